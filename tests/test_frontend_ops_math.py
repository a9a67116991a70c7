"""One-node ONNX models for the math, activation, logic, reduction and normalisation converters,
checked against onnxruntime (values and element types), across the opsets where their meaning changed."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from tpubuild.frontend import registry
from tpubuild.ir import mlir, top
from tpubuild.testing import upstream_check

R = np.random.default_rng(77)


def randn(*shape, dtype=np.float32):
    return R.standard_normal(shape).astype(dtype)


def node(op, inputs, outputs=("y",), **attrs):
    return helper.make_node(op, list(inputs), list(outputs), name=f"{op}_{outputs[0]}", **attrs)


def wide(*shape):
    """Values over a wide range, with exact zeros and saturating magnitudes."""
    x = randn(*shape) * 4
    flat = x.reshape(-1)
    flat[:4] = [0.0, -30.0, 30.0, 1e-3][: flat.size]
    return x


# ---- activations --------------------------------------------------------------

ACTIVATIONS = [
    ("LeakyRelu", {}, 6),
    ("LeakyRelu", {"alpha": 0.2}, 16),
    ("Elu", {}, 6),
    ("Elu", {"alpha": 0.5}, 6),
    ("Selu", {}, 6),
    ("Selu", {"alpha": 1.5, "gamma": 2.0}, 6),
    ("Softplus", {}, 1),
    ("Softplus", {}, 22),
    ("Erf", {}, 9),
    ("Erf", {}, 13),
    ("HardSigmoid", {}, 6),
    ("HardSigmoid", {"alpha": 0.1, "beta": 0.6}, 22),
    ("HardSwish", {}, 14),
    ("Mish", {}, 18),
    ("Gelu", {}, 20),
    ("Gelu", {"approximate": "none"}, 20),
    ("Gelu", {"approximate": "tanh"}, 20),
]


@pytest.mark.parametrize("op,attrs,opset", ACTIVATIONS, ids=lambda v: str(v))
def test_activation(check_onnx, op, attrs, opset):
    check_onnx(node(op, ["x"], **attrs), {"x": wide(2, 3, 5)}, opset=opset)


def test_erf_accuracy_near_zero_and_tails(check_onnx):
    x = np.array([0.0, 1e-7, -1e-5, 1e-3, 0.1, 0.49, 0.5, 0.51, 1.0, -2.0, 3.5, 6.0, -9.0], np.float32)
    check_onnx(node("Erf", ["x"]), {"x": x}, opset=13, rtol=2e-6, atol=1e-9)


PRELU_SLOPES = [(1,), (3, 1, 1), (1, 3, 1, 1), (5,), (3, 4, 5), ()]


@pytest.mark.parametrize("slope_shape", PRELU_SLOPES, ids=str)
@pytest.mark.parametrize("opset", [9, 16])
def test_prelu(check_onnx, slope_shape, opset):
    check_onnx(
        node("PRelu", ["x", "slope"]), {"x": wide(2, 3, 4, 5)}, initializers={"slope": randn(*slope_shape)}, opset=opset
    )


def test_prelu_runtime_slope(check_onnx):
    check_onnx(node("PRelu", ["x", "slope"]), {"x": wide(2, 3, 4), "slope": randn(3, 1)}, opset=16)


# ---- unary math ------------------------------------------------------------------


def positive(*shape):
    return np.abs(randn(*shape)) * 3 + 0.05


UNARY_MATH = {
    "Exp": wide,
    "Log": positive,
    "Sqrt": positive,
    "Reciprocal": wide,
    "Abs": wide,
    "Neg": wide,
    "Floor": wide,
    "Ceil": wide,
}


@pytest.mark.parametrize("opset", [6, 13])
@pytest.mark.parametrize("op", UNARY_MATH)
def test_unary_math(check_onnx, op, opset):
    check_onnx(node(op, ["x"]), {"x": UNARY_MATH[op](3, 4)}, opset=opset)


@pytest.mark.parametrize("op", ["Log", "Sqrt", "Reciprocal"])
def test_unary_math_edges(check_onnx, op):
    """Negative, zero and infinite inputs give the same nan/inf as onnxruntime."""
    x = np.array([-1.0, 0.0, -0.0, np.inf, 4.0], np.float32)
    check_onnx(node(op, ["x"]), {"x": x}, opset=13)


@pytest.mark.parametrize("op", ["Abs", "Neg"])
@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.int8])
def test_unary_integer(check_onnx, op, dtype):
    check_onnx(node(op, ["x"]), {"x": R.integers(-100, 100, (3, 4)).astype(dtype)}, opset=13)


@pytest.mark.parametrize("exponent", [2.0, 3.0, 0.5, -1.0, 0.0])
@pytest.mark.parametrize("opset", [7, 15])
def test_pow_scalar_exponent(check_onnx, exponent, opset):
    check_onnx(
        node("Pow", ["x", "e"]),
        {"x": positive(2, 3, 4)},
        initializers={"e": np.array(exponent, np.float32)},
        opset=opset,
    )


def test_pow_integer_exponent_negative_base(check_onnx):
    x = wide(3, 4)
    check_onnx(node("Pow", ["x", "e"]), {"x": x}, initializers={"e": np.array([3], np.int64)}, opset=15)


@pytest.mark.parametrize("e_shape", [(4,), (3, 1), (2, 3, 4), (1, 1, 1)], ids=str)
def test_pow_tensor_exponent(check_onnx, e_shape):
    check_onnx(node("Pow", ["x", "e"]), {"x": positive(2, 3, 4), "e": randn(*e_shape)}, opset=15)


def test_pow_constant_base(check_onnx):
    check_onnx(node("Pow", ["b", "x"]), {"x": randn(3, 4)}, initializers={"b": np.array(2.0, np.float32)}, opset=15)


# ---- variadic ------------------------------------------------------------------

VARIADIC_SHAPES = [[(3, 4)], [(3, 4), (3, 4)], [(2, 3, 4), (4,), (3, 1)], [(1,), (2, 1, 5), (3, 5), (5,)]]


@pytest.mark.parametrize("shapes", VARIADIC_SHAPES, ids=str)
@pytest.mark.parametrize("op", ["Max", "Min", "Sum", "Mean"])
@pytest.mark.parametrize("opset", [8, 13])
def test_variadic(check_onnx, op, shapes, opset):
    ins = {f"x{i}": randn(*s) for i, s in enumerate(shapes)}
    check_onnx(node(op, list(ins)), ins, opset=opset)


@pytest.mark.parametrize("op", ["Max", "Min", "Sum", "Mean"])
def test_variadic_with_constant(check_onnx, op):
    check_onnx(node(op, ["x", "c"]), {"x": randn(2, 3)}, initializers={"c": randn(3)}, opset=13)


@pytest.mark.parametrize("op", ["Max", "Min"])
def test_max_min_int(check_onnx, op):
    a = R.integers(-50, 50, (3, 4)).astype(np.int64)
    b = R.integers(-50, 50, (4,)).astype(np.int64)
    check_onnx(node(op, ["a", "b"]), {"a": a, "b": b}, opset=13)


# ---- where / compare / logic / cast ----------------------------------------------


@pytest.mark.parametrize("shapes", [((2, 3), (2, 3), (2, 3)), ((3,), (2, 3), ()), ((2, 1), (1, 3), (2, 3))], ids=str)
@pytest.mark.parametrize("opset", [9, 16])
def test_where(check_onnx, shapes, opset):
    c, a, b = shapes
    check_onnx(node("Where", ["c", "a", "b"]), {"c": R.random(c) > 0.5, "a": randn(*a), "b": randn(*b)}, opset=opset)


def test_where_int64(check_onnx):
    a = R.integers(0, 9, (4,)).astype(np.int64)
    check_onnx(
        node("Where", ["c", "a", "b"]),
        {"c": R.random(4) > 0.5, "a": a},
        initializers={"b": np.array(-1, np.int64)},
        opset=16,
    )


COMPARES = [
    ("Equal", 11),
    ("Equal", 19),
    ("Less", 9),
    ("Less", 13),
    ("Greater", 7),
    ("Greater", 13),
    ("LessOrEqual", 12),
    ("LessOrEqual", 16),
    ("GreaterOrEqual", 12),
    ("GreaterOrEqual", 16),
]


@pytest.mark.parametrize("op,opset", COMPARES)
@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_compare(check_onnx, op, opset, dtype):
    if opset < 9 and dtype != np.float32:
        pytest.skip("integer comparisons start at opset 9")
    a = R.integers(-3, 3, (2, 3, 4)).astype(dtype)
    b = R.integers(-3, 3, (3, 1)).astype(dtype)
    got = check_onnx(node(op, ["a", "b"]), {"a": a, "b": b}, opset=opset)
    assert got["y"].dtype == np.bool_


def test_compare_with_constant(check_onnx):
    check_onnx(
        node("Greater", ["x", "zero"]), {"x": randn(3, 4)}, initializers={"zero": np.array(0.0, np.float32)}, opset=13
    )


@pytest.mark.parametrize("op", ["And", "Or", "Xor"])
def test_logic_binary(check_onnx, op):
    check_onnx(node(op, ["a", "b"]), {"a": R.random((2, 3, 4)) > 0.5, "b": R.random((3, 4)) > 0.5}, opset=7)


def test_not(check_onnx):
    check_onnx(node("Not", ["a"]), {"a": R.random((3, 4)) > 0.5}, opset=1)


def test_compare_chain_into_where(check_onnx):
    """Equal (bool) -> Not -> Where: bool tensors flow between ops and through the file."""
    nodes = [node("Equal", ["a", "b"], ["eq"]), node("Not", ["eq"], ["ne"]), node("Where", ["ne", "a", "b"])]
    a = R.integers(0, 3, (4, 5)).astype(np.float32)
    check_onnx(nodes, {"a": a, "b": R.integers(0, 3, (4, 5)).astype(np.float32)}, ["y", "eq"], opset=13)


CASTS = [
    (np.float32, TensorProto.INT64),
    (np.float32, TensorProto.INT32),
    (np.float32, TensorProto.FLOAT16),
    (np.float32, TensorProto.BOOL),
    (np.float32, TensorProto.DOUBLE),
    (np.float32, TensorProto.FLOAT),
    (np.float32, TensorProto.INT8),
    (np.float32, TensorProto.UINT8),
    (np.int64, TensorProto.FLOAT),
    (np.int32, TensorProto.INT64),
    (np.bool_, TensorProto.FLOAT),
    (np.bool_, TensorProto.INT64),
    (np.float16, TensorProto.FLOAT),
    (np.int64, TensorProto.BOOL),
]


@pytest.mark.parametrize("src,to", CASTS, ids=lambda v: str(v))
@pytest.mark.parametrize("opset", [9, 13, 19])
def test_cast(check_onnx, src, to, opset):
    if np.dtype(src) == np.bool_:
        x = R.random((3, 5)) > 0.5
    elif np.dtype(src).kind == "f":
        x = (randn(3, 5) * 50).astype(src)
        if to in (TensorProto.INT8, TensorProto.UINT8):
            x = np.abs(x) % 100  # in range: out-of-range float -> int is undefined in ONNX
    else:
        x = R.integers(-5, 5, (3, 5)).astype(src)
    check_onnx(node("Cast", ["x"], to=to), {"x": x}, opset=opset)


@pytest.mark.parametrize("opset", [13, 19])
def test_cast_through_bfloat16(check_onnx, opset):
    """float -> bfloat16 -> float rounds to nearest even (onnxruntime cannot hand out bfloat16 arrays)."""
    x = randn(4, 8) * 100
    nodes = [node("Cast", ["x"], ["b"], to=TensorProto.BFLOAT16), node("Cast", ["b"], to=TensorProto.FLOAT)]
    check_onnx(nodes, {"x": x}, opset=opset, rtol=0, atol=0)


def test_cast_feeds_float_op(check_onnx):
    nodes = [node("Cast", ["i"], ["f"], to=TensorProto.FLOAT), node("Mul", ["f", "x"])]
    check_onnx(nodes, {"i": R.integers(0, 5, (2, 3)).astype(np.int64), "x": randn(2, 3)}, opset=13)


def test_cast_to_string_refused(make_model, convert):
    from tpubuild.errors import TpuBuildError

    model = make_model(node("Cast", ["x"], to=TensorProto.STRING), {"x": randn(2)}, opset=13)
    with pytest.raises(TpuBuildError, match="Cast to STRING is not supported"):
        convert(model, {"x": [2]})


# ---- reductions ------------------------------------------------------------------

REDUCE_OPS = list(top.REDUCE_MODES)
AXES_INPUT_SINCE = {op: 18 for op in REDUCE_OPS} | {"ReduceSum": 13}
REDUCE_AXES = [[1], [0, 2], [-1], [-3, -1], None]


def reduce_input(op):
    x = randn(2, 3, 4)
    if op == "ReduceLogSum":
        return np.abs(x) + 0.1
    if op == "ReduceProd":
        return (x * 0.5 + 1).astype(np.float32)
    return x


@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("axes", REDUCE_AXES, ids=str)
@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_axes_attribute(check_onnx, op, axes, keepdims):
    attrs = {"keepdims": keepdims} | ({} if axes is None else {"axes": axes})
    check_onnx(node(op, ["x"], **attrs), {"x": reduce_input(op)}, opset=AXES_INPUT_SINCE[op] - 1)


@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("axes", REDUCE_AXES, ids=str)
@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_axes_input(check_onnx, op, axes, keepdims):
    inits = {} if axes is None else {"axes": np.array(axes, np.int64)}
    ins = ["x"] if axes is None else ["x", "axes"]
    check_onnx(node(op, ins, keepdims=keepdims), {"x": reduce_input(op)}, initializers=inits, opset=18)


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean", "ReduceMax"])
@pytest.mark.parametrize("empty", ["absent", "empty_tensor"])
def test_reduce_noop_with_empty_axes(check_onnx, op, empty):
    """noop_with_empty_axes=1 and no axes: the input passes through unchanged."""
    ins, inits = ["x"], {}
    if empty == "empty_tensor":
        ins, inits = ["x", "axes"], {"axes": np.array([], np.int64)}
    got = check_onnx(node(op, ins, noop_with_empty_axes=1), {"x": randn(2, 3)}, initializers=inits, opset=18)
    assert got["y"].shape == (2, 3)


@pytest.mark.parametrize("op", ["ReduceMean", "ReduceMax", "ReduceProd", "ReduceL1", "ReduceSumSquare"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_reduce_integer(check_onnx, op, dtype):
    """Integer reductions stay integer; an integer mean truncates toward zero, as onnxruntime's."""
    x = R.integers(-7, 7, (3, 5)).astype(dtype)
    check_onnx(node(op, ["x"], axes=[1], keepdims=0), {"x": x}, opset=13)


def test_reduce_sum_opset13_int64(check_onnx):
    x = R.integers(-9, 9, (3, 4)).astype(np.int64)
    check_onnx(
        node("ReduceSum", ["x", "axes"], keepdims=0), {"x": x}, initializers={"axes": np.array([1], np.int64)}, opset=13
    )


def test_reduce_axes_from_graph_input_refused(make_model, convert):
    from tpubuild.errors import TpuBuildError

    model = make_model(node("ReduceSum", ["x", "axes"]), {"x": randn(2, 3), "axes": np.array([1], np.int64)}, opset=13)
    with pytest.raises(TpuBuildError, match="axes.*compile time"):
        convert(model, {"x": [2, 3], "axes": [1]})


ARG_CASES = [dict(), dict(axis=1), dict(axis=-1, keepdims=0), dict(axis=0, keepdims=0)]


@pytest.mark.parametrize("attrs", ARG_CASES, ids=str)
@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("opset", [11, 13])
def test_arg(check_onnx, op, attrs, opset):
    got = check_onnx(node(op, ["x"], **attrs), {"x": randn(3, 4, 5)}, opset=opset)
    assert got["y"].dtype == np.int64


@pytest.mark.parametrize("select_last_index", [0, 1])
@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
def test_arg_ties(check_onnx, op, select_last_index):
    x = R.integers(0, 3, (4, 6)).astype(np.float32)  # many ties
    check_onnx(node(op, ["x"], axis=1, select_last_index=select_last_index), {"x": x}, opset=12)


# ---- pooling, normalisation, softmax ---------------------------------------------


@pytest.mark.parametrize("shape", [(1, 3, 5, 7), (2, 4, 9), (1, 2, 3, 4, 5)], ids=str)
def test_global_max_pool(check_onnx, shape):
    check_onnx(node("GlobalMaxPool", ["x"]), {"x": randn(*shape)})


@pytest.mark.parametrize("shape", [(2, 3, 5, 4), (2, 3, 7), (1, 2, 3, 4, 2)], ids=str)
@pytest.mark.parametrize("opset", [6, 22])
def test_instance_normalization(check_onnx, shape, opset):
    c = shape[1]
    check_onnx(
        node("InstanceNormalization", ["x", "s", "b"], epsilon=1e-3),
        {"x": randn(*shape) * 3 + 1},
        initializers={"s": randn(c), "b": randn(c)},
        opset=opset,
    )


@pytest.mark.parametrize("groups", [1, 2, 6])
@pytest.mark.parametrize("shape", [(2, 6, 4, 3), (1, 6, 5)], ids=str)
def test_group_normalization_opset18_per_group_scale(check_onnx, shape, groups):
    """Opset 18: scale and bias have one value per group."""
    check_onnx(
        node("GroupNormalization", ["x", "s", "b"], num_groups=groups, epsilon=1e-4),
        {"x": randn(*shape) * 2 + 1},
        initializers={"s": randn(groups), "b": randn(groups)},
        opset=18,
    )


@pytest.mark.parametrize("groups", [1, 3, 6])
@pytest.mark.parametrize("shape", [(2, 6, 4, 3), (1, 6, 5)], ids=str)
def test_group_normalization_opset21_per_channel_scale(check_onnx, shape, groups):
    """Opset 21: scale and bias have one value per channel."""
    check_onnx(
        node("GroupNormalization", ["x", "s", "b"], num_groups=groups),
        {"x": randn(*shape) * 2 + 1},
        initializers={"s": randn(6), "b": randn(6)},
        opset=21,
    )


def test_group_normalization_opset21_runtime_scale(check_onnx):
    check_onnx(
        node("GroupNormalization", ["x", "s", "b"], num_groups=2),
        {"x": randn(2, 4, 3), "s": randn(4), "b": randn(4)},
        opset=21,
    )


def test_group_normalization_bad_groups_refused(make_model, convert):
    from tpubuild.errors import TpuBuildError

    model = make_model(
        node("GroupNormalization", ["x", "s", "b"], num_groups=4),
        {"x": randn(1, 6, 3)},
        initializers={"s": randn(6), "b": randn(6)},
        opset=21,
    )
    with pytest.raises(TpuBuildError, match="6 channels do not split into 4 groups"):
        convert(model, {"x": [1, 6, 3]})


LRN_CASES = [dict(size=3), dict(size=5, alpha=1e-3, beta=0.5, bias=2.0), dict(size=1), dict(size=7, alpha=0.01)]


@pytest.mark.parametrize("attrs", LRN_CASES, ids=str)
@pytest.mark.parametrize("opset", [1, 13])
def test_lrn(check_onnx, attrs, opset):
    check_onnx(node("LRN", ["x"], **attrs), {"x": randn(2, 6, 4, 3) * 3}, opset=opset)


@pytest.mark.parametrize("size", [2, 4])
def test_lrn_even_size(make_model, run_top, size):
    """onnxruntime refuses even sizes (and onnx's reference LRN loops over the batch, not the
    channels), so the reference is the spec's formula written out: the window then has one more
    channel after c than before."""
    x = (randn(2, 6, 3, 2) * 3).astype(np.float64)
    alpha, beta, bias = 0.01, 0.75, 1.0
    expect = np.empty_like(x)
    for c in range(x.shape[1]):
        lo, hi = max(0, c - (size - 1) // 2), min(x.shape[1] - 1, c + -(-(size - 1) // 2))
        square_sum = (x[:, lo : hi + 1] ** 2).sum(axis=1)
        expect[:, c] = x[:, c] / (bias + alpha / size * square_sum) ** beta
    model = make_model(node("LRN", ["x"], size=size, alpha=alpha), {"x": x.astype(np.float32)}, opset=13)
    got = run_top(model, {"x": x.astype(np.float32)})["y"]
    np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_log_softmax_opset11_flattens(check_onnx, axis):
    check_onnx(node("LogSoftmax", ["x"], axis=axis), {"x": randn(2, 3, 4) * 3}, opset=11)


@pytest.mark.parametrize("axis", [0, 1, 2, -1, None])
def test_log_softmax_opset13(check_onnx, axis):
    attrs = {} if axis is None else {"axis": axis}
    check_onnx(node("LogSoftmax", ["x"], **attrs), {"x": randn(2, 3, 4) * 3}, opset=13)


def test_log_softmax_large_values(check_onnx):
    check_onnx(node("LogSoftmax", ["x"]), {"x": np.array([[1000.0, 0.0, -1000.0]], np.float32)}, opset=13)


# ---- the IR they produce ----------------------------------------------------------


def test_new_ops_parse_upstream(make_model, convert, tmp_path):
    """A model using every new TOP op prints in generic form that upstream MLIR parses and verifies."""

    nodes = [
        node("LeakyRelu", ["x"], ["a"]),
        node("PRelu", ["a", "slope"], ["b"]),
        node("Elu", ["b"], ["c"]),
        node("Softplus", ["c"], ["d"]),
        node("Erf", ["d"], ["e"]),
        node("Gelu", ["e"], ["f"], approximate="tanh"),
        node("HardSigmoid", ["f"], ["g"]),
        node("HardSwish", ["g"], ["h"]),
        node("Mish", ["h"], ["i"]),
        node("Exp", ["i"], ["j"]),
        node("Log", ["j"], ["k"]),
        node("Pow", ["k", "two"], ["l"]),
        node("Pow", ["l", "x"], ["l3"]),
        node("Sqrt", ["l3"], ["m"]),
        node("Reciprocal", ["m"], ["n"]),
        node("Abs", ["n"], ["o"]),
        node("Floor", ["o"], ["p"]),
        node("Ceil", ["p"], ["q"]),
        node("Max", ["q", "x", "a"], ["r"]),
        node("Min", ["r", "x"], ["s"]),
        node("Greater", ["s", "x"], ["gt"]),
        node("Not", ["gt"], ["ngt"]),
        node("Where", ["ngt", "s", "x"], ["t"]),
        node("ArgMax", ["t"], ["am"], axis=1),
        node("Cast", ["am"], ["amf"], to=TensorProto.FLOAT),
        node("ReduceMean", ["t"], ["u"], axes=[2, 3]),
        node("GlobalMaxPool", ["t"], ["v"]),
        node("InstanceNormalization", ["t", "sc", "bi"], ["w"]),
        node("GroupNormalization", ["w", "sc", "bi"], ["gn"], num_groups=2),
        node("LRN", ["gn"], ["z"], size=3),
        node("LogSoftmax", ["z"], ["y"], axis=1),
        node("Sign", ["x"], ["e1"]),
        node("Round", ["e1"], ["e2"]),
        node("Sin", ["e2"], ["e3"]),
        node("Cos", ["e3"], ["e4"]),
        node("Softsign", ["e4"], ["e5"]),
        node("Celu", ["e5"], ["e6"]),
        node("ThresholdedRelu", ["e6"], ["e7"]),
        node("Shrink", ["e7"], ["e8"]),
        node("Swish", ["e8"], ["e9"]),
        node("Mod", ["e9", "two"], ["e10"], fmod=1),
        node("RMSNormalization", ["e10", "rms_scale"], ["e11"], axis=1),
        node("IsInf", ["e11"], ["inf"]),
        node("IsNaN", ["e11"], ["nan"]),
    ]
    inits = {"slope": randn(4, 1, 1), "two": np.array(2.0, np.float32), "sc": randn(4), "bi": randn(4)}
    inits["rms_scale"] = randn(4, 3, 3)
    model = make_model(
        nodes, {"x": randn(1, 4, 3, 3)}, ["y", "u", "v", "amf", "inf", "nan"], initializers=inits, opset=24
    )
    module, _ = convert(model, {"x": [1, 4, 3, 3]})
    names = {op.name for op in mlir.body_ops(module)}
    wanted = {
        cls.name
        for cls in (
            top.LeakyReluOp,
            top.PReluOp,
            top.EluOp,
            top.SoftplusOp,
            top.ErfOp,
            top.GELUOp,
            top.HardSigmoidOp,
            top.HardSwishOp,
            top.MishOp,
            top.ExpOp,
            top.LogOp,
            top.PowOp,
            top.Pow3Op,
            top.SqrtOp,
            top.ReciprocalOp,
            top.AbsOp,
            top.FloorOp,
            top.CeilOp,
            top.MaxOp,
            top.MinOp,
            top.CompareOp,
            top.WhereOp,
            top.ArgOp,
            top.CastOp,
            top.ReduceOp,
            top.MaxPoolOp,
            top.InstanceNormOp,
            top.GroupNormOp,
            top.LRNOp,
            top.SoftmaxOp,
            top.SignOp,
            top.RoundOp,
            top.SinOp,
            top.CosOp,
            top.SoftsignOp,
            top.CeluOp,
            top.ThresholdedReluOp,
            top.ShrinkOp,
            top.SwishOp,
            top.ModOp,
            top.RMSNormOp,
            top.IsInfOp,
            top.IsNaNOp,
        )
    }
    assert wanted <= names
    text = mlir.print_module(module)
    assert mlir.print_module(mlir.parse_module(text)) == text
    path = tmp_path / "math.mlir"
    path.write_text(text)
    upstream_check(path)


def test_every_issue3_math_op_is_registered():
    table = registry.supported()
    wanted = [
        "LeakyRelu",
        "PRelu",
        "Elu",
        "Selu",
        "Softplus",
        "Erf",
        "Gelu",
        "HardSigmoid",
        "HardSwish",
        "Mish",
        "Exp",
        "Log",
        "Pow",
        "Sqrt",
        "Reciprocal",
        "Abs",
        "Neg",
        "Floor",
        "Ceil",
        "Max",
        "Min",
        "Sum",
        "Mean",
        "Where",
        "Equal",
        "Less",
        "Greater",
        "Not",
        "And",
        "Cast",
        "ReduceMean",
        "ReduceSum",
        "ReduceMax",
        "ReduceMin",
        "ReduceProd",
        "ReduceL2",
        "ArgMax",
        "GlobalMaxPool",
        "InstanceNormalization",
        "GroupNormalization",
        "LRN",
        "LogSoftmax",
    ]
    assert [op for op in wanted if ("", op) not in table] == []
    assert table[("", "ReduceSum")] == [1, 13] and table[("", "ReduceMean")] == [1, 18]
    assert table[("", "GroupNormalization")] == [18, 21] and table[("", "LogSoftmax")] == [1, 13]


FLOAT8 = [TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E4M3FNUZ, TensorProto.FLOAT8E5M2, TensorProto.FLOAT8E5M2FNUZ]


@pytest.mark.parametrize("saturate", [0, 1])
@pytest.mark.parametrize("to", FLOAT8, ids=TensorProto.DataType.Name)
def test_cast_through_float8(check_onnx, to, saturate):
    """float -> float8 -> float: rounding, and out-of-range values/infinities clamped or not."""
    x = np.concatenate([randn(16) * 10, np.array([1e6, -1e6, np.inf, -np.inf, np.nan, 0.0, 500.0], np.float32)])
    nodes = [node("Cast", ["x"], ["f8"], to=to, saturate=saturate), node("Cast", ["f8"], to=TensorProto.FLOAT)]
    check_onnx(nodes, {"x": x}, opset=19, rtol=0, atol=0)


@pytest.mark.parametrize("to", [TensorProto.INT4, TensorProto.UINT4], ids=TensorProto.DataType.Name)
def test_cast_through_4bit(check_onnx, to):
    """Whole values only: for fractions onnxruntime rounds to nearest even while the ONNX test data
    (and ml_dtypes, and the C cast used for 8-bit and wider) truncate; the spec leaves it open."""
    x = np.arange(-8, 8, dtype=np.float32) if to == TensorProto.INT4 else np.arange(0, 16, dtype=np.float32)
    nodes = [node("Cast", ["x"], ["q"], to=to), node("Cast", ["q"], to=TensorProto.FLOAT)]
    check_onnx(nodes, {"x": x}, opset=21, rtol=0, atol=0)


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin", "ReduceSum", "ReduceProd", "ReduceLogSumExp"])
def test_reduce_empty_set(check_onnx, op):
    """Reducing over an empty axis gives the reduction's identity (-inf for max, 1 for prod...)."""
    check_onnx(
        node(op, ["x", "axes"], keepdims=1),
        {"x": np.zeros((2, 0, 3), np.float32)},
        initializers={"axes": np.array([1], np.int64)},
        opset=18,
    )


@pytest.mark.parametrize(
    "op, attrs", [("LpNormalization", {"axis": 1}), ("LpNormalization", {"p": 1}), ("MeanVarianceNormalization", {})]
)
def test_lp_and_mean_variance_normalization(check_onnx, op, attrs):
    x = randn(2, 3, 4, 5)
    x[0, :, 0, 0] = 0.0  # a zero norm along axis 1: onnxruntime gives 0 there, not 0 / 0
    x[1, :, :, -1] = 0.0  # and along the last axis
    check_onnx(node(op, ["x"], **attrs), {"x": x}, opset=13)


# ---- further activations and math ---------------------------------------------------

EXTRA_ACTIVATIONS = [
    ("Celu", {}, 12),
    ("Celu", {"alpha": 2.0}, 12),
    ("ThresholdedRelu", {}, 10),
    ("ThresholdedRelu", {"alpha": -0.5}, 22),
    ("Shrink", {}, 9),
    ("Shrink", {"bias": 1.5, "lambd": 2.0}, 9),
    ("Softsign", {}, 1),
    ("Swish", {}, 24),
    ("Swish", {"alpha": 1.702}, 24),
]


@pytest.mark.parametrize("op,attrs,opset", EXTRA_ACTIVATIONS, ids=lambda v: str(v))
def test_extra_activation(check_onnx, op, attrs, opset):
    check_onnx(node(op, ["x"], **attrs), {"x": wide(2, 3, 5)}, opset=opset)


def unit(*shape):
    """Inside (-1, 1), the domain of Asin, Acos and Atanh."""
    return np.tanh(randn(*shape)) * 0.999


TRIGONOMETRIC = {
    "Tan": lambda *s: np.clip(randn(*s), -1.4, 1.4),  # (below pi/2)
    "Asin": unit,
    "Acos": unit,
    "Atan": wide,
    "Sinh": lambda *s: randn(*s) * 3,
    "Cosh": lambda *s: randn(*s) * 3,
    "Asinh": wide,
    "Acosh": lambda *s: positive(*s) + 1,
    "Atanh": unit,
}


@pytest.mark.parametrize("op", TRIGONOMETRIC)
def test_trigonometric_and_hyperbolic(check_onnx, op):
    check_onnx(node(op, ["x"]), {"x": TRIGONOMETRIC[op](3, 5)}, opset=9)


@pytest.mark.parametrize("op", ["Round", "Sign", "Sin", "Cos"])
def test_extra_unary(check_onnx, op):
    x = wide(3, 5)
    if op == "Round":
        x.reshape(-1)[:6] = [0.5, 1.5, 2.5, -0.5, -1.5, 2.4999]  # halves go to even
    check_onnx(node(op, ["x"]), {"x": x}, opset=13)


def test_sign_int(check_onnx):
    check_onnx(node("Sign", ["x"]), {"x": R.integers(-3, 3, (4, 4)).astype(np.int64)}, opset=13)


@pytest.mark.parametrize("attrs", [{}, {"detect_positive": 0}, {"detect_negative": 0}], ids=str)
def test_isinf(check_onnx, attrs):
    x = np.array([np.inf, -np.inf, np.nan, 0.0, 1e38, -3.0], np.float32)
    got = check_onnx(node("IsInf", ["x"], **attrs), {"x": x}, opset=20)
    assert got["y"].dtype == np.bool_


def test_isnan(check_onnx):
    check_onnx(node("IsNaN", ["x"]), {"x": np.array([np.inf, np.nan, 0.0, -np.nan], np.float32)}, opset=13)


@pytest.mark.parametrize("fmod", [0, 1])
def test_mod_int(check_onnx, fmod):
    a = R.integers(-20, 20, (3, 4)).astype(np.int64)
    b = np.array([3, -3, 7, -5], np.int64)
    check_onnx(node("Mod", ["a", "b"], fmod=fmod), {"a": a, "b": b}, opset=13)


def test_mod_float_fmod(check_onnx):
    check_onnx(
        node("Mod", ["a", "b"], fmod=1), {"a": wide(3, 4), "b": np.array([1.5, -2.0, 0.7, -3.3], np.float32)}, opset=13
    )


@pytest.mark.parametrize("target", [np.int64, np.float16, np.bool_])
def test_castlike(check_onnx, target):
    like = np.zeros((1,), target)
    check_onnx(node("CastLike", ["x", "like"]), {"x": randn(3, 4) * 5, "like": like}, opset=15)


def test_castlike_constant_to_runtime_type_folds(make_model, check_against_ort, convert):
    """CastLike reads only its second input's type, so a constant first input stays a constant
    (here it feeds Pad's constant_value, which must be known at compile time)."""
    nodes = [node("CastLike", ["neg", "x"], ["value"]), node("Pad", ["x", "pads", "value"])]
    x = randn(2, 3)
    model = make_model(
        nodes,
        {"x": x},
        initializers={"neg": np.array(-7, np.int64), "pads": np.array([0, 1, 0, 2], np.int64)},
        opset=19,
    )
    check_against_ort(model, {"x": x})
    module, _ = convert(model, {"x": [2, 3]})
    assert not any(isinstance(op, top.CastOp) for op in mlir.body_ops(module))


@pytest.mark.parametrize("axis", [-1, 1, 0])
def test_rms_normalization(check_onnx, axis):
    x = randn(2, 3, 4) * 2
    check_onnx(
        node("RMSNormalization", ["x", "s"], axis=axis, epsilon=1e-4),
        {"x": x},
        initializers={"s": randn(*x.shape[axis:])},
        opset=23,
    )
