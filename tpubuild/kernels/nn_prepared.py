"""Conv and pools prepared for fixed operand shapes and weights (reference inference's plans).

Each maker does once what nn.py's kernel redoes per call (output size, live taps, pads,
the weights reshaped and transposed, every tap's slice of the padded input, a pool's
divisors) and returns a function computing the kernel's bits: the same float operations
per element, the same GEMM operands (the BLAS call's shapes and layout set its sums'
order). A small model's conv was two thirds such Python work. The depthwise conv runs
channels last (see _DepthwiseNHWC). Shapes the makers do not cover get None (the kernel
serves): a channel multiplier, non-float32 operands, a pool over a windows view.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from tpubuild.ir import top
from tpubuild.kernels import nn
from tpubuild.kernels.activation import clip, relu
from tpubuild.kernels.registry import Operand, prepared

F32 = np.dtype(np.float32)


class _Padder:
    """x zero- (or ``fill``-) padded on its last dims into a fresh array, or x itself without pads."""

    def __init__(self, shape: tuple[int, ...], begin, end, fill: float = 0.0):
        nd = len(begin)
        self.pads = any(begin) or any(end)
        self.shape = shape[:-nd] + tuple(s + b + e for s, b, e in zip(shape[-nd:], begin, end, strict=True))
        self.inner = (Ellipsis,) + tuple(slice(b, b + s) for b, s in zip(begin, shape[-nd:], strict=True))
        self.fill = fill

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if not self.pads:
            return x
        xp = np.zeros(self.shape, x.dtype) if self.fill == 0 else np.full(self.shape, self.fill, x.dtype)
        xp[self.inner] = x
        return xp


def _tap_slices(taps, strides, dilations, out_sp) -> list[tuple]:
    """nn.tap_view's index of each tap, made once."""
    return [
        (Ellipsis,)
        + tuple(
            slice(k * d, k * d + (o - 1) * s + 1, s) for k, d, s, o in zip(tap, dilations, strides, out_sp, strict=True)
        )
        for tap in taps
    ]


def _channel_bias(b: np.ndarray | None, out_shape: tuple[int, ...], full: bool) -> np.ndarray | None:
    """A conv's bias [C] as an operand of its output [N, C, ...]; ``full``: broadcast to a small output once (as
    _full; not for the simulator's tiles, a copy per command)."""
    if b is None:
        return None
    shaped = b.reshape((1, -1) + (1,) * (len(out_shape) - 2))
    if not full or math.prod(out_shape) > _FULL_WEIGHT:
        return shaped
    return np.ascontiguousarray(np.broadcast_to(shaped, out_shape))


class _Epilogue:
    """The conv kernel's end: + bias (float32, in place), then the fused ReLU / ReLU-n, in place (relu's clip of a
    float32 output, its bounds made once)."""

    def __init__(self, p: top.ConvParams, bias: np.ndarray | None):
        self.bias = bias
        self.bounds = (
            (np.zeros((), F32), np.asarray(p.relu_limit if p.relu_limit >= 0 else np.inf, F32)) if p.do_relu else None
        )

    def __call__(self, y: np.ndarray) -> np.ndarray:
        if self.bias is not None:
            y += self.bias
        return y if self.bounds is None else clip(y, *self.bounds, out=y)


@prepared(top.ConvOp)
def _(p: top.ConvParams, operands: list[Operand]) -> Callable | None:
    return conv(p, operands, sliced=False)


def conv(p: top.ConvParams, operands: list[Operand], *, sliced: bool) -> Callable | None:
    """nn.conv prepared (``sliced``: a TPU F32 conv the chip slices, its GEMMs pixel-major, one per output row)."""
    x, w, b = operands
    if (
        w.const is None
        or (b.shape is not None and b.const is None)
        or x.dtype != F32
        or w.const.dtype != F32
        or (b.const is not None and b.const.dtype != F32)
    ):
        return None
    nd = len(p.kernel_shape)
    n, c = x.dims[:2]
    oc, g = w.dims[0], p.group
    out_sp = tuple(
        (size + lo + hi - (k - 1) * d - 1) // s + 1
        for size, lo, hi, k, d, s in zip(
            x.dims[2:], p.pads[:nd], p.pads[nd:], p.kernel_shape, p.dilations, p.strides, strict=True
        )
    )
    taps = nn._live_taps(p, x.dims[2:], out_sp)
    if not taps or (g > 1 and c == g and (oc != c or nd != 2)):
        return None  # no live tap (zeros), a channel multiplier or not 2-D: the kernel
    wt = w.const.reshape(oc, c // g, -1)
    if len(taps) < wt.shape[2]:
        wt = wt[:, :, [np.ravel_multi_index(t, p.kernel_shape) for t in taps]]
    bias = _channel_bias(b.const, (n, oc) + out_sp, full=not sliced)
    epilogue = _Epilogue(p, bias)
    if g > 1 and c == g:
        if not sliced and nn.DepthwiseGemv.suits(p, x.shape, taps, out_sp, F32):
            return _DepthwiseGemv(nn.DepthwiseGemv(p, x.shape, taps, out_sp), wt, b.const, _Epilogue(p, None))
        if all(s == 1 for s in p.strides) and math.prod(x.dims) * F32.itemsize >= _DEPTHWISE_FLAT:
            return _DepthwiseFlat(p, taps, out_sp, wt, epilogue)
        return _DepthwiseNHWC(p, x.shape, taps, out_sp, wt, epilogue)
    pad = _Padder(x.dims, p.pads[:nd], p.pads[nd:])
    if len(taps) == 1:
        tap = _tap_slices(taps, p.strides, p.dilations, out_sp)[0]
        if not sliced and nn.folds_bias(b.const, F32, c, (n, oc) + out_sp):
            return _Conv1Tap(
                n,
                g,
                c,
                oc,
                out_sp,
                nn.with_bias(wt.reshape(g, oc // g, c // g), b.const),
                pad,
                tap,
                _Epilogue(p, None),
                sliced,
                fold=True,
            )
        return _Conv1Tap(n, g, c, oc, out_sp, wt, pad, tap, epilogue, sliced)
    if not sliced and nn.Im2colFlat.suits(p, x.shape, taps, F32):
        return _Im2colFlat(
            nn.Im2colFlat(p, x.shape, g, oc, out_sp),
            nn.Im2colFlat.weights(wt, g, p.kernel_shape[0], b.const),
            _Epilogue(p, None),
        )
    return _Im2col(p, x.shape, oc, g, taps, out_sp, wt, pad, epilogue, sliced)


class _Conv1Tap:
    """One live tap (1x1): the (strided) input pixels times the weights, as nn's kernel calls the GEMM
    (``fold``: the weights' last column is the bias, the pixels get a row of ones, nn.folds_bias)."""

    def __init__(self, n, g, c, oc, out_sp, wt, pad, tap, epilogue, sliced, fold=False):
        self.cols_shape = (n, g, c // g, -1, nn.gemm_row(out_sp)) if sliced else (n, g, c // g, -1)
        self.wt = wt if fold else wt.reshape(g, oc // g, c // g)
        self.fold = fold
        self.out_shape = (n, oc) + out_sp
        self.pad, self.tap, self.epilogue = pad, tap, epilogue
        self.sliced = sliced
        # every pixel, unpadded (a 1x1 conv at stride 1): the input is the columns
        self.whole = not pad.pads and all(t.step == 1 and t.start == 0 for t in tap[1:])

    def __call__(self, x, w, b):
        cols = (x if self.whole else self.pad(x)[self.tap]).reshape(self.cols_shape)
        if self.sliced:
            y = np.moveaxis(nn.pixel_gemm(cols, self.wt.swapaxes(1, 2)), 4, 2)
        else:
            y = np.matmul(self.wt, nn.with_ones(cols) if self.fold else cols)
        return self.epilogue(y.reshape(self.out_shape))


class _Im2col:
    """nn._im2col with its tap slices, block sizes and transposed weights made once."""

    def __init__(self, p, x_shape, oc, g, taps, out_sp, wt, pad, epilogue, sliced):
        n, c = x_shape[:2]
        k, cg = len(taps), c // g
        self.n, self.g, self.cg, self.k, self.ocg, self.oc = n, g, cg, k, oc // g, oc
        self.tap_rows, self.rest_taps = nn.gemm_order(taps)
        self.wt = nn.gemm_weights(wt, g, self.tap_rows)  # [g, K, ocg]; its transpose is C order
        self.sliced = sliced
        self.rest = math.prod(out_sp[1:])
        row_bytes = (1 if sliced else n) * c * k * self.rest * F32.itemsize  # (as nn._im2col)
        self.rows = max(1, min(out_sp[0], nn._COLS_BLOCK // max(row_bytes, 1)))
        self.out_sp = out_sp
        self.blocks = []  # (first output row, rows, input rows' slice, each tap's slice of them)
        for r0 in range(0, out_sp[0], self.rows):
            r = min(self.rows, out_sp[0] - r0)
            start = r0 * p.strides[0]
            stop = start + (r - 1) * p.strides[0] + (p.kernel_shape[0] - 1) * p.dilations[0] + 1
            self.blocks.append(
                (
                    r0,
                    r,
                    (slice(None), slice(None), slice(start, stop)),
                    _tap_slices(taps, p.strides, p.dilations, (r,) + out_sp[1:]),
                )
            )
        self.pad, self.epilogue = pad, epilogue
        # one block with every tap live: the columns are one strided view of the padded input, copied in
        # one call (the taps' copies were a numpy call each); (shape, byte strides) of that view
        self.window = None
        if len(self.blocks) == 1 and k == math.prod(p.kernel_shape):
            step = [F32.itemsize * math.prod(pad.shape[i + 1 :]) for i in range(len(pad.shape))]
            dims = range(2, len(pad.shape))
            taps = tuple(d * step[i] for d, i in zip(p.dilations, dims, strict=True))
            self.window = (
                (n, g, p.kernel_shape[0], cg) + tuple(p.kernel_shape[1:]) + out_sp,
                (step[0], cg * step[1], taps[0], step[1])
                + taps[1:]
                + tuple(s * step[i] for s, i in zip(p.strides, dims, strict=True)),
            )

    def __call__(self, x, w, b):
        xp = self.pad(x)
        n, g, cg, k, ocg, rest = self.n, self.g, self.cg, self.k, self.ocg, self.rest
        y = np.empty((n, g, ocg, self.out_sp[0] * rest), F32)
        cols = nn._COLUMNS.array((n, g, self.tap_rows, cg, self.rest_taps, self.rows) + self.out_sp[1:], F32)
        for r0, r, rows, tap_slices in self.blocks:
            part = cols[:, :, :, :, :, :r]
            if self.window is not None and xp.dtype == F32 and xp.flags.c_contiguous:
                shape, strides = self.window
                np.copyto(cols.reshape(shape), np.ndarray(shape, F32, buffer=xp, strides=strides))
            else:
                xb = xp[rows]
                block = (n, g, cg, r) + self.out_sp[1:]
                for t, tap in enumerate(tap_slices):
                    part[:, :, t // self.rest_taps, :, t % self.rest_taps] = xb[tap].reshape(block)
            if self.sliced:
                row = rest if len(self.out_sp) == 2 else r * rest  # (nn.gemm_row)
                prod = nn.pixel_gemm(part.reshape(n, g, cg * k, r * rest // row, row), self.wt)  # [n, g, r, row, ocg]
                y[:, :, :, r0 * rest : (r0 + r) * rest] = np.moveaxis(prod, 4, 2).reshape(n, g, ocg, r * rest)
            else:
                pixels = part.reshape(n, g, cg * k, r * rest)
                np.matmul(self.wt.swapaxes(1, 2), pixels, out=y[:, :, :, r0 * rest : (r0 + r) * rest])
        return self.epilogue(y.reshape((n, self.oc) + self.out_sp))


class _Im2colFlat:
    """nn.Im2colFlat (a TOP conv at stride 1) with its weights and bias, clipped by the kernel's activation."""

    def __init__(self, conv: nn.Im2colFlat, wt: np.ndarray, epilogue: _Epilogue):
        self.conv, self.wt, self.bounds = conv, wt, epilogue.bounds

    def __call__(self, x, w, b):
        return self.conv(x, self.wt, self.bounds)


class _DepthwiseGemv:
    """nn.DepthwiseGemv (a TOP depthwise conv) with its weights and bias, clipped by the kernel's activation."""

    def __init__(self, conv: nn.DepthwiseGemv, wt: np.ndarray, bias: np.ndarray | None, epilogue: _Epilogue):
        self.conv, self.wt, self.bounds = conv, conv.weights(wt, bias), epilogue.bounds

    def __call__(self, x, w, b):
        return self.conv(x, self.wt, self.bounds)


# an input at least this big (bytes) runs nn's flat-plane kernel (stride 1): the channels-last copy, its
# product and its sum no longer stay in cache together, while the flat kernel goes a cache-sized block of
# channels at a time (PP-OCRv4 rec's (1, 128, 12, 160) 3x3: 2.9 -> 1.6 ms)
_DEPTHWISE_FLAT = 1 << 19


class _DepthwiseFlat:
    """nn._depthwise_flat (the kernel's stride-1 depthwise: the same products and sums, tap by tap)."""

    def __init__(self, p, taps, out_sp, wt, epilogue):
        self.p, self.taps, self.out_sp, self.wt, self.epilogue = p, taps, out_sp, wt, epilogue

    def __call__(self, x, w, b):
        y = nn._depthwise_flat(x, self.wt, self.taps, self.p, self.out_sp, F32)
        return self.epilogue(np.ascontiguousarray(y))


class _DepthwiseNHWC:
    """nn's depthwise conv (each tap's shifted input times its channel's weight, summed tap by tap) on a
    channels-last copy of the padded input.

    The kernel's rows are a channel's output row or plane: PP-OCR's recognisers' planes are two or three
    pixels high, so each of its multiplies and adds walked hundreds of short strided rows. Channels last,
    a tap's input for one output row is one contiguous run of width x channels elements (at a column
    stride of one), and its weights are that run's channel pattern, repeated, made once: the same
    products and sums per element, in passes over long rows.
    """

    def __init__(self, p, x_shape, taps, out_sp, wt, epilogue):
        n, c, h, w = x_shape
        (ph, pw), (sh, sw), (dh, dw) = p.pads[:2], p.strides, p.dilations
        self.padded = (n, h + ph + p.pads[2], w + pw + p.pads[3], c)
        self.inner = (slice(None), slice(ph, ph + h), slice(pw, pw + w))
        ho, wo = out_sp
        self.taps = [
            (
                slice(None),
                slice(kh * dh, kh * dh + (ho - 1) * sh + 1, sh),
                slice(kw * dw, kw * dw + (wo - 1) * sw + 1, sw),
            )
            for kh, kw in taps
        ]
        # tap t's weight for each (column, channel) of an output row, channels fastest
        self.weights = [np.ascontiguousarray(np.broadcast_to(wt[:, 0, t], (wo, c))) for t in range(len(taps))]
        self.out = (n, ho, wo, c)
        self.epilogue = epilogue

    def __call__(self, x, w, b):
        xp = np.zeros(self.padded, F32)
        xp[self.inner] = x.transpose(0, 2, 3, 1)
        y = np.empty(self.out, F32)
        part = np.empty(self.out, F32)
        np.multiply(xp[self.taps[0]], self.weights[0], out=y)
        for tap, weights in zip(self.taps[1:], self.weights[1:], strict=True):
            np.multiply(xp[tap], weights, out=part)
            y += part
        return self.epilogue(np.ascontiguousarray(y.transpose(0, 3, 1, 2)))


class _PoolTaps:
    """A pool's static parts: pads (ceil_mode's grown), output size, each tap's slice of the padded input."""

    def __init__(self, p: top.PoolParams, x_shape, fill: float):
        nd = len(p.kernel_shape)
        spatial = x_shape[-nd:]
        self.begin, end = nn._pool_pads(p, spatial)
        self.dil, self.out_sp = nn._pool_shape(p, spatial)
        self.is_global = nn._global(p, spatial, self.begin, end)
        self.few = nn._few_taps(p.kernel_shape, self.out_sp)
        self.pad = _Padder(x_shape, self.begin, end, fill)
        self.taps = _tap_slices(list(np.ndindex(*p.kernel_shape)), p.strides, self.dil, self.out_sp)
        self.out_shape = x_shape[:-nd] + self.out_sp
        self.flat = x_shape[:-nd] + (-1,)


@prepared(top.MaxPoolOp)
def _(p: top.PoolParams, operands: list[Operand]) -> Callable | None:
    return max_pool(p, operands, shifted=True)


def max_pool(p: top.PoolParams, operands: list[Operand], *, shifted: bool) -> Callable | None:
    """nn's max pool prepared; ``shifted``: a 2-D float32 one as _ShiftedMax (TOP's: the chip's pools keep the
    kernel's order of maxima, its signed zeros)."""
    (x,) = operands
    if x.dtype is None or x.dtype.kind != "f":
        return None
    pool = _PoolTaps(p, x.shape, -np.inf)
    if not pool.is_global and not pool.few:
        return None  # a windows view: the kernel
    if (
        shifted
        and not pool.is_global
        and len(p.kernel_shape) == 2
        and x.dtype == F32
        and math.prod(pool.pad.shape) * F32.itemsize <= _SHIFTED_MAX
    ):
        return _ShiftedMax(p, pool, x.shape)

    def run(x):
        if pool.is_global:
            y = x.reshape(pool.flat).max(axis=-1).reshape(pool.out_shape)
        else:
            y = nn.window_max(pool.pad(x), p.kernel_shape, p.strides, pool.dil, pool.out_sp)
        return nn.fused(y, p)

    return run


# the largest padded input (bytes) _ShiftedMax pools: its whole-plane passes stay in cache (squeezenet's
# (1, 64, 113, 113), 3.3 MB: 750 -> 1506 us, its (1, 256, 29, 29), 0.9 MB: 167 -> 176)
_SHIFTED_MAX = 1 << 18


class _ShiftedMax:
    """A 2-D max pool as maxima of whole shifted runs: the -inf padded planes flattened into one run, the maximum
    over the kernel's rows is the run against itself shifted by a row (and two ...), then over its columns the
    same with shifts of a column, and the windows' maxima are a strided view of that (the shifts' runs cross
    rows and planes only in elements no window keeps). nn.window_max's maxima of 4-D strided views took numpy
    three times as long per element as these (demo_cnn's 3x3 at stride 2 on (1, 16, 32, 32): 30 -> 15 us)."""

    def __init__(self, p: top.PoolParams, pool: _PoolTaps, x_shape):
        (kh, kw), (sh, sw), (dh, dw) = p.kernel_shape, p.strides, pool.dil
        hp, wp = pool.pad.shape[-2:]
        self.p, self.out_shape = p, pool.out_shape
        self.length = math.prod(x_shape[:-2]) * hp * wp
        self.row_shifts = [t * dh * wp for t in range(1, kh)]
        self.col_shifts = [t * dw for t in range(1, kw)]
        self.padded, self.inner = pool.pad.shape, pool.pad.inner
        self.tail = max(self.row_shifts + self.col_shifts + [0])  # -inf after the planes: the last shifts' runs
        item = F32.itemsize
        lead = x_shape[:-2]
        self.windows = (
            self.out_shape,
            tuple(math.prod(lead[i + 1 :]) * hp * wp * item for i in range(len(lead))) + (sh * wp * item, sw * item),
        )
        self._views = nn._Views(self._make_views)

    def _make_views(self) -> tuple:
        """The flat padded planes with their tail and their input part, the rows' maxima with their tail, the
        columns' maxima, in the scratch buffers."""
        run, tail = self.length, self.tail
        flat = nn._PLANES.array((run + tail,), F32)
        rows = nn._COLUMNS.array((run + tail,), F32)
        return flat, flat[:run].reshape(self.padded)[self.inner], rows, rows[run:], nn._PRODUCTS.array((run,), F32)

    def __call__(self, x):
        flat, inner, rows, rows_tail, cols = self._views.get()
        run = self.length
        flat.fill(-np.inf)
        np.copyto(inner, x)
        _shifted_max(flat, self.row_shifts, rows[:run])
        rows_tail.fill(-np.inf)
        _shifted_max(rows, self.col_shifts, cols)
        y = np.empty(self.out_shape, F32)
        np.copyto(y, np.ndarray(self.windows[0], F32, buffer=cols, strides=self.windows[1]))
        return nn.fused(y, self.p)


def _shifted_max(src: np.ndarray, shifts: list[int], out: np.ndarray) -> None:
    """out = the maximum of src's first len(out) elements and those runs shifted by each of ``shifts``."""
    run = len(out)
    if not shifts:
        np.copyto(out, src[:run])
        return
    np.maximum(src[:run], src[shifts[0] : run + shifts[0]], out=out)
    for shift in shifts[1:]:
        np.maximum(out, src[shift : run + shift], out=out)


@prepared(top.AvgPoolOp)
def _(p: top.PoolParams, operands: list[Operand]) -> Callable | None:
    (x,) = operands
    if x.dtype is None or x.dtype.kind != "f":
        return None
    pool = _PoolTaps(p, x.shape, 0.0)
    if not pool.is_global and not pool.few:
        return None
    counts = nn._pool_counts(p, x.dims[-len(p.kernel_shape) :], pool.begin, pool.dil, pool.out_sp)
    acc = nn.pool_sum_dtype(x.dtype)

    def run(x):
        if pool.is_global:
            total = x.reshape(pool.flat).sum(axis=-1, dtype=acc).reshape(pool.out_shape)
        else:
            xp = pool.pad(x)
            total = np.zeros(pool.out_shape, acc)
            for tap in pool.taps:
                total += xp[tap]
        return nn.fused((total / counts).astype(x.dtype), p)

    return run


def _mean(x: np.ndarray, axes: tuple[int, ...], count: np.floating | np.intp) -> np.ndarray:
    """``x.mean(axis=axes, keepdims=True)`` of a float32/64 array: numpy's own steps (the sum, then a
    division by the count as an intp, cast back) without its Python wrapper."""
    total = np.add.reduce(x, axis=axes, keepdims=True)
    return np.true_divide(total, count, out=total, casting="unsafe")


# the largest result a weight is broadcast to once, for the plan (numpy's broadcasting loop costs a small
# result's add three times the add of a whole operand)
_FULL_WEIGHT = 1 << 14


def _full(o: Operand, shape: tuple[int, ...]) -> np.ndarray | None:
    """A weight operand broadcast to ``shape`` in C order, for a small result (else None: broadcast per call)."""
    if o.const is None or o.const.shape == shape or math.prod(shape) > _FULL_WEIGHT:
        return None
    return np.ascontiguousarray(np.broadcast_to(o.const, shape))


def _divisor(count: int) -> np.float32 | np.intp:
    """numpy's mean divides a float32 sum by an intp count in float64, then rounds to float32: the float32
    quotient itself (rounding a float64 quotient of float32 operands to float32 is the correctly rounded
    float32 quotient), which a float32 divisor gives three times faster, when the count is a float32."""
    return np.float32(count) if count <= 1 << 24 else np.intp(count)


@prepared(top.LayerNormOp)
def _(p: top.LayerNormParams, operands: list[Operand]) -> Callable | None:
    x, scale, bias = operands
    if (
        x.dtype != F32
        or p.stats
        or any(
            o.shape is not None and (o.dtype != F32 or np.broadcast_shapes(x.dims, o.shape) != x.dims)
            for o in (scale, bias)
        )
    ):
        return None
    axes = tuple(range(p.axis % len(x.dims), len(x.dims)))
    count = _divisor(math.prod(x.dims[a] for a in axes))
    eps = np.asarray(p.eps, F32)
    full_scale, full_bias = _full(scale, x.dims), _full(bias, x.dims)

    def run(x, scale, bias):
        # nn's kernel's operations in its order, each result written over a temporary of the run
        scale = full_scale if full_scale is not None else scale
        bias = full_bias if full_bias is not None else bias
        mean = _mean(x, axes, count)
        d = np.subtract(x, mean)
        var = _mean(np.multiply(d, d), axes, count)
        var += eps
        rstd = np.divide(1, np.sqrt(var, out=var))
        y = np.multiply(d, rstd, out=d)
        if scale is not None:
            y *= scale
        if bias is not None:
            y += bias
        return y

    return run


@prepared(top.SoftmaxOp)
def _(p: top.SoftmaxParams, operands: list[Operand]) -> Callable | None:
    (x,) = operands
    if x.dtype != F32 or p.log:
        return None
    beta = np.asarray(p.beta, F32)

    def run(x):
        if p.beta != 1.0:
            x = x * beta
        shifted = np.subtract(x, np.maximum.reduce(x, axis=p.axis, keepdims=True))  # x.max's own reduction
        e = np.exp(shifted, out=shifted)
        return np.divide(e, np.add.reduce(e, axis=p.axis, keepdims=True), out=e)

    return run


# the float32 sign bit, as an int32
_SIGN_BIT = np.int32(-1 << 31)


@prepared(top.SiLUOp)
def _(p, operands: list[Operand]) -> Callable | None:
    if operands[0].dtype != F32:
        return None
    one, zero = np.ones((), F32), np.zeros((), F32)

    def run(x):
        # x * elementwise.sigmoid(x), the same operations but -|x|, abs then negative, made as x with its sign bit
        # set (what they make of any float, NaN payloads too), one integer pass, and no dtype checks: a small
        # model runs dozens of SiLUs, most of them on a few thousand elements
        e = np.bitwise_or(x.view(np.int32), _SIGN_BIT).view(F32)
        np.exp(e, out=e)
        den = np.add(e, one)
        np.maximum(e, np.greater_equal(x, zero), out=e)
        s = np.divide(e, den, out=den)
        return np.multiply(x, s, out=s)

    return run


@prepared(top.HardSwishOp)
def _(p, operands: list[Operand]) -> Callable | None:
    if operands[0].dtype != F32:
        return None
    six, half, zero, one = (np.asarray(v, F32) for v in (6, 0.5, 0, 1))

    def run(x):
        # pointwise's kernel with its constants made once (PP-OCR runs 18 HardSwishes)
        with np.errstate(all="ignore"):
            t = np.divide(x, six)
            t += half
            clip(t, zero, one, out=t)
            return np.multiply(x, t, out=t)

    return run


@prepared(top.MatMulOp)
def _(p: top.ReluParams, operands: list[Operand]) -> Callable | None:
    a, b, bias = operands
    if a.dtype != F32 or b.dtype != F32 or a.shape is None or b.shape is None:
        return None
    out = (
        np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
        if len(a.shape) > 1 and len(b.shape) > 1
        else None
    )
    if out is None or (bias.shape is not None and (bias.dtype != F32 or np.broadcast_shapes(out, bias.shape) != out)):
        return None
    limit = p.relu_limit
    full_bias = _full(bias, out)

    def run(a, b, bias):
        y = np.matmul(a, b)
        bias = full_bias if full_bias is not None else bias
        if bias is not None:
            y += bias  # y + bias, in the product's array
        return relu(y, limit, out=y) if p.do_relu else y

    return run
