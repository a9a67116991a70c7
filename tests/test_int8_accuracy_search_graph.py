"""search:<model>/<target> in the doit graph: only INT8 targets of a manifest asking for it have one.

Drives `doit` in a subprocess on a temp manifest (".  task" = executed). The
model's calibration (KL on inputs with rare large values) leaves the INT8
output below the target, so the search has something to pin.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from tpubuild.lower.qtable import parse_quantize_table
from tpubuild.testing import run_doit, save_onnx, snapshot_code, tasks_marked

MANIFEST = """\
name: t
source: tiny.onnx
inputs:
  - name: x
    shape: [2, 4]
    range: [-1, 1]
calibration:
  data: calib/*.npz
  method: kl
{extra}targets:
  - {{chip: bm1684x, mode: F32}}
  - {{chip: bm1684x, mode: INT8}}
"""


def tiny_onnx(path: Path) -> None:
    rng = np.random.default_rng(7)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="h"),
        helper.make_node("Relu", ["h"], ["r"], name="r"),
        helper.make_node("MatMul", ["r", "w2"], ["y"], name="y"),
    ]
    save_onnx(
        path,
        nodes,
        {"x": [2, 4]},
        {"y": [2, 3]},
        {"w1": rng.standard_normal((4, 6)).astype(np.float32), "w2": rng.standard_normal((6, 3)).astype(np.float32)},
    )


class Zoo:
    def __init__(self, root: Path):
        self.models, self.build = root / "models", root / "build"
        self.code = snapshot_code(root / "code")  # sources edited during the run must not rebuild everything
        (self.models / "calib").mkdir(parents=True)
        tiny_onnx(self.models / "tiny.onnx")
        rng = np.random.default_rng(3)
        for i in range(6):
            x = rng.standard_normal((2, 4)).astype(np.float32)
            x[0, 0] *= 30.0  # rare large values: KL clips them
            np.savez(self.models / "calib" / f"s{i}.npz", x=x)

    def manifest(self, extra: str) -> None:
        (self.models / "t.yaml").write_text(MANIFEST.format(extra=extra))

    def doit(self, *args: str) -> set[str]:
        run = run_doit(*args, manifests=self.models, build=self.build, code=self.code)
        assert run.returncode == 0, run.stdout + run.stderr
        return tasks_marked(run.stdout)


@pytest.fixture
def zoo(tmp_path) -> Zoo:
    return Zoo(tmp_path)


LOWER = ["lower:t/bm1684x-F32", "lower:t/bm1684x-INT8"]


def test_search_feeds_int8_lowering_only_and_reruns_on_its_options(zoo):
    (zoo.models / "user.qtable").write_text("# the user's pin\nr F32\n")
    zoo.manifest("quantize_table: user.qtable\nmixed_precision: {search: true, target_cos: 0.999}\n")
    ran = zoo.doit(*LOWER)
    assert "search:t/bm1684x-INT8" in ran and not any(t.startswith("search:t/bm1684x-F32") for t in ran)
    text = (zoo.build / "t" / "bm1684x-INT8" / "qtable.txt").read_text()
    table = parse_quantize_table(text)
    assert table.get("r") == "F32"  # the user's entry, kept as written
    assert "# target: bm1684x-INT8" in text and "INT8 with the user table" in text
    assert not (zoo.build / "t" / "bm1684x-F32" / "qtable.txt").exists()

    assert zoo.doit(*LOWER) == set()  # nothing changed: nothing runs

    zoo.manifest("quantize_table: user.qtable\nmixed_precision: {search: true, target_cos: 0.5}\n")
    ran = zoo.doit(*LOWER)
    assert "search:t/bm1684x-INT8" in ran and "lower:t/bm1684x-F32" not in ran
    assert "calibrate:t" not in ran


def test_the_search_is_on_by_default_and_search_false_turns_it_off(zoo):
    zoo.manifest("")
    ran = zoo.doit(*LOWER)
    assert "search:t/bm1684x-INT8" in ran and "lower:t/bm1684x-INT8" in ran
    zoo.manifest("mixed_precision: {search: false}\n")
    ran = zoo.doit(*LOWER)
    assert "lower:t/bm1684x-INT8" in ran and not any(t.startswith("search:") for t in ran)
