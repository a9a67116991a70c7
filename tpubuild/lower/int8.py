"""INT8 lowering rules, one per TOP op class (tpubuild/lower/quant.py states the scheme).

- Conv, MatMul: int8 x int8 -> int32 with per-output-channel weight scales
  and multipliers, int32 bias.
- Add, Sub, Mul, Concat, AvgPool: every input requantized to the output's scale
  by its own multiplier (a Concat input keeps its resolution until the join).
- MaxPool and data movement (Reshape, Permute, Slice, Pad...): the output keeps
  the input's quantization, so they are exact.
- Unary functions (Sigmoid, GELU, SiLU, Exp, ...), and binary ops with a scalar
  constant: a 256-entry table from the input's stored byte to the output's,
  computed with the TOP kernel, so exact for per-tensor int8.
- Everything else (Softmax, LayerNorm, Div by a tensor, ...) has no rule here
  and stays in the chip's float mode with casts around it.

A rule returns None when its op cannot be INT8 after all (a conv whose filter
is not a constant, a sum that could overflow int32): that op stays float too.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TypeGuard
import weakref

import numpy as np
from xdsl.dialects.builtin import NoneType, f32
from xdsl.ir import Operation, SSAValue

from tpubuild.calib.calibrate import VECTOR_SIZE
from tpubuild.ir import mlir, top, tpu
from tpubuild.ir.base import TensorOp
from tpubuild.ir.quant import UniformType
from tpubuild.ir.types import shape_of
from tpubuild.ir.weights import ByIdentity
from tpubuild.kernels import get_kernel
from tpubuild.kernels.tpu import avgpool_counts
from tpubuild.lower.lowering import Lowering, int8_rule, is_float_type, retyped, tpu_params
from tpubuild.lower.quant import (
    QType,
    bias_safe_scales,
    channel_scales,
    multiplier_rshift,
    quantize_bias,
    quantize_per_channel,
    shared_rshift,
)

ACC_LIMIT = 2**31  # int32 accumulator
# A Concat whose inputs' ranges differ by more than this stays float, and so do the
# ops that pass its values on (PASS_ON): one 8-bit scale cannot hold both (a detection
# head's boxes in 0..320 next to scores in 0..0.005 would leave every score 0).
CONCAT_RANGE_RATIO = 64.0
# Ops whose result is a per-sample vector (pooled features and what reads them: squeeze-excite gates, a
# classifier head) stay float while together they do at most this share of the model's multiply-accumulates.
# One int8 scale per tensor serves a vector badly: its channels' means differ by orders of magnitude, and an
# input unlike the calibration set's (a dark photo) moves them all far below the calibrated maximum, where a
# few steps are left (a squeeze-excite pool at cosine 0.97 took a classifier's output to 0.52). Kept float
# they cost next to nothing; a model that is mostly vectors (an MLP) stays INT8.
VECTOR_MACS_SHARE = 0.05
NOT_COMPUTED = (top.WeightOp, top.InputOp, top.NoneOp)
# ops that sum over their inputs' channels with weights: what a TPU computes in INT8 for speed
MIXING = (top.ConvOp, top.DeconvOp, top.MatMulOp, top.EinsumOp, top.RnnOp)


def relu_bounds(qy: QType, p) -> tuple[int, int]:
    """The output clamp with a fused ReLU (do_relu / relu_limit) folded in."""
    lo, hi = qy.qmin, qy.qmax
    if getattr(p, "do_relu", False):
        lo = max(lo, qy.zero_point)
        if p.relu_limit >= 0:
            hi = min(hi, qy.stored(p.relu_limit))
    return lo, hi


def _requant(params, qy: QType, p, multipliers, rshifts, in_zps):
    lo, hi = relu_bounds(qy, p)
    return dataclasses.replace(
        params,
        multiplier=tuple(int(m) for m in multipliers),
        rshift=tuple(int(r) for r in rshifts),
        in_zp=tuple(int(z) for z in in_zps),
        out_zp=qy.zero_point,
        qmin=lo,
        qmax=hi,
    )


def _emit(lw: Lowering, op: TensorOp, operands, params, elem) -> list[SSAValue]:
    types = [retyped(t, elem) if is_float_type(t) else t for t in op.result_types]
    return list(lw.emit(tpu.MIRROR[type(op)], operands, params, op.names, types).results)


def _per_channel(values, axis: int, storage: str) -> UniformType:
    values = [float(v) for v in np.atleast_1d(values)]
    if len(values) == 1:
        return UniformType.get(storage, f32, values, [0])
    return UniformType.get(storage, f32, values, [0] * len(values), axis=axis)


# ---- weighted sums -------------------------------------------------------------------


@int8_rule(top.ConvOp)
def _(lw: Lowering, op: TensorOp):
    x, wv, bv = op.operands
    w = lw.weight_array(wv)
    bias = lw.bias_array(op, bv)
    if w is None or (bias is None and not isinstance(bv.type, NoneType)):
        return None  # a filter or bias computed at run time: float
    if math.prod(w.shape[1:]) * 255 * 128 >= ACC_LIMIT:
        return None
    xin, qx = lw.quant_value(x)
    qy = lw.out_qtype(op.loc_name)
    k = _weighted(w, bias, 0, 0, qx.scale, qy.scale)
    wq = lw.weight(mlir.value_name(wv), "i8", k.w, k.w_type)
    bq = lw.none() if k.b is None else lw.weight(mlir.value_name(bv), "i32", k.b, k.b_type)
    params = _requant(tpu_params(tpu.ConvOp, op.params), qy, op.params, k.mults, k.shifts, [qx.zero_point])
    return _emit(lw, op, [xin, wq, bq], params, qy.element())


@dataclasses.dataclass(frozen=True)
class Weighted:
    """What an INT8 Conv/MatMul makes of its constant filter and bias for its input and output scales."""

    w: np.ndarray
    w_type: UniformType
    b: np.ndarray | None
    b_type: UniformType | None
    mults: tuple[int, ...]
    shifts: tuple[int, ...]


# by the identity of the filter and bias arrays (each entry keeps them, so their ids stay theirs): the
# mixed-precision search lowers one module's weights dozens of times, and requantizing a 6625-channel
# classifier was a third of each lowering
_WEIGHTED: ByIdentity[Weighted] = ByIdentity(256)


def _weighted(
    w: np.ndarray, bias: np.ndarray | None, axis: int, bias_axis: int | None, in_scale: float, out_scale: float
) -> Weighted:
    """Per-channel int8 filter, int32 bias, their types and the requantization multipliers and shifts."""
    if bias is not None and bias_axis is None:
        raise ValueError("a bias needs its channel axis")

    def make() -> Weighted:
        s = bias_safe_scales(channel_scales(w, axis), bias, in_scale)
        acc_scale = in_scale * s
        mults, shifts = zip(*(multiplier_rshift(v / out_scale) for v in acc_scale), strict=True)
        return Weighted(
            quantize_per_channel(w, s, axis),
            _per_channel(s, axis, "i8"),
            None if bias is None else quantize_bias(bias, acc_scale),
            None if bias is None or bias_axis is None else _per_channel(acc_scale, bias_axis, "i32"),
            mults,
            shifts,
        )

    return _WEIGHTED.get((w, bias), (axis, bias_axis, in_scale, out_scale), make)


@int8_rule(top.MatMulOp)
def _(lw: Lowering, op: TensorOp):
    a, b, bv = op.operands
    w = lw.weight_array(b)
    bias = lw.bias_array(op, bv)
    if bias is None and not isinstance(bv.type, NoneType):
        return None
    if shape_of(a.type)[-1] * 255 * 255 >= ACC_LIMIT:
        return None
    ain, qa = lw.quant_value(a)
    if w is not None and w.ndim >= 2:  # per output channel (the last dim)
        qy = lw.out_qtype(op.loc_name)
        k = _weighted(w, bias, w.ndim - 1, None if bias is None else bias.ndim - 1, qa.scale, qy.scale)
        bin_ = lw.weight(mlir.value_name(b), "i8", k.w, k.w_type)
        bq = lw.none() if k.b is None else lw.weight(mlir.value_name(bv), "i32", k.b, k.b_type)
        params = _requant(tpu_params(tpu.MatMulOp, op.params), qy, op.params, k.mults, k.shifts, [qa.zero_point, 0])
        return _emit(lw, op, [ain, bin_, bq], params, qy.element())
    bin_, qb = lw.quant_value(b)
    s_b, zp_b = np.array([qb.scale]), qb.zero_point
    qy = lw.out_qtype(op.loc_name)
    acc_scale = qa.scale * s_b
    mults, shifts = zip(*(multiplier_rshift(s / qy.scale) for s in acc_scale), strict=True)
    bq = (
        lw.none()
        if bias is None
        else lw.weight(
            mlir.value_name(bv), "i32", quantize_bias(bias, acc_scale), _per_channel(acc_scale, bias.ndim - 1, "i32")
        )
    )
    params = _requant(tpu_params(tpu.MatMulOp, op.params), qy, op.params, mults, shifts, [qa.zero_point, zp_b])
    return _emit(lw, op, [ain, bin_, bq], params, qy.element())


# ---- elementwise and joins: each input requantized to the output's scale -------------------


@int8_rule(top.AddOp, top.SubOp)
def _(lw: Lowering, op: TensorOp):
    if lut_operand(lw, op) is not None:
        return lut(lw, op)
    ins = [lw.quant_value(v) for v in op.operands]
    qy = lw.out_qtype(op.loc_name)
    mults, r = shared_rshift([q.scale / qy.scale for _, q in ins])
    params = _requant(
        tpu_params(tpu.MIRROR[type(op)], op.params), qy, op.params, mults, [r], [q.zero_point for _, q in ins]
    )
    return _emit(lw, op, [v for v, _ in ins], params, qy.element())


@int8_rule(top.MulOp)
def _(lw: Lowering, op: TensorOp):
    if lut_operand(lw, op) is not None:
        return lut(lw, op)
    (a, qa), (b, qb) = (lw.quant_value(v) for v in op.operands)
    qy = lw.out_qtype(op.loc_name)
    m, r = multiplier_rshift(qa.scale * qb.scale / qy.scale)
    params = _requant(tpu_params(tpu.MulOp, op.params), qy, op.params, [m], [r], [qa.zero_point, qb.zero_point])
    return _emit(lw, op, [a, b], params, qy.element())


@int8_rule(top.ConcatOp)
def _(lw: Lowering, op: TensorOp):
    ins = [lw.quant_value(v) for v in op.operands]
    qy = lw.out_qtype(op.loc_name)
    mrs = [(1, 0) if q == qy else multiplier_rshift(q.scale / qy.scale) for _, q in ins]
    params = _requant(
        tpu_params(tpu.ConcatOp, op.params),
        qy,
        op.params,
        [m for m, _ in mrs],
        [r for _, r in mrs],
        [q.zero_point for _, q in ins],
    )
    return _emit(lw, op, [v for v, _ in ins], params, qy.element())


@int8_rule(top.AvgPoolOp)
def _(lw: Lowering, op: TensorOp):
    xin, qx = lw.quant_value(op.operands[0])
    qy = lw.out_qtype(op.loc_name)
    counts = avgpool_counts(op.params, shape_of(op.operands[0].type))
    mults, r = shared_rshift([qx.scale / (qy.scale * k) for k in counts])
    params = _requant(tpu_params(tpu.AvgPoolOp, op.params), qy, op.params, mults, [r], [qx.zero_point])
    return _emit(lw, op, [xin], dataclasses.replace(params, counts=tuple(counts)), qy.element())


@int8_rule(top.MaxPoolOp)
def _(lw: Lowering, op: TensorOp):
    xin, qx = lw.quant_value(op.operands[0])
    params = _requant(tpu_params(tpu.MaxPoolOp, op.params), qx, op.params, [], [], [qx.zero_point])
    return _emit(lw, op, [xin], params, qx.element())


# ---- data movement: the input's quantization passes through -------------------------------


def same_type(lw: Lowering, op: TensorOp, stored_params=None):
    """The op on stored values, its result in the data operand's quantization; ``stored_params(p, qx)``
    rewrites parameters given in real units."""
    data, *rest = op.operands
    if not is_float_type(data.type) or any(is_float_type(v.type) for v in rest):
        return None
    xin, qx = lw.quant_value(data)
    params = tpu_params(tpu.MIRROR[type(op)], op.params)
    if stored_params is not None:
        params = stored_params(params, qx)
    return _emit(lw, op, [xin, *[lw.raw_value(v) for v in rest]], params, qx.element())


@int8_rule(*top.MOVE_OPS)
def _(lw: Lowering, op: TensorOp):
    return same_type(lw, op)


@int8_rule(top.PadOp)
def _(lw: Lowering, op: TensorOp):
    return same_type(lw, op, lambda p, qx: dataclasses.replace(p, val=float(qx.stored(p.val))))


@int8_rule(top.InterpOp)
def _(lw: Lowering, op: TensorOp):
    # nearest copies values; linear and cubic make new ones, which stay float
    return same_type(lw, op) if op.params.mode == "nearest" else None


# ---- tables -------------------------------------------------------------------------------

UNARY = tuple(c for c in top.TOP_OPS if issubclass(c, top.UnaryOp)) + (
    top.ReluOp,
    top.SigmoidOp,
    top.TanhOp,
    top.ClipOp,
)


def _scalar_const_operands(lw: Lowering, op: TensorOp) -> int | None:
    """The index of the one tensor operand when every other operand is a one-element constant."""
    tensors = [i for i, v in enumerate(op.operands) if (a := lw.weight_array(v)) is None or a.size != 1]
    if len(tensors) != 1 or len(op.operands) < 2:
        return None
    x = op.operands[tensors[0]]
    return tensors[0] if shape_of(x.type) == shape_of(op.result_types[0]) else None


SCALAR_BINARY = (top.AddOp, top.SubOp, top.MulOp, top.DivOp, top.Pow3Op, top.MaxOp, top.MinOp)


def lut_operand(lw: Lowering, op: TensorOp) -> int | None:
    """Which operand a table over 256 stored values would index: the op is elementwise in that one
    tensor (a unary function, or a binary op with a scalar constant) from float to float; else None."""
    if len(op.results) != 1 or not is_float_type(op.result_types[0]):
        return None
    index = 0 if isinstance(op, UNARY) else _scalar_const_operands(lw, op) if isinstance(op, SCALAR_BINARY) else None
    return index if index is not None and is_float_type(op.operands[index].type) else None


def _lut_index(lw: Lowering, op: TensorOp) -> int:
    """lut_operand of an op known to be one a table computes."""
    index = lut_operand(lw, op)
    if index is None:
        raise ValueError(f"{op.name} at {op.loc_name!r} is not a table over one operand")
    return index


def lut(lw: Lowering, op: TensorOp):
    """y = f(x) as a table over the 256 stored values of x; f is the op's TOP kernel.

    A chain of such ops (a hardswish, then x * a + b, ...) is one table over the
    first op's input, computed in float: one rounding instead of one per op.
    """
    chain = [*lw.chains.get(op, []), op]
    head = chain[0]
    x = head.operands[_lut_index(lw, head)]
    xin, qx = lw.quant_value(x)
    qy = lw.out_qtype(op.loc_name)
    # the same chain between the same quantizations, in another lowering of this module: the same table
    key = (tuple((id(step), *map(id, step.attributes.values())) for step in chain), qx, qy)
    made = _TABLES.setdefault(op, {})
    if key not in made:
        values = qx.dequantize(np.arange(256, dtype=np.uint8).view(qx.dtype))  # entry i: the stored byte i
        with np.errstate(all="ignore"):
            for step in chain:
                i = lut_operand(lw, step)
                args = [values if j == i else lw.weight_array(v) for j, v in enumerate(step.operands)]
                values = np.asarray(get_kernel(type(step))(step.params, *args), np.float32).reshape(-1)
        made[key] = qy.quantize(values)
    tv = lw.weight(op.loc_name, "table", made[key], qy.element())
    return list(lw.emit(tpu.LutOp, [xin, tv], None, op.names, [retyped(op.result_types[0], qy.element())]).results)


# op -> its tables by chain and quantizations: the mixed-precision search lowers one module dozens of times (a
# table's ops stay alive with its op: they are its operands' producers)
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@int8_rule(*UNARY)
def _(lw: Lowering, op: TensorOp):
    return lut(lw, op) if lut_operand(lw, op) is not None else None


@int8_rule(top.DivOp, top.Pow3Op, top.MaxOp, top.MinOp)
def _(lw: Lowering, op: TensorOp):
    return None if lut_operand(lw, op) is None else lut(lw, op)


def lut_chains(lw: Lowering) -> dict[Operation, list[TensorOp]]:
    """op -> the table ops before it that it absorbs: each feeds only the next, which is a table op too."""
    users: dict[SSAValue, int] = {}
    for op in lw.ops:
        for v in op.operands:
            users[v] = users.get(v, 0) + 1
    for v in mlir.return_op(lw.module).operands:
        users[v] = users.get(v, 0) + 1  # a graph output is materialized

    def lut_able(op: object) -> TypeGuard[TensorOp]:
        return (
            isinstance(op, TensorOp)
            and lw.mode_of(op) == "INT8"
            and op not in lw.float_forced
            and lut_operand(lw, op) is not None
        )

    chains: dict[Operation, list[TensorOp]] = {}
    for op in lw.ops:
        if not lut_able(op):
            continue
        x = op.operands[_lut_index(lw, op)]
        producer = x.owner
        if lut_able(producer) and users.get(x) == 1:
            chains[op] = [*chains.pop(producer, []), producer]
    return chains


# ---- where INT8 must not go ------------------------------------------------------------


# The ops that pass a Concat's values on element by element, or move them: after a Concat of unlike ranges
# they stay float with it (float_region).
PASS_ON = (*top.MOVE_OPS, *UNARY, *SCALAR_BINARY, top.ConcatOp, top.PadOp, top.InterpOp, top.MaxPoolOp)


def _range(lw: Lowering, v: SSAValue) -> float:
    array = lw.weight_array(v)
    if array is not None:
        return float(np.max(np.abs(array))) if array.size else 0.0
    stats = lw.cali.get(mlir.value_name(v))
    return 0.0 if stats is None else max(stats.threshold, abs(stats.min), abs(stats.max))


def _ranges_differ(lw: Lowering, op: TensorOp) -> bool:
    ranges = [r for r in (_range(lw, v) for v in op.operands) if r > 0]
    return bool(ranges) and max(ranges) > CONCAT_RANGE_RATIO * min(ranges)


def macs(op: Operation) -> int:
    """An op's multiply-accumulates (convolutions and matmuls; 0 for the rest)."""
    if isinstance(op, top.ConvOp):
        return math.prod(shape_of(op.results[0].type)) * math.prod(shape_of(op.operands[1].type)[1:])
    if isinstance(op, top.MatMulOp):
        return math.prod(shape_of(op.results[0].type)) * shape_of(op.operands[0].type)[-1]
    return 0


def _is_vector(op: TensorOp) -> bool:
    """A result of at most VECTOR_SIZE values per sample, along one axis ([N, C], [N, C, 1, 1])."""
    if not op.results or not is_float_type(op.results[0].type):
        return False
    per_sample = shape_of(op.results[0].type)[1:]
    return 0 < math.prod(per_sample) <= VECTOR_SIZE and sum(d > 1 for d in per_sample) <= 1


def vector_region(lw: Lowering) -> set[Operation]:
    """The ops whose result is a per-sample vector, if together they are cheap (VECTOR_MACS_SHARE)."""
    vectors: set[Operation] = {op for op in lw.ops if not isinstance(op, NOT_COMPUTED) and _is_vector(op)}
    total = sum(macs(op) for op in lw.ops)
    return vectors if sum(macs(op) for op in vectors) <= VECTOR_MACS_SHARE * total else set()


def output_tail(lw: Lowering) -> set[Operation]:
    """The ops after the last conv or matmul on every way to a graph output: a classifier's softmax, a detector's
    score sigmoid and box decoding. In INT8 each of them quantizes the output once more, at a scale a step of
    which is a pixel of a box (mini_yolo: anchors -+ distances, their sum and difference, half, times the
    stride: five roundings after the last conv); they compute from the last conv's INT8 output in float instead.
    None of them is a conv or a matmul: they are a small share of the work. So is a per-sample vector (float
    anyway: vector_region) that only such ops read, a classifier's pooled features and fully connected head
    included (the head in the chip's float mode: Lowering.tail); the feature map before the pool stays INT8."""
    ret = mlir.return_op(lw.module)
    vectors = vector_region(lw)
    after: set[Operation] = set()  # after the last conv or matmul
    tail: set[Operation] = set()  # and the vectors only they read
    for op in reversed(lw.ops):
        if isinstance(op, NOT_COMPUTED) or not op.results:
            continue
        uses = [use.operation for r in op.results for use in r.uses]
        if not isinstance(op, MIXING) and all(u is ret or u in after for u in uses):
            after.add(op)
            tail.add(op)
        elif op in vectors and all(u is ret or u in tail for u in uses):
            tail.add(op)
    return tail


def float_region(lw: Lowering) -> set[Operation]:
    """Concats of inputs whose ranges differ by more than CONCAT_RANGE_RATIO, and the ops after them that
    pass their values on element by element (PASS_ON); Adds and Subs of such inputs, alone; per-sample
    vectors (vector_region). (The ops after the last conv or matmul stay float too: output_tail.)

    An INT8 op that passes values on would put the Concat's result back under one scale (a detection head's
    transposed output, a transformer's residual stream after Concat(class token, patches)); an op that mixes
    them (Conv, MatMul, LayerNorm, ...) computes from them at its input's threshold as it would anyway, and
    the search keeps it in float if INT8 there costs too much: a ViT keeps its residual Adds in float, not
    every matmul after the class token's Concat.

    An Add's output scale follows its larger input, so the smaller one would be
    rounded away: BERT's attention scores (about +-30) plus its padding mask
    (0 or -10000) would leave every score 0 and the softmax uniform. In float the
    sum is exact, and whatever reads it quantizes it at its own threshold (the
    softmax after a mask stays float anyway).
    """
    forced: set[Operation] = set()
    alone: set[Operation] = set()
    for op in lw.ops:
        starts = isinstance(op, top.ConcatOp) and _ranges_differ(lw, op)
        if starts or (isinstance(op, PASS_ON) and any(v.owner in forced for v in op.operands)):
            forced.add(op)
        elif isinstance(op, (top.AddOp, top.SubOp)) and lut_operand(lw, op) is None and _ranges_differ(lw, op):
            alone.add(op)  # (with a scalar constant it is a table, exact whatever the ranges)
    return forced | alone | vector_region(lw)
