"""What decides Tpu vs Top: the graph outputs (cos/euc, and top-1 and max abs error when bounded), never nothing.

TOP vs onnxruntime is judged on every tensor; Tpu vs Top, as TPU-MLIR's
model_deploy without --compare_all, on the graph outputs, every other tensor
compared and reported. A comparison that pairs no output fails.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tpubuild.build import stages
from tpubuild.errors import TpuBuildError
from tpubuild.verify.compare import compare_tensors
from tpubuild.verify.similarity import Tolerance

TOL = Tolerance(0.99, 0.9)


def test_outputs_decide_and_the_rest_is_reported():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(200), rng.standard_normal(48)
    test = {"inner": -b, "out": a}
    ref = {"inner": b, "out": a}
    report = compare_tensors(test, ref, TOL, test_outputs=["out"], ref_outputs=["out"], decide="outputs")
    assert report["passed"] and report["failed"] == 1 and report["decided_by"] == "graph outputs"
    assert {r["name"]: (r["passed"], r["output"]) for r in report["tensors"]} == {
        "inner": (False, False),
        "out": (True, True),
    }
    # the same comparison judged on every tensor fails
    assert not compare_tensors(test, ref, TOL, test_outputs=["out"], ref_outputs=["out"])["passed"]
    # a failing output fails
    bad = compare_tensors({**test, "out": -a}, ref, TOL, test_outputs=["out"], ref_outputs=["out"], decide="outputs")
    assert not bad["passed"]


def test_an_output_without_counterpart_is_a_failure_not_a_pass():
    a = np.ones(4)
    # the TPU output is renamed and its shape differs from TOP's: nothing pairs it
    report = compare_tensors(
        {"inner": a, "out_f32": np.ones(5)},
        {"inner": a, "out": a},
        TOL,
        test_outputs=["out_f32"],
        ref_outputs=["out"],
        decide="outputs",
    )
    assert report["compared"] == 1 and not report["passed"]
    # no outputs named at all: nothing can decide
    assert not compare_tensors({"x": a}, {"x": a}, TOL, decide="outputs")["passed"]
    assert not compare_tensors({"x": a}, {"y": a}, TOL)["passed"]


@pytest.fixture(scope="module")
def int8_target(tmp_path_factory):
    """A tiny classifier lowered to INT8 for bm1684x: (tpu.mlir, canonical.mlir, input.npz, top_outs.npz)."""
    d = tmp_path_factory.mktemp("verify")
    rng = np.random.default_rng(5)
    w = rng.standard_normal((6, 5)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"], name="mm"),
        helper.make_node("Relu", ["mm"], ["r"], name="r"),
        helper.make_node("Softmax", ["r"], ["y"], name="y", axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 5])],
        initializer=[numpy_helper.from_array(w, "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), d / "m.onnx")
    specs = [{"name": "x", "shape": [8, 6], "dtype": "float32", "range": [-1.0, 1.0]}]
    p = {
        k: str(d / k)
        for k in (
            "origin.mlir",
            "origin_weights.npz",
            "input.npz",
            "canonical.mlir",
            "canonical_weights.npz",
            "cali.mlir",
            "cali_table",
            "tpu.mlir",
            "tpu_weights.npz",
            "top_outs.npz",
            "origin_outs.npz",
            "onnx_outs.npz",
            "verify_top.json",
        )
    }
    stages.transform(str(d / "m.onnx"), specs, "m", None, p["origin.mlir"], p["origin_weights.npz"], p["input.npz"])
    stages.reference(str(d / "m.onnx"), p["input.npz"], p["onnx_outs.npz"])
    stages.canonicalize(p["origin.mlir"], p["origin_weights.npz"], p["canonical.mlir"], p["canonical_weights.npz"])
    stages.verify_top(
        "m",
        str(d / "m.onnx"),
        p["origin.mlir"],
        p["canonical.mlir"],
        p["input.npz"],
        p["onnx_outs.npz"],
        {"cos": 0.99999, "euc": 0.999},
        p["origin_outs.npz"],
        p["top_outs.npz"],
        p["verify_top.json"],
    )
    stages.calibrate(
        "m", p["canonical.mlir"], specs, [p["input.npz"]], None, "max", None, p["cali.mlir"], p["cali_table"]
    )
    stages.lower(
        "m", p["cali.mlir"], p["cali_table"], None, "bm1684x", "INT8", False, p["tpu.mlir"], p["tpu_weights.npz"]
    )
    return d, p


def verify(int8_target, tolerance: dict) -> dict:
    d, p = int8_target
    out = {k: str(d / f"{k}_{len(list(d.iterdir()))}") for k in ("outs.npz", "raw.npz", "v.json")}
    stages.verify_tpu(
        "m",
        "bm1684x-INT8",
        p["tpu.mlir"],
        p["canonical.mlir"],
        p["input.npz"],
        p["top_outs.npz"],
        tolerance,
        out["outs.npz"],
        out["raw.npz"],
        out["v.json"],
    )
    return json.loads(open(out["v.json"]).read())["comparisons"][0]


def test_verify_tpu_reports_max_abs_and_top1_per_output(int8_target):
    comp = verify(int8_target, {"cos": 0.9, "euc": 0.8})
    assert comp["passed"] and comp["decided_by"] == "graph outputs" and comp["compared"] >= 3
    (out,) = comp["outputs"]
    assert out["top1_agreement"] == 1.0 and 0 < out["max_abs"] < 0.05 and out["passed"]
    assert [r["output"] for r in comp["tensors"]].count(True) == 1


@pytest.mark.parametrize("bound, needle", [({"max_abs": 1e-9}, "max abs error"), ({"top1": 1.01}, "top-1 agreement")])
def test_verify_tpu_fails_an_output_beyond_its_bounds(int8_target, bound, needle):
    with pytest.raises(TpuBuildError, match=needle):
        verify(int8_target, {"cos": 0.9, "euc": 0.8, **bound})


def test_an_output_with_nan_names_them():
    ref = np.ones((2, 4), np.float32)
    test = ref.copy()
    test[0, :3] = np.nan
    (problem,) = stages._output_checks("y_f32", "y", test, ref, {})["problems"]
    assert problem.startswith("3 of 8 values NaN or infinite")
    assert stages._output_checks("y_f32", "y", ref, ref, {})["passed"]
