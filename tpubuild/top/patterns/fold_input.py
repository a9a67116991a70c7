"""Constant scale and shift of an input folded into the Conv/MatMul that reads it.

W * (a*x + b) = (W*a) * x + W*b: a per-input-channel (or scalar) affine before a
Conv or a MatMul with a constant right operand becomes a scaled filter and a
bias. fold.py folds affines *after* their producer; this is the other side, for
affines whose producer cannot take them (PP-LCNetV3's learnable scale and shift
after each HardSwish). A Conv with padding takes the scale only: its zero
padding would not be shifted. The consumer keeps its name; the affine ops go
once no other op reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from xdsl.ir import SSAValue
from xdsl.pattern_rewriter import PatternRewriter, RewritePattern, op_type_rewrite_pattern

from tpubuild.ir import top
from tpubuild.ir.base import TensorOp
from tpubuild.ir.types import dtype_of, shape_of
from tpubuild.ir.weights import WeightStore
from tpubuild.top.patterns.common import add_weight, erase_if_unused, producer, rebuilt, weight_array
from tpubuild.top.patterns.fold import per_channel


@dataclass
class Affine:
    """value = x * scale + shift, both [C] along ``axis`` of x (None: absent), and the ops computing it."""

    x: SSAValue
    scale: np.ndarray | None
    shift: np.ndarray | None
    ops: list[TensorOp]


def _constant_side(op: TensorOp, weights: WeightStore, axis: int, orders) -> tuple[SSAValue, np.ndarray] | None:
    for i, j in orders:
        x, c = op.operands[i], weight_array(op.operands[j], weights)
        if c is None or producer(x, top.WeightOp) is not None:
            continue
        shape = shape_of(x.type)
        if shape != shape_of(op.results[0].type):
            continue  # the constant broadcasts the result larger
        vec = per_channel(c, shape, axis % len(shape))
        if vec is not None:
            return x, vec
    return None


def input_affine(value: SSAValue, weights: WeightStore, axis: int) -> Affine | None:
    """``value`` as x * a + b (or x * a, x + b, x - b) with a, b constant along ``axis``."""
    ops: list[TensorOp] = []
    shift = None
    add = producer(value, top.AddOp | top.SubOp)
    if add is not None and not getattr(add.params, "do_relu", False):
        orders = ((0, 1), (1, 0)) if isinstance(add, top.AddOp) else ((0, 1),)
        found = _constant_side(add, weights, axis, orders)
        if found is not None:
            value, shift = found
            shift = -shift if isinstance(add, top.SubOp) else shift
            ops.append(add)
    scale = None
    mul = producer(value, top.MulOp)
    if mul is not None and not mul.params.do_relu:
        found = _constant_side(mul, weights, axis, ((0, 1), (1, 0)))
        if found is not None:
            value, scale = found
            ops.append(mul)
    if not ops:
        return None
    return Affine(value, scale, shift, ops)


def _finish(
    op: TensorOp,
    affine: Affine,
    weight: np.ndarray,
    bias: np.ndarray | None,
    *,
    weights: WeightStore,
    rewriter: PatternRewriter,
    weight_operand: int = 1,
    bias_operand: int = 2,
) -> None:
    name = op.names[0]
    operands = list(op.operands)
    operands[0] = affine.x
    operands[weight_operand] = add_weight(
        rewriter, weights, f"{name}_weight", weight, dtype_of(op.operands[weight_operand].type)
    )
    if bias is not None:
        operands[bias_operand] = add_weight(rewriter, weights, f"{name}_bias", bias, dtype_of(op.results[0].type))
    rewriter.replace(op, rebuilt(op, operands=operands))
    for dead in affine.ops:
        erase_if_unused(dead, rewriter)


def _bias(op: TensorOp, weights: WeightStore, index: int = 2) -> tuple[bool, np.ndarray | None]:
    """(usable, array): a constant bias, or none at all; a run-time bias cannot absorb a shift."""
    value = op.operands[index]
    if isinstance(value.owner, top.NoneOp):
        return True, None
    b = weight_array(value, weights)
    return b is not None, None if b is None else b.astype(np.float64)


@dataclass
class FoldInputAffineIntoConv(RewritePattern):
    """Conv(x * a + b), a and b per input channel -> Conv(x) with the filter scaled and b in the
    bias (b only without padding)."""

    weights: WeightStore

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.ConvOp, rewriter: PatternRewriter) -> None:
        affine = input_affine(op.operands[0], self.weights, axis=1)
        w = weight_array(op.operands[1], self.weights)
        usable, bias = _bias(op, self.weights)
        if affine is None or w is None or not usable:
            return
        if affine.shift is not None and any(op.params.pads):
            return  # the padding would stay 0 where the shifted input has b
        oc, cg = w.shape[:2]
        g = op.params.group
        w64 = w.astype(np.float64)

        def per_filter(vec: np.ndarray) -> np.ndarray:
            # input channel c = group * cg + i feeds the output channels of that group through w[:, i]
            return np.repeat(vec.reshape(g, cg), oc // g, axis=0).reshape(oc, cg, *(1,) * (w.ndim - 2))

        new_w = w64 if affine.scale is None else w64 * per_filter(affine.scale)
        if affine.shift is not None:
            shifted = (w64 * per_filter(affine.shift)).sum(axis=tuple(range(1, w.ndim)))
            bias = shifted if bias is None else bias + shifted
        _finish(op, affine, new_w, bias, weights=self.weights, rewriter=rewriter)


@dataclass
class FoldInputAffineIntoMatMul(RewritePattern):
    """MatMul(x * a + b, W), a and b along x's last dim, W a constant matrix -> MatMul(x, a*W)
    with b @ W in the bias."""

    weights: WeightStore

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.MatMulOp, rewriter: PatternRewriter) -> None:
        if len(shape_of(op.operands[0].type)) < 2:
            return
        w = weight_array(op.operands[1], self.weights)
        usable, bias = _bias(op, self.weights)
        if w is None or w.ndim != 2 or not usable:
            return
        affine = input_affine(op.operands[0], self.weights, axis=-1)
        if affine is None:
            return
        w64 = w.astype(np.float64)
        new_w = w64 if affine.scale is None else affine.scale[:, None] * w64
        if affine.shift is not None:
            bias = affine.shift @ w64 if bias is None else bias + affine.shift @ w64
        _finish(op, affine, new_w, bias, weights=self.weights, rewriter=rewriter)
