"""The chip's integer arithmetic, shared by TPU inference and the simulator.

The rules (TPU-MLIR's BM1684X "MultiplierShift" requantization):

- products of int8/uint8 values (minus zero points) accumulate in int32;
  conv/matmul accumulators saturate to int32 before requantization;
- requantize: ``y = clamp(RSR(acc * multiplier, rshift) + out_zp, qmin, qmax)``
  with ``acc * multiplier`` in int64 (|acc| < 2^31, multiplier < 2^31: no
  overflow) and RSR a right shift rounding half away from zero (TPU-MLIR's
  ``RightShiftRound`` with ``ROUNDING_HALF_AWAY_FROM_ZERO``);
- float -> int (quantizing casts, weights): round half away from zero, saturate.

Int8 GEMMs and convolutions run through float BLAS (numpy has no integer BLAS):
float64, where every partial sum is an integer far below 2^53, so the result
is exact whatever the summation order; where the partial sums stay within 2^24
over spans of a conv's input channels or a matmul's K, in float32 span by span
(kernels/tpu.py, ``f32_spans``), half the time for the same integers.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
STORAGE_RANGE = {
    np.dtype(np.int8): (-128, 127),
    np.dtype(np.uint8): (0, 255),
    np.dtype(np.int16): (-32768, 32767),
    np.dtype(np.int32): (INT32_MIN, INT32_MAX),
}


def is_float(dtype) -> bool:
    """numpy floats and ml_dtypes' (bfloat16, float8...: numpy sees those as kind 'V')."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or (dtype.kind == "V" and dtype.name.startswith(("bfloat", "float")))


def round_half_away(x) -> np.ndarray:
    """Round to the nearest integer, ties away from zero (float64; the tie test is exact)."""
    return rounded_half_away(np.array(x, np.float64)).astype(np.int64)


def rounded_half_away(v: np.ndarray) -> np.ndarray:
    """``v`` (float64, the caller's to overwrite) rounded half away from zero in place, as whole floats.

    In place, with one float temporary: through the temporaries of the plain expression, quantizing a
    100-million-value classifier filter took 9 s.
    """
    whole = np.trunc(v)
    # (v + 0.5 would round 0.49999999999999994 up to 1.0; the fraction v - whole is exact)
    np.subtract(v, whole, out=v)
    np.abs(v, out=v)
    np.copysign(v >= 0.5, whole, out=v)  # one step away from zero where due (trunc keeps the sign: -0.0)
    v += whole
    return v


def round_towards_zero(x) -> np.ndarray:
    return np.trunc(np.asarray(x, np.float64)).astype(np.int64)


def round_half_even(x) -> np.ndarray:
    return np.rint(np.asarray(x, np.float64)).astype(np.int64)


ROUNDERS = {"HalfAwayFromZero": round_half_away, "HalfToEven": round_half_even, "TowardsZero": round_towards_zero}


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


# |acc * multiplier| below this: the product is exact in float64, and so is adding a half to it after the shift
_F64_EXACT = float(2**52)


def requantize_sums(acc: np.ndarray, bias, multiplier, rshift, out_zp: int, qmin: int, qmax: int) -> np.ndarray:
    """requantize(saturate(acc + bias, int32), ...) of a BLAS accumulator (float32/float64 holding exact
    integers; bias: integers or None; multiplier, rshift: as requantize), stored in the narrowest of
    int8/uint8/int64 holding [qmin, qmax].

    The same bits as the integer form, in float64 when every |sum * multiplier| is below 2^52 (the product,
    its power-of-two shift and the half added to round it are then exact): half the passes of int64
    arithmetic over a conv's output, which were most of an INT8 conv's time. Otherwise the integer form.
    """
    mult = np.asarray(multiplier, np.int64)
    shift = np.asarray(rshift, np.int64)
    t = acc.astype(np.float64) if bias is None else np.add(acc, bias, dtype=np.float64)
    lo, hi = float(t.min(initial=0.0)), float(t.max(initial=0.0))
    if lo < INT32_MIN or hi > INT32_MAX:
        np.clip(t, INT32_MIN, INT32_MAX, out=t)
        lo, hi = max(lo, INT32_MIN), min(hi, INT32_MAX)
    dtype = next(
        (
            d
            for d in (np.dtype(np.int8), np.dtype(np.uint8))
            if STORAGE_RANGE[d][0] <= qmin and qmax <= STORAGE_RANGE[d][1]
        ),
        np.dtype(np.int64),
    )
    if (
        max(-lo, hi) * float(np.abs(mult).max(initial=0)) >= _F64_EXACT
        or shift.min(initial=0) < 0
        or shift.max(initial=0) > 52
    ):
        return requantize(exact_int(t), mult, shift, out_zp, qmin, qmax).astype(dtype)
    t *= mult * np.ldexp(1.0, -shift)
    # half away from zero: trunc(t +- 1/2), exact as t is a multiple of 2^-shift below 2^(52 - shift)
    t += np.copysign(0.5, t)
    if out_zp:
        np.trunc(t, out=t)
        t += out_zp
    # without a zero point the cast truncates: clamping to integer bounds first gives the same integers
    np.clip(t, qmin, qmax, out=t)
    return t.astype(dtype)


def exact_int(x: np.ndarray) -> np.ndarray:
    """A float64 array of exact integers (a BLAS result) as int64."""
    return np.rint(x).astype(np.int64)


def centered(x: np.ndarray, zp: int, dtype: npt.DTypeLike = np.float64) -> np.ndarray:
    """x - zero point in a float dtype (exact for stored 8-bit values), ready for a BLAS product: one pass when
    the zero point is 0 (symmetric activations)."""
    return x.astype(dtype) - np.dtype(dtype).type(zp) if zp else x.astype(dtype)


def channel_shape(values, rank: int, axis: int) -> np.ndarray:
    """A per-channel vector shaped to broadcast along ``axis`` of a rank-``rank`` tensor (one value: a scalar)."""
    values = np.asarray(values, np.int64)
    if values.size == 1:
        return values.reshape(())
    shape = [1] * rank
    shape[axis] = values.size
    return values.reshape(shape)
