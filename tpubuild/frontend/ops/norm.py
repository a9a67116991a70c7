"""Softmax, LogSoftmax, LayerNormalization, BatchNormalization."""

from __future__ import annotations

import math

from tpubuild.frontend.onnx_graph import Ctx, Node, shape_of
from tpubuild.frontend.ops.common import norm_axis, result_names
from tpubuild.frontend.registry import converter
from tpubuild.ir import top


def _softmax_flat(node: Node, ctx: Ctx):
    """Before opset 13 (Log)Softmax flattens to 2-D at ``axis`` and normalises the whole tail."""
    x, out = node.input(0), node.outputs[0]
    shape = shape_of(x)
    axis = norm_axis(node.attrs.get("axis", 1), len(shape))
    log = node.op_type == "LogSoftmax"
    if axis == len(shape) - 1:
        return [ctx.emit(top.SoftmaxOp, [x], top.SoftmaxParams(axis, log=log), name=out)]
    flat = (math.prod(shape[:axis]), math.prod(shape[axis:]))
    y = ctx.emit(top.ReshapeOp, [x], top.ShapeParams(flat), name=f"{out}_2d")
    y = ctx.emit(top.SoftmaxOp, [y], top.SoftmaxParams(1, log=log), name=f"{out}_softmax")
    return [ctx.emit(top.ReshapeOp, [y], top.ShapeParams(shape), name=out)]


def _softmax(node: Node, ctx: Ctx):
    x = node.input(0)
    axis = norm_axis(node.attrs.get("axis", -1), len(shape_of(x)))
    p = top.SoftmaxParams(axis, log=node.op_type == "LogSoftmax")
    return [ctx.emit(top.SoftmaxOp, [x], p, name=node.outputs[0])]


for _op in ("Softmax", "LogSoftmax"):
    converter(_op, since=1)(_softmax_flat)
    converter(_op, since=13)(_softmax)


@converter("LayerNormalization", since=17)
def _(node: Node, ctx: Ctx):
    x = node.input(0)
    axis = norm_axis(node.attrs.get("axis", -1), len(shape_of(x)))
    operands = [x, node.input(1), node.input(2)]
    if not any(node.outputs[1:]):
        p = top.LayerNormParams(axis, float(node.attrs.get("epsilon", 1e-5)))
        return [ctx.emit(top.LayerNormOp, operands, p, name=node.outputs[0])]
    # Mean/InvStdDev wanted too: the multi-result form (unused ones get derived names)
    p = top.LayerNormParams(axis, float(node.attrs.get("epsilon", 1e-5)), stats=True)
    return ctx.emit_multi(top.LayerNormOp, operands, p, names=result_names(node.outputs, 3))


@converter("BatchNormalization", since=6)
def _(node: Node, ctx: Ctx):
    if node.attrs.get("training_mode", 0) or any(node.outputs[1:]):
        raise NotImplementedError("BatchNormalization in training mode is not supported")
    x, scale, bias, mean, var = (node.input(i) for i in range(5))
    p = top.EpsParams(float(node.attrs.get("epsilon", 1e-5)))
    return [ctx.emit(top.BatchNormOp, [x, mean, var, scale, bias], p, name=node.outputs[0])]
