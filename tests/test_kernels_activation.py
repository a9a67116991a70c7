"""Activation kernels computed in place / on their own elements give the bits of their plain formulas; GELU
is within 1.2e-7 (its erfc's error) and an output rounding of the exact value."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tpubuild.ir import top
from tpubuild.kernels import get_kernel


def plain_sigmoid(x):
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype)


def plain_erf(x):
    z = np.abs(x.astype(np.float64))
    t = 1.0 / (1.0 + 0.5 * z)
    poly = -1.26551223 + t * (
        1.00002368
        + t
        * (
            0.37409196
            + t
            * (
                0.09678418
                + t
                * (
                    -0.18628806
                    + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))
                )
            )
        )
    )
    far = 1.0 - t * np.exp(-z * z + poly)
    z2 = z * z
    series = np.zeros_like(z)
    term = z.copy()
    for n in range(8):
        series += term / (2 * n + 1)
        term = -term * z2 / (n + 1)
    return np.copysign(np.where(z < 0.5, series * (2.0 / math.sqrt(math.pi)), far), x)


def plain_gelu(x, tanh):
    x64 = x.astype(np.float64)
    inner = np.tanh(math.sqrt(2.0 / math.pi) * (x64 + 0.044715 * x64**3)) if tanh else plain_erf(x64 / math.sqrt(2.0))
    return (0.5 * x64 * (1.0 + inner)).astype(x.dtype)


PLAIN = {
    "sigmoid": (top.SigmoidOp, top.SigmoidOp.PARAMS(), plain_sigmoid),
    "silu": (top.SiLUOp, top.SiLUOp.PARAMS(), lambda x: x * plain_sigmoid(x)),
    "hardswish": (
        top.HardSwishOp,
        top.HardSwishOp.PARAMS(),
        lambda x: x * np.clip(x / np.asarray(6, x.dtype) + np.asarray(0.5, x.dtype), 0, 1),
    ),
    "hardsigmoid": (
        top.HardSigmoidOp,
        top.HardSigmoidParams(alpha=0.3, beta=0.4),
        lambda x: np.clip(x * np.asarray(0.3, x.dtype) + np.asarray(0.4, x.dtype), 0, 1),
    ),
    "erf": (top.ErfOp, top.ErfOp.PARAMS(), lambda x: plain_erf(x).astype(x.dtype)),
    "gelu_tanh": (top.GELUOp, top.GeluParams("tanh"), lambda x: plain_gelu(x, True)),
}


def arrays(dtype):
    rng = np.random.default_rng(3)
    special = np.array(
        [
            0.0,
            -0.0,
            np.inf,
            -np.inf,
            np.nan,
            1e-40,
            -1e-40,
            88.7,
            -88.7,
            1e30,
            -1e30,
            0.5,
            -0.5,
            0.7071,
            -0.7071,
            3,
            -3,
            6,
            -6,
        ],
        np.float64,
    )
    with np.errstate(over="ignore"):
        yield special.astype(dtype)
    for n in (1, 17, 4099):
        for scale in (0.1, 1.0, 8.0, 100.0):
            yield (rng.normal(size=n) * scale).astype(dtype)
    grid = (rng.normal(size=(30, 40)) * 3).astype(dtype)
    yield grid.T  # not C-contiguous
    yield grid[:, ::3]


@pytest.mark.parametrize("name", sorted(PLAIN))
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_activation_is_its_plain_formula_bit_for_bit(name, dtype):
    cls, params, plain = PLAIN[name]
    for x in arrays(dtype):
        with np.errstate(all="ignore"):
            expect = np.asarray(plain(x.copy()))
            got = np.asarray(get_kernel(cls)(params, x))
        assert got.dtype == expect.dtype and got.shape == expect.shape
        assert got.tobytes() == expect.tobytes(), (name, x.dtype, x.shape)


def exact_gelu(x: np.ndarray) -> np.ndarray:
    """x Phi(x) in float64 from libm's erfc, element by element (-inf * 0: nan, as 0.5 x (1 + erf) gives)."""
    with np.errstate(invalid="ignore"):
        return np.array(
            [v * 0.5 * math.erfc(-v / math.sqrt(2.0)) if not math.isnan(v) else v for v in x.astype(np.float64).ravel()]
        ).reshape(x.shape)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_gelu_is_x_phi_x(dtype):
    """1 + erf(x / sqrt2) cancels in the negative tail (a thousandth off at -5 with a 1e-7 erf): the kernel's
    Phi comes from erfc, so every output is within erfc's fractional error of the exact value, rounded."""
    cls, params = top.GELUOp, top.GeluParams("normal")
    tails = np.concatenate([-np.geomspace(1e-3, 30, 400), np.geomspace(1e-3, 30, 400)]).astype(dtype)
    for x in [*arrays(dtype), tails]:
        with np.errstate(all="ignore"):
            got = np.asarray(get_kernel(cls)(params, x))
        expect = exact_gelu(x)
        assert got.dtype == x.dtype and got.shape == x.shape
        with np.errstate(invalid="ignore", over="ignore"):
            ulp = np.spacing(np.abs(expect).astype(dtype)).astype(np.float64)  # the output rounding
            err = np.abs(got.astype(np.float64) - expect)
        finite = np.isfinite(expect)
        bound = 1.2e-7 * np.abs(expect) + ulp + np.finfo(dtype).tiny  # (subnormal values carry fewer bits)
        assert (err[finite] <= bound[finite]).all(), (x.dtype, x.shape)
        assert np.array_equal(got[~finite].astype(np.float64), expect[~finite], equal_nan=True)
        zero = expect == 0
        assert (np.signbit(got[zero]) == np.signbit(expect[zero])).all()
