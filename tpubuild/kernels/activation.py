"""Fused activations that compute ops carry (do_relu / relu_limit, as TPU-MLIR)."""

import numpy as np


try:
    from numpy._core import umath

    # np.clip's ufunc: the same, without the wrapper's 2 us a call (numpy's stubs do not list it)
    clip = umath.clip  # pyright: ignore[reportAttributeAccessIssue]
except (ImportError, AttributeError):  # another numpy's layout
    clip = np.clip


def relu(y: np.ndarray, limit: float = -1.0, out: np.ndarray | None = None) -> np.ndarray:
    """max(y, 0), then min(., limit) when limit >= 0, as one clip pass: numpy's float maximum and minimum
    are each three times slower than its clip (NaN stays NaN; -0 stays -0, which max(-0, 0) made +0)."""
    zero = np.zeros((), y.dtype)
    if limit >= 0:
        return clip(y, zero, np.asarray(limit, y.dtype), out=out)
    if y.dtype.kind == "f":
        return clip(y, zero, np.asarray(np.inf, y.dtype), out=out)
    return np.maximum(y, zero, out=out)


def fused(y: np.ndarray, p) -> np.ndarray:
    return relu(y, p.relu_limit) if getattr(p, "do_relu", False) else y
