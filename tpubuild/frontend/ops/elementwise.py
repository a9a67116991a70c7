"""Elementwise arithmetic and activations."""

from __future__ import annotations

import math

import numpy as np

from tpubuild.frontend.onnx_graph import Const, Ctx, Node, shape_of
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
    # training_mode decides what the op computes, so it must be known (a graph input could be true)
    training = ctx.const(node, 2, "training_mode")
    if training is not None and bool(training):
        ratio = ctx.const(node, 1, "ratio")
        if ratio is None or float(ratio) != 0.0:  # a zero ratio drops nothing even in training
            raise NotImplementedError("Dropout with training_mode=true (random drops) is not supported")
    y = ctx.emit(top.IdentityOp, [node.input(0)], name=node.outputs[0])
    # at inference nothing is dropped: the mask, when asked for, is all true
    mask = [Const(np.ones(shape_of(node.input(0)), np.bool_), name) for name in node.outputs[1:2] if name]
    return [y, *mask]


@converter("Clip", since=1)
def _(node: Node, ctx: Ctx):
    p = top.ClipParams(float(node.attrs.get("min", -math.inf)), float(node.attrs.get("max", math.inf)))
    return [ctx.emit(top.ClipOp, [node.input(0)], p, name=node.outputs[0])]


@converter("Clip", since=11)
def _(node: Node, ctx: Ctx):
    bounds = [node.input(1), node.input(2)]
    if any(b is not None and not isinstance(b, Const) for b in bounds):
        # a bound computed from the data (librosa's top_db floor: max(dB) - 80) is numpy.clip's max then min
        y, out = node.input(0), node.outputs[0]
        for i, (cls, what) in enumerate(((top.MaxOp, "min"), (top.MinOp, "max"))):
            if bounds[i] is not None:
                last = bounds[1] is None or i == 1
                # as a scalar, a one-element bound broadcasts without changing the clipped tensor's rank
                bound = ctx.reshape(bounds[i], (), f"{out}_{what}")
                y = ctx.emit(cls, [y, bound], name=out if last else f"{out}_lo")
        return [y]
    lo, hi = ctx.const(node, 1, "min"), ctx.const(node, 2, "max")
    p = top.ClipParams(-math.inf if lo is None else float(lo), math.inf if hi is None else float(hi))
    return [ctx.emit(top.ClipOp, [node.input(0)], p, name=node.outputs[0])]
