"""Patterns that only remove work: identities, dead ops, ops computable at compile time."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from xdsl.pattern_rewriter import PatternRewriter, RewritePattern, op_type_rewrite_pattern

from tpubuild.errors import TpuBuildError
from tpubuild.ir import mlir, top
from tpubuild.ir.types import dtype_of, shape_of
from tpubuild.ir.weights import WeightStore
from tpubuild.kernels import KernelError, get_kernel
from tpubuild.top.patterns.common import add_weight, forward, is_constant


class RemoveIdentity(RewritePattern):
    """top.Identity (ONNX Identity, Dropout) passes its input on."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.IdentityOp, rewriter: PatternRewriter) -> None:
        forward(op, op.operands[0], rewriter)


class RemoveDeadOp(RewritePattern):
    """An op none of whose results is used (the graph outputs are uses) is erased.

    Graph inputs stay: they are the model's interface even when nothing reads them.
    """

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.TopOp, rewriter: PatternRewriter) -> None:
        if isinstance(op, top.InputOp):
            return
        if all(not result.uses for result in op.results):
            rewriter.erase(op)


@dataclass
class FoldConstantOp(RewritePattern):
    """An op whose operands are all weights (or absent) becomes weights: its kernel runs now.

    Each result becomes a ``top.Weight`` located at, and stored under, the result's
    tensor name (a fresh variant of it if the store already holds that name).
    """

    weights: WeightStore

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.TopOp, rewriter: PatternRewriter) -> None:
        if isinstance(op, top.InputOp | top.WeightOp | top.NoneOp):
            return
        if not op.operands or not all(is_constant(v) for v in op.operands):
            return
        try:
            kernel = get_kernel(type(op))
        except NotImplementedError:
            return  # no reference kernel: the op stays for the backend to run
        args = [None if isinstance(v.owner, top.NoneOp) else self.weights[mlir.value_name(v)] for v in op.operands]
        try:
            result = kernel(op.params, *args)
        except (KernelError, ValueError, FloatingPointError) as e:
            raise TpuBuildError(
                f"{op.name} failed while folding constants: {e}",
                loc=op.loc_name,
                hint="the op's constant inputs are invalid for it; fix the source model",
            ) from None
        results = result if isinstance(result, tuple) else (result,)
        new = []
        for value, array, name in zip(op.results, results, op.names, strict=True):
            array = np.asarray(array)
            if array.shape != shape_of(value.type):
                raise TpuBuildError(
                    f"{op.name} folded to shape {array.shape}, its type says {shape_of(value.type)}", loc=name
                )
            new.append(add_weight(rewriter, self.weights, name, array, dtype_of(value.type)))
        rewriter.replace(op, [], new)
