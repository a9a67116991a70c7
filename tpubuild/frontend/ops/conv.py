"""Conv (and the convolution of ConvInteger and QLinearConv)."""

from __future__ import annotations

from tpubuild.frontend.onnx_graph import Ctx, Node, Value, shape_of
from tpubuild.frontend.ops.common import resolve_pads
from tpubuild.frontend.registry import converter
from tpubuild.ir import top


def conv(ctx: Ctx, attrs: dict, x: Value, w: Value, b: Value, name: str):
    """top.Conv of an ONNX Conv's (or ConvInteger's, QLinearConv's) attributes."""
    xs, ws = shape_of(x), shape_of(w)
    nd = len(xs) - 2
    kernel = attrs.get("kernel_shape") or ws[2:]
    strides = attrs.get("strides") or [1] * nd
    dilations = attrs.get("dilations") or [1] * nd
    pads = resolve_pads(attrs, xs[2:], kernel, strides, dilations)
    p = top.ConvParams(tuple(kernel), tuple(strides), tuple(pads), tuple(dilations), group=attrs.get("group", 1))
    return ctx.emit(top.ConvOp, [x, w, b], p, name=name)


@converter("Conv", since=1)
def _(node: Node, ctx: Ctx):
    return [conv(ctx, node.attrs, node.input(0), node.input(1), node.input(2), node.outputs[0])]
