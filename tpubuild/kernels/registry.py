"""The kernel registry: one numpy function per op class.

A kernel takes the op's parsed parameters and its operand arrays (``None`` for
an absent optional operand) and returns an array, or a tuple for several
results. Registering one op class twice is a programming error.
"""

from __future__ import annotations

from collections.abc import Callable

_KERNELS: dict[type, Callable] = {}


class KernelError(Exception):
    """A kernel met inputs it cannot compute (raised with the op's location by the interpreter)."""


def kernel(*op_classes: type) -> Callable[[Callable], Callable]:
    def register(fn: Callable) -> Callable:
        for cls in op_classes:
            if cls in _KERNELS:
                raise ValueError(f"a kernel for {cls.name} is already registered")
            _KERNELS[cls] = fn
        return fn
    return register


def get_kernel(op_class: type) -> Callable:
    from tpubuild.kernels import load_all
    load_all()
    try:
        return _KERNELS[op_class]
    except KeyError:
        raise NotImplementedError(f"no reference kernel for {op_class.name}") from None
