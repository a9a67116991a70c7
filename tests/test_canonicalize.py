"""Canonicalize: each pattern's rewritten IR, and unchanged numerics (TOP before/after, onnxruntime).

Models are built as ONNX with onnx.helper, converted by the frontend, canonicalized,
printed, re-parsed and checked by upstream MLIR, then run: the canonical module must
give the origin module's values on every tensor name both still have, and
onnxruntime's on every name present in both.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from tpubuild.build.files import npz_bytes
from tpubuild.frontend import convert_onnx
from tpubuild.ir import mlir, top
from tpubuild.ir.mlir import GraphBuilder
from tpubuild.ir.types import shape_of, tensor_type
from tpubuild.ir.weights import WeightStore
from tpubuild.top.canonicalize import canonicalize
from tpubuild.top.inference import run
from tpubuild.verify.reference import onnx_tensors
from tpubuild.verify.similarity import cosine
from tpubuild.testing import upstream_check

R = np.random.default_rng(2025)
MODELS = Path(__file__).resolve().parent.parent / "models"
PLUMBING = (top.InputOp, top.WeightOp, top.NoneOp)


def randn(*shape, scale=1.0):
    return (R.standard_normal(shape) * scale).astype(np.float32)


def node(op, inputs, output, **attrs):
    return helper.make_node(op, list(inputs), [output], name=output, **attrs)


def upstream_parses(path: Path) -> None:
    upstream_check(path)


def compute_ops(module) -> list:
    return [op for op in mlir.body_ops(module) if isinstance(op, top.TopOp) and not isinstance(op, PLUMBING)]


def kinds(module) -> list[tuple[str, str]]:
    """(op name, tensor name) of every compute op, in order."""
    return [(op.name, op.loc_name) for op in compute_ops(module)]


def only_named(module, name: str):
    found = [op for op in compute_ops(module) if name in op.names]
    assert len(found) == 1, kinds(module)
    return found[0]


def only(module, cls):
    found = [op for op in compute_ops(module) if isinstance(op, cls)]
    assert len(found) == 1, kinds(module)
    return found[0]


def save_and_check(module, weights: WeightStore, tmp_path: Path):
    """Print, re-parse and upstream-check the canonical module; weights are exactly those it uses."""
    path = tmp_path / "canonical.mlir"
    path.write_text(mlir.print_module(module))
    upstream_parses(path)
    assert sorted(weights) == sorted(mlir.weight_names(module))
    assert mlir.module_attr(module, "state") == "TOP_F32"
    assert mlir.module_attr(module, "weight_file") == "canonical_weights.npz"
    return mlir.load_module(path)


def assert_same_values(before: dict, after: dict, *, rtol=1e-5, atol=1e-6) -> None:
    """allclose on every common name; ``atol`` is relative to the tensor's largest magnitude,
    since folding reorders float32 rounding and near-cancelling sums show it absolutely."""
    common = sorted(set(before) & set(after))
    assert common
    for name in common:
        scale = max(1.0, float(np.max(np.abs(before[name]), initial=0.0)))
        np.testing.assert_allclose(after[name], before[name], rtol=rtol, atol=atol * scale, err_msg=name)


def canon_onnx(tmp_path: Path, nodes, inputs: dict, outputs=None, initializers=None):
    """ONNX model -> (canonical module, origin module); numerics checked against origin and onnxruntime."""
    graph_inputs = [helper.make_tensor_value_info(k, onnx.TensorProto.FLOAT, v.shape) for k, v in inputs.items()]
    outs = [onnx.ValueInfoProto(name=o) for o in (outputs or [nodes[-1].output[0]])]
    inits = [onnx.numpy_helper.from_array(a, k) for k, a in (initializers or {}).items()]
    model = helper.make_model(
        helper.make_graph(nodes, "t", graph_inputs, outs, inits),
        opset_imports=[helper.make_opsetid("", 17)],
        ir_version=8,
    )
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    origin, weights = convert_onnx(path, {k: v.shape for k, v in inputs.items()}, "t", "origin_weights.npz")
    origin_text = mlir.print_module(origin)
    canonical, cweights = canonicalize(origin, weights, "canonical_weights.npz")
    assert mlir.print_module(origin) == origin_text, "canonicalize modified its input module"
    canonical = save_and_check(canonical, cweights, tmp_path)
    assert mlir.output_names(canonical) == mlir.output_names(origin)
    before, after = run(origin, weights, inputs), run(canonical, cweights, inputs)
    assert_same_values(before, after)
    ref = onnx_tensors(path, inputs)
    for name in mlir.output_names(canonical):
        assert name in ref
    assert_same_values(ref, after, rtol=1e-4, atol=1e-5)
    return canonical, origin, cweights


def canon_ir(builder_fn, tmp_path: Path, inputs: dict):
    """A module built by hand with GraphBuilder -> canonical; TOP numerics before/after compared."""
    module, weights = builder_fn()
    canonical, cweights = canonicalize(module, weights, "canonical_weights.npz")
    canonical = save_and_check(canonical, cweights, tmp_path)
    assert mlir.output_names(canonical) == mlir.output_names(module)
    assert_same_values(run(module, weights, inputs), run(canonical, cweights, inputs))
    return canonical, cweights


CONV = dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])


# ---- ReLU fusion ----------------------------------------------------------------


def test_relu_fused_into_conv(tmp_path):
    x = {"x": randn(1, 3, 8, 8)}
    nodes = [node("Conv", ["x", "w", "b"], "conv", **CONV), node("Relu", ["conv"], "relu")]
    canonical, _, _ = canon_onnx(tmp_path, nodes, x, initializers={"w": randn(4, 3, 3, 3), "b": randn(4)})
    assert kinds(canonical) == [("top.Conv", "relu")]
    p = only(canonical, top.ConvOp).params
    assert p.do_relu and p.relu_limit < 0


def test_relu_fused_into_matmul(tmp_path):
    nodes = [node("MatMul", ["x", "w"], "mm"), node("Relu", ["mm"], "act")]
    canonical, _, _ = canon_onnx(tmp_path, nodes, {"x": randn(2, 5, 8)}, initializers={"w": randn(8, 6)})
    assert kinds(canonical) == [("top.MatMul", "act")]
    assert only(canonical, top.MatMulOp).params.do_relu


def test_relu6_clip_fused_with_limit(tmp_path):
    nodes = [node("Conv", ["x", "w"], "conv", **CONV), node("Clip", ["conv", "lo", "hi"], "relu6")]
    inits = {"w": randn(4, 3, 3, 3), "lo": np.float32(0), "hi": np.float32(6)}
    canonical, _, _ = canon_onnx(tmp_path, nodes, {"x": randn(1, 3, 8, 8, scale=4)}, initializers=inits)
    assert kinds(canonical) == [("top.Conv", "relu6")]
    p = only(canonical, top.ConvOp).params
    assert p.do_relu and p.relu_limit == 6.0


def test_relu_then_clip_with_negative_min_fuses_both(tmp_path):
    nodes = [
        node("Conv", ["x", "w"], "conv", **CONV),
        node("Relu", ["conv"], "relu"),
        node("Clip", ["relu", "lo", "hi"], "clip"),
    ]
    inits = {"w": randn(4, 3, 3, 3), "lo": np.float32(-1), "hi": np.float32(2)}
    canonical, _, _ = canon_onnx(tmp_path, nodes, {"x": randn(1, 3, 8, 8, scale=3)}, initializers=inits)
    assert kinds(canonical) == [("top.Conv", "clip")]
    assert only(canonical, top.ConvOp).params.relu_limit == 2.0


def test_clip_with_negative_min_alone_is_not_a_relu(tmp_path):
    nodes = [node("Conv", ["x", "w"], "conv", **CONV), node("Clip", ["conv", "lo", "hi"], "clip")]
    inits = {"w": randn(4, 3, 3, 3), "lo": np.float32(-1), "hi": np.float32(2)}
    canonical, _, _ = canon_onnx(tmp_path, nodes, {"x": randn(1, 3, 8, 8, scale=3)}, initializers=inits)
    assert kinds(canonical) == [("top.Conv", "conv"), ("top.Clip", "clip")]
    assert not only(canonical, top.ConvOp).params.do_relu


def test_relu_not_fused_when_conv_has_another_user(tmp_path):
    nodes = [node("Conv", ["x", "w"], "conv", **CONV), node("Relu", ["conv"], "relu")]
    canonical, _, _ = canon_onnx(
        tmp_path, nodes, {"x": randn(1, 3, 8, 8)}, outputs=["relu", "conv"], initializers={"w": randn(4, 3, 3, 3)}
    )
    assert kinds(canonical) == [("top.Conv", "conv"), ("top.Relu", "relu")]
    assert not only(canonical, top.ConvOp).params.do_relu


def test_relu_fused_into_add(tmp_path):
    nodes = [node("Add", ["x", "y"], "sum"), node("Relu", ["sum"], "out")]
    canonical, _, _ = canon_onnx(tmp_path, nodes, {"x": randn(2, 6), "y": randn(2, 6)})
    assert kinds(canonical) == [("top.Add", "out")]
    assert only(canonical, top.AddOp).params.do_relu


def test_relu_after_sigmoid_stays(tmp_path):
    """Sigmoid carries no fused activation."""
    nodes = [node("Sigmoid", ["x"], "s"), node("Relu", ["s"], "out")]
    canonical, _, _ = canon_onnx(tmp_path, nodes, {"x": randn(2, 6)})
    assert kinds(canonical) == [("top.Sigmoid", "s"), ("top.Relu", "out")]


# ---- BatchNorm ----------------------------------------------------------------


def bn_inits(c: int, prefix: str = "bn") -> dict:
    return {
        f"{prefix}.scale": R.uniform(0.5, 1.5, c).astype(np.float32),
        f"{prefix}.bias": randn(c, scale=0.2),
        f"{prefix}.mean": randn(c, scale=0.2),
        f"{prefix}.var": R.uniform(0.5, 1.5, c).astype(np.float32),
    }


def bn_node(x: str, out: str, prefix: str = "bn"):
    return node(
        "BatchNormalization", [x] + [f"{prefix}.{k}" for k in ("scale", "bias", "mean", "var")], out, epsilon=1e-3
    )


@pytest.mark.parametrize("bias", [False, True])
def test_batchnorm_folded_into_conv(tmp_path, bias):
    inits = {"w": randn(6, 3, 3, 3), **bn_inits(6)}
    conv_in = ["x", "w"]
    if bias:
        inits["b"] = randn(6)
        conv_in.append("b")
    nodes = [node("Conv", conv_in, "conv", **CONV), bn_node("conv", "bn")]
    canonical, _, weights = canon_onnx(tmp_path, nodes, {"x": randn(2, 3, 7, 7)}, initializers=inits)
    assert kinds(canonical) == [("top.Conv", "bn")]
    conv = only(canonical, top.ConvOp)
    filt, b = (mlir.value_name(v) for v in conv.operands[1:])
    # new arrays under new names; the originals are no longer referenced and gone from the store
    assert filt != "w" and b != "b" and sorted(weights) == sorted([filt, b])
    inv = inits["bn.scale"].astype(np.float64) / np.sqrt(inits["bn.var"].astype(np.float64) + 1e-3)
    np.testing.assert_allclose(weights[filt], inits["w"] * inv[:, None, None, None], rtol=1e-6)
    b0 = inits.get("b", np.zeros(6, np.float32))
    np.testing.assert_allclose(weights[b], (b0 - inits["bn.mean"]) * inv + inits["bn.bias"], rtol=1e-5, atol=1e-7)


def test_batchnorm_folded_into_grouped_conv_then_relu(tmp_path):
    inits = {"w": randn(6, 1, 3, 3), **bn_inits(6)}
    nodes = [node("Conv", ["x", "w"], "conv", group=6, **CONV), bn_node("conv", "bn"), node("Relu", ["bn"], "relu")]
    canonical, _, _ = canon_onnx(tmp_path, nodes, {"x": randn(1, 6, 5, 5)}, initializers=inits)
    assert kinds(canonical) == [("top.Conv", "relu")]
    assert only(canonical, top.ConvOp).params.do_relu


def test_batchnorm_folded_into_deconv_then_relu(tmp_path):
    """DBNet's upsampling head: ConvTranspose, BatchNorm, ReLU -> one Deconv (filter [IC, OC, k, k])."""
    inits = {"w": randn(4, 6, 2, 2), **bn_inits(6)}
    nodes = [
        node("ConvTranspose", ["x", "w"], "up", strides=[2, 2]),
        bn_node("up", "bn"),
        node("Relu", ["bn"], "relu"),
    ]
    canonical, _, _ = canon_onnx(tmp_path, nodes, {"x": randn(1, 4, 5, 5)}, initializers=inits)
    assert kinds(canonical) == [("top.Deconv", "relu")]


@pytest.mark.parametrize("then, folds", [("Add", True), ("BatchNormalization", False)])
def test_grouped_deconv_takes_a_shift_but_not_a_scale(tmp_path, then, folds):
    """A grouped Deconv's filter axis 1 holds one group's output channels: a per-channel bias folds, a
    per-channel scale (the BatchNorm) stays an op of its own."""
    inits = {"w": randn(4, 3, 2, 2), "t": randn(1, 6, 1, 1), **bn_inits(6)}
    after = node("Add", ["up", "t"], "out") if then == "Add" else bn_node("up", "out")
    nodes = [node("ConvTranspose", ["x", "w"], "up", strides=[2, 2], group=2), after]
    canonical, _, _ = canon_onnx(tmp_path, nodes, {"x": randn(1, 4, 5, 5)}, initializers=inits)
    assert kinds(canonical) == ([("top.Deconv", "out")] if folds else [("top.Deconv", "up"), ("top.Conv", "out")])


def test_shared_filter_folded_separately(tmp_path):
    """Two convs share a filter; each BN makes its own copy, the shared original goes."""
    inits = {"w": randn(4, 3, 3, 3), **bn_inits(4, "bn1"), **bn_inits(4, "bn2")}
    nodes = [
        node("Conv", ["x", "w"], "c1", **CONV),
        bn_node("c1", "n1", "bn1"),
        node("Conv", ["x", "w"], "c2", **CONV),
        bn_node("c2", "n2", "bn2"),
        node("Add", ["n1", "n2"], "out"),
    ]
    canonical, _, weights = canon_onnx(tmp_path, nodes, {"x": randn(1, 3, 6, 6)}, initializers=inits)
    assert kinds(canonical) == [("top.Conv", "n1"), ("top.Conv", "n2"), ("top.Add", "out")]
    assert "w" not in weights and len(weights) == 4


def test_batchnorm_after_conv_with_two_users_becomes_depthwise_conv(tmp_path):
    inits = {"w": randn(4, 3, 3, 3), **bn_inits(4)}
    nodes = [node("Conv", ["x", "w"], "conv", **CONV), bn_node("conv", "bn"), node("Relu", ["bn"], "relu")]
    canonical, _, _ = canon_onnx(
        tmp_path, nodes, {"x": randn(1, 3, 6, 6)}, outputs=["relu", "conv"], initializers=inits
    )
    assert kinds(canonical) == [("top.Conv", "conv"), ("top.Conv", "relu")]
    dw = [op for op in canonical.walk() if isinstance(op, top.ConvOp)][1]
    assert dw.params.group == 4 and dw.params.kernel_shape == (1, 1) and dw.params.do_relu


def test_batchnorm_after_conv_with_runtime_filter_becomes_depthwise_conv(tmp_path):
    nodes = [node("Conv", ["x", "w"], "conv", **CONV), bn_node("conv", "bn")]
    canonical, _, _ = canon_onnx(
        tmp_path, nodes, {"x": randn(1, 3, 6, 6), "w": randn(4, 3, 3, 3)}, initializers=bn_inits(4)
    )
    assert kinds(canonical) == [("top.Conv", "conv"), ("top.Conv", "bn")]


def test_lone_batchnorm_becomes_depthwise_conv(tmp_path):
    canonical, _, weights = canon_onnx(
        tmp_path, [bn_node("x", "bn")], {"x": randn(2, 5, 4, 3)}, initializers=bn_inits(5)
    )
    assert kinds(canonical) == [("top.Conv", "bn")]
    conv = only(canonical, top.ConvOp)
    assert conv.params.group == 5 and weights[mlir.value_name(conv.operands[1])].shape == (5, 1, 1, 1)


def test_lone_batchnorm_not_nchw_becomes_mul_add(tmp_path):
    canonical, _, _ = canon_onnx(tmp_path, [bn_node("x", "bn")], {"x": randn(2, 5, 7)}, initializers=bn_inits(5))
    assert kinds(canonical) == [("top.Mul", "bn_mul"), ("top.Add", "bn")]


def test_densenet_preactivation_is_one_depthwise_conv(tmp_path):
    """Concat -> BatchNorm -> Caffe-style Scale (Mul, Add of Unsqueezed per-channel vectors) -> ReLU:
    a single depthwise Conv with the ReLU fused (one INT8 requantization instead of four)."""
    inits = {
        **bn_inits(6),
        "g": R.uniform(0.5, 1.5, 6).astype(np.float32),
        "t": randn(6, scale=0.1),
        "axes": np.array([1, 2], np.int64),
    }
    nodes = [
        node("Concat", ["x", "y"], "cat", axis=1),
        bn_node("cat", "bn"),
        node("Unsqueeze", ["g", "axes"], "g3"),
        node("Mul", ["bn", "g3"], "scaled"),
        node("Unsqueeze", ["t", "axes"], "t3"),
        node("Add", ["scaled", "t3"], "shifted"),
        node("Relu", ["shifted"], "out"),
    ]
    canonical, _, _ = canon_onnx(tmp_path, nodes, {"x": randn(1, 2, 5, 5), "y": randn(1, 4, 5, 5)}, initializers=inits)
    assert kinds(canonical) == [("top.Concat", "cat"), ("top.Conv", "out")]
    assert only(canonical, top.ConvOp).params.do_relu


def test_batchnorm_on_2d_folded_into_matmul(tmp_path):
    inits = {"w": randn(8, 5), "b": randn(5), **bn_inits(5)}
    nodes = [node("Gemm", ["x", "w", "b"], "fc"), bn_node("fc", "bn")]
    canonical, _, _ = canon_onnx(tmp_path, nodes, {"x": randn(3, 8)}, initializers=inits)
    assert kinds(canonical) == [("top.MatMul", "bn")]


# ---- Identity / Dropout ----------------------------------------------------------


def test_identity_and_dropout_removed(tmp_path):
    nodes = [
        node("Identity", ["x"], "i1"),
        node("Sigmoid", ["i1"], "s"),
        node("Dropout", ["s"], "d"),
        node("Tanh", ["d"], "out"),
    ]
    canonical, _, _ = canon_onnx(tmp_path, nodes, {"x": randn(2, 3)})
    assert kinds(canonical) == [("top.Sigmoid", "s"), ("top.Tanh", "out")]


def test_identity_output_name_moves_to_producer(tmp_path):
    nodes = [node("Sigmoid", ["x"], "s"), node("Identity", ["s"], "i1"), node("Identity", ["i1"], "out")]
    canonical, _, _ = canon_onnx(tmp_path, nodes, {"x": randn(2, 3)})
    assert kinds(canonical) == [("top.Sigmoid", "out")]
    assert mlir.output_names(canonical) == ["out"]


def test_identity_output_kept_when_its_input_is_also_an_output(tmp_path):
    nodes = [node("Sigmoid", ["x"], "s"), node("Identity", ["s"], "copy")]
    canonical, _, _ = canon_onnx(tmp_path, nodes, {"x": randn(2, 3)}, outputs=["s", "copy"])
    assert kinds(canonical) == [("top.Sigmoid", "s"), ("top.Identity", "copy")]


def test_identity_output_kept_when_its_input_has_another_user(tmp_path):
    nodes = [node("Sigmoid", ["x"], "s"), node("Identity", ["s"], "copy"), node("Tanh", ["s"], "t")]
    canonical, _, _ = canon_onnx(tmp_path, nodes, {"x": randn(2, 3)}, outputs=["copy", "t"])
    assert kinds(canonical) == [("top.Sigmoid", "s"), ("top.Identity", "copy"), ("top.Tanh", "t")]


def test_identity_output_renames_producer_once_dead_users_are_gone(tmp_path):
    nodes = [node("Sigmoid", ["x"], "s"), node("Identity", ["s"], "out"), node("Tanh", ["s"], "dangling")]
    canonical, _, _ = canon_onnx(tmp_path, nodes, {"x": randn(2, 3)}, outputs=["out"])
    assert kinds(canonical) == [("top.Sigmoid", "out")]


def test_identity_of_graph_input_as_output_kept(tmp_path):
    canonical, _, _ = canon_onnx(tmp_path, [node("Identity", ["x"], "out")], {"x": randn(2, 3)})
    assert kinds(canonical) == [("top.Identity", "out")]
    assert [op.loc_name for op in mlir.input_ops(canonical)] == ["x"]


# ---- constant folding and dead code --------------------------------------------------


def _const_graph():
    """y = x * (a + b) * transpose(c): the Add and the Permute only read weights."""
    rng = np.random.default_rng(5)  # the test rebuilds the graph for its expectations: same arrays
    a, b, c = (rng.standard_normal(s).astype(np.float32) for s in ((4,), (4,), (4, 1)))
    weights = WeightStore({"a": a, "b": b, "c": c})
    g = GraphBuilder([tensor_type((2, 4))])
    x = g.add(top.InputOp.make([g.args[0]], name="x")).results[0]
    s = g.add(
        top.AddOp.make([g.weight("a", tensor_type((4,))), g.weight("b", tensor_type((4,)))], name="a_plus_b")
    ).results[0]
    ct = g.add(top.PermuteOp.make([g.weight("c", tensor_type((4, 1)))], top.PermuteParams((1, 0)), name="c_t")).results[
        0
    ]
    y = g.add(top.MulOp.make([x, s], name="xs")).results[0]
    y = g.add(top.MulOp.make([y, ct], name="y")).results[0]
    return g.finish([y], name="t", weight_file="w.npz"), weights


def test_constant_ops_folded_into_weights(tmp_path):
    x = randn(2, 4)
    canonical, weights = canon_ir(_const_graph, tmp_path, {"x": x})
    assert kinds(canonical) == [("top.Mul", "xs"), ("top.Mul", "y")]
    _, original = _const_graph()
    assert sorted(weights) == ["a_plus_b", "c_t"]
    np.testing.assert_array_equal(weights["a_plus_b"], original["a"] + original["b"])
    np.testing.assert_array_equal(weights["c_t"], original["c"].T)
    np.testing.assert_allclose(
        run(canonical, weights, {"x": x})["y"], x * (original["a"] + original["b"]) * original["c"].T, rtol=1e-6
    )


def test_dead_ops_and_their_weights_removed(tmp_path):
    """A dangling branch (its output is no graph output) goes, with the weight only it used."""
    nodes = [
        node("Mul", ["x", "unused_w"], "dead1"),
        node("Sigmoid", ["dead1"], "dead2"),
        node("Add", ["x", "kept_w"], "out"),
    ]
    canonical, origin, weights = canon_onnx(
        tmp_path, nodes, {"x": randn(2, 3)}, outputs=["out"], initializers={"unused_w": randn(3), "kept_w": randn(3)}
    )
    assert ("top.Sigmoid", "dead2") in kinds(origin)
    assert kinds(canonical) == [("top.Add", "out")]
    assert sorted(weights) == ["kept_w"]


def test_unused_graph_input_kept(tmp_path):
    canonical, _, _ = canon_onnx(tmp_path, [node("Relu", ["x"], "out")], {"x": randn(2, 3), "unused": randn(4)})
    assert [op.loc_name for op in mlir.input_ops(canonical)] == ["x", "unused"]


# ---- Mul/Add/Sub by constants into Conv/MatMul --------------------------------------


def test_conv_mul_add_folded(tmp_path):
    inits = {"w": randn(4, 3, 3, 3), "b": randn(4), "s": randn(1, 4, 1, 1), "t": randn(4, 1, 1)}
    nodes = [
        node("Conv", ["x", "w", "b"], "conv", **CONV),
        node("Mul", ["s", "conv"], "scaled"),
        node("Add", ["scaled", "t"], "shifted"),
        node("Relu", ["shifted"], "out"),
    ]
    canonical, _, weights = canon_onnx(tmp_path, nodes, {"x": randn(1, 3, 6, 6)}, initializers=inits)
    assert kinds(canonical) == [("top.Conv", "out")]
    conv = only(canonical, top.ConvOp)
    assert conv.params.do_relu
    b = weights[mlir.value_name(conv.operands[2])]
    np.testing.assert_allclose(b, inits["b"] * inits["s"].ravel() + inits["t"].ravel(), rtol=1e-6)


def test_matmul_scalar_mul_and_sub_folded(tmp_path):
    inits = {"w": randn(8, 5), "k": np.float32(0.5), "c": randn(5)}
    nodes = [node("MatMul", ["x", "w"], "mm"), node("Mul", ["mm", "k"], "half"), node("Sub", ["half", "c"], "out")]
    canonical, _, _ = canon_onnx(tmp_path, nodes, {"x": randn(2, 3, 8)}, initializers=inits)
    assert kinds(canonical) == [("top.MatMul", "out")]


def test_matmul_add_bias_with_runtime_right_operand(tmp_path):
    """Adding a bias needs no constant weight: x @ y + c is a MatMul with bias."""
    nodes = [node("MatMul", ["x", "y"], "mm"), node("Add", ["mm", "c"], "out")]
    canonical, _, _ = canon_onnx(tmp_path, nodes, {"x": randn(3, 4), "y": randn(4, 5)}, initializers={"c": randn(5)})
    assert kinds(canonical) == [("top.MatMul", "out")]


@pytest.mark.parametrize("const_shape", [(8,), (1, 1, 8, 1)], ids=["along_w", "along_h"])
def test_add_not_per_channel_stays(tmp_path, const_shape):
    nodes = [node("Conv", ["x", "w"], "conv", **CONV), node("Add", ["conv", "c"], "out")]
    canonical, _, _ = canon_onnx(
        tmp_path, nodes, {"x": randn(1, 3, 8, 8)}, initializers={"w": randn(4, 3, 3, 3), "c": randn(*const_shape)}
    )
    assert kinds(canonical) == [("top.Conv", "conv"), ("top.Add", "out")]


def test_mul_that_broadcasts_result_larger_stays(tmp_path):
    nodes = [node("MatMul", ["x", "w"], "mm"), node("Mul", ["mm", "c"], "out")]
    canonical, _, _ = canon_onnx(
        tmp_path, nodes, {"x": randn(3, 4)}, initializers={"w": randn(4, 5), "c": randn(2, 1, 5)}
    )
    assert kinds(canonical) == [("top.MatMul", "mm"), ("top.Mul", "out")]


def test_mul_not_folded_through_relu(tmp_path):
    nodes = [node("Conv", ["x", "w"], "conv", **CONV), node("Relu", ["conv"], "r"), node("Mul", ["r", "s"], "out")]
    canonical, _, _ = canon_onnx(
        tmp_path, nodes, {"x": randn(1, 3, 5, 5)}, initializers={"w": randn(4, 3, 3, 3), "s": randn(1, 4, 1, 1)}
    )
    assert kinds(canonical) == [("top.Conv", "r"), ("top.Mul", "out")]


# ---- Softmax with a preceding scale -----------------------------------------------------


@pytest.mark.parametrize("op, c, beta", [("Div", 3.0, 1 / 3.0), ("Mul", 0.125, 0.125), ("Mul", -2.0, -2.0)])
def test_scalar_scale_folded_into_softmax(tmp_path, op, c, beta):
    nodes = [
        node("MatMul", ["q", "k"], "scores"),
        node(op, ["scores", "c"], "scaled"),
        node("Softmax", ["scaled"], "probs", axis=-1),
    ]
    canonical, _, _ = canon_onnx(
        tmp_path,
        nodes,
        {"q": randn(2, 4, 8, scale=2), "k": randn(2, 8, 4, scale=2)},
        initializers={"c": np.array(c, np.float32)},
    )
    assert kinds(canonical) == [("top.MatMul", "scores"), ("top.Softmax", "probs")]
    assert only(canonical, top.SoftmaxOp).params.beta == pytest.approx(beta)


def test_per_element_scale_not_folded_into_softmax(tmp_path):
    nodes = [node("Sigmoid", ["x"], "s"), node("Mul", ["s", "c"], "scaled"), node("Softmax", ["scaled"], "probs")]
    canonical, _, _ = canon_onnx(tmp_path, nodes, {"x": randn(2, 4)}, initializers={"c": randn(4)})
    assert kinds(canonical) == [("top.Sigmoid", "s"), ("top.Mul", "scaled"), ("top.Softmax", "probs")]


# ---- Reshape / Permute / Concat ------------------------------------------------------


def _shape(*dims):
    return np.array(dims, np.int64)


def test_reshape_chain_merged_and_noop_removed(tmp_path):
    nodes = [
        node("Sigmoid", ["x"], "s"),
        node("Reshape", ["s", "s1"], "r1"),
        node("Reshape", ["r1", "s2"], "r2"),
        node("Reshape", ["r2", "s3"], "r3"),
        node("Tanh", ["r3"], "out"),
    ]
    inits = {"s1": _shape(6, 4), "s2": _shape(2, 12), "s3": _shape(2, 3, 4)}
    canonical, _, _ = canon_onnx(tmp_path, nodes, {"x": randn(2, 3, 4)}, initializers=inits)
    assert kinds(canonical) == [("top.Sigmoid", "s"), ("top.Tanh", "out")]


def test_reshape_chain_merged_into_last(tmp_path):
    nodes = [node("Reshape", ["x", "s1"], "r1"), node("Reshape", ["r1", "s2"], "r2"), node("Tanh", ["r2"], "out")]
    inits = {"s1": _shape(6, 4), "s2": _shape(4, 6)}
    canonical, _, _ = canon_onnx(tmp_path, nodes, {"x": randn(2, 3, 4)}, initializers=inits)
    assert kinds(canonical) == [("top.Reshape", "r2"), ("top.Tanh", "out")]
    assert only(canonical, top.ReshapeOp).params.shape == (4, 6)


def test_permute_chain_composed(tmp_path):
    nodes = [node("Transpose", ["x"], "t1", perm=[0, 2, 3, 1]), node("Transpose", ["t1"], "t2", perm=[0, 2, 1, 3])]
    x = randn(2, 3, 4, 5)
    canonical, _, _ = canon_onnx(tmp_path, nodes, {"x": x})
    assert kinds(canonical) == [("top.Permute", "t2")]
    order = only(canonical, top.PermuteOp).params.order
    assert np.transpose(x, order).shape == np.transpose(np.transpose(x, (0, 2, 3, 1)), (0, 2, 1, 3)).shape
    assert order == (0, 3, 2, 1)


def test_inverse_permutes_cancel_with_output_name_kept(tmp_path):
    nodes = [
        node("Sigmoid", ["x"], "s"),
        node("Transpose", ["s"], "t1", perm=[0, 2, 3, 1]),
        node("Transpose", ["t1"], "out", perm=[0, 3, 1, 2]),
    ]
    canonical, _, _ = canon_onnx(tmp_path, nodes, {"x": randn(2, 3, 4, 5)})
    assert kinds(canonical) == [("top.Sigmoid", "out")]


def test_permute_of_unit_dims_becomes_reshape(tmp_path):
    nodes = [node("Sigmoid", ["x"], "s"), node("Transpose", ["s"], "t", perm=[1, 0, 2]), node("Tanh", ["t"], "out")]
    canonical, _, _ = canon_onnx(tmp_path, nodes, {"x": randn(1, 4, 5)})
    assert kinds(canonical) == [("top.Sigmoid", "s"), ("top.Reshape", "t"), ("top.Tanh", "out")]


def test_single_input_concat_removed(tmp_path):
    nodes = [node("Sigmoid", ["x"], "s"), node("Concat", ["s"], "c", axis=1), node("Tanh", ["c"], "out")]
    canonical, _, _ = canon_onnx(tmp_path, nodes, {"x": randn(2, 3)})
    assert kinds(canonical) == [("top.Sigmoid", "s"), ("top.Tanh", "out")]


def test_empty_concat_input_dropped(tmp_path):
    """x[:, 3:] of a 3-channel x, joined back (as RivaGAN's encoder does): the Concat is x alone."""
    nodes = [
        node("Sigmoid", ["x"], "s"),
        node("Slice", ["s", "three", "end", "axes"], "rest"),
        node("Concat", ["s", "rest"], "c", axis=1),
        node("Tanh", ["c"], "out"),
    ]
    inits = {"three": _shape(3), "end": _shape(2**62), "axes": _shape(1)}
    canonical, _, _ = canon_onnx(tmp_path, nodes, {"x": randn(1, 3, 4)}, initializers=inits)
    assert kinds(canonical) == [("top.Sigmoid", "s"), ("top.Tanh", "out")]


def _yolov8_head(cut: str):
    """Two levels of a YOLOv8 head: per level Concat(box, cls) on channels, Reshape to [1, C, H*W], the levels
    concatenated on anchors, then box and cls taken apart again (``cut``: a Split or two Slices), the class part
    through a Sigmoid."""
    nodes, inits = [], {}
    for level, hw in enumerate((4, 2)):
        nodes += [
            node("Sigmoid", [f"x{level}"], f"box{level}"),
            node("Tanh", [f"y{level}"], f"cls{level}"),
            node("Concat", [f"box{level}", f"cls{level}"], f"cat{level}", axis=1),
            node("Reshape", [f"cat{level}", f"shape{level}"], f"flat{level}"),
        ]
        inits[f"shape{level}"] = _shape(1, 7, hw * hw)
    nodes.append(node("Concat", ["flat0", "flat1"], "joint", axis=2))
    if cut == "slice":
        nodes.append(node("Slice", ["joint", "zero", "four", "axes"], "boxes"))
        nodes.append(node("Slice", ["joint", "four", "seven", "axes"], "scores"))
        inits |= {"zero": _shape(0), "four": _shape(4), "seven": _shape(7), "axes": _shape(1)}
    else:
        nodes.append(helper.make_node("Split", ["joint", "sizes"], ["boxes", "scores"], name="split", axis=1))
        inits["sizes"] = _shape(4, 3)
    nodes += [node("Exp", ["boxes"], "box_out"), node("Sigmoid", ["scores"], "score_out")]
    inputs = {"x0": randn(1, 4, 4, 4), "y0": randn(1, 3, 4, 4), "x1": randn(1, 4, 2, 2), "y1": randn(1, 3, 2, 2)}
    return nodes, inputs, ["box_out", "score_out"], inits


@pytest.mark.parametrize("cut", ["split", "slice"])
def test_split_of_a_yolov8_head_takes_its_parts_from_the_concat_inputs(tmp_path, cut):
    nodes, inputs, outputs, inits = _yolov8_head(cut)
    canonical, _, _ = canon_onnx(tmp_path, nodes, inputs, outputs=outputs, initializers=inits)
    assert not [op for op in compute_ops(canonical) if isinstance(op, top.SplitOp | top.SliceOp)]
    assert not [op for op in compute_ops(canonical) if {"joint", "cat0", "flat1"} & set(op.names)]  # the chain went
    scores = mlir.value_name(only_named(canonical, "score_out").operands[0])
    joined = only_named(canonical, scores)
    # the sigmoid reads a Concat of the levels' class parts alone: [1, 3, 16 + 4]
    assert isinstance(joined, top.ConcatOp) and shape_of(joined.results[0].type) == (1, 3, 20)
    assert [mlir.value_name(x.owner.operands[0]) for x in joined.operands] == ["cls0", "cls1"]


@pytest.mark.parametrize("sizes", [(5, 2), (4, 0, 3)])
def test_split_across_the_concat_inputs_or_with_an_empty_piece_stays(tmp_path, sizes):
    nodes, inputs, outputs, inits = _yolov8_head("split")
    inits["sizes"] = _shape(*sizes)
    split = next(n for n in nodes if n.op_type == "Split")
    split.output[:] = ["boxes", "empty", "scores"] if 0 in sizes else ["boxes", "scores"]
    canonical, _, _ = canon_onnx(tmp_path, nodes, inputs, outputs=outputs, initializers=inits)
    assert isinstance(only(canonical, top.SplitOp).operands[0].owner, top.ConcatOp)


# ---- whole models ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "model, input_name, shape",
    [
        ("demo_cnn", "input", (1, 3, 32, 32)),
        ("tiny_transformer", "tokens", (1, 16, 64)),
    ],
)
def test_shipped_models_match_onnxruntime(tmp_path, model, input_name, shape):
    path = MODELS / f"{model}.onnx"
    origin, weights = convert_onnx(path, {input_name: shape}, model, "origin_weights.npz")
    canonical, cweights = canonicalize(origin, weights, "canonical_weights.npz")
    canonical = save_and_check(canonical, cweights, tmp_path)
    inputs = {input_name: np.random.default_rng(0).standard_normal(shape).astype(np.float32)}
    ref = onnx_tensors(path, inputs)
    got = run(canonical, cweights, inputs)
    common = sorted(set(ref) & set(got))
    assert set(mlir.output_names(canonical)) <= set(common)
    assert len(common) >= 10
    for name in common:
        assert cosine(got[name], ref[name]) >= 0.99999, name
    assert_same_values(run(origin, weights, inputs), got, rtol=1e-4, atol=1e-5)
    if model == "demo_cnn":
        ops = compute_ops(canonical)
        assert not [op for op in ops if isinstance(op, top.BatchNormOp | top.IdentityOp)]
        for op in ops:
            if isinstance(op, top.ReluOp | top.ClipOp):
                assert not isinstance(op.operands[0].owner, top.ConvOp), op.loc_name
        assert sum(isinstance(op, top.ConvOp) and op.params.do_relu for op in ops) == 3
    else:
        assert only(canonical, top.SoftmaxOp).params.beta == pytest.approx(0.25)
        assert not [op for op in compute_ops(canonical) if isinstance(op, top.DivOp)]


def test_input_weight_store_left_alone(tmp_path):
    origin, weights = convert_onnx(MODELS / "demo_cnn.onnx", {"input": (1, 3, 32, 32)}, "demo_cnn", "w.npz")
    before = {n: weights[n].copy() for n in weights}
    _, cweights = canonicalize(origin, weights, "c.npz")
    assert sorted(weights) == sorted(before)
    for n in before:
        np.testing.assert_array_equal(weights[n], before[n])
    assert "stem.weight" not in cweights  # folded with its BatchNorm into a new array


def test_deterministic(tmp_path):
    path = MODELS / "demo_cnn.onnx"
    outs = []
    for _ in range(2):
        origin, weights = convert_onnx(path, {"input": (1, 3, 32, 32)}, "demo_cnn", "w.npz")
        canonical, cweights = canonicalize(origin, weights, "c.npz")
        outs.append((mlir.print_module(canonical), npz_bytes({n: cweights[n] for n in cweights})))
    assert outs[0] == outs[1]
