"""Quantized models as float arithmetic and casts: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear (QDQ
and dynamic quantization), MatMulInteger, ConvInteger, QLinearMatMul, QLinearConv and onnxruntime's QLinear
contrib ops (QOperator).

A weight's DequantizeLinear has constant operands and folds to float weights; on activations the pair
computes what onnxruntime does: ``saturate(round_half_even(x / scale) + zero_point)`` in the integer type
(float8 and float4: the cast's own rounding and saturation), then ``(q - zero_point) * scale``. Calibration
finds the pairs in this form and gives their tensors the model's own grid where INT8 has it
(tpubuild/calib/qdq.py)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from onnx import helper

from tpubuild.frontend.onnx_graph import Const, Ctx, Node, Value, dtype_of_value, shape_of
from tpubuild.frontend.ops.common import norm_axis
from tpubuild.frontend.registry import converter
from tpubuild.ir import top


def _is_integer(dtype: np.dtype) -> bool:
    try:
        ml_dtypes.iinfo(dtype)  # numpy's integers and ml_dtypes' 2- and 4-bit ones
    except ValueError:
        return False
    return True


def _broadcast(node: Node, ctx: Ctx, i: int, data_shape, name: str) -> Value:
    """Input ``i`` (a scale or zero point) as float32, shaped to broadcast against the data: a scalar, one
    value per index of ``axis``, or one per block of ``block_size`` along it (blocked: constants only)."""
    rank = len(data_shape)
    value = node.input(i)
    if node.attrs.get("block_size"):
        array = ctx.const(node, i, "blocked scale or zero point")
        assert array is not None, "called for inputs the node has"
        value = Const(array, name)
    if isinstance(value, Const):
        array = np.asarray(value.array).astype(np.float32)
        if array.size == 1:
            return Const(array.reshape(()), name)
        axis = norm_axis(int(node.attrs.get("axis", 1)), rank)
        block = int(node.attrs.get("block_size", 0) or 0)
        if block:
            array = np.repeat(array, block, axis=axis)
            array = array[tuple(slice(0, d) if i == axis else slice(None) for i, d in enumerate(data_shape))]
            return Const(np.ascontiguousarray(array), name)
        return Const(array.reshape([-1 if i == axis else 1 for i in range(rank)]), name)
    value = _float32(ctx, value, f"{name}_float")
    shape = shape_of(value)
    if len(shape) == 1 and shape[0] > 1:  # per axis, computed at run time
        axis = norm_axis(int(node.attrs.get("axis", 1)), rank)
        target = tuple(shape[0] if i == axis else 1 for i in range(rank))
        return ctx.emit(top.ReshapeOp, [value], top.ShapeParams(target), name=name)
    return value


def _float32(ctx: Ctx, value: Value, name: str) -> Value:
    if dtype_of_value(value) == np.float32:
        return value
    if isinstance(value, Const):
        return Const(np.asarray(value.array).astype(np.float32), name)
    return ctx.emit(top.CastOp, [value], top.CastParams("float32"), name=name)


def _nonzero(value: Value | None) -> bool:
    return value is not None and not (isinstance(value, Const) and not np.any(np.asarray(value.array, np.float32)))


def _output_type(zero: Value | None) -> np.dtype:
    """The quantized type: the zero point's (uint8 without one)."""
    return dtype_of_value(zero) if zero is not None else np.dtype(np.uint8)


def _stored(ctx: Ctx, y: Value, zero: Value | None, to: np.dtype, name: str, saturate: bool = True) -> Value:
    """Real values in steps -> the quantized type: rounded half to even (as onnxruntime), plus the zero point,
    saturated, cast (float8 and float4: the cast's own rounding and saturation)."""
    integer = _is_integer(to)
    if integer:
        y = ctx.emit(top.RoundOp, [y], name=f"{name}_rounded")
    if _nonzero(zero):
        y = ctx.emit(top.AddOp, [y, zero], name=f"{name}_shifted")
    if integer:
        info = ml_dtypes.iinfo(to)
        y = ctx.emit(top.ClipOp, [y], top.ClipParams(float(info.min), float(info.max)), name=f"{name}_saturated")
    return ctx.emit(top.CastOp, [y], top.CastParams(to.name, saturate=saturate), name=name)


@converter("DequantizeLinear", since=10)
def _(node: Node, ctx: Ctx):
    x, scale, zero, out = node.input(0), node.input(1), node.input(2), node.outputs[0]
    shape = shape_of(x)
    y = _float32(ctx, x, f"{out}_float")
    if _nonzero(zero):
        zp = _broadcast(node, ctx, 2, shape, f"{out}_zero_point")
        y = ctx.emit(top.SubOp, [y, zp], name=f"{out}_centered")
    to = dtype_of_value(scale)
    s = _broadcast(node, ctx, 1, shape, f"{out}_scale")
    if to == np.float32:
        return [ctx.emit(top.MulOp, [y, s], name=out)]
    y = ctx.emit(top.MulOp, [y, s], name=f"{out}_f32")
    return [ctx.emit(top.CastOp, [y], top.CastParams(to.name), name=out)]


@converter("QuantizeLinear", since=10)
def _(node: Node, ctx: Ctx):
    x, zero, out = node.input(0), node.input(2), node.outputs[0]
    shape = shape_of(x)
    to = _output_type(zero)
    if zero is None and node.attrs.get("output_dtype"):
        to = np.dtype(helper.tensor_dtype_to_np_dtype(node.attrs["output_dtype"]))
    s = _broadcast(node, ctx, 1, shape, f"{out}_scale")
    y = ctx.emit(top.DivOp, [_float32(ctx, x, f"{out}_float"), s], name=f"{out}_scaled")
    zp = _broadcast(node, ctx, 2, shape, f"{out}_zero_point") if _nonzero(zero) else None
    return [_stored(ctx, y, zp, to, out, saturate=bool(node.attrs.get("saturate", 1)))]


@converter("DynamicQuantizeLinear", since=11)
def _(node: Node, ctx: Ctx):
    """uint8 with the scale and zero point of the tensor's own range (0 included), as the op defines them."""
    x = node.input(0)
    y_name, scale_name, zp_name = node.outputs
    axes = tuple(range(len(shape_of(x))))

    def emit(cls, operands, name, params=None):
        return ctx.emit(cls, operands, params, name=name)

    zero = Const(np.array(0, np.float32), f"{scale_name}_zero")
    hi = emit(top.ReduceOp, [x], f"{scale_name}_max", top.ReduceParams(axes, "ReduceMax", keepdims=False))
    lo = emit(top.ReduceOp, [x], f"{scale_name}_min", top.ReduceParams(axes, "ReduceMin", keepdims=False))
    lo = emit(top.MinOp, [lo, zero], f"{scale_name}_lo")
    span = emit(top.SubOp, [emit(top.MaxOp, [hi, zero], f"{scale_name}_hi"), lo], f"{scale_name}_span")
    scale = emit(top.DivOp, [span, Const(np.array(255, np.float32), f"{scale_name}_levels")], scale_name)
    byte = top.ClipParams(0.0, 255.0)
    zp = emit(top.DivOp, [emit(top.SubOp, [zero, lo], f"{zp_name}_neg_min"), scale], f"{zp_name}_real")
    zp = emit(top.ClipOp, [emit(top.RoundOp, [zp], f"{zp_name}_rounded")], f"{zp_name}_float", byte)
    q = emit(top.RoundOp, [emit(top.DivOp, [x, scale], f"{y_name}_scaled")], f"{y_name}_rounded")
    q = emit(top.ClipOp, [emit(top.AddOp, [q, zp], f"{y_name}_shifted")], f"{y_name}_saturated", byte)
    as_byte = top.CastParams("uint8")
    return [emit(top.CastOp, [q], y_name, as_byte), scale, emit(top.CastOp, [zp], zp_name, as_byte)]


# ---- integer MatMul and Conv (dynamic quantization, QOperator models) ------------------------------------
# The products are summed in float32 (exact while |sum| < 2**24, and within its rounding beyond), as the chip's
# float modes can; the result is cast back to int32, or requantized as onnxruntime does: the accumulator times
# one float32 multiplier (a_scale * b_scale / y_scale), rounded half to even, plus the zero point, saturated.


def _centered(ctx: Ctx, data: Value, zero: Value | None, zp_shape, name: str) -> Value:
    """float32(data) - zero point; a zero point of several values is reshaped to ``zp_shape``."""
    y = _float32(ctx, data, f"{name}_float")
    if not _nonzero(zero):
        return y
    zp = _float32(ctx, zero, f"{name}_zp_float")
    if shape_of(zp) and np.prod(shape_of(zp)) > 1:
        if isinstance(zp, Const):
            zp = Const(np.asarray(zp.array).reshape(zp_shape), f"{name}_zp")
        else:
            zp = ctx.emit(top.ReshapeOp, [zp], top.ShapeParams(tuple(zp_shape)), name=f"{name}_zp")
    return ctx.emit(top.SubOp, [y, zp], name=f"{name}_centered")


def _matmul_operands(ctx: Ctx, a: Value, a_zp: Value | None, b: Value, b_zp: Value | None, out: str):
    """A's zero point is per row (M of [..., M, K]), B's per column (N of [..., K, N])."""
    m = shape_of(a)[-2] if len(shape_of(a)) >= 2 else 1
    return _centered(ctx, a, a_zp, (m, 1), f"{out}_a"), _centered(ctx, b, b_zp, (shape_of(b)[-1],), f"{out}_b")


def _conv_operands(ctx: Ctx, x: Value, x_zp: Value | None, w: Value, w_zp: Value | None, out: str):
    """x's zero point is one value, w's one per output channel."""
    ws = shape_of(w)
    x_c = _centered(ctx, x, x_zp, (), f"{out}_x")
    return x_c, _centered(ctx, w, w_zp, (ws[0],) + (1,) * (len(ws) - 1), f"{out}_w")


def _requantized(ctx: Ctx, node: Node, acc: Value, scales: tuple[int, int, int], zp_index: int, out: str):
    a_s, b_s, y_s = (np.asarray(ctx.const(node, i, "scale"), np.float32) for i in scales)
    multiplier = (a_s.reshape(-1) * b_s.reshape(-1)) / y_s.reshape(-1)  # float32, as onnxruntime
    if multiplier.size > 1:  # per output channel (conv: axis 1) or column (matmul: the last axis)
        rank = len(shape_of(acc))
        axis = 1 if node.op_type == "QLinearConv" else rank - 1
        multiplier = multiplier.reshape([-1 if i == axis else 1 for i in range(rank)])
    y = ctx.emit(top.MulOp, [acc, Const(multiplier, f"{out}_multiplier")], name=f"{out}_real")
    return _stored_per_tensor(ctx, y, node.input(zp_index), out)


@converter("MatMulInteger", since=10)
def _(node: Node, ctx: Ctx):
    out = node.outputs[0]
    a, b = _matmul_operands(ctx, node.input(0), node.input(2), node.input(1), node.input(3), out)
    acc = ctx.emit(top.MatMulOp, [a, b, None], name=f"{out}_float")
    return [ctx.emit(top.CastOp, [acc], top.CastParams("int32"), name=out)]


@converter("ConvInteger", since=10)
def _(node: Node, ctx: Ctx):
    from tpubuild.frontend.ops.conv import conv

    out = node.outputs[0]
    x, w = _conv_operands(ctx, node.input(0), node.input(2), node.input(1), node.input(3), out)
    acc = conv(ctx, node.attrs, x, w, None, f"{out}_float")
    return [ctx.emit(top.CastOp, [acc], top.CastParams("int32"), name=out)]


@converter("QLinearMatMul", since=10)
def _(node: Node, ctx: Ctx):
    out = node.outputs[0]
    a, b = _matmul_operands(ctx, node.input(0), node.input(2), node.input(3), node.input(5), out)
    acc = ctx.emit(top.MatMulOp, [a, b, None], name=f"{out}_acc")
    return [_requantized(ctx, node, acc, (1, 4, 6), 7, out)]


@converter("QLinearConv", since=10)
def _(node: Node, ctx: Ctx):
    """The int32 bias joins the accumulator before requantization."""
    from tpubuild.frontend.ops.conv import conv

    out = node.outputs[0]
    x, w = _conv_operands(ctx, node.input(0), node.input(2), node.input(3), node.input(5), out)
    bias = node.input(8)
    bias = None if bias is None else _float32(ctx, bias, f"{out}_bias")
    acc = conv(ctx, node.attrs, x, w, bias, f"{out}_acc")
    return [_requantized(ctx, node, acc, (1, 4, 6), 7, out)]


# ---- onnxruntime's QLinear contrib ops (QOperator models): the float op between a dequantize and a quantize ----
# (data inputs as (tensor, scale, zero point) triples at these positions, then the output's scale, zero point);
# QLinearConcat takes the output's first, then a triple per input
_QLINEAR = {
    "QLinearAdd": ("Add", lambda n: (0, 3), 6),
    "QLinearMul": ("Mul", lambda n: (0, 3), 6),
    "QLinearGlobalAveragePool": ("GlobalAveragePool", lambda n: (0,), 3),
    "QLinearAveragePool": ("AveragePool", lambda n: (0,), 3),
    "QLinearSigmoid": ("Sigmoid", lambda n: (0,), 3),
    "QLinearLeakyRelu": ("LeakyRelu", lambda n: (0,), 3),
    "QLinearConcat": ("Concat", lambda n: tuple(range(2, n, 3)), 0),
}


def _dequantized(ctx: Ctx, data: Value, scale: Value, zero: Value | None, name: str) -> Value:
    """(data - zero point) * scale in float32 (per-tensor scales, as these ops take)."""
    y = _centered(ctx, data, zero, (), name)
    return ctx.emit(top.MulOp, [y, _float32(ctx, scale, f"{name}_scale")], name=f"{name}_dq")


def _quantized(ctx: Ctx, y: Value, scale: Value, zero: Value | None, name: str) -> Value:
    y = ctx.emit(top.DivOp, [y, _float32(ctx, scale, f"{name}_scale")], name=f"{name}_scaled")
    return _stored_per_tensor(ctx, y, zero, name)


def _stored_per_tensor(ctx: Ctx, y: Value, zero: Value | None, name: str) -> Value:
    """_stored with one zero point (a QLinear op's output)."""
    zp = _float32(ctx, zero, f"{name}_zp") if _nonzero(zero) else None
    return _stored(ctx, y, zp, _output_type(zero), name)


def _qlinear(node: Node, ctx: Ctx):
    from tpubuild.frontend import registry
    from tpubuild.frontend.onnx_graph import node_attrs

    float_op, positions, out_at = _QLINEAR[node.op_type]
    data = positions(len(node.inputs))
    if node.attrs.get("channels_last"):
        raise NotImplementedError(f"{node.op_type} with channels_last")
    out = node.outputs[0]
    inputs = [
        _dequantized(ctx, node.input(i), node.input(i + 1), node.input(i + 2), f"{out}_in{k}")
        for k, i in enumerate(data)
    ]
    attrs = {k: v for k, v in node.attrs.items() if k != "channels_last"}
    proto = helper.make_node(float_op, [f"{out}_in{k}_dq" for k in range(len(data))], [f"{out}_float"], **attrs)
    fn = registry.find(float_op, node.opset)
    assert fn is not None, float_op
    (y,) = fn(type(node)(proto, inputs, node_attrs(proto, node.opset), node.opset), ctx)
    return [_quantized(ctx, y, node.input(out_at), node.input(out_at + 1), out)]


for _op in _QLINEAR:
    converter(_op, since=1, domain="com.microsoft")(_qlinear)
