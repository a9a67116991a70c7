"""If: a condition known at compile time (a shape test, once the input shapes are fixed) takes its branch; one
decided by the data runs both branches and picks each output with a Where (ONNX branches have no side effects)."""

from __future__ import annotations

import numpy as np

from tpubuild.frontend.onnx_graph import Const, Ctx, Node, dtype_of_value, shape_of
from tpubuild.frontend.registry import converter
from tpubuild.ir import top


@converter("If", since=1)
def _(node: Node, ctx: Ctx):
    cond = node.input(0)
    if isinstance(cond, Const):
        taken = ctx.inline(node.attrs["then_branch" if bool(np.asarray(cond.array).reshape(-1)[0]) else "else_branch"])
        # the If's results carry its own output names: verification pairs tensors by name
        return [
            value if isinstance(value, Const) else ctx.emit(top.IdentityOp, [value], name=name)
            for value, name in zip(taken, node.outputs, strict=True)
        ]
    then, other = ctx.inline(node.attrs["then_branch"]), ctx.inline(node.attrs["else_branch"])
    if shape_of(cond) != ():  # a one-element tensor: as a scalar it broadcasts to any output's shape
        cond = ctx.emit(top.ReshapeOp, [cond], top.ShapeParams(()), name=f"{node.outputs[0]}_cond")
    outs = []
    for a, b, name in zip(then, other, node.outputs, strict=True):
        if (shape_of(a), dtype_of_value(a)) != (shape_of(b), dtype_of_value(b)):
            raise NotImplementedError(
                f"its condition is computed from the graph inputs, and its branches give output {name!r} different "
                f"types ({dtype_of_value(a)}{list(shape_of(a))} and {dtype_of_value(b)}{list(shape_of(b))}): both "
                "branches run and a Where picks, which needs one type"
            )
        outs.append(ctx.emit(top.WhereOp, [cond, a, b], name=name))
    return outs
