"""Layout and indexing kernels: expand, tile, gather/scatter, split, slice, pad, depth2space, trilu, cumsum,
topk, einsum."""

from __future__ import annotations

from typing import Literal

import numpy as np

from tpubuild.ir import top
from tpubuild.kernels.registry import KernelError, kernel


@kernel(top.ExpandOp)
def _(p: top.ShapeParams, x):
    return np.broadcast_to(x, np.broadcast_shapes(x.shape, p.shape)).copy()


@kernel(top.TileOp)
def _(p: top.TileParams, x):
    return np.tile(x, p.tile)


def _checked_indices(indices: np.ndarray, size: int, what: str) -> np.ndarray:
    idx = indices.astype(np.int64, copy=False)
    if idx.size and (idx.min() < -size or idx.max() >= size):
        raise KernelError(f"{what} index out of range [{-size}, {size})")
    return np.where(idx < 0, idx + size, idx)


@kernel(top.GatherOp)
def _(p: top.AxisParams, x, indices):
    axis = p.axis % x.ndim
    return np.take(x, _checked_indices(indices, x.shape[axis], "Gather"), axis=axis)


@kernel(top.GatherElementsOp)
def _(p: top.AxisParams, x, indices):
    axis = p.axis % x.ndim
    return np.take_along_axis(x, _checked_indices(indices, x.shape[axis], "GatherElements"), axis=axis)


@kernel(top.GatherNDOp)
def _(p: top.GatherNDParams, x, indices):
    b = p.batch_dims
    depth = indices.shape[-1]
    batch = int(np.prod(x.shape[:b], dtype=np.int64))
    data = x.reshape((batch,) + x.shape[b:])
    idx = indices.reshape(batch, -1, depth).astype(np.int64)
    coords = [_checked_indices(idx[..., k], data.shape[1 + k], "GatherND") for k in range(depth)]
    picked = data[(np.arange(batch)[:, None], *coords)]  # [batch, n, rest...]
    return picked.reshape(indices.shape[:-1] + x.shape[b + depth :])


_SCATTER_UFUNC = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


def _scatter(x, where: tuple, updates, reduction: str):
    out = x.copy()
    if reduction == "none":
        out[where] = updates
    else:  # ufunc.at is unbuffered: repeated indices all contribute
        _SCATTER_UFUNC[reduction].at(out, where, updates)
    return out


@kernel(top.ScatterElementsOp)
def _(p: top.ScatterParams, x, indices, updates):
    axis = p.axis % x.ndim
    where = list(np.indices(indices.shape, sparse=True))
    where[axis] = _checked_indices(indices, x.shape[axis], "ScatterElements")
    return _scatter(x, tuple(where), updates, p.reduction)


@kernel(top.ScatterNDOp)
def _(p: top.ScatterParams, x, indices, updates):
    depth = indices.shape[-1]
    where = tuple(_checked_indices(indices[..., k], x.shape[k], "ScatterND") for k in range(depth))
    return _scatter(x, where, updates, p.reduction)


@kernel(top.TriluOp)
def _(p: top.TriluParams, x):
    return np.triu(x, p.diagonal) if p.upper else np.tril(x, p.diagonal)


@kernel(top.CumSumOp)
def _(p: top.CumSumParams, x):
    axis = p.axis % x.ndim
    y = np.flip(x, axis) if p.reverse else x
    total = np.cumsum(y, axis=axis, dtype=x.dtype)
    if p.exclusive:  # shift by one along the axis, a zero first (no subtraction: exact for floats)
        zero = np.zeros_like(np.take(total, [0], axis=axis))
        total = np.concatenate([zero, np.take(total, np.arange(x.shape[axis] - 1), axis=axis)], axis=axis)
    return np.flip(total, axis) if p.reverse else total


@kernel(top.SplitOp)
def _(p: top.SplitParams, x):
    cuts = np.cumsum(p.split_size)[:-1]
    return tuple(np.split(x, cuts, axis=p.axis % x.ndim))


@kernel(top.SliceOp)
def _(p: top.SliceParams, x):
    index = tuple(
        slice(start, None if stop < 0 else stop, step)
        for start, stop, step in zip(p.offset, p.ends, p.steps, strict=True)
    )
    return x[index].copy()


_PAD_MODES: dict[str, Literal["constant", "reflect", "edge", "wrap"]] = {
    "constant": "constant",
    "reflect": "reflect",
    "edge": "edge",
    "wrap": "wrap",
}


@kernel(top.PadOp)
def _(p: top.PadParams, x):
    nd = x.ndim
    begins, ends = p.paddings[:nd], p.paddings[nd:]
    # negative pads crop first; the remaining (non-negative) pads then pad what is left
    crop = tuple(slice(max(-b, 0), x.shape[i] - max(-e, 0)) for i, (b, e) in enumerate(zip(begins, ends, strict=True)))
    x = x[crop]
    widths = [(max(b, 0), max(e, 0)) for b, e in zip(begins, ends, strict=True)]
    if p.mode == "constant":
        return np.pad(x, widths, mode="constant", constant_values=np.asarray(p.val).astype(x.dtype))
    return np.pad(x, widths, mode=_PAD_MODES[p.mode])


@kernel(top.Depth2SpaceOp)
def _(p: top.Depth2SpaceParams, x):
    n, c, h, w = x.shape
    bh, bw = p.block_h, p.block_w
    if p.is_inversed:
        y = x.reshape(n, c, h // bh, bh, w // bw, bw).transpose((0, 1, 3, 5, 2, 4) if p.is_CRD else (0, 3, 5, 1, 2, 4))
        return y.reshape(n, c * bh * bw, h // bh, w // bw)
    oc = c // (bh * bw)
    if p.is_CRD:
        y = x.reshape(n, oc, bh, bw, h, w).transpose(0, 1, 4, 2, 5, 3)
    else:
        y = x.reshape(n, bh, bw, oc, h, w).transpose(0, 3, 4, 1, 5, 2)
    return y.reshape(n, oc, h * bh, w * bw)


@kernel(top.EinsumOp)
def _(p: top.EinsumParams, *xs):
    if any(x.dtype.kind == "V" for x in xs):  # ml_dtypes' bfloat16 etc.: numpy's einsum has no loops for them
        return np.einsum(p.mode, *[x.astype(np.float32) for x in xs]).astype(xs[0].dtype)
    return np.einsum(p.mode, *xs)


@kernel(top.TopKOp)
def _(p: top.TopKParams, x):
    axis = p.axis % x.ndim
    # a stable sort keeps equal values in index order, as ONNX asks; NaN sorts as the largest
    if p.largest:
        # a descending key that cannot overflow: -x for floats, ~x (= -x - 1) for signed, max - x for unsigned
        if x.dtype.kind == "f":
            key = -x
        elif x.dtype.kind == "i":
            key = ~x
        else:
            key = np.iinfo(np.uint64).max - x.astype(np.uint64)
        order = np.argsort(key, axis=axis, kind="stable")
        if x.dtype.kind == "f":  # -NaN is still NaN and sorts last; ONNX puts NaN first for largest
            nan_first = np.argsort(~np.isnan(np.take_along_axis(x, order, axis)), axis=axis, kind="stable")
            order = np.take_along_axis(order, nan_first, axis)
    else:
        order = np.argsort(x, axis=axis, kind="stable")
    idx = np.take(order, np.arange(p.K), axis=axis)
    return np.take_along_axis(x, idx, axis=axis), idx.astype(np.int64)
