"""Helpers converters share: pads from auto_pad, axis normalisation, names of multi-result ops."""

from __future__ import annotations

import math
from collections.abc import Sequence


def resolve_pads(
    attrs: dict, spatial: Sequence[int], kernel: Sequence[int], strides: Sequence[int], dilations: Sequence[int]
) -> list[int]:
    """Explicit ONNX pads [begins..., ends...] for any auto_pad mode."""
    nd = len(kernel)
    mode = attrs.get("auto_pad", "NOTSET")
    if mode in ("NOTSET", ""):
        pads = attrs.get("pads")
        return list(pads) if pads else [0] * (2 * nd)
    if mode == "VALID":
        return [0] * (2 * nd)
    begins, ends = [], []
    for size, k, s, d in zip(spatial, kernel, strides, dilations, strict=True):
        out = math.ceil(size / s)
        total = max((out - 1) * s + (k - 1) * d + 1 - size, 0)
        small, large = total // 2, total - total // 2
        begins.append(small if mode == "SAME_UPPER" else large)
        ends.append(large if mode == "SAME_UPPER" else small)
    return begins + ends


def result_names(outputs: Sequence[str], count: int) -> list[str]:
    """A tensor name per result of a multi-result op; results the model leaves unused (empty ONNX
    names) are named after the node's first used output, which is unique in the graph."""
    first = next((o for o in outputs if o), "unused")
    padded = list(outputs) + [""] * (count - len(outputs))
    return [o or f"{first}_out{i}" for i, o in enumerate(padded[:count])]


def norm_axis(axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise ValueError(f"axis {axis} is out of range for rank {rank}")
    return axis % rank
