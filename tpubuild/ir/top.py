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
from xdsl.dialects.builtin import NoneType, TensorType, i64
from xdsl.ir import Attribute, Dialect, Operation
from xdsl.utils.exceptions import VerifyException

from tpubuild.ir.base import TensorOp, op_definition, with_shape
from tpubuild.ir.types import dtype_from_name, shape_of, tensor_type


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


def pooled_size(
    size: int, k: int, stride: int, pad_begin: int, pad_end: int, dilation: int = 1, ceil_mode: bool = False
) -> int:
    span = size + pad_begin + pad_end - dilation * (k - 1) - 1
    out = (math.ceil(span / stride) if ceil_mode else span // stride) + 1
    if ceil_mode and (out - 1) * stride >= size + pad_begin:
        out -= 1  # ONNX: the last window must start inside the input or its begin padding
    if out < 1:
        raise VerifyException(
            f"window {k} (dilation {dilation}, pads {pad_begin},{pad_end}) does not fit input size {size}"
        )
    return out


def _spatial_out(in_shape, kernel, strides, pads, dilations, ceil_mode=False) -> list[int]:
    nd = len(kernel)
    spatial = in_shape[-nd:]
    return [
        pooled_size(spatial[i], kernel[i], strides[i], pads[i], pads[i + nd], dilations[i], ceil_mode)
        for i in range(nd)
    ]


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
    log: bool = False  # log(softmax), as TPU-MLIR's (ONNX LogSoftmax)


@op_definition
class SoftmaxOp(TopOp):
    name = "top.Softmax"
    PARAMS = SoftmaxParams


@dataclass(frozen=True)
class LayerNormParams:
    axis: int = -1
    eps: float = 1e-5
    stats: bool = False  # also return the mean and 1/stddev (ONNX's Mean/InvStdDev, TPU-MLIR's mean/rstd)


@op_definition
class LayerNormOp(TopOp):
    """Normalise over dims axis..end; scale/bias broadcast over those dims."""

    name = "top.LayerNorm"
    PARAMS = LayerNormParams
    OPERANDS = ("input", "scale", "bias")

    @classmethod
    def infer(cls, p: LayerNormParams, in_types):
        if not p.stats:
            return [in_types[0]]
        x = shape_of(in_types[0])
        axis = _norm_axis(p.axis, len(x))
        stat = with_shape(in_types[0], [*x[:axis], *[1] * (len(x) - axis)])
        return [in_types[0], stat, stat]


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


@dataclass(frozen=True)
class MaskPoolParams(PoolParams):
    storage_order: int = 0  # of the indices: 0 row-major, 1 column-major spatial order


@op_definition
class MaxPoolWithMaskOp(PoolOp):
    """MaxPool that also returns where each maximum came from (ONNX MaxPool's Indices output): int64
    flat indices into the input, batch and channel included."""

    name = "top.MaxPoolWithMask"
    PARAMS = MaskPoolParams

    @classmethod
    def infer(cls, p: MaskPoolParams, in_types):
        (y,) = PoolOp.infer.__func__(cls, p, in_types)
        return [y, TensorType(i64, shape_of(y))]


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
            if len(s) != len(shapes[0]) or any(
                a != b for i, (a, b) in enumerate(zip(s, shapes[0], strict=True)) if i != axis
            ):
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


# ---- data movement and layout (tensor ops) -----------------------------------


@dataclass(frozen=True)
class DeconvParams:
    kernel_shape: tuple[int, ...]
    strides: tuple[int, ...]
    pads: tuple[int, ...]  # ONNX order, begins then ends; negative pads grow the output
    dilations: tuple[int, ...]
    output_padding: tuple[int, ...] = ()
    group: int = 1
    do_relu: bool = False
    relu_limit: float = -1.0


@op_definition
class DeconvOp(TopOp):
    """Transposed convolution (ONNX ConvTranspose); filter [IC, OC/group, *kernel], optional bias [OC]."""

    name = "top.Deconv"
    PARAMS = DeconvParams
    OPERANDS = ("input", "filter", "bias")

    @classmethod
    def infer(cls, p: DeconvParams, in_types):
        x, w = shape_of(in_types[0]), shape_of(in_types[1])
        nd = len(p.kernel_shape)
        if len(x) != nd + 2 or len(w) != len(x) or x[1] != w[0]:
            raise VerifyException(f"deconv input {x} / filter {w} do not match kernel {p.kernel_shape}")
        extra = p.output_padding or (0,) * nd
        out = [
            (x[2 + i] - 1) * p.strides[i]
            + (p.kernel_shape[i] - 1) * p.dilations[i]
            + 1
            + extra[i]
            - p.pads[i]
            - p.pads[nd + i]
            for i in range(nd)
        ]
        if min(out) < 1:
            raise VerifyException(f"deconv output size {out} is empty")
        return [with_shape(in_types[0], [x[0], w[1] * p.group, *out])]


@op_definition
class ExpandOp(TopOp):
    """Broadcast to ``shape`` (numpy rules, as ONNX Expand)."""

    name = "top.Expand"
    PARAMS = ShapeParams

    @classmethod
    def infer(cls, p: ShapeParams, in_types):
        return [with_shape(in_types[0], broadcast_shapes(shape_of(in_types[0]), p.shape))]


@dataclass(frozen=True)
class TileParams:
    tile: tuple[int, ...]


@op_definition
class TileOp(TopOp):
    name = "top.Tile"
    PARAMS = TileParams

    @classmethod
    def infer(cls, p: TileParams, in_types):
        x = shape_of(in_types[0])
        if len(p.tile) != len(x):
            raise VerifyException(f"tile {p.tile} does not match rank {len(x)}")
        return [with_shape(in_types[0], [d * t for d, t in zip(x, p.tile, strict=True)])]


@op_definition
class GatherOp(TopOp):
    """ONNX Gather: take ``indices`` (negative counts from the end) along ``axis``."""

    name = "top.Gather"
    PARAMS = AxisParams
    OPERANDS = ("input", "indices")

    @classmethod
    def infer(cls, p: AxisParams, in_types):
        x, idx = shape_of(in_types[0]), shape_of(in_types[1])
        axis = _norm_axis(p.axis, len(x))
        return [with_shape(in_types[0], [*x[:axis], *idx, *x[axis + 1 :]])]


@op_definition
class GatherElementsOp(TopOp):
    name = "top.GatherElements"
    PARAMS = AxisParams
    OPERANDS = ("input", "indices")

    @classmethod
    def infer(cls, p: AxisParams, in_types):
        x, idx = shape_of(in_types[0]), shape_of(in_types[1])
        if len(x) != len(idx):
            raise VerifyException(f"indices rank {len(idx)} differs from input rank {len(x)}")
        _norm_axis(p.axis, len(x))
        return [with_shape(in_types[0], idx)]


@dataclass(frozen=True)
class GatherNDParams:
    batch_dims: int = 0


@op_definition
class GatherNDOp(TopOp):
    """ONNX GatherND: the last dim of ``indices`` addresses the leading dims of the input (after batch_dims)."""

    name = "top.GatherND"
    PARAMS = GatherNDParams
    OPERANDS = ("input", "indices")

    @classmethod
    def infer(cls, p: GatherNDParams, in_types):
        x, idx = shape_of(in_types[0]), shape_of(in_types[1])
        depth = idx[-1] if idx else 0
        if not idx or p.batch_dims + depth > len(x) or x[: p.batch_dims] != idx[: p.batch_dims]:
            raise VerifyException(f"indices {idx} (batch_dims {p.batch_dims}) do not address input {x}")
        return [with_shape(in_types[0], [*idx[:-1], *x[p.batch_dims + depth :]])]


@dataclass(frozen=True)
class ScatterParams:
    axis: int = 0  # ScatterElements only
    reduction: str = "none"  # none, add, mul, max, min


class ScatterOp(TopOp):
    PARAMS = ScatterParams
    OPERANDS = ("input", "indices", "updates")

    @classmethod
    def infer(cls, p: ScatterParams, in_types):
        if p.reduction not in ("none", "add", "mul", "max", "min"):
            raise VerifyException(f"unknown scatter reduction {p.reduction!r}")
        return [in_types[0]]


@op_definition
class ScatterElementsOp(ScatterOp):
    """ONNX ScatterElements: updates written at ``indices`` along ``axis`` (the input's shape stays)."""

    name = "top.ScatterElements"


@op_definition
class ScatterNDOp(ScatterOp):
    """ONNX ScatterND: slices of updates written at the index tuples in the last dim of ``indices``."""

    name = "top.ScatterND"


@dataclass(frozen=True)
class TriluParams:
    upper: bool = True
    diagonal: int = 0


@op_definition
class TriluOp(TopOp):
    """Keep the upper (or lower) triangle of the last two dims from ``diagonal`` on; zero the rest."""

    name = "top.Trilu"
    PARAMS = TriluParams


@dataclass(frozen=True)
class CumSumParams:
    axis: int
    exclusive: bool = False
    reverse: bool = False


@op_definition
class CumSumOp(TopOp):
    name = "top.CumSum"
    PARAMS = CumSumParams


@dataclass(frozen=True)
class SplitParams:
    axis: int
    split_size: tuple[int, ...]


@op_definition
class SplitOp(TopOp):
    """Split along ``axis`` into pieces of ``split_size``; one result per piece."""

    name = "top.Split"
    PARAMS = SplitParams

    @classmethod
    def infer(cls, p: SplitParams, in_types):
        x = shape_of(in_types[0])
        axis = _norm_axis(p.axis, len(x))
        if sum(p.split_size) != x[axis] or min(p.split_size, default=0) < 0:
            raise VerifyException(f"split sizes {p.split_size} do not add up to dim {axis} of {x}")
        return [with_shape(in_types[0], [*x[:axis], s, *x[axis + 1 :]]) for s in p.split_size]


@dataclass(frozen=True)
class SliceParams:
    """Per dim (all dims): python-normalised start, stop and step; stop -1 with a negative step means
    'through index 0'."""

    offset: tuple[int, ...]
    ends: tuple[int, ...]
    steps: tuple[int, ...]


def slice_len(start: int, stop: int, step: int) -> int:
    return len(range(start, stop, step))


@op_definition
class SliceOp(TopOp):
    name = "top.Slice"
    PARAMS = SliceParams

    @classmethod
    def infer(cls, p: SliceParams, in_types):
        x = shape_of(in_types[0])
        if not len(p.offset) == len(p.ends) == len(p.steps) == len(x) or 0 in p.steps:
            raise VerifyException(f"slice {p} does not fit input shape {x}")
        return [with_shape(in_types[0], [slice_len(*a) for a in zip(p.offset, p.ends, p.steps, strict=True)])]


@dataclass(frozen=True)
class PadParams:
    paddings: tuple[int, ...]  # ONNX order: begins of every dim, then ends; negative crops
    val: float = 0.0
    mode: str = "constant"  # constant, reflect, edge, wrap


@op_definition
class PadOp(TopOp):
    name = "top.Pad"
    PARAMS = PadParams

    @classmethod
    def infer(cls, p: PadParams, in_types):
        x = shape_of(in_types[0])
        if len(p.paddings) != 2 * len(x) or p.mode not in ("constant", "reflect", "edge", "wrap"):
            raise VerifyException(f"pad {p} does not fit input shape {x}")
        out = [d + p.paddings[i] + p.paddings[len(x) + i] for i, d in enumerate(x)]
        if min(out, default=1) < 0:
            raise VerifyException(f"pads {p.paddings} crop more than shape {x}")
        return [with_shape(in_types[0], out)]


@dataclass(frozen=True)
class InterpParams:
    """Resize of every dim to ``shape``; ``scales`` (output/input, or as the model gave them) enter the
    coordinate transform, as ONNX Resize."""

    shape: tuple[int, ...]
    scales: tuple[float, ...]
    mode: str = "nearest"  # nearest, linear, cubic
    coord_mode: str = "half_pixel"  # half_pixel, half_pixel_symmetric, pytorch_half_pixel, align_corners,
    #                                 asymmetric, tf_half_pixel_for_nn, tf_crop_and_resize
    nearest_mode: str = "round_prefer_floor"  # round_prefer_floor, round_prefer_ceil, floor, ceil
    cubic_coeff_a: float = -0.75
    exclude_outside: bool = False
    antialias: bool = False  # downsampling linear/cubic widens the filter by 1/scale (opset 18)
    roi: tuple[float, ...] = ()  # tf_crop_and_resize: starts of every dim, then ends (normalised)
    extrapolation_value: float = 0.0  # tf_crop_and_resize: the value outside the roi


INTERP_COORD_MODES = (
    "half_pixel",
    "half_pixel_symmetric",
    "pytorch_half_pixel",
    "align_corners",
    "asymmetric",
    "tf_half_pixel_for_nn",
    "tf_crop_and_resize",
)


@op_definition
class InterpOp(TopOp):
    """Nearest / (bi)linear / cubic resize (ONNX Resize and Upsample)."""

    name = "top.Interp"
    PARAMS = InterpParams

    @classmethod
    def infer(cls, p: InterpParams, in_types):
        x = shape_of(in_types[0])
        if len(p.shape) != len(x) or len(p.scales) != len(x):
            raise VerifyException(f"interp shape {p.shape} / scales {p.scales} do not match rank {len(x)}")
        if p.mode not in ("nearest", "linear", "cubic"):
            raise VerifyException(f"unknown interp mode {p.mode!r}")
        if p.coord_mode not in INTERP_COORD_MODES:
            raise VerifyException(f"unknown coordinate transformation mode {p.coord_mode!r}")
        if p.nearest_mode not in ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil"):
            raise VerifyException(f"unknown nearest mode {p.nearest_mode!r}")
        if (p.coord_mode == "tf_crop_and_resize") != (len(p.roi) == 2 * len(x)):
            raise VerifyException("an roi of 2 x rank values goes with tf_crop_and_resize, and only with it")
        return [with_shape(in_types[0], p.shape)]


@dataclass(frozen=True)
class GridSampleParams:
    mode: str = "linear"  # nearest, linear or cubic (opset 16's bilinear, bicubic)
    padding_mode: str = "zeros"  # zeros, border or reflection
    align_corners: bool = False


@op_definition
class GridSampleOp(TopOp):
    """ONNX GridSample: each output point samples the input [N, C, *D] at its grid point ([N, *out, len(D)] of
    coordinates normalised to [-1, 1], x first: the last axis)."""

    name = "top.GridSample"
    PARAMS = GridSampleParams
    OPERANDS = ("input", "grid")

    @classmethod
    def infer(cls, p: GridSampleParams, in_types):
        x, grid = shape_of(in_types[0]), shape_of(in_types[1])
        if len(x) < 3 or len(grid) != len(x) or grid[0] != x[0] or grid[-1] != len(x) - 2:
            raise VerifyException(
                f"grid {list(grid)} does not sample input {list(x)}: expected [N, *out, {len(x) - 2}]"
            )
        if p.mode not in ("nearest", "linear", "cubic"):
            raise VerifyException(f"unknown GridSample mode {p.mode!r}")
        if p.padding_mode not in ("zeros", "border", "reflection"):
            raise VerifyException(f"unknown GridSample padding mode {p.padding_mode!r}")
        return [with_shape(in_types[0], [x[0], x[1], *grid[1:-1]])]


@dataclass(frozen=True)
class Depth2SpaceParams:
    block_h: int
    block_w: int
    is_CRD: bool = False  # channel order of mode CRD (else DCR)
    is_inversed: bool = False  # SpaceToDepth


@op_definition
class Depth2SpaceOp(TopOp):
    """DepthToSpace (DCR/CRD) and, inversed, SpaceToDepth on NCHW tensors."""

    name = "top.Depth2Space"
    PARAMS = Depth2SpaceParams

    @classmethod
    def infer(cls, p: Depth2SpaceParams, in_types):
        x = shape_of(in_types[0])
        if len(x) != 4:
            raise VerifyException(f"depth2space needs an NCHW input, got {x}")
        n, c, h, w = x
        bb = p.block_h * p.block_w
        if p.is_inversed:
            if h % p.block_h or w % p.block_w:
                raise VerifyException(f"spatial dims {h}x{w} are not multiples of block {p.block_h}x{p.block_w}")
            return [with_shape(in_types[0], [n, c * bb, h // p.block_h, w // p.block_w])]
        if c % bb:
            raise VerifyException(f"channels {c} are not a multiple of block {p.block_h}x{p.block_w}")
        return [with_shape(in_types[0], [n, c // bb, h * p.block_h, w * p.block_w])]


@dataclass(frozen=True)
class EinsumParams:
    mode: str  # the equation, explicit form ('ab,bc->ac')


@op_definition
class EinsumOp(TopOp):
    """Einsum the frontend could not lower to MatMul/Permute/Reshape."""

    name = "top.Einsum"
    PARAMS = EinsumParams
    OPERANDS = ("inputs*",)

    @classmethod
    def infer(cls, p: EinsumParams, in_types):
        shapes = [shape_of(t) for t in in_types]
        try:
            out = np.einsum(p.mode, *[np.broadcast_to(np.zeros((), np.float32), s) for s in shapes]).shape
        except ValueError as e:
            raise VerifyException(f"einsum {p.mode!r} on shapes {shapes}: {e}") from None
        return [with_shape(in_types[0], out)]


@dataclass(frozen=True)
class TopKParams:
    axis: int
    K: int
    largest: bool = True
    sorted: bool = True


@op_definition
class TopKOp(TopOp):
    """The K largest (or smallest) along ``axis``: values, and their int64 indices."""

    name = "top.TopK"
    PARAMS = TopKParams

    @classmethod
    def infer(cls, p: TopKParams, in_types):
        x = list(shape_of(in_types[0]))
        axis = _norm_axis(p.axis, len(x))
        if not 0 <= p.K <= x[axis]:
            raise VerifyException(f"K={p.K} is out of range for dim {axis} of {x}")
        x[axis] = p.K
        return [with_shape(in_types[0], x), TensorType(i64, x)]


@dataclass(frozen=True)
class RnnParams:
    """ONNX RNN attributes (gate order as ONNX: LSTM iofc, GRU zrh); layout 0 ([seq, batch, ...])."""

    hidden_size: int
    direction: str = "forward"  # forward, reverse, bidirectional
    activations: tuple[str, ...] = ()  # () = the ONNX defaults
    activation_alpha: tuple[float, ...] = ()
    activation_beta: tuple[float, ...] = ()
    clip: float = 0.0  # 0: no clipping
    input_forget: bool = False
    linear_before_reset: bool = False


class RnnOp(TopOp):
    PARAMS = RnnParams
    GATES: ClassVar[int] = 1

    @classmethod
    def infer(cls, p: RnnParams, in_types):
        x, w = shape_of(in_types[0]), shape_of(in_types[1])
        dirs = 2 if p.direction == "bidirectional" else 1
        if len(x) != 3 or w != (dirs, cls.GATES * p.hidden_size, x[2]):
            raise VerifyException(
                f"{cls.name}: input {x} / weights {w} do not fit hidden size {p.hidden_size} "
                f"and direction {p.direction}"
            )
        seq, batch = x[0], x[1]
        y = with_shape(in_types[0], [seq, dirs, batch, p.hidden_size])
        h = with_shape(in_types[0], [dirs, batch, p.hidden_size])
        return [y] + [h] * (cls.NUM_RESULTS - 1)


@op_definition
class LSTMOp(RnnOp):
    """Single-layer LSTM; results Y, Y_h, Y_c."""

    name = "top.LSTM"
    OPERANDS = ("input", "filter", "recurrence", "bias", "initial_h", "initial_c", "peephole")
    GATES = 4
    NUM_RESULTS = 3


@op_definition
class GRUOp(RnnOp):
    """Single-layer GRU; results Y, Y_h."""

    name = "top.GRU"
    OPERANDS = ("input", "filter", "recurrence", "bias", "initial_h")
    GATES = 3
    NUM_RESULTS = 2


@op_definition
class RNNOp(RnnOp):
    """Single-layer simple RNN (ONNX RNN); results Y, Y_h."""

    name = "top.RNN"
    OPERANDS = ("input", "filter", "recurrence", "bias", "initial_h")
    NUM_RESULTS = 2


# ---- elementwise math, activations, comparisons, reductions, normalisation --------


class UnaryOp(TopOp):
    """Elementwise on one tensor; the result keeps its type."""


@op_definition
class ExpOp(UnaryOp):
    name = "top.Exp"


@op_definition
class LogOp(UnaryOp):
    name = "top.Log"


@op_definition
class SqrtOp(UnaryOp):
    name = "top.Sqrt"


@op_definition
class AbsOp(UnaryOp):
    name = "top.Abs"


@op_definition
class FloorOp(UnaryOp):
    name = "top.Floor"


@op_definition
class CeilOp(UnaryOp):
    name = "top.Ceil"


@op_definition
class ErfOp(UnaryOp):
    name = "top.Erf"


@op_definition
class SoftplusOp(UnaryOp):
    """log(1 + exp(x))."""

    name = "top.Softplus"


@op_definition
class MishOp(UnaryOp):
    """x * tanh(softplus(x))."""

    name = "top.Mish"


@op_definition
class HardSwishOp(UnaryOp):
    """x * clip(x / 6 + 1/2, 0, 1)."""

    name = "top.HardSwish"


@op_definition
class SiLUOp(UnaryOp):
    """x * sigmoid(x) (Swish with beta 1); canonicalize recognises the decomposed form."""

    name = "top.SiLU"


@dataclass(frozen=True)
class ConstValParams:
    const_val: float = 1.0


@op_definition
class ReciprocalOp(UnaryOp):
    """const_val / x, as TPU-MLIR's."""

    name = "top.Reciprocal"
    PARAMS = ConstValParams


@dataclass(frozen=True)
class AlphaParams:
    alpha: float


@op_definition
class LeakyReluOp(UnaryOp):
    """x if x >= 0 else alpha * x."""

    name = "top.LeakyRelu"
    PARAMS = AlphaParams


@op_definition
class EluOp(UnaryOp):
    """x if x > 0 else alpha * (exp(x) - 1)."""

    name = "top.Elu"
    PARAMS = AlphaParams


@dataclass(frozen=True)
class HardSigmoidParams:
    alpha: float = 0.2
    beta: float = 0.5


@op_definition
class HardSigmoidOp(UnaryOp):
    """clip(alpha * x + beta, 0, 1)."""

    name = "top.HardSigmoid"
    PARAMS = HardSigmoidParams


@op_definition
class SinOp(UnaryOp):
    name = "top.Sin"


@op_definition
class CosOp(UnaryOp):
    name = "top.Cos"


@op_definition
class TanOp(UnaryOp):
    name = "top.Tan"


@op_definition
class AsinOp(UnaryOp):
    name = "top.Asin"


@op_definition
class AcosOp(UnaryOp):
    name = "top.Acos"


@op_definition
class AtanOp(UnaryOp):
    name = "top.Atan"


@op_definition
class SinhOp(UnaryOp):
    name = "top.Sinh"


@op_definition
class CoshOp(UnaryOp):
    name = "top.Cosh"


@op_definition
class AsinhOp(UnaryOp):
    name = "top.Asinh"


@op_definition
class AcoshOp(UnaryOp):
    name = "top.Acosh"


@op_definition
class AtanhOp(UnaryOp):
    name = "top.Atanh"


@op_definition
class SignOp(UnaryOp):
    name = "top.Sign"


@op_definition
class RoundOp(UnaryOp):
    """Round half to even (ONNX Round)."""

    name = "top.Round"


@op_definition
class SoftsignOp(UnaryOp):
    """x / (1 + |x|)."""

    name = "top.Softsign"


@dataclass(frozen=True)
class BetaParams:
    beta: float = 1.0


@op_definition
class SwishOp(UnaryOp):
    """x * sigmoid(beta * x) (SiLU at beta 1)."""

    name = "top.Swish"
    PARAMS = BetaParams


@op_definition
class CeluOp(UnaryOp):
    """max(0, x) + min(0, alpha * (exp(x / alpha) - 1))."""

    name = "top.Celu"
    PARAMS = AlphaParams


@op_definition
class ThresholdedReluOp(UnaryOp):
    """x if x > alpha else 0."""

    name = "top.ThresholdedRelu"
    PARAMS = AlphaParams


@dataclass(frozen=True)
class ShrinkParams:
    bias: float = 0.0
    lambd: float = 0.5


@op_definition
class ShrinkOp(UnaryOp):
    """x + bias below -lambd, x - bias above lambd, 0 between."""

    name = "top.Shrink"
    PARAMS = ShrinkParams


class PredicateOp(TopOp):
    """An elementwise test; a bool result."""

    @classmethod
    def infer(cls, p, in_types):
        return [tensor_type(shape_of(in_types[0]), np.bool_)]


@op_definition
class IsNaNOp(PredicateOp):
    name = "top.IsNaN"


@dataclass(frozen=True)
class IsInfParams:
    detect_positive: bool = True
    detect_negative: bool = True


@op_definition
class IsInfOp(PredicateOp):
    name = "top.IsInf"
    PARAMS = IsInfParams


@dataclass(frozen=True)
class ModParams:
    fmod: bool = False  # False: the result takes the divisor's sign (Python %); True: the dividend's (C fmod)


@op_definition
class ModOp(BinaryOp):
    name = "top.Mod"
    PARAMS = ModParams


@dataclass(frozen=True)
class RMSNormParams:
    axis: int = -1
    eps: float = 1e-5


@op_definition
class RMSNormOp(TopOp):
    """x / sqrt(mean(x^2 over dims axis..end) + eps) * gamma."""

    name = "top.RMSNorm"
    PARAMS = RMSNormParams
    OPERANDS = ("input", "gamma")


GELU_MODES = ("normal", "tanh")


@dataclass(frozen=True)
class GeluParams:
    approx_mode: str = "normal"  # normal: x * Phi(x) through erf; tanh: the tanh approximation


@op_definition
class GELUOp(UnaryOp):
    name = "top.GELU"
    PARAMS = GeluParams

    @classmethod
    def infer(cls, p: GeluParams, in_types):
        if p.approx_mode not in GELU_MODES:
            raise VerifyException(f"GELU approx_mode {p.approx_mode!r} is not one of {GELU_MODES}")
        return [in_types[0]]


@op_definition
class PReluOp(TopOp):
    """x if x >= 0 else slope * x; slope broadcasts to x."""

    name = "top.PRelu"
    OPERANDS = ("input", "slope")

    @classmethod
    def infer(cls, p, in_types):
        x = shape_of(in_types[0])
        if broadcast_shapes(x, shape_of(in_types[1])) != x:
            raise VerifyException(f"PRelu slope {shape_of(in_types[1])} does not broadcast to input {x}")
        return [in_types[0]]


@dataclass(frozen=True)
class PowParams:
    exponent: float


@op_definition
class PowOp(UnaryOp):
    """x ** exponent for a constant scalar exponent."""

    name = "top.Pow"
    PARAMS = PowParams


@op_definition
class Pow3Op(BinaryOp):
    """lhs ** rhs elementwise with broadcasting (TPU-MLIR's name); the result has lhs's type."""

    name = "top.Pow3"


class VariadicOp(TopOp):
    """Elementwise over any number of inputs with numpy broadcasting."""

    OPERANDS = ("inputs*",)

    @classmethod
    def infer(cls, p, in_types):
        return [with_shape(in_types[0], broadcast_shapes(*[shape_of(t) for t in in_types]))]


@op_definition
class MaxOp(VariadicOp):
    name = "top.Max"


@op_definition
class MinOp(VariadicOp):
    name = "top.Min"


@op_definition
class WhereOp(TopOp):
    """cond ? tbrn : fbrn with broadcasting; the result has the branches' element type."""

    name = "top.Where"
    OPERANDS = ("cond", "tbrn", "fbrn")

    @classmethod
    def infer(cls, p, in_types):
        return [with_shape(in_types[1], broadcast_shapes(*[shape_of(t) for t in in_types]))]


COMPARE_MODES = ("Equal", "NotEqual", "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "And", "Or", "Xor", "Not")


@dataclass(frozen=True)
class CompareParams:
    mode: str


@op_definition
class CompareOp(TopOp):
    """Comparisons and logic (TPU-MLIR's modes plus Or); a bool result. ``Not`` takes one operand."""

    name = "top.Compare"
    PARAMS = CompareParams
    OPERANDS = ("lhs", "rhs*")

    @classmethod
    def infer(cls, p: CompareParams, in_types):
        if p.mode not in COMPARE_MODES:
            raise VerifyException(f"compare mode {p.mode!r} is not one of {COMPARE_MODES}")
        if len(in_types) != (1 if p.mode == "Not" else 2):
            raise VerifyException(
                f"compare mode {p.mode} takes {1 if p.mode == 'Not' else 2} operands, got {len(in_types)}"
            )
        return [tensor_type(broadcast_shapes(*[shape_of(t) for t in in_types]), np.bool_)]


@dataclass(frozen=True)
class CastParams:
    to: str  # numpy dtype name of the result: float32, int64, bool, bfloat16, float8_e4m3fn...
    saturate: bool = True  # float8 targets only: out-of-range values clamp to the largest finite one
    round_mode: str = "up"  # float8_e8m0fnu target only: up, down or nearest (ONNX Cast-24)


@op_definition
class CastOp(TopOp):
    """Element type conversion (ONNX Cast); float -> int truncates, as C casts do."""

    name = "top.Cast"
    PARAMS = CastParams

    @classmethod
    def infer(cls, p: CastParams, in_types):
        return [tensor_type(shape_of(in_types[0]), dtype_from_name(p.to))]


REDUCE_MODES = (
    "ReduceMean",
    "ReduceSum",
    "ReduceMax",
    "ReduceMin",
    "ReduceProd",
    "ReduceL1",
    "ReduceL2",
    "ReduceSumSquare",
    "ReduceLogSum",
    "ReduceLogSumExp",
)


@dataclass(frozen=True)
class ReduceParams:
    axes: tuple[int, ...]  # non-negative, ascending, not empty (the frontend resolves 'all')
    mode: str
    keepdims: bool = True


def _reduced(shape: Sequence[int], axes: Sequence[int], keepdims: bool) -> list[int]:
    if any(not 0 <= a < len(shape) for a in axes) or len(set(axes)) != len(axes):
        raise VerifyException(f"reduce axes {tuple(axes)} do not fit rank {len(shape)}")
    if keepdims:
        return [1 if i in axes else d for i, d in enumerate(shape)]
    return [d for i, d in enumerate(shape) if i not in axes]


@op_definition
class ReduceOp(TopOp):
    """Reduce over ``axes`` by ``mode`` (TPU-MLIR's modes plus SumSquare/LogSum/LogSumExp)."""

    name = "top.Reduce"
    PARAMS = ReduceParams

    @classmethod
    def infer(cls, p: ReduceParams, in_types):
        if p.mode not in REDUCE_MODES:
            raise VerifyException(f"reduce mode {p.mode!r} is not one of {REDUCE_MODES}")
        return [with_shape(in_types[0], _reduced(shape_of(in_types[0]), p.axes, p.keepdims))]


@dataclass(frozen=True)
class ArgParams:
    axis: int  # non-negative
    mode: str = "ArgMax"  # or ArgMin
    keepdims: bool = True
    select_last_index: bool = False


@op_definition
class ArgOp(TopOp):
    """Index of the max/min along ``axis`` (int64; the first one unless select_last_index)."""

    name = "top.Arg"
    PARAMS = ArgParams

    @classmethod
    def infer(cls, p: ArgParams, in_types):
        if p.mode not in ("ArgMax", "ArgMin"):
            raise VerifyException(f"arg mode {p.mode!r} is not ArgMax or ArgMin")
        return [tensor_type(_reduced(shape_of(in_types[0]), (p.axis,), p.keepdims), np.int64)]


@op_definition
class InstanceNormOp(TopOp):
    """Normalise each (n, c) over the spatial dims; weight/bias [C]."""

    name = "top.InstanceNorm"
    PARAMS = EpsParams
    OPERANDS = ("input", "weight", "bias")


@dataclass(frozen=True)
class GroupNormParams:
    num_groups: int
    eps: float = 1e-5


@op_definition
class GroupNormOp(TopOp):
    """Normalise each (n, group of C/num_groups channels) over those channels and the spatial dims;
    weight/bias per channel [C] (ONNX opset 21's meaning; the frontend widens opset 18's per-group ones)."""

    name = "top.GroupNorm"
    PARAMS = GroupNormParams
    OPERANDS = ("input", "weight", "bias")

    @classmethod
    def infer(cls, p: GroupNormParams, in_types):
        x = shape_of(in_types[0])
        if len(x) < 2 or p.num_groups < 1 or x[1] % p.num_groups:
            raise VerifyException(f"{x[1] if len(x) > 1 else '?'} channels do not split into {p.num_groups} groups")
        return [in_types[0]]


@dataclass(frozen=True)
class LRNParams:
    size: int
    alpha: float = 1e-4
    beta: float = 0.75
    bias: float = 1.0


@op_definition
class LRNOp(TopOp):
    """Local response normalisation across ``size`` neighbouring channels."""

    name = "top.LRN"
    PARAMS = LRNParams


# Ops whose result's values are some of their data operand's (operand 0), moved or repeated: what passes
# through them keeps its quantization in INT8 (lower/int8.py), and its range matters only where their
# results are read (calib/calibrate.py).
MOVE_OPS = (
    ReshapeOp,
    PermuteOp,
    SliceOp,
    SplitOp,
    TileOp,
    ExpandOp,
    Depth2SpaceOp,
    GatherOp,
    GatherElementsOp,
    IdentityOp,
)

TOP_OPS: list[type[TopOp]] = [
    v for v in list(globals().values()) if isinstance(v, type) and issubclass(v, TopOp) and "name" in v.__dict__
]

Top = Dialect("top", list[type[Operation]](TOP_OPS), [])


def is_tensor(t: Attribute) -> bool:
    return isinstance(t, TensorType)
