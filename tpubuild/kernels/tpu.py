"""TPU kernels: TOP's arithmetic in the lowered types, bit-exact to the chip.

Float modes: 16-bit float operands are widened exactly to float32, the TOP
kernel computes in float32, and the interpreter rounds the result to the op's
result type (nearest even) when it stores it: one rounding per op, as the
chip's float units do.

INT8: an op whose data operands are int8/uint8 runs its integer path
(tpu_arith.py states the rules); every number it needs is in its parameters.
Ops that only move data (Reshape, Permute, Slice, Pad...) run the TOP kernel on
the stored integers directly, which is exact.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import overload

import ml_dtypes
import numpy as np

from tpubuild.ir import top, tpu
from tpubuild.ir.types import dtype_from_name
from tpubuild.kernels import deconv, halfcast, nn, nn_prepared
from tpubuild.kernels.registry import _KERNELS, _PREPARED, Operand, get_kernel, kernel, prepared
from tpubuild.kernels.tpu_arith import (
    ROUNDERS,
    STORAGE_RANGE,
    centered,
    channel_shape,
    exact_int,
    is_float,
    requantize,
    requantize_sums,
    rshift_round,
    saturate,
)

_NARROW_FLOATS = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
_QUANT_STORAGE = (np.dtype(np.int8), np.dtype(np.uint8))


@overload
def widen(x: np.ndarray) -> np.ndarray: ...
@overload
def widen(x: None) -> None: ...
def widen(x: np.ndarray | None) -> np.ndarray | None:
    """bf16/f16 -> float32 (exact); anything else unchanged."""
    return halfcast.astype(x, np.float32) if x is not None and x.dtype in _NARROW_FLOATS else x


def is_quant(x) -> bool:
    return x is not None and x.dtype in _QUANT_STORAGE


def _float_kernel(top_kernel):
    def run(p, *xs):
        return top_kernel(p, *[widen(x) for x in xs])

    return run


def _float_prepared(top_cls: type, maker=None):
    """A TPU op whose float path is its TOP op's kernel on widened operands: its TOP op's prepared kernel
    (None: the kernel), or ``maker``, the float path's own, made for the widened operands (widening is
    exact: the prepared kernel's bits on them are the kernel's), the 16-bit operands widened at each call."""

    def make(p, operands):
        if any(o.dtype is not None and o.dtype != np.float32 and o.dtype not in _NARROW_FLOATS for o in operands):
            return None
        wide = [
            Operand(o.shape, np.dtype(np.float32), widen(o.const)) if o.dtype in _NARROW_FLOATS else o for o in operands
        ]
        fn = maker(p, wide) if maker is not None else _PREPARED[top_cls](p, wide) if top_cls in _PREPARED else None
        if fn is None or not any(o.dtype in _NARROW_FLOATS for o in operands):
            return fn
        return lambda *xs: fn(*[widen(x) for x in xs])

    return make


def _zp(p, i: int) -> int:
    return p.in_zp[i] if i < len(p.in_zp) else 0


def _no_relu(p):
    return dataclasses.replace(p, do_relu=False, relu_limit=-1.0)


# ---- ops with an integer path ---------------------------------------------------------

# float32 holds every integer up to 2^24: a product whose partial sums all stay within it is exact in float32
F32_EXACT = 1 << 24


@kernel(tpu.ConvOp)
def _(p, x, w, b):
    if not is_quant(x):
        # the chip slices it: the GEMMs whose sums must not depend on a slice's size (nn.conv)
        return nn.conv(p, widen(x), widen(w), widen(b), sliced=True)
    # zero padding of x - zp is padding with real 0; the bias is int32, already in accumulator units, added
    # in float64 (exact) after the sums; exact sums are the same in any order: the slices need nothing more
    zp, plain = _zp(p, 0), _no_relu(p)
    spans = conv_spans(x.dtype, zp, w, p.group)
    if spans is None:
        acc = nn.conv(plain, centered(x, zp), w.astype(np.float64), None, sliced=False)
    else:
        xc, wc = centered(x, zp, np.float32), w.astype(np.float32)
        acc = summed(nn.conv(plain, xc[:, c], wc[:, c], None, sliced=False) for c in spans)
    if b is not None:
        b = b.reshape((1, -1) + (1,) * (acc.ndim - 2))
    return requantize_sums(
        acc, b, channel_shape(p.multiplier, acc.ndim, 1), channel_shape(p.rshift, acc.ndim, 1), p.out_zp, p.qmin, p.qmax
    )


# f32_spans looks at about this many (output, input) sums at a time
_SPAN_BLOCK = 1 << 20


def f32_spans(reach: int, sums: np.ndarray) -> list[slice] | None:
    """Spans of a product's inputs (a conv's input channels, a matmul's K) over which every partial sum stays
    within F32_EXACT in any order, given ``sums`` [outputs, inputs], each output's sum of |w| over what one input
    brings (a channel's taps, a matrix row's entry), and ``reach``, the largest |x - zp|. Each span's sums are
    then exact in float32, and so is their total in float64: a float32 GEMM takes half a float64 one's time.
    [slice(None)] where the whole product fits; None where float32 cannot be exact (one input alone beyond
    the bound). VGG's 3x3 convs over 512 channels just miss it whole and take two spans.

    The inputs are taken a block at a time, so a classifier's 25088 x 4096 weights need no copy of their own
    size in int64 (whole, they took 9 s and 2.5 GB)."""
    limit = F32_EXACT // reach  # sum * reach <= F32_EXACT, in integers
    outputs, inputs = sums.shape
    block = max(1, _SPAN_BLOCK // max(outputs, 1))
    spans, start, i, run = [], 0, 0, np.zeros(outputs, np.int64)
    while i < inputs:
        # each output's sum from the span's start through each input of the block
        reached = np.cumsum(sums[:, i : i + block], axis=1, dtype=np.int64)
        reached += run[:, None]
        over = np.flatnonzero(reached.max(axis=0) > limit)
        if not over.size:
            run, i = reached[:, -1], i + reached.shape[1]
            continue
        stop = i + int(over[0])  # the first input beyond the bound closes the span before it
        if stop == start:
            return None
        spans.append(slice(start, stop))
        start, i, run = stop, stop, np.zeros(outputs, np.int64)
    spans.append(slice(start, inputs))
    return [slice(None)] if len(spans) == 1 else spans


def conv_spans(x_dtype: np.dtype, zp: int, w: np.ndarray, group: int = 1) -> list[slice] | None:
    """f32_spans of a conv of stored x (minus zp) with integer filters w; None also where w is not integer,
    and for a grouped conv that would need more than one span (its filters span only a group's channels)."""
    if not is_quant(w) or w.size == 0:
        return None
    spans = f32_spans(_reach(x_dtype, zp), np.abs(w.reshape(w.shape[0], w.shape[1], -1).astype(np.int32)).sum(axis=2))
    return spans if group == 1 or spans == [slice(None)] else None


def matmul_spans(a_dtype: np.dtype, zp_a: int, b: np.ndarray, zp_b: int) -> list[slice] | None:
    """f32_spans of K for stored a (minus zp_a) times integer b [..., K, N] (minus zp_b), each column's bound
    its largest over b's batch; None also where b is not integer."""
    if not is_quant(b) or b.size == 0 or b.ndim < 2:
        return None
    k, n = b.shape[-2:]
    # |b - zp_b| of 8-bit values fits int16
    mag = np.abs(b.astype(np.int16) - np.int16(zp_b)).reshape(-1, k, n).max(axis=0)
    return f32_spans(_reach(a_dtype, zp_a), mag.T)


def _reach(dtype: np.dtype, zp: int) -> int:
    """The largest |x - zp| of a stored value x of ``dtype``."""
    lo, hi = STORAGE_RANGE[np.dtype(dtype)]
    return max(abs(lo - zp), abs(hi - zp))


def summed(parts: Iterator[np.ndarray]) -> np.ndarray:
    """A product's partial sums (exact integers, one per span of f32_spans) added in float64; one as it is."""
    acc = next(parts)
    for part in parts:
        if acc.dtype != np.float64:
            acc = acc.astype(np.float64)
        acc += part
    return acc


@kernel(tpu.MatMulOp)
def _(p, a, b, bias):
    if not is_quant(a):
        return get_kernel(top.MatMulOp)(p, widen(a), widen(b), widen(bias))
    zp_a, zp_b = _zp(p, 0), _zp(p, 1)
    spans = matmul_spans(a.dtype, zp_a, b, zp_b)
    if spans is None:
        acc = np.matmul(centered(a, zp_a), centered(b, zp_b))
    else:
        ac, bc = centered(a, zp_a, np.float32), centered(b, zp_b, np.float32)
        acc = summed(np.matmul(ac[..., c], bc[..., c, :]) for c in spans)
    return requantize_sums(
        acc,
        bias,
        channel_shape(p.multiplier, acc.ndim, -1),
        channel_shape(p.rshift, acc.ndim, -1),
        p.out_zp,
        p.qmin,
        p.qmax,
    )


def _linear_sum(p, xs, signs) -> np.ndarray:
    """Add/Sub: clamp(RSR(sum_i sign_i * m_i * (x_i - zp_i), rshift) + out_zp, qmin, qmax)."""
    acc = sum(
        sign * np.int64(m) * (x.astype(np.int64) - _zp(p, i))
        for i, (sign, m, x) in enumerate(zip(signs, p.multiplier, xs, strict=True))
    )
    return saturate(rshift_round(acc, p.rshift[0]) + p.out_zp, p.qmin, p.qmax)


@kernel(tpu.AddOp)
def _(p, a, b):
    if not is_quant(a):
        return get_kernel(top.AddOp)(p, widen(a), widen(b))
    return _linear_sum(p, (a, b), (1, 1))


@kernel(tpu.SubOp)
def _(p, a, b):
    if not is_quant(a):
        return get_kernel(top.SubOp)(p, widen(a), widen(b))
    return _linear_sum(p, (a, b), (1, -1))


@kernel(tpu.MulOp)
def _(p, a, b):
    if not is_quant(a):
        return get_kernel(top.MulOp)(p, widen(a), widen(b))
    acc = (a.astype(np.int64) - _zp(p, 0)) * (b.astype(np.int64) - _zp(p, 1))
    return requantize(acc, p.multiplier[0], p.rshift[0], p.out_zp, p.qmin, p.qmax)


@kernel(tpu.ConcatOp)
def _(p, *xs):
    if not is_quant(xs[0]):
        return get_kernel(top.ConcatOp)(p, *[widen(x) for x in xs])
    # each input requantized to the output's scale on its own (a branch keeps its resolution)
    parts = [
        requantize(x.astype(np.int64) - _zp(p, i), m, r, p.out_zp, p.qmin, p.qmax)
        for i, (x, m, r) in enumerate(zip(xs, p.multiplier, p.rshift, strict=True))
    ]
    return np.concatenate(parts, axis=p.axis)


@kernel(tpu.AvgPoolOp)
def _(p, x):
    if not is_quant(x):
        return get_kernel(top.AvgPoolOp)(p, widen(x))
    sums, counts = window_sums(p, centered(x, _zp(p, 0)))
    # the multiplier of each output element is the one for its window's element count
    index = np.searchsorted(np.asarray(p.counts), counts)
    mult = np.asarray(p.multiplier, np.int64)[np.broadcast_to(index, sums.shape)]
    return requantize(exact_int(sums), mult, p.rshift[0], p.out_zp, p.qmin, p.qmax)


def window_sums(p: top.PoolParams, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per output element: the sum of its window and its element count (the TOP AvgPool divisor)."""
    nd = len(p.kernel_shape)
    dil = p.dilations or (1,) * nd
    spatial = x.shape[-nd:]
    begin, end = nn._pool_pads(p, spatial)
    axes = tuple(range(-nd, 0))
    sums = nn.windows(x, p.kernel_shape, p.strides, dil, begin, end).sum(axis=axes)
    ones = np.ones(spatial, np.float64)
    if p.count_include_pad:
        ones = np.pad(ones, list(zip(p.pads[:nd], p.pads[nd:], strict=True)), constant_values=1.0)
        begin = [b - pb for b, pb in zip(begin, p.pads[:nd], strict=True)]
        end = [e - pe for e, pe in zip(end, p.pads[nd:], strict=True)]
    counts = nn.windows(ones, p.kernel_shape, p.strides, dil, begin, end).sum(axis=axes)
    return sums, np.rint(counts).astype(np.int64)


def avgpool_counts(p: top.PoolParams, in_shape) -> list[int]:
    """The distinct window element counts of a pool over ``in_shape`` (what AvgPool needs multipliers for)."""
    nd = len(p.kernel_shape)
    _, counts = window_sums(p, np.zeros((1,) + tuple(in_shape[-nd:])))
    return sorted({int(c) for c in counts.ravel()})


@kernel(tpu.MaxPoolOp)
def _(p, x):
    if not is_quant(x):
        return get_kernel(top.MaxPoolOp)(p, widen(x))
    # a fused ReLU is in [qmin, qmax]
    y = get_kernel(top.MaxPoolOp)(_no_relu(p), x)
    return saturate(y, p.qmin, p.qmax)


# ---- casts and tables ------------------------------------------------------------------


@kernel(tpu.CastOp)
def _(p: tpu.CastParams, x):
    to = dtype_from_name(p.to) if p.to else None
    if to in _QUANT_STORAGE and is_float(x.dtype):
        lo, hi = STORAGE_RANGE[to]
        inv = np.float32(1.0) / np.float32(p.scale)
        with np.errstate(invalid="ignore", over="ignore"):
            q = ROUNDERS[p.round_mode](widen(x).astype(np.float32) * inv)
        return saturate(q + p.zero_point, lo, hi).astype(to)
    if is_quant(x) and (to is None or is_float(to)):
        real = (x.astype(np.int32) - np.int32(p.zero_point)).astype(np.float32) * np.float32(p.scale)
        return real if to is None else real.astype(to)
    if to is None:
        return widen(x)
    onnx_round = p.round_mode if to == ml_dtypes.float8_e8m0fnu else "up"
    return get_kernel(top.CastOp)(top.CastParams(to=p.to, saturate=p.saturate, round_mode=onnx_round), x)


@kernel(tpu.LutOp)
def _(p, x, table):
    # the index is the stored byte: int8 -1 is entry 255
    return table[x.view(np.uint8) if x.dtype == np.int8 else x]


# ---- every other TPU op: the TOP kernel on widened operands ---------------------------


def register_mirrors() -> None:
    """Every TPU op without a kernel of its own runs its TOP op's on widened operands (idempotent)."""
    for top_cls, tpu_cls in tpu.MIRROR.items():
        if tpu_cls not in _KERNELS and top_cls in _KERNELS:
            kernel(tpu_cls)(_float_kernel(_KERNELS[top_cls]))
            prepared(tpu_cls)(_float_prepared(top_cls))


# a Deconv as the chip slices it (TOP's is never sliced)
kernel(tpu.MIRROR[top.DeconvOp])(_float_kernel(functools.partial(deconv.deconv, sliced=True)))

# Conv and the pools have kernels of their own whose float path is the TOP kernel on widened operands (the
# conv's sliced, as the chip computes it)
_conv_float = _float_prepared(top.ConvOp, functools.partial(nn_prepared.conv, sliced=True))
_matmul_float = _float_prepared(top.MatMulOp)


@prepared(tpu.MatMulOp)
def _(p, operands):
    a, b, bias = operands
    if a.dtype not in _QUANT_STORAGE:
        return _matmul_float(p, operands)
    if b.const is None or (bias.shape is not None and bias.const is None):
        return None
    # the weights centered once, in float32 span by span where that is exact (matmul_spans); the rest as the kernel
    zp_a, zp_b = _zp(p, 0), _zp(p, 1)
    spans = matmul_spans(a.dtype, zp_a, b.const, zp_b)
    dtype = np.float64 if spans is None else np.float32
    wide = centered(b.const, zp_b, dtype)
    parts = [(c, wide if c == slice(None) else np.ascontiguousarray(wide[..., c, :])) for c in spans or [slice(None)]]
    mult, shift = channel_shape(p.multiplier, len(a.shape), -1), channel_shape(p.rshift, len(a.shape), -1)

    def run(a, b, bias_):
        ac = centered(a, zp_a, dtype)
        acc = summed(np.matmul(ac[..., c], w) for c, w in parts)
        return requantize_sums(acc, bias.const, mult, shift, p.out_zp, p.qmin, p.qmax)

    return run


@prepared(tpu.ConvOp)
def _(p, operands):
    x, w, b = operands
    if x.dtype in _QUANT_STORAGE:
        return _ConvInt8(p, x, w, b) if w.const is not None and (b.shape is None or b.const is not None) else None
    return _conv_float(p, operands)


class _ConvInt8:
    """tpu.Conv's integer path with what depends on its weights done once: the spans of input channels it sums
    in float32 (conv_spans; else float64), each span's filters and prepared conv, the bias and requantization
    numbers shaped."""

    def __init__(self, p, x: Operand, w: Operand, b: Operand):
        assert x.dtype is not None and w.const is not None, "made for a present x and constant weights"
        self.zp = _zp(p, 0)
        rank = len(x.dims)
        plain = _no_relu(p)
        spans = conv_spans(x.dtype, self.zp, w.const, p.group)
        self.dtype = np.float64 if spans is None else np.float32
        # (span of x's channels, its conv)
        if spans is None:
            w64 = w.const.astype(np.float64)
            self.parts = [(slice(None), lambda xc: nn.conv(plain, xc, w64, None, sliced=False))]
        else:
            self.parts = [(c, self._span_conv(plain, x.dims, w.const[:, c].astype(np.float32))) for c in spans]
        self.bias = None if b.const is None else b.const.reshape((1, -1) + (1,) * (rank - 2))
        self.mult, self.shift = channel_shape(p.multiplier, rank, 1), channel_shape(p.rshift, rank, 1)
        self.out = (p.out_zp, p.qmin, p.qmax)

    @staticmethod
    def _span_conv(p, x_dims: tuple[int, ...], w: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
        """The float32 conv of a span of x's channels by its filters, prepared (nn_prepared) where it can be."""
        shape = (x_dims[0], w.shape[1] * p.group) + tuple(x_dims[2:])
        f32, none = np.dtype(np.float32), Operand(None, None, None)
        conv = nn_prepared.conv(p, [Operand(shape, f32, None), Operand(w.shape, f32, w), none], sliced=False)
        return (lambda xc: conv(xc, w, None)) if conv else (lambda xc: nn.conv(p, xc, w, None, sliced=False))

    def __call__(self, x, w, b):
        xc = centered(x, self.zp, self.dtype)
        acc = summed(conv(xc[:, c]) for c, conv in self.parts)
        return requantize_sums(acc, self.bias, self.mult, self.shift, *self.out)


prepared(tpu.AvgPoolOp)(_float_prepared(top.AvgPoolOp))
prepared(tpu.MaxPoolOp)(_float_prepared(top.MaxPoolOp, functools.partial(nn_prepared.max_pool, shifted=False)))
