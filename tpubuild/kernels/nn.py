"""Neural-network kernels: conv, matmul, pooling, normalisation, softmax."""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tpubuild.ir import top
from tpubuild.kernels.activation import clip, fused, relu
from tpubuild.kernels.registry import kernel


def windows(x: np.ndarray, kernel_shape, strides, dilations, pads_begin, pads_end, fill=0.0) -> np.ndarray:
    """View of x as [..., *out_spatial, *kernel] windows over its last len(kernel_shape) dims."""
    nd = len(kernel_shape)
    lead = [(0, 0)] * (x.ndim - nd)
    xp = np.pad(x, lead + list(zip(pads_begin, pads_end, strict=True)), constant_values=fill)
    span = [(k - 1) * d + 1 for k, d in zip(kernel_shape, dilations, strict=True)]
    axes = tuple(range(x.ndim - nd, x.ndim))
    win = sliding_window_view(xp, span, axis=axes)
    # sliding_window_view appends the window dims: [..., *out_full, *span]; stride the
    # output dims and step through each window by its dilation
    index = (
        (slice(None),) * (x.ndim - nd)
        + tuple(slice(None, None, s) for s in strides)
        + tuple(slice(None, None, d) for d in dilations)
    )
    return win[index]


def padded(x: np.ndarray, begin, end, fill=0.0) -> np.ndarray:
    """x with its last len(begin) dims padded by ``fill`` (x itself without pads)."""
    if not any(begin) and not any(end):
        return x
    nd = len(begin)
    lead = x.shape[:-nd]
    shape = lead + tuple(s + b + e for s, b, e in zip(x.shape[-nd:], begin, end, strict=True))
    xp = np.full(shape, fill, x.dtype)
    xp[(Ellipsis,) + tuple(slice(b, b + s) for b, s in zip(begin, x.shape[-nd:], strict=True))] = x
    return xp


def tap_view(xp: np.ndarray, tap, strides, dilations, out_sp) -> np.ndarray:
    """The elements of padded ``xp`` under kernel position ``tap`` for every output position (a view)."""
    return xp[
        (Ellipsis,)
        + tuple(
            slice(k * d, k * d + (o - 1) * s + 1, s) for k, d, s, o in zip(tap, dilations, strides, out_sp, strict=True)
        )
    ]


# im2col builds its columns this many bytes at a time (output rows in blocks): the block
# stays in cache between being written and the GEMM reading it
_COLS_BLOCK = 1 << 21


def pixel_gemm(cols: np.ndarray, wt: np.ndarray) -> np.ndarray:
    """cols [..., K, rows, row] (the columns as built) times wt [..., K, N] -> [..., rows, row, N], pixel-major,
    one BLAS GEMM per row of ``row`` pixels (an output row of a 2-D conv, an input row of a Deconv).

    Each row's columns are copied C-contiguous ([..., rows, K, row]; the GEMM reads their transpose) and
    numpy's matmul calls BLAS once per row of the stack, so every row's GEMM has one shape and layout,
    whatever the number of rows: a row's bits depend on its own
    columns, K and N alone, and an H slice of the op, as the chip computes it, matches the whole tensor's
    bits (layer group slices F32 convs and Deconvs on that: slicing.exact_f32). One GEMM over every pixel
    would not: a BLAS kernel sums an output in an order set by where its pixel falls in the kernel's
    register tiles and threads' shares, which depend on the pixel count (measured on numpy's OpenBLAS
    0.3.31, Haswell kernels: a 12-row tile sums each output as one FMA chain, an 8- or 4-row remainder as two
    interleaved ones, a single row takes GEMV, and two threads split the rows; docs/backend.md, Exact F32), so
    a slice of fewer pixels summed some outputs otherwise. BLAS gives one result for one shape and layout of
    the same numbers: that is all this relies on.
    """
    a = np.ascontiguousarray(np.moveaxis(cols, -2, -3))
    return np.matmul(a.swapaxes(-1, -2), wt[..., None, :, :])


def gemm_row(out_sp: tuple[int, ...]) -> int:
    """The pixels of one ``pixel_gemm`` row of a conv whose output has spatial dims ``out_sp``: an output row
    (W) of a 2-D conv, the only kind whose H the chip slices; all of a 1- or 3-D conv's."""
    return math.prod(out_sp[1:]) if len(out_sp) == 2 else math.prod(out_sp)


@kernel(top.ConvOp)
def _(p: top.ConvParams, x, w, b):
    return conv(p, x, w, b, sliced=False)


def conv(p: top.ConvParams, x, w, b, *, sliced: bool) -> np.ndarray:
    """The conv; ``sliced``: the chip computes it in H slices whose bits must equal the whole tensor's (a TPU
    F32 conv): its GEMMs run pixel-major, one per output row (``pixel_gemm``). A TOP conv is never sliced: its
    GEMMs are the weights times the columns, output-channel-major as the result is laid out, all rows at once.
    """
    nd = len(p.kernel_shape)
    n, c = x.shape[:2]
    oc, g = w.shape[0], p.group
    out_sp = tuple(
        (size + lo + hi - (k - 1) * d - 1) // s + 1
        for size, lo, hi, k, d, s in zip(
            x.shape[2:], p.pads[:nd], p.pads[nd:], p.kernel_shape, p.dilations, p.strides, strict=True
        )
    )
    dtype = np.result_type(x.dtype, w.dtype)
    taps = _live_taps(p, x.shape[2:], out_sp)
    w = w.reshape(oc, c // g, -1)
    if len(taps) < w.shape[2]:
        w = w[:, :, [np.ravel_multi_index(t, p.kernel_shape) for t in taps]]
    if not taps:
        y = np.zeros((n, oc) + out_sp, dtype)
    elif (
        not sliced
        and g > 1
        and c == g == oc
        and DepthwiseGemv.suits(p, x.shape, taps, out_sp, dtype)
        and (b is None or b.dtype == dtype)
    ):
        conv = DepthwiseGemv(p, x.shape, taps, out_sp)
        y, b = conv(x, conv.weights(w, b)), None  # the bias in the product
    elif g > 1 and c == g and all(st == 1 for st in p.strides):
        y = _depthwise_flat(x, w, taps, p, out_sp, dtype)
    elif g > 1 and c == g:
        y = _depthwise(padded(x, p.pads[:nd], p.pads[nd:]), w, taps, p, out_sp, dtype)
    elif len(taps) == 1:
        # one tap (1x1): a plain matmul of the (strided) input pixels (see _im2col)
        xp = padded(x, p.pads[:nd], p.pads[nd:])
        view = tap_view(xp, taps[0], p.strides, p.dilations, out_sp)
        wg = w.reshape(g, oc // g, c // g)
        if sliced:
            y = np.moveaxis(pixel_gemm(view.reshape(n, g, c // g, -1, gemm_row(out_sp)), wg.swapaxes(1, 2)), 4, 2)
        elif folds_bias(b, dtype, c, (n, oc) + out_sp):
            y, b = np.matmul(with_bias(wg, b), with_ones(view.reshape(n, g, c // g, -1))), None
        else:
            y = np.matmul(wg, view.reshape(n, g, c // g, -1))
    elif not sliced and Im2colFlat.suits(p, x.shape, taps, dtype) and (b is None or b.dtype == dtype):
        y, b = Im2colFlat(p, x.shape, g, oc, out_sp)(x, Im2colFlat.weights(w, g, p.kernel_shape[0], b)), None
    else:
        y = _im2col(padded(x, p.pads[:nd], p.pads[nd:]), w, g, taps, p, out_sp, dtype, sliced)
    y = y.reshape(n, oc, *out_sp)
    if b is not None:
        bias = b.reshape((1, oc) + (1,) * nd)
        if np.can_cast(bias.dtype, y.dtype, "safe"):
            y += bias
        else:
            y = y + bias
    y = y.astype(x.dtype, copy=False)
    # y is this call's own array: the fused activation may overwrite it
    return relu(y, p.relu_limit, out=y) if p.do_relu else y


# a TOP 1x1 conv's output of more elements than this, from at most _FOLD_CHANNELS input channels and no more
# than it has, takes its bias in the GEMM (a row of ones under its columns): numpy's add of a [C, 1, 1] bias
# broadcast over a big output cost a third of a thin product (mini_mobilenet's 16 -> 64 on 48x48: 75 -> 58 us,
# the input copied under the ones); a smaller output's add, or a wider input's copy, costs more than it saves
# (64 -> 24 on 24x24: 16.0 -> 15.9 us, 72 -> 24: 18.0 -> 22.3; squeezenet's 512 -> 1000 on 13x13: 1142 -> 1270,
# its K of 513 slower; the prepared kernel adds a small output's bias broadcast once)
_FOLD_BIAS = 1 << 14
_FOLD_CHANNELS = 48


def folds_bias(b: np.ndarray | None, dtype, c: int, out_shape: tuple[int, ...]) -> bool:
    """Does a TOP 1x1 conv of ``c`` input channels add its bias in the GEMM (``with_bias``, ``with_ones``)?"""
    return (
        b is not None
        and b.dtype == dtype
        and c <= min(_FOLD_CHANNELS, out_shape[1])
        and math.prod(out_shape) > _FOLD_BIAS
    )


def with_bias(wt: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """GEMM weights [g, oc / g, K] with each output channel's bias (``bias`` [oc], or zeros) as column K."""
    g, ocg = wt.shape[:2]
    b = np.zeros((g, ocg, 1), wt.dtype) if bias is None else bias.reshape(g, ocg, 1).astype(wt.dtype)
    return np.concatenate([wt, b], axis=-1)


def with_ones(cols: np.ndarray) -> np.ndarray:
    """Columns [..., K, pixels] with a row of ones under them (the bias's, see ``with_bias``), in scratch."""
    out = _COLUMNS.array(cols.shape[:-2] + (cols.shape[-2] + 1, cols.shape[-1]), cols.dtype)
    np.copyto(out[..., :-1, :], cols)
    out[..., -1, :] = 1
    return out


def _live_taps(p: top.ConvParams, spatial, out_sp) -> list[tuple[int, ...]]:
    """The kernel taps that meet the input for some output pixel; the others only ever see padding.

    A 5x5 kernel over a plane two rows high (PP-OCR's recognisers) has two rows of taps
    that only multiply zeros: they are left out of the product.
    """
    nd = len(p.kernel_shape)
    live = []
    for i in range(nd):
        begin, size, s, d = p.pads[i], spatial[i], p.strides[i], p.dilations[i]
        keep = []
        for k in range(p.kernel_shape[i]):
            first = max(0, -(-(begin - k * d) // s))  # the first output pixel whose tap is past the begin pads
            if first < out_sp[i] and k * d + first * s < begin + size:
                keep.append(k)
        live.append(keep)
    return list(itertools.product(*live))


def _depthwise(xp, w, taps, p, out_sp, dtype) -> np.ndarray:
    """One input channel per group: tap by tap, the shifted input times its channel's weight, summed.

    A fixed order of float operations per output element, not a GEMV: BLAS orders a
    GEMV's sums by the block's size, and the chip runs this kernel on H slices of
    every size (results must not depend on it). Channels go in blocks whose output
    and temporary stay in cache across the taps.
    """
    n, c = xp.shape[:2]
    oc, k = w.shape[0], len(taps)
    if oc != c:  # channel multiplier: output channel o reads input channel o // (oc / c)
        xp = np.repeat(xp, oc // c, axis=1)
    wt = w.reshape(oc, k)
    plane = n * math.prod(out_sp) * np.dtype(dtype).itemsize
    chans = max(1, min(oc, _COLS_BLOCK // (4 * plane)))
    scale_shape = (1, -1) + (1,) * len(out_sp)
    y = np.empty((n, oc) + out_sp, dtype)
    tmp = np.empty((n, chans) + out_sp, dtype)
    for c0 in range(0, oc, chans):
        c1 = min(oc, c0 + chans)
        out, part, xb = y[:, c0:c1], tmp[:, : c1 - c0], xp[:, c0:c1]
        for t, tap in enumerate(taps):
            view = tap_view(xb, tap, p.strides, p.dilations, out_sp)
            if t == 0:
                np.multiply(view, wt[c0:c1, 0].reshape(scale_shape), out=out)
            else:
                np.multiply(view, wt[c0:c1, t].reshape(scale_shape), out=part)
                out += part
    return y


# OpenBLAS runs a GEMV of fewer than 2304 * 4 multiply-adds on one thread (its sums then do not depend on
# the thread count)
_ONE_THREAD_GEMV = 2304 * 4

# the largest columns a TOP depthwise conv builds (bigger planes keep the tap passes)
_DEPTHWISE_COLS = 1 << 22

# a TOP depthwise conv makes its planes and columns a block of channels at a time, about this many bytes of
# columns, each block multiplied while it is still in cache (the columns are taps times the input: PP-OCR's 5x5
# convs' are 2.6 MB, and written whole, then read back by the products, they took twice the time of blocks; 512 KB
# blocks beat 256 KB ones by 10-20% on mini_mobilenet's, fewer numpy calls; 1 MB ones were slower)
_DEPTHWISE_BLOCK = 1 << 19


class _Scratch(threading.local):
    """One buffer per thread, grown to the largest request, for temporaries that never leave a kernel call: a
    fresh array of a few hundred KB is fresh pages from the system on every call (a page fault each 4 KB,
    which cost a small depthwise model a third of its run)."""

    def __init__(self):
        self.buf = np.empty(0, np.uint8)

    def array(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        """An uninitialised array, valid until the next request."""
        size = math.prod(shape) * np.dtype(dtype).itemsize
        if self.buf.nbytes < size:
            self.buf = np.empty(size, np.uint8)
        return self.buf[:size].view(dtype).reshape(shape)


_COLUMNS = _Scratch()
_PLANES = _Scratch()
_PRODUCTS = _Scratch()


_V = TypeVar("_V")


class _Views(threading.local, Generic[_V]):
    """A kernel's views of this thread's scratch buffers, from ``make()``, kept between calls (a small model's
    depthwise convs spent a tenth of their time making them on every call), made again once another call
    replaced a buffer (they would keep the old one alive)."""

    def __init__(self, make: Callable[[], _V]):
        self.make = make
        self.key: tuple[int, int, int] | None = None
        self.views: _V | None = None

    def get(self) -> _V:
        key = (id(_PLANES.buf), id(_COLUMNS.buf), id(_PRODUCTS.buf))
        views = self.views
        if key != self.key or views is None:
            views = self.views = self.make()
            # the buffers by id, after make() grew them: the views keep them alive, so an id seen again is the
            # same buffer
            self.key = (id(_PLANES.buf), id(_COLUMNS.buf), id(_PRODUCTS.buf))
        return views


class DepthwiseGemv:
    """TOP's depthwise conv (never sliced): per channel, its live taps' columns times its weights, one BLAS
    product per block of output rows, which multiplies and adds each tap in one pass (a third of the tap by
    tap passes of ``_depthwise``, whose order the chip's slices keep).

    The zero-padded input is split into its stride phases (plane (a, b) holds the pixels at rows a mod sh,
    columns b mod sw), in which every tap is a shift: its columns for a block of output rows are one run of
    rows x Wq elements of a flattened phase plane (Wq its width; the columns past the output's width are
    computed and dropped), so the column copies are a few long runs per channel, not one short run per
    output row. A block of k taps by rows x Wq pixels stays under ``_ONE_THREAD_GEMV`` multiply-adds, so
    the products are the same on any number of BLAS threads.
    """

    @staticmethod
    def suits(p: top.ConvParams, x_shape, taps, out_sp, dtype) -> bool:
        """2-D float32, planes big enough for a product per channel to beat the tap passes (ShuffleNet's 14x14
        and 7x7 stay with them), taps a box (live taps always are), one output row's block under one thread's
        GEMV."""
        if len(out_sp) != 2 or np.dtype(dtype) != np.float32 or math.prod(out_sp) < 128:
            return False
        rows, cols = sorted({t[0] for t in taps}), sorted({t[1] for t in taps})
        box = (
            len(taps) == len(rows) * len(cols)
            and rows[-1] - rows[0] + 1 == len(rows)
            and cols[-1] - cols[0] + 1 == len(cols)
        )
        k, wq = len(taps) + 1, DepthwiseGemv._width(p, x_shape[3], out_sp[1], taps)
        if math.prod(out_sp) * k < 2500 or k * wq > _ONE_THREAD_GEMV:
            return False
        blocks, rows = DepthwiseGemv._blocks(out_sp[0], k * wq)
        return box and math.prod(x_shape[:2]) * k * blocks * rows * wq * 4 <= _DEPTHWISE_COLS

    @staticmethod
    def _blocks(ho: int, row: int) -> tuple[int, int]:
        """(blocks, rows each): the fewest blocks of output rows whose products (``row`` multiply-adds an output
        row: taps and the bias by Wq) stay one thread's GEMV, rows spread evenly (48 rows in three blocks of 16,
        not 20 + 20 + 8 of which 12 rows were computed and dropped)."""
        blocks = -(-ho // min(ho, _ONE_THREAD_GEMV // row))
        return blocks, -(-ho // blocks)

    @staticmethod
    def _shifts(p: top.ConvParams, taps) -> list[tuple[int, int, int]]:
        """Each tap's (phase plane, shift in it: rows, columns)."""
        (sh, sw), (dh, dw) = p.strides, p.dilations
        return [((kh * dh) % sh * sw + (kw * dw) % sw, (kh * dh) // sh, (kw * dw) // sw) for kh, kw in taps]

    @staticmethod
    def _width(p: top.ConvParams, w: int, wo: int, taps) -> int:
        """Wq: a phase plane's columns, the padded input's and every tap's shifted output row."""
        sw = p.strides[1]
        return max(-(-(w + p.pads[1] + p.pads[3]) // sw), wo + max(v for _, _, v in DepthwiseGemv._shifts(p, taps)))

    def __init__(self, p: top.ConvParams, x_shape, taps, out_sp):
        n, c, h, w = x_shape
        (ho, wo), (sh, sw) = out_sp, p.strides
        top_pad, left = p.pads[0], p.pads[1]
        shifts = self._shifts(p, taps)
        wq = self._width(p, w, wo, taps)
        self.blocks, self.rows = self._blocks(ho, (len(taps) + 1) * wq)
        # rows of a phase plane: the input's, and the last block's with its lowest tap (+1: a shifted run's
        # dropped columns reach into the next row)
        hq = max(-(-(h + top_pad + p.pads[2]) // sh), self.blocks * self.rows + max(u for _, u, _ in shifts) + 1)
        self.planes = (n, c, sh, sw, hq, wq)  # the padded input's [.., row % sh, column % sw, row // sh, column // sw]
        # each phase plane's input pixels: (its part of the planes, the input's strided rows and columns)
        self.fills = []
        for a in range(sh):
            r0 = (a - top_pad) % sh
            for b in range(sw):
                c0 = (b - left) % sw
                rows, cols = range(r0, h, sh), range(c0, w, sw)
                if rows and cols:
                    u0, v0 = (r0 + top_pad) // sh, (c0 + left) // sw
                    self.fills.append(
                        (
                            (Ellipsis, a, b, slice(u0, u0 + len(rows)), slice(v0, v0 + len(cols))),
                            (Ellipsis, slice(r0, None, sh), slice(c0, None, sw)),
                        )
                    )
        self.phases = (n, c, sh * sw, hq * wq)
        self.run = run = self.rows * wq
        k = len(taps) + 1  # the taps and a row of ones, the bias's
        self.chans = chans = max(1, min(c, _DEPTHWISE_BLOCK // (n * self.blocks * k * run * 4)))
        self.cols = (n, chans, self.blocks, k, run)
        # each block of channels: (first, end, each fill's (part of the block's planes, the input's pixels))
        self.chan_blocks = [
            (
                c0,
                min(c, c0 + chans),
                [
                    (
                        (slice(None), slice(0, min(c, c0 + chans) - c0)) + dst[1:],
                        (slice(None), slice(c0, c0 + chans)) + src[1:],
                    )
                    for dst, src in self.fills
                ],
            )
            for c0 in range(0, c, chans)
        ]
        self.out = (n, c, ho, wo)
        self._views = _Views(self._make_views)
        # the taps of a phase plane whose shifts are a grid (all of them, but for a dilation in a strided
        # dimension) have their columns in one strided view of the plane: (first tap in the columns,
        # first element, (rows, columns) of taps, their element strides); the taps go in the columns in that
        # order (self.order, the weights' with them)
        self.groups, self.order = [], []
        for plane in sorted({a for a, _, _ in shifts}):
            mine = [t for t, (a, _, _) in enumerate(shifts) if a == plane]  # rows then columns ascending
            us, vs = sorted({shifts[t][1] for t in mine}), sorted({shifts[t][2] for t in mine})
            steps = [b - a for a, b in itertools.pairwise(us)] + [b - a for a, b in itertools.pairwise(vs)]
            if (
                len(mine) == len(us) * len(vs)
                and len(set(steps[: len(us) - 1])) <= 1
                and len(set(steps[len(us) - 1 :])) <= 1
            ):
                su, sv = (us[1] - us[0] if len(us) > 1 else 0), (vs[1] - vs[0] if len(vs) > 1 else 0)
                parts = [(mine, us[0] * wq + vs[0], (len(us), len(vs)), (su * wq, sv))]
            else:
                parts = [([t], shifts[t][1] * wq + shifts[t][2], (1, 1), (0, 0)) for t in mine]
            for group, first, grid, strides in parts:
                self.groups.append((len(self.order), plane * hq * wq + first, grid, strides))
                self.order += group

    def weights(self, w: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        """w [c, 1, live taps] in the columns' order of taps, then ``bias`` [c] (or zeros): the product adds it
        with the taps' (a broadcast add of the bias to the products cost a channel's GEMV): ``with_bias`` of a
        conv of c groups of one channel."""
        return with_bias(w[..., self.order], bias)

    def _make_views(self) -> tuple[np.ndarray, list, np.ndarray, np.ndarray]:
        """A block's planes, each block's (first channel, end, fills' (part of the planes, the input's pixels),
        groups' (part of the columns, view of the planes), columns, products), the products and the columns'
        row of ones, in the scratch buffers."""
        n, c, chans = self.out[0], self.out[1], self.chans
        planes = _PLANES.array((n, chans) + self.planes[2:], np.float32)
        flat = planes.reshape((n, chans) + self.phases[2:])
        cols = _COLUMNS.array(self.cols, np.float32)
        item = flat.itemsize
        copies = []
        for k0, first, grid, (su, sv) in self.groups:
            shape = self.cols[:3] + grid + (self.run,)
            strides = flat.strides[:2] + (self.run * item, su * item, sv * item, item)
            copies.append(
                (
                    cols[:, :, :, k0 : k0 + math.prod(grid)].reshape(shape),
                    np.ndarray(shape, np.float32, buffer=flat, offset=first * item, strides=strides),
                )
            )
        y = _PRODUCTS.array((n, c, self.blocks, 1, self.run), np.float32)
        blocks = [
            (
                c0,
                c1,
                [(planes[dst], src) for dst, src in fills],
                [(dst[:, : c1 - c0], src[:, : c1 - c0]) for dst, src in copies],
                cols[:, : c1 - c0],
                y[:, c0:c1],
            )
            for c0, c1, fills in self.chan_blocks
        ]
        return planes, blocks, y, cols[:, :, :, -1]

    def __call__(self, x: np.ndarray, w: np.ndarray, bounds: tuple | None = None) -> np.ndarray:
        """The conv of x by w (``weights``: the live taps in the columns' order, then the bias), clipped to
        ``bounds`` (the fused ReLU's, or None) as it is cropped out of the products, C order."""
        n, c, _, _, _, wq = self.planes
        planes, blocks, y, ones = self._views.get()
        planes.fill(0)  # the pads; each block's pixels go where the last one's were
        ones.fill(1)  # each block's columns: the taps' rows are written over, this one stays
        w = w.reshape(c, 1, 1, -1)
        for c0, c1, fills, copies, cols, out in blocks:
            for dst, src in fills:
                np.copyto(dst, x[src])
            for dst, src in copies:
                np.copyto(dst, src)
            np.matmul(w[c0:c1], cols, out=out)  # the same product per channel and block
        y = y.reshape(n, c, -1, wq)[:, :, : self.out[2], : self.out[3]]
        return cropped(y, bounds)


def cropped(y: np.ndarray, bounds: tuple | None) -> np.ndarray:
    """A fresh C-order copy of ``y`` (a view of a scratch product), clipped to ``bounds`` (a fused ReLU's
    (0, limit) float32 arrays, or None) in the same pass."""
    out = np.empty(y.shape, y.dtype)
    if bounds is None:
        np.copyto(out, y)
        return out
    return clip(y, *bounds, out=out)


def _flat_planes(x: np.ndarray, begin, end, tail: int) -> np.ndarray:
    """x zero-padded, each plane flattened, with ``tail`` more zeros after it: [n, c, plane + tail]."""
    n, c = x.shape[:2]
    grid = tuple(size + b + e for size, b, e in zip(x.shape[2:], begin, end, strict=True))
    plane = math.prod(grid)
    flat = np.zeros((n, c, plane + tail), x.dtype)
    inner = flat[:, :, :plane].reshape((n, c) + grid, copy=False)
    inner[(Ellipsis,) + tuple(slice(b, b + size) for b, size in zip(begin, x.shape[2:], strict=True))] = x
    return flat


def _depthwise_flat(x, w, taps, p, out_sp, dtype) -> np.ndarray:
    """_depthwise at stride 1 on flattened padded planes: the same float operations, in long runs.

    Output pixel j of the flattened padded plane reads element j + offset(tap), so each
    tap is one contiguous run per channel instead of a strided view whose rows are as
    short as the plane is narrow (ShuffleNet's 14x14 and 7x7 planes). Every padded
    column is computed and the last kernel-span - 1 of each row dropped.
    """
    n, c = x.shape[:2]
    nd = len(out_sp)
    oc, k = w.shape[0], len(taps)
    grid = tuple(size + b + e for size, b, e in zip(x.shape[2:], p.pads[:nd], p.pads[nd:], strict=True))
    steps = [math.prod(grid[i + 1 :]) for i in range(nd)]  # elements per step along each dim
    offsets = [sum(t * d * st for t, d, st in zip(tap, p.dilations, steps, strict=True)) for tap in taps]
    length = out_sp[0] * steps[0]  # the output rows, each a whole padded row
    flat = _flat_planes(x, p.pads[:nd], p.pads[nd:], max(0, max(offsets) + length - math.prod(grid)))
    if oc != c:  # channel multiplier: output channel o reads input channel o // (oc / c)
        flat = np.repeat(flat, oc // c, axis=1)
    wt = w.reshape(oc, k)
    chans = max(1, min(oc, _COLS_BLOCK // (4 * n * length * np.dtype(dtype).itemsize)))
    full = np.empty((n, oc, length), dtype)
    tmp = np.empty((n, chans, length), dtype)
    for c0 in range(0, oc, chans):
        c1 = min(oc, c0 + chans)
        out, part = full[:, c0:c1], tmp[:, : c1 - c0]
        for t, off in enumerate(offsets):
            view = flat[:, c0:c1, off : off + length]
            if t == 0:
                np.multiply(view, wt[c0:c1, 0, None], out=out)
            else:
                np.multiply(view, wt[c0:c1, t, None], out=part)
                out += part
    keep = (slice(None),) * 3 + tuple(slice(0, o) for o in out_sp[1:])
    return full.reshape((n, oc, out_sp[0]) + grid[1:])[keep]


class Im2colFlat:
    """A TOP conv (never sliced) at stride 1 with every tap live: its columns [n, g, kernel row, channel,
    kernel column, ho x Wp] are one strided view of the zero-padded input, each channel's plane flattened, so
    a tap's pixels are one run of ho whole padded rows (Wp wide; the columns past the output's width are
    computed and dropped), not ho runs of wo: the copy's runs are ten to thirty times longer on small planes.
    The columns in the one block ``_im2col`` would make (at most ``_COLS_BLOCK`` bytes)."""

    @staticmethod
    def suits(p: top.ConvParams, x_shape, taps, dtype) -> bool:
        if (
            len(p.kernel_shape) != 2
            or np.dtype(dtype) != np.float32
            or any(s != 1 for s in p.strides)
            or len(taps) != math.prod(p.kernel_shape)
        ):
            return False
        n, c, h, w = x_shape
        rows = h + p.pads[0] + p.pads[2] - (p.kernel_shape[0] - 1) * p.dilations[0]
        return n * c * len(taps) * rows * (w + p.pads[1] + p.pads[3]) * 4 <= _COLS_BLOCK

    @staticmethod
    def weights(w: np.ndarray, g: int, kernel_rows: int, bias: np.ndarray | None) -> np.ndarray:
        """w [oc, C/g, taps] as the product's left side [g, oc/g, K + 1], K in ``gemm_order``, then each output
        channel's bias (or zero: the columns' row of ones), C order."""
        return with_bias(gemm_weights(w, g, kernel_rows).swapaxes(1, 2), bias)

    def __init__(self, p: top.ConvParams, x_shape, g: int, oc: int, out_sp):
        n, c, h, w = x_shape
        (kh, kw), (dh, dw) = p.kernel_shape, p.dilations
        top_pad, left = p.pads[0], p.pads[1]
        wp = w + left + p.pads[3]
        plane = (h + top_pad + p.pads[2] + 1) * wp  # +1 row: the last tap's run past the output's width
        self.padded = (n, c, plane // wp, wp)
        self.inner = (slice(None), slice(None), slice(top_pad, top_pad + h), slice(left, left + w))
        run = out_sp[0] * wp
        item = np.dtype(np.float32).itemsize
        k = kh * (c // g) * kw
        self.view = (
            (n, g, kh, c // g, kw, run),
            tuple(s * item for s in (c * plane, c // g * plane, dh * wp, plane, dw, 1)),
        )
        self.cols = (n, g, k + 1, run)  # the taps' rows, then a row of ones (the bias's)
        self.out = (n, -1, out_sp[0], wp)
        self.width = out_sp[1]
        self.ocg = oc // g

        self._views = _Views(self._make_views)

    def _make_views(self) -> tuple:
        """The padded planes, their part the input goes in, the columns' taps and their view of the planes, the
        columns' row of ones, the columns and the product, in the scratch buffers."""
        xp = _PLANES.array(self.padded, np.float32)
        shape, strides = self.view
        cols = _COLUMNS.array(self.cols, np.float32)
        product = _PRODUCTS.array(self.cols[:2] + (self.ocg, self.cols[3]), np.float32)
        return (
            xp,
            xp[self.inner],
            cols[:, :, :-1].reshape(shape),
            np.ndarray(shape, np.float32, buffer=xp, strides=strides),
            cols[:, :, -1],
            cols,
            product,
            product.reshape(self.out)[..., : self.width],
        )

    def __call__(self, x: np.ndarray, wt: np.ndarray, bounds: tuple | None = None) -> np.ndarray:
        """The conv of x by ``weights`` (the bias in them), clipped to ``bounds`` (the fused ReLU's, or None) as
        it is cropped out of the product, C order."""
        xp, inner, taps, windows, ones, cols, product, y = self._views.get()
        xp.fill(0)
        np.copyto(inner, x)
        np.copyto(taps, windows)
        ones.fill(1)
        np.matmul(wt, cols, out=product)
        return cropped(y, bounds)


def gemm_order(taps: list[tuple[int, ...]]) -> tuple[int, int]:
    """(rows, rest): the live taps as a grid of their distinct first (H) indices by the rest. The GEMM's sum
    runs over (tap row, input channel, rest of the tap), so a conv whose kernel rows are folded into its
    input's channels (``layergroup.Fold``: channel dy * ic + c, a 1 x kw kernel) sums its products in the
    same order and gets the same bits."""
    rows = len({t[0] for t in taps})
    return rows, len(taps) // rows


def gemm_weights(w: np.ndarray, g: int, rows: int) -> np.ndarray:
    """w [oc, C/g, taps] (its live taps) as the GEMM's right side [g, K, oc/g], K in ``gemm_order``."""
    oc, cg, k = w.shape
    return w.reshape(g, oc // g, cg, rows, k // rows).swapaxes(2, 3).reshape(g, oc // g, cg * k).swapaxes(1, 2)


def _im2col(xp, w, g, taps, p, out_sp, dtype, sliced: bool) -> np.ndarray:
    """Columns [n, g, K, pixels] (K in ``gemm_order``) copied tap by tap from strided views, then one GEMM
    per group.

    The columns are built in blocks of output rows, so a block is still in cache when
    the GEMM reads it. ``sliced``: the GEMMs run pixel-major, one per output row (``pixel_gemm``), so an H
    slice of the output, as the chip computes it, matches the whole tensor's bits; else the weights times the
    block's columns.
    """
    n, c = xp.shape[:2]
    oc, k = w.shape[0], len(taps)
    cg, ocg = c // g, oc // g
    tap_rows, rest_taps = gemm_order(taps)
    wt = gemm_weights(w, g, tap_rows)
    rest = math.prod(out_sp[1:])
    # sliced: blocks sized by one sample's bytes, so an N slice has the whole tensor's blocks (a 1- or 3-D conv's
    # block is one pixel_gemm row)
    row_bytes = (1 if sliced else n) * c * k * rest * np.dtype(dtype).itemsize
    rows = max(1, min(out_sp[0], _COLS_BLOCK // max(row_bytes, 1)))
    y = np.empty((n, g, ocg, out_sp[0], rest), dtype)
    cols = np.empty((n, g, tap_rows, cg, rest_taps, rows) + out_sp[1:], dtype)
    for r0 in range(0, out_sp[0], rows):
        r = min(rows, out_sp[0] - r0)
        block_sp = (r,) + out_sp[1:]
        # the block's input rows: output rows r0.. start at r0 * stride
        start = r0 * p.strides[0]
        stop = start + (r - 1) * p.strides[0] + (p.kernel_shape[0] - 1) * p.dilations[0] + 1
        xb = xp[:, :, start:stop]
        part = cols[:, :, :, :, :, :r]
        for t, tap in enumerate(taps):
            part[:, :, t // rest_taps, :, t % rest_taps] = tap_view(xb, tap, p.strides, p.dilations, block_sp).reshape(
                (n, g, cg) + block_sp
            )
        if sliced:
            row = rest if len(out_sp) == 2 else r * rest  # (gemm_row)
            prod = pixel_gemm(part.reshape(n, g, cg * k, r * rest // row, row), wt)  # [n, g, rows, row, ocg]
            y[:, :, :, r0 : r0 + r] = np.moveaxis(prod.reshape(n, g, r, rest, ocg), 4, 2)
        else:
            y[:, :, :, r0 : r0 + r] = np.matmul(wt.swapaxes(1, 2), part.reshape(n, g, cg * k, r * rest)).reshape(
                n, g, ocg, r, rest
            )
    return y


@kernel(top.MatMulOp)
def _(p, a, b, bias):
    y = np.matmul(a, b)
    if bias is not None:
        y = y + bias
    return fused(y, p)


def _pool_pads(p: top.PoolParams, spatial) -> tuple[list[int], list[int]]:
    """Begin/end pads, the end grown so ceil_mode's last partial window exists."""
    nd = len(p.kernel_shape)
    dil = p.dilations or (1,) * nd
    begin, end = list(p.pads[:nd]), list(p.pads[nd:])
    for i in range(nd):
        out = top.pooled_size(spatial[i], p.kernel_shape[i], p.strides[i], begin[i], end[i], dil[i], p.ceil_mode)
        need = (out - 1) * p.strides[i] + (p.kernel_shape[i] - 1) * dil[i] + 1
        end[i] = max(end[i], need - spatial[i] - begin[i])
    return begin, end


def _pool_shape(p: top.PoolParams, spatial) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(dilations, output spatial size) of a pool over ``spatial``."""
    nd = len(p.kernel_shape)
    dil = tuple(p.dilations) or (1,) * nd
    out = tuple(
        top.pooled_size(spatial[i], p.kernel_shape[i], p.strides[i], p.pads[i], p.pads[nd + i], dil[i], p.ceil_mode)
        for i in range(nd)
    )
    return dil, out


def _global(p: top.PoolParams, spatial, begin, end) -> bool:
    """One window over the whole unpadded plane: a plain reduction of each plane."""
    return tuple(p.kernel_shape) == tuple(spatial) and not any(begin) and not any(end)


def _few_taps(kernel_shape, out_sp) -> bool:
    """Reduce tap by tap over strided views (one pass each), or over a windows view?

    Taps win up to a few dozen of them (YOLO's 5x5 SPPF pools on 4x4 planes too) or
    while there are no more of them than output pixels; a window over most of a
    plane (few outputs, many taps) is one reduction of the windows view.
    """
    return math.prod(kernel_shape) <= max(64, math.prod(out_sp))


@kernel(top.MaxPoolOp)
def _(p: top.PoolParams, x):
    nd = len(p.kernel_shape)
    begin, end = _pool_pads(p, x.shape[-nd:])
    # padding never wins: the lowest value of the dtype (-inf cannot pad an int8 tensor)
    lowest = np.iinfo(x.dtype).min if x.dtype.kind in "iu" else -np.inf
    dil, out_sp = _pool_shape(p, x.shape[-nd:])
    if _global(p, x.shape[-nd:], begin, end):
        return fused(x.reshape(x.shape[:-nd] + (-1,)).max(axis=-1).reshape(x.shape[:-nd] + out_sp), p)
    if not _few_taps(p.kernel_shape, out_sp):
        win = windows(x, p.kernel_shape, p.strides, dil, begin, end, fill=lowest)
        return fused(win.max(axis=tuple(range(-nd, 0))), p)
    return fused(window_max(padded(x, begin, end, fill=lowest), p.kernel_shape, p.strides, dil, out_sp), p)


def window_max(xp: np.ndarray, kernel_shape, strides, dilations, out_sp) -> np.ndarray:
    """Each window's maximum over padded ``xp``, one dimension at a time (last first): a 3x3 pool is 2 + 2
    maxima of strided views, not 8 (max is exact: any order gives the same value)."""
    nd = len(kernel_shape)
    y = xp
    for i in reversed(range(nd)):
        k, s, d, o = kernel_shape[i], strides[i], dilations[i], out_sp[i]
        rest = (slice(None),) * (nd - 1 - i)
        views = [y[(Ellipsis, slice(t * d, t * d + (o - 1) * s + 1, s)) + rest] for t in range(k)]
        y = np.maximum(views[0], views[1]) if k > 1 else views[0].copy()  # max(copy of the first, the second)
        for view in views[2:]:
            np.maximum(y, view, out=y)
    return y


@kernel(top.MaxPoolWithMaskOp)
def _(p: top.MaskPoolParams, x):
    nd = len(p.kernel_shape)
    spatial = x.shape[-nd:]
    begin, end = _pool_pads(p, spatial)
    lowest = np.iinfo(x.dtype).min if x.dtype.kind in "iu" else -np.inf
    dil = p.dilations or (1,) * nd
    win = windows(x, p.kernel_shape, p.strides, dil, begin, end, fill=lowest)
    flat = win.reshape(win.shape[:-nd] + (-1,))
    # the first maximum in window order, as onnxruntime; padding never wins (it is lowest, or out of range)
    pos = windows(np.arange(math.prod(spatial)).reshape(spatial), p.kernel_shape, p.strides, dil, begin, end, fill=-1)
    pos = np.broadcast_to(pos.reshape(pos.shape[:nd] + (-1,)), flat.shape)
    best = np.where(pos >= 0, flat, lowest).max(axis=-1, keepdims=True)
    pick = np.argmax((flat == best) & (pos >= 0), axis=-1)[..., None]  # argmax: the first True
    y = np.take_along_axis(flat, pick, axis=-1)[..., 0]
    where = np.take_along_axis(pos, pick, axis=-1)[..., 0]
    if p.storage_order:  # column-major: the first spatial dim varies fastest
        coords = np.unravel_index(where, spatial)
        where = np.ravel_multi_index(coords, spatial, order="F")
    plane = math.prod(spatial)
    lead = np.arange(math.prod(x.shape[:-nd])).reshape(x.shape[:-nd] + (1,) * nd) * plane
    return fused(y, p), (where + lead).astype(np.int64)


@kernel(top.AvgPoolOp)
def _(p: top.PoolParams, x):
    nd = len(p.kernel_shape)
    spatial = x.shape[-nd:]
    begin, end = _pool_pads(p, spatial)
    dil, out_sp = _pool_shape(p, spatial)
    acc = pool_sum_dtype(x.dtype)
    if _global(p, spatial, begin, end):
        total = x.reshape(x.shape[:-nd] + (-1,)).sum(axis=-1, dtype=acc).reshape(x.shape[:-nd] + out_sp)
    elif _few_taps(p.kernel_shape, out_sp):
        xp = padded(x, begin, end)
        total = np.zeros(x.shape[:-nd] + out_sp, acc)
        for tap in np.ndindex(*p.kernel_shape):
            total += tap_view(xp, tap, p.strides, dil, out_sp)
    else:
        total = windows(x, p.kernel_shape, p.strides, dil, begin, end).sum(axis=tuple(range(-nd, 0)), dtype=acc)
    return fused((total / _pool_counts(p, spatial, begin, dil, out_sp)).astype(x.dtype), p)


def pool_sum_dtype(dtype: np.dtype) -> type:
    """An average pool's sums: float32 ones of float32 (as onnxruntime sums; numpy's pairwise sum of a
    plane, a few ulps off; summing in float64 was half a PP-OCR model's squeeze-excite pools), float64 else
    (float16's would lose the small terms)."""
    return np.float32 if dtype == np.float32 else np.float64


def _pool_counts(p: top.PoolParams, spatial, begin, dil, out_sp) -> np.ndarray:
    """Each window's divisor: its real elements, plus the declared pads when count_include_pad (never ceil's extra).

    The counted region is a box, so the count is the outer product of one count per axis.
    """
    nd = len(p.kernel_shape)
    count = np.ones((), np.float64)
    for i in range(nd):
        lo, hi = (-p.pads[i], spatial[i] + p.pads[nd + i]) if p.count_include_pad else (0, spatial[i])
        # input position of every (output, tap) pair along this axis
        pos = np.arange(out_sp[i])[:, None] * p.strides[i] + np.arange(p.kernel_shape[i])[None, :] * dil[i] - begin[i]
        axis_count = ((pos >= lo) & (pos < hi)).sum(axis=1).astype(np.float64)
        count = np.multiply.outer(count, axis_count)
    return count


@kernel(top.SoftmaxOp)
def _(p: top.SoftmaxParams, x):
    if p.beta != 1.0:
        x = x * np.asarray(p.beta, x.dtype)
    shifted = x - x.max(axis=p.axis, keepdims=True)
    e = np.exp(shifted)
    if p.log:
        return shifted - np.log(e.sum(axis=p.axis, keepdims=True))
    return e / e.sum(axis=p.axis, keepdims=True)


@kernel(top.LayerNormOp)
def _(p: top.LayerNormParams, x, scale, bias):
    axes = tuple(range(p.axis % x.ndim, x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    d = x - mean
    var = (d * d).mean(axis=axes, keepdims=True)
    rstd = 1 / np.sqrt(var + np.asarray(p.eps, x.dtype))
    y = d * rstd
    if scale is not None:
        y = y * scale
    if bias is not None:
        y = y + bias
    y = y.astype(x.dtype, copy=False)
    return (y, mean, rstd) if p.stats else y


@kernel(top.BatchNormOp)
def _(p: top.EpsParams, x, mean, var, scale, bias):
    shape = (1, -1) + (1,) * (x.ndim - 2)
    inv = scale / np.sqrt(var + np.asarray(p.eps, var.dtype))
    return (x * inv.reshape(shape) + (bias - mean * inv).reshape(shape)).astype(x.dtype, copy=False)
