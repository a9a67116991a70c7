"""The default test input: the calibration sample calibration holds back (calib/data.py, split_test_sample).

Without `test_input`, a model with calibration data is verified on the last calibration sample (sorted file
order, after `count`), and no reader of calibration samples (calibrate, the search, a prepare step) reads it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tpubuild.calib.data import Samples, split_test_sample
from tpubuild.testing import run_doit, tasks_marked

SPEC = [{"name": "x", "shape": [1, 3, 4, 4]}]


def _stacks(tmp_path: Path, counts: list[int]) -> list[Path]:
    rng = np.random.default_rng(0)
    files = []
    for i, n in enumerate(counts):
        files.append(tmp_path / f"s{i}.npz")
        np.savez(files[-1], x=rng.standard_normal((n, 1, 3, 4, 4)).astype(np.float32))
    return files


def test_held_back_is_the_last_sample_after_count(tmp_path):
    files = _stacks(tmp_path, [2, 3, 2])
    every = list(Samples.of(files, SPEC))
    for count, last in ((None, 6), (4, 3), (7, 6), (100, 6)):
        used, held = split_test_sample(Samples.of(files, SPEC, count))
        got = list(used)
        assert held is not None and len(got) == last and held.used == last
        for a, b in zip(got, every[:last], strict=True):
            np.testing.assert_array_equal(a["x"], b["x"])
        np.testing.assert_array_equal(held.read()["x"], every[last]["x"])
    assert (
        split_test_sample(Samples.of(files, SPEC, 4))[1].describe().startswith("calibration sample s1.npz [sample 1]")
    )
    # one sample: calibration needs it, nothing is held back
    one = Samples.of(files[:1], SPEC, 1)
    assert split_test_sample(one) == (one, None)


def test_held_back_npy_and_images(tmp_path):
    from PIL import Image

    np.save(tmp_path / "a.npy", np.arange(2 * 48, dtype=np.float32).reshape(2, 1, 3, 4, 4))
    used, held = split_test_sample(Samples.of([tmp_path / "a.npy"], SPEC))
    assert len(list(used)) == 1 and held.read()["x"][0, 0, 0, 0] == 48
    paths = []
    for i in range(5):  # two images a sample: the fifth makes no sample
        paths.append(tmp_path / f"i{i}.png")
        Image.fromarray(np.full((4, 4, 3), i * 10, np.uint8)).save(paths[-1])
    spec = [{"name": "x", "shape": [2, 3, 4, 4]}]
    used, held = split_test_sample(Samples.of(paths, spec))
    assert [s["x"][0, 0, 0, 0] for s in used] == [0.0] and held.read()["x"][:, 0, 0, 0].tolist() == [20.0, 30.0]
    assert "i2.png, i3.png" in held.describe()


# ---- through doit: the test input, calibration's statistics and the file dependency ---------------------

MANIFEST = """\
name: m
source: m.onnx
inputs:
  - name: x
    shape: [1, 3, 8, 8]
calibration:
  data: calib/*.npz
  method: max
targets:
  - {chip: bm1684x, mode: INT8}
"""


TEST_S3 = "test_input: calib/s3.npz\n"


def _model(path: Path) -> None:
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((4, 3, 3, 3)) * 0.3).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="c", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["y"], name="y"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        initializer=[numpy_helper.from_array(w, "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("held")
    models, build = root / "models", root / "build"
    (models / "calib").mkdir(parents=True)
    _model(models / "m.onnx")
    rng = np.random.default_rng(1)
    for i in range(4):
        x = rng.uniform(-1, 1, (1, 3, 8, 8)).astype(np.float32)
        if i == 3:
            x[0, 0, 0, 0] = 1.5  # only the held-back sample reaches past 1: calibration's max would show it
        np.savez(models / "calib" / f"s{i}.npz", x=x)
    (models / "m.yaml").write_text(MANIFEST)
    # the same model verified on a calibration file it names itself
    (models / "t.yaml").write_text(
        MANIFEST.replace("name: m", "name: t").replace("calibration:", TEST_S3 + "calibration:")
    )
    run = run_doit("compile", manifests=models, build=build, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    return models, build, run


def test_verifies_on_the_held_back_sample_that_calibration_never_reads(built):
    from tpubuild.build.files import read_npz
    from tpubuild.calib.table import read_table

    models, build, run = built
    held = np.load(models / "calib" / "s3.npz")["x"]
    np.testing.assert_array_equal(read_npz(build / "m" / "input.npz")["x"], held)
    header, entries = read_table(build / "m" / "cali_table")
    assert entries["x"].max < 1.0 and any("sample number: 3" in h for h in header), (header, entries["x"])
    source = json.loads((build / "m" / "bm1684x-INT8" / "verify.json").read_text())["test_input"]
    assert source == "calibration sample s3.npz [sample 0] (held back: calibration reads the 3 samples before it)"
    summary = (build / "m" / "summary.txt").read_text()
    assert f"test input: {source}" in summary
    assert "Test input: calibration sample s3.npz" in (build / "m" / "bm1684x-INT8" / "report.html").read_text()


def test_a_test_input_among_the_calibration_files_is_left_out_of_calibration(built):
    """A test_input that the calibration glob also names is verified on as given, and no calibration stage
    reads it: its 1.5 would set calibration's maximum."""
    from tpubuild.build.files import read_npz
    from tpubuild.calib.table import read_table

    models, build, _ = built
    np.testing.assert_array_equal(read_npz(build / "t" / "input.npz")["x"], np.load(models / "calib" / "s3.npz")["x"])
    header, entries = read_table(build / "t" / "cali_table")
    assert entries["x"].max < 1.0 and any("sample number: 3" in h for h in header), (header, entries["x"])
    source = json.loads((build / "t" / "bm1684x-INT8" / "verify.json").read_text())["test_input"]
    assert source == "test_input s3.npz (from the manifest; calibration leaves it out)"


def test_a_new_held_back_sample_remakes_the_test_input(built):
    """transform's file_dep holds the calibration files: a changed last sample re-makes input.npz."""
    from tpubuild.build.files import read_npz

    models, build, _ = built
    x = np.full((1, 3, 8, 8), 0.25, np.float32)
    np.savez(models / "calib" / "s3.npz", x=x)
    run = run_doit("transform:m", manifests=models, build=build, timeout=600)
    assert run.returncode == 0 and "transform:m" in tasks_marked(run.stdout), run.stdout
    np.testing.assert_array_equal(read_npz(build / "m" / "input.npz")["x"], x)


def test_calibration_files_leave_out_the_test_input_only_when_others_remain(tmp_path):
    from tpubuild.build.manifest import load_manifest
    from tpubuild.build.tasks import calibration_files

    (tmp_path / "calib").mkdir()
    for i in range(3):
        np.savez(tmp_path / "calib" / f"s{i}.npz", x=np.zeros((1, 3, 8, 8), np.float32))
    _model(tmp_path / "m.onnx")

    def files(manifest: str, data: str = "calib/*.npz"):
        (tmp_path / "m.yaml").write_text(manifest.replace("calib/*.npz", data))
        got, left_out = calibration_files(load_manifest(tmp_path / "m.yaml"))
        return [Path(f).name for f in got], left_out

    assert files(MANIFEST) == (["s0.npz", "s1.npz", "s2.npz"], None)
    with_test = MANIFEST.replace("calibration:", "test_input: calib/s1.npz\ncalibration:")
    assert files(with_test) == (["s0.npz", "s2.npz"], "calib/s1.npz")
    assert files(with_test, "calib/s[02].npz") == (["s0.npz", "s2.npz"], None)  # not one of them
    assert files(with_test, "calib/s1.npz") == (["s1.npz"], None)  # the only one: calibration needs it
