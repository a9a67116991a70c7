"""lower:<model>/<target> and verify_tpu:<model>/<target> in the doit graph, driven as a user drives it.

Which tasks ran is read from doit's console output (".  task" = executed,
"-- task" = up to date), on a small model in its own build tree.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tpubuild.testing import run_doit, snapshot_code, tasks_marked, upstream_check

REPO = Path(__file__).resolve().parents[1]

MANIFEST = """\
name: m
source: tiny.onnx
inputs:
  - name: x
    shape: [2, 8]
    range: [-1, 1]
calibration:
  data: calib/*.npz
  method: {method}
{extra}targets:
{targets}
"""


def target_lines(*targets: str) -> str:
    lines = []
    for t in targets:
        chip, mode, *asym = t.split("-")
        lines.append(f"  - {{chip: {chip}, mode: {mode}" + (", asymmetric: true}" if asym else "}"))
    return "\n".join(lines)


def tiny_onnx(path: Path) -> None:
    """y = softmax(relu(x @ w1 + b1) @ w2), batch fixed by the manifest."""
    rng = np.random.default_rng(1)
    inits = [
        numpy_helper.from_array(rng.standard_normal(s).astype(np.float32) * 0.5, n)
        for n, s in (("w1", (8, 16)), ("b1", (16,)), ("w2", (16, 4)))
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["mm"], name="mm"),
        helper.make_node("Add", ["mm", "b1"], ["add"], name="add"),
        helper.make_node("Relu", ["add"], ["act"], name="act"),
        helper.make_node("MatMul", ["act", "w2"], ["logits"], name="logits"),
        helper.make_node("Softmax", ["logits"], ["y"], name="y", axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        initializer=inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)


class Zoo:
    def __init__(self, root: Path):
        self.models = root / "models"
        self.build = root / "build"
        self.code = snapshot_code(root / "code")  # sources edited during the run must not rebuild everything
        (self.models / "calib").mkdir(parents=True)
        tiny_onnx(self.models / "tiny.onnx")
        rng = np.random.default_rng(2)
        for i in range(4):
            np.savez(self.models / "calib" / f"s{i}.npz", x=rng.uniform(-1, 1, (2, 8)).astype(np.float32))

    def manifest(self, *targets: str, method: str = "max", extra: str = "") -> None:
        (self.models / "m.yaml").write_text(MANIFEST.format(method=method, extra=extra, targets=target_lines(*targets)))

    def doit(self, *args: str) -> subprocess.CompletedProcess:
        return run_doit(*args, manifests=self.models, build=self.build, code=self.code)

    def compile(self) -> set[str]:
        run = self.doit("compile")
        assert run.returncode == 0, run.stdout + run.stderr
        return tasks_marked(run.stdout)


@pytest.fixture
def zoo(tmp_path) -> Zoo:
    return Zoo(tmp_path)


TARGET_STAGES = ("lower", "verify_tpu", "layergroup", "assign", "codegen", "run", "verify_chip", "report")


def target_tasks(*targets: str) -> set[str]:
    """Every stage of these targets; an INT8 target also searches its quantize table (on by default)."""
    return {f"{stage}:m/{t}" for t in targets for stage in TARGET_STAGES + (("search",) if "INT8" in t else ())}


def test_targets_build_verify_and_summarize(zoo):
    zoo.manifest("bm1684x-F32", "bm1684x-INT8", "bm1684x-INT8-asym", "cv183x-BF16")
    ran = zoo.compile()
    assert target_tasks("bm1684x-F32", "bm1684x-INT8", "bm1684x-INT8-asym", "cv183x-BF16") <= ran
    for t in ("bm1684x-F32", "bm1684x-INT8", "bm1684x-INT8-asym", "cv183x-BF16"):
        root = zoo.build / "m" / t
        searched = {"qtable.txt", "bias_correction.npz"} if "INT8" in t else set()
        assert {p.name for p in root.iterdir()} == searched | {
            "tpu.mlir",
            "tpu_weights.npz",
            "tpu_outs.npz",
            "tpu_raw.npz",
            "verify_tpu.json",
            "lg.mlir",
            "addr.mlir",
            "m.model",
            "chip_outs.npz",
            "profile.json",
            "verify.json",
            "report.html",
        }
        (comp,) = json.loads((root / "verify_tpu.json").read_text())["comparisons"]
        assert comp["passed"] and comp["compared"] >= 4, comp
        assert comp["min_cos"] >= 0.99, (t, comp["min_cos"])
        (out,) = comp["outputs"]
        assert out["ref_name"] == "y" and out["top1_agreement"] == 1.0 and out["max_abs"] < 0.05
    labels = {
        row["label"]
        for row in json.loads((zoo.build / "m" / "bm1684x-F32" / "verify_tpu.json").read_text())["comparisons"][0][
            "tensors"
        ]
    }
    assert labels == {"EQUAL"}
    raw = np.load(zoo.build / "m" / "bm1684x-INT8" / "tpu_raw.npz")
    assert raw["logits"].dtype == np.int8  # the stored bits, for the chip simulation to match
    summary = (zoo.build / "m" / "summary.txt").read_text()
    # two TOP levels, then per target its Tpu and Chip levels
    assert summary.count("PASS") == 10 and "bm1684x-INT8-asym/tpu.mlir" in summary
    assert "bm1684x-INT8/m.model vs tpu_raw.npz" in summary


def test_float_targets_never_wait_for_calibration(zoo):
    zoo.manifest("bm1684x-F32", "bm1684x-INT8")
    run = zoo.doit("lower:m/bm1684x-F32")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "calibrate:m" not in run.stdout
    run = zoo.doit("lower:m/bm1684x-INT8")
    assert ".  calibrate:m" in run.stdout


def test_changing_one_target_reruns_that_target_only(zoo):
    zoo.manifest("bm1684x-F32", "bm1684x-INT8")
    zoo.compile()
    zoo.manifest("bm1684x-F16", "bm1684x-INT8")
    assert zoo.compile() == target_tasks("bm1684x-F16") | {"compile:m"}
    zoo.manifest("bm1684x-F16", "bm1684x-INT8-asym")
    assert zoo.compile() == target_tasks("bm1684x-INT8-asym") | {"compile:m"}


def test_changing_calibration_method_reruns_int8_targets_only(zoo):
    zoo.manifest("bm1684x-F32", "bm1684x-INT8", "bm1684x-INT8-asym")
    zoo.compile()
    zoo.manifest("bm1684x-F32", "bm1684x-INT8", "bm1684x-INT8-asym", method="kl")
    ran = zoo.compile()
    assert {"calibrate:m", "lower:m/bm1684x-INT8", "lower:m/bm1684x-INT8-asym"} <= ran
    assert not {t for t in ran if "F32" in t}, ran


def test_quantize_table_content_reruns_lowering(zoo):
    (zoo.models / "qtable.txt").write_text("# pins\n")
    zoo.manifest("bm1684x-F32", "bm1684x-INT8", extra="quantize_table: qtable.txt\n")
    zoo.compile()
    assert zoo.compile() == set()
    f32 = (zoo.build / "m" / "bm1684x-F32" / "tpu.mlir").read_bytes()
    (zoo.models / "qtable.txt").write_text("logits F16\n")
    # the F32 target re-lowers, gets the same bytes (an entry never lowers precision) and stops there
    assert zoo.compile() == {"compile:m", "lower:m/bm1684x-F32"} | target_tasks("bm1684x-INT8")
    assert (zoo.build / "m" / "bm1684x-F32" / "tpu.mlir").read_bytes() == f32
    text = (zoo.build / "m" / "bm1684x-INT8" / "tpu.mlir").read_text()
    assert '"tpu.MatMul"' in text and 'xf16> loc("logits")' in text


@pytest.mark.parametrize("search", [True, False])
def test_the_quantize_table_lowering_reads_is_its_file_dep(zoo, search):
    """A user's quantize table is an input of the stages that read it (lowering; an INT8 target's verify_tpu, whose
    failure hint reads it), or the table the search made from it is."""
    from tpubuild.build.manifest import load_manifest
    from tpubuild.build.tasks import model_tasks

    (zoo.models / "qtable.txt").write_text("logits F16\n")
    extra = "quantize_table: qtable.txt\n" + ("" if search else "mixed_precision: {search: false}\n")
    zoo.manifest("bm1684x-F32", "bm1684x-INT8", extra=extra)
    tasks = {f"{t['basename']}:{t['name']}": t for t in model_tasks(load_manifest(zoo.models / "m.yaml"), zoo.build)}
    user, searched = str(zoo.models / "qtable.txt"), str(zoo.build / "m" / "bm1684x-INT8" / "qtable.txt")
    int8_table = searched if search else user
    assert user in tasks["lower:m/bm1684x-F32"]["file_dep"]
    assert int8_table in tasks["lower:m/bm1684x-INT8"]["file_dep"]
    assert int8_table in tasks["verify_tpu:m/bm1684x-INT8"]["file_dep"]
    assert user not in tasks["verify_tpu:m/bm1684x-F32"]["file_dep"]  # a float target's verification reads none
    if search:
        assert (
            user in tasks["search:m/bm1684x-INT8"]["file_dep"] and user not in tasks["lower:m/bm1684x-INT8"]["file_dep"]
        )


def test_unsupported_mode_is_refused_before_any_work(zoo):
    zoo.manifest("bm1684x-INT8", "cv183x-F32")
    run = zoo.doit("compile")
    assert run.returncode != 0
    out = run.stdout + run.stderr
    assert "cv183x does not support mode F32; it supports BF16, INT8" in out and "targets[1]" in out
    assert not any(line.startswith(".  ") and "compile" not in line for line in run.stdout.splitlines()), out
    assert not (zoo.build / "m").exists()


def test_unknown_chip_is_refused(zoo):
    zoo.manifest("bm9999-INT8")
    run = zoo.doit("compile")
    assert (
        run.returncode != 0 and "unknown chip 'bm9999'; known chips: bm1684x, bm1688, cv183x" in run.stdout + run.stderr
    )


def test_shipped_demo_cnn_int8_and_transformer(tmp_path):
    """The shipped manifests' targets verify: demo_cnn's INT8 at cos >= 0.99 on every tensor, and every
    tpu.mlir parses with upstream MLIR."""
    shipped = os.pathsep.join(str(REPO / "configs" / "models" / f"{m}.yaml") for m in ("demo_cnn", "tiny_transformer"))
    build = tmp_path / "build"
    run = run_doit("compile", manifests=shipped, build=build)
    assert run.returncode == 0, run.stdout + run.stderr
    (comp,) = json.loads((build / "demo_cnn" / "bm1684x-INT8" / "verify_tpu.json").read_text())["comparisons"]
    assert comp["passed"] and comp["compared"] >= 10 and comp["min_cos"] >= 0.99, comp["min_cos"]
    for path in sorted(build.glob("*/*/tpu.mlir")):
        upstream_check(path, "-o", os.devnull)
    assert len(list(build.glob("*/*/tpu.mlir"))) >= 3
