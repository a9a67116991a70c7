"""Instance, group, RMS and local response normalisation."""

from __future__ import annotations

import numpy as np

from tpubuild.ir import top
from tpubuild.kernels.registry import kernel


def _channel_affine(y, weight, bias):
    shape = (1, -1) + (1,) * (y.ndim - 2)
    if weight is not None:
        y = y * weight.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    return y


def _normalise(x, axes, eps):
    mean = x.mean(axis=axes, keepdims=True)
    d = x - mean
    var = (d * d).mean(axis=axes, keepdims=True)
    return d / np.sqrt(var + np.asarray(eps, x.dtype))


@kernel(top.InstanceNormOp)
def _(p: top.EpsParams, x, weight, bias):
    y = _normalise(x, tuple(range(2, x.ndim)), p.eps)
    return _channel_affine(y, weight, bias).astype(x.dtype, copy=False)


@kernel(top.GroupNormOp)
def _(p: top.GroupNormParams, x, weight, bias):
    n, c = x.shape[:2]
    grouped = x.reshape(n, p.num_groups, -1)
    y = _normalise(grouped, (2,), p.eps).reshape(x.shape)
    return _channel_affine(y, weight, bias).astype(x.dtype, copy=False)


@kernel(top.LRNOp)
def _(p: top.LRNParams, x):
    # sum of squares over channels c - floor((size-1)/2) .. c + ceil((size-1)/2), clipped to the tensor
    before, after = (p.size - 1) // 2, p.size - 1 - (p.size - 1) // 2
    sq = np.square(x.astype(np.float64))
    pad = [(0, 0), (before + 1, after)] + [(0, 0)] * (x.ndim - 2)
    csum = np.cumsum(np.pad(sq, pad), axis=1)
    c = x.shape[1]
    window = csum[:, p.size : p.size + c] - csum[:, :c]
    scale = (p.bias + p.alpha / p.size * window) ** p.beta
    return (x / scale).astype(x.dtype)


@kernel(top.RMSNormOp)
def _(p: top.RMSNormParams, x, gamma):
    axes = tuple(range(p.axis % x.ndim, x.ndim))
    ms = np.mean(np.square(x), axis=axes, keepdims=True)
    y = x / np.sqrt(ms + np.asarray(p.eps, x.dtype))
    if gamma is not None:
        y = y * gamma
    return y.astype(x.dtype, copy=False)
