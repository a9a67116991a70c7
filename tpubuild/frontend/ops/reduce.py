"""Reductions (ReduceMean/Sum/Max/Min/Prod/L1/L2/SumSquare/LogSum/LogSumExp), ArgMax/ArgMin and Hardmax."""

from __future__ import annotations

import numpy as np

from tpubuild.frontend.onnx_graph import Const, Ctx, Node, dtype_of_value, shape_of
from tpubuild.frontend.ops.common import norm_axis
from tpubuild.frontend.registry import converter
from tpubuild.ir import top

# the opset where ``axes`` moved from an attribute to an optional input
_AXES_INPUT_SINCE = {op: 18 for op in top.REDUCE_MODES} | {"ReduceSum": 13}


def _reduce(node: Node, ctx: Ctx, axes):
    x, out = node.input(0), node.outputs[0]
    rank = len(shape_of(x))
    if axes is None or len(axes) == 0:
        if node.attrs.get("noop_with_empty_axes", 0):
            return [ctx.emit(top.IdentityOp, [x], name=out)]
        axes = range(rank)
    norm = tuple(sorted({norm_axis(int(a), rank) for a in axes}))
    if not norm:  # a scalar input: nothing to reduce
        return [ctx.emit(top.IdentityOp, [x], name=out)]
    p = top.ReduceParams(norm, node.op_type, keepdims=bool(node.attrs.get("keepdims", 1)))
    return [ctx.emit(top.ReduceOp, [x], p, name=out)]


def _axes_attr(node: Node, ctx: Ctx):
    return _reduce(node, ctx, node.attrs.get("axes"))


def _axes_input(node: Node, ctx: Ctx):
    axes = ctx.const(node, 1, "axes")
    return _reduce(node, ctx, None if axes is None else np.asarray(axes).reshape(-1).tolist())


for _op in top.REDUCE_MODES:  # the ONNX op types, one mode each
    converter(_op, since=1)(_axes_attr)
    converter(_op, since=_AXES_INPUT_SINCE[_op])(_axes_input)


def _arg(node: Node, ctx: Ctx):
    x = node.input(0)
    p = top.ArgParams(
        norm_axis(int(node.attrs.get("axis", 0)), len(shape_of(x))),
        node.op_type,
        keepdims=bool(node.attrs.get("keepdims", 1)),
        select_last_index=bool(node.attrs.get("select_last_index", 0)),
    )
    return [ctx.emit(top.ArgOp, [x], p, name=node.outputs[0])]


for _op in ("ArgMax", "ArgMin"):
    converter(_op, since=1)(_arg)


@converter("Hardmax", since=13)
def _(node: Node, ctx: Ctx):
    """1 at the first maximum along the axis, 0 elsewhere: ArgMax compared with the positions on the axis."""
    x, out = node.input(0), node.outputs[0]
    shape = shape_of(x)
    axis = norm_axis(int(node.attrs.get("axis", -1)), len(shape))
    first = ctx.emit(top.ArgOp, [x], top.ArgParams(axis, "ArgMax", keepdims=True), name=f"{out}_argmax")
    positions = Const(
        np.arange(shape[axis], dtype=np.int64).reshape([-1 if d == axis else 1 for d in range(len(shape))]),
        f"{out}_positions",
    )
    hit = ctx.emit(top.CompareOp, [first, positions], top.CompareParams("Equal"), name=f"{out}_hit")
    one, zero = (Const(np.array(v, dtype_of_value(x)), f"{out}_{n}") for v, n in ((1, "one"), (0, "zero")))
    return [ctx.emit(top.WhereOp, [hit, one, zero], name=out)]
