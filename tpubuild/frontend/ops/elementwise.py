"""Elementwise arithmetic and activations."""

from __future__ import annotations

import math

from tpubuild.frontend.onnx_graph import Ctx, Node
from tpubuild.frontend.registry import converter
from tpubuild.ir import top

_BINARY = {"Add": top.AddOp, "Sub": top.SubOp, "Mul": top.MulOp, "Div": top.DivOp}
_UNARY = {"Relu": top.ReluOp, "Sigmoid": top.SigmoidOp, "Tanh": top.TanhOp, "Identity": top.IdentityOp}


def _binary(node: Node, ctx: Ctx):
    return [ctx.emit(_BINARY[node.op_type], [node.input(0), node.input(1)], name=node.outputs[0])]


def _unary(node: Node, ctx: Ctx):
    return [ctx.emit(_UNARY[node.op_type], [node.input(0)], name=node.outputs[0])]


for _op in _BINARY:
    converter(_op, since=7)(_binary)  # numpy-style broadcasting from opset 7
for _op in _UNARY:
    converter(_op, since=1)(_unary)


@converter("Dropout", since=1)
def _(node: Node, ctx: Ctx):
    if len(node.outputs) > 1 and node.outputs[1]:
        raise NotImplementedError("Dropout's mask output is not supported at inference")
    return [ctx.emit(top.IdentityOp, [node.input(0)], name=node.outputs[0])]


@converter("Clip", since=1)
def _(node: Node, ctx: Ctx):
    p = top.ClipParams(float(node.attrs.get("min", -math.inf)), float(node.attrs.get("max", math.inf)))
    return [ctx.emit(top.ClipOp, [node.input(0)], p, name=node.outputs[0])]


@converter("Clip", since=11)
def _(node: Node, ctx: Ctx):
    lo, hi = ctx.const(node, 1, "min"), ctx.const(node, 2, "max")
    p = top.ClipParams(-math.inf if lo is None else float(lo), math.inf if hi is None else float(hi))
    return [ctx.emit(top.ClipOp, [node.input(0)], p, name=node.outputs[0])]
