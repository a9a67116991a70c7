"""Data-movement simplification: Reshape/Permute chains merged or cancelled, one-input Concat removed, empty
Concat inputs dropped, a Split or Slice of what a Concat joined taken from the Concat's inputs."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from xdsl.ir import SSAValue
from xdsl.pattern_rewriter import PatternRewriter, RewritePattern, op_type_rewrite_pattern

from tpubuild.ir import top
from tpubuild.ir.base import TensorOp
from tpubuild.ir.types import shape_of
from tpubuild.top.patterns.common import erase_if_unused, forward, is_graph_output, producer, rebuilt


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


class DropEmptyConcatInputs(RewritePattern):
    """A Concat input with no values adds nothing (RivaGAN's encoder joins ``x[:, 32:]`` of 32 channels); the
    chip has no zero-size tensors."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.ConcatOp, rewriter: PatternRewriter) -> None:
        kept = [x for x in op.operands if math.prod(shape_of(x.type))]
        if kept and len(kept) < len(op.operands):
            rewriter.replace(op, rebuilt(op, operands=kept))


@dataclass(frozen=True)
class _Cut:
    """How to take ``op``'s result apart into ``pieces`` ([start, end) along ``axis``): at an aligned Concat its
    inputs regroup (``inner`` empty); any other op is rebuilt once per piece from the pieces of its operands
    (``inner``, one cut per operand)."""

    op: TensorOp
    axis: int
    pieces: tuple[tuple[int, int], ...]
    inner: tuple[_Cut, ...]


def _edges(concat: top.ConcatOp, axis: int) -> list[int]:
    sizes = [shape_of(x.type)[axis] for x in concat.operands]
    return [sum(sizes[:i]) for i in range(len(sizes) + 1)]


def _plan_cut(value: SSAValue, axis: int, pieces: tuple[tuple[int, int], ...], first: bool = False) -> _Cut | None:
    """A cut of ``value`` that ends at Concats along ``axis`` whose inputs meet at every piece's ends, through
    ops that only move values; None if there is none. Every value on the way has one user, so the old chain
    goes; the ``first`` may have more if all are Splits or Slices (a box Slice and a class Slice), each of which
    takes its pieces the same way."""
    op = producer(value)
    users = [use.operation for use in value.uses]
    shared = first and all(isinstance(u, top.SplitOp | top.SliceOp) for u in users)
    if not (len(users) == 1 or shared) or not isinstance(op, top.ConcatOp | top.ReshapeOp | top.PermuteOp):
        return None
    rank = len(shape_of(value.type))
    if isinstance(op, top.ConcatOp):
        if op.params.axis % rank == axis:
            edges = _edges(op, axis)
            aligned = all(start in edges and end in edges for start, end in pieces)
            return _Cut(op, axis, pieces, ()) if aligned else None
        inner = [_plan_cut(x, axis, pieces) for x in op.operands]
    elif isinstance(op, top.ReshapeOp):
        # the dims up to the cut's stay as they are: each piece is the same reshape of a piece of the input
        same = shape_of(op.operands[0].type)[: axis + 1] == shape_of(value.type)[: axis + 1]
        inner = [_plan_cut(op.operands[0], axis, pieces) if same else None]
    else:
        inner = [_plan_cut(op.operands[0], op.params.order[axis], pieces)]
    return None if any(cut is None for cut in inner) else _Cut(op, axis, pieces, tuple(c for c in inner if c))


def _cut_values(cut: _Cut, names: Sequence[str], rewriter: PatternRewriter) -> list[SSAValue]:
    """The pieces of ``cut.op``'s result, new ops named ``names`` (one per piece) inserted before the match."""
    op = cut.op
    if not cut.inner:  # the aligned Concat: its inputs, regrouped
        edges = _edges(cast(top.ConcatOp, op), cut.axis)
        found = []
        for (start, end), name in zip(cut.pieces, names, strict=True):
            group = [x for x, lo in zip(op.operands, edges, strict=False) if start <= lo < end]
            found.append(
                group[0]
                if len(group) == 1
                else rewriter.insert(top.ConcatOp.make(group, op.params, name=name)).results[0]
            )
        return found
    inner = [_cut_values(c, [f"{c.op.names[0]}_part{k}" for k in range(len(cut.pieces))], rewriter) for c in cut.inner]
    found = []
    for k, ((start, end), name) in enumerate(zip(cut.pieces, names, strict=True)):
        operands = [part[k] for part in inner]
        if isinstance(op, top.ReshapeOp):
            shape = list(op.params.shape)
            shape[cut.axis] = end - start
            made = top.ReshapeOp.make(operands, top.ShapeParams(tuple(shape)), name=name)
        else:
            made = type(op).make(operands, op.params, name=name)
        found.append(rewriter.insert(made).results[0])
    return found


def _apply_cut(op: TensorOp, axis: int, pieces: tuple[tuple[int, int], ...], rewriter: PatternRewriter) -> None:
    if any(is_graph_output(r) for r in op.results) or any(start >= end for start, end in pieces):
        return  # a piece may be an input of the Concat, under that input's name; an empty one is no input
    rank = len(shape_of(op.operands[0].type))
    cut = _plan_cut(op.operands[0], axis % rank, pieces, first=True)
    if cut is not None:
        rewriter.replace(op, [], _cut_values(cut, op.names, rewriter))


class SplitConcatParts(RewritePattern):
    """A Split whose cuts fall where the inputs of a Concat along its axis meet gives those inputs (or Concats
    of them) back, also through Reshapes that keep the dims up to the axis, Permutes and Concats along other
    axes: a YOLOv8 head concatenates box distributions and class logits per level, reshapes, concatenates the
    levels and splits box from class again. Taken apart, the class logits keep a quantization of their own
    instead of sharing one INT8 scale with the box distributions (a scale set by logits 40 below zero, where
    the sigmoid after them only needs -12 to 12)."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.SplitOp, rewriter: PatternRewriter) -> None:
        edges = list(itertools.accumulate(op.params.split_size, initial=0))
        _apply_cut(op, op.params.axis, tuple(itertools.pairwise(edges)), rewriter)


class SliceConcatPart(RewritePattern):
    """SplitConcatParts for a Slice taking one such piece (step 1 along one axis, the rest whole)."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.SliceOp, rewriter: PatternRewriter) -> None:
        shape = shape_of(op.operands[0].type)
        p = op.params
        cut = [
            i
            for i, (a, b, s, n) in enumerate(zip(p.offset, p.ends, p.steps, shape, strict=True))
            if (a, b, s) != (0, n, 1)
        ]
        if len(cut) == 1 and p.steps[cut[0]] == 1:
            _apply_cut(op, cut[0], ((p.offset[cut[0]], p.ends[cut[0]]),), rewriter)
