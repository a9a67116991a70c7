"""Prepared kernels (made once per operand shapes and weights) give their kernel's bits."""

from __future__ import annotations

import dataclasses
import functools
import math
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpubuild.ir import top, tpu
from tpubuild.kernels import Operand, get_kernel, prepare

F32 = np.dtype(np.float32)


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()
    )


@st.composite
def convs(draw):
    nd = draw(st.sampled_from([1, 2]))
    n, g = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    c, oc = g * draw(st.integers(1, 5)), g * draw(st.integers(1, 5))
    k = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    p = top.ConvParams(
        kernel_shape=k,
        strides=tuple(draw(st.integers(1, 2)) for _ in range(nd)),
        pads=tuple(draw(st.integers(0, 2)) for _ in range(2 * nd)),
        dilations=tuple(draw(st.integers(1, 2)) for _ in range(nd)),
        group=g,
        do_relu=draw(st.booleans()),
        relu_limit=draw(st.sampled_from([-1.0, 0.5, 6.0])),
    )
    spatial = tuple(draw(st.integers(1, 9)) for _ in range(nd))
    if any(s + p.pads[i] + p.pads[nd + i] < (k[i] - 1) * p.dilations[i] + 1 for i, s in enumerate(spatial)):
        spatial = tuple(s + (k[i] - 1) * p.dilations[i] + 1 for i, s in enumerate(spatial))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    x = rng.normal(size=(n, c) + spatial).astype(np.float32)
    w = rng.normal(size=(oc, c // g) + k).astype(np.float32)
    b = rng.normal(size=oc).astype(np.float32) if draw(st.booleans()) else None
    return p, x, w, b


def conv_operands(x, w, b) -> list[Operand]:
    bias = Operand(b.shape, F32, b) if b is not None else Operand(None, None, None)
    return [Operand(x.shape, x.dtype, None), Operand(w.shape, w.dtype, w), bias]


def as_op(cls, p: top.ConvParams):
    """p as ``cls``'s parameters: a TOP conv, or a TPU F32 conv (the chip slices it: its GEMMs differ)."""
    return p if cls is top.ConvOp else cls.PARAMS(**{f.name: getattr(p, f.name) for f in dataclasses.fields(p)})


@settings(max_examples=300, deadline=None)
@given(convs(), st.sampled_from([top.ConvOp, tpu.ConvOp]))
def test_prepared_conv_is_the_kernel(case, cls):
    p, x, w, b = case
    p, kernel = as_op(cls, p), get_kernel(cls)
    run = prepare(cls, p, conv_operands(x, w, b))
    assert same_bits(run(x, w, b), kernel(p, x, w, b))
    assert same_bits(run(x * 2, w, b), kernel(p, x * 2, w, b))  # made once, run on any input
    fortran = np.asfortranarray(x)  # not C-contiguous (a simulator tile may not be)
    assert same_bits(run(fortran, w, b), kernel(p, fortran, w, b))


@st.composite
def depthwise_convs(draw):
    c = draw(st.integers(2, 12))
    k = (draw(st.integers(1, 5)), draw(st.integers(1, 5)))
    p = top.ConvParams(
        kernel_shape=k,
        strides=(draw(st.integers(1, 3)), draw(st.integers(1, 3))),
        pads=tuple(draw(st.integers(0, 2)) for _ in range(4)),
        dilations=(draw(st.integers(1, 2)), draw(st.integers(1, 2))),
        group=c,
        do_relu=draw(st.booleans()),
        relu_limit=draw(st.sampled_from([-1.0, 6.0])),
    )
    spatial = tuple(draw(st.integers(1, 10)) + (k[i] - 1) * p.dilations[i] for i in range(2))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    x = rng.normal(size=(draw(st.integers(1, 2)), c) + spatial).astype(np.float32)
    w = rng.normal(size=(c, 1) + k).astype(np.float32)
    b = rng.normal(size=c).astype(np.float32) if draw(st.booleans()) else None
    return p, x, w, b


@settings(max_examples=300, deadline=None)
@given(depthwise_convs())
def test_prepared_depthwise_conv_is_the_kernel(case):
    p, x, w, b = case
    run = prepare(top.ConvOp, p, conv_operands(x, w, b))
    assert same_bits(run(x, w, b), get_kernel(top.ConvOp)(p, x, w, b))
    assert same_bits(run(x * 3, w, b), get_kernel(top.ConvOp)(p, x * 3, w, b))


@pytest.mark.parametrize(
    "shape, oc, kernel, stride",
    [
        ((1, 64, 24, 128), 8, (3, 3), (1, 1)),  # the columns go in several blocks of output rows
        ((2, 24, 8, 8), 24, (3, 3), (1, 1)),
        ((1, 32, 2, 96), 200, (1, 1), (1, 1)),  # 1x1: one GEMM
        ((1, 16, 9, 9), 8, (1, 1), (2, 2)),
        ((1, 8, 2, 20), 8, (5, 5), (1, 1)),  # rows of taps only see padding
        ((1, 200, 2, 96), 1, (5, 5), (1, 1)),  # depthwise (PP-OCR's)
        ((2, 72, 24, 24), 1, (3, 3), (2, 2)),
    ],
)
@pytest.mark.parametrize("cls", [top.ConvOp, tpu.ConvOp])
def test_prepared_conv_paths(shape, oc, kernel, stride, cls):
    rng = np.random.default_rng(0)
    group = shape[1] if oc == 1 else 1  # oc 1: depthwise
    oc = shape[1] if oc == 1 else oc
    x = rng.normal(size=shape).astype(np.float32)
    w = rng.normal(size=(oc, shape[1] // group) + kernel).astype(np.float32)
    b = rng.normal(size=oc).astype(np.float32)
    p = as_op(
        cls,
        top.ConvParams(
            kernel_shape=kernel,
            strides=stride,
            pads=tuple(k // 2 for k in kernel) * 2,
            dilations=(1, 1),
            group=group,
            do_relu=True,
        ),
    )
    run = prepare(cls, p, conv_operands(x, w, b))
    assert not isinstance(run, functools.partial)  # the prepared path, not the kernel
    assert same_bits(run(x, w, b), get_kernel(cls)(p, x, w, b))


@st.composite
def pools(draw):
    nd = draw(st.sampled_from([1, 2]))
    k = tuple(draw(st.integers(1, 4)) for _ in range(nd))
    strides = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    pads = tuple(draw(st.integers(0, k[i % nd] - 1)) for i in range(2 * nd))
    p = top.PoolParams(
        kernel_shape=k,
        strides=strides,
        pads=pads,
        ceil_mode=draw(st.booleans()),
        count_include_pad=draw(st.booleans()),
        do_relu=draw(st.booleans()),
    )
    spatial = tuple(k[i] + draw(st.integers(0, 8)) for i in range(nd))
    if draw(st.booleans()):  # a global pool
        p = top.PoolParams(kernel_shape=spatial, strides=(1,) * nd, pads=(0,) * (2 * nd))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    return p, rng.normal(size=(draw(st.integers(1, 2)), draw(st.integers(1, 4))) + spatial).astype(np.float32)


@settings(max_examples=300, deadline=None)
@given(pools(), st.sampled_from([top.MaxPoolOp, top.AvgPoolOp]))
def test_prepared_pool_is_the_kernel(case, cls):
    p, x = case
    run = prepare(cls, p, [Operand(x.shape, x.dtype, None)])
    assert same_bits(run(x), get_kernel(cls)(p, x))
    assert same_bits(run(-x), get_kernel(cls)(p, -x))


def _operands(*arrays, consts=()) -> list[Operand]:
    """Operands of these arrays (None: absent); the indices in ``consts`` are weights."""
    return [
        Operand(None, None, None) if a is None else Operand(a.shape, a.dtype, a if i in consts else None)
        for i, a in enumerate(arrays)
    ]


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(0, 2**16),
    st.booleans(),
    st.booleans(),
    st.integers(-2, -1),
    st.sampled_from([1e-5, 1e-12, 0.5]),
)
def test_prepared_layer_norm_is_the_kernel(rank, seed, with_scale, with_bias, axis, eps):
    rng = np.random.default_rng(seed)
    shape = tuple(rng.integers(1, 9, size=max(rank, 2)))
    x = (rng.normal(size=shape) * rng.choice([1e-3, 1.0, 1e3])).astype(np.float32)
    norm = shape[axis % len(shape) :]
    scale = rng.normal(size=norm).astype(np.float32) if with_scale else None
    bias = rng.normal(size=norm[-1:]).astype(np.float32) if with_bias else None
    p = top.LayerNormParams(axis=axis, eps=eps)
    run = prepare(top.LayerNormOp, p, _operands(x, scale, bias, consts=(1, 2)))
    assert not isinstance(run, functools.partial)
    assert same_bits(run(x, scale, bias), get_kernel(top.LayerNormOp)(p, x, scale, bias))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(0, 2**16), st.sampled_from([1.0, 0.5, 3.0]))
def test_prepared_softmax_is_the_kernel(rank, seed, beta):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=tuple(rng.integers(1, 9, size=rank))) * 10).astype(np.float32)
    p = top.SoftmaxParams(axis=int(rng.integers(-rank, rank)), beta=beta)
    run = prepare(top.SoftmaxOp, p, _operands(x))
    assert same_bits(run(x), get_kernel(top.SoftmaxOp)(p, x))


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**16), st.booleans(), st.booleans(), st.sampled_from([-1.0, 6.0]))
def test_prepared_matmul_is_the_kernel(seed, with_bias, relu, limit):
    rng = np.random.default_rng(seed)
    batch = tuple(rng.integers(1, 4, size=int(rng.integers(0, 3))))
    m, k, n = (int(v) for v in rng.integers(1, 40, size=3))
    a = rng.normal(size=batch + (m, k)).astype(np.float32)
    b = rng.normal(size=(k, n)).astype(np.float32)
    bias = rng.normal(size=n).astype(np.float32) if with_bias else None
    p = top.ReluParams(do_relu=relu, relu_limit=limit)
    run = prepare(top.MatMulOp, p, _operands(a, b, bias, consts=(1, 2)))
    assert same_bits(run(a, b, bias), get_kernel(top.MatMulOp)(p, a, b, bias))


def test_prepared_split_reshape_gather_are_the_kernels():
    x = np.arange(2 * 7 * 3, dtype=np.float32).reshape(2, 7, 3)
    for p in (top.SplitParams(axis=1, split_size=(2, 4, 1)), top.SplitParams(axis=-1, split_size=(1, 2))):
        got, expect = prepare(top.SplitOp, p, _operands(x))(x), get_kernel(top.SplitOp)(p, x)
        assert len(got) == len(expect) and all(same_bits(g, e) for g, e in zip(got, expect, strict=True))
    p = top.ShapeParams(shape=(14, 3))
    assert same_bits(prepare(top.ReshapeOp, p, _operands(x))(x), get_kernel(top.ReshapeOp)(p, x))
    indices = np.array([[0, -1], [6, 2]], np.int64)
    p = top.AxisParams(axis=1)
    run = prepare(top.GatherOp, p, _operands(x, indices, consts=(1,)))
    assert same_bits(run(x, indices), get_kernel(top.GatherOp)(p, x, indices))
    # an index out of range is left to the kernel, which fails the run (not the plan)
    bad = np.array([7], np.int64)
    assert isinstance(prepare(top.GatherOp, p, _operands(x, bad, consts=(1,))), functools.partial)


@settings(max_examples=150, deadline=None)
@given(
    st.integers(0, 2**16),
    st.sampled_from(["nearest", "linear", "cubic"]),
    st.sampled_from(["half_pixel", "asymmetric", "align_corners", "pytorch_half_pixel"]),
    st.sampled_from(["round_prefer_floor", "floor", "ceil"]),
)
def test_prepared_interp_is_the_kernel(seed, mode, coord_mode, nearest_mode):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(1, 2) + tuple(rng.integers(1, 7, size=2))).astype(np.float32)
    x.ravel()[:3] = [-0.0, np.nan, np.inf][: x.size]
    out = (1, 2) + tuple(int(v) for v in rng.integers(1, 13, size=2))
    p = top.InterpParams(
        shape=out,
        scales=tuple(o / i for o, i in zip(out, x.shape, strict=True)),
        mode=mode,
        coord_mode=coord_mode,
        nearest_mode=nearest_mode,
    )
    with np.errstate(invalid="ignore"):
        assert same_bits(prepare(top.InterpOp, p, _operands(x))(x), get_kernel(top.InterpOp)(p, x))


def depthwise_f64(p: top.ConvParams, x, w, b):
    """The depthwise conv in float64, tap by tap (a reference for any float32 summation order)."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    (pt, pl, pb, pr), (sh, sw), (dh, dw) = p.pads, p.strides, p.dilations
    xp = np.pad(x64, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    kh, kw = p.kernel_shape
    ho, wo = (xp.shape[2] - (kh - 1) * dh - 1) // sh + 1, (xp.shape[3] - (kw - 1) * dw - 1) // sw + 1
    y = np.zeros(x.shape[:2] + (ho, wo))
    for i in range(kh):
        for j in range(kw):
            y += (
                xp[:, :, i * dh : i * dh + (ho - 1) * sh + 1 : sh, j * dw : j * dw + (wo - 1) * sw + 1 : sw]
                * w64[None, :, 0, i, j, None, None]
            )
    y += b.astype(np.float64)[None, :, None, None]
    return np.maximum(y, 0) if p.do_relu else y


@pytest.mark.parametrize(
    "shape, kernel, stride, dilation, pads",
    [
        ((1, 88, 3, 96), (5, 5), (1, 1), (1, 1), (2, 2, 2, 2)),  # PP-OCR's: one block per channel
        ((2, 40, 3, 96), (5, 5), (2, 1), (1, 1), (2, 2, 2, 2)),  # two samples, a row of taps only in the padding
        ((1, 16, 48, 48), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1)),  # three blocks of 21 rows: grown, cropped
        ((1, 8, 50, 24), (3, 3), (1, 1), (1, 1), (1, 0, 0, 1)),  # two blocks of 44 rows, 49 of them output
        ((1, 8, 50, 48), (3, 3), (2, 2), (1, 1), (1, 0, 0, 1)),  # one block
        ((1, 3, 21, 300), (5, 5), (1, 1), (2, 1), (3, 2, 1, 4)),  # one output row per block, dilated
        ((1, 4, 40, 36), (3, 5), (2, 3), (3, 2), (3, 4, 2, 4)),  # strided and dilated: taps in several phases
    ],
)
def test_top_depthwise_conv_by_products(shape, kernel, stride, dilation, pads):
    """A TOP depthwise conv on planes big enough is one BLAS product per channel and block (nn.DepthwiseGemv):
    close to float64, the prepared kernel's bits the kernel's, the TPU conv (sliced) still tap by tap."""
    rng = np.random.default_rng(1)
    c = shape[1]
    x = rng.normal(size=shape).astype(np.float32)
    w = rng.normal(size=(c, 1) + kernel).astype(np.float32)
    b = rng.normal(size=c).astype(np.float32)
    p = top.ConvParams(kernel_shape=kernel, strides=stride, pads=pads, dilations=dilation, group=c, do_relu=True)
    run = prepare(top.ConvOp, p, conv_operands(x, w, b))
    assert type(run).__name__ == "_DepthwiseGemv"
    got = run(x, w, b)
    assert same_bits(got, get_kernel(top.ConvOp)(p, x, w, b))
    assert same_bits(run(x, w, b), got)  # made once, run again
    np.testing.assert_allclose(got, depthwise_f64(p, x, w, b), rtol=1e-5, atol=1e-5)
    tpu_p = as_op(tpu.ConvOp, p)
    assert type(prepare(tpu.ConvOp, tpu_p, conv_operands(x, w, b))).__name__ == "_DepthwiseNHWC"


def conv_f64(p: top.ConvParams, x, w, b):
    """The conv in float64 over a windows view (a reference for any float32 summation order)."""
    from tpubuild.kernels.nn import windows

    g = p.group
    win = windows(x.astype(np.float64), p.kernel_shape, p.strides, p.dilations, p.pads[:2], p.pads[2:])
    n, c, ho, wo = win.shape[:4]
    win = win.reshape(n, g, c // g, ho, wo, *p.kernel_shape)
    wg = w.astype(np.float64).reshape(g, -1, c // g, *p.kernel_shape)
    y = np.einsum("ngchwij,gocij->ngohw", win, wg).reshape(n, -1, ho, wo) + b.astype(np.float64)[None, :, None, None]
    return np.maximum(y, 0) if p.do_relu else y


@pytest.mark.parametrize(
    "shape, oc, group, kernel, dilation, pads",
    [
        ((1, 16, 16, 16), 16, 1, (3, 3), (1, 1), (1, 1, 1, 1)),  # demo_cnn's
        ((2, 12, 32, 32), 12, 1, (3, 3), (1, 1), (1, 1, 1, 1)),  # two samples
        ((1, 8, 9, 13), 6, 2, (3, 5), (2, 1), (2, 1, 3, 2)),  # groups, dilated, uneven pads
        ((1, 4, 7, 7), 5, 1, (2, 2), (1, 1), (0, 1, 1, 0)),
    ],
)
def test_top_conv_flat_columns(shape, oc, group, kernel, dilation, pads):
    """A TOP conv at stride 1 takes its columns from the flattened padded planes (nn.Im2colFlat): close to
    float64, the prepared kernel's bits the kernel's; the TPU conv (sliced) keeps the pixel-major GEMM."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=shape).astype(np.float32)
    w = rng.normal(size=(oc, shape[1] // group) + kernel).astype(np.float32)
    b = rng.normal(size=oc).astype(np.float32)
    p = top.ConvParams(kernel_shape=kernel, strides=(1, 1), pads=pads, dilations=dilation, group=group, do_relu=True)
    run = prepare(top.ConvOp, p, conv_operands(x, w, b))
    assert type(run).__name__ == "_Im2colFlat"
    got = run(x, w, b)
    assert same_bits(got, get_kernel(top.ConvOp)(p, x, w, b))
    np.testing.assert_allclose(got, conv_f64(p, x, w, b), rtol=1e-5, atol=1e-5)
    assert type(prepare(tpu.ConvOp, as_op(tpu.ConvOp, p), conv_operands(x, w, b))).__name__ == "_Im2col"


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 2),
    st.integers(1, 7),
    st.sampled_from([(3, 3), (5, 5), (1, 3), (3, 5)]),
    st.integers(1, 2),
    st.integers(1, 2),
    st.integers(0, 2**16),
    st.integers(1, 3),
)
def test_depthwise_gemv_blocks_of_channels_change_no_bits(n, c, kernel, stride, dilation, seed, chans):
    """nn.DepthwiseGemv builds and multiplies its columns a few channels at a time: each channel's products
    are the same BLAS calls on the same columns, so any block size gives the bits of one block of all."""
    from tpubuild.kernels import nn

    rng = np.random.default_rng(seed)
    h, w = (int(v) for v in rng.integers(10, 40, size=2))
    p = top.ConvParams(
        kernel_shape=kernel,
        strides=(stride, 1),
        pads=tuple(k // 2 for k in kernel) * 2,
        dilations=(1, dilation),
        group=c,
    )
    x = rng.normal(size=(n, c, h, w)).astype(np.float32)
    b = rng.normal(size=c).astype(np.float32)
    out_sp = tuple(
        (s + k // 2 * 2 - (k - 1) * d - 1) // st + 1
        for s, k, d, st in zip((h, w), kernel, p.dilations, p.strides, strict=True)
    )
    taps = nn._live_taps(p, (h, w), out_sp)
    wt = rng.normal(size=(c, 1, len(taps))).astype(np.float32)
    results = []
    for block in (1 << 40, 1, chans * math.prod(nn.DepthwiseGemv(p, x.shape, taps, out_sp).cols[2:]) * 4 * n):
        with mock.patch.object(nn, "_DEPTHWISE_BLOCK", block):
            conv = nn.DepthwiseGemv(p, x.shape, taps, out_sp)
        assert conv.chans == (c if block > 1 << 30 else min(c, chans) if block > 1 else 1)
        results.append((conv(x, conv.weights(wt, b)), conv(x, conv.weights(wt, None))))
    for with_bias, without in results[1:]:
        assert same_bits(with_bias, results[0][0]) and same_bits(without, results[0][1])


def test_depthwise_gemv_result_is_its_own_array():
    """A 3x1 kernel without pads crops nothing out of the products (their scratch buffer): the result is a copy,
    which the next call leaves as it is."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(1, 4, 40, 40)).astype(np.float32)
    w = rng.normal(size=(4, 1, 3, 1)).astype(np.float32)
    p = top.ConvParams(kernel_shape=(3, 1), strides=(1, 1), pads=(1, 0, 1, 0), dilations=(1, 1), group=4)
    run = prepare(top.ConvOp, p, conv_operands(x, w, None))
    assert type(run).__name__ == "_DepthwiseGemv"
    first = run(x, w, None)
    expect = first.copy()
    second = run(-x, w, None)
    assert same_bits(first, expect) and same_bits(first, get_kernel(top.ConvOp)(p, x, w, None))
    assert same_bits(second, get_kernel(top.ConvOp)(p, -x, w, None))


def test_depthwise_gemv_views_follow_the_scratch_buffers():
    """nn.DepthwiseGemv keeps its views of this thread's scratch buffers between calls; another conv's call that
    replaces a buffer (a bigger one, or here a fresh one) has them made again: the bits of the kernel."""
    from tpubuild.kernels import nn

    rng = np.random.default_rng(4)
    convs = []
    for shape, kernel, stride in [((1, 8, 20, 30), (3, 3), (1, 1)), ((1, 48, 40, 40), (5, 5), (2, 2))]:
        x = rng.normal(size=shape).astype(np.float32)
        w = rng.normal(size=(shape[1], 1) + kernel).astype(np.float32)
        b = rng.normal(size=shape[1]).astype(np.float32)
        p = top.ConvParams(
            kernel_shape=kernel,
            strides=stride,
            pads=tuple(k // 2 for k in kernel) * 2,
            dilations=(1, 1),
            group=shape[1],
        )
        run = prepare(top.ConvOp, p, conv_operands(x, w, b))
        assert type(run).__name__ == "_DepthwiseGemv"
        convs.append((run, x, w, b, get_kernel(top.ConvOp)(p, x, w, b)))
    for i, (run, x, w, b, expect) in enumerate(convs + convs + convs[:1]):
        if i == 3:
            for scratch in (nn._PLANES, nn._COLUMNS, nn._PRODUCTS):
                scratch.buf = np.full(scratch.buf.size, 255, np.uint8)  # replaced, and not zeros
        assert same_bits(run(x, w, b), expect)
        assert run.conv._views.key == tuple(id(s.buf) for s in (nn._PLANES, nn._COLUMNS, nn._PRODUCTS))


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**16), st.booleans())
def test_prepared_hardswish_is_the_kernel(seed, fortran):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=tuple(int(v) for v in rng.integers(1, 9, size=int(rng.integers(1, 5))))) * 5).astype(
        np.float32
    )
    x.ravel()[:6] = np.array([np.nan, np.inf, -np.inf, -0.0, 3.0, -3.0], np.float32)[: x.size]
    x = np.asfortranarray(x) if fortran else x
    run = prepare(top.HardSwishOp, None, _operands(x))
    assert not isinstance(run, functools.partial)
    assert same_bits(run(x), get_kernel(top.HardSwishOp)(None, x))


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**16), st.sampled_from(["C", "F", "strided"]))
def test_prepared_silu_is_the_kernel(seed, layout):
    """x * sigmoid(x) with -|x| made as x with its sign bit set: the kernel's bits on NaNs of either sign and
    payload, infinities, zeros of either sign, subnormals, big values."""
    rng = np.random.default_rng(seed)
    shape = tuple(int(v) for v in rng.integers(1, 9, size=int(rng.integers(1, 5))))
    x = (rng.normal(size=shape) * rng.choice([1e-3, 1.0, 30.0, 1e3], size=shape)).astype(np.float32)
    special = np.array(
        [
            0x7FC00000,
            0xFFC00000,
            0x7FC01234,
            0xFFD00001,
            0x7F800000,
            0xFF800000,
            0,
            0x80000000,
            1,
            0x80000001,
            0x7F7FFFFF,
            0xFF7FFFFF,
        ],
        np.uint32,
    ).view(np.float32)
    where = rng.random(size=shape) < 0.3
    x[where] = rng.choice(special, size=int(where.sum()))
    x = np.asfortranarray(x) if layout == "F" else x[..., ::2] if layout == "strided" else x
    run = prepare(top.SiLUOp, None, _operands(x))
    assert not isinstance(run, functools.partial)
    with np.errstate(all="ignore"):
        assert same_bits(run(x), get_kernel(top.SiLUOp)(None, x))


@pytest.mark.parametrize(
    "shape, kernel, stride, dilation, pads, ceil",
    [
        ((1, 16, 32, 32), (3, 3), (2, 2), (1, 1), (1, 1, 1, 1), False),  # demo_cnn's
        ((2, 3, 9, 11), (3, 2), (2, 3), (2, 1), (1, 0, 0, 1), True),  # two samples, dilated, ceil's grown pads
        ((1, 8, 20, 20), (5, 5), (1, 1), (1, 1), (2, 2, 2, 2), False),  # YOLO's SPPF
        ((1, 4, 7, 7), (2, 2), (2, 2), (1, 1), (0, 0, 0, 0), True),
        ((3, 5, 1), (1, 3), (1, 2), (1, 1), (0, 1, 0, 1), False),  # a 3-D tensor, one row
    ],
)
def test_top_max_pool_by_shifted_runs(shape, kernel, stride, dilation, pads, ceil):
    """TOP's 2-D float32 max pool takes maxima of shifted runs of its flattened planes (_ShiftedMax): the
    kernel's bits, again on a second call (its scratch reused); the TPU's keeps the kernel's views."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=shape).astype(np.float32)
    x.ravel()[:3] = [np.inf, -np.inf, 0.0]
    p = top.PoolParams(kernel_shape=kernel, strides=stride, pads=pads, dilations=dilation, ceil_mode=ceil)
    run = prepare(top.MaxPoolOp, p, [Operand(x.shape, F32, None)])
    assert type(run).__name__ == "_ShiftedMax"
    expect = get_kernel(top.MaxPoolOp)(p, x)
    assert same_bits(run(x), expect) and same_bits(run(x), expect)
    relu = dataclasses.replace(p, do_relu=True)
    assert same_bits(prepare(top.MaxPoolOp, relu, [Operand(x.shape, F32, None)])(x), get_kernel(top.MaxPoolOp)(relu, x))
    tpu_p = tpu.MaxPoolOp.PARAMS(**{f.name: getattr(p, f.name) for f in dataclasses.fields(p)})
    assert type(prepare(tpu.MaxPoolOp, tpu_p, [Operand(x.shape, F32, None)])).__name__ != "_ShiftedMax"
