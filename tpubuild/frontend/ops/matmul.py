"""MatMul and Gemm."""

from __future__ import annotations

import numpy as np

from tpubuild.frontend.onnx_graph import Const, Ctx, Node, shape_of
from tpubuild.frontend.registry import converter
from tpubuild.ir import top


@converter("MatMul", since=1)
def _(node: Node, ctx: Ctx):
    return [ctx.emit(top.MatMulOp, [node.input(0), node.input(1), None], name=node.outputs[0])]


def _transposed(value, ctx: Ctx, name: str):
    if isinstance(value, Const):
        return Const(np.ascontiguousarray(value.array.T), f"{value.name}_T")
    return ctx.emit(top.PermuteOp, [value], top.PermuteParams((1, 0)), name=name)


@converter("Gemm", since=7)
def _(node: Node, ctx: Ctx):
    """Y = alpha * A' B' + beta * C, as one MatMul with a bias where C is a row vector."""
    out = node.outputs[0]
    a, b, c = node.input(0), node.input(1), node.input(2)
    alpha, beta = float(node.attrs.get("alpha", 1.0)), float(node.attrs.get("beta", 1.0))
    if node.attrs.get("transA", 0):
        a = _transposed(a, ctx, f"{out}_transA")
    if node.attrs.get("transB", 0):
        b = _transposed(b, ctx, f"{out}_transB")
    n = shape_of(b)[1]
    if alpha != 1.0 and isinstance(b, Const):
        b, alpha = Const(b.array * np.asarray(alpha, b.array.dtype), f"{b.name}_alpha"), 1.0
    bias, add_c = None, None
    if c is not None and beta != 0.0:
        if isinstance(c, Const) and c.array.size in (1, n) and c.array.ndim <= 2 and alpha == 1.0:
            bias = Const(
                np.broadcast_to(c.array.reshape(-1) * np.asarray(beta, c.array.dtype), (n,)).copy(),
                c.name if beta == 1.0 and c.array.shape == (n,) else f"{c.name}_bias",
            )
        else:
            add_c = (
                c
                if beta == 1.0
                else ctx.emit(top.MulOp, [c, Const(np.asarray(beta, np.float32), f"{out}_beta")], name=f"{out}_betaC")
            )
    last = out if alpha == 1.0 and add_c is None else f"{out}_matmul"
    y = ctx.emit(top.MatMulOp, [a, b, bias], name=last)
    if alpha != 1.0:
        y = ctx.emit(
            top.MulOp,
            [y, Const(np.asarray(alpha, np.float32), f"{out}_alpha")],
            name=out if add_c is None else f"{out}_scaled",
        )
    if add_c is not None:
        y = ctx.emit(top.AddOp, [y, add_c], name=out)
    return [y]
