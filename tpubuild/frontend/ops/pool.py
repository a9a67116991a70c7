"""MaxPool, AveragePool, GlobalAveragePool, GlobalMaxPool."""

from __future__ import annotations

import dataclasses

from tpubuild.frontend.onnx_graph import Ctx, Node, shape_of
from tpubuild.frontend.ops.common import resolve_pads
from tpubuild.frontend.registry import converter
from tpubuild.ir import top


def _pool(node: Node, ctx: Ctx, cls):
    x = node.input(0)
    spatial = shape_of(x)[2:]
    kernel = node.attrs["kernel_shape"]
    nd = len(kernel)
    strides = node.attrs.get("strides") or [1] * nd
    dilations = node.attrs.get("dilations") or [1] * nd
    pads = resolve_pads(node.attrs, spatial, kernel, strides, dilations)
    p = top.PoolParams(
        tuple(kernel),
        tuple(strides),
        tuple(pads),
        dilations=tuple(dilations) if any(d != 1 for d in dilations) else (),
        ceil_mode=bool(node.attrs.get("ceil_mode", 0)),
        count_include_pad=bool(node.attrs.get("count_include_pad", 0)),
    )
    if len(node.outputs) > 1 and node.outputs[1]:  # MaxPool's Indices
        p = top.MaskPoolParams(**dataclasses.asdict(p), storage_order=int(node.attrs.get("storage_order", 0)))
        return ctx.emit_multi(top.MaxPoolWithMaskOp, [x], p, names=node.outputs[:2])
    return [ctx.emit(cls, [x], p, name=node.outputs[0])]


@converter("MaxPool", since=1)
def _(node: Node, ctx: Ctx):
    return _pool(node, ctx, top.MaxPoolOp)  # storage_order only orders the Indices output


@converter("AveragePool", since=1)
def _(node: Node, ctx: Ctx):
    return _pool(node, ctx, top.AvgPoolOp)


def _global(node: Node, ctx: Ctx, cls):
    """A pool whose window is the whole spatial extent."""
    x = node.input(0)
    spatial = shape_of(x)[2:]
    nd = len(spatial)
    p = top.PoolParams(tuple(spatial), (1,) * nd, (0,) * (2 * nd))
    return [ctx.emit(cls, [x], p, name=node.outputs[0])]


@converter("GlobalAveragePool", since=1)
def _(node: Node, ctx: Ctx):
    return _global(node, ctx, top.AvgPoolOp)


@converter("GlobalMaxPool", since=1)
def _(node: Node, ctx: Ctx):
    return _global(node, ctx, top.MaxPoolOp)
