"""Fused activations that compute ops carry (do_relu / relu_limit, as TPU-MLIR)."""

import numpy as np


def relu(y: np.ndarray, limit: float = -1.0) -> np.ndarray:
    y = np.maximum(y, np.zeros((), y.dtype))
    if limit >= 0:
        y = np.minimum(y, np.asarray(limit, y.dtype))
    return y


def fused(y: np.ndarray, p) -> np.ndarray:
    return relu(y, p.relu_limit) if getattr(p, "do_relu", False) else y
