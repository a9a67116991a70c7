"""The quantization a QDQ model carries: the grids of its QuantizeLinear nodes, for calibration and lowering.

The frontend writes an activation's QuantizeLinear as float arithmetic (tpubuild/frontend/ops/quantize.py):
``Div`` by the scale, ``Round``, ``Add`` of the zero point, ``Clip`` to the integer type's range and a ``Cast``;
its DequantizeLinear as a ``Cast`` back, ``Sub`` of the zero point and ``Mul`` by the scale (which canonicalize
may fold into the conv that reads it). The pair fixes a grid: the stored integers q in [qmin, qmax] stand for
scale * (q - zero_point).

Each float tensor of the pattern is on a grid of its own: the tensor quantized and the dequantized one on the
real values' (step: the scale), the values in between on the integers' (step 1); so is a tensor whose values
reach a QuantizeLinear unchanged (through a MaxPool or ops that move values) and that nothing else reads. Where
the grid is one that symmetric INT8 has (int8 with zero point 0, uint8 with zero point 0; int8 with -128 and
uint8 with 128 are those two shifted), calibration takes it as the tensor's entry (``qdq_entries``); the others
only an int8 grid with a zero point holds, which no entry can say, and lowering stores those tensors on them
(``Lowering.grids``). Either way an INT8 target stores the integers onnxruntime's QDQ model computes (casts onto
a grid round half to even, as QuantizeLinear does), and the pattern's ops become tables that map each stored
byte to itself. Thresholds of statistics instead quantize the model's already quantized values a second time,
on grids of their own, and the mixed-precision search then keeps in float what it must to make up for it:
facenet-pytorch's MTCNN O-Net quantized by onnxruntime, its bm1684x INT8 target kept 97.7% of the
multiply-accumulates in float that way.

Activations quantized per channel (a scale per channel) are left to statistics, as is every tensor the
pattern does not name.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import SSAValue

from tpubuild.calib.table import Entry
from tpubuild.ir import mlir, top
from tpubuild.ir.base import TensorOp
from tpubuild.ir.weights import WeightStore
from tpubuild.top.patterns.common import producer, single_user, weight_array

T = TypeVar("T", bound=TensorOp)

INTEGER_TYPES = {"int8": (-128, 127), "uint8": (0, 255)}
# ops whose result holds some of their first operand's values, unchanged
KEEP_VALUES = (*top.MOVE_OPS, top.MaxPoolOp)


def _scalar(weights: WeightStore, value: SSAValue) -> float | None:
    """A scalar constant operand's value (one element), else None."""
    array = weight_array(value, weights)
    return float(np.asarray(array).reshape(-1)[0]) if array is not None and array.size == 1 else None


def _readers(value: SSAValue, cls: type[T]) -> list[T]:
    """The ``cls`` ops that read ``value`` as their first operand."""
    return [use.operation for use in value.uses if isinstance(use.operation, cls) and use.index == 0]


@dataclass(frozen=True)
class Grid:
    """Values ``step * k`` for the integers k from ``lo`` to ``hi``."""

    step: float
    lo: int
    hi: int

    def entry(self) -> Entry | None:
        """Its calibration entry, where a symmetric INT8 grid of the same step holds it (uint8: 0 to 255 steps,
        int8: -128 to 127), else None."""
        lo, hi = self.lo * self.step, self.hi * self.step
        if self.lo >= 0 and self.hi <= 255:
            return Entry(255 * self.step, lo, hi)
        if self.lo >= -128 and self.hi <= 127:
            return Entry(127 * self.step, lo, hi)
        return None


def _quantize_linear(cast: top.CastOp, weights: WeightStore) -> Iterator[tuple[SSAValue | str, Grid]]:
    """The grids of one QuantizeLinear (``cast``: its last op) and of the DequantizeLinear that reads it: the
    tensor quantized first, as a value, then the others by name."""
    qmin, qmax = INTEGER_TYPES[cast.params.to]
    clip = producer(cast.operands[0], top.ClipOp)
    if clip is not None and (clip.params.min, clip.params.max) == (qmin, qmax):
        shifted = producer(clip.operands[0], top.AddOp)
        unshifted = clip.operands[0] if shifted is None else shifted.operands[0]
    else:
        # uint8: canonicalize fuses the zero point's Add and the [0, 255] Clip into an Add with a ReLU-255
        shifted, clip = producer(cast.operands[0], top.AddOp), None
        if shifted is None or qmin != 0 or (shifted.params.do_relu, shifted.params.relu_limit) != (True, qmax):
            return
        unshifted = shifted.operands[0]
    zero = _scalar(weights, shifted.operands[1]) if shifted is not None else 0.0
    rounded = producer(unshifted, top.RoundOp)
    scaled = producer(rounded.operands[0], top.DivOp) if rounded is not None else None
    scale = _scalar(weights, scaled.operands[1]) if scaled is not None else None
    if zero is None or zero != round(zero) or scale is None or not scale > 0 or rounded is None or scaled is None:
        return
    zp = round(zero)
    real, centered, stored = Grid(scale, qmin - zp, qmax - zp), Grid(1.0, qmin - zp, qmax - zp), Grid(1.0, qmin, qmax)
    yield scaled.operands[0], real
    yield scaled.names[0], centered
    yield rounded.names[0], centered
    if shifted is not None:
        yield shifted.names[0], stored
    if clip is not None:
        yield clip.names[0], stored
    # the DequantizeLinear: a cast back, then (each where the model has it) the zero point off and the scale on
    back = single_user(cast.results[0])
    if not isinstance(back, top.CastOp) or back.params.to != "float32":
        return
    yield back.names[0], stored
    # (a conv that reads the centered values may have the scale folded into its weights: the Mul that
    # remains, for the other readers, is one of several users)
    centered_values = [back.results[0]] if zero == 0 else []
    for sub in _readers(back.results[0], top.SubOp):
        if _scalar(weights, sub.operands[1]) == zero:
            yield sub.names[0], centered
            centered_values.append(sub.results[0])
    for value in centered_values:
        for mul in _readers(value, top.MulOp):
            if _scalar(weights, mul.operands[1]) == scale:
                yield mul.names[0], real


def _passed_back(value: SSAValue) -> Iterator[SSAValue]:
    """The tensors whose values reach ``value`` unchanged through ops that only pick or move them (``KEEP_VALUES``),
    each read by nothing else."""
    while isinstance(value.owner, KEEP_VALUES) and len(value.owner.results) == 1:
        source = value.owner.operands[0]
        if single_user(source) is None or isinstance(source.owner, top.WeightOp):
            return
        yield source
        value = source


def model_grids(module: ModuleOp, weights: WeightStore) -> dict[str, Grid]:
    """Per float tensor of a QuantizeLinear/DequantizeLinear pattern, the model's grid; and a quantized tensor's
    for the tensors whose values reach it unchanged (the model computes them in float, as onnxruntime's quantizer
    leaves a PRelu before a MaxPool and its QuantizeLinear: on the grid already, they reach it without a second
    rounding)."""
    found: dict[str, Grid] = {}
    quantized: list[tuple[SSAValue, Grid]] = []
    for op in mlir.body_ops(module):
        if isinstance(op, top.CastOp) and op.params.to in INTEGER_TYPES:
            for key, grid in _quantize_linear(op, weights):
                if isinstance(key, SSAValue):
                    quantized.append((key, grid))
                    key = mlir.value_name(key)
                found[key] = grid
    for value, grid in quantized:
        for source in _passed_back(value):
            found.setdefault(mlir.value_name(source), grid)
    return found


def qdq_entries(module: ModuleOp, weights: WeightStore) -> dict[str, Entry]:
    """The calibration entries of the model's grids that a symmetric INT8 grid holds (lowering stores the others
    on their grids, with a zero point)."""
    return {name: entry for name, grid in model_grids(module, weights).items() if (entry := grid.entry()) is not None}
