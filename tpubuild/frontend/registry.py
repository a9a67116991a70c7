"""Converters from ONNX nodes to TOP ops, registered per (domain, op_type, since_version).

A converter is registered at the opset where its meaning begins; a model is
served by the highest registration at or below its opset (tinygrad's rule:
versions only where the meaning changed). Registering the same key twice is a
programming error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from tpubuild.registry import Registry


class OpKey(NamedTuple):
    domain: str
    op_type: str
    since_version: int


_CONVERTERS = Registry("a converter")


def converter(op_type: str, since: int = 1, domain: str = "") -> Callable[[Callable], Callable]:
    """Register ``fn(node, ctx) -> list of outputs`` for ``op_type`` from opset ``since`` on."""
    return _CONVERTERS.register(OpKey(domain, op_type, since))


def _load() -> None:
    from tpubuild.frontend import ops  # noqa: F401  (registers every converter)


def find(op_type: str, opset: int, domain: str = "") -> Callable | None:
    _load()
    best = None
    for key, fn in _CONVERTERS.items():
        fits = key.domain == domain and key.op_type == op_type and key.since_version <= opset
        if fits and (best is None or key.since_version > best[0]):
            best = (key.since_version, fn)
    return best[1] if best else None


def supported() -> dict[tuple[str, str], list[int]]:
    """(domain, op_type) -> the opsets where a converter's meaning starts, ascending."""
    _load()
    table: dict[tuple[str, str], list[int]] = {}
    for key in _CONVERTERS:
        table.setdefault((key.domain, key.op_type), []).append(key.since_version)
    return {k: sorted(v) for k, v in sorted(table.items())}
