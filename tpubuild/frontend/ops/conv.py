"""Conv."""

from __future__ import annotations

from tpubuild.frontend.onnx_graph import Ctx, Node, shape_of
from tpubuild.frontend.ops.common import resolve_pads
from tpubuild.frontend.registry import converter
from tpubuild.ir import top


@converter("Conv", since=1)
def _(node: Node, ctx: Ctx):
    x, w, b = node.input(0), node.input(1), node.input(2)
    xs, ws = shape_of(x), shape_of(w)
    nd = len(xs) - 2
    kernel = node.attrs.get("kernel_shape") or ws[2:]
    strides = node.attrs.get("strides") or [1] * nd
    dilations = node.attrs.get("dilations") or [1] * nd
    pads = resolve_pads(node.attrs, xs[2:], kernel, strides, dilations)
    p = top.ConvParams(tuple(kernel), tuple(strides), tuple(pads), tuple(dilations), group=node.attrs["group"])
    return [ctx.emit(top.ConvOp, [x, w, b], p, name=node.outputs[0])]
