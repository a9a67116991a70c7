"""Streaming activation statistics: per tensor min, max and a histogram of |x|.

One sample at a time, so memory holds one histogram per tensor (2048 int64
counts) however many samples are seen.

The histogram range grows by re-binning rather than being fixed by a first
pass over the data (TPU-MLIR runs inference twice, or keeps every sample's
activations on disk): it covers [0, R) where R is the smallest power of two
above the largest |x| seen so far. When a sample exceeds R, R doubles (k
times) and every 2^k adjacent bins merge into one. Because the bin width is
a power of two, ``floor(|x| / width)`` at the wider width is exactly the
merged bin of the narrower one, so the result equals the histogram of all
samples at once over [0, R) (a test checks it bit for bit), and it does not
depend on the order of the samples. The price: |x|max lands between bin 1024
and bin 2047, so [0, |x|max] gets 1024 to 2048 bins, not always 2048.

Exact zeros are counted apart from the histogram (TPU-MLIR drops them too):
after a ReLU they can be half of all values, and they quantize without error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

BINS = 2048


@dataclass
class TensorStats:
    """Running statistics of one tensor over the samples seen so far."""

    bins: int = BINS
    samples: int = 0
    count: int = 0  # values seen
    zeros: int = 0  # exact zeros (not in hist)
    infinite: int = 0  # +-inf values (in none of the others: a mask's -inf is beyond any threshold)
    min: float = math.inf
    max: float = -math.inf
    range: float = 0.0  # hist covers [0, range); 0 until a nonzero value is seen
    hist: np.ndarray = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.bins & (self.bins - 1):
            raise ValueError(f"histogram bins must be a power of two, not {self.bins}")
        if self.hist is None:
            self.hist = np.zeros(self.bins, np.int64)

    @property
    def absmax(self) -> float:
        return max(-self.min, self.max, 0.0) if self.count else 0.0

    @property
    def width(self) -> float:
        return self.range / self.bins

    def update(self, x: np.ndarray) -> None:
        """Add one sample of the tensor. Raises ValueError on NaN. Infinities are counted apart: a model writes
        -inf where a value must vanish (an attention mask before a softmax), and no scale holds them."""
        x = np.asarray(x)
        if x.dtype != np.float32:
            x = x.astype(np.float32)  # f16/bf16 tensors: exact in f32
        self.samples += 1
        if x.size == 0:
            return
        flat = x.reshape(-1)  # a copy only if x is not contiguous: every pass below then streams
        lo, hi = float(flat.min()), float(flat.max())
        if not (math.isfinite(lo) and math.isfinite(hi)):
            if math.isnan(lo) or math.isnan(hi):
                raise ValueError("the tensor holds NaN values")
            finite = np.isfinite(flat)
            self.infinite += int(flat.size - np.count_nonzero(finite))
            flat = flat[finite]
            if flat.size == 0:
                return
            lo, hi = float(flat.min()), float(flat.max())
        self.count += flat.size
        self.min, self.max = min(self.min, lo), max(self.max, hi)
        peak = max(-lo, hi)
        if peak == 0.0:
            self.zeros += flat.size
            return
        if peak >= self.range:
            self._grow(peak)
        scaled = np.abs(flat)
        # |x| has no sign bit, so its zeros are the all-zero bit patterns: counted as unsigned integers, five
        # times faster than as floats
        zeros = flat.size - np.count_nonzero(scaled.view(f"u{scaled.itemsize}"))
        # bins / range is a power of two: the scaling is exact and |x| * scale < bins
        scale = self.bins / self.range
        if not 2.0**-100 < scale < 2.0**100:  # beyond float32's normal range
            scaled = scaled.astype(np.float64)
        scaled *= scaled.dtype.type(scale)
        self.hist += np.bincount(scaled.astype(np.intp), minlength=self.bins)
        self.hist[0] -= zeros
        self.zeros += int(zeros)

    def _grow(self, peak: float) -> None:
        self._widen(math.ldexp(1.0, math.frexp(peak)[1]))  # the smallest power of two > peak

    def _widen(self, new_range: float) -> None:
        """The histogram over [0, new_range), a power of two times its range: adjacent bins merged."""
        self.hist = _merged_bins(self.hist, int(new_range / self.range)) if self.range else self.hist
        self.range = new_range

    def merge(self, other: TensorStats) -> None:
        """Add the samples ``other`` has seen (of the same tensor, the same bins): the statistics of all of them,
        the same as one stream of both gives (the histogram's range is a power of two: merging bins is exact)."""
        self.samples += other.samples
        self.count += other.count
        self.zeros += other.zeros
        self.infinite += other.infinite
        self.min, self.max = min(self.min, other.min), max(self.max, other.max)
        if other.range > self.range:
            self._widen(other.range)
        if other.range:
            self.hist = self.hist + _merged_bins(other.hist, int(self.range / other.range))

    def nonzero_bins(self) -> int:
        """1 + the index of the last non-empty bin (0 for an all-zero tensor)."""
        nz = np.flatnonzero(self.hist)
        return int(nz[-1]) + 1 if nz.size else 0


def _merged_bins(hist: np.ndarray, factor: int) -> np.ndarray:
    """``hist`` with each ``factor`` adjacent bins (a power of two) merged into one, at the start, zeros after."""
    if factor == 1:
        return hist
    merged = np.zeros_like(hist)
    if factor >= len(hist):
        merged[0] = hist.sum()
    else:
        merged[: len(hist) // factor] = hist.reshape(-1, factor).sum(axis=1)
    return merged


def batch_stats(samples, bins: int = BINS) -> TensorStats:
    """The statistics of several samples at once (the reference the streaming form must equal)."""
    stats = TensorStats(bins=bins)
    arrays = [np.asarray(s, np.float32).ravel() for s in samples]
    allx = np.concatenate(arrays) if arrays else np.zeros(0, np.float32)
    stats.samples = len(arrays)
    if allx.size == 0:
        return stats
    stats.count = allx.size
    stats.min, stats.max = float(allx.min()), float(allx.max())
    ax = np.abs(allx[allx != 0]).astype(np.float64)
    stats.zeros = allx.size - ax.size
    if ax.size:
        stats.range = math.ldexp(1.0, math.frexp(float(ax.max()))[1])
        stats.hist, _ = np.histogram(ax, bins=bins, range=(0.0, stats.range))
        stats.hist = stats.hist.astype(np.int64)
    return stats
