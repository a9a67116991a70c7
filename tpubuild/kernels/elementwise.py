"""Elementwise kernels: binary ops with broadcasting, activations, clip."""

from __future__ import annotations

import numpy as np

from tpubuild.ir import top
from tpubuild.kernels.activation import fused, relu
from tpubuild.kernels.registry import kernel


@kernel(top.AddOp)
def _(p, a, b):
    return fused(np.add(a, b), p)


@kernel(top.SubOp)
def _(p, a, b):
    return np.subtract(a, b)


@kernel(top.MulOp)
def _(p, a, b):
    return fused(np.multiply(a, b), p)


@kernel(top.DivOp)
def _(p, a, b):
    if np.issubdtype(np.result_type(a, b), np.integer):
        return np.trunc(np.divide(a, b)).astype(np.result_type(a, b))  # ONNX integer Div truncates
    return np.divide(a, b)


@kernel(top.ReluOp)
def _(p, x):
    return relu(x, p.relu_limit)


def sigmoid(x: np.ndarray) -> np.ndarray:
    # split by sign so exp never overflows
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype)


@kernel(top.SigmoidOp)
def _(p, x):
    return sigmoid(x)


@kernel(top.SiLUOp)
def _(p, x):
    return x * sigmoid(x)


@kernel(top.TanhOp)
def _(p, x):
    return np.tanh(x)


@kernel(top.ClipOp)
def _(p, x):
    return np.clip(x, np.asarray(p.min, x.dtype) if np.isfinite(p.min) else None,
                   np.asarray(p.max, x.dtype) if np.isfinite(p.max) else None)
