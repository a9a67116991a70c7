"""The chip's integer arithmetic, shared by TPU inference and the simulator.

The rules (TPU-MLIR's BM1684X "MultiplierShift" requantization):

- products of int8/uint8 values (minus zero points) accumulate in int32;
  conv/matmul accumulators saturate to int32 before requantization;
- requantize: ``y = clamp(RSR(acc * multiplier, rshift) + out_zp, qmin, qmax)``
  with ``acc * multiplier`` in int64 (|acc| < 2^31, multiplier < 2^31: no
  overflow) and RSR a right shift rounding half away from zero (TPU-MLIR's
  ``RightShiftRound`` with ``ROUNDING_HALF_AWAY_FROM_ZERO``);
- float -> int (quantizing casts, weights): round half away from zero, saturate.

Int8 GEMMs and convolutions run through float64 BLAS: every partial sum is an
integer far below 2^53, so the float64 result is exact whatever the summation
order, and numpy has no integer BLAS.
"""

from __future__ import annotations

import numpy as np

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
STORAGE_RANGE = {np.dtype(np.int8): (-128, 127), np.dtype(np.uint8): (0, 255),
                 np.dtype(np.int16): (-32768, 32767), np.dtype(np.int32): (INT32_MIN, INT32_MAX)}


def is_float(dtype) -> bool:
    """numpy floats and ml_dtypes' (bfloat16, float8...: numpy sees those as kind 'V')."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or (dtype.kind == "V" and dtype.name.startswith(("bfloat", "float")))


def round_half_away(x) -> np.ndarray:
    """Round to the nearest integer, ties away from zero (float64; the tie test is exact)."""
    x = np.asarray(x, np.float64)
    mag = np.abs(x)
    whole = np.floor(mag)
    # (mag + 0.5 would round 0.49999999999999994 up to 1.0; the fraction mag - whole is exact)
    return (np.sign(x) * (whole + (mag - whole >= 0.5))).astype(np.int64)


def round_towards_zero(x) -> np.ndarray:
    return np.trunc(np.asarray(x, np.float64)).astype(np.int64)


ROUNDERS = {"HalfAwayFromZero": round_half_away, "TowardsZero": round_towards_zero}


def rshift_round(v, shift) -> np.ndarray:
    """v / 2^shift rounded half away from zero, in int64 (shift >= 0, elementwise or broadcast)."""
    v = np.asarray(v, np.int64)
    shift = np.asarray(shift, np.int64)
    if np.any(shift < 0) or np.any(shift > 63):
        raise ValueError(f"right shift out of range [0, 63]: {shift}")
    half = np.where(shift > 0, np.left_shift(np.int64(1), np.maximum(shift - 1, 0)), 0)
    # -((-v + half) >> shift) == (v + half - 1) >> shift for v < 0 and shift > 0 (an arithmetic shift
    # floors; 2^shift - half = half): so one add of v's sign (v >> 63, -1 or 0) where shift > 0, not the
    # abs/negate/select passes of the magnitude form
    t = np.empty(np.broadcast_shapes(v.shape, shift.shape), np.int64)
    np.right_shift(v, 63, out=t)
    if shift.ndim or shift == 0:
        t &= -(shift > 0).astype(np.int64)
    t += v
    t += half
    return np.right_shift(t, shift, out=t)


def saturate(v, lo: int, hi: int) -> np.ndarray:
    return np.clip(np.asarray(v, np.int64), lo, hi)


def requantize(acc, multiplier, rshift, out_zp: int, qmin: int, qmax: int) -> np.ndarray:
    """clamp(RSR(acc * multiplier, rshift) + out_zp, qmin, qmax); multiplier/rshift broadcast against acc."""
    prod = np.asarray(acc, np.int64) * np.asarray(multiplier, np.int64)
    return saturate(rshift_round(prod, rshift) + out_zp, qmin, qmax)


def exact_int(x: np.ndarray) -> np.ndarray:
    """A float64 array of exact integers (a BLAS result) as int64."""
    return np.rint(x).astype(np.int64)


def centered(x: np.ndarray, zp: int) -> np.ndarray:
    """x - zero point as float64 (exact), ready for a BLAS product."""
    return x.astype(np.float64) - float(zp)


def channel_shape(values, rank: int, axis: int) -> np.ndarray:
    """A per-channel vector shaped to broadcast along ``axis`` of a rank-``rank`` tensor (one value: a scalar)."""
    values = np.asarray(values, np.int64)
    if values.size == 1:
        return values.reshape(())
    shape = [1] * rank
    shape[axis] = values.size
    return values.reshape(shape)
