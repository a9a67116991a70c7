"""Interp (ONNX Resize/Upsample): separable nearest, linear and cubic resampling, one axis at a time;
GridSample: the same interpolations at the coordinates a grid gives.

Source coordinates follow ONNX Resize: each output index maps to a real input
coordinate by the coordinate transformation mode, the interpolation weights
come from that coordinate's fraction, and neighbours outside the input are
clamped to the edge (``exclude_outside`` drops them and renormalises instead).
Arithmetic is float64, as onnx's reference, then cast back.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from tpubuild.ir import top
from tpubuild.kernels.registry import kernel


def _half_pixel_symmetric(x, scale, in_len, out_len):
    adjustment = out_len / (scale * in_len)
    return in_len / 2 * (1 - adjustment) + (x + 0.5) / scale - 0.5


def _one(s: float, n: int) -> bool:
    """Is the resized length (scale x input, as onnx's reference takes it) 1? (1/49 * 49 is not exactly 1.)"""
    return math.isclose(s * n, 1.0, rel_tol=1e-9)


# mode -> fn(output indices, scale, input length, output length) -> source coordinates
_COORDS = {
    "half_pixel": lambda x, s, n, m: (x + 0.5) / s - 0.5,
    "half_pixel_symmetric": _half_pixel_symmetric,
    "pytorch_half_pixel": lambda x, s, n, m: np.full_like(x, -0.5) if _one(s, n) else (x + 0.5) / s - 0.5,
    "align_corners": lambda x, s, n, m: np.zeros_like(x) if _one(s, n) else x * (n - 1) / (s * n - 1),
    "asymmetric": lambda x, s, n, m: x / s,
    "tf_half_pixel_for_nn": lambda x, s, n, m: (x + 0.5) / s,
}

# nearest_mode -> offset from the left neighbour given the fraction in (0, 1]
_NEAREST = {
    "round_prefer_floor": lambda r: (r > 0.5).astype(np.int64),
    "round_prefer_ceil": lambda r: (r >= 0.5).astype(np.int64),
    "floor": lambda r: (r == 1.0).astype(np.int64),
    "ceil": lambda r: np.ones_like(r, dtype=np.int64),
}


def _cubic(d: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic convolution kernel at distances d."""
    d = np.abs(d)
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return np.where(d <= 1, near, np.where(d < 2, far, 0.0))


def _taps(frac: np.ndarray, p: top.InterpParams, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Neighbour offsets from the left neighbour, and their weights, per output position.

    Antialiased downsampling stretches the linear/cubic kernel by 1/scale, so more
    neighbours contribute, and the weights are renormalised (as onnx's reference).
    """
    s = min(scale, 1.0) if p.antialias else 1.0
    if p.mode == "nearest":
        return _NEAREST[p.nearest_mode](frac)[:, None], np.ones((len(frac), 1))
    if p.mode == "linear":
        start = math.floor(-1 / s) + 1
        offsets = np.arange(start, 2 - start)
        weights = np.clip(1 - np.abs((offsets - frac[:, None]) * s), 0, 1)
    else:
        start = math.floor(-2 / s) + 1
        offsets = np.arange(start, 2 - start)
        weights = _cubic((offsets - frac[:, None]) * s, p.cubic_coeff_a)
    if p.antialias:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return np.broadcast_to(offsets, weights.shape), weights


def _resample_axis(x: np.ndarray, axis: int, out_len: int, p: top.InterpParams) -> np.ndarray:
    idx, weights, outside = axis_taps(x.shape[axis], axis, out_len, p)
    return _apply_taps(x, axis, idx, weights, outside, p)


def axis_taps(in_len: int, axis: int, out_len: int, p: top.InterpParams):
    """(source indices [out, taps] clamped to the input, their weights, the outputs outside the roi or None)."""
    scale = p.scales[axis]
    outside = None
    if p.coord_mode == "tf_crop_and_resize":
        rank = len(p.scales)
        start, end = p.roi[axis], p.roi[rank + axis]
        full = scale * in_len
        src = (
            np.full(out_len, (end - start) * (in_len - 1) / 2)
            if _one(scale, in_len)
            else np.arange(out_len) * (end - start) * (in_len - 1) / (full - 1)
        )
        src = src + start * (in_len - 1)
        outside = (src < 0) | (src > in_len - 1)
    else:
        src = _COORDS[p.coord_mode](np.arange(out_len, dtype=np.float64), scale, in_len, out_len)
    # the left neighbour, chosen so the fraction lies in (0, 1] (an integer coordinate is its own right one)
    left = np.ceil(src).astype(np.int64) - 1
    frac = src - left
    offsets, weights = _taps(frac, p, scale)
    idx = left[:, None] + offsets
    if p.exclude_outside:
        weights = np.where((idx < 0) | (idx >= in_len), 0.0, weights)
        total = weights.sum(axis=-1, keepdims=True)
        weights = weights / np.where(total == 0, 1.0, total)
    return np.clip(idx, 0, in_len - 1), weights, outside


def _apply_taps(x: np.ndarray, axis: int, idx: np.ndarray, weights: np.ndarray, outside, p: top.InterpParams):
    out_len = idx.shape[0]
    gathered = np.take(x, idx, axis=axis)  # [..., out, taps, ...]
    shape = (1,) * axis + weights.shape + (1,) * (x.ndim - axis - 1)
    y = (gathered * weights.reshape(shape)).sum(axis=axis + 1)
    if outside is not None and outside.any():
        mask = outside.reshape((1,) * axis + (out_len,) + (1,) * (x.ndim - axis - 1))
        y = np.where(mask, p.extrapolation_value, y)
    return y


def resampled(p: top.InterpParams, shape: tuple[int, ...]) -> list[int]:
    """The axes the resize changes (in order; the others are copied as they are)."""
    axes = []
    for axis, out_len in enumerate(p.shape):
        identity = math.isclose(p.scales[axis], 1.0) and out_len == shape[axis]
        if p.roi:
            rank = len(p.scales)
            identity = identity and p.roi[axis] == 0.0 and p.roi[rank + axis] == 1.0
        if not identity:
            axes.append(axis)
    return axes


@kernel(top.InterpOp)
def _(p: top.InterpParams, x):
    y = x.astype(np.float64)
    for axis in resampled(p, x.shape):
        y = _resample_axis(y, axis, p.shape[axis], p)
    if x.dtype.kind in "iu":
        y = np.rint(y)
    return y.astype(x.dtype)


def _reflect(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Coordinates outside [lo, hi] reflected by the near border until inside (onnx's _gs_reflect)."""
    span = hi - lo
    if span <= 0:
        return np.full_like(x, lo)
    below, above = x < lo, x > hi
    dx = np.where(below, lo - x, x - hi)
    n = np.trunc(dx / span)
    r = dx - n * span
    even = n % 2 == 0
    inside_from_lo, inside_from_hi = np.where(even, lo + r, hi - r), np.where(even, hi - r, lo + r)
    return np.where(below, inside_from_lo, np.where(above, inside_from_hi, x))


def _cubic_weights(t: np.ndarray) -> list[np.ndarray]:
    """Keys' cubic convolution (a = -0.75) for the taps at -1, 0, 1, 2 from a fraction ``t`` in [0, 1)."""
    a = -0.75

    def near(d):  # |d| <= 1
        return ((a + 2) * d - (a + 3)) * d * d + 1

    def far(d):  # 1 < |d| < 2
        return ((a * d - 5 * a) * d + 8 * a) * d - 4 * a

    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


@kernel(top.GridSampleOp)
def _(p: top.GridSampleParams, x, grid):
    """As onnxruntime (and PyTorch's grid_sample): the grid's coordinates (x first: the last axis) denormalised
    to pixel positions, one outside the borders clamped (border) or reflected (reflection) first, then every
    tap outside the input is 0 (zeros), the edge pixel (border) or its reflection. Cubic with border padding
    clamps its taps only, not the position (onnx's reference clamps both, onnxruntime and PyTorch do not).
    Arithmetic in float64, then cast back."""
    n, c, *size = x.shape
    g = grid.astype(np.float64)
    taps_per_axis = []
    for axis, length in enumerate(size):
        norm = g[..., len(size) - 1 - axis]
        lo, hi = (0.0, length - 1.0) if p.align_corners else (-0.5, length - 0.5)
        pos = (norm + 1) / 2 * (length - 1) if p.align_corners else ((norm + 1) * length - 1) / 2
        if p.mode == "nearest":
            pos = np.rint(pos)
        if p.padding_mode == "border" and p.mode != "cubic":
            pos = np.where((pos < lo) | (pos > hi), np.clip(pos, 0, length - 1), pos)
        elif p.padding_mode == "reflection":
            pos = _reflect(pos, lo, hi)
        taps_per_axis.append(_grid_taps(p, pos, length, lo, hi))
    batch = np.arange(n).reshape((n,) + (1,) * (grid.ndim - 2))
    data = x.astype(np.float64)
    out = np.zeros((n, *grid.shape[1:-1], c))
    for combo in itertools.product(*taps_per_axis):
        weight = np.prod([wk for _, wk in combo], axis=0)
        out += data[(batch, slice(None), *(index for index, _ in combo))] * weight[..., None]  # [N, *out, C]
    y = np.moveaxis(out, -1, 1)
    if x.dtype.kind in "iu":
        y = np.rint(y)
    return y.astype(x.dtype)


def _grid_taps(p: top.GridSampleParams, pos: np.ndarray, length: int, lo: float, hi: float):
    """(index, weight) per tap along one axis: the weight is 0 where a zeros-padded tap falls outside."""
    if p.mode == "nearest":
        firsts, weights = [pos], [np.ones_like(pos)]
    else:
        first = np.floor(pos)
        t = pos - first
        firsts = [first, first + 1] if p.mode == "linear" else [first + k for k in (-1, 0, 1, 2)]
        weights = [1 - t, t] if p.mode == "linear" else _cubic_weights(t)
    out = []
    for index, weight in zip(firsts, weights, strict=True):
        index = np.nan_to_num(index, nan=-1.0)  # a NaN grid point reads outside (no integer index is NaN)
        if p.padding_mode == "zeros":
            weight = np.where((index >= 0) & (index < length), weight, 0.0)
        elif p.padding_mode == "reflection":
            index = np.trunc(_reflect(index, lo, hi))
        out.append((np.clip(index, 0, length - 1).astype(np.int64), weight))
    return out
