"""The `tpubuild` command as a user runs it (a subprocess): results, exit codes, error messages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from tpubuild.build import stages
from tpubuild.build.files import read_npz, write_npz
from tpubuild.calib.table import read_table
from tpubuild.testing import save_onnx

SPECS = [{"name": "x", "shape": [2, 4], "dtype": "float32", "range": [-1.0, 1.0]}]


def tpubuild(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tpubuild.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=600
    )


def assert_user_error(run: subprocess.CompletedProcess, *needles: str, code: int = 2) -> None:
    assert run.returncode == code, run.stdout + run.stderr
    assert run.stderr.startswith("tpubuild: error: "), run.stderr
    assert "Traceback" not in run.stdout + run.stderr
    for needle in needles:
        assert needle in run.stderr, run.stderr


def tiny_onnx(path: Path) -> None:
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"], name="mm"),
        helper.make_node("Relu", ["mm"], ["y"], name="relu"),
    ]
    save_onnx(
        path, nodes, {"x": ["N", 4]}, {"y": ["N", 3]}, {"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)}
    )


@pytest.fixture
def origin(tmp_path) -> Path:
    """origin.mlir (+ weights, input.npz) of the tiny model."""
    tiny_onnx(tmp_path / "m.onnx")
    stages.transform(
        str(tmp_path / "m.onnx"),
        SPECS,
        "m",
        None,
        str(tmp_path / "origin.mlir"),
        str(tmp_path / "origin_weights.npz"),
        str(tmp_path / "input.npz"),
    )
    return tmp_path / "origin.mlir"


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "tpubuild"
    run = subprocess.run([str(script), "--help"], capture_output=True, text=True)
    assert run.returncode == 0 and "compile" in run.stdout and "infer" in run.stdout


def test_a_closed_pipe_ends_quietly():
    """`tpubuild ops | head -1`: the reader goes away; no traceback, the shell's SIGPIPE status."""
    read, write = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "tpubuild.cli", "ops"], stdout=write, stderr=subprocess.PIPE)
    os.close(write)
    os.close(read)  # gone before the child (still importing) writes its first line
    err = proc.communicate(timeout=60)[1].decode()
    assert proc.returncode == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_ops_lists_the_issue_op_set():
    run = tpubuild("ops")
    assert run.returncode == 0, run.stderr
    listed = {line.split()[0] for line in run.stdout.splitlines()[:-1]}
    first_set = {
        "Conv",
        "MatMul",
        "Gemm",
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Relu",
        "Sigmoid",
        "Tanh",
        "Softmax",
        "LayerNormalization",
        "BatchNormalization",
        "MaxPool",
        "AveragePool",
        "GlobalAveragePool",
        "Concat",
        "Reshape",
        "Transpose",
        "Flatten",
        "Squeeze",
        "Unsqueeze",
        "Clip",
        "Identity",
        "Dropout",
    }
    # (Constant has no converter: the frontend folds it into a weight before conversion)
    assert first_set <= listed, first_set - listed


def test_infer_outputs_and_all_tensors(origin, tmp_path):
    inp = str(tmp_path / "input.npz")
    run = tpubuild("infer", str(origin), "--input", inp, "--output", str(tmp_path / "out.npz"))
    assert run.returncode == 0, run.stderr
    outs = read_npz(tmp_path / "out.npz")
    assert list(outs) == ["y"]
    x = read_npz(inp)["x"]
    w = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
    np.testing.assert_allclose(outs["y"], np.maximum(x @ w, 0), rtol=1e-5, atol=1e-6)

    run = tpubuild("infer", str(origin), "--input", inp, "--output", str(tmp_path / "all.npz"), "--all-tensors")
    assert run.returncode == 0, run.stderr
    assert {"mm", "y"} <= set(read_npz(tmp_path / "all.npz"))


def test_infer_real_values_of_an_int8_tpu_mlir(origin, tmp_path):
    """A tpu.mlir's tensors: stored int8/uint8 by default, real values with --real (what TOP's compare with)."""
    inp = str(tmp_path / "input.npz")
    stages.canonicalize(
        str(origin),
        str(tmp_path / "origin_weights.npz"),
        str(tmp_path / "canonical.mlir"),
        str(tmp_path / "canonical_weights.npz"),
    )
    stages.calibrate(
        "m",
        str(tmp_path / "canonical.mlir"),
        SPECS,
        [inp],
        None,
        "max",
        None,
        str(tmp_path / "cali.mlir"),
        str(tmp_path / "cali_table"),
    )
    tpu_mlir = tmp_path / "tpu.mlir"
    stages.lower(
        "m",
        str(tmp_path / "cali.mlir"),
        str(tmp_path / "cali_table"),
        None,
        "bm1684x",
        "INT8",
        False,
        str(tpu_mlir),
        str(tmp_path / "tpu_weights.npz"),
    )
    for flags, out in (((), "stored.npz"), (("--real",), "real.npz"), (("--real",), "outputs.npz")):
        every = ("--all-tensors",) if out != "outputs.npz" else ()
        run = tpubuild("infer", str(tpu_mlir), "--input", inp, "--output", str(tmp_path / out), *every, *flags)
        assert run.returncode == 0, run.stderr
    stored, real = read_npz(tmp_path / "stored.npz"), read_npz(tmp_path / "real.npz")
    # the graph output: lowering returns y cast back to f32 (y_f32); --real writes it under the ONNX name y,
    # float32, so `tpubuild compare` pairs it with onnxruntime's outputs by name
    outputs = read_npz(tmp_path / "outputs.npz")
    assert list(outputs) == ["y"] and outputs["y"].dtype == np.float32
    names = [n for n in stored if n.startswith("y_")]
    assert names and names[0] in real, names
    np.testing.assert_array_equal(outputs["y"], real[names[0]])
    w = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
    write_npz(tmp_path / "onnx_outs.npz", {"y": np.maximum(read_npz(inp)["x"] @ w, 0)})
    run = tpubuild("compare", str(tmp_path / "outputs.npz"), str(tmp_path / "onnx_outs.npz"))
    assert run.returncode == 0 and "1 compared, 0 below" in run.stdout, run.stdout + run.stderr
    # canonicalize fused the ReLU: y is the MatMul's result, never negative, so stored as uint8
    assert stored["y"].dtype == np.uint8 and real["y"].dtype == np.float32
    threshold = read_table(tmp_path / "cali_table")[1]["y"].threshold
    np.testing.assert_allclose(real["y"], stored["y"] * (threshold / 255), rtol=1e-6)  # scale T/255, no zero point
    x = read_npz(inp)["x"]
    w = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
    np.testing.assert_allclose(real["y"], np.maximum(x @ w, 0), atol=0.03)  # int8 x and w: a few steps at most
    assert set(real) == set(stored)


def test_infer_truncated_mlir(origin, tmp_path):
    text = origin.read_text()
    bad = tmp_path / "truncated.mlir"
    bad.write_text(text[: len(text) // 2])
    out = tmp_path / "out.npz"
    run = tpubuild("infer", str(bad), "--input", str(tmp_path / "input.npz"), "--output", str(out))
    assert_user_error(run, str(bad))
    assert not out.exists()


def test_infer_missing_files(origin, tmp_path):
    run = tpubuild(
        "infer",
        str(tmp_path / "nope.mlir"),
        "--input",
        str(tmp_path / "input.npz"),
        "--output",
        str(tmp_path / "o.npz"),
    )
    assert_user_error(run, "nope.mlir")
    run = tpubuild("infer", str(origin), "--input", str(tmp_path / "nope.npz"), "--output", str(tmp_path / "o.npz"))
    assert_user_error(run, "nope.npz", "not found")
    run = tpubuild("infer", str(origin), "--input", str(origin), "--output", str(tmp_path / "o.npz"))
    assert_user_error(run, "origin.mlir", "not an .npz")


def test_compare(tmp_path):
    rng = np.random.default_rng(0)
    a = {"t": rng.standard_normal(100).astype(np.float32), "u": rng.standard_normal(10).astype(np.float32)}
    np.savez(tmp_path / "a.npz", **a)
    np.savez(tmp_path / "same.npz", **a)
    np.savez(tmp_path / "noisy.npz", t=a["t"] + 0.5 * rng.standard_normal(100).astype(np.float32), u=a["u"])
    np.savez(tmp_path / "other.npz", v=a["t"])

    same = tpubuild("compare", str(tmp_path / "a.npz"), str(tmp_path / "same.npz"))
    assert same.returncode == 0 and "EQUAL" in same.stdout and "2 compared" in same.stdout
    noisy = tpubuild("compare", str(tmp_path / "noisy.npz"), str(tmp_path / "a.npz"), "--tolerance", "0.999,0.99")
    assert noisy.returncode == 1 and "t: NOT SIMILAR" in noisy.stdout and "SQNR" in noisy.stdout
    loose = tpubuild("compare", str(tmp_path / "noisy.npz"), str(tmp_path / "a.npz"), "--tolerance", "0.5,-5")
    assert loose.returncode == 0, loose.stdout
    nothing = tpubuild("compare", str(tmp_path / "a.npz"), str(tmp_path / "other.npz"))
    assert_user_error(nothing, "no tensor name", code=1)
    assert_user_error(
        tpubuild("compare", str(tmp_path / "a.npz"), str(tmp_path / "a.npz"), "--tolerance", "0.9"), "COS,EUC"
    )
    assert_user_error(tpubuild("compare", str(tmp_path / "a.npz"), str(tmp_path / "missing.npz")), "missing.npz")


MANIFEST = "name: {name}\nsource: m.onnx\ninputs: [{{name: x, shape: [2, 4], range: [-1, 1]}}]\n"


def test_compile_manifest_outside_configs(tmp_path):
    tiny_onnx(tmp_path / "m.onnx")
    (tmp_path / "one.yaml").write_text(MANIFEST.format(name="one"))
    (tmp_path / "two.yaml").write_text(MANIFEST.format(name="two"))
    build = tmp_path / "out"
    run = tpubuild(
        "compile", str(tmp_path / "one.yaml"), str(tmp_path / "two.yaml"), "--build-dir", str(build), "-j", "2"
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert (build / "one" / "summary.txt").is_file() and (build / "two" / "summary.txt").is_file()
    again = tpubuild("compile", str(tmp_path / "one.yaml"), "--build-dir", str(build))
    assert again.returncode == 0
    assert not [line for line in again.stdout.splitlines() if line.startswith(".  ")], again.stdout


def test_compile_bad_inputs_fail_with_a_message(tmp_path):
    tiny_onnx(tmp_path / "m.onnx")
    (tmp_path / "typo.yaml").write_text(MANIFEST.format(name="typo").replace("[2, 4]", "[2, '4']"))
    (tmp_path / "corrupt.onnx").write_bytes(b"\x08\x07garbage" * 10)
    (tmp_path / "corrupt.yaml").write_text(MANIFEST.format(name="corrupt").replace("m.onnx", "corrupt.onnx"))
    run = tpubuild(
        "compile", str(tmp_path / "typo.yaml"), str(tmp_path / "corrupt.yaml"), "--build-dir", str(tmp_path / "out")
    )
    assert run.returncode != 0
    out = run.stdout + run.stderr
    assert "Traceback" not in out
    assert "typo.yaml" in out and "inputs[0].shape[1]" in out
    assert "corrupt.onnx: not a valid ONNX model" in out
    assert not (tmp_path / "out" / "corrupt" / "origin.mlir").exists()
