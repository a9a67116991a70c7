"""ConvTranspose -> top.Deconv, with auto_pad and output_shape resolved to explicit pads."""

from __future__ import annotations

from tpubuild.frontend.onnx_graph import Ctx, Node, shape_of
from tpubuild.frontend.registry import converter
from tpubuild.ir import top


def deconv_pads(attrs: dict, spatial, kernel, strides, dilations, output_padding) -> list[int]:
    """Explicit pads [begins..., ends...] from pads, auto_pad or output_shape (ONNX's equations)."""
    nd = len(kernel)
    mode = attrs.get("auto_pad", "NOTSET") or "NOTSET"
    target = attrs.get("output_shape")
    if target:
        target = list(target)[-nd:]  # output_shape may list the N and C dims too
    elif mode in ("SAME_UPPER", "SAME_LOWER"):
        target = [size * s for size, s in zip(spatial, strides, strict=True)]
    else:
        pads = attrs.get("pads")
        return list(pads) if pads and mode == "NOTSET" else [0] * (2 * nd)
    begins, ends = [], []
    for size, k, s, d, extra, out in zip(spatial, kernel, strides, dilations, output_padding, target, strict=True):
        total = s * (size - 1) + extra + (k - 1) * d + 1 - out
        # ONNX: odd padding goes to the end for SAME_UPPER, to the beginning otherwise
        small, large = total // 2, total - total // 2
        begins.append(small if mode == "SAME_UPPER" else large)
        ends.append(large if mode == "SAME_UPPER" else small)
    return begins + ends


@converter("ConvTranspose", since=1)
def _(node: Node, ctx: Ctx):
    x, w, b = node.input(0), node.input(1), node.input(2)
    xs, ws = shape_of(x), shape_of(w)
    nd = len(xs) - 2
    kernel = list(node.attrs.get("kernel_shape") or ws[2:])
    if kernel != list(ws[2:]):
        raise ValueError(f"kernel_shape {kernel} differs from the filter's {list(ws[2:])}")
    strides = list(node.attrs.get("strides") or [1] * nd)
    dilations = list(node.attrs.get("dilations") or [1] * nd)
    output_padding = list(node.attrs.get("output_padding") or [0] * nd)
    pads = deconv_pads(node.attrs, xs[2:], kernel, strides, dilations, output_padding)
    p = top.DeconvParams(
        tuple(kernel),
        tuple(strides),
        tuple(pads),
        tuple(dilations),
        output_padding=tuple(output_padding) if any(output_padding) else (),
        group=node.attrs.get("group", 1),
    )
    return [ctx.emit(top.DeconvOp, [x, w, b], p, name=node.outputs[0])]
