"""The TPU dialect: ops as the chip runs them, after lowering to a mode.

Every TOP compute op has a TPU counterpart of the same name (``top.Conv`` ->
``tpu.Conv``) with the TOP op's parameters, operands and shape rule; what
differs is the element types (f32, bf16, f16, or ``!quant.uniform`` storage).
``top.Input``, ``top.Weight`` and ``top.None`` stay as they are, as in
TPU-MLIR's tpu.mlir.

Ops with INT8 arithmetic (Conv, MatMul, Add, Sub, Mul, Concat, AvgPool,
MaxPool) add the requantization fields of ``Requant``. A kernel runs its
integer path when its data operands are integers; its parameters then hold
everything the arithmetic needs (multipliers, shifts, zero points, clamp
bounds, all in stored units), so the simulator can run the same kernels
without MLIR types. The result types carry the same scales for readers.

Extra ops: ``tpu.Cast`` (quantize, dequantize, float <-> float) and
``tpu.Lut`` (a 256-entry table lookup: any unary function of an 8-bit tensor).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from xdsl.dialects.builtin import TensorType
from xdsl.ir import Dialect

from tpubuild.ir import top
from tpubuild.ir.base import TensorOp, op_definition
from tpubuild.ir.types import elem_of, shape_of


class TpuOp(TensorOp):
    """Base of TPU ops."""


@dataclass(frozen=True)
class Requant:
    """INT8 arithmetic of a quantized op (ignored when its operands are float).

    ``y = clamp(RSR(acc * multiplier, rshift) + out_zp, qmin, qmax)`` where RSR
    is a right shift rounding half away from zero, acc the op's int32 sum of
    ``(x - in_zp)`` terms, and [qmin, qmax] the result storage range narrowed by
    any fused ReLU. What ``multiplier``/``rshift`` index is per op: output
    channel (Conv, MatMul), input (Add, Sub, Concat), window count (AvgPool,
    with ``counts``), one value (Mul); MaxPool only clamps.
    """

    multiplier: tuple[int, ...] = ()
    rshift: tuple[int, ...] = ()
    in_zp: tuple[int, ...] = ()  # one per data operand
    out_zp: int = 0
    qmin: int = -128
    qmax: int = 127
    counts: tuple[int, ...] = ()  # AvgPool: the window sizes ``multiplier`` is for
    round_mode: str = "HalfAwayFromZero"


def _with_requant(params: type) -> type:
    """The TOP parameter dataclass extended by Requant's fields (appended: they all have defaults)."""
    fields = [(f.name, f.type, f) for f in dataclasses.fields(Requant)]
    return dataclasses.make_dataclass(
        params.__name__,
        [(n, t, dataclasses.field(default=f.default)) for n, t, f in fields],
        bases=(params,),
        frozen=True,
        namespace={"__module__": __name__},
    )


def _mirror(top_cls: type[top.TopOp], params: type | None = None) -> type[TpuOp]:
    """A TPU op with the TOP op's name, parameters (or ``params``), operands and shape rule."""
    name = "tpu." + top_cls.name.split(".", 1)[1]
    namespace = {
        "name": name,
        "PARAMS": params or top_cls.PARAMS,
        "OPERANDS": top_cls.OPERANDS,
        "NUM_RESULTS": top_cls.NUM_RESULTS,
        "infer": classmethod(top_cls.infer.__func__),
        "__doc__": f"{name}: lowered {top_cls.name}.",
        "__module__": __name__,
    }
    return op_definition(type(top_cls.__name__, (TpuOp,), namespace))


# TOP ops with an INT8 path: their parameters gain the Requant fields
QUANTIZED = (top.ConvOp, top.MatMulOp, top.AddOp, top.SubOp, top.MulOp, top.ConcatOp, top.AvgPoolOp, top.MaxPoolOp)
_GRAPH = (top.InputOp, top.WeightOp, top.NoneOp)  # shared with TOP, not mirrored
# top.Cast (ONNX Cast) lowers to tpu.Cast rounding towards zero, as C casts do
_NOT_MIRRORED = (*_GRAPH, top.CastOp)

# TOP op class -> its TPU op class
MIRROR: dict[type, type[TpuOp]] = {
    cls: _mirror(cls, _with_requant(cls.PARAMS) if cls in QUANTIZED else None)
    for cls in top.TOP_OPS
    if cls not in _NOT_MIRRORED
}

ConvOp = MIRROR[top.ConvOp]
MatMulOp = MIRROR[top.MatMulOp]
AddOp = MIRROR[top.AddOp]
SubOp = MIRROR[top.SubOp]
MulOp = MIRROR[top.MulOp]
ConcatOp = MIRROR[top.ConcatOp]
AvgPoolOp = MIRROR[top.AvgPoolOp]
MaxPoolOp = MIRROR[top.MaxPoolOp]
ReluOp = MIRROR[top.ReluOp]
ReshapeOp = MIRROR[top.ReshapeOp]
PermuteOp = MIRROR[top.PermuteOp]
SoftmaxOp = MIRROR[top.SoftmaxOp]
LayerNormOp = MIRROR[top.LayerNormOp]


@dataclass(frozen=True)
class CastParams:
    """What a cast does; ``to`` names the result storage (a numpy dtype name).

    Quantize (float -> int8/uint8): ``clamp(round(f32(x) * f32(1/scale)) + zero_point)``
    in float32, rounding by ``round_mode`` (HalfAwayFromZero, HalfToEven: a QDQ model's own grid, or
    TowardsZero),
    saturating. Dequantize (an int8/uint8 input, float result):
    ``f32(x - zero_point) * f32(scale)``. Anything else converts as ONNX Cast
    does (float -> float rounds to nearest even; float -> wider int truncates;
    a float8_e8m0fnu result rounds by ``round_mode``: up, down or nearest).
    ``to`` empty: a float result the interpreter rounds to its type. ONNX Cast
    lowers here with scale 1, zero point 0 and TowardsZero (C's cast).
    """

    to: str = ""
    scale: float = 1.0
    zero_point: int = 0
    round_mode: str = "HalfAwayFromZero"
    saturate: bool = True  # float8 results only: out-of-range values clamp to the largest finite one


# (an older name of CastParams, for files written before ``to``/``scale`` existed)
RoundParams = CastParams


@op_definition
class CastOp(TpuOp):
    """Change element type: quantize (float -> !quant.uniform), dequantize, or float <-> float."""

    name = "tpu.Cast"
    PARAMS = CastParams


@op_definition
class LutOp(TpuOp):
    """y = table[byte value of x]: a 256-entry table for an 8-bit input, the result in the table's type."""

    name = "tpu.Lut"
    OPERANDS = ("input", "table")

    @classmethod
    def infer(cls, p, in_types):
        return [TensorType(elem_of(in_types[1]), list(shape_of(in_types[0])))]


TPU_OPS = [*MIRROR.values(), CastOp, LutOp]

Tpu = Dialect("tpu", TPU_OPS, [])
