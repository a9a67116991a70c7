"""Pointwise math, activations, comparisons, where, cast, variadic max/min."""

from __future__ import annotations

import functools
import math

import ml_dtypes
import numpy as np
from onnx.numpy_helper import to_float8e8m0

from tpubuild.ir import top
from tpubuild.ir.types import dtype_from_name
from tpubuild.kernels.activation import clip
from tpubuild.kernels.registry import kernel

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def erf(x: np.ndarray) -> np.ndarray:
    """erf in float64, accurate to about 1e-7 relative everywhere (numpy has no erf).

    Near 0 a Taylor series (erfc-based forms lose the relative accuracy there), elsewhere
    1 - erfc from Numerical Recipes' Chebyshev fit (fractional error < 1.2e-7).
    """
    z = np.abs(x.astype(np.float64, copy=False))
    flat = z.reshape(-1)
    near = flat < 0.5
    # each form only on its own elements (the same operations per element as on all of them), picked by
    # index: take and put are twice as fast as boolean-mask indexing
    inside, outside = np.flatnonzero(near), np.flatnonzero(~near)
    y = np.empty_like(flat)
    y.put(inside, _erf_series(flat.take(inside)))
    y.put(outside, _erf_far(flat.take(outside)))
    return np.copysign(y.reshape(z.shape), x)


# Numerical Recipes' Chebyshev coefficients for erfc, innermost first
_ERFC_COEFFS = (
    0.17087277,
    -0.82215223,
    1.48851587,
    -1.13520398,
    0.27886807,
    -0.18628806,
    0.09678418,
    0.37409196,
    1.00002368,
    -1.26551223,
)


def _erf_far(z: np.ndarray) -> np.ndarray:
    """1 - erfc(z) (z >= 0)."""
    q = erfc_nonneg(z)
    return np.subtract(1.0, q, out=q)


def erfc_nonneg(z: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """erfc(z) of float64 z >= 0, fractional error < 1.2e-7: t exp(-z^2 + poly(t)), t = 1 / (1 + z/2),
    poly as c0 + t (c1 + t (c2 + ...)); -z*z + poly is computed as poly - z*z (negation is exact, and a + (-b)
    is a - b). ``out``: z's array, overwritten (else z is kept)."""
    t = np.multiply(z, 0.5)
    t += 1.0
    t = np.divide(1.0, t)  # not in place: numpy's loop for a scalar over an array it overwrites is slower
    poly = t * _ERFC_COEFFS[0]
    for c in _ERFC_COEFFS[1:-1]:
        poly += c
        poly *= t
    poly += _ERFC_COEFFS[-1]
    q = np.multiply(z, z, out=out)
    np.subtract(poly, q, out=q)
    np.exp(q, out=q)
    q *= t
    return q


def _erf_series(z: np.ndarray) -> np.ndarray:
    """2/sqrt(pi) * sum (-1)^n z^(2n+1) / (n! (2n+1)); at |z| < 0.5 the 8th term is below 1e-12.

    The terms as the plain loop makes them (term = -term * z^2 / n), with the exact steps
    left out: the first term over 1 added to zero is z, the first update divides by 1,
    -term * z^2 is term * (-z^2), and the term after the last is never used.
    """
    neg_z2 = np.multiply(z, z)
    np.negative(neg_z2, out=neg_z2)
    series = z.copy()
    term = np.multiply(z, neg_z2)
    part = np.empty_like(z)
    for n in range(1, 8):
        series += np.divide(term, 2 * n + 1, out=part)
        if n < 7:
            term *= neg_z2
            term /= n + 1
    series *= 2.0 / math.sqrt(math.pi)
    return series


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(np.zeros((), x.dtype), x)


def _unary(fn):
    def run(p, x):
        with np.errstate(all="ignore"):  # log(-1), sqrt(-1), 1/0: nan/inf, as onnxruntime gives
            y = np.asarray(fn(x))
        return y if y.dtype == np.bool_ else y.astype(x.dtype, copy=False)

    return run


_UNARY = {
    top.ExpOp: np.exp,
    top.LogOp: np.log,
    top.SqrtOp: np.sqrt,
    top.AbsOp: np.abs,
    top.FloorOp: np.floor,
    top.CeilOp: np.ceil,
    top.ErfOp: erf,
    top.SoftplusOp: softplus,
    top.MishOp: lambda x: x * np.tanh(softplus(x)),
    top.SinOp: np.sin,
    top.CosOp: np.cos,
    top.TanOp: np.tan,
    top.AsinOp: np.arcsin,
    top.AcosOp: np.arccos,
    top.AtanOp: np.arctan,
    top.SinhOp: np.sinh,
    top.CoshOp: np.cosh,
    top.AsinhOp: np.arcsinh,
    top.AcoshOp: np.arccosh,
    top.AtanhOp: np.arctanh,
    top.SignOp: np.sign,
    top.RoundOp: np.rint,  # half to even
    top.SoftsignOp: lambda x: x / (1 + np.abs(x)),
    top.IsNaNOp: np.isnan,
}
for _cls, _fn in _UNARY.items():
    kernel(_cls)(_unary(_fn))


@kernel(top.ReciprocalOp)
def _(p: top.ConstValParams, x):
    with np.errstate(divide="ignore"):
        return (np.asarray(p.const_val, x.dtype) / x).astype(x.dtype, copy=False)


@kernel(top.LeakyReluOp)
def _(p: top.AlphaParams, x):
    return np.where(x >= 0, x, x * np.asarray(p.alpha, x.dtype))


@kernel(top.EluOp)
def _(p: top.AlphaParams, x):
    with np.errstate(over="ignore"):
        return np.where(x > 0, x, np.asarray(p.alpha, x.dtype) * np.expm1(np.minimum(x, 0)))


@kernel(top.SwishOp)
def _(p: top.BetaParams, x):
    with np.errstate(over="ignore"):
        return (x / (1.0 + np.exp(-p.beta * x.astype(np.float64)))).astype(x.dtype)


@kernel(top.CeluOp)
def _(p: top.AlphaParams, x):
    with np.errstate(over="ignore"):
        neg = p.alpha * np.expm1(np.minimum(x, 0).astype(np.float64) / p.alpha)
    return (np.maximum(x, 0) + neg).astype(x.dtype)


@kernel(top.ThresholdedReluOp)
def _(p: top.AlphaParams, x):
    return np.where(x > np.asarray(p.alpha, x.dtype), x, np.zeros((), x.dtype))


@kernel(top.ShrinkOp)
def _(p: top.ShrinkParams, x):
    bias, lambd = np.asarray(p.bias, x.dtype), np.asarray(p.lambd, x.dtype)
    return np.where(x < -lambd, x + bias, np.where(x > lambd, x - bias, np.zeros((), x.dtype))).astype(x.dtype)


@kernel(top.IsInfOp)
def _(p: top.IsInfParams, x):
    return np.isinf(x) & (((x > 0) & p.detect_positive) | ((x < 0) & p.detect_negative))


@kernel(top.ModOp)
def _(p: top.ModParams, a, b):
    with np.errstate(divide="ignore", invalid="ignore"):
        return (np.fmod if p.fmod else np.mod)(a, b)


@kernel(top.HardSigmoidOp)
def _(p: top.HardSigmoidParams, x):
    y = np.multiply(x, np.asarray(p.alpha, x.dtype))
    y += np.asarray(p.beta, x.dtype)
    return clip(y, 0, 1, out=y).astype(x.dtype, copy=False)


@kernel(top.GELUOp)
def _(p: top.GeluParams, x):
    x64 = x.astype(np.float64)
    if p.approx_mode == "tanh":
        inner = np.tanh(_SQRT_2_OVER_PI * (x64 + 0.044715 * x64**3))
        inner += 1.0
        half = np.multiply(x64, 0.5, out=x64)
        return np.multiply(half, inner, out=inner).astype(x.dtype)
    # x * Phi(x), Phi(x) = (1 + erf(x / sqrt2)) / 2 = erfc(-x / sqrt2) / 2: from erfc(|x| / sqrt2) / 2 = h, Phi
    # is h below 0 and 1 - h above, which stays accurate in the negative tail, where 1 + erf cancels (a
    # thousandth off at -5), and needs no series near 0 (Phi is near 1/2 there): a third of erf's passes
    z = np.multiply(x64, 1.0 / math.sqrt(2.0))
    h = erfc_nonneg(np.abs(z, out=z), out=z)
    h *= 0.5
    # 1 - h above 0 (x -0 included, as the sign bit says), h below: (not signbit) - copysign(h, x)
    phi = np.subtract(~np.signbit(x64), np.copysign(h, x64, out=h), out=h)
    return np.multiply(x64, phi, out=phi).astype(x.dtype)


@kernel(top.HardSwishOp)
def _(p, x):
    # x * clip(x / 6 + 1/2, 0, 1), in place after the first array
    with np.errstate(all="ignore"):
        t = np.divide(x, np.asarray(6, x.dtype))
        t += np.asarray(0.5, x.dtype)
        clip(t, 0, 1, out=t)
        return np.multiply(x, t, out=t).astype(x.dtype, copy=False)


@kernel(top.PReluOp)
def _(p, x, slope):
    return np.where(x >= 0, x, x * slope).astype(x.dtype, copy=False)


@kernel(top.PowOp)
def _(p: top.PowParams, x):
    with np.errstate(all="ignore"):
        if float(p.exponent).is_integer() and np.issubdtype(x.dtype, np.integer):
            return np.power(x, int(p.exponent))
        return np.power(x, np.asarray(p.exponent, x.dtype))


@kernel(top.Pow3Op)
def _(p, a, b):
    with np.errstate(all="ignore"):
        if np.issubdtype(a.dtype, np.integer) and np.issubdtype(b.dtype, np.integer):
            return np.power(a, b.astype(a.dtype))
        return np.power(a.astype(np.float64), b.astype(np.float64)).astype(a.dtype)


@kernel(top.MaxOp)
def _(p, *xs):
    return functools.reduce(np.maximum, xs)


@kernel(top.MinOp)
def _(p, *xs):
    return functools.reduce(np.minimum, xs)


@kernel(top.WhereOp)
def _(p, cond, a, b):
    return np.where(cond.astype(bool), a, b)


_COMPARE = {
    "Equal": np.equal,
    "NotEqual": np.not_equal,
    "Greater": np.greater,
    "GreaterOrEqual": np.greater_equal,
    "Less": np.less,
    "LessOrEqual": np.less_equal,
    "And": np.logical_and,
    "Or": np.logical_or,
    "Xor": np.logical_xor,
    "Not": np.logical_not,
}


@kernel(top.CompareOp)
def _(p: top.CompareParams, *xs):
    return _COMPARE[p.mode](*xs)


@kernel(top.CastOp)
def _(p: top.CastParams, x):
    to = dtype_from_name(p.to)
    if to == ml_dtypes.float8_e8m0fnu:  # a power of two: its own rounding rule
        return to_float8e8m0(x, saturate=p.saturate, round_mode=p.round_mode)
    if p.saturate and to.name.startswith("float8") and x.dtype.kind == "f":
        # clamp to +-max, infinities too (onnxruntime does so for the fnuz types as well,
        # although the spec's table says NaN there); NaN stays NaN
        big = float(ml_dtypes.finfo(to).max)
        x = np.clip(x, -big, big)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf -> int: ONNX leaves the value undefined
        return x.astype(to)  # float -> int truncates toward zero, as ONNX's C cast
