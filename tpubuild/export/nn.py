"""Export rules of the network ops: convolutions, matmul, pooling, softmax and normalisations.

TOP is NCHW and TOSA's convolutions and pools NHWC: each such rule transposes its input to NHWC and its
result back (IREE cancels the pairs that meet between two convs). TOSA also wants every window to end
exactly on the input's (padded) edge: the end padding is recomputed from the output size TOP inferred, and
rows no window reads are sliced off.
"""

from __future__ import annotations

import collections
import functools
import math

import numpy as np

from tpubuild.export.elementwise import RNN_ACTIVATIONS, reduce_max, reduce_mean, reduce_sum
from tpubuild.export.tosa import Emitter, Val, element, rule, scalar_literal
from tpubuild.export.tensor import strided_slice
from tpubuild.ir import top
from tpubuild.ir.types import shape_of
from tpubuild.kernels import nn as pool_kernels
from tpubuild.kernels.rnn import activation_specs

_NHWC = (0, 2, 3, 1)
_NCHW = (0, 3, 1, 2)


def _fit_windows(e: Emitter, x: Val, axes, kernel, strides, dilations, pads_begin, pads_end, outs):
    """(x, end pads) such that every output's window ends inside the padded input exactly (TOSA's rule):
    the end pad from the output size; input rows past the last window sliced off."""
    ends = []
    size = list(x.shape)
    for axis, k, s, d, pb, out in zip(axes, kernel, strides, dilations, pads_begin, outs, strict=False):
        need = (out - 1) * s + (k - 1) * d + 1 - x.shape[axis] - pb
        if need < 0:
            size[axis] += need
            need = 0
        ends.append(need)
    x = e.slice(x, [0] * x.rank, size)
    return x, ends


def _conv2d_nhwc(e: Emitter, x: Val, w, bias: Val, p, out_hw, depthwise: bool, mult: int = 1) -> Val:
    """tosa.conv2d or depthwise_conv2d of NHWC ``x`` with a TOP filter [OC, IC/g, KH, KW]: an array (reordered
    here) or a computed value (reordered by tosa ops)."""
    kh, kw = w.shape[2:]
    x, ends = _fit_windows(e, x, (1, 2), (kh, kw), p.strides, p.dilations, p.pads[:2], p.pads[2:], out_hw)
    pad = [p.pads[0], ends[0], p.pads[1], ends[1]]
    oc = w.shape[0]
    if depthwise:
        c = x.shape[3]
        shape, perm, name = (c, mult, kh, kw), (2, 3, 0, 1), "tosa.depthwise_conv2d"  # [KH, KW, C, M]
    else:
        shape, perm, name = w.shape, (0, 2, 3, 1), "tosa.conv2d"  # [OC, KH, KW, IC]
    if isinstance(w, np.ndarray):
        wv = e.const(np.ascontiguousarray(w.reshape(shape).transpose(perm)))
    else:
        wv = e.transpose(e.reshape(w, shape), perm)
    zp = e.zero_point(x.dtype)
    props = (
        f"acc_type = {element(x.dtype)}, dilation = array<i64: {p.dilations[0]}, {p.dilations[1]}>, "
        f"pad = array<i64: {', '.join(map(str, pad))}>, stride = array<i64: {p.strides[0]}, {p.strides[1]}>"
    )
    return e.op1(name, [x, wv, bias, zp, zp], [x.shape[0], *out_hw, oc], x.dtype, props)


def conv_nchw(e: Emitter, op, p, x: Val, w: np.ndarray | Val, b: Val | None, out_shape) -> Val:
    """A TOP Conv (1-D, 2-D or 3-D, any group) through TOSA's channels-last convs."""
    nd = len(p.kernel_shape)
    if nd == 1:  # as a 2-D conv of height 1
        p2 = top.ConvParams(
            kernel_shape=(1, *p.kernel_shape),
            strides=(1, *p.strides),
            pads=(0, p.pads[0], 0, p.pads[1]),
            dilations=(1, *p.dilations),
            group=p.group,
            do_relu=p.do_relu,
            relu_limit=p.relu_limit,
        )
        x2 = e.reshape(x, [x.shape[0], x.shape[1], 1, x.shape[2]])
        w2 = _reshaped(e, w, (w.shape[0], w.shape[1], 1, w.shape[2]))
        y = conv_nchw(e, op, p2, x2, w2, b, [*out_shape[:2], 1, out_shape[2]])
        return e.reshape(y, out_shape)
    if nd == 3:
        return _per_group(e, x, w, b, p.group, 1, lambda xi, wi, bi: _conv3d(e, p, xi, wi, bi, out_shape))
    if nd != 2:
        raise NotImplementedError(f"{nd}-D convolution")
    n, c = x.shape[:2]
    oc, g = w.shape[0], p.group
    if _pointwise(p, w) and (1 < g < c or (g == 1 and n == 1 and _no_depthwise(op))):
        return _grouped_pointwise(e, p, x, w, b, out_shape)
    out_hw = list(out_shape[2:])
    xh = e.transpose(x, _NHWC)
    if 1 < g == c:
        bias = b if b is not None else e.const(np.zeros(oc, x.dtype))
        y = _conv2d_nhwc(e, xh, w, bias, p, out_hw, True, oc // c)
    elif g == 1 and _pointwise(p, w):
        y = _pointwise_nhwc(e, xh, w, b)
    else:
        y = _per_group(e, xh, w, b, g, 3, lambda xi, wi, bi: _conv2d_nhwc(e, xi, wi, bi, p, out_hw, False))
    if p.do_relu:
        y = e.relu(y, p.relu_limit)
    return e.transpose(y, _NCHW)


def _per_group(e: Emitter, x: Val, w: np.ndarray | Val, b: Val | None, g: int, axis: int, conv) -> Val:
    """A grouped conv as ``conv(x, w, bias)`` once per group on its channels (``axis`` of x), concatenated there."""
    if g == 1:
        return conv(x, w, b if b is not None else e.const(np.zeros(w.shape[0], x.dtype)))
    icg, ocg = x.shape[axis] // g, w.shape[0] // g
    bias_all = b.array if b is not None and b.array is not None else None
    parts = []
    for i in range(g):
        start, size = [0] * x.rank, list(x.shape)
        start[axis], size[axis] = i * icg, icg
        if b is None:
            bi = e.const(np.zeros(ocg, x.dtype))
        elif bias_all is not None:
            bi = e.const(bias_all[i * ocg : (i + 1) * ocg])
        else:
            bi = e.slice(b, [i * ocg], [ocg])
        if isinstance(w, np.ndarray):
            wi = w[i * ocg : (i + 1) * ocg]
        else:
            wi = e.slice(w, [i * ocg] + [0] * (w.rank - 1), [ocg, *w.shape[1:]])
        parts.append(conv(e.slice(x, start, size), wi, bi))
    return e.concat(parts, axis)


def _is_depthwise(op) -> bool:
    if not isinstance(op, top.ConvOp):
        return False
    p = op.params
    return p.group > 1 and p.group == shape_of(op.operands[0].type)[1]


def _no_depthwise(op) -> bool:
    """Whether the function holding the conv has no depthwise conv."""
    return not _has_depthwise(op.parent_block())


@functools.lru_cache(maxsize=2)  # asked by each 1x1 conv of the function being exported
def _has_depthwise(block) -> bool:
    return any(_is_depthwise(op) for op in block.ops)


def _pointwise(p, w) -> bool:
    return tuple(w.shape[2:]) == (1, 1) and set(p.strides) == {1} and not any(p.pads)


def _grouped_pointwise(e: Emitter, p, x: Val, w: np.ndarray | Val, b: Val | None, out_shape) -> Val:
    """A 1x1 conv (of one image, or grouped as ShuffleNet's) as one batched tosa.matmul in NCHW: per image and
    group, the group's [OC/g, IC/g] filter times its [IC/g, H*W] channels. A conv per group, sliced and
    concatenated, made ShuffleNet's export 4x the ops and its iree-compile twice IREE's own ONNX path's. Ungrouped,
    the result stays NCHW, where a Concat of channels is a contiguous join that IREE writes in place, not a strided
    copy per input: through channels-last tosa.conv2d, ddddocr_det's CSP blocks compiled to 90 dispatches where
    IREE's own ONNX path makes 72, and in this form to 80. Not in a model with depthwise convs, which TOSA has
    only channels-last: MobileNet's depthwise-pointwise pairs would alternate layouts (retinaface_mnet: twice the
    transposes). Nor for several images, whose filter this form repeats per image."""
    (n, c, h, wd), oc, g = x.shape, w.shape[0], p.group
    icg, ocg = c // g, oc // g
    if isinstance(w, np.ndarray):
        filters = e.const(np.ascontiguousarray(np.broadcast_to(w.reshape(1, g, ocg, icg), (n, g, ocg, icg))))
    else:
        filters = e.broadcast_to(e.reshape(w, [1, g, ocg, icg]), [n, g, ocg, icg])
    filters = e.reshape(filters, [n * g, ocg, icg])
    y = e.reshape(_matmul3(e, filters, e.reshape(x, [n * g, icg, h * wd])), out_shape)
    return _bias_relu(e, p, y, b)


def _pointwise_nhwc(e: Emitter, x: Val, w: np.ndarray | Val, b: Val | None) -> Val:
    """A 1x1 conv of NHWC ``x`` as one tosa.matmul of its [N*H*W, IC] pixels by the [IC, OC] filter. As a
    tosa.conv2d, IREE tiles its output channels by a divisor of OC that is no multiple of the vector width
    (60 of 240) and LLVM's loop strength reduction then took 0.3 s per such conv: ppocrv4_rec compiled in 1.3x
    the CPU time of IREE's own ONNX path, and in 0.8x to 0.9x as a matmul."""
    n, h, wd, c = x.shape
    oc = w.shape[0]
    if isinstance(w, np.ndarray):
        filt = e.const(np.ascontiguousarray(w.reshape(oc, c).T[None]))
    else:
        filt = e.reshape(e.transpose(e.reshape(w, [oc, c]), (1, 0)), [1, c, oc])
    y = _matmul3(e, e.reshape(x, [1, n * h * wd, c]), filt)
    if b is not None:
        y = e.binary("tosa.add", y, e.reshape(b, [1, 1, oc]))
    return e.reshape(y, [n, h, wd, oc])


def _matmul3(e: Emitter, a: Val, b: Val) -> Val:
    """tosa.matmul of [B, M, K] and [B, K, N], in a's type; 16-bit floats accumulate in float32 and round once
    at the end, as numpy's (and ml_dtypes') matmul and the conv kernels do."""
    zp = e.zero_point(a.dtype)
    acc = np.float32 if a.is_float and a.dtype.itemsize == 2 else a.dtype
    y = e.op1("tosa.matmul", [a, b, zp, zp], [a.shape[0], a.shape[1], b.shape[2]], acc)
    return e.cast(y, a.dtype)


def _bias_relu(e: Emitter, p, y: Val, b: Val | None) -> Val:
    """An NCHW result plus the per-channel bias, then the fused ReLU."""
    if b is not None:
        y = e.binary("tosa.add", y, e.reshape(b, [1, y.shape[1], 1, 1]))
    if p.do_relu:
        y = e.relu(y, p.relu_limit)
    return y


def _conv3d(e: Emitter, p, x: Val, w: np.ndarray | Val, bias: Val, out_shape) -> Val:
    """tosa.conv3d on NDHWC, its filter [OC, KD, KH, KW, IC]."""
    oc = w.shape[0]
    xh = e.transpose(x, (0, 2, 3, 4, 1))
    xh, ends = _fit_windows(
        e, xh, (1, 2, 3), w.shape[2:], p.strides, p.dilations, p.pads[:3], p.pads[3:], out_shape[2:]
    )
    if isinstance(w, np.ndarray):
        wv = e.const(np.ascontiguousarray(w.transpose(0, 2, 3, 4, 1)))
    else:
        wv = e.transpose(w, (0, 2, 3, 4, 1))
    zp = e.zero_point(x.dtype)
    pad = [v for pair in zip(p.pads[:3], ends, strict=True) for v in pair]
    props = (
        f"acc_type = {element(x.dtype)}, dilation = array<i64: {', '.join(map(str, p.dilations))}>, "
        f"pad = array<i64: {', '.join(map(str, pad))}>, stride = array<i64: {', '.join(map(str, p.strides))}>"
    )
    y = e.op1("tosa.conv3d", [xh, wv, bias, zp, zp], [x.shape[0], *out_shape[2:], oc], x.dtype, props)
    if p.do_relu:
        y = e.relu(y, p.relu_limit)
    return e.transpose(y, (0, 4, 1, 2, 3))


def _reshaped(e: Emitter, w, shape):
    return w.reshape(shape) if isinstance(w, np.ndarray) else e.reshape(w, shape)


@rule(top.ConvOp)
def _(e: Emitter, op, p: top.ConvParams, args):
    x, w, b = args
    return conv_nchw(e, op, p, x, w.array if w.array is not None else w, b, op.results[0].type.get_shape())


def _patches(p: top.DeconvParams, x: Val, out_shape) -> bool:
    """A transposed conv whose output windows tile the output: stride = kernel, no padding, one group."""
    return (
        len(p.kernel_shape) == 2
        and p.group == 1
        and tuple(p.strides) == tuple(p.kernel_shape)
        and set(p.dilations) == {1}
        and not any(p.pads)
        and not any(p.output_padding or ())
        and list(out_shape[2:]) == [d * k for d, k in zip(x.shape[2:], p.kernel_shape, strict=True)]
    )


def _deconv_as_patches(e: Emitter, p: top.DeconvParams, x: Val, w: Val, b: Val | None, out_shape) -> Val:
    """Each input pixel's channels times the [IC, OC * KH * KW] filter is its output window: one product, then
    the windows put in place (DBNet's and U-Net's upsampling). As a conv on the zero-stuffed input it is
    KH * KW times the work, and the stuffed input a transpose of its own in IREE."""
    n, ic, h, wd = x.shape
    oc = w.shape[1]
    kh, kw = p.kernel_shape
    rows = e.reshape(e.transpose(x, _NHWC), [1, n * h * wd, ic])
    filters = (
        e.const(w.array.reshape(1, ic, oc * kh * kw)) if w.array is not None else e.reshape(w, [1, ic, oc * kh * kw])
    )
    y = e.reshape(_matmul3(e, rows, filters), [n, h, wd, oc, kh, kw])
    return _bias_relu(e, p, e.reshape(e.transpose(y, (0, 3, 1, 4, 2, 5)), out_shape), b)


@rule(top.DeconvOp)
def _(e: Emitter, op, p: top.DeconvParams, args):
    """A transposed conv as a conv: the input with stride - 1 zeros between its pixels, padded by
    (k - 1) * d - pad, convolved with the flipped filter (its in/out channels swapped per group)."""
    x, w, b = args
    nd = len(p.kernel_shape)
    out_shape = list(op.results[0].type.get_shape())
    if _patches(p, x, out_shape):
        return _deconv_as_patches(e, p, x, w, b, out_shape)
    g = p.group
    ic, ocg = w.shape[:2]
    k = tuple(w.shape[2:])
    # [IC, OC/g, k...] -> [OC, IC/g, k...], flipped in space
    grouped = (g, ic // g, ocg, *k)
    swap = (0, 2, 1, *range(3, 3 + nd))
    if w.array is not None:
        wt = w.array.reshape(grouped).transpose(swap).reshape(g * ocg, ic // g, *k)
        wt = np.ascontiguousarray(np.flip(wt, axis=tuple(range(2, 2 + nd))))
    else:
        wt = e.reshape(e.transpose(e.reshape(w, grouped), swap), (g * ocg, ic // g, *k))
        for axis in range(2, 2 + nd):
            wt = e.unary("tosa.reverse", wt, f"axis = {axis} : i32")
    # zeros between pixels: each spatial dim as [L, 1] padded to [L, s], flattened, the trailing zeros cut
    spatial = list(x.shape[2:])
    for i, s in enumerate(p.strides):
        if s == 1:
            continue
        axis = 2 + i
        shape = list(x.shape)
        x = e.reshape(x, [*shape[: axis + 1], 1, *shape[axis + 1 :]])
        ends = [0] * x.rank
        ends[axis + 1] = s - 1
        x = e.pad(x, [0] * x.rank, ends)
        shape[axis] *= s
        x = e.reshape(x, shape)
        size = list(x.shape)
        size[axis] = (spatial[i] - 1) * s + 1
        x = e.slice(x, [0] * x.rank, size)
    extra = p.output_padding or (0,) * nd
    begins, ends, crop_begin = [], [], []
    for i in range(nd):
        reach = (p.kernel_shape[i] - 1) * p.dilations[i]
        begins.append(reach - p.pads[i])
        ends.append(reach - p.pads[nd + i] + extra[i])
    # negative pads crop: done on the zero-stuffed input before the conv
    start = [0, 0] + [max(0, -b_) for b_ in begins]
    size = [x.shape[0], x.shape[1]] + [x.shape[2 + i] - max(0, -begins[i]) - max(0, -ends[i]) for i in range(nd)]
    if any(v < 0 for v in begins + ends):
        x = e.slice(x, start, size)
    del crop_begin
    pads = tuple(max(0, v) for v in begins) + tuple(max(0, v) for v in ends)
    cp = top.ConvParams(
        kernel_shape=p.kernel_shape,
        strides=(1,) * nd,
        pads=pads,
        dilations=p.dilations,
        group=g,
        do_relu=p.do_relu,
        relu_limit=p.relu_limit,
    )
    return conv_nchw(e, op, cp, x, wt, b, out_shape)


@rule(top.MatMulOp)
def _(e: Emitter, op, p: top.ReluParams, args):
    a, b, bias = args
    out_shape = list(op.results[0].type.get_shape())
    a2 = e.reshape(a, [1, a.shape[0]]) if a.rank == 1 else a
    b2 = e.reshape(b, [b.shape[0], 1]) if b.rank == 1 else b
    m, k = a2.shape[-2:]
    n = b2.shape[-1]
    batch = tuple(np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2]))
    nb = math.prod(batch)
    if b2.rank == 2:
        # weights shared by every row: one [1, batch * M, K] x [1, K, N] product
        a3 = e.reshape(a2, [1, nb * m, k])
        b3 = e.reshape(b2, [1, k, n])
    else:
        a3 = e.reshape(e.broadcast_to(a2, [*batch, m, k]), [nb, m, k])
        b3 = e.reshape(e.broadcast_to(b2, [*batch, k, n]), [nb, k, n])
    y = e.reshape(_matmul3(e, a3, b3), out_shape)
    if bias is not None:
        y = e.binary("tosa.add", y, bias)
    if p.do_relu:
        y = e.relu(y, p.relu_limit)
    return y


def _pool(e: Emitter, op, p: top.PoolParams, x: Val, kind: str) -> Val:
    out_shape = list(op.results[0].type.get_shape())
    nd = len(p.kernel_shape)
    if nd > 2 or any(d != 1 for d in (p.dilations or ())):
        return _pool_taps(e, p, x, kind)[0]
    if nd == 1:
        p2 = top.PoolParams(
            kernel_shape=(1, *p.kernel_shape),
            strides=(1, *p.strides),
            pads=(0, p.pads[0], 0, p.pads[1]),
            dilations=(1, *(p.dilations or (1,))),
            ceil_mode=p.ceil_mode,
            count_include_pad=p.count_include_pad,
            do_relu=p.do_relu,
            relu_limit=p.relu_limit,
        )
        x2 = e.reshape(x, [*x.shape[:2], 1, x.shape[2]])
        y = _pool_2d(e, op, p2, x2, kind, [*out_shape[:2], 1, out_shape[2]])
        return e.reshape(y, out_shape)
    if nd != 2 or x.rank != 4:
        raise NotImplementedError(f"{nd}-D pooling")
    return _pool_2d(e, op, p, x, kind, out_shape)


def _pool_2d(e: Emitter, op, p: top.PoolParams, x: Val, kind: str, out_shape) -> Val:
    if any(d != 1 for d in (p.dilations or ())):
        raise NotImplementedError("dilated pooling")
    xh = e.transpose(x, _NHWC)
    begins = list(p.pads[:2])
    if kind == "avg" and p.count_include_pad and any(p.pads):
        # the declared pads count: written as zeros, then pooled without padding
        xh = e.pad(xh, [0, p.pads[0], p.pads[1], 0], [0, p.pads[2], p.pads[3], 0])
        begins = [0, 0]
    xh, ends = _fit_windows(e, xh, (1, 2), p.kernel_shape, p.strides, (1, 1), begins, [0, 0], out_shape[2:])
    if kind == "avg" and p.count_include_pad and any(p.pads):
        ends = [max(0, v) for v in ends]
    if any(pb >= k for pb, k in zip(begins, p.kernel_shape, strict=False)) or any(
        pe >= k for pe, k in zip(ends, p.kernel_shape, strict=False)
    ):
        fill = -math.inf if kind == "max" else 0.0
        if kind != "max":
            raise NotImplementedError("average pooling with pads as large as its window")
        xh = e.pad(xh, [0, begins[0], begins[1], 0], [0, ends[0], ends[1], 0], fill)
        begins, ends = [0, 0], [0, 0]
    pad = f"array<i64: {begins[0]}, {ends[0]}, {begins[1]}, {ends[1]}>"
    kernel = f"array<i64: {p.kernel_shape[0]}, {p.kernel_shape[1]}>"
    stride = f"array<i64: {p.strides[0]}, {p.strides[1]}>"
    shape = [x.shape[0], out_shape[2], out_shape[3], x.shape[1]]
    if kind == "max":
        y = e.op1("tosa.max_pool2d", [xh], shape, x.dtype, f"kernel = {kernel}, pad = {pad}, stride = {stride}")
    else:
        zp = e.zero_point(x.dtype)
        props = f"acc_type = {element(x.dtype)}, kernel = {kernel}, pad = {pad}, stride = {stride}"
        y = e.op1("tosa.avg_pool2d", [xh, zp, zp], shape, x.dtype, props)
    if p.do_relu:
        y = e.relu(y, p.relu_limit)
    return e.transpose(y, _NCHW)


@rule(top.MaxPoolOp)
def _(e: Emitter, op, p, args):
    return _pool(e, op, p, args[0], "max")


@rule(top.MaxPoolWithMaskOp)
def _(e: Emitter, op, p: top.MaskPoolParams, args):
    return _pool_taps(e, p, args[0], "argmax")


def _pool_taps(e: Emitter, p: top.PoolParams, x: Val, kind: str) -> tuple[Val, ...]:
    """A pool TOSA has no op for (3-D, dilated, with indices) as the kernel computes it tap by tap: the input
    padded as the kernel pads it (the lowest value for max, zeros for average), one strided slice per window
    tap, their maximum or their sum in tap order divided by the kernel's counts; with indices, the first
    maximum's flat position among the real (unpadded) taps, as the kernel and onnxruntime pick it."""
    nd = len(p.kernel_shape)
    spatial = x.shape[-nd:]
    begin, end = pool_kernels._pool_pads(p, spatial)
    dil, out_sp = pool_kernels._pool_shape(p, spatial)
    lowest = float(np.iinfo(x.dtype).min) if x.dtype.kind in "iu" else -math.inf
    xp = e.pad(x, [0] * (x.rank - nd) + begin, [0] * (x.rank - nd) + end, lowest if kind != "avg" else 0.0)
    lead = x.shape[:-nd]
    taps = [
        strided_slice(
            e,
            xp,
            [0] * len(lead) + [t * d for t, d in zip(tap, dil, strict=True)],
            [*lead, *out_sp],
            [1] * len(lead) + list(p.strides),
        )
        for tap in np.ndindex(*p.kernel_shape)
    ]
    el = element(x.dtype)
    if kind == "max":
        return (
            e.relu(_reduce_taps(e, taps, "tosa.maximum"), p.relu_limit)
            if p.do_relu
            else _reduce_taps(e, taps, "tosa.maximum"),
        )
    if kind == "avg":
        total = _reduce_taps(e, taps, "tosa.add")
        counts = pool_kernels._pool_counts(p, spatial, begin, dil, out_sp).astype(x.dtype)
        y = e.map([total, e.const(counts)], lambda bd, v: bd.f("arith.divf", *v, el=el))
        return (e.relu(y, p.relu_limit) if p.do_relu else y,)
    # the flat position of each (output, tap) in the unpadded plane, -1 on padding
    grids = np.meshgrid(*[np.arange(o) * s for o, s in zip(out_sp, p.strides, strict=True)], indexing="ij")
    positions = []
    for tap in np.ndindex(*p.kernel_shape):
        coords = [g + t * d - b for g, t, d, b in zip(grids, tap, dil, begin, strict=True)]
        inside = np.logical_and.reduce([(c >= 0) & (c < n) for c, n in zip(coords, spatial, strict=True)])
        clipped = [np.clip(c, 0, n - 1) for c, n in zip(coords, spatial, strict=True)]
        flat = np.ravel_multi_index(clipped, spatial, order="F" if getattr(p, "storage_order", 0) else "C")
        positions.append(e.const(np.where(inside, flat, -1).astype(np.int64).reshape((1,) * len(lead) + tuple(out_sp))))

    def first_max(pick_index: bool):
        def body(bd, v):
            vals, pos = v[: len(taps)], v[len(taps) :]
            best, at = vals[0], bd.const(-1, np.int64)
            for value, where in zip(vals, pos, strict=True):
                valid = bd.op(
                    "arith.cmpi", where, bd.const(0, np.int64), type="i64", result="i1", props="predicate = 5 : i64"
                )
                first = bd.op(
                    "arith.cmpi", at, bd.const(0, np.int64), type="i64", result="i1", props="predicate = 2 : i64"
                )
                if x.is_float:
                    larger = bd.cmpf("ogt", value, best, el)
                else:
                    larger = bd.op("arith.cmpi", value, best, type=el, result="i1", props="predicate = 4 : i64")
                take = bd.op("arith.andi", valid, bd.op("arith.ori", first, larger, type="i1"), type="i1")
                best, at = bd.select(take, value, best, el), bd.select(take, where, at, "i64")
            return at if pick_index else best

        return body

    values = e.map([*taps, *positions], first_max(False))
    index = e.map([*taps, *positions], first_max(True), dtype=np.int64)
    plane = math.prod(spatial)
    offsets = (np.arange(math.prod(lead)) * plane).reshape(tuple(lead) + (1,) * nd).astype(np.int64)
    return (e.relu(values, p.relu_limit) if p.do_relu else values), e.binary("tosa.add", index, e.const(offsets))


def _reduce_taps(e: Emitter, taps: list[Val], name: str) -> Val:
    y = taps[0]
    for t in taps[1:]:
        y = e.binary(name, y, t)
    return y


@rule(top.AvgPoolOp)
def _(e: Emitter, op, p, args):
    return _pool(e, op, p, args[0], "avg")


@rule(top.SoftmaxOp)
def _(e: Emitter, op, p: top.SoftmaxParams, args):
    (x,) = args
    el = element(x.dtype)
    axis = p.axis % x.rank
    if p.beta != 1.0:
        x = e.binary("tosa.mul", x, e.scalar(p.beta, x.dtype, x.rank))
    if not p.log and x.dtype == np.float32:
        # linalg's own op (TOSA has none), which IREE compiles to one dispatch where the formula below takes three
        # (16-bit floats keep the formula: IREE links no fmaxf for its f16 softmax, and their sums accumulate in
        # float32 as the kernel's)
        init = e.op1("tensor.empty", [], x.shape, x.dtype)
        return e.op1("linalg.softmax", [x, init], x.shape, x.dtype, f"dimension = {axis} : i64")
    m = reduce_max(e, x, [axis])
    ex = e.map([x, m], lambda bd, v: bd.f("math.exp", bd.f("arith.subf", *v, el=el), el=el))
    s = reduce_sum(e, ex, [axis])
    if p.log:
        return e.map(
            [x, m, s],
            lambda bd, v: bd.f(
                "arith.subf", bd.f("arith.subf", v[0], v[1], el=el), bd.f("math.log", v[2], el=el), el=el
            ),
        )
    return e.map([ex, s], lambda bd, v: bd.f("arith.divf", *v, el=el))


def _normalize(e: Emitter, x: Val, axes, eps: float) -> tuple[Val, Val, Val]:
    """(x - mean) / sqrt(var + eps) over ``axes``, with the mean and 1 / sqrt(var + eps) (kept dims)."""
    el = element(x.dtype)
    mean = reduce_mean(e, x, axes)
    centered = e.binary("tosa.sub", x, mean)
    var = reduce_mean(e, e.binary("tosa.mul", centered, centered), axes)
    rstd = e.map(
        [var], lambda bd, v: bd.f("math.rsqrt", bd.f("arith.addf", v[0], bd.const(eps, x.dtype), el=el), el=el)
    )
    return e.binary("tosa.mul", centered, rstd), mean, rstd


@rule(top.LayerNormOp)
def _(e: Emitter, op, p: top.LayerNormParams, args):
    x, scale, bias = args
    axis = p.axis % x.rank
    y, mean, rstd = _normalize(e, x, range(axis, x.rank), p.eps)
    if scale is not None:
        y = e.binary("tosa.mul", y, scale)
    if bias is not None:
        y = e.binary("tosa.add", y, bias)
    return (y, mean, rstd) if p.stats else y


@rule(top.RMSNormOp)
def _(e: Emitter, op, p: top.RMSNormParams, args):
    x, gamma = args
    el = element(x.dtype)
    axes = range(p.axis % x.rank, x.rank)
    ms = reduce_mean(e, e.binary("tosa.mul", x, x), axes)
    rstd = e.map(
        [ms], lambda bd, v: bd.f("math.rsqrt", bd.f("arith.addf", v[0], bd.const(p.eps, x.dtype), el=el), el=el)
    )
    y = e.binary("tosa.mul", x, rstd)
    return e.binary("tosa.mul", y, gamma) if gamma is not None else y


def _per_channel(e: Emitter, v: Val, rank: int) -> Val:
    """A [C] vector as [1, C, 1, ...] against an N, C, ... tensor."""
    return e.reshape(v, [1, v.shape[0]] + [1] * (rank - 2))


@rule(top.BatchNormOp)
def _(e: Emitter, op, p: top.EpsParams, args):
    x, mean, var, scale, bias = args
    el = element(x.dtype)
    rank = x.rank
    y = e.binary("tosa.sub", x, _per_channel(e, mean, rank))
    rstd = e.map(
        [_per_channel(e, var, rank)],
        lambda bd, v: bd.f("math.rsqrt", bd.f("arith.addf", v[0], bd.const(p.eps, x.dtype), el=el), el=el),
    )
    y = e.binary("tosa.mul", y, rstd)
    if scale is not None:
        y = e.binary("tosa.mul", y, _per_channel(e, scale, rank))
    if bias is not None:
        y = e.binary("tosa.add", y, _per_channel(e, bias, rank))
    return y


@rule(top.InstanceNormOp)
def _(e: Emitter, op, p: top.EpsParams, args):
    x, weight, bias = args
    y, _, _ = _normalize(e, x, range(2, x.rank), p.eps)
    if weight is not None:
        y = e.binary("tosa.mul", y, _per_channel(e, weight, x.rank))
    if bias is not None:
        y = e.binary("tosa.add", y, _per_channel(e, bias, x.rank))
    return y


@rule(top.GroupNormOp)
def _(e: Emitter, op, p: top.GroupNormParams, args):
    x, weight, bias = args
    n, c = x.shape[:2]
    g = p.num_groups
    xg = e.reshape(x, [n, g, (c // g) * math.prod(x.shape[2:])])
    y, _, _ = _normalize(e, xg, [2], p.eps)
    y = e.reshape(y, x.shape)
    if weight is not None:
        y = e.binary("tosa.mul", y, _per_channel(e, weight, x.rank))
    if bias is not None:
        y = e.binary("tosa.add", y, _per_channel(e, bias, x.rank))
    return y


@rule(top.LRNOp)
def _(e: Emitter, op, p: top.LRNParams, args):
    """x / (bias + alpha / size * sum of squares over ``size`` neighbouring channels) ** beta; the sum as an
    average pool over channels of the zero-padded squares (so every window counts ``size``)."""
    (x,) = args
    el = element(x.dtype)
    n, c = x.shape[:2]
    hw = math.prod(x.shape[2:])
    sq = e.binary("tosa.mul", x, x)
    # [N, C, HW, 1] read as NHWC: pooled over "H" = the channels
    t = e.reshape(sq, [n, c, hw, 1])
    lo, hi = (p.size - 1) // 2, p.size // 2
    t = e.pad(t, [0, lo, 0, 0], [0, hi, 0, 0])
    zp = e.zero_point(x.dtype)
    props = (
        f"acc_type = {el}, kernel = array<i64: {p.size}, 1>, pad = array<i64: 0, 0, 0, 0>, stride = array<i64: 1, 1>"
    )
    avg = e.op1("tosa.avg_pool2d", [t, zp, zp], [n, c, hw, 1], x.dtype, props)
    avg = e.reshape(avg, x.shape)

    def body(bd, v):
        base = bd.f(
            "arith.addf", bd.const(p.bias, x.dtype), bd.f("arith.mulf", bd.const(p.alpha, x.dtype), v[1], el=el), el=el
        )
        return bd.f("arith.divf", v[0], bd.f("math.powf", base, bd.const(p.beta, x.dtype), el=el), el=el)

    return e.map([x, avg], body)


__all__ = ["conv_nchw", "scalar_literal"]


def _einsum_subscripts(mode: str, ranks: list[int]) -> tuple[list[str], str]:
    """Each operand's subscripts and the output's, numpy's way: an ellipsis as letters of its own (right
    aligned, broadcast), an implicit output as the ellipsis then the letters used once, in alphabetical order."""
    mode = mode.replace(" ", "")
    lhs, out = mode.split("->") if "->" in mode else (mode, None)
    subs = lhs.split(",")
    spare = [c for c in "ZYXWVUTSRQPONMLKJIHGFEDCBA" if c not in mode]
    dots = max((r - len(s.replace("...", "")) for s, r in zip(subs, ranks, strict=True) if "..." in s), default=0)
    ell = "".join(spare[:dots][::-1])
    subs = [s.replace("...", ell[dots - (r - len(s.replace("...", ""))) :]) for s, r in zip(subs, ranks, strict=True)]
    if out is None:
        counts = collections.Counter("".join(subs))
        out = ell + "".join(sorted(c for c in counts if counts[c] == 1 and c not in ell))
    return subs, out.replace("...", ell)


@rule(top.EinsumOp)
def _(e: Emitter, op, p: top.EinsumParams, args):
    """One ``linalg.generic``: a loop per subscript letter, the output's parallel and the rest reductions, the
    products of the operands' elements summed into a zero tensor."""
    subs, out = _einsum_subscripts(p.mode, [v.rank for v in args])
    x0 = args[0]
    if not x0.is_float or any(v.dtype != x0.dtype for v in args):
        raise NotImplementedError(f"einsum of {[v.dtype.name for v in args]}")
    letters = list(dict.fromkeys(out + "".join(subs)))
    sizes = {}
    for sub, v in zip(subs, args, strict=True):
        for letter, d in zip(sub, v.shape, strict=True):
            sizes[letter] = max(sizes.get(letter, 1), d)
    if any(
        d not in (1, sizes[letter])
        for sub, v in zip(subs, args, strict=True)
        for letter, d in zip(sub, v.shape, strict=True)
    ):
        raise NotImplementedError(f"einsum {p.mode!r} on shapes {[v.shape for v in args]}")
    dims = ", ".join(f"d{i}" for i in range(len(letters)))
    index = {letter: f"d{i}" for i, letter in enumerate(letters)}

    def amap(sub: str, shape) -> str:
        exprs = ["0" if d == 1 and sizes[letter] != 1 else index[letter] for letter, d in zip(sub, shape, strict=True)]
        return f"affine_map<({dims}) -> ({', '.join(exprs)})>"

    shape = [sizes[letter] for letter in out]
    el = element(x0.dtype)
    init = e.const(np.zeros(shape, x0.dtype))
    ins = [e.use(v) for v in args]
    names = [e.fresh() for _ in args]
    acc = e.fresh()
    lines = [f"^bb0({', '.join(f'{n}: {el}' for n in names)}, {acc}: {el}):"]
    prod = names[0]
    for n in names[1:]:
        new = e.fresh()
        lines.append(f'{new} = "arith.mulf"({prod}, {n}) : ({el}, {el}) -> {el}')
        prod = new
    total = e.fresh()
    lines.append(f'{total} = "arith.addf"({acc}, {prod}) : ({el}, {el}) -> {el}')
    lines.append(f'"linalg.yield"({total}) : ({el}) -> ()')
    maps = [amap(s, v.shape) for s, v in zip(subs, args, strict=True)] + [amap(out, shape)]
    iterators = ", ".join(
        "#linalg.iterator_type<parallel>" if letter in out else "#linalg.iterator_type<reduction>" for letter in letters
    )
    props = (
        f"indexing_maps = [{', '.join(maps)}], iterator_types = [{iterators}], "
        f"operandSegmentSizes = array<i32: {len(ins)}, 1>"
    )
    return e.op("linalg.generic", [*ins, init], [(shape, x0.dtype)], props, region=lines)[0]


@rule(top.CumSumOp)
def _(e: Emitter, op, p: top.CumSumParams, args):
    """A float cumulative sum as a product with a triangular matrix of ones along the axis (moved last); an
    integer one as a sum under that mask (a matmul would go through floats)."""
    (x,) = args
    axis = p.axis % x.rank
    n = x.shape[axis]
    i, j = np.indices((n, n))
    keep = (i >= j) if p.reverse else (i <= j)
    if p.exclusive:
        keep &= i != j
    if not x.is_float:
        # integers (exact, wrapping): a linalg.generic summing x[.., j, ..] where keep[j, i], j a reduction loop
        el = element(x.dtype)
        out = [f"d{d}" for d in range(x.rank)]
        at = [f"d{x.rank}" if d == axis else f"d{d}" for d in range(x.rank)]

        def body(bd, v, acc):
            return bd.select(v[1], bd.op("arith.addi", acc, v[0], type=el), acc, el)

        mask = e.const(keep)
        return e.loops([(x, at), (mask, [f"d{x.rank}", f"d{axis}"])], e.const(np.zeros(x.shape, x.dtype)), out, 1, body)
    perm = [d for d in range(x.rank) if d != axis] + [axis]
    moved = e.transpose(x, perm)
    rows = math.prod(moved.shape[:-1])
    zp = e.zero_point(x.dtype)
    prod = e.op1(
        "tosa.matmul",
        [e.reshape(moved, [1, rows, n]), e.const(keep.astype(x.dtype).reshape(1, n, n)), zp, zp],
        [1, rows, n],
        x.dtype,
    )
    return e.transpose(e.reshape(prod, moved.shape), [int(i) for i in np.argsort(perm)])


# ---- recurrent layers ------------------------------------------------------------------------------------
# Unrolled over the (static) sequence as the kernel (kernels/rnn.py) loops: the input's products with W for
# every step in one matmul, then per step the state's product with R and the gates' arithmetic in
# linalg.generic bodies. float32 where the kernel computes in float64: equal within float32 rounding.


def _mm(e: Emitter, a: Val, b: Val) -> Val:
    """[M, K] x [K, N] through tosa.matmul."""
    (m, k), n = a.shape, b.shape[1]
    zp = e.zero_point(a.dtype)
    y = e.op1("tosa.matmul", [e.reshape(a, [1, m, k]), e.reshape(b, [1, k, n]), zp, zp], [1, m, n], a.dtype)
    return e.reshape(y, [m, n])


def _row(e: Emitter, v: Val, i: int) -> Val:
    """v[i] of a tensor (a direction's weights, a step's input)."""
    return e.reshape(e.slice(v, [i] + [0] * (v.rank - 1), [1, *v.shape[1:]]), v.shape[1:])


def _cols(v: Val, e: Emitter, part: int, size: int) -> Val:
    """Gate ``part`` (columns part * size ...) of a [B, G * size] tensor."""
    return e.slice(v, [0, part * size], [v.shape[0], size])


class _Gates:
    """A direction's activations (ONNX's slots: name, alpha, beta) and clip, applied in linalg bodies."""

    def __init__(self, e: Emitter, p: top.RnnParams, specs, dtype):
        self.e, self.p, self.specs, self.dtype, self.el = e, p, specs, dtype, element(dtype)

    def act(self, bd, slot: int, x: str, clip: bool = True) -> str:
        if clip and self.p.clip > 0:
            c = bd.const(self.p.clip, self.dtype)
            x = bd.f(
                "arith.minimumf",
                bd.f("arith.maximumf", x, bd.f("arith.negf", c, el=self.el), el=self.el),
                c,
                el=self.el,
            )
        name, alpha, beta = self.specs[slot]
        return RNN_ACTIVATIONS[name](bd, x, self.el, alpha, beta)

    def map(self, inputs, body) -> Val:
        """``body(b, scalars, self)`` on each element of the inputs."""
        return self.e.map(inputs, lambda bd, v: body(bd, v, self))


def _rnn_common(e: Emitter, op, p: top.RnnParams, args, gates: int, defaults):
    x, w, r = args[:3]
    if not x.is_float:
        raise NotImplementedError(f"{op.name} of {x.dtype}")
    seq, batch, inp = x.shape
    backwards = {"forward": [False], "reverse": [True], "bidirectional": [False, True]}[p.direction]
    specs = activation_specs(p, defaults, len(backwards))
    per = len(defaults)
    for d, back in enumerate(backwards):
        xw = _mm(e, e.reshape(x, [seq * batch, inp]), e.transpose(_row(e, w, d), [1, 0]))
        xw = e.reshape(xw, [seq, batch, gates * p.hidden_size])
        rt = e.transpose(_row(e, r, d), [1, 0])  # [H, G * H]
        steps = list(reversed(range(seq))) if back else list(range(seq))
        yield d, steps, xw, rt, _Gates(e, p, specs[per * d : per * (d + 1)], x.dtype)


def _state(e: Emitter, v: Val | None, d: int, batch: int, hs: int, dtype) -> Val:
    return _row(e, v, d) if v is not None else e.const(np.zeros((batch, hs), dtype))


def _stacked(e: Emitter, per_direction: list[dict[int, Val]], seq: int) -> Val:
    """Y [seq, dirs, B, H] from each direction's states by step."""
    dirs = []
    for states in per_direction:
        dirs.append(e.concat([e.reshape(states[t], [1, 1, *states[t].shape]) for t in range(seq)], 0))
    return e.concat(dirs, 1)


def _final(e: Emitter, last: list[Val]) -> Val:
    return e.concat([e.reshape(v, [1, *v.shape]) for v in last], 0)


@rule(top.RNNOp)
def _(e: Emitter, op, p: top.RnnParams, args):
    x, _, _, b, h0 = args
    seq, batch, _ = x.shape
    hs = p.hidden_size
    ys, last = [], []
    for d, steps, xw, rt, g in _rnn_common(e, op, p, args, 1, ("Tanh",)):
        if b is not None:
            bias = _row(e, b, d)
            xw = e.binary(
                "tosa.add",
                xw,
                e.reshape(e.binary("tosa.add", e.slice(bias, [0], [hs]), e.slice(bias, [hs], [hs])), [1, 1, hs]),
            )
        h = _state(e, h0, d, batch, hs, x.dtype)
        states = {}
        for t in steps:
            pre = e.binary("tosa.add", _row(e, xw, t), _mm(e, h, rt))
            h = states[t] = g.map([pre], lambda bd, v, gg: gg.act(bd, 0, v[0]))
        ys.append(states)
        last.append(h)
    return _stacked(e, ys, seq), _final(e, last)


@rule(top.GRUOp)
def _(e: Emitter, op, p: top.RnnParams, args):
    x, _, _, b, h0 = args
    seq, batch, _ = x.shape
    hs = p.hidden_size
    ys, last = [], []
    for d, steps, xw, rt, g in _rnn_common(e, op, p, args, 3, ("Sigmoid", "Tanh")):
        rb = None
        if b is not None:
            bias = _row(e, b, d)
            xw = e.binary("tosa.add", xw, e.reshape(e.slice(bias, [0], [3 * hs]), [1, 1, 3 * hs]))
            rb = e.reshape(e.slice(bias, [3 * hs], [3 * hs]), [1, 3 * hs])
        rh = e.slice(rt, [0, 2 * hs], [hs, hs])
        h = _state(e, h0, d, batch, hs, x.dtype)
        states = {}
        for t in steps:
            xt = _row(e, xw, t)
            hr = _mm(e, h, rt)
            if rb is not None:
                hr = e.binary("tosa.add", hr, rb)
            z, reset = (
                g.map(
                    [_cols(xt, e, k, hs), _cols(hr, e, k, hs)],
                    lambda bd, v, gg: gg.act(bd, 0, bd.f("arith.addf", *v, el=gg.el)),
                )
                for k in (0, 1)
            )
            if p.linear_before_reset:
                cand = g.map(
                    [_cols(xt, e, 2, hs), reset, _cols(hr, e, 2, hs)],
                    lambda bd, v, gg: gg.act(
                        bd, 1, bd.f("arith.addf", v[0], bd.f("arith.mulf", v[1], v[2], el=gg.el), el=gg.el)
                    ),
                )
            else:
                rh_in = _mm(e, e.binary("tosa.mul", reset, h), rh)
                if rb is not None:
                    rh_in = e.binary("tosa.add", rh_in, _cols(rb, e, 2, hs))
                cand = g.map(
                    [_cols(xt, e, 2, hs), rh_in], lambda bd, v, gg: gg.act(bd, 1, bd.f("arith.addf", *v, el=gg.el))
                )

            def update(bd, v, gg):  # (1 - z) * cand + z * h
                keep = bd.f("arith.subf", bd.const(1.0, x.dtype), v[0], el=gg.el)
                return bd.f(
                    "arith.addf",
                    bd.f("arith.mulf", keep, v[1], el=gg.el),
                    bd.f("arith.mulf", v[0], v[2], el=gg.el),
                    el=gg.el,
                )

            h = states[t] = g.map([z, cand, h], update)
        ys.append(states)
        last.append(h)
    return _stacked(e, ys, seq), _final(e, last)


@rule(top.LSTMOp)
def _(e: Emitter, op, p: top.RnnParams, args):
    x, _, _, b, h0, c0, peep = args
    seq, batch, _ = x.shape
    hs = p.hidden_size
    ys, last_h, last_c = [], [], []
    for d, steps, xw, rt, g in _rnn_common(e, op, p, args, 4, ("Sigmoid", "Tanh", "Tanh")):
        if b is not None:
            bias = _row(e, b, d)
            both = e.binary("tosa.add", e.slice(bias, [0], [4 * hs]), e.slice(bias, [4 * hs], [4 * hs]))
            xw = e.binary("tosa.add", xw, e.reshape(both, [1, 1, 4 * hs]))
        if peep is not None:
            pi, po, pf = (e.reshape(e.slice(_row(e, peep, d), [k * hs], [hs]), [1, hs]) for k in range(3))
        else:
            pi = po = pf = e.const(np.zeros((1, hs), x.dtype))
        h, c = _state(e, h0, d, batch, hs, x.dtype), _state(e, c0, d, batch, hs, x.dtype)
        states = {}
        for t in steps:
            gates = e.binary("tosa.add", _row(e, xw, t), _mm(e, h, rt))
            gi, go, gf, gc = (_cols(gates, e, k, hs) for k in range(4))

            def cell(bd, v, gg):  # forget * c + i * g(gc), peepholes on the previous cell
                gi_, gf_, gc_, c_, pi_, pf_ = v
                i = gg.act(bd, 0, bd.f("arith.addf", gi_, bd.f("arith.mulf", pi_, c_, el=gg.el), el=gg.el))
                if p.input_forget:
                    forget = bd.f("arith.subf", bd.const(1.0, x.dtype), i, el=gg.el)
                else:
                    forget = gg.act(bd, 0, bd.f("arith.addf", gf_, bd.f("arith.mulf", pf_, c_, el=gg.el), el=gg.el))
                return bd.f(
                    "arith.addf",
                    bd.f("arith.mulf", forget, c_, el=gg.el),
                    bd.f("arith.mulf", i, gg.act(bd, 1, gc_), el=gg.el),
                    el=gg.el,
                )

            c = g.map([gi, gf, gc, c, pi, pf], cell)

            def hidden(bd, v, gg):  # o * h(c), the output gate's peephole on the new cell
                o = gg.act(bd, 0, bd.f("arith.addf", v[0], bd.f("arith.mulf", v[2], v[1], el=gg.el), el=gg.el))
                return bd.f("arith.mulf", o, gg.act(bd, 2, v[1], clip=False), el=gg.el)

            h = states[t] = g.map([go, c, po], hidden)
        ys.append(states)
        last_h.append(h)
        last_c.append(c)
    return _stacked(e, ys, seq), _final(e, last_h), _final(e, last_c)
