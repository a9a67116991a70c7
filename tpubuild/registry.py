"""One registry idiom for every table of functions filled by decorators.

Kernels per op class, lowering rules, cost formulas, calibration methods,
prepare steps: each is a ``Registry`` (a dict) whose ``register`` decorator
adds a function under one or more keys. Registering a key twice is a
programming error, raised at import time.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def _label(key: Hashable) -> str:
    name = getattr(key, "name", None)  # op classes name themselves, e.g. "top.Conv"
    return name if isinstance(name, str) else repr(key)


class Registry(dict):
    """key -> function; ``what`` names an entry in error messages (e.g. "a kernel")."""

    def __init__(self, what: str):
        super().__init__()
        self.what = what

    def register(self, *keys: Hashable) -> Callable[[F], F]:
        def add(fn: F) -> F:
            for key in keys:
                if key in self:
                    raise ValueError(f"{self.what} for {_label(key)} is already registered")
                self[key] = fn
            return fn

        return add
