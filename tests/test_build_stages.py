"""Stage functions called directly: atomic outputs, the default test input, the summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from tpubuild.build import stages
from tpubuild.build.files import read_npz, write_npz
from tpubuild.build.testinput import default_input, make_inputs
from tpubuild.build.version import compiler_version
from tpubuild.errors import TpuBuildError
from tpubuild.testing import save_onnx

SPECS = [{"name": "x", "shape": [2, 4], "dtype": "float32", "range": [-1.0, 1.0]}]


def tiny_onnx(path: Path) -> None:
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"], name="mm"),
        helper.make_node("Relu", ["mm"], ["y"], name="relu"),
    ]
    save_onnx(
        path, nodes, {"x": ["N", 4]}, {"y": ["N", 3]}, {"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)}
    )


def outputs(tmp_path: Path) -> dict[str, str]:
    return {
        "out_mlir": str(tmp_path / "origin.mlir"),
        "out_weights": str(tmp_path / "origin_weights.npz"),
        "out_input": str(tmp_path / "input.npz"),
    }


def test_default_input_is_deterministic_and_in_range():
    a = default_input("m", SPECS[0])
    assert a.dtype == np.float32 and a.shape == (2, 4)
    assert a.min() >= -1.0 and a.max() < 1.0
    np.testing.assert_array_equal(a, default_input("m", SPECS[0]))
    assert not np.array_equal(a, default_input("other_model", SPECS[0]))
    ints = default_input("m", {"name": "ids", "shape": [100], "dtype": "int64", "range": [3, 7]})
    assert ints.dtype == np.int64 and set(np.unique(ints)) <= {3, 4, 5, 6}


def test_default_input_is_the_same_in_every_process():
    """Seeded from crc32, not hash(): a different PYTHONHASHSEED gives the same bytes."""
    code = (
        f"from tpubuild.build.testinput import default_input; print(default_input('m', {SPECS[0]!r}).tobytes().hex())"
    )
    runs = [
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    ]
    assert runs[0] == runs[1] == default_input("m", SPECS[0]).tobytes().hex() + "\n"


def test_test_input_file(tmp_path):
    data = np.full((2, 4), 0.5, np.float32)
    np.savez(tmp_path / "in.npz", x=data)
    got = make_inputs("m", SPECS, str(tmp_path / "in.npz"))
    np.testing.assert_array_equal(got["x"], data)
    np.savez(tmp_path / "bad.npz", x=np.zeros((3, 4), np.float32))
    with pytest.raises(TpuBuildError, match=r"shape \[3, 4\]; the model is compiled for \[2, 4\]"):
        make_inputs("m", SPECS, str(tmp_path / "bad.npz"))


def test_test_input_image(tmp_path):
    """An image test_input goes through the input's preprocess: resize, BGR, (pixel - mean) * scale, batch."""
    from PIL import Image

    rgb = np.zeros((4, 6, 3), np.uint8)
    rgb[..., 0], rgb[..., 1], rgb[..., 2] = 200, 100, 50  # R, G, B
    Image.fromarray(rgb).save(tmp_path / "in.png")
    spec = {
        "name": "img",
        "shape": [2, 3, 4, 6],
        "dtype": "float32",
        "preprocess": {"mean": [10, 20, 30], "scale": [0.5], "pixel_format": "bgr"},
    }
    got = make_inputs("m", [spec], str(tmp_path / "in.png"))["img"]
    assert got.shape == (2, 3, 4, 6) and got.dtype == np.float32
    expected = np.array([(50 - 10) * 0.5, (100 - 20) * 0.5, (200 - 30) * 0.5], np.float32)  # B, G, R planes
    np.testing.assert_array_equal(got, np.broadcast_to(expected[None, :, None, None], (2, 3, 4, 6)))
    with pytest.raises(TpuBuildError, match="one NCHW or NHWC input"):
        make_inputs("m", SPECS, str(tmp_path / "in.png"))


def test_transform_writes_all_outputs(tmp_path):
    tiny_onnx(tmp_path / "m.onnx")
    stages.transform(str(tmp_path / "m.onnx"), SPECS, "m", None, **outputs(tmp_path))
    assert "origin_weights.npz" in (tmp_path / "origin.mlir").read_text()
    assert set(read_npz(tmp_path / "input.npz")) == {"x"}
    assert not list(tmp_path.glob(".*.tmp"))


def test_failing_stage_leaves_no_target_not_even_a_stale_one(tmp_path, monkeypatch):
    """A failure while publishing: no output survives, including one from an earlier run."""
    from tpubuild.ir.weights import WeightStore

    tiny_onnx(tmp_path / "m.onnx")
    stages.transform(str(tmp_path / "m.onnx"), SPECS, "m", None, **outputs(tmp_path))
    assert (tmp_path / "origin.mlir").exists()

    def broken_save(self, path):
        Path(path).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(WeightStore, "save", broken_save)
    with pytest.raises(OSError):
        stages.transform(str(tmp_path / "m.onnx"), SPECS, "m", None, **outputs(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_unsupported_op_is_a_user_error(tmp_path):
    tiny_onnx(tmp_path / "m.onnx")
    model = onnx.load(tmp_path / "m.onnx")
    model.graph.node[1].op_type = "Det"
    onnx.save(model, tmp_path / "m.onnx")
    with pytest.raises(TpuBuildError, match=r"unsupported ONNX ops.*Det"):
        stages.transform(str(tmp_path / "m.onnx"), SPECS, "m", None, **outputs(tmp_path))
    assert not (tmp_path / "origin.mlir").exists()


def test_verify_top_and_summary(tmp_path):
    """The whole model-level chain on a tiny model, through the stage functions."""
    onnx_path = str(tmp_path / "m.onnx")
    tiny_onnx(tmp_path / "m.onnx")
    p = {
        k: str(tmp_path / v)
        for k, v in {
            "origin": "origin.mlir",
            "ow": "origin_weights.npz",
            "input": "input.npz",
            "ref": "onnx_outs.npz",
            "canon": "canonical.mlir",
            "cw": "canonical_weights.npz",
            "oo": "origin_outs.npz",
            "to": "top_outs.npz",
            "json": "verify_top.json",
            "summary": "summary.txt",
        }.items()
    }
    stages.transform(onnx_path, SPECS, "m", None, p["origin"], p["ow"], p["input"])
    stages.reference(onnx_path, p["input"], p["ref"])
    stages.canonicalize(p["origin"], p["ow"], p["canon"], p["cw"])
    stages.verify_top(
        "m",
        onnx_path,
        p["origin"],
        p["canon"],
        p["input"],
        p["ref"],
        {"cos": 0.99999, "euc": 0.999},
        p["oo"],
        p["to"],
        p["json"],
    )
    doc = json.loads(Path(p["json"]).read_text())
    assert [c["passed"] for c in doc["comparisons"]] == [True, True]
    assert all(c["compared"] >= 1 for c in doc["comparisons"])
    x = read_npz(p["input"])["x"]
    w = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
    np.testing.assert_allclose(read_npz(p["to"])["y"], np.maximum(x @ w, 0), rtol=1e-5, atol=1e-6)

    stages.summarize("m", [p["json"]], p["summary"])
    lines = Path(p["summary"]).read_text().splitlines()
    assert len(lines) == 5 and lines[2].endswith("PASS") and lines[3].endswith("PASS")
    assert lines[4] == stages.SUMMARY_NOTE  # what the figures are: the minimum of what decided


def up_to_canonical(tmp_path: Path, onnx_path: str, specs) -> tuple[str, str, str, str]:
    """transform, reference and canonicalize into ``tmp_path``: (origin.mlir, canonical.mlir, input.npz,
    onnx_outs.npz)."""
    names = ["origin.mlir", "origin_weights.npz", "input.npz", "onnx_outs.npz", "canonical.mlir", "cw.npz"]
    o, ow, inp, ref, c, cw = (str(tmp_path / n) for n in names)
    stages.transform(onnx_path, specs, "m", None, o, ow, inp)
    stages.reference(onnx_path, inp, ref)
    stages.canonicalize(o, ow, c, cw)
    return o, c, inp, ref


def test_verify_top_fails_below_tolerance(tmp_path):
    """Tamper with the reference: the stage fails, names the tensor and publishes nothing."""
    onnx_path = str(tmp_path / "m.onnx")
    tiny_onnx(tmp_path / "m.onnx")
    o, c, inp, ref = up_to_canonical(tmp_path, onnx_path, SPECS)
    tensors = read_npz(ref)
    tensors["y"] = tensors["y"][::-1].copy() + 1
    write_npz(ref, tensors)
    outs = [str(tmp_path / n) for n in ("origin_outs.npz", "top_outs.npz", "verify_top.json")]
    with pytest.raises(TpuBuildError, match="y: NOT SIMILAR"):
        stages.verify_top("m", onnx_path, o, c, inp, ref, {"cos": 0.99999, "euc": 0.999}, *outs)
    assert not any(Path(p).exists() for p in outs)


def test_verify_top_takes_float32_round_off_of_near_zero_maps(tmp_path):
    """Sigmoids of logits near -18 (a detector's map of an input with nothing to find) are below 4e-8, and
    onnxruntime's fast sigmoid is off by a large share of each (or 0): the map's cosine is far below the top
    tolerance, yet every element is within FLOAT32_ATOL, so the map passes as CLOSE (and an F16 target's,
    within FLOAT16_ATOL, and any target's as a Sigmoid's output, within 4 steps of a 16-bit result); a
    difference above it still fails."""
    from tpubuild.verify.similarity import FLOAT32_ATOL

    shift = -18.0
    onnx_path = tmp_path / "m.onnx"
    nodes = [
        helper.make_node("Add", ["x", "b"], ["logits"]),
        helper.make_node("Sigmoid", ["logits"], ["y"]),
        helper.make_node("Relu", ["y"], ["z"]),  # the same map, from an op of unbounded range
    ]
    outputs = {"y": ["N", 64], "z": ["N", 64]}
    save_onnx(onnx_path, nodes, {"x": ["N", 64]}, outputs, {"b": np.array(shift, np.float32)})
    specs = [{"name": "x", "shape": [2, 64], "dtype": "float32", "range": [-1.0, 1.0]}]
    o, c, inp, ref = up_to_canonical(tmp_path, str(onnx_path), specs)
    outs = [str(tmp_path / n) for n in ("origin_outs.npz", "top_outs.npz", "verify_top.json")]
    tol = {"cos": 0.99999, "euc": 0.999}
    stages.verify_top("m", str(onnx_path), o, c, inp, ref, tol, *outs)
    rows = [r for r in json.loads(Path(outs[2]).read_text())["comparisons"][1]["tensors"] if r["name"] == "y"]
    assert rows[0]["label"] == "CLOSE" and rows[0]["cos"] < tol["cos"]  # the cosine alone fails it
    canonical = json.loads(Path(outs[2]).read_text())["comparisons"][1]
    assert canonical["decided_cos"] >= tol["cos"] > canonical["min_cos"]  # the summary's figure: what decided
    exact = 1 / (1 + np.exp(-shift - read_npz(inp)["x"].astype(np.float64)))
    np.testing.assert_allclose(read_npz(outs[1])["y"], exact, rtol=1e-5)  # TOP's own map is exact

    # an F16 target holds the map in float16's subnormals: a few steps of 2^-24 each, CLOSE within FLOAT16_ATOL
    tpu, tw = str(tmp_path / "tpu.mlir"), str(tmp_path / "tpu_w.npz")
    stages.lower("m", c, None, None, "bm1684x", "F16", False, tpu, tw)
    f16_tol = {"cos": 0.99, "euc": 0.90}
    verified = [str(tmp_path / n) for n in ("tpu_outs.npz", "tpu_raw.npz", "verify_tpu.json")]
    stages.verify_tpu("m", "bm1684x-F16", tpu, c, inp, outs[1], f16_tol, *verified, mode="F16")
    rows = json.loads(Path(verified[2]).read_text())["comparisons"][0]["tensors"]
    assert [(r["label"], r["cos"] < f16_tol["cos"]) for r in rows if r.get("output")] == [("CLOSE", True)] * 2
    # judged as any other mode's: the Sigmoid's map is CLOSE within 4 16-bit steps, the ReLU's by its cosine
    with pytest.raises(TpuBuildError, match="NOT SIMILAR") as err:
        stages.verify_tpu("m", "bm1684x-F16", tpu, c, inp, outs[1], f16_tol, *verified)
    assert "    z_f32" in str(err.value) and "    y_f32" not in str(err.value)

    tensors = read_npz(ref)
    tensors["y"] = tensors["y"] + np.float32(2 * FLOAT32_ATOL)
    write_npz(ref, tensors)
    with pytest.raises(TpuBuildError, match="y: NOT SIMILAR"):
        stages.verify_top("m", str(onnx_path), o, c, inp, ref, tol, *outs)


def test_compiler_version_shape():
    import tpubuild

    version = compiler_version()
    assert version.startswith(tpubuild.__version__ + "+") and len(version.split("+")[1]) == 12


def test_npz_files_are_deterministic_zips_numpy_reads(tmp_path):
    """write_npz streams the bytes npz_bytes makes: sorted members, fixed timestamps, no data descriptors, the same
    bytes for the same arrays; np.load and read_npz give back values and dtypes (bfloat16 too)."""
    import zipfile

    import ml_dtypes

    from tpubuild.build.files import npz_bytes

    rng = np.random.default_rng(0)
    arrays = {
        "b": rng.normal(size=(2, 3, 5)).astype(np.float32),
        "a": np.arange(4, dtype=np.int8),
        "bf": np.ones(3, ml_dtypes.bfloat16),
        "f": np.asfortranarray(rng.normal(size=(3, 4))),
        "scalar": np.float32(2.5),
        "empty": np.zeros((0, 3)),
    }
    write_npz(tmp_path / "x.npz", arrays)
    write_npz(tmp_path / "y.npz", dict(reversed(list(arrays.items()))))
    data = (tmp_path / "x.npz").read_bytes()
    assert data == (tmp_path / "y.npz").read_bytes() == npz_bytes(arrays)
    with zipfile.ZipFile(tmp_path / "x.npz") as zf:
        infos = zf.infolist()
        assert [i.filename for i in infos] == sorted(i.filename for i in infos)
        assert {i.date_time for i in infos} == {(1980, 1, 1, 0, 0, 0)} and not any(i.flag_bits & 0x8 for i in infos)
    back = read_npz(tmp_path / "x.npz")
    assert back.keys() == arrays.keys()
    assert all(back[k].dtype == np.asarray(v).dtype and np.array_equal(back[k], v) for k, v in arrays.items())
