"""Comparing tensor sets by name; outputs paired by position; nothing compared = failure."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tpubuild.errors import TpuBuildError
from tpubuild.frontend import convert_onnx
from tpubuild.calib.calibrate import RESULT_LEVELS
from tpubuild.verify.compare import bounded_outputs, compare_tensors, jsonable, pair_tensors
from tpubuild.verify.reference import onnx_tensors, output_names
from tpubuild.verify.similarity import Tolerance

TOL = Tolerance(0.99, 0.9)


def test_pairs_by_name_then_outputs_by_position_and_shape():
    test = {"x": np.zeros(2), "out_a": np.ones((2, 3)), "out_b": np.ones(4)}
    ref = {"x": np.zeros(2), "y": np.ones((2, 3)), "z": np.ones(5)}
    pairs = pair_tensors(test, ref, test_outputs=["out_a", "out_b"], ref_outputs=["y", "z"])
    # out_b / z differ in shape: not paired
    assert pairs == [("x", "x"), ("out_a", "y")]


def test_report_counts_and_verdict():
    rng = np.random.default_rng(1)
    a = rng.standard_normal(100)
    report = compare_tensors({"t": a, "u": a}, {"t": a, "u": -a, "v": a}, TOL)
    assert report["compared"] == 2 and report["failed"] == 1 and not report["passed"]
    assert report["only_in_ref"] == ["v"] and report["only_in_test"] == []
    assert report["min_cos"] == pytest.approx(-1.0)
    json.dumps(jsonable(report), allow_nan=False)  # strict JSON, infinities as strings


def test_nothing_compared_fails():
    report = compare_tensors({"a": np.ones(3)}, {"b": np.ones(3)}, TOL)
    assert report["compared"] == 0 and not report["passed"]


def test_an_output_of_probabilities_is_close_within_a_16_bit_step(tmp_path):
    """A seal detector's map of a page without seals, all below 4e-7: BF16 off by up to 40% of each value is at
    a cosine of noise, and within 4 steps of a 16-bit probability; an error of 1e-3 is not."""
    nodes = [helper.make_node("Sigmoid", ["x"], ["p"]), helper.make_node("Relu", ["x"], ["r"])]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [64]) for n in ("p", "r")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), tmp_path / "m.onnx")
    module, _ = convert_onnx(tmp_path / "m.onnx", {"x": (64,)}, "m", "w.npz")
    atols = bounded_outputs(module)
    assert atols == {"p": 4 / RESULT_LEVELS}
    rng = np.random.default_rng(2)
    ref = rng.uniform(1e-8, 4e-7, 64)
    noisy = ref * rng.uniform(0.6, 1.4, 64)
    outs = {"p": noisy, "r": noisy}
    report = compare_tensors(
        outs, {"p": ref, "r": ref}, TOL, test_outputs=["p", "r"], ref_outputs=["p", "r"], decide="outputs", atols=atols
    )
    assert [(row["name"], row["label"]) for row in report["tensors"]] == [("p", "CLOSE"), ("r", "NOT SIMILAR")]
    far = compare_tensors({"p": ref + 1e-3}, {"p": ref}, TOL, atols=atols)
    assert not far["passed"]


def _two_node_model(path):
    w = np.arange(6, dtype=np.float32).reshape(3, 2) / 10
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"], name="mm"),
        helper.make_node("Relu", ["mm"], ["y"], name="relu"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])],
        initializer=[numpy_helper.from_array(w, "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return w


def test_reference_exposes_every_tensor(tmp_path):
    path = tmp_path / "m.onnx"
    w = _two_node_model(path)
    x = np.array([[1, -2, 3], [-4, 5, -6]], np.float32)
    got = onnx_tensors(path, {"x": x})
    assert set(got) == {"mm", "y"}
    np.testing.assert_allclose(got["mm"], x @ w, rtol=1e-6)
    np.testing.assert_allclose(got["y"], np.maximum(x @ w, 0), rtol=1e-6)
    assert output_names(path) == ["y"]


def test_reference_rejects_corrupt_onnx(tmp_path):
    path = tmp_path / "broken.onnx"
    _two_node_model(path)
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(TpuBuildError) as err:
        onnx_tensors(path, {"x": np.zeros((2, 3), np.float32)})
    assert str(path) in str(err.value) and "ONNX" in str(err.value)


def test_reference_names_a_missing_input(tmp_path):
    path = tmp_path / "m.onnx"
    _two_node_model(path)
    with pytest.raises(TpuBuildError, match="'x'"):
        onnx_tensors(path, {"other": np.zeros((2, 3), np.float32)})
