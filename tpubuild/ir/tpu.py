"""The TPU dialect: ops as the chip runs them, after lowering to a mode.

A TPU op reuses its TOP counterpart's parameters and shape rule; what differs
is the element types (f32, bf16, f16, or !quant.uniform storage) and, for
INT8, the requantization parameters the lowering adds. ``tpu.Cast`` moves a
tensor between types (quantize, dequantize, float casts).
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.ir import Dialect

from tpubuild.ir import top
from tpubuild.ir.base import TensorOp, op_definition


class TpuOp(TensorOp):
    """Base of TPU ops."""


def _mirror(top_cls: type[top.TopOp], name: str) -> type[TpuOp]:
    """A TPU op with the TOP op's parameters, operands and shape rule."""
    cls = type(top_cls.__name__, (TpuOp,), {
        "name": name, "PARAMS": top_cls.PARAMS, "OPERANDS": top_cls.OPERANDS,
        "infer": top_cls.__dict__.get("infer", TensorOp.__dict__["infer"]),
        "__doc__": f"{name}: lowered {top_cls.name}.",
        "__module__": __name__,
    })
    return op_definition(cls)


ConvOp = _mirror(top.ConvOp, "tpu.Conv")
MatMulOp = _mirror(top.MatMulOp, "tpu.MatMul")
AddOp = _mirror(top.AddOp, "tpu.Add")
SubOp = _mirror(top.SubOp, "tpu.Sub")
MulOp = _mirror(top.MulOp, "tpu.Mul")
ReluOp = _mirror(top.ReluOp, "tpu.Relu")
MaxPoolOp = _mirror(top.MaxPoolOp, "tpu.MaxPool")
AvgPoolOp = _mirror(top.AvgPoolOp, "tpu.AvgPool")
ConcatOp = _mirror(top.ConcatOp, "tpu.Concat")
ReshapeOp = _mirror(top.ReshapeOp, "tpu.Reshape")
PermuteOp = _mirror(top.PermuteOp, "tpu.Permute")
SoftmaxOp = _mirror(top.SoftmaxOp, "tpu.Softmax")
LayerNormOp = _mirror(top.LayerNormOp, "tpu.LayerNorm")


@dataclass(frozen=True)
class RoundParams:
    round_mode: str = "HalfAwayFromZero"


@op_definition
class CastOp(TpuOp):
    """Change element type: quantize (float -> !quant.uniform), dequantize, or float <-> float."""

    name = "tpu.Cast"
    PARAMS = RoundParams


TPU_OPS = [ConvOp, MatMulOp, AddOp, SubOp, MulOp, ReluOp, MaxPoolOp, AvgPoolOp, ConcatOp, ReshapeOp, PermuteOp,
           SoftmaxOp, LayerNormOp, CastOp]

Tpu = Dialect("tpu", TPU_OPS, [])
