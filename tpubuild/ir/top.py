"""The TOP dialect: framework-independent tensor ops in float32.

Op names follow TPU-MLIR's (``top.Conv``, ``top.MatMul``, ...). Each op is a
short class: its parameters (a frozen dataclass in ``PARAMS``), its operand
names and, where the result type is not the first operand's, its shape rule.
Kernels live in tpubuild/kernels, registered against these classes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from xdsl.dialects.builtin import NoneType, TensorType
from xdsl.ir import Attribute, Dialect
from xdsl.utils.exceptions import VerifyException

from tpubuild.ir.base import TensorOp, op_definition, with_shape
from tpubuild.ir.types import shape_of


class TopOp(TensorOp):
    """Base of TOP ops."""


def broadcast_shapes(*shapes: Sequence[int]) -> tuple[int, ...]:
    try:
        return tuple(np.broadcast_shapes(*[tuple(s) for s in shapes]))
    except ValueError:
        raise VerifyException(f"shapes {[tuple(s) for s in shapes]} do not broadcast") from None


def _norm_axis(axis: int, rank: int) -> int:
    if not -rank <= axis < max(rank, 1):
        raise VerifyException(f"axis {axis} out of range for rank {rank}")
    return axis % max(rank, 1)


# ---- graph plumbing -------------------------------------------------------

@op_definition
class InputOp(TopOp):
    """A graph input; its location is the input's name."""

    name = "top.Input"


@op_definition
class WeightOp(TopOp):
    """A constant tensor stored in the module's weight file under its location name."""

    name = "top.Weight"
    OPERANDS = ()


@op_definition
class NoneOp(TopOp):
    """The value of an absent optional operand."""

    name = "top.None"
    OPERANDS = ()

    @classmethod
    def infer(cls, p, in_types):
        return [NoneType()]


@op_definition
class IdentityOp(TopOp):
    """ONNX Identity, and Dropout at inference; removed by canonicalize."""

    name = "top.Identity"


# ---- compute --------------------------------------------------------------

@dataclass(frozen=True)
class ReluParams:
    do_relu: bool = False
    relu_limit: float = -1.0  # < 0: no upper bound (ReLU); else ReLU-N, as TPU-MLIR


@dataclass(frozen=True)
class ConvParams:
    kernel_shape: tuple[int, ...]
    strides: tuple[int, ...]
    pads: tuple[int, ...]  # ONNX order: begins of each spatial dim, then ends
    dilations: tuple[int, ...]
    group: int = 1
    do_relu: bool = False
    relu_limit: float = -1.0


def pooled_size(size: int, k: int, stride: int, pad_begin: int, pad_end: int, dilation: int = 1,
                ceil_mode: bool = False) -> int:
    span = size + pad_begin + pad_end - dilation * (k - 1) - 1
    out = (math.ceil(span / stride) if ceil_mode else span // stride) + 1
    if ceil_mode and (out - 1) * stride >= size + pad_begin:
        out -= 1  # ONNX: the last window must start inside the input or its begin padding
    if out < 1:
        raise VerifyException(f"window {k} (dilation {dilation}, pads {pad_begin},{pad_end}) "
                              f"does not fit input size {size}")
    return out


def _spatial_out(in_shape, kernel, strides, pads, dilations, ceil_mode=False) -> list[int]:
    nd = len(kernel)
    spatial = in_shape[-nd:]
    return [pooled_size(spatial[i], kernel[i], strides[i], pads[i], pads[i + nd], dilations[i], ceil_mode)
            for i in range(nd)]


@op_definition
class ConvOp(TopOp):
    """N-d convolution; filter [OC, IC/group, *kernel], optional bias [OC], optional fused ReLU."""

    name = "top.Conv"
    PARAMS = ConvParams
    OPERANDS = ("input", "filter", "bias")

    @classmethod
    def infer(cls, p: ConvParams, in_types):
        x, w = shape_of(in_types[0]), shape_of(in_types[1])
        if len(x) != len(p.kernel_shape) + 2 or len(w) != len(x):
            raise VerifyException(f"conv input {x} / filter {w} do not match kernel {p.kernel_shape}")
        if x[1] != w[1] * p.group:
            raise VerifyException(f"conv input channels {x[1]} != filter {w[1]} x group {p.group}")
        out = _spatial_out(x, p.kernel_shape, p.strides, p.pads, p.dilations)
        return [with_shape(in_types[0], [x[0], w[0], *out])]


@op_definition
class MatMulOp(TopOp):
    """numpy-style matmul with batch broadcast, optional bias on the last dim and fused ReLU."""

    name = "top.MatMul"
    PARAMS = ReluParams
    OPERANDS = ("input", "right", "bias")

    @classmethod
    def infer(cls, p, in_types):
        a, b = shape_of(in_types[0]), shape_of(in_types[1])
        a2 = (1,) + a if len(a) == 1 else a
        b2 = b + (1,) if len(b) == 1 else b
        if a2[-1] != b2[-2]:
            raise VerifyException(f"matmul inner dims differ: {a} x {b}")
        batch = broadcast_shapes(a2[:-2], b2[:-2])
        out = list(batch) + [a2[-2], b2[-1]]
        if len(a) == 1:
            out.pop(-2)
        if len(b) == 1:
            out.pop(-1)
        return [with_shape(in_types[0], out)]


class BinaryOp(TopOp):
    """Elementwise with numpy broadcasting."""

    OPERANDS = ("lhs", "rhs")

    @classmethod
    def infer(cls, p, in_types):
        return [with_shape(in_types[0], broadcast_shapes(*[shape_of(t) for t in in_types]))]


@op_definition
class AddOp(BinaryOp):
    name = "top.Add"
    PARAMS = ReluParams


@op_definition
class SubOp(BinaryOp):
    name = "top.Sub"


@op_definition
class MulOp(BinaryOp):
    name = "top.Mul"
    PARAMS = ReluParams


@op_definition
class DivOp(BinaryOp):
    name = "top.Div"


@dataclass(frozen=True)
class LimitParams:
    relu_limit: float = -1.0


@op_definition
class ReluOp(TopOp):
    name = "top.Relu"
    PARAMS = LimitParams


@op_definition
class SigmoidOp(TopOp):
    name = "top.Sigmoid"


@op_definition
class TanhOp(TopOp):
    name = "top.Tanh"


@dataclass(frozen=True)
class ClipParams:
    min: float = -math.inf
    max: float = math.inf


@op_definition
class ClipOp(TopOp):
    name = "top.Clip"
    PARAMS = ClipParams


@dataclass(frozen=True)
class AxisParams:
    axis: int = -1


@dataclass(frozen=True)
class SoftmaxParams:
    axis: int = -1
    beta: float = 1.0  # softmax(beta * x), as TPU-MLIR's: canonicalize folds a preceding scale in


@op_definition
class SoftmaxOp(TopOp):
    name = "top.Softmax"
    PARAMS = SoftmaxParams


@dataclass(frozen=True)
class LayerNormParams:
    axis: int = -1
    eps: float = 1e-5


@op_definition
class LayerNormOp(TopOp):
    """Normalise over dims axis..end; scale/bias broadcast over those dims."""

    name = "top.LayerNorm"
    PARAMS = LayerNormParams
    OPERANDS = ("input", "scale", "bias")


@dataclass(frozen=True)
class EpsParams:
    eps: float = 1e-5


@op_definition
class BatchNormOp(TopOp):
    """Inference batch norm over channel dim 1; folded into Conv by canonicalize."""

    name = "top.BatchNorm"
    PARAMS = EpsParams
    OPERANDS = ("input", "mean", "variance", "scale", "bias")


@dataclass(frozen=True)
class PoolParams:
    kernel_shape: tuple[int, ...]
    strides: tuple[int, ...]
    pads: tuple[int, ...]
    dilations: tuple[int, ...] = ()
    ceil_mode: bool = False
    count_include_pad: bool = False
    do_relu: bool = False
    relu_limit: float = -1.0


class PoolOp(TopOp):
    PARAMS = PoolParams

    @classmethod
    def infer(cls, p: PoolParams, in_types):
        x = shape_of(in_types[0])
        nd = len(p.kernel_shape)
        dil = p.dilations or (1,) * nd
        out = _spatial_out(x, p.kernel_shape, p.strides, p.pads, dil, p.ceil_mode)
        return [with_shape(in_types[0], [*x[:-nd], *out])]


@op_definition
class MaxPoolOp(PoolOp):
    name = "top.MaxPool"


@op_definition
class AvgPoolOp(PoolOp):
    name = "top.AvgPool"


@op_definition
class ConcatOp(TopOp):
    name = "top.Concat"
    PARAMS = AxisParams
    OPERANDS = ("inputs*",)

    @classmethod
    def infer(cls, p: AxisParams, in_types):
        shapes = [shape_of(t) for t in in_types]
        axis = _norm_axis(p.axis, len(shapes[0]))
        for s in shapes[1:]:
            if len(s) != len(shapes[0]) or any(a != b for i, (a, b) in enumerate(zip(s, shapes[0])) if i != axis):
                raise VerifyException(f"concat on axis {axis} of mismatched shapes {shapes}")
        out = list(shapes[0])
        out[axis] = sum(s[axis] for s in shapes)
        return [with_shape(in_types[0], out)]


@dataclass(frozen=True)
class ShapeParams:
    shape: tuple[int, ...]


@op_definition
class ReshapeOp(TopOp):
    """Reshape to a static shape (the frontend resolves 0 and -1)."""

    name = "top.Reshape"
    PARAMS = ShapeParams

    @classmethod
    def infer(cls, p: ShapeParams, in_types):
        if math.prod(shape_of(in_types[0])) != math.prod(p.shape):
            raise VerifyException(f"reshape {shape_of(in_types[0])} -> {p.shape} changes the element count")
        return [with_shape(in_types[0], p.shape)]


@dataclass(frozen=True)
class PermuteParams:
    order: tuple[int, ...]


@op_definition
class PermuteOp(TopOp):
    """Transpose by a permutation of all dims."""

    name = "top.Permute"
    PARAMS = PermuteParams

    @classmethod
    def infer(cls, p: PermuteParams, in_types):
        x = shape_of(in_types[0])
        if sorted(p.order) != list(range(len(x))):
            raise VerifyException(f"order {p.order} is not a permutation of {len(x)} dims")
        return [with_shape(in_types[0], [x[i] for i in p.order])]


TOP_OPS: list[type[TopOp]] = [v for v in list(globals().values())
                               if isinstance(v, type) and issubclass(v, TopOp) and "name" in v.__dict__]

Top = Dialect("top", TOP_OPS, [])


def is_tensor(t: Attribute) -> bool:
    return isinstance(t, TensorType)
