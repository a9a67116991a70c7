"""calibrate:<model> in the doit graph: only INT8 models have it, and a method change re-runs only it.

Drives `doit` in a subprocess on temp manifests, as tests/test_build_graph.py does
(".  task" = executed, "-- task" = up to date).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from tpubuild.testing import run_doit, save_onnx, snapshot_code, tasks_marked


MANIFEST = """\
name: {name}
source: tiny.onnx
inputs:
  - name: x
    shape: [{rows}, 4]
    range: [-1, 1]
{calibration}targets:
{targets}"""
CALIBRATION = """calibration:
  data: calib/*.npz
  method: {method}
"""
INT8 = "  - {chip: bm1684x, mode: F32}\n  - {chip: bm1684x, mode: INT8}\n"
F32 = "  - {chip: bm1684x, mode: F32}\n"
ROWS = 512


def tiny_onnx(path: Path) -> None:
    """y = Relu(x @ w + b) with a heavy-tailed x making KL and max disagree (more than
    calibrate.VECTOR_SIZE values per sample: smaller tensors take their max whatever the method)."""
    rng = np.random.default_rng(7)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["add"]),
        helper.make_node("Relu", ["add"], ["y"]),
    ]
    save_onnx(
        path,
        nodes,
        {"x": [ROWS, 4]},
        {"y": [ROWS, 3]},
        {"w": rng.standard_normal((4, 3)).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)},
    )


class Zoo:
    def __init__(self, root: Path):
        self.models, self.build = root / "models", root / "build"
        self.code = snapshot_code(root / "code")  # sources edited during the run must not rebuild everything
        (self.models / "calib").mkdir(parents=True)
        tiny_onnx(self.models / "tiny.onnx")
        rng = np.random.default_rng(3)
        for i in range(6):
            x = rng.standard_normal((ROWS, 4)).astype(np.float32)
            x[0, 0] *= 8.0  # a rare large value: clipped by KL, kept by max
            np.savez(self.models / "calib" / f"s{i}.npz", x=x)

    def manifest(self, name: str, *, method: str | None = "kl", targets: str = INT8) -> None:
        cal = CALIBRATION.format(method=method) if method else ""
        (self.models / f"{name}.yaml").write_text(
            MANIFEST.format(name=name, calibration=cal, targets=targets, rows=ROWS)
        )

    def doit(self, *args: str) -> subprocess.CompletedProcess:
        return run_doit(*args, manifests=self.models, build=self.build, code=self.code)


def executed(out: str) -> set[str]:
    return tasks_marked(out, ".  ")


@pytest.fixture
def zoo(tmp_path) -> Zoo:
    return Zoo(tmp_path)


def test_only_int8_models_calibrate(zoo):
    zoo.manifest("q")
    zoo.manifest("f", targets=F32)
    run = zoo.doit("compile")
    assert run.returncode == 0, run.stdout + run.stderr
    ran = executed(run.stdout)
    assert "calibrate:q" in ran and "calibrate:f" not in ran
    assert (zoo.build / "q" / "cali.mlir").is_file() and (zoo.build / "q" / "cali_table").is_file()
    assert not (zoo.build / "f" / "cali.mlir").exists()
    # 6 samples: the last is the test input (no test_input), sample 4 of the other 5 is held back for validation
    assert "# sample number: 4" in (zoo.build / "q" / "cali_table").read_text()


def test_method_change_reruns_only_calibration(zoo):
    zoo.manifest("q")
    zoo.manifest("r")
    assert zoo.doit("compile").returncode == 0
    before = (zoo.build / "q" / "cali_table").read_text()
    zoo.manifest("q", method="max")
    run = zoo.doit("compile")
    assert run.returncode == 0, run.stdout + run.stderr
    ran = executed(run.stdout)
    assert {"calibrate:q", "lower:q/bm1684x-INT8"} <= ran  # new thresholds: INT8 lowering again
    # the INT8 target's stages from lowering on, and nothing of the F32 target, earlier stages or model r
    int8_stages = ("search", "lower", "verify_tpu", "layergroup", "assign", "codegen", "run", "verify_chip", "report")
    assert ran <= {"calibrate:q", "compile:q"} | {f"{s}:q/bm1684x-INT8" for s in int8_stages}, ran
    assert (zoo.build / "q" / "cali_table").read_text() != before
    assert executed(zoo.doit("compile").stdout) == set()


def test_new_calibration_file_recalibrates(zoo):
    zoo.manifest("q")
    assert zoo.doit("compile").returncode == 0
    # sorted before the last sample (s5, the test input without test_input), which stays the test input
    np.savez(zoo.models / "calib" / "s0a.npz", x=np.full((ROWS, 4), 5.0, np.float32))
    run = zoo.doit("compile")
    assert run.returncode == 0, run.stdout
    assert "calibrate:q" in executed(run.stdout) and "canonicalize:q" not in executed(run.stdout)
    # transform reads the new file (it could have been the last) but makes the same input: nothing after it runs
    assert "transform:q" in executed(run.stdout) and "reference:q" not in executed(run.stdout)
    # 7 samples: s5 is the test input, sample 4 of the other 6 is held back for validation
    assert "# sample number: 5" in (zoo.build / "q" / "cali_table").read_text()


def test_int8_without_calibration_fails_clearly(zoo):
    zoo.manifest("q", method=None)
    run = zoo.doit("compile")
    assert run.returncode != 0
    assert "INT8 target but no `calibration` section" in run.stdout + run.stderr
    assert "Traceback" not in run.stdout + run.stderr
