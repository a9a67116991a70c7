"""InstanceNormalization, GroupNormalization, RMSNormalization, LRN, LpNormalization,
MeanVarianceNormalization."""

from __future__ import annotations

import numpy as np

from tpubuild.frontend.onnx_graph import Const, Ctx, Node, shape_of
from tpubuild.frontend.ops.common import norm_axis
from tpubuild.frontend.registry import converter
from tpubuild.ir import top


@converter("InstanceNormalization", since=1)
def _(node: Node, ctx: Ctx):
    p = top.EpsParams(float(node.attrs.get("epsilon", 1e-5)))
    return [ctx.emit(top.InstanceNormOp, [node.input(0), node.input(1), node.input(2)], p, name=node.outputs[0])]


def _group_norm(node: Node, ctx: Ctx, weight, bias):
    p = top.GroupNormParams(int(node.attrs["num_groups"]), float(node.attrs.get("epsilon", 1e-5)))
    return [ctx.emit(top.GroupNormOp, [node.input(0), weight, bias], p, name=node.outputs[0])]


@converter("GroupNormalization", since=18)
def _(node: Node, ctx: Ctx):
    """Opset 18: scale and bias hold one value per group; widened to one per channel here."""
    channels = shape_of(node.input(0))[1]
    groups = int(node.attrs["num_groups"])
    if groups < 1 or channels % groups:
        raise ValueError(f"{channels} channels do not split into {groups} groups")
    per_channel = []
    for i, what in ((1, "scale"), (2, "bias")):
        value = ctx.const(node, i, what)
        if value is None:
            raise ValueError(f"{node.op_type} needs its {what} input")
        per_channel.append(Const(np.repeat(value, channels // groups), f"{node.outputs[0]}_{what}"))
    return _group_norm(node, ctx, *per_channel)


@converter("GroupNormalization", since=21)
def _(node: Node, ctx: Ctx):
    """Opset 21: scale and bias per channel; stash_type only picks the float type of the statistics."""
    return _group_norm(node, ctx, node.input(1), node.input(2))


@converter("LRN", since=1)
def _(node: Node, ctx: Ctx):
    p = top.LRNParams(
        int(node.attrs["size"]),
        float(node.attrs.get("alpha", 1e-4)),
        float(node.attrs.get("beta", 0.75)),
        float(node.attrs.get("bias", 1.0)),
    )
    return [ctx.emit(top.LRNOp, [node.input(0)], p, name=node.outputs[0])]


@converter("RMSNormalization", since=23)
def _(node: Node, ctx: Ctx):
    axis = norm_axis(int(node.attrs.get("axis", -1)), len(shape_of(node.input(0))))
    p = top.RMSNormParams(axis, float(node.attrs.get("epsilon", 1e-5)))
    return [ctx.emit(top.RMSNormOp, [node.input(0), node.input(1)], p, name=node.outputs[0])]


@converter("LpNormalization", since=1)
def _(node: Node, ctx: Ctx):
    """x / its L1 or L2 norm along the axis; a zero norm gives 0, as onnxruntime does (not 0 / 0)."""
    x, out = node.input(0), node.outputs[0]
    p = int(node.attrs.get("p", 2))
    if p not in (1, 2):
        raise NotImplementedError(f"LpNormalization with p = {p} (only 1 and 2)")
    axis = norm_axis(int(node.attrs.get("axis", -1)), len(shape_of(x)))
    norm = ctx.emit(top.ReduceOp, [x], top.ReduceParams((axis,), f"ReduceL{p}"), name=f"{out}_norm")
    tiny = Const(np.array(np.finfo(np.float32).tiny, np.float32), f"{out}_tiny")
    return [ctx.emit(top.DivOp, [x, ctx.emit(top.MaxOp, [norm, tiny], name=f"{out}_nonzero")], name=out)]


@converter("MeanVarianceNormalization", since=9)
def _(node: Node, ctx: Ctx):
    """(x - mean) / (std + 1e-9) over the axes (default N, H, W), as the ONNX function body defines it."""
    x, out = node.input(0), node.outputs[0]
    rank = len(shape_of(x))
    axes = tuple(sorted({norm_axis(int(a), rank) for a in node.attrs.get("axes", [0, 2, 3])}))
    mean = ctx.emit(top.ReduceOp, [x], top.ReduceParams(axes, "ReduceMean"), name=f"{out}_mean")
    centered = ctx.emit(top.SubOp, [x, mean], name=f"{out}_centered")
    square = ctx.emit(top.MulOp, [centered, centered], name=f"{out}_square")
    var = ctx.emit(top.ReduceOp, [square], top.ReduceParams(axes, "ReduceMean"), name=f"{out}_var")
    std = ctx.emit(top.SqrtOp, [var], name=f"{out}_std")
    eps = Const(np.array(1e-9, np.float32), f"{out}_eps")
    return [ctx.emit(top.DivOp, [centered, ctx.emit(top.AddOp, [std, eps], name=f"{out}_std_eps")], name=out)]
