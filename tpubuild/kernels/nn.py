"""Neural-network kernels: conv, matmul, pooling, normalisation, softmax."""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tpubuild.ir import top
from tpubuild.kernels.activation import fused
from tpubuild.kernels.registry import kernel


def windows(x: np.ndarray, kernel_shape, strides, dilations, pads_begin, pads_end, fill=0.0) -> np.ndarray:
    """View of x as [..., *out_spatial, *kernel] windows over its last len(kernel_shape) dims."""
    nd = len(kernel_shape)
    lead = [(0, 0)] * (x.ndim - nd)
    xp = np.pad(x, lead + list(zip(pads_begin, pads_end)), constant_values=fill)
    span = [(k - 1) * d + 1 for k, d in zip(kernel_shape, dilations)]
    axes = tuple(range(x.ndim - nd, x.ndim))
    win = sliding_window_view(xp, span, axis=axes)
    # sliding_window_view appends the window dims: [..., *out_full, *span]; stride the
    # output dims and step through each window by its dilation
    index = ((slice(None),) * (x.ndim - nd) + tuple(slice(None, None, s) for s in strides)
             + tuple(slice(None, None, d) for d in dilations))
    return win[index]


@kernel(top.ConvOp)
def _(p: top.ConvParams, x, w, b):
    nd = len(p.kernel_shape)
    n, c = x.shape[:2]
    oc, g = w.shape[0], p.group
    win = windows(x, p.kernel_shape, p.strides, p.dilations, p.pads[:nd], p.pads[nd:])
    out_sp = win.shape[2:2 + nd]
    k = math.prod(p.kernel_shape)
    win = win.reshape(n, g, c // g, math.prod(out_sp), k)
    cols = np.ascontiguousarray(np.moveaxis(win, 2, 3)).reshape(n, g, math.prod(out_sp), (c // g) * k)
    wm = w.reshape(g, oc // g, (c // g) * k)
    y = np.matmul(cols, np.swapaxes(wm, 1, 2)[None])  # n, g, P, oc/g
    y = np.swapaxes(y, 2, 3).reshape(n, oc, *out_sp)
    if b is not None:
        y = y + b.reshape((1, oc) + (1,) * nd)
    return fused(y.astype(x.dtype, copy=False), p)


@kernel(top.MatMulOp)
def _(p, a, b, bias):
    y = np.matmul(a, b)
    if bias is not None:
        y = y + bias
    return fused(y, p)


def _pool_pads(p: top.PoolParams, spatial) -> tuple[list[int], list[int]]:
    """Begin/end pads, the end grown so ceil_mode's last partial window exists."""
    nd = len(p.kernel_shape)
    dil = p.dilations or (1,) * nd
    begin, end = list(p.pads[:nd]), list(p.pads[nd:])
    for i in range(nd):
        out = top.pooled_size(spatial[i], p.kernel_shape[i], p.strides[i], begin[i], end[i], dil[i], p.ceil_mode)
        need = (out - 1) * p.strides[i] + (p.kernel_shape[i] - 1) * dil[i] + 1
        end[i] = max(end[i], need - spatial[i] - begin[i])
    return begin, end


@kernel(top.MaxPoolOp)
def _(p: top.PoolParams, x):
    nd = len(p.kernel_shape)
    begin, end = _pool_pads(p, x.shape[-nd:])
    # padding never wins: the lowest value of the dtype (-inf cannot pad an int8 tensor)
    lowest = np.iinfo(x.dtype).min if x.dtype.kind in "iu" else -np.inf
    win = windows(x, p.kernel_shape, p.strides, p.dilations or (1,) * nd, begin, end, fill=lowest)
    return fused(win.max(axis=tuple(range(-nd, 0))), p)


@kernel(top.MaxPoolWithMaskOp)
def _(p: top.MaskPoolParams, x):
    nd = len(p.kernel_shape)
    spatial = x.shape[-nd:]
    begin, end = _pool_pads(p, spatial)
    lowest = np.iinfo(x.dtype).min if x.dtype.kind in "iu" else -np.inf
    dil = p.dilations or (1,) * nd
    win = windows(x, p.kernel_shape, p.strides, dil, begin, end, fill=lowest)
    flat = win.reshape(win.shape[:-nd] + (-1,))
    # the first maximum in window order, as onnxruntime; padding never wins (it is lowest, or out of range)
    pos = windows(np.arange(math.prod(spatial)).reshape(spatial), p.kernel_shape, p.strides, dil, begin, end,
                  fill=-1)
    pos = np.broadcast_to(pos.reshape(pos.shape[:nd] + (-1,)), flat.shape)
    best = np.where(pos >= 0, flat, lowest).max(axis=-1, keepdims=True)
    pick = np.argmax((flat == best) & (pos >= 0), axis=-1)[..., None]  # argmax: the first True
    y = np.take_along_axis(flat, pick, axis=-1)[..., 0]
    where = np.take_along_axis(pos, pick, axis=-1)[..., 0]
    if p.storage_order:  # column-major: the first spatial dim varies fastest
        coords = np.unravel_index(where, spatial)
        where = np.ravel_multi_index(coords, spatial, order="F")
    plane = math.prod(spatial)
    lead = np.arange(math.prod(x.shape[:-nd])).reshape(x.shape[:-nd] + (1,) * nd) * plane
    return fused(y, p), (where + lead).astype(np.int64)


@kernel(top.AvgPoolOp)
def _(p: top.PoolParams, x):
    nd = len(p.kernel_shape)
    dil = p.dilations or (1,) * nd
    spatial = x.shape[-nd:]
    begin, end = _pool_pads(p, spatial)
    axes = tuple(range(-nd, 0))
    total = windows(x, p.kernel_shape, p.strides, dil, begin, end).sum(axis=axes, dtype=np.float64)
    # the divisor counts real elements, plus the declared pads when count_include_pad (never ceil's extra)
    ones = np.ones(spatial, np.float64)
    if p.count_include_pad:
        ones = np.pad(ones, list(zip(p.pads[:nd], p.pads[nd:])), constant_values=1.0)
        begin = [b - pb for b, pb in zip(begin, p.pads[:nd])]
        end = [e - pe for e, pe in zip(end, p.pads[nd:])]
    count = windows(ones, p.kernel_shape, p.strides, dil, begin, end).sum(axis=axes)
    return fused((total / count).astype(x.dtype), p)


@kernel(top.SoftmaxOp)
def _(p: top.SoftmaxParams, x):
    if p.beta != 1.0:
        x = x * np.asarray(p.beta, x.dtype)
    shifted = x - x.max(axis=p.axis, keepdims=True)
    e = np.exp(shifted)
    if p.log:
        return shifted - np.log(e.sum(axis=p.axis, keepdims=True))
    return e / e.sum(axis=p.axis, keepdims=True)


@kernel(top.LayerNormOp)
def _(p: top.LayerNormParams, x, scale, bias):
    axes = tuple(range(p.axis % x.ndim, x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    d = x - mean
    var = (d * d).mean(axis=axes, keepdims=True)
    rstd = 1 / np.sqrt(var + np.asarray(p.eps, x.dtype))
    y = d * rstd
    if scale is not None:
        y = y * scale
    if bias is not None:
        y = y + bias
    y = y.astype(x.dtype, copy=False)
    return (y, mean, rstd) if p.stats else y


@kernel(top.BatchNormOp)
def _(p: top.EpsParams, x, mean, var, scale, bias):
    shape = (1, -1) + (1,) * (x.ndim - 2)
    inv = scale / np.sqrt(var + np.asarray(p.eps, var.dtype))
    return (x * inv.reshape(shape) + (bias - mean * inv).reshape(shape)).astype(x.dtype, copy=False)
