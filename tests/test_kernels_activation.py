"""Activation kernels computed in place / on their own elements give the bits of their plain formulas."""

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
    poly = (-1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (
        0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277)))))))))
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
    inner = (np.tanh(math.sqrt(2.0 / math.pi) * (x64 + 0.044715 * x64 ** 3)) if tanh
             else plain_erf(x64 / math.sqrt(2.0)))
    return (0.5 * x64 * (1.0 + inner)).astype(x.dtype)


PLAIN = {
    "sigmoid": (top.SigmoidOp, top.SigmoidOp.PARAMS(), plain_sigmoid),
    "silu": (top.SiLUOp, top.SiLUOp.PARAMS(), lambda x: x * plain_sigmoid(x)),
    "hardswish": (top.HardSwishOp, top.HardSwishOp.PARAMS(),
                  lambda x: x * np.clip(x / np.asarray(6, x.dtype) + np.asarray(0.5, x.dtype), 0, 1)),
    "hardsigmoid": (top.HardSigmoidOp, top.HardSigmoidParams(alpha=0.3, beta=0.4),
                    lambda x: np.clip(x * np.asarray(0.3, x.dtype) + np.asarray(0.4, x.dtype), 0, 1)),
    "erf": (top.ErfOp, top.ErfOp.PARAMS(), lambda x: plain_erf(x).astype(x.dtype)),
    "gelu": (top.GELUOp, top.GeluParams("normal"), lambda x: plain_gelu(x, False)),
    "gelu_tanh": (top.GELUOp, top.GeluParams("tanh"), lambda x: plain_gelu(x, True)),
}


def arrays(dtype):
    rng = np.random.default_rng(3)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 88.7, -88.7, 1e30, -1e30, 0.5, -0.5,
                        0.7071, -0.7071, 3, -3, 6, -6], np.float64)
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
