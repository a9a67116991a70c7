"""Shared fixtures: one-node ONNX models checked against onnxruntime."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

# Builds in tests run their stages: the user's artifact cache would restore them from earlier
# runs (of other code), and tests would fill it. tests/test_cache.py uses its own, in a temp folder.
os.environ["TPUBUILD_ARTIFACT_CACHE"] = "off"


def make_onnx(
    nodes: Sequence[onnx.NodeProto] | onnx.NodeProto,
    inputs: Mapping[str, np.ndarray],
    outputs: Sequence[str] | None = None,
    *,
    initializers: Mapping[str, np.ndarray] | None = None,
    opset: int = 17,
    input_dims: Mapping[str, Sequence] | None = None,
    domains: Mapping[str, int] | None = None,
) -> onnx.ModelProto:
    """A model of ``nodes`` whose graph inputs are typed from ``inputs``.

    ``input_dims`` overrides a graph input's declared dims (e.g. ``["N", 3]`` to make
    it dynamic); ``domains`` adds opset imports of other domains. Outputs default to the last node's
    outputs and carry no type: onnxruntime infers them, and our frontend does not read them.
    """
    nodes = [nodes] if isinstance(nodes, onnx.NodeProto) else list(nodes)
    input_dims = input_dims or {}
    graph_inputs = [
        helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.dtype), input_dims.get(name, a.shape))
        for name, a in inputs.items()
    ]
    inits = [numpy_helper.from_array(np.asarray(a), name) for name, a in (initializers or {}).items()]
    outs = [onnx.ValueInfoProto(name=o) for o in (outputs or [o for o in nodes[-1].output if o])]
    graph = helper.make_graph(nodes, "test", graph_inputs, outs, initializer=inits)
    # ir_version 8 is read by every onnxruntime that runs opsets up to 18; newer opsets need 9+
    ir_version = 8 if opset <= 18 else 10
    opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, v) for d, v in (domains or {}).items()]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=ir_version)
    # onnx's shape inference types the outputs (the checker wants types); intermediates stay untyped
    typed = onnx.shape_inference.infer_shapes(model)
    del typed.graph.value_info[:]
    for out in typed.graph.output:
        if not out.type.tensor_type.HasField("shape"):
            out.ClearField("type")  # inference gave up (e.g. a data-dependent Reshape)
    return typed


def run_onnxruntime(model: onnx.ModelProto, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    return dict(zip(names, sess.run(names, dict(inputs)), strict=True))


def run_ours(
    model: onnx.ModelProto,
    inputs: Mapping[str, np.ndarray],
    tmp_path: Path,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, np.ndarray]:
    """Frontend -> TOP module (printed and re-parsed, as a stage file is) -> TOP inference."""
    from tpubuild.frontend import convert_onnx
    from tpubuild.ir import mlir
    from tpubuild.top.inference import run

    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    shapes = {k: v.shape for k, v in inputs.items()} if input_shapes is None else input_shapes
    module, weights = convert_onnx(path, shapes, "test", "test_weights.npz")
    module = mlir.parse_module(mlir.print_module(module))
    return run(module, weights, inputs)


def check_model(
    model: onnx.ModelProto, inputs: Mapping[str, np.ndarray], tmp_path: Path, *, rtol: float = 1e-4, atol: float = 1e-5
) -> dict[str, np.ndarray]:
    """Assert our TOP inference equals onnxruntime on every graph output (values and dtype)."""
    if all(o.type.HasField("tensor_type") for o in model.graph.output):
        onnx.checker.check_model(model)
    expect = run_onnxruntime(model, inputs)
    got = run_ours(model, inputs, tmp_path)
    for name, ref in expect.items():
        assert name in got, f"output {name!r} missing from TOP inference"
        ours = got[name]
        assert ours.shape == ref.shape, f"{name}: shape {ours.shape} != onnxruntime {ref.shape}"
        assert ours.dtype == ref.dtype, f"{name}: dtype {ours.dtype} != onnxruntime {ref.dtype}"
        if ref.dtype.kind in "biu":
            np.testing.assert_array_equal(ours, ref, err_msg=name)
        else:
            np.testing.assert_allclose(ours, ref, rtol=rtol, atol=atol, err_msg=name)
    return got


@pytest.fixture
def check_onnx(tmp_path):
    """``check_onnx(nodes, inputs, initializers=..., opset=..., rtol=..., atol=...)``: build a
    model of ``nodes`` and assert TOP inference matches onnxruntime on its outputs."""

    def check(nodes, inputs, outputs=None, *, initializers=None, opset=17, rtol=1e-4, atol=1e-5):
        model = make_onnx(nodes, inputs, outputs, initializers=initializers, opset=opset)
        return check_model(model, inputs, tmp_path, rtol=rtol, atol=atol)

    return check


@pytest.fixture
def make_model():
    """``make_model(nodes, inputs, outputs=None, initializers=..., opset=..., input_dims=...)``."""
    return make_onnx


@pytest.fixture
def attention_model():
    """``attention_model(batch)``: a transformer-ish block (q.k^T, softmax, residual add, LayerNorm, GELU,
    projection) on x [batch, 6, 16], for the lowering and chip tests."""

    def build(batch: int) -> onnx.ModelProto:
        rng = np.random.default_rng(11)

        def node(op, inputs, output, **attrs):
            return helper.make_node(op, list(inputs), [output], name=output, **attrs)

        def randn(*shape):
            return (rng.standard_normal(shape) * 0.3).astype(np.float32)

        nodes = [
            node("MatMul", ["x", "wq"], "q"),
            node("MatMul", ["x", "wk"], "k"),
            node("Transpose", ["k"], "kt", perm=[0, 2, 1]),
            node("MatMul", ["q", "kt"], "scores"),
            node("Softmax", ["scores"], "attn", axis=-1),
            node("MatMul", ["attn", "x"], "ctx"),
            node("Add", ["ctx", "x"], "res"),
            node("LayerNormalization", ["res", "g", "beta"], "ln", axis=-1),
            node("Gelu", ["ln"], "act"),
            node("MatMul", ["act", "wo"], "out"),
        ]
        inits = {
            "wq": randn(16, 16),
            "wk": randn(16, 16),
            "g": np.ones(16, np.float32),
            "beta": np.zeros(16, np.float32),
            "wo": randn(16, 8),
        }
        return make_onnx(nodes, {"x": np.zeros((batch, 6, 16), np.float32)}, initializers=inits, opset=20)

    return build


@pytest.fixture
def check_against_ort(tmp_path):
    """``check_against_ort(model, inputs, rtol=..., atol=...)`` for a model built by hand."""

    def check(model, inputs, *, rtol=1e-4, atol=1e-5):
        return check_model(model, inputs, tmp_path, rtol=rtol, atol=atol)

    return check


@pytest.fixture
def run_top(tmp_path):
    """``run_top(model, inputs) -> {tensor: array}``: frontend and TOP inference, no reference run."""

    def run(model, inputs):
        return run_ours(model, inputs, tmp_path)

    return run


@pytest.fixture
def convert(tmp_path):
    """``convert(model, shapes) -> (module, weights)``: save the model and run the frontend."""
    from tpubuild.frontend import convert_onnx

    def run(model, shapes):
        path = tmp_path / "model.onnx"
        onnx.save(model, path)
        return convert_onnx(path, shapes, "test", "test_weights.npz")

    return run


@pytest.fixture
def rng():
    return np.random.default_rng(0)
