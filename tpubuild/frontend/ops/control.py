"""If whose condition is known at compile time (a shape test, once the input shapes are fixed): its branch."""

from __future__ import annotations

import numpy as np

from tpubuild.frontend.onnx_graph import Const, Ctx, Node
from tpubuild.frontend.registry import converter
from tpubuild.ir import top


@converter("If", since=1)
def _(node: Node, ctx: Ctx):
    cond = ctx.const(node, 0, "condition")
    taken = ctx.inline(node.attrs["then_branch" if bool(np.asarray(cond).reshape(-1)[0]) else "else_branch"])
    # the If's results carry its own output names: verification pairs tensors by name
    return [
        value if isinstance(value, Const) else ctx.emit(top.IdentityOp, [value], name=name)
        for value, name in zip(taken, node.outputs, strict=True)
    ]
