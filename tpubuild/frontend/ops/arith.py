"""Math: Exp, Log, Sqrt, Reciprocal, Abs, Neg, Floor, Ceil, Round, Sign, the trigonometric and hyperbolic
functions and their inverses, IsNaN, IsInf, Pow, Mod, Max, Min, Sum, Mean, Where, Cast, CastLike."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from tpubuild.frontend.onnx_graph import Const, Ctx, Node, dtype_of_value, shape_of
from tpubuild.frontend.registry import converter
from tpubuild.ir import top
from tpubuild.ir.types import element_type
from tpubuild.kernels import get_kernel

_PLAIN = {
    "Exp": top.ExpOp,
    "Log": top.LogOp,
    "Sqrt": top.SqrtOp,
    "Reciprocal": top.ReciprocalOp,
    "Abs": top.AbsOp,
    "Floor": top.FloorOp,
    "Ceil": top.CeilOp,
    "Round": top.RoundOp,
    "Sign": top.SignOp,
    "Sin": top.SinOp,
    "Cos": top.CosOp,
    "Tan": top.TanOp,
    "Asin": top.AsinOp,
    "Acos": top.AcosOp,
    "Atan": top.AtanOp,
    "Sinh": top.SinhOp,
    "Cosh": top.CoshOp,
    "Asinh": top.AsinhOp,
    "Acosh": top.AcoshOp,
    "Atanh": top.AtanhOp,
    "IsNaN": top.IsNaNOp,
}


def _plain(node: Node, ctx: Ctx):
    return [ctx.emit(_PLAIN[node.op_type], [node.input(0)], name=node.outputs[0])]


for _op in _PLAIN:
    converter(_op, since=1)(_plain)


@converter("Neg", since=1)
def _(node: Node, ctx: Ctx):
    """x * -1, as TPU-MLIR lowers Neg."""
    x = node.input(0)
    minus = Const(np.asarray(-1, dtype_of_value(x)), f"{node.outputs[0]}_minus_one")
    return [ctx.emit(top.MulOp, [x, minus], name=node.outputs[0])]


@converter("Pow", since=1)
def _(node: Node, ctx: Ctx):
    """A constant scalar exponent gives top.Pow; anything else the broadcasting top.Pow3."""
    x, e = node.input(0), node.input(1)
    if isinstance(e, Const) and e.array.size == 1 and e.array.ndim <= len(shape_of(x)):
        return [ctx.emit(top.PowOp, [x], top.PowParams(float(e.array.reshape(()))), name=node.outputs[0])]
    return [ctx.emit(top.Pow3Op, [x, e], name=node.outputs[0])]


@converter("Max", since=1)
def _(node: Node, ctx: Ctx):
    return [ctx.emit(top.MaxOp, list(node.inputs), name=node.outputs[0])]


@converter("Min", since=1)
def _(node: Node, ctx: Ctx):
    return [ctx.emit(top.MinOp, list(node.inputs), name=node.outputs[0])]


def _sum(node: Node, ctx: Ctx, out: str):
    """A chain of Adds; the last is named ``out``."""
    inputs = list(node.inputs)
    if len(inputs) == 1:
        return ctx.emit(top.IdentityOp, inputs, name=out)
    acc = inputs[0]
    for i, v in enumerate(inputs[1:], start=1):
        acc = ctx.emit(top.AddOp, [acc, v], name=out if i == len(inputs) - 1 else f"{out}_sum{i}")
    return acc


@converter("Sum", since=1)
def _(node: Node, ctx: Ctx):
    return [_sum(node, ctx, node.outputs[0])]


@converter("Mean", since=1)
def _(node: Node, ctx: Ctx):
    out = node.outputs[0]
    if len(node.inputs) == 1:
        return [ctx.emit(top.IdentityOp, [node.input(0)], name=out)]
    total = _sum(node, ctx, f"{out}_sum")
    count = Const(np.asarray(len(node.inputs), dtype_of_value(node.input(0))), f"{out}_count")
    return [ctx.emit(top.DivOp, [total, count], name=out)]


@converter("Where", since=9)
def _(node: Node, ctx: Ctx):
    return [ctx.emit(top.WhereOp, [node.input(0), node.input(1), node.input(2)], name=node.outputs[0])]


def _cast(node: Node, ctx: Ctx, to: np.dtype, what: str):
    try:
        element_type(to)
    except NotImplementedError:
        raise NotImplementedError(f"{node.op_type} to {what} is not supported") from None
    x = node.input(0)
    p = top.CastParams(
        to.name, saturate=bool(node.attrs.get("saturate", 1)), round_mode=node.attrs.get("round_mode", "up")
    )
    if isinstance(x, Const):  # CastLike of a constant to a run-time tensor's type is still a constant
        return [Const(np.asarray(get_kernel(top.CastOp)(p, x.array)), node.outputs[0])]
    if dtype_of_value(x) == to:
        return [ctx.emit(top.IdentityOp, [x], name=node.outputs[0])]
    return [ctx.emit(top.CastOp, [x], p, name=node.outputs[0])]


@converter("Cast", since=6)
def _(node: Node, ctx: Ctx):
    to = node.attrs["to"]
    return _cast(node, ctx, helper.tensor_dtype_to_np_dtype(to), TensorProto.DataType.Name(to))


@converter("CastLike", since=15)
def _(node: Node, ctx: Ctx):
    """Cast to the element type of the second input (only its type is read)."""
    to = dtype_of_value(node.input(1))
    return _cast(node, ctx, to, str(to))


@converter("IsInf", since=10)
def _(node: Node, ctx: Ctx):
    p = top.IsInfParams(bool(node.attrs["detect_positive"]), bool(node.attrs["detect_negative"]))
    return [ctx.emit(top.IsInfOp, [node.input(0)], p, name=node.outputs[0])]


@converter("Mod", since=10)
def _(node: Node, ctx: Ctx):
    """fmod=0 on floats is defined from opset 28 (floored, divisor's sign); earlier models cannot have it."""
    fmod = bool(node.attrs.get("fmod", 0))
    return [ctx.emit(top.ModOp, [node.input(0), node.input(1)], top.ModParams(fmod), name=node.outputs[0])]
