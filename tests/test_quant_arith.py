"""The INT8 arithmetic pinned by hand-worked values (tpu_arith.py and lower/quant.py state the rules).

Expected numbers come from the rules, worked out here by hand: round half away
from zero, m / 2^r with m in [2^30, 2^31), saturation at the storage bounds.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpubuild.calib.table import Entry
from tpubuild.ir import tpu
from tpubuild.kernels import get_kernel
from tpubuild.kernels.tpu_arith import requantize, requantize_sums, round_half_away, rshift_round
from tpubuild.lower.quant import (
    QType,
    activation_qtype,
    channel_scales,
    multiplier_rshift,
    quantize_bias,
    quantize_per_channel,
    round_half_away_exact,
    shared_rshift,
)

M_HALF = 2**30  # with r = 31: x 0.5


# ---- rounding --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "v, r, expect",
    [
        (5, 1, 3),
        (-5, 1, -3),  # 2.5 -> 3, -2.5 -> -3 (ties away from zero)
        (3, 1, 2),
        (-3, 1, -2),  # 1.5, -1.5
        (1, 1, 1),
        (-1, 1, -1),  # 0.5, -0.5
        (6, 2, 2),
        (-6, 2, -2),  # 1.5, -1.5
        (2, 2, 1),
        (-2, 2, -1),  # 0.5, -0.5
        (-7, 2, -2),
        (7, 2, 2),  # -1.75, 1.75
        (5, 2, 1),
        (-5, 2, -1),  # 1.25, -1.25
        (4, 0, 4),
        (-4, 0, -4),  # no shift
        (2**62 - 1, 62, 1),
        (-(2**62 - 1), 62, -1),  # largest magnitudes: no int64 overflow
    ],
)
def test_rshift_rounds_half_away_from_zero(v, r, expect):
    assert int(rshift_round(np.int64(v), r)) == expect


def test_rshift_matches_exact_integer_rounding():
    """Many values and shifts (per channel, zeros included) against Python's exact integers: |v| / 2^r
    rounded half up, the sign put back."""
    rng = np.random.default_rng(3)
    v = rng.integers(-(2**40), 2**40, size=(3, 6, 50))
    v[0, :, :21] = np.arange(-10, 11)  # ties and small values around zero
    shift = np.array([0, 1, 2, 7, 20, 40]).reshape(1, 6, 1)
    got = rshift_round(v, shift)
    for (i, c, j), value in np.ndenumerate(v):
        r, mag = int(shift[0, c, 0]), abs(int(value))
        want = (mag + (1 << r >> 1)) >> r
        assert got[i, c, j] == (-want if value < 0 else want), (value, r)


def test_rshift_per_channel_broadcast():
    v = np.array([[5, 5], [-5, -5]], np.int64)
    assert rshift_round(v, np.array([1, 2])).tolist() == [[3, 1], [-3, -1]]


@pytest.mark.parametrize(
    "x, expect",
    [
        (0.5, 1),
        (-0.5, -1),
        (1.5, 2),
        (-1.5, -2),
        (2.5, 3),
        (-2.5, -3),
        (0.49999999999999994, 0),
        (2.4999999, 2),
        (-0.0, 0),
    ],
)
def test_round_half_away(x, expect):
    assert int(round_half_away(x)) == expect
    assert round_half_away_exact(x) == expect


# ---- multiplier and shift --------------------------------------------------------------


@pytest.mark.parametrize(
    "scale, m, r",
    [
        (0.5, 2**30, 31),  # 0.5 = 2^30 / 2^31
        (0.75, 1610612736, 31),  # 0.75 * 2^31
        (1 / 3, 1431655765, 32),  # 2/3 * 2^31 = 1431655765.33 -> down
        (1.0, 2**30, 30),
        (3.0, 1610612736, 29),  # 0.75 * 2^31 / 2^29
        (0.5 + 2**-32, 2**30 + 1, 31),  # exactly 2^30 + 0.5 at r = 31: the tie rounds up
        (2.0**-40, 2**23, 63),  # r capped at 63: m = 2^-40 * 2^63
        (2.0**31, 2**31 - 1, 0),  # too large: saturated
        (0.0, 0, 0),
    ],
)
def test_multiplier_and_rshift(scale, m, r):
    assert multiplier_rshift(scale) == (m, r)


def test_multiplier_rounding_up_to_2_pow_31_drops_a_bit():
    # 1 - 2^-40: m = round((1 - 2^-40) * 2^31) = 2^31, which does not fit: r one less, m = 2^30
    assert multiplier_rshift(1 - 2.0**-40) == (2**30, 30)


def test_shared_rshift_fits_the_largest_scale():
    ms, r = shared_rshift([0.5, 0.25, 0.1])
    assert r == 31
    assert ms == [2**30, 2**29, 214748365]  # 0.1 * 2^31 = 214748364.8 -> 214748365


def test_negative_scale_refused():
    with pytest.raises(ValueError):
        multiplier_rshift(-0.5)


# ---- requantization and saturation --------------------------------------------------------


def test_requantize_halves_with_ties_away_and_saturates():
    acc = np.array([100, 101, -101, 13, -7, 5, 1000, -1000], np.int64)
    y = requantize(acc, M_HALF, 31, 0, -128, 127)
    assert y.tolist() == [50, 51, -51, 7, -4, 3, 127, -128]


def test_requantize_unsigned_with_zero_point():
    acc = np.array([-1000, -20, 0, 300, 1000], np.int64)
    # x 0.5 then + zp 10, in [0, 255]
    assert requantize(acc, M_HALF, 31, 10, 0, 255).tolist() == [0, 0, 10, 160, 255]


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.sampled_from([np.float32, np.float64]),
    st.integers(1, 40),
    st.sampled_from([(-128, 127, 0), (0, 255, 0), (0, 255, 37), (-128, 127, -5), (-(2**20), 2**20, 3)]),
    st.booleans(),
    st.booleans(),
)
def test_requantize_sums_is_the_integer_form(seed, acc_dtype, size, bounds, with_bias, big):
    """The float64 path (and its fallback) gives requantize's bits on saturated int32 sums: ties made on purpose
    (sums that are odd multiples of 2^(r - 1) / m), sums past int32 with the bias, multipliers near 2^31."""
    rng = np.random.default_rng(seed)
    qmin, qmax, zp = bounds
    channels = 3
    limit = 2**40 if big else (2**24 if acc_dtype == np.float32 else 2**31)
    acc = rng.integers(-limit, limit, (size, channels)).astype(acc_dtype)
    shift = rng.integers(0, 45, channels)
    mult = np.where(rng.random(channels) < 0.5, rng.integers(2**30, 2**31, channels), rng.integers(1, 9, channels))
    ties = mult == 1  # 2^(r - 1) itself: exactly half of 2^r
    acc[:, ties] = (
        np.where(rng.random((size, int(ties.sum()))) < 0.5, -1, 1)
        * np.ldexp(1.0, np.maximum(shift[ties] - 1, 0))
        * rng.choice([1, 3, 5], (size, int(ties.sum())))
    )
    acc = acc.astype(acc_dtype)
    bias = rng.integers(-(2**31), 2**31, channels).astype(np.int32) if with_bias else None
    wide = acc.astype(np.float64) + (0 if bias is None else bias)
    want = requantize(np.clip(np.rint(wide), -(2**31), 2**31 - 1).astype(np.int64), mult, shift, zp, qmin, qmax)
    got = requantize_sums(acc, bias, mult, shift, zp, qmin, qmax)
    assert got.tolist() == want.tolist()
    assert got.dtype == (
        np.int8 if qmin >= -128 and qmax <= 127 else np.uint8 if qmin >= 0 and qmax <= 255 else np.int64
    )


def test_requantize_per_channel():
    acc = np.array([[10, 10], [-10, -10]], np.int64)  # channels along axis 1
    y = requantize(acc, np.array([[M_HALF, 3 * 2**29]]), np.array([[31, 31]]), 0, -128, 127)
    assert y.tolist() == [[5, 8], [-5, -8]]  # x 0.5; x 0.75: 7.5 -> 8, -7.5 -> -8


# ---- activation and weight quantization ------------------------------------------------------


def test_symmetric_activation_scales():
    assert activation_qtype(Entry(12.7, -3.0, 12.7), False) == QType("i8", 12.7 / 127)
    assert activation_qtype(Entry(12.75, 0.0, 12.75), False) == QType("u8", 12.75 / 255)  # non-negative: 255 steps


def test_asymmetric_zero_point():
    q = activation_qtype(Entry(3.0, -1.0, 3.0), True)
    assert q.storage == "i8" and q.scale == pytest.approx(4 / 255)
    # -128 - round(-1 / (4/255)) = -128 - round(-63.75) = -128 + 64
    assert q.zero_point == -64
    assert q.stored(0.0) == -64 and q.stored(-1.0) == -128 and q.stored(3.0) == 127


def test_asymmetric_range_is_clipped_to_the_threshold():
    # observed [-1, 8], threshold 2 (the method clipped the outliers): range [-1, 2], scale 3/255
    q = activation_qtype(Entry(2.0, -1.0, 8.0), True)
    assert q.scale == pytest.approx(3 / 255)
    assert q.zero_point == -43  # -128 - round(-1 / (3/255)) = -128 + 85
    assert q.stored(8.0) == 127  # beyond the threshold: saturated


def test_asymmetric_range_always_holds_zero():
    q = activation_qtype(Entry(5.0, 1.0, 5.0), True)  # min > 0: widened to [0, 5]
    assert q.zero_point == -128 and q.stored(0.0) == -128


def test_activation_quantize_and_saturate():
    q = QType("i8", 0.5)
    assert q.quantize(np.array([0.25, -0.25, 0.75, 100.0, -100.0])).tolist() == [1, -1, 2, 127, -128]
    u = QType("u8", 0.5, 0)
    assert u.quantize(np.array([-1.0, 0.25, 200.0])).tolist() == [0, 1, 255]


def test_per_channel_weights():
    w = np.array([[127.0, -63.5], [254.0, 63.0]], np.float32)  # scales 1 and 2: exact ties
    s = channel_scales(w, 0)
    assert s.tolist() == [1.0, 2.0]
    assert quantize_per_channel(w, s, 0).tolist() == [[127, -64], [127, 32]]  # -63.5 -> -64, 31.5 -> 32


def test_per_channel_scales_along_last_axis_and_zero_channel():
    w = np.array([[2.0, 0.0], [-4.0, 0.0]], np.float32)
    assert channel_scales(w, 1).tolist() == [4 / 127, 1.0]


def test_bias_in_accumulator_units_saturates():
    assert quantize_bias(np.array([1.0, -0.125, 1e9]), np.array([0.01, 0.25, 1e-3])).tolist() == [
        100,
        -1,
        2**31 - 1,
    ]  # -0.5 -> -1 (away from zero); 1e12 saturates


# ---- kernels: the integer paths on hand-computed cases ----------------------------------------


def params(cls, **kw):
    return cls.PARAMS(**kw)


def test_conv_int8_path():
    # 1x1 conv, one channel: acc = 2x + 3, then x 0.5: [13, -7, 5] -> [6.5, -3.5, 2.5] -> [7, -4, 3]
    p = params(
        tpu.ConvOp,
        kernel_shape=(1, 1),
        strides=(1, 1),
        pads=(0, 0, 0, 0),
        dilations=(1, 1),
        multiplier=(M_HALF,),
        rshift=(31,),
    )
    x = np.array([5, -5, 1], np.int8).reshape(1, 1, 1, 3)
    w = np.array([2], np.int8).reshape(1, 1, 1, 1)
    b = np.array([3], np.int32)
    assert get_kernel(tpu.ConvOp)(p, x, w, b).ravel().tolist() == [7, -4, 3]


def test_conv_int8_zero_point_and_padding_is_real_zero():
    # asymmetric input (zp 10): a 3-wide window over [zp] padded with real zeros sums to (12-10) = 2
    p = params(
        tpu.ConvOp,
        kernel_shape=(1, 3),
        strides=(1, 1),
        pads=(0, 1, 0, 1),
        dilations=(1, 1),
        multiplier=(2**30,),
        rshift=(30,),
        in_zp=(10,),
    )
    x = np.array([12], np.int8).reshape(1, 1, 1, 1)
    w = np.ones((1, 1, 1, 3), np.int8)
    assert get_kernel(tpu.ConvOp)(p, x, w, None).ravel().tolist() == [2]


@pytest.mark.parametrize("kernel, channels, group", [((3, 3), 8, 1), ((5, 5), 16, 16), ((1, 1), 2048, 1)])
def test_conv_int8_accumulates_exactly_in_float32_or_float64(kernel, channels, group):
    """Small enough partial sums run in float32 whole (depthwise 5x5, 3x3 over 8 channels), others in float32
    over spans of the input channels, added in float64 (1x1 over 2048 channels of +-127: 255 * 127 * 2048 >
    2^24): either way the accumulator is the exact integer sum, as computed here in int64 (with the weights at
    the storage extremes, where float32 over all channels at once would round), in the kernel and prepared."""
    from tpubuild.kernels.registry import Operand, prepare
    from tpubuild.kernels.tpu import conv_spans

    rng = np.random.default_rng(5)
    x = rng.integers(-128, 128, (1, channels, 6, 7)).astype(np.int8)
    x.flat[:3] = [-128, 127, -128]
    w = rng.choice(np.array([-128, 127, -127, 3], np.int8), (channels, channels // group) + kernel)
    b = rng.integers(-(2**30), 2**30, channels).astype(np.int32)
    zp = -7
    pads = tuple(k // 2 for k in kernel) * 2
    p = params(
        tpu.ConvOp,
        kernel_shape=kernel,
        strides=(1, 1),
        pads=pads,
        dilations=(1, 1),
        group=group,
        multiplier=(2**30,) * channels,
        rshift=(30,),
        in_zp=(zp,),
        qmin=-(2**31),
        qmax=2**31 - 1,
    )
    xs = np.pad(x.astype(np.int64) - zp, [(0, 0), (0, 0)] + [(k // 2, k // 2) for k in kernel])
    want = np.zeros((1, channels, 6, 7), np.int64)
    cg = channels // group
    for o in range(channels):
        g = o // (channels // group)
        for i in range(kernel[0]):
            for j in range(kernel[1]):
                want[0, o] += np.tensordot(
                    w[o, :, i, j].astype(np.int64), xs[0, g * cg : (g + 1) * cg, i : i + 6, j : j + 7], 1
                )
    want = np.clip(want + b.reshape(1, -1, 1, 1), -(2**31), 2**31 - 1)
    spans = conv_spans(x.dtype, zp, w, group)
    assert spans is not None and (len(spans) > 1) == (channels == 2048)
    assert all(c.stop - c.start < channels for c in spans[1:] if c.stop is not None)
    assert np.array_equal(get_kernel(tpu.ConvOp)(p, x, w, b), want)
    operands = [Operand(x.shape, x.dtype, None), Operand(w.shape, w.dtype, w), Operand(b.shape, b.dtype, b)]
    assert np.array_equal(prepare(tpu.ConvOp, p, operands)(x, w, b), want)


@pytest.mark.parametrize("block", [1 << 20, 4 * 7, 4])
def test_float32_spans_only_where_every_span_is_exact(block, monkeypatch):
    """One channel whose own sums may pass 2^24 (a 40x40 kernel of 127s: 128 * 127 * 1600), or a grouped conv
    that would need its channels split, runs in float64 (None); spans otherwise close just before the bound,
    however many inputs f32_spans takes at a time (all; 7 or 1 of 4 outputs' channels)."""
    from tpubuild.kernels import tpu as tpu_kernels
    from tpubuild.kernels.tpu import F32_EXACT, conv_spans

    monkeypatch.setattr(tpu_kernels, "_SPAN_BLOCK", block)

    assert conv_spans(np.dtype(np.int8), 0, np.full((2, 1, 40, 40), 127, np.int8)) is None
    w = np.full((4, 1024, 1, 1), 127, np.int8)  # 128 * 127 per channel: 1032 of them fit in 2^24
    assert conv_spans(np.dtype(np.int8), 0, w, group=1) == [slice(None)]
    wide = np.full((4, 2100, 1, 1), 127, np.int8)
    spans = conv_spans(np.dtype(np.int8), 0, wide, group=1)
    assert spans == [slice(0, 1032), slice(1032, 2064), slice(2064, 2100)]
    assert 1032 * 128 * 127 <= F32_EXACT < 1033 * 128 * 127
    assert conv_spans(np.dtype(np.int8), 0, wide, group=2) is None


def test_matmul_int8_per_channel():
    p = params(tpu.MatMulOp, multiplier=(M_HALF, 2**30), rshift=(31, 30), in_zp=(1, 0))
    a = np.array([[3, 5]], np.int8)  # minus zp 1: [2, 4]
    b = np.array([[1, 2], [1, -3]], np.int8)
    # [2+4, 4-12] = [6, -8]; x [0.5, 1.0] -> [3, -8]
    assert get_kernel(tpu.MatMulOp)(p, a, b, None).tolist() == [[3, -8]]


@pytest.mark.parametrize(
    "k, b_dtype, zp_b, split", [(64, np.int8, 0, False), (3000, np.int8, 0, True), (1200, np.uint8, -3, True)]
)
def test_matmul_int8_accumulates_exactly_over_float32_spans(k, b_dtype, zp_b, split):
    """A matmul of stored values at their extremes sums in float32, over spans of K where its sums can pass 2^24
    (3000 x 128 x 127; 1200 x 128 x 258, uint8 minus zero point -3 reaching 258), in the kernel (b a tensor, as
    attention reads it) and prepared (b a weight): its accumulator is the exact integer sum, computed here in
    int64."""
    from tpubuild.kernels.registry import Operand, prepare
    from tpubuild.kernels.tpu import matmul_spans

    rng = np.random.default_rng(7)
    a = rng.choice(np.array([-128, 127, -127], np.int8), (2, 3, k))
    info = np.iinfo(b_dtype)
    b = rng.choice(np.array([info.min, info.max], b_dtype), (k, 5))
    p = params(tpu.MatMulOp, multiplier=(2**30,) * 5, rshift=(30,), in_zp=(-1, zp_b), qmin=-(2**31), qmax=2**31 - 1)
    want = np.clip((a.astype(np.int64) + 1) @ (b.astype(np.int64) - zp_b), -(2**31), 2**31 - 1)
    assert (len(matmul_spans(a.dtype, -1, b, zp_b)) > 1) == split
    assert np.array_equal(get_kernel(tpu.MatMulOp)(p, a, b, None), want)
    operands = [Operand(a.shape, a.dtype, None), Operand(b.shape, b.dtype, b), Operand(None, None, None)]
    assert np.array_equal(prepare(tpu.MatMulOp, p, operands)(a, b, None), want)


def test_add_sub_int8():
    a, b = np.array([10, -10], np.int8), np.array([3, 3], np.int8)
    p = params(tpu.AddOp, multiplier=(M_HALF, M_HALF), rshift=(31,))
    assert get_kernel(tpu.AddOp)(p, a, b).tolist() == [7, -4]  # 6.5, -3.5
    p = params(tpu.SubOp, multiplier=(M_HALF, M_HALF), rshift=(31,), in_zp=(0, 1), out_zp=-100)
    assert get_kernel(tpu.SubOp)(p, a, b).tolist() == [-96, -106]  # (10-2)/2 = 4, (-10-2)/2 = -6; + zp


def test_add_int8_fused_relu_is_the_clamp():
    p = params(tpu.AddOp, multiplier=(2**30, 2**30), rshift=(30,), out_zp=-5, qmin=-5, qmax=20)
    assert get_kernel(tpu.AddOp)(p, np.array([-50, 10, 30], np.int8), np.zeros(3, np.int8)).tolist() == [-5, 5, 20]


def test_mul_int8():
    p = params(tpu.MulOp, multiplier=(M_HALF,), rshift=(31,), in_zp=(0, 2))
    # 7 * (3-2) = 7 -> 3.5 -> 4; -7 -> -4; 100 * 100 saturates
    assert get_kernel(tpu.MulOp)(p, np.array([7, -7, 100], np.int8), np.array([3, 3, 102], np.int8)).tolist() == [
        4,
        -4,
        127,
    ]


def test_concat_requantizes_each_branch():
    # branch a (scale 0.01) -> output scale 1.0: x 0.01; branch b already at the output's scale
    ma, ra = multiplier_rshift(0.01)
    p = params(tpu.ConcatOp, axis=0, multiplier=(ma, 1), rshift=(ra, 0), in_zp=(0, 0))
    y = get_kernel(tpu.ConcatOp)(p, np.array([100, -50, 127], np.int8), np.array([5], np.int8))
    assert y.tolist() == [1, -1, 1, 5]  # 1.0, -0.5 -> -1 (away), 1.27 -> 1


def test_avgpool_int8_by_window_count():
    # 2x2 window with no padding: count 4, multiplier 1/4 = 2^30 / 2^32
    p = params(
        tpu.AvgPoolOp,
        kernel_shape=(2, 2),
        strides=(2, 2),
        pads=(0, 0, 0, 0),
        multiplier=(2**30,),
        rshift=(32,),
        counts=(4,),
        qmin=0,
        qmax=255,
    )
    x = np.array([[1, 2], [3, 4]], np.uint8).reshape(1, 1, 2, 2)  # sum 10 -> 2.5 -> 3
    assert get_kernel(tpu.AvgPoolOp)(p, x).ravel().tolist() == [3]


def test_avgpool_int8_padding_counts_real_elements():
    # 3-wide window over [8, 8] padded by 1 on each side, count_include_pad off: counts 2 and 2
    p = params(
        tpu.AvgPoolOp,
        kernel_shape=(1, 3),
        strides=(1, 1),
        pads=(0, 1, 0, 1),
        multiplier=(2**30,),
        rshift=(31,),
        counts=(2,),
    )
    x = np.array([8, 7], np.int8).reshape(1, 1, 1, 2)
    assert get_kernel(tpu.AvgPoolOp)(p, x).ravel().tolist() == [8, 8]  # 15 / 2 = 7.5 -> 8 twice


def test_maxpool_int8_pads_below_every_value_and_clamps():
    p = params(tpu.MaxPoolOp, kernel_shape=(1, 2), strides=(1, 2), pads=(0, 1, 0, 0), qmin=-3, qmax=127)
    x = np.array([-128, -10, 5], np.int8).reshape(1, 1, 1, 3)
    # windows [pad, -128], [-10, 5]: max -128 clamped to -3 (a fused ReLU at zp -3), then 5
    assert get_kernel(tpu.MaxPoolOp)(p, x).ravel().tolist() == [-3, 5]


def test_lut_indexes_by_stored_byte():
    table = np.arange(256, dtype=np.uint8)[::-1].copy()  # entry i = 255 - i
    x = np.array([0, 1, -1, -128, 127], np.int8)  # bytes 0, 1, 255, 128, 127
    assert get_kernel(tpu.LutOp)(None, x, table).tolist() == [255, 254, 0, 127, 128]


# ---- casts ----------------------------------------------------------------------------


def cast(x, **kw):
    return get_kernel(tpu.CastOp)(tpu.CastParams(**kw), x)


def test_quantizing_cast_rounds_half_away_and_saturates():
    x = np.array([0.25, -0.25, 0.75, -0.75, 64.0, -64.5, 0.0], np.float32)  # scale 0.5: exact halves
    assert cast(x, to="int8", scale=0.5).tolist() == [1, -1, 2, -2, 127, -128, 0]
    assert cast(x, to="uint8", scale=0.5, zero_point=3).tolist() == [4, 2, 5, 1, 131, 0, 3]


def test_quantizing_cast_from_bf16_and_towards_zero():
    x = np.array([1.5, -1.5, 2.75], ml_dtypes.bfloat16)
    assert cast(x, to="int8", scale=1.0).tolist() == [2, -2, 3]
    assert cast(x, to="int8", scale=1.0, round_mode="TowardsZero").tolist() == [1, -1, 2]


def test_dequantizing_cast():
    q = np.array([-128, 0, 5, 127], np.int8)
    assert cast(q, to="float32", scale=0.25, zero_point=4).tolist() == [-33.0, -1.0, 0.25, 30.75]
    assert cast(q, to="float16", scale=0.5).dtype == np.float16


def test_float_cast_rounds_to_nearest_even():
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8], np.float32)  # ties at bf16's 7 fraction bits
    assert cast(x, to="bfloat16").astype(np.float32).tolist() == [1.0, 1 + 2**-6]
