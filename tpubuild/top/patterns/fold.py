"""Constant scales folded into what they follow: BatchNorm, Mul/Add/Sub by constants into
Conv/MatMul weights, a scalar scale into Softmax's beta.

y = W*x + b followed by y*s + t (s, t constant per output channel) is
(W*s)*x + (b*s + t): the filter (Conv) or the right operand (MatMul) is
scaled along its output-channel axis and the bias rewritten. The producer
must have no fused activation and the affine op as its only user; the folded
op takes the affine op's tensor name. Folded arrays are computed in float64
and stored under fresh names.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from xdsl.ir import SSAValue
from xdsl.pattern_rewriter import PatternRewriter, RewritePattern, op_type_rewrite_pattern

from tpubuild.ir import top
from tpubuild.ir.base import TensorOp
from tpubuild.ir.types import dtype_of, shape_of
from tpubuild.ir.weights import WeightStore
from tpubuild.top.patterns.common import add_weight, producer, rebuilt, single_user, weight_array, with_relu


@dataclass(frozen=True)
class Channels:
    """Where an op's output channels are: in its result, and in its weight operand."""

    out_axis: int
    weight_axis: int
    weight_operand: int = 1
    bias_operand: int = 2


# Conv: NC... result, filter [OC, IC/g, *k]; MatMul: channels last, right operand [..., K, N]; Deconv: NC...
# result, filter [IC, OC/g, *k] (its output channels are axis 1 of the filter only for one group)
CHANNELS: dict[type, Channels] = {
    top.ConvOp: Channels(out_axis=1, weight_axis=0),
    top.MatMulOp: Channels(out_axis=-1, weight_axis=-1),
    top.DeconvOp: Channels(out_axis=1, weight_axis=1),
}


def _along(vec: np.ndarray, axis: int, rank: int) -> np.ndarray:
    """``vec`` shaped to broadcast along ``axis`` of a rank-``rank`` array."""
    shape = [1] * rank
    shape[axis] = vec.size
    return vec.reshape(shape)


def per_channel(c: np.ndarray, out_shape: tuple[int, ...], axis: int) -> np.ndarray | None:
    """``c`` as a [C] vector if, broadcast against ``out_shape``, it varies along ``axis`` only."""
    if c.dtype.kind != "f" or c.ndim > len(out_shape):
        return None
    shape = (1,) * (len(out_shape) - c.ndim) + c.shape
    if any(d != 1 for i, d in enumerate(shape) if i != axis) or shape[axis] not in (1, out_shape[axis]):
        return None
    return np.broadcast_to(c.reshape(-1).astype(np.float64), (out_shape[axis],))


def channel_axis(op: TensorOp) -> int | None:
    """The output-channel axis of an op CHANNELS knows (normalised), else None."""
    info = CHANNELS.get(type(op))
    if info is None:
        return None
    return info.out_axis % len(shape_of(op.results[0].type))


def known_channel_axis(op: TensorOp) -> int:
    """The output-channel axis of an op CHANNELS knows (normalised); KeyError for another op."""
    return CHANNELS[type(op)].out_axis % len(shape_of(op.results[0].type))


def fold_affine(
    source: TensorOp,
    scale: np.ndarray | None,
    shift: np.ndarray | None,
    *,
    name: str,
    relu_from,
    weights: WeightStore,
    rewriter: PatternRewriter,
) -> TensorOp | None:
    """``source`` with ``y*scale + shift`` (per-channel [C] vectors) folded in, named ``name``
    and taking the fused ReLU of ``relu_from`` (the affine op's params); None if impossible."""
    info = CHANNELS[type(source)]
    if getattr(source.params, "do_relu", False):
        return None
    w_value, b_value = source.operands[info.weight_operand], source.operands[info.bias_operand]
    out_type = source.results[0].type
    bias = weight_array(b_value, weights)
    if bias is None and not isinstance(b_value.owner, top.NoneOp):
        return None  # a bias computed at run time cannot absorb the shift
    new_w = w_value
    new_bias = np.zeros(shape_of(out_type)[known_channel_axis(source)]) if bias is None else bias.astype(np.float64)
    if scale is not None:
        w = weight_array(w_value, weights)
        if w is None or w.ndim < 2 or (isinstance(source, top.DeconvOp) and source.params.group != 1):
            return None
        w_scaled = w.astype(np.float64) * _along(scale, info.weight_axis % w.ndim, w.ndim)
        new_bias = new_bias * scale
        new_w = add_weight(rewriter, weights, f"{name}_weight", w_scaled, w.dtype)
    if shift is not None:
        new_bias = new_bias + shift
    operands = list(source.operands)
    operands[info.weight_operand] = new_w
    if bias is not None or shift is not None:
        operands[info.bias_operand] = add_weight(rewriter, weights, f"{name}_bias", new_bias, dtype_of(out_type))
    params = with_relu(source.params, getattr(relu_from, "do_relu", False), getattr(relu_from, "relu_limit", -1.0))
    return rebuilt(source, params=params, operands=operands, name=name)


def _fold_into_producer(
    op: TensorOp,
    value: SSAValue,
    scale: np.ndarray | None,
    shift: np.ndarray | None,
    weights: WeightStore,
    rewriter: PatternRewriter,
) -> bool:
    """Replace ``op`` (an affine op on ``value``) by ``value``'s producer with the affine folded."""
    source = producer(value)
    if source is None or type(source) not in CHANNELS or single_user(value) is not op:
        return False
    if getattr(source.params, "do_relu", False):
        return False
    folded = fold_affine(
        source, scale, shift, name=op.names[0], relu_from=op.params, weights=weights, rewriter=rewriter
    )
    if folded is None:
        return False
    rewriter.replace(op, folded)
    rewriter.erase(source)
    return True


def _constant_channel_operand(op: TensorOp, weights: WeightStore, *, commutative: bool):
    """(value, [C] constant) pairs where ``op`` combines a foldable producer's output with a
    per-channel constant and the result keeps that output's shape."""
    orders = ((0, 1), (1, 0)) if commutative else ((0, 1),)
    for i, j in orders:
        value, const = op.operands[i], weight_array(op.operands[j], weights)
        source = producer(value)
        if const is None or source is None or type(source) not in CHANNELS:
            continue
        out_shape = shape_of(value.type)
        if shape_of(op.results[0].type) != out_shape:
            continue  # the constant broadcasts the result larger: not a per-channel affine
        vec = per_channel(const, out_shape, known_channel_axis(source))
        if vec is not None:
            yield value, vec


@dataclass
class FoldBatchNorm(RewritePattern):
    """BatchNorm after a Conv (or a 2-D MatMul, channels on axis 1) -> new weights and bias."""

    weights: WeightStore

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.BatchNormOp, rewriter: PatternRewriter) -> None:
        source = producer(op.operands[0])
        if source is None or channel_axis(source) != 1:
            return
        scale, shift = batchnorm_affine(op, self.weights)
        if scale is not None:
            _fold_into_producer(op, op.operands[0], scale, shift, self.weights, rewriter)


def batchnorm_affine(op: top.BatchNormOp, weights: WeightStore) -> tuple[np.ndarray | None, np.ndarray | None]:
    """BatchNorm as y*scale + shift per channel (float64), or (None, None) if not constant."""
    mean, var, gamma, beta = (weight_array(v, weights) for v in op.operands[1:5])
    if mean is None or var is None or gamma is None or beta is None:
        return None, None
    inv = gamma.astype(np.float64) / np.sqrt(var.astype(np.float64) + op.params.eps)
    return inv, beta.astype(np.float64) - mean.astype(np.float64) * inv


@dataclass
class DecomposeBatchNorm(RewritePattern):
    """A BatchNorm left over (nothing to fold into): on NCHW a depthwise 1x1 Conv (filter = the
    per-channel scale, bias = the shift), else Mul by and Add of per-channel weights.

    The depthwise form is one op: the Mul/Add by per-channel constants and the ReLU that follow
    (a Caffe-style Scale layer after the BatchNorm, as in DenseNet's pre-activation blocks) then
    fold into it (FoldScaleBiasPass), and INT8 computes the whole affine with per-channel weight
    scales, an int32 bias and one requantization. As separate Mul and Add ops, every step's
    result is quantized per tensor: a batch norm that divides by a small variance and then
    subtracts a large mean cancels most of the first result's 8 bits (light_densenet121: output
    cosine 0.39). TPU-MLIR does the same: Scale ops merge (TopMultiScaleMergeToOne) and become
    depthwise convolutions. The Conv takes the BatchNorm's tensor name; the Mul form names its
    Mul ``<bn>_mul`` and its Add takes the BatchNorm's name.
    """

    weights: WeightStore

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.BatchNormOp, rewriter: PatternRewriter) -> None:
        scale, shift = batchnorm_affine(op, self.weights)
        x = op.operands[0]
        shape = shape_of(x.type)
        if scale is None or shift is None or len(shape) < 2:
            return
        dtype, name = dtype_of(x.type), op.names[0]
        if len(shape) == 4:
            c = scale.size
            w = add_weight(rewriter, self.weights, f"{name}_scale", scale.reshape(c, 1, 1, 1), dtype)
            b = add_weight(rewriter, self.weights, f"{name}_shift", shift.reshape(c), dtype)
            params = top.ConvParams((1, 1), (1, 1), (0, 0, 0, 0), (1, 1), group=c)
            rewriter.replace(op, top.ConvOp.make([x, w, b], params, name=name, result_types=[op.results[0].type]))
            return
        channel = (scale.size,) + (1,) * (len(shape) - 2)
        s = add_weight(rewriter, self.weights, f"{name}_scale", scale.reshape(channel), dtype)
        t = add_weight(rewriter, self.weights, f"{name}_shift", shift.reshape(channel), dtype)
        mul = top.MulOp.make([x, s], name=f"{name}_mul", result_types=[op.results[0].type])
        add = top.AddOp.make([mul.results[0], t], name=name, result_types=[op.results[0].type])
        rewriter.replace(op, [mul, add])


@dataclass
class FoldMulIntoProducer(RewritePattern):
    """Conv/MatMul result times a per-channel constant -> scaled weights and bias."""

    weights: WeightStore

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.MulOp, rewriter: PatternRewriter) -> None:
        for value, vec in _constant_channel_operand(op, self.weights, commutative=True):
            if _fold_into_producer(op, value, vec, None, self.weights, rewriter):
                return


@dataclass
class FoldAddIntoProducer(RewritePattern):
    """Conv/MatMul result plus a per-channel constant -> bias (a MatMul then Add is a linear layer)."""

    weights: WeightStore

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.AddOp, rewriter: PatternRewriter) -> None:
        for value, vec in _constant_channel_operand(op, self.weights, commutative=True):
            if _fold_into_producer(op, value, None, vec, self.weights, rewriter):
                return


@dataclass
class FoldSubIntoProducer(RewritePattern):
    """Conv/MatMul result minus a per-channel constant -> bias."""

    weights: WeightStore

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.SubOp, rewriter: PatternRewriter) -> None:
        for value, vec in _constant_channel_operand(op, self.weights, commutative=False):
            if _fold_into_producer(op, value, None, -vec, self.weights, rewriter):
                return


# op -> (operand orders that read "x op constant", power of the constant in the scale)
_SCALES = {
    top.MulOp: (((0, 1), (1, 0)), 1),
    top.DivOp: (((0, 1),), -1),
}


@dataclass
class FoldScaleIntoSoftmax(RewritePattern):
    """Softmax(x * s) or Softmax(x / s), s a constant scalar -> Softmax(x) with beta scaled
    (attention's 1/sqrt(d) before its softmax)."""

    weights: WeightStore

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.SoftmaxOp, rewriter: PatternRewriter) -> None:
        scale_op = producer(op.operands[0])
        if scale_op is None or type(scale_op) not in _SCALES or single_user(op.operands[0]) is not op:
            return
        if getattr(scale_op.params, "do_relu", False):
            return
        orders, power = _SCALES[type(scale_op)]
        for i, j in orders:
            x, c = scale_op.operands[i], weight_array(scale_op.operands[j], self.weights)
            if c is None or c.size != 1 or c.dtype.kind != "f" or shape_of(x.type) != shape_of(op.results[0].type):
                continue
            s = float(c.reshape(()))
            if s == 0.0 or not np.isfinite(s):
                return  # x * 0 or x / 0 is no softmax temperature
            beta = op.params.beta * s**power
            rewriter.replace(op, top.SoftmaxOp.make([x], replace(op.params, beta=beta), name=op.names[0]))
            rewriter.erase(scale_op)
            return


def _scalar_scale(
    scale_op: TensorOp | None, weights: WeightStore, result_shape: tuple[int, ...]
) -> tuple[SSAValue, float] | None:
    """(x, s) if ``scale_op`` is x * s or x / s (the power already applied), s a usable scalar."""
    if scale_op is None or type(scale_op) not in _SCALES or getattr(scale_op.params, "do_relu", False):
        return None
    orders, power = _SCALES[type(scale_op)]
    for i, j in orders:
        x, c = scale_op.operands[i], weight_array(scale_op.operands[j], weights)
        if c is None or c.size != 1 or c.dtype.kind != "f" or shape_of(x.type) != result_shape:
            continue
        s = float(c.reshape(()))
        return (x, s**power) if s != 0.0 and np.isfinite(s) else None
    return None


@dataclass
class FoldQueryScaleIntoSoftmax(RewritePattern):
    """Softmax((q * s) @ k), s a constant scalar (either MatMul operand scaled, or divided) ->
    Softmax(q @ k) with beta scaled: attention that scales q before its scores (SVTR, timm).

    The unscaled MatMul is a new tensor, so it gets a new name (``<matmul>_unscaled``);
    the Softmax keeps its own.
    """

    weights: WeightStore

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.SoftmaxOp, rewriter: PatternRewriter) -> None:
        mm = producer(op.operands[0], top.MatMulOp)
        if mm is None or single_user(op.operands[0]) is not op or mm.params.do_relu:
            return
        if not isinstance(mm.operands[2].owner, top.NoneOp):
            return  # a bias is not scaled with the product
        for side in (0, 1):
            scale_op = producer(mm.operands[side])
            if single_user(mm.operands[side]) is not mm:
                continue
            found = _scalar_scale(scale_op, self.weights, shape_of(mm.operands[side].type))
            if found is None or scale_op is None:
                continue
            x, s = found
            operands = list(mm.operands)
            operands[side] = x
            scores = rebuilt(mm, operands=operands, name=f"{mm.names[0]}_unscaled")
            softmax = top.SoftmaxOp.make(
                [scores.results[0]], replace(op.params, beta=op.params.beta * s), name=op.names[0]
            )
            rewriter.replace(op, [scores, softmax])
            rewriter.erase(mm)
            rewriter.erase(scale_op)
            return
