"""Compile-time INT8 quantization: scales, zero points, multipliers and shifts.

- Activations, per tensor, from calibration. Symmetric: scale = threshold/127
  (i8), or threshold/255 as u8 when calibration saw no negative value.
  Asymmetric: the observed [min, max] clipped to [-threshold, threshold] (so
  the calibration method's outlier clipping applies to both ends) and widened
  to hold 0; scale = (max-min)/255, i8 storage with zero point
  -128 - round(min/scale), so real 0 is exact.
- Weights: per output channel, symmetric i8, scale = max|w_c|/127; bias int32
  = round(b / (s_in * s_w_c)).
- A real multiplier M (e.g. s_in*s_w/s_out) becomes an integer multiplier m
  and right shift r with m / 2^r ~ M: m = round(M * 2^r) with the largest r in
  [0, 63] that keeps m < 2^31, i.e. m in [2^30, 2^31) (TFLite's
  QuantizeMultiplier normalisation; TPU-MLIR's BM1684X get_scale_and_shift
  searches r <= 30 and so keeps one bit less for M < 1). M >= 2^31 saturates
  to m = 2^31 - 1, r = 0.

Every rounding here is half away from zero and exact (no float rounding of
the tie test), so the same scales give the same integers everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from xdsl.dialects.builtin import f32

from tpubuild.calib.qdq import Grid
from tpubuild.calib.table import Entry
from tpubuild.ir.quant import STORAGE, UniformType
from tpubuild.kernels.tpu_arith import rounded_half_away

MULT_BITS = 31  # multipliers are positive int32
MAX_RSHIFT = 63


def round_half_away_exact(x: float) -> int:
    """Exact for any float: the fractional part of a float is exact, so is the tie test."""
    ax = abs(x)
    whole = math.floor(ax)
    n = whole + (1 if ax - whole >= 0.5 else 0)
    return -n if x < 0 else n


@lru_cache(maxsize=1 << 16)  # per-channel scales repeat across the search's lowerings of one model
def multiplier_rshift(scale: float) -> tuple[int, int]:
    """(m, r) with m / 2^r ~ scale: m in [2^30, 2^31), r as large as allowed (see module doc)."""
    if not (scale >= 0 and math.isfinite(scale)):
        raise ValueError(f"requantization scale {scale} is not a finite number >= 0")
    (m,), r = shared_rshift([scale])
    return m, r


def shared_rshift(scales: Sequence[float]) -> tuple[list[int], int]:
    """Multipliers for several scales with one right shift (sums of differently scaled terms)."""
    top = max(abs(s) for s in scales)
    if top == 0:
        return [0] * len(scales), 0
    _, exp = math.frexp(top)  # top = f * 2^exp, f in [0.5, 1): top * 2^(31-exp) in [2^30, 2^31)
    return _fit(scales, MULT_BITS - exp)


def _fit(scales: Sequence[float], r: int) -> tuple[list[int], int]:
    limit = 2**MULT_BITS
    if r < 0:  # |scale| >= 2^31: saturate
        return [int(math.copysign(limit - 1, s)) if s else 0 for s in scales], 0
    r = min(r, MAX_RSHIFT)
    ms = [round_half_away_exact(math.ldexp(s, r)) for s in scales]
    if max(abs(m) for m in ms) >= limit and r > 0:  # rounding reached 2^31: one bit less
        r -= 1
        ms = [round_half_away_exact(math.ldexp(s, r)) for s in scales]
    return ms, r


@dataclass(frozen=True)
class QType:
    """Per-tensor uniform quantization of an activation: real = scale * (stored - zero_point)."""

    storage: str  # i8 or u8
    scale: float
    zero_point: int = 0

    @property
    def qmin(self) -> int:
        return STORAGE[self.storage][0]

    @property
    def qmax(self) -> int:
        return STORAGE[self.storage][1]

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.int8 if self.storage == "i8" else np.uint8)

    def element(self) -> UniformType:
        return UniformType.get(self.storage, f32, [self.scale], [self.zero_point])

    @classmethod
    def of(cls, elem) -> QType | None:
        if isinstance(elem, UniformType) and elem.quant_axis < 0 and elem.storage_type in ("i8", "u8"):
            return cls(elem.storage_type, elem.scale_list[0], elem.zero_point_list[0])
        return None

    def quantize(self, x: np.ndarray) -> np.ndarray:
        # (clipped before rounding: an infinite or huge value saturates instead of overflowing int64)
        v = np.clip(np.nan_to_num(np.asarray(x, np.float64) / self.scale, nan=0.0), -(2.0**40), 2.0**40)
        q = rounded_half_away(v)
        q += self.zero_point
        return np.clip(q, self.qmin, self.qmax, out=q).astype(self.dtype)

    def dequantize(self, q: np.ndarray) -> np.ndarray:
        return ((q.astype(np.float64) - self.zero_point) * self.scale).astype(np.float32)

    def stored(self, real: float) -> int:
        """The stored value nearest a real one, saturated."""
        return int(np.clip(round_half_away_exact(real / self.scale) + self.zero_point, self.qmin, self.qmax))


def activation_qtype(stats: Entry, asymmetric: bool) -> QType:
    """A tensor's quantization from its calibration table entry (threshold, observed min and max)."""
    if asymmetric:
        lo, hi = min(max(stats.min, -stats.threshold), 0.0), max(min(stats.max, stats.threshold), 0.0)
        if not hi > lo:  # never seen anything but 0
            return QType("i8", 1.0 / 255, -128)
        scale = (hi - lo) / 255
        zp = int(np.clip(-128 - round_half_away_exact(lo / scale), -128, 127))
        return QType("i8", scale, zp)
    th = stats.threshold if stats.threshold > 0 and math.isfinite(stats.threshold) else 1.0
    if stats.min >= 0:
        return QType("u8", th / 255)
    return QType("i8", th / 127)


def grid_qtype(grid: Grid) -> QType:
    """int8 storage of a model's grid of 256 values or fewer: its step, the zero point that puts its lowest at -128."""
    return QType("i8", grid.step, -128 - grid.lo)


def channel_scales(w: np.ndarray, axis: int) -> np.ndarray:
    """Symmetric int8 scale per channel along ``axis``: max|w_c| / 127 (1 for an all-zero channel)."""
    reduce_axes = tuple(i for i in range(w.ndim) if i != axis % w.ndim)
    if not w.size:
        return np.ones(w.shape[axis])
    # max |w| as the larger of max w and -min w: exact in w's own dtype, without a widened copy
    wmax = np.maximum(np.max(w, axis=reduce_axes).astype(np.float64), -np.min(w, axis=reduce_axes).astype(np.float64))
    return np.where(wmax > 0, wmax / 127, 1.0)


# weights quantize in blocks of about this many values along their first axis: the float64 work of a block stays
# in cache (a 100-million-value classifier filter: 4.4 s whole, 0.9 s in blocks)
_BLOCK_VALUES = 1 << 18


def quantize_per_channel(w: np.ndarray, scales: np.ndarray, axis: int) -> np.ndarray:
    shape = [1] * w.ndim
    shape[axis % w.ndim] = -1
    s = scales.reshape(shape)
    q = np.empty(w.shape, np.int8)
    step = max(1, _BLOCK_VALUES // max(1, math.prod(w.shape[1:])))
    for i in range(0, w.shape[0], step):
        v = w[i : i + step].astype(np.float64)
        v /= s[i : i + step] if axis % w.ndim == 0 else s
        q[i : i + step] = np.clip(rounded_half_away(v), -127, 127, out=v)
    return q


def quantize_bias(b: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """int32 bias in accumulator units (scale s_in * s_w per channel), saturated.

    (Clipped before rounding: a quotient beyond int64 would wrap in the cast, and saturate with the wrong sign.)
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.nan_to_num(b.astype(np.float64) / scales, nan=0.0)
    return rounded_half_away(np.clip(v, -(2.0**31), 2.0**31 - 1)).astype(np.int32)


# A bias must fit the accumulator in its units with room left for the products: |b| / (s_in * s_w) <= 2^30.
BIAS_LIMIT = 2.0**30


def bias_safe_scales(w_scales: np.ndarray, bias: np.ndarray | None, in_scale: float) -> np.ndarray:
    """Per-channel weight scales, raised where the bias would not fit in accumulator units.

    A channel whose filter is (nearly) all zeros (PP-OCRv4 rec has filters of 1e-40) gets a
    weight scale of 1e-42: its bias, divided by s_in * s_w, is far beyond int32, and its
    requantization multiplier rounds to 0, so the channel's output, which is its bias, comes
    out 0. Raising s_w to |b| / (s_in * 2^30) keeps the bias exact (its filter rounds to 0, as
    it nearly is); TFLite's quantizer does the same (AdjustWeightsForBiasScale).
    """
    if bias is None:
        return w_scales
    b = np.abs(bias.astype(np.float64))
    per_channel = b.reshape(-1, b.shape[-1]).max(axis=0) if b.ndim else b.reshape(1)  # the channel axis is last
    need = per_channel / (in_scale * BIAS_LIMIT)
    return np.maximum(w_scales, need if need.size == np.size(w_scales) else need.max())
