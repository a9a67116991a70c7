"""An explicit Pad folded into the Conv or pool that reads it (their own pads do the same work).

Only constant-mode pads of the spatial dims (none on N and C, none negative) fold,
and only where the consumer's implicit padding means the same value:

- Conv pads with zeros: the Pad's value must be 0.
- MaxPool ignores its own padding (it behaves as -inf). A Pad of -inf is that; so is
  any value no larger than every input element (0 after a ReLU, a Sigmoid...), as
  long as every window still holds an input element (pads below the kernel size,
  no dilation), since the max then never picks the padding.
- AvgPool counts explicit padding in its divisor; its own pads count only with
  count_include_pad. So a zero Pad folds into one that has no pads of its own or
  already counts them, and the result counts all of them.

ceil_mode pools are left alone: their last window's extent is measured against
the input without its end padding, so folding can change the output size. The
consumer keeps its own tensor name; a Pad with other users stays for them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from xdsl.pattern_rewriter import PatternRewriter, RewritePattern, op_type_rewrite_pattern

from tpubuild.ir import top
from tpubuild.ir.base import TensorOp
from tpubuild.top.patterns.common import erase_if_unused, producer, rebuilt


def spatial_pads(pad: top.PadOp, nd: int) -> tuple[int, ...] | None:
    """The Pad's begins then ends over the last ``nd`` dims, if it pads nothing else and crops nothing."""
    p = pad.params
    rank = len(p.paddings) // 2
    begins, ends = p.paddings[:rank], p.paddings[rank:]
    if p.mode != "constant" or rank < nd or min(p.paddings) < 0:
        return None
    if any(begins[: rank - nd]) or any(ends[: rank - nd]):
        return None
    return tuple(begins[rank - nd :]) + tuple(ends[rank - nd :])


def _lower_bound_relu(p) -> float:
    return 0.0 if getattr(p, "do_relu", False) else -math.inf


# op class -> lower bound of every element it produces (from its params)
LOWER_BOUNDS: dict[type, Callable[[Any], float]] = {  # op class -> f(its params)
    top.ReluOp: lambda p: 0.0,
    top.SigmoidOp: lambda p: 0.0,
    top.HardSigmoidOp: lambda p: 0.0,
    top.SoftmaxOp: lambda p: -math.inf if p.log else 0.0,
    top.ClipOp: lambda p: p.min,
    top.AbsOp: lambda p: 0.0,
    top.ExpOp: lambda p: 0.0,
    top.ConvOp: _lower_bound_relu,
    top.MatMulOp: _lower_bound_relu,
    top.AddOp: _lower_bound_relu,
    top.MulOp: _lower_bound_relu,
    top.MaxPoolOp: _lower_bound_relu,
    top.AvgPoolOp: _lower_bound_relu,
}


def lower_bound(op: TensorOp | None) -> float:
    """A value no element of ``op``'s result is below (-inf if nothing is known)."""
    rule = LOWER_BOUNDS.get(type(op))
    return -math.inf if rule is None or op is None else rule(op.params)


def _summed(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(x + y for x, y in zip(a, b, strict=True))


def _windows_hold_input(kernel: tuple[int, ...], pads: tuple[int, ...]) -> bool:
    """Pads below the kernel size: every (undilated) window overlaps the input."""
    return all(t < kernel[i % len(kernel)] for i, t in enumerate(pads))


def _fold(op: TensorOp, rewriter: PatternRewriter, fits: Callable[[top.PadOp, tuple[int, ...]], object]) -> None:
    """Replace ``op`` by itself reading the Pad's input, with ``fits(pad, pads)``'s params
    (None: this Pad cannot fold)."""
    pad = producer(op.operands[0], top.PadOp)
    if pad is None:
        return
    pads = spatial_pads(pad, len(op.params.kernel_shape))
    if pads is None or not any(pads):
        return
    params = fits(pad, pads)
    if params is None:
        return
    rewriter.replace(op, rebuilt(op, params=params, operands=[pad.operands[0], *op.operands[1:]]))
    erase_if_unused(pad, rewriter)


class FoldPadIntoConv(RewritePattern):
    """Conv(Pad(x, 0)) -> Conv(x) with the pads added to its own."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.ConvOp, rewriter: PatternRewriter) -> None:
        _fold(
            op,
            rewriter,
            lambda pad, pads: (
                dataclasses.replace(op.params, pads=_summed(op.params.pads, pads)) if pad.params.val == 0.0 else None
            ),
        )


class FoldPadIntoMaxPool(RewritePattern):
    """MaxPool(Pad(x, v)) -> MaxPool(x) with the pads added, v being -inf or no larger than x."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.MaxPoolOp, rewriter: PatternRewriter) -> None:
        p = op.params

        def fits(pad: top.PadOp, pads: tuple[int, ...]):
            total = _summed(p.pads, pads)
            if p.ceil_mode or any(d != 1 for d in p.dilations):
                return None
            if not _windows_hold_input(p.kernel_shape, total):
                return None  # a window of padding alone would give v, not nothing
            v = pad.params.val
            if not (v == -math.inf or v <= lower_bound(producer(pad.operands[0]))):
                return None
            return dataclasses.replace(p, pads=total)

        _fold(op, rewriter, fits)


class FoldPadIntoAvgPool(RewritePattern):
    """AvgPool(Pad(x, 0)) -> AvgPool(x, count_include_pad) with the pads added, when the pool
    has no pads of its own or counts them already."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.AvgPoolOp, rewriter: PatternRewriter) -> None:
        p = op.params

        def fits(pad: top.PadOp, pads: tuple[int, ...]):
            if pad.params.val != 0.0 or p.ceil_mode or (any(p.pads) and not p.count_include_pad):
                return None
            total = _summed(p.pads, pads)
            if not _windows_hold_input(p.kernel_shape, total):
                return None  # ONNX (and TPU-MLIR) pools want pads below the kernel size
            return dataclasses.replace(p, pads=total, count_include_pad=True)

        _fold(op, rewriter, fits)
