"""Reductions over axes, and arg max/min."""

from __future__ import annotations

import numpy as np

from tpubuild.ir import top
from tpubuild.kernels.registry import kernel


def _log_sum_exp(x, axis, keepdims):
    m = np.max(x, axis=axis, keepdims=True, initial=-np.inf)
    m = np.where(np.isfinite(m), m, 0)  # all -inf (or inf) along an axis: let exp/log give the answer
    out = np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True)) + m
    return out if keepdims else np.squeeze(out, axis=axis)


def _extreme(fn, pick):
    """max/min that give the identity (lowest/highest value) over an empty set, as ONNX 18 says."""

    def run(x, axis, keepdims):
        if x.dtype == np.bool_:
            initial = pick == "min"  # max over nothing is False, min is True
        elif x.dtype.kind in "iu":
            info = np.iinfo(x.dtype)
            initial = info.min if pick == "max" else info.max
        else:  # numpy floats and ml_dtypes' (bfloat16 is kind 'V')
            initial = -np.inf if pick == "max" else np.inf
        return fn(x, axis=axis, keepdims=keepdims, initial=initial)

    return run


_REDUCE = {
    "ReduceMean": np.mean,
    "ReduceSum": np.sum,
    "ReduceMax": _extreme(np.max, "max"),
    "ReduceMin": _extreme(np.min, "min"),
    "ReduceProd": np.prod,
    "ReduceL1": lambda x, axis, keepdims: np.sum(np.abs(x), axis=axis, keepdims=keepdims),
    "ReduceL2": lambda x, axis, keepdims: np.sqrt(np.sum(np.square(x), axis=axis, keepdims=keepdims)),
    "ReduceSumSquare": lambda x, axis, keepdims: np.sum(np.square(x), axis=axis, keepdims=keepdims),
    "ReduceLogSum": lambda x, axis, keepdims: np.log(np.sum(x, axis=axis, keepdims=keepdims)),
    "ReduceLogSumExp": _log_sum_exp,
}


@kernel(top.ReduceOp)
def _(p: top.ReduceParams, x):
    with np.errstate(divide="ignore", invalid="ignore"):
        y = _REDUCE[p.mode](x, axis=p.axes, keepdims=p.keepdims)
    if np.issubdtype(x.dtype, np.integer) and p.mode == "ReduceMean":
        y = np.trunc(y)  # integer mean divides as C does
    return np.asarray(y).astype(x.dtype, copy=False)


@kernel(top.ArgOp)
def _(p: top.ArgParams, x):
    pick = np.argmax if p.mode == "ArgMax" else np.argmin
    if p.select_last_index:
        last = x.shape[p.axis] - 1
        idx = last - pick(np.flip(x, axis=p.axis), axis=p.axis, keepdims=p.keepdims)
    else:
        idx = pick(x, axis=p.axis, keepdims=p.keepdims)
    return idx.astype(np.int64)
