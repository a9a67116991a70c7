"""Reshape, Split, Gather and Interp prepared for fixed operand shapes (reference inference's plans).

What the kernels recompute on every call from the parameters alone (a split's cut
points, a constant Gather's checked indices, a resize's source indices and weights)
is made once; the run does the kernel's own numpy work, so the bits are the kernel's.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tpubuild.ir import top
from tpubuild.kernels import layout, resize
from tpubuild.kernels.registry import KernelError, Operand, prepared


@prepared(top.ReshapeOp)
def _(p: top.ShapeParams, operands: list[Operand]) -> Callable | None:
    shape = p.shape
    return lambda x: x.reshape(shape)


@prepared(top.SplitOp)
def _(p: top.SplitParams, operands: list[Operand]) -> Callable | None:
    (x,) = operands
    axis = p.axis % len(x.dims)
    cuts = [int(c) for c in np.cumsum(p.split_size)[:-1]]
    # np.split's views: the last piece runs to the end
    pieces = [(slice(None),) * axis + (slice(a, b),) for a, b in zip([0] + cuts, cuts + [None], strict=True)]
    return lambda x: tuple(x[piece] for piece in pieces)


@prepared(top.GatherOp)
def _(p: top.AxisParams, operands: list[Operand]) -> Callable | None:
    x, indices = operands
    if indices.const is None:
        return None
    axis = p.axis % len(x.dims)
    try:
        idx = layout._checked_indices(indices.const, x.dims[axis], "Gather")
    except KernelError:
        return None  # the kernel fails the run, with the op's location
    return lambda x, indices: np.take(x, idx, axis=axis)


def _nearest(y: np.ndarray, axis: int, idx: np.ndarray) -> np.ndarray:
    """resize's one-tap resampling: a gathered value times 1.0 is itself, and its sum alone is it plus zero
    (-0 becomes +0)."""
    gathered = np.take(y, idx, axis=axis)
    gathered += 0.0
    return gathered


@prepared(top.InterpOp)
def _(p: top.InterpParams, operands: list[Operand]) -> Callable | None:
    (x,) = operands
    if x.dtype is None or x.dtype.kind != "f":
        return None
    steps = []
    for axis in resize.resampled(p, x.dims):
        idx, weights, outside = resize.axis_taps(x.dims[axis], axis, p.shape[axis], p)
        if idx.shape[1] == 1 and outside is None and np.all(weights == 1.0):
            steps.append(lambda y, axis=axis, idx=idx[:, 0]: _nearest(y, axis, idx))
        else:
            steps.append(
                lambda y, axis=axis, idx=idx, weights=weights, outside=outside: resize._apply_taps(
                    y, axis, idx, weights, outside, p
                )
            )

    def run(x):
        y = x.astype(np.float64)
        for step in steps:
            y = step(y)
        return y.astype(x.dtype)

    return run
