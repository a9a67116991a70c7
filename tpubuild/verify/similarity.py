"""Similarity of two tensors, as TPU-MLIR's npz compare reports it.

- cosine similarity (both all-zero: 1.0; one all-zero: 0.0),
- euclidean similarity 1 - ||a-b|| / ||(a+b)/2|| (equal tensors: 1.0),
- SQNR in dB of the zero-mean signal against the zero-mean noise (inf when
  there is no noise). SQNR is not symmetric: the second argument is the
  reference signal.
- a label: EQUAL (bitwise), CLOSE (allclose), SIMILAR (meets the tolerance),
  NOT SIMILAR, or NOT MATCH (different element counts).

All arithmetic is float64 so the metric does not add its own rounding error
to a float32 comparison.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

EQUAL, CLOSE, SIMILAR, NOT_SIMILAR, NOT_MATCH = "EQUAL", "CLOSE", "SIMILAR", "NOT SIMILAR", "NOT MATCH"
# allclose bounds for CLOSE: float32 round-off after a few ops, not a looser "close enough"
CLOSE_RTOL, CLOSE_ATOL = 1e-5, 1e-8
# CLOSE's atol where two float32 implementations of a graph meet (TOP vs onnxruntime, IREE vs TOP): 4 units in
# the last place of 1.0. Their functions (onnxruntime's sigmoid, tanh, exp) round to a few ulps of the
# function's range, not of its value: PP-OCRv4's seal detector maps a page without seals to sigmoids of
# -15 to -68, at most 3.3e-7, and onnxruntime's are off by up to 1.4e-7 (5.6 times the exact value; TOP's by
# 1.6e-11). Every element within this is round-off, whatever the cosine of such a map says.
FLOAT32_ATOL = 2.0**-21
# CLOSE's atol for an F16 target's results against TOP's float32: 4 of float16's smallest steps (2^-24, its
# subnormal spacing), as the tiny-part rule gives INT8 4 of its steps. F16 holds that seal detector's
# sigmoids as at most 6 such steps (a cosine of 0.89), all it can say of them.
FLOAT16_ATOL = 4 * 2.0**-24


@dataclass(frozen=True)
class Tolerance:
    cos: float
    euc: float
    atol: float = CLOSE_ATOL  # CLOSE's absolute bound

    @classmethod
    def parse(cls, text: str) -> Tolerance:
        """'0.99,0.9' -> Tolerance(0.99, 0.9); raises ValueError with the expected form."""
        parts = text.split(",")
        try:
            cos, euc = (float(p) for p in parts)
        except ValueError:
            raise ValueError(f"tolerance {text!r} is not of the form COS,EUC (two numbers, e.g. 0.99,0.9)") from None
        return cls(cos, euc)


def _f64(x: np.ndarray) -> np.ndarray:
    return np.asarray(x).astype(np.float64, copy=False).ravel()


# The metrics on float64 copies made once: similarity() computes all of them on the same two copies and
# difference (each conversion and a - b is a pass over tensors of up to hundreds of MB); the public
# functions below are the same expressions on their own copies.


# norms between these: no square or product that matters is a subnormal or overflows float64
_NORM_RANGE = (1e-100, 1e100)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0.0 or nb == 0.0:
        return 1.0 if na == nb else 0.0
    lo, hi = _NORM_RANGE
    if not (lo < na < hi and lo < nb < hi):
        # each scaled to a largest |value| of 1 first: squares of values near 1e-160 lose their low bits as
        # subnormals, and cos([1], [3.8e-160]) came out 1.000002
        a, b = a / np.max(np.abs(a)), b / np.max(np.abs(b))
        na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return float(np.dot(a, b) / (na * nb))


def _euclidean(a: np.ndarray, b: np.ndarray, diff: np.ndarray) -> float:
    dist = np.linalg.norm(diff)
    if dist == 0.0:
        return 1.0
    mid = np.linalg.norm((a + b) / 2)
    # a == -b: the mean is zero but the tensors differ, as dissimilar as it gets
    return float(1.0 - dist / mid) if mid > 0.0 else -math.inf


def _sqnr_db(ref: np.ndarray, diff: np.ndarray) -> float:
    if not ref.size:  # an empty tensor (a zero-length slice) has neither
        return math.inf
    # the noise test - ref here, ref - test in the definition: negating is exact and leaves its power as it is
    signal = ref - ref.mean()
    noise = diff - diff.mean()
    noise_power = float(np.dot(noise, noise))
    signal_power = float(np.dot(signal, signal))
    if noise_power == 0.0 or signal_power == 0.0:
        return math.inf
    return float(10.0 * math.log10(signal_power / noise_power))


def _max_abs(diff: np.ndarray) -> float:
    return float(np.max(np.abs(diff))) if diff.size else 0.0


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return _cosine(_f64(a), _f64(b))


def euclidean(a: np.ndarray, b: np.ndarray) -> float:
    a, b = _f64(a), _f64(b)
    return _euclidean(a, b, a - b)


def sqnr_db(test: np.ndarray, ref: np.ndarray) -> float:
    """Signal (ref) to noise (test - ref) power ratio in dB, both taken zero-mean."""
    ref64 = _f64(ref)
    return _sqnr_db(ref64, _f64(test) - ref64)


def max_abs_error(a: np.ndarray, b: np.ndarray) -> float:
    return _max_abs(_f64(a) - _f64(b))


def _all_close(a: np.ndarray, b: np.ndarray, diff: np.ndarray, mae: float, atol: float) -> bool:
    """np.allclose(a, b, CLOSE_RTOL, atol, equal_nan=True) from the difference made already: with every
    element finite (a finite largest |a - b|) that is numpy's own test |a - b| <= atol + rtol * |b|, in fewer
    passes than isclose's handling of infinities and NaNs (verify_top compares hundreds of tensors)."""
    if not math.isfinite(mae):
        return bool(np.allclose(a, b, rtol=CLOSE_RTOL, atol=atol, equal_nan=True))
    if mae <= atol:
        return True
    bound = np.abs(b)
    bound *= CLOSE_RTOL
    bound += atol
    return bool(np.all(np.abs(diff) <= bound))


def _agreeing_non_finite_zeroed(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``a`` and ``b`` with 0 where both hold the same infinity (a causal mask's -inf) or NaN: those agree, and
    have no magnitude for a metric to weigh. Where only one is not finite, the metrics stay NaN or infinite."""
    same = ~np.isfinite(a) & ((a == b) | (np.isnan(a) & np.isnan(b)))
    return np.where(same, 0.0, a), np.where(same, 0.0, b)


@dataclass(frozen=True)
class Similarity:
    label: str
    passed: bool
    cos: float
    euc: float
    sqnr: float
    max_abs: float

    def to_dict(self) -> dict:
        return asdict(self)


def similarity(test: np.ndarray, ref: np.ndarray, tol: Tolerance) -> Similarity:
    """Every metric and the TPU-MLIR style label for one pair of tensors."""
    test, ref = np.asarray(test), np.asarray(ref)
    if test.size != ref.size:
        nan = math.nan
        return Similarity(NOT_MATCH, False, nan, nan, nan, nan)
    a, b = _f64(test), _f64(ref)
    with np.errstate(invalid="ignore"):
        diff = a - b
    mae = _max_abs(diff)
    if math.isnan(mae):
        a, b = _agreeing_non_finite_zeroed(a, b)
        diff = a - b
        mae = _max_abs(diff)
    cos, euc, sqnr = _cosine(a, b), _euclidean(a, b, diff), _sqnr_db(b, diff)
    same_shape = test.shape == ref.shape
    if same_shape and np.array_equal(test, ref, equal_nan=test.dtype.kind == "f" and ref.dtype.kind == "f"):
        label = EQUAL
    elif same_shape and _all_close(a, b, diff, mae, tol.atol):
        label = CLOSE
    elif cos >= tol.cos and euc >= tol.euc:  # NaN metrics compare False: never similar
        label = SIMILAR
    else:
        label = NOT_SIMILAR
    return Similarity(label, label != NOT_SIMILAR, cos, euc, sqnr, mae)
