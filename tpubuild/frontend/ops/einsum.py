"""Einsum: two-operand contractions lowered to Permute/Reshape/MatMul; the rest stay top.Einsum.

The lowering puts each operand in [batch..., free, contracted] / [batch..., contracted, free]
order, multiplies, and permutes the product into the output's letter order, so the
attention forms ('bhid,bhjd->bhij', 'bhij,bhjd->bhid', 'bid,jd->bij') become one
MatMul plus layout ops the backend already handles.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from tpubuild.frontend.onnx_graph import Const, Ctx, Node, Value, shape_of
from tpubuild.frontend.registry import converter
from tpubuild.ir import top


def explicit_equation(equation: str, count: int) -> tuple[list[str], str]:
    """Operand subscripts and output subscripts; the implicit form's output is its once-seen letters, sorted."""
    eq = equation.replace(" ", "")
    lhs, arrow, out = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != count:
        raise ValueError(f"equation {equation!r} names {len(terms)} operands, the node has {count}")
    if not arrow:
        letters = "".join(terms).replace("...", "")
        out = ("..." if "..." in lhs else "") + "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    return terms, out


def _permute(value: Value, ctx: Ctx, order: Sequence[int], name: str) -> Value:
    if list(order) == sorted(order):
        return value
    if isinstance(value, Const):
        return Const(np.ascontiguousarray(np.transpose(value.array, order)), name)
    return ctx.emit(top.PermuteOp, [value], top.PermuteParams(tuple(order)), name=name)


def _lowerable(terms: list[str], out: str) -> bool:
    a, b = terms
    if "..." in a + b + out or any(len(set(t)) != len(t) for t in (a, b, out)):
        return False  # ellipses and diagonals
    # a letter summed inside one operand alone is a reduction, not a contraction
    return all(c in out or c in other for t, other in ((a, b), (b, a)) for c in t)


def _lower(node: Node, ctx: Ctx, terms: list[str], out: str) -> Value:
    (a, b), (x, y) = terms, (node.input(0), node.input(1))
    name = node.outputs[0]
    dims = {**dict(zip(b, shape_of(y), strict=True)), **dict(zip(a, shape_of(x), strict=True))}
    for c in set(a) & set(b):
        da, db = shape_of(x)[a.index(c)], shape_of(y)[b.index(c)]
        if da != db and 1 not in (da, db):
            raise ValueError(f"einsum {a},{b}: letter {c!r} has sizes {da} and {db}")
        dims[c] = max(da, db)
    batch = [c for c in out if c in a and c in b]
    contract = [c for c in a if c in b and c not in out]
    left = [c for c in out if c in a and c not in b]
    right = [c for c in out if c in b and c not in a]

    def size(letters: list[str]) -> int:
        return math.prod(dims[c] for c in letters)

    # without batch letters the left operand's free letters stay separate dims, which MatMul broadcasts a
    # 2-D right operand over ('bid,jd->bij' needs no reshape)
    rows = [dims[c] for c in left] if left and not batch else [size(left)]
    xa = _permute(x, ctx, [a.index(c) for c in batch + left + contract], f"{name}_lhs_perm")
    xa = ctx.reshape(xa, [shape_of(xa)[i] for i in range(len(batch))] + rows + [size(contract)], f"{name}_lhs")
    yb = _permute(y, ctx, [b.index(c) for c in batch + contract + right], f"{name}_rhs_perm")
    yb = ctx.reshape(yb, [shape_of(yb)[i] for i in range(len(batch))] + [size(contract), size(right)], f"{name}_rhs")
    product = batch + left + right
    unflat = [dims[c] for c in product]
    need_reshape = [dims[c] for c in batch] + rows + [size(right)] != unflat
    need_permute = product != list(out)
    z = ctx.emit(top.MatMulOp, [xa, yb, None], name=f"{name}_matmul" if need_reshape or need_permute else name)
    if need_reshape:
        z = ctx.reshape(z, unflat, f"{name}_unflat" if need_permute else name)
    return _permute(z, ctx, [product.index(c) for c in out], name)


@converter("Einsum", since=12)
def _(node: Node, ctx: Ctx):
    terms, out = explicit_equation(node.attrs["equation"], len(node.inputs))
    if len(terms) == 2 and _lowerable(terms, out):
        return [_lower(node, ctx, terms, out)]
    if len(terms) == 1 and sorted(terms[0]) == sorted(out) and "..." not in out and len(set(out)) == len(out):
        return [
            _permute(node.input(0), ctx, [terms[0].index(c) for c in out], node.outputs[0])
            if terms[0] != out
            else ctx.emit(top.IdentityOp, [node.input(0)], name=node.outputs[0])
        ]
    p = top.EinsumParams(f"{','.join(terms)}->{out}")
    return [ctx.emit(top.EinsumOp, list(node.inputs), p, name=node.outputs[0])]
