"""Threshold methods: a tensor's statistics -> T, its int8 range being [-T, T] (or [0, T]).

One function per method, registered by name; the manifest's
``calibration.method`` picks one. ``auto`` is not a function of one tensor's
statistics: it runs the model again to choose among these per tensor (tune.py).

Every method gets ``levels``, the positive quantization levels the lowering
gives the tensor: 127 for a tensor with negative values (int8, scale T/127),
255 for a non-negative one (uint8 after ReLU, scale T/255).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tpubuild.calib.stats import TensorStats
from tpubuild.registry import Registry

Method = Callable[[TensorStats, int], float]
METHODS = Registry("a calibration method")

PERCENTILE = 99.99
# KL never clips more than this share of the values (its clip point is at least
# the median of |x|). TensorRT's search assumes a distribution that starts at 0;
# for one far from it (a detection head's class logits, all in [-7, -2]) a clip
# point just above the first non-empty bin leaves P and Q one identical spike, a
# divergence of 0, and the tensor becomes a constant.
KL_MAX_CLIPPED = 0.5
# An all-zero tensor: any positive range quantizes it exactly (TPU-MLIR uses the same floor).
MIN_THRESHOLD = 1e-5


def method(name: str) -> Callable[[Method], Method]:
    return METHODS.register(name)


def levels_for(stats: TensorStats) -> int:
    return 255 if stats.min >= 0 else 127


def threshold(stats: TensorStats, name: str) -> float:
    """The threshold method ``name`` gives, clamped to (0, |x|max]: no method gains by clipping nothing."""
    if stats.absmax == 0.0:
        return MIN_THRESHOLD
    value = METHODS[name](stats, levels_for(stats))
    return float(min(value, stats.absmax)) if value > 0 else stats.absmax


@method("max")
def max_abs(stats: TensorStats, levels: int) -> float:
    """|x|max: nothing is clipped, the step is widest."""
    return stats.absmax


@method("percentile")
def percentile(stats: TensorStats, levels: int, q: float = PERCENTILE) -> float:
    """The q-th percentile of |x| over every value (zeros included), interpolated within its bin.

    A tensor that is nearly all zeros (the percentile is 0) keeps its full range.
    """
    target = q / 100.0 * stats.count
    if target <= stats.zeros:
        return stats.absmax
    cum = stats.zeros + np.cumsum(stats.hist)
    k = int(np.searchsorted(cum, target))
    before = cum[k - 1] if k else stats.zeros
    frac = (target - before) / stats.hist[k]
    return float((k + frac) * stats.width)


def _kl_divergence(hist: np.ndarray, cum: np.ndarray, i: int, nq: int) -> float:
    """TensorRT's KL(P || Q) for clipping the histogram after bin i - 1.

    P: bins [0, i) with the clipped outliers added to the last one. Q: the same
    bins (without outliers) merged into nq groups (the last takes the remainder),
    each group's count spread evenly over its bins that are non-empty in P.
    """
    p = hist[:i].copy()
    p[-1] += cum[-1] - cum[i]
    merged = i // nq
    group = np.minimum(np.arange(i) // merged, nq - 1)
    nonzero = p > 0
    qsum = np.bincount(group, weights=hist[:i], minlength=nq)
    qnz = np.bincount(group, weights=nonzero, minlength=nq)
    q = np.where(nonzero, (qsum / np.maximum(qnz, 1))[group], 0.0)
    if q.sum() == 0:
        return np.inf
    p, q = p[nonzero] / p.sum(), q[nonzero] / q.sum()
    q = np.maximum(q, 1e-12)  # P's outlier bin can land in an all-empty group
    return float(np.sum(p * np.log(p / q)))


@method("kl")
def kl(stats: TensorStats, levels: int) -> float:
    """TensorRT's entropy calibration: the clip point whose 8-bit version loses the least information.

    Candidates are the bin edges from ``levels + 1`` bins (128 for int8, as
    TensorRT and TPU-MLIR; 256 for uint8), or from the edge that clips
    KL_MAX_CLIPPED of the values if that is higher, to the last non-empty bin:
    every 16th, then every one within 16 of the best.
    """
    nq = levels + 1
    n = stats.nonzero_bins()
    hist = stats.hist.astype(np.float64)
    cum = np.concatenate([[0.0], np.cumsum(hist)])
    lowest = max(nq, int(np.searchsorted(cum, (1.0 - KL_MAX_CLIPPED) * cum[-1])))
    if n <= lowest:
        return stats.absmax

    def best_of(candidates) -> tuple[float, int]:
        return min((_kl_divergence(hist, cum, i, nq), i) for i in candidates)

    _, coarse = best_of(list(range(lowest, n + 1, 16)) + [n])
    _, best = best_of(range(max(lowest, coarse - 15), min(n, coarse + 15) + 1))
    return best * stats.width


def _quant_error(x: np.ndarray, weight: np.ndarray, thresholds: np.ndarray, levels: int) -> np.ndarray:
    """Expected squared error of |x| values (with counts) fake-quantized at each threshold."""
    step = thresholds[:, None] / levels
    q = np.minimum(np.round(x[None, :] / step), levels) * step
    return ((x[None, :] - q) ** 2 * weight[None, :]).sum(axis=1)


@method("mse")
def mse(stats: TensorStats, levels: int) -> float:
    """The threshold minimising the mean squared error of fake-quantized values.

    The values inside a bin are unknown: each non-empty bin stands for 4 evenly
    spaced points. Candidates: 128 evenly spaced thresholds up to |x|max, then
    32 more between the best one's neighbours.
    """
    occupied = np.flatnonzero(stats.hist)
    if occupied.size == 0:
        return stats.absmax
    sub = (np.arange(4) + 0.5) / 4
    x = ((occupied[:, None] + sub[None, :]) * stats.width).ravel()
    weight = np.repeat(stats.hist[occupied] / 4.0, 4)
    top = stats.absmax
    coarse = top * np.arange(1, 129) / 128
    j = int(np.argmin(_quant_error(x, weight, coarse, levels)))
    fine = np.linspace(top * j / 128, top * min(j + 2, 128) / 128, 33)[1:]
    fine = fine[fine > 0]
    return float(fine[int(np.argmin(_quant_error(x, weight, fine, levels)))])
