"""TPU ops' prepared kernels give their kernel's bits: the INT8 conv, and float paths on 16-bit operands."""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpubuild.ir import top, tpu
from tpubuild.kernels import Operand, get_kernel, prepare

NONE = Operand(None, None, None)


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()
    )


def weight(a) -> Operand:
    return Operand(a.shape, a.dtype, a) if a is not None else NONE


@st.composite
def int8_convs(draw):
    g = draw(st.sampled_from([1, 2, "depthwise"]))
    c = draw(st.integers(1, 6)) * (2 if g == 2 else 1)
    g = c if g == "depthwise" else g
    oc = g * draw(st.integers(1, 4))
    k = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    strides = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    unsigned = draw(st.booleans())
    zp = draw(st.sampled_from([0, 3])) if unsigned else draw(st.sampled_from([0, -2]))
    qmin, qmax = draw(st.sampled_from([(-128, 127), (0, 127), (0, 255)]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    p = tpu.ConvOp.PARAMS(
        kernel_shape=k,
        strides=strides,
        pads=tuple(draw(st.integers(0, 1)) for _ in range(4)),
        dilations=(1, 1),
        group=g,
        multiplier=tuple(int(m) for m in rng.integers(1, 2**31, oc)),
        rshift=tuple(int(r) for r in rng.integers(20, 40, oc)),
        in_zp=(zp,),
        out_zp=0,
        qmin=qmin,
        qmax=qmax,
    )
    spatial = (k[0] + draw(st.integers(0, 6)), k[1] + draw(st.integers(0, 6)))
    x = rng.integers(0, 256, (draw(st.integers(1, 2)), c) + spatial).astype(np.uint8 if unsigned else np.int8)
    # large weights over many taps: sums past 2^24, accumulated in float64
    w = rng.integers(-128, 128, (oc, c // g) + k).astype(np.int8)
    b = rng.integers(-(2**31), 2**31, oc).astype(np.int32) if draw(st.booleans()) else None
    return p, x, w, b


@settings(max_examples=200, deadline=None)
@given(int8_convs())
def test_prepared_int8_conv_is_the_kernel(case):
    p, x, w, b = case
    run = prepare(tpu.ConvOp, p, [Operand(x.shape, x.dtype, None), weight(w), weight(b)])
    assert not isinstance(run, functools.partial)
    kernel = functools.partial(get_kernel(tpu.ConvOp), p)
    assert same_bits(run(x, w, b), kernel(x, w, b))
    other = np.ascontiguousarray(x[..., ::-1])  # made once, run on any input
    assert same_bits(run(other, w, b), kernel(other, w, b))


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_prepared_float_paths_widen_16_bit_operands(dtype):
    """A TPU op on f16/bf16 operands runs its TOP op's prepared kernel on them widened (the conv's sliced)."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(1, 8, 6, 10)).astype(dtype)
    w, b = rng.normal(size=(8, 1, 3, 3)).astype(dtype), rng.normal(size=8).astype(np.float32)
    cases = [
        (
            tpu.ConvOp,
            tpu.ConvOp.PARAMS(
                kernel_shape=(3, 3), strides=(1, 1), pads=(1, 1, 1, 1), dilations=(1, 1), group=8, do_relu=True
            ),
            [x, w, b],
        ),
        (
            tpu.ConvOp,
            tpu.ConvOp.PARAMS(kernel_shape=(1, 1), strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1), group=1),
            [x, rng.normal(size=(5, 8, 1, 1)).astype(dtype), None],
        ),
        (tpu.AvgPoolOp, tpu.AvgPoolOp.PARAMS(kernel_shape=(6, 10), strides=(1, 1), pads=(0, 0, 0, 0)), [x]),
        (tpu.MIRROR[top.SoftmaxOp], top.SoftmaxParams(axis=-1), [x]),
        (tpu.MatMulOp, tpu.MatMulOp.PARAMS(), [x, rng.normal(size=(10, 4)).astype(dtype), None]),
    ]
    for cls, p, args in cases:
        consts = [a if i > 0 else None for i, a in enumerate(args)]
        spec = [Operand(a.shape, a.dtype, c) if a is not None else NONE for a, c in zip(args, consts, strict=True)]
        run = prepare(cls, p, spec)
        assert not isinstance(run, functools.partial), cls.name
        assert same_bits(run(*args), get_kernel(cls)(p, *args)), cls.name


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**16), st.booleans(), st.sampled_from([(0, 0), (3, -2)]), st.sampled_from([2, 3]))
def test_prepared_int8_matmul_is_the_kernel(seed, with_bias, zps, rank):
    rng = np.random.default_rng(seed)
    a = rng.integers(-128, 128, (2, 3, 7)[-rank:]).astype(np.int8)
    b = rng.integers(-128, 128, (7, 5)).astype(np.int8)
    bias = rng.integers(-(2**20), 2**20, 5).astype(np.int32) if with_bias else None
    p = tpu.MatMulOp.PARAMS(
        multiplier=tuple(int(m) for m in rng.integers(1, 2**31, 5)),
        rshift=tuple(int(r) for r in rng.integers(10, 40, 5)),
        in_zp=zps,
        out_zp=1,
    )
    run = prepare(tpu.MatMulOp, p, [Operand(a.shape, a.dtype, None), weight(b), weight(bias)])
    assert not isinstance(run, functools.partial)
    assert same_bits(run(a, b, bias), get_kernel(tpu.MatMulOp)(p, a, b, bias))


@pytest.mark.parametrize("cls", [top.ConvOp, tpu.ConvOp])
@pytest.mark.parametrize("shape, kernel, relu", [((1, 128, 12, 160), (3, 3), False), ((1, 16, 96, 96), (5, 5), True)])
def test_big_stride_1_depthwise_runs_the_flat_kernel(cls, shape, kernel, relu):
    """An input past nn_prepared._DEPTHWISE_FLAT at stride 1: nn's flat-plane kernel, the conv kernel's bits
    (a TOP conv whose planes the per-channel GEMV does not take, and a TPU conv, which the chip slices)."""
    rng = np.random.default_rng(2)
    c = shape[1]
    x = rng.normal(size=shape).astype(np.float32)
    w, b = rng.normal(size=(c, 1) + kernel).astype(np.float32), rng.normal(size=c).astype(np.float32)
    p = cls.PARAMS(
        kernel_shape=kernel,
        strides=(1, 1),
        pads=tuple(k // 2 for k in kernel) * 2,
        dilations=(1, 1),
        group=c,
        do_relu=relu,
    )
    run = prepare(cls, p, [Operand(x.shape, x.dtype, None), weight(w), weight(b)])
    assert type(run).__name__ in ("_DepthwiseFlat", "_DepthwiseGemv")
    assert cls is top.ConvOp or type(run).__name__ == "_DepthwiseFlat"
    assert same_bits(run(x, w, b), get_kernel(cls)(p, x, w, b))
