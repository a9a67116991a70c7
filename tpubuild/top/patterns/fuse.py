"""Activation fusion: a ReLU (or Clip(0, N), i.e. ReLU-N) merged into the op that feeds it.

The producer must carry ``do_relu``/``relu_limit`` (Conv, MatMul, Add, Mul, pools)
and have the activation as its only user; the fused op takes the activation's
tensor name, since that is the tensor it now produces.
"""

from __future__ import annotations

import math

from xdsl.pattern_rewriter import PatternRewriter, RewritePattern, op_type_rewrite_pattern

from tpubuild.ir import top
from tpubuild.ir.base import TensorOp
from tpubuild.top.patterns.common import carries_relu, producer, rebuilt, single_user, with_relu


def _fuse(act: TensorOp, limit: float, rewriter: PatternRewriter, *, needs_relu: bool = False) -> None:
    """Replace ``act`` = ReLU-``limit``(producer) by the producer with the ReLU fused.

    ``needs_relu``: the activation only equals a ReLU-N if the producer already clamps at 0.
    """
    source = producer(act.operands[0])
    if source is None or not carries_relu(source) or single_user(act.operands[0]) is not act:
        return
    if needs_relu and not source.params.do_relu:
        return
    fused = rebuilt(source, params=with_relu(source.params, True, limit), name=act.names[0])
    rewriter.replace(act, fused)
    rewriter.erase(source)


class FuseRelu(RewritePattern):
    """Relu(x) with x from a fusable op -> that op with do_relu (relu_limit kept)."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.ReluOp, rewriter: PatternRewriter) -> None:
        _fuse(op, op.params.relu_limit, rewriter)


class FuseClipAsRelu(RewritePattern):
    """Clip(0, N)(x) -> do_relu with relu_limit N (ReLU6 and friends); Clip(<=0, N) too when x
    is already ReLU'd."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.ClipOp, rewriter: PatternRewriter) -> None:
        p = op.params
        if p.max <= 0 or p.min > 0:
            return
        limit = p.max if math.isfinite(p.max) else -1.0
        _fuse(op, limit, rewriter, needs_relu=p.min < 0)
