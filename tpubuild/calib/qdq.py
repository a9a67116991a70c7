"""The quantization a QDQ model carries: calibration entries from its QuantizeLinear scales.

The frontend writes an activation's QuantizeLinear as float arithmetic (tpubuild/frontend/ops/quantize.py):
``Div`` by the scale, ``Round``, ``Add`` of the zero point, ``Clip`` to the integer type's range and a ``Cast``;
its DequantizeLinear as a ``Cast`` back, ``Sub`` of the zero point and ``Mul`` by the scale (which canonicalize
may fold into the conv that reads it). The pair fixes a grid: the stored integers q in [qmin, qmax] stand for
scale * (q - zero_point).

Each float tensor of the pattern gets the entry of that grid: the tensor quantized and the dequantized one the
real values' (step: the scale), the values in between the integers' (step 1). Where the grid is one that INT8
has (int8 with zero point 0, uint8 with zero point 0, or 128: a signed grid), an INT8 target then stores
exactly the integers onnxruntime's QDQ model computes, and the pattern's ops become tables that map each
stored byte to itself. Thresholds of statistics instead quantize the model's already quantized values a second
time, on a grid of their own: MTCNN's O-Net quantized by onnxruntime (QDQ, int8, per-channel weights) was at
cosine 0.988 against its own float reference on bm1684x INT8 that way. A grid with another zero point has no
such match; it gets the symmetric threshold that holds its whole range.

Activations quantized per channel (a scale per channel) are left to statistics, as is every tensor the
pattern does not name.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeVar

import numpy as np
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import SSAValue

from tpubuild.calib.table import Entry
from tpubuild.ir import mlir, top
from tpubuild.ir.base import TensorOp
from tpubuild.ir.weights import WeightStore

T = TypeVar("T", bound=TensorOp)

INTEGER_TYPES = {"int8": (-128, 127), "uint8": (0, 255)}
# ops whose result holds some of their first operand's values, unchanged
KEEP_VALUES = (*top.MOVE_OPS, top.MaxPoolOp)


def _scalar(weights: WeightStore, value: SSAValue) -> float | None:
    """A scalar constant operand's value (one element), else None."""
    if not isinstance(value.owner, top.WeightOp):
        return None
    array = np.asarray(weights[value.owner.loc_name])
    return float(array.reshape(-1)[0]) if array.size == 1 else None


def _producer(value: SSAValue, cls: type[T]) -> T | None:
    owner = value.owner
    return owner if isinstance(owner, cls) else None


def _only_user(value: SSAValue, cls: type[T]) -> T | None:
    users = [use.operation for use in value.uses]
    return users[0] if len(users) == 1 and isinstance(users[0], cls) else None


def _entry(lo: float, hi: float, step: float) -> Entry | None:
    """The entry of values on a grid of ``step`` between ``lo`` and ``hi`` (multiples of ``step``): INT8's own
    grid of that step where it holds the range (uint8: 255 steps from 0, int8: -128 to 127 steps), else None."""
    a, b = round(lo / step), round(hi / step)
    if a >= 0 and b <= 255:
        return Entry(255 * step, lo, hi)
    if a >= -128 and b <= 127:
        return Entry(127 * step, lo, hi)
    return None


def _quantize_linear(cast: top.CastOp, weights: WeightStore) -> Iterator[tuple[SSAValue | str, Entry]]:
    """The entries of one QuantizeLinear (``cast``: its last op) and of the DequantizeLinear that reads it: the
    tensor quantized first, as a value, then the others by name."""
    qmin, qmax = INTEGER_TYPES[cast.params.to]
    clip = _producer(cast.operands[0], top.ClipOp)
    if clip is None or (clip.params.min, clip.params.max) != (qmin, qmax):
        return
    shifted = _producer(clip.operands[0], top.AddOp)
    zero = _scalar(weights, shifted.operands[1]) if shifted is not None else 0.0
    rounded = _producer(shifted.operands[0] if shifted is not None else clip.operands[0], top.RoundOp)
    scaled = _producer(rounded.operands[0], top.DivOp) if rounded is not None else None
    scale = _scalar(weights, scaled.operands[1]) if scaled is not None else None
    if zero is None or scale is None or not scale > 0 or rounded is None or scaled is None:
        return
    real = _entry(scale * (qmin - zero), scale * (qmax - zero), scale)
    centered = _entry(qmin - zero, qmax - zero, 1.0)
    stored = _entry(qmin, qmax, 1.0)
    if real is None or centered is None or stored is None:
        return  # no INT8 grid holds it: statistics do better than a coarser grid over its whole range
    yield scaled.operands[0], real
    yield scaled.names[0], centered
    yield rounded.names[0], centered
    if shifted is not None:
        yield shifted.names[0], stored
    yield clip.names[0], stored
    # the DequantizeLinear: a cast back, then (each where the model has it) the zero point off and the scale on
    back = _only_user(cast.results[0], top.CastOp)
    if back is None or back.params.to != "float32":
        return
    yield back.names[0], stored
    value = back.results[0]
    sub = _only_user(value, top.SubOp)
    if sub is not None and sub.operands[0] is value and _scalar(weights, sub.operands[1]) == zero:
        yield sub.names[0], centered
        value = sub.results[0]
    elif zero != 0:
        return
    mul = _only_user(value, top.MulOp)
    if mul is not None and mul.operands[0] is value and _scalar(weights, mul.operands[1]) == scale:
        yield mul.names[0], real


def _passed_back(value: SSAValue) -> Iterator[SSAValue]:
    """The tensors whose values reach ``value`` unchanged through ops that only pick or move them (``KEEP_VALUES``),
    each read by nothing else."""
    while isinstance(value.owner, KEEP_VALUES) and len(value.owner.results) == 1:
        source = value.owner.operands[0]
        if len(list(source.uses)) != 1 or isinstance(source.owner, top.WeightOp):
            return
        yield source
        value = source


def qdq_entries(module: ModuleOp, weights: WeightStore) -> dict[str, Entry]:
    """Per float tensor of a QuantizeLinear/DequantizeLinear pattern, the entry of the model's grid; and that of
    a quantized tensor for those whose values reach it unchanged (the model computes them in float, as
    onnxruntime's quantizer leaves a PRelu before a MaxPool and its QuantizeLinear: on the grid already, they
    reach it without a second rounding)."""
    found: dict[str, Entry] = {}
    quantized: list[tuple[SSAValue, Entry]] = []
    for op in mlir.body_ops(module):
        if isinstance(op, top.CastOp) and op.params.to in INTEGER_TYPES:
            for key, entry in _quantize_linear(op, weights):
                if isinstance(key, SSAValue):
                    quantized.append((key, entry))
                    key = mlir.value_name(key)
                found[key] = entry
    for value, entry in quantized:
        for source in _passed_back(value):
            found.setdefault(mlir.value_name(source), entry)
    return found
