"""Data-movement simplification: Reshape/Permute chains merged or cancelled, one-input Concat removed."""

from __future__ import annotations

from xdsl.pattern_rewriter import PatternRewriter, RewritePattern, op_type_rewrite_pattern

from tpubuild.ir import top
from tpubuild.ir.types import shape_of
from tpubuild.top.patterns.common import erase_if_unused, forward, producer


class RemoveNoOpReshape(RewritePattern):
    """A Reshape to the shape it already has passes its input on."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.ReshapeOp, rewriter: PatternRewriter) -> None:
        if shape_of(op.operands[0].type) == shape_of(op.results[0].type):
            forward(op, op.operands[0], rewriter)


class MergeReshapes(RewritePattern):
    """Reshape(Reshape(x)) -> Reshape(x); the inner one goes if nothing else uses it."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.ReshapeOp, rewriter: PatternRewriter) -> None:
        inner = producer(op.operands[0], top.ReshapeOp)
        if inner is not None:
            rewriter.replace(op, top.ReshapeOp.make([inner.operands[0]], op.params, name=op.names[0]))
            erase_if_unused(inner, rewriter)


class RemoveNoOpPermute(RewritePattern):
    """A Permute by the identity order passes its input on."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.PermuteOp, rewriter: PatternRewriter) -> None:
        if list(op.params.order) == list(range(len(op.params.order))):
            forward(op, op.operands[0], rewriter)


class MergePermutes(RewritePattern):
    """Permute(Permute(x, p), q) -> Permute(x, p[q]) (the identity then cancels)."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.PermuteOp, rewriter: PatternRewriter) -> None:
        inner = producer(op.operands[0], top.PermuteOp)
        if inner is None:
            return
        p, q = inner.params.order, op.params.order
        merged = top.PermuteParams(tuple(p[i] for i in q))
        rewriter.replace(op, top.PermuteOp.make([inner.operands[0]], merged, name=op.names[0]))
        erase_if_unused(inner, rewriter)


class PermuteAsReshape(RewritePattern):
    """A Permute that only moves size-1 dims keeps the memory order: it is a Reshape."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.PermuteOp, rewriter: PatternRewriter) -> None:
        shape = shape_of(op.operands[0].type)
        moved = [i for i in op.params.order if shape[i] != 1]
        if moved != sorted(moved) or list(op.params.order) == sorted(op.params.order):
            return
        out = shape_of(op.results[0].type)
        rewriter.replace(op, top.ReshapeOp.make([op.operands[0]], top.ShapeParams(out), name=op.names[0]))


class RemoveSingleConcat(RewritePattern):
    """Concat of one tensor is that tensor."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.ConcatOp, rewriter: PatternRewriter) -> None:
        if len(op.operands) == 1:
            forward(op, op.operands[0], rewriter)
