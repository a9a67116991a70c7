"""Transposed convolution: every input pixel scatters filter-weighted copies into the output."""

from __future__ import annotations

import math

import numpy as np

from tpubuild.ir import top
from tpubuild.kernels.activation import fused
from tpubuild.kernels.nn import pixel_gemm
from tpubuild.kernels.registry import kernel


@kernel(top.DeconvOp)
def _(p: top.DeconvParams, x, w, b):
    return deconv(p, x, w, b, sliced=False)


def deconv(p: top.DeconvParams, x, w, b, *, sliced: bool) -> np.ndarray:
    """The Deconv; ``sliced``: the chip computes it in H or N slices (a TPU F32 Deconv), whose bits must
    equal the whole tensor's: its GEMMs run one per input row (``pixel_gemm``). A TOP Deconv is never
    sliced."""
    nd = len(p.kernel_shape)
    n, c = x.shape[:2]
    g = p.group
    cin, cout = c // g, w.shape[1]
    spatial = x.shape[2:]
    kernel_shape = w.shape[2:]
    extra = p.output_padding or (0,) * nd
    # contributions of each input pixel for each kernel tap: [n, g, cout, *kernel, *spatial], computed in the
    # operands' precision as onnxruntime does (the INT8 flow has no deconvolution: no exactness to keep)
    dtype = np.result_type(x.dtype, w.dtype)
    xg = x.reshape(n, g, cin, math.prod(spatial)).astype(dtype, copy=False)
    wg = w.reshape(g, cin, cout * math.prod(kernel_shape)).astype(dtype, copy=False)
    # sliced: one GEMM per input row (pixel_gemm; all of a 1- or 3-D Deconv's pixels, which only N slices): an
    # input row's contributions do not depend on how many rows share the call, so an H or N slice, as the
    # chip computes it, matches the whole tensor's bits
    if sliced:
        row = spatial[-1] if nd == 2 else math.prod(spatial)
        prod = pixel_gemm(xg.reshape(n, g, cin, -1, row), wg).reshape(n, g, -1, wg.shape[-1])
    else:
        prod = np.matmul(xg.swapaxes(2, 3), wg)
    taps = prod.swapaxes(2, 3).reshape(n, g, cout, *kernel_shape, *spatial)
    full = [(spatial[i] - 1) * p.strides[i] + (kernel_shape[i] - 1) * p.dilations[i] + 1 + extra[i] for i in range(nd)]
    y = np.zeros((n, g, cout, *full), dtype)
    for tap in np.ndindex(*kernel_shape):
        window = tuple(
            slice(k * d, k * d + (size - 1) * s + 1, s)
            for k, d, s, size in zip(tap, p.dilations, p.strides, spatial, strict=True)
        )
        y[(slice(None),) * 3 + window] += taps[(slice(None),) * 3 + tap]
    # pads crop the full output; negative pads (from an explicit output_shape) extend it with zeros
    begins, ends = p.pads[:nd], p.pads[nd:]
    grow = [(0, 0)] * 3 + [(max(-bb, 0), max(-e, 0)) for bb, e in zip(begins, ends, strict=True)]
    if any(any(pair) for pair in grow):
        y = np.pad(y, grow)
    crop = tuple(
        slice(max(bb, 0), y.shape[3 + i] - max(e, 0)) for i, (bb, e) in enumerate(zip(begins, ends, strict=True))
    )
    y = y[(slice(None),) * 3 + crop]
    y = y.reshape(n, g * cout, *y.shape[3:])
    if b is not None:
        y = y + b.reshape((1, -1) + (1,) * nd)
    return fused(y.astype(x.dtype, copy=False), p)
