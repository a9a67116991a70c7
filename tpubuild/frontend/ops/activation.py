"""Activations: LeakyRelu, PRelu, Elu, Selu, Celu, ThresholdedRelu, Shrink, Softplus, Softsign, Swish, Erf,
Gelu, HardSigmoid, HardSwish, Mish."""

from __future__ import annotations

import numpy as np

from tpubuild.frontend.onnx_graph import Const, Ctx, Node, shape_of
from tpubuild.frontend.registry import converter
from tpubuild.ir import top

# ONNX op -> (TOP op, first opset) for activations without attributes
_PLAIN = {
    "Softplus": (top.SoftplusOp, 1),
    "Erf": (top.ErfOp, 9),
    "HardSwish": (top.HardSwishOp, 14),
    "Mish": (top.MishOp, 18),
    "Softsign": (top.SoftsignOp, 1),
}


def _plain(node: Node, ctx: Ctx):
    return [ctx.emit(_PLAIN[node.op_type][0], [node.input(0)], name=node.outputs[0])]


for _op, (_cls, _since) in _PLAIN.items():
    converter(_op, since=_since)(_plain)


@converter("LeakyRelu", since=1)
def _(node: Node, ctx: Ctx):
    p = top.AlphaParams(float(node.attrs["alpha"]))
    return [ctx.emit(top.LeakyReluOp, [node.input(0)], p, name=node.outputs[0])]


@converter("Elu", since=1)
def _(node: Node, ctx: Ctx):
    p = top.AlphaParams(float(node.attrs["alpha"]))
    return [ctx.emit(top.EluOp, [node.input(0)], p, name=node.outputs[0])]


@converter("Selu", since=1)
def _(node: Node, ctx: Ctx):
    """gamma * Elu(x, alpha): TPU-MLIR has no Selu, so an Elu and a scale."""
    out = node.outputs[0]
    elu = ctx.emit(top.EluOp, [node.input(0)], top.AlphaParams(float(node.attrs["alpha"])), name=f"{out}_elu")
    gamma = Const(np.asarray(node.attrs["gamma"], np.float32), f"{out}_gamma")
    return [ctx.emit(top.MulOp, [elu, gamma], name=out)]


@converter("HardSigmoid", since=1)
def _(node: Node, ctx: Ctx):
    p = top.HardSigmoidParams(float(node.attrs["alpha"]), float(node.attrs["beta"]))
    return [ctx.emit(top.HardSigmoidOp, [node.input(0)], p, name=node.outputs[0])]


@converter("PRelu", since=1)
def _(node: Node, ctx: Ctx):
    """Before opset 7 a 1-D slope of C values is per channel (dim 1), not numpy-broadcast."""
    x, slope = node.input(0), node.input(1)
    rank, s = len(shape_of(x)), shape_of(slope)
    if rank > 2 and len(s) == 1 and s[0] > 1:
        per_channel = (s[0],) + (1,) * (rank - 2)
        slope = (
            Const(slope.array.reshape(per_channel), f"{slope.name}_per_channel")
            if isinstance(slope, Const)
            else ctx.emit(top.ReshapeOp, [slope], top.ShapeParams(per_channel), name=f"{node.outputs[0]}_slope")
        )
    return [ctx.emit(top.PReluOp, [x, slope], name=node.outputs[0])]


@converter("PRelu", since=7)
def _(node: Node, ctx: Ctx):
    return [ctx.emit(top.PReluOp, [node.input(0), node.input(1)], name=node.outputs[0])]


_GELU_MODE = {"none": "normal", "tanh": "tanh"}


@converter("Gelu", since=20)
def _(node: Node, ctx: Ctx):
    approximate = node.attrs.get("approximate", "none")
    if approximate not in _GELU_MODE:
        raise ValueError(f"Gelu approximate={approximate!r} is not 'none' or 'tanh'")
    p = top.GeluParams(_GELU_MODE[approximate])
    return [ctx.emit(top.GELUOp, [node.input(0)], p, name=node.outputs[0])]


@converter("Celu", since=12)
def _(node: Node, ctx: Ctx):
    p = top.AlphaParams(float(node.attrs["alpha"]))
    return [ctx.emit(top.CeluOp, [node.input(0)], p, name=node.outputs[0])]


@converter("ThresholdedRelu", since=10)
def _(node: Node, ctx: Ctx):
    p = top.AlphaParams(float(node.attrs["alpha"]))
    return [ctx.emit(top.ThresholdedReluOp, [node.input(0)], p, name=node.outputs[0])]


@converter("Shrink", since=9)
def _(node: Node, ctx: Ctx):
    p = top.ShrinkParams(float(node.attrs["bias"]), float(node.attrs["lambd"]))
    return [ctx.emit(top.ShrinkOp, [node.input(0)], p, name=node.outputs[0])]


@converter("Swish", since=24)
def _(node: Node, ctx: Ctx):
    """ONNX's alpha is TPU-MLIR's beta: x * sigmoid(alpha * x)."""
    p = top.BetaParams(float(node.attrs["alpha"]))
    return [ctx.emit(top.SwishOp, [node.input(0)], p, name=node.outputs[0])]
