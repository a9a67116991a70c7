"""`tpubuild run` and the run / verify_chip stage functions on a hand-assembled model file."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tpubuild.build import stages
from tpubuild.build.files import read_npz, write_npz
from tpubuild.cli import main
from tpubuild.codegen import commands as cmd
from tpubuild.codegen.asm import Assembler
from tpubuild.codegen.commands import Tensor
from tpubuild.codegen.model_file import ChipParams, write_model
from tpubuild.errors import TpuBuildError
from tpubuild.ir import tpu
from tpubuild.kernels import get_kernel

CHIP = ChipParams(
    name="toy",
    lanes=4,
    lane_bytes=8192,
    banks=2,
    eu_bytes=16,
    ddr_bandwidth=8e9,
    clock_hz=5e8,
    macs_per_lane_per_cycle={"INT8": 32, "F32": 4},
    gdma_latency_cycles=10,
    bdc_overhead_cycles=5,
)
ADD = tpu.AddOp.PARAMS(multiplier=(21000, 17000), rshift=(15,), in_zp=(2, -3), out_zp=1)
SHAPE = (1, 6, 5, 7)


def _add_model(path, source=""):
    """y = requantized a + b (int8), in two channel halves (lane_start 0 and 3); ``source``: y's name in the
    source model."""
    asm = Assembler(CHIP, model="adder", mode="INT8", act_base=0)
    a, b = asm.input("a", SHAPE, "int8", 0.05, 2), asm.input("b", SHAPE, "int8", 0.04, -3)
    y = asm.output("y", SHAPE, "int8", 0.06, 1, source=source)
    strides = cmd.contiguous_strides(SHAPE)
    for half in range(2):
        blk = (1, 3, 5, 7)
        lane = 3 * half
        off = half * 3 * 5 * 7
        la, lb, ly = asm.local(blk, "int8", lane), asm.local(blk, "int8", lane), asm.local(blk, "int8", lane)
        asm.load(a.ddr_addr + off, strides, la, blk, "int8", lane_start=lane, wait_bdc=half and 1)
        g = asm.load(b.ddr_addr + off, strides, lb, blk, "int8", lane_start=lane, wait_bdc=half and 1)
        c = asm.compute(
            tpu.AddOp,
            ADD,
            [Tensor.local(la, lane, blk, "int8"), Tensor.local(lb, lane, blk, "int8")],
            [Tensor.local(ly, lane, blk, "int8")],
            wait_gdma=g,
        )
        asm.store(ly, y.ddr_addr + off, strides, blk, "int8", lane_start=lane, wait_bdc=c)
    write_model(path, asm.build())


@pytest.fixture
def files(tmp_path):
    rng = np.random.default_rng(0)
    inputs = {"a": rng.integers(-128, 128, SHAPE, dtype=np.int8), "b": rng.integers(-128, 128, SHAPE, dtype=np.int8)}
    expect = get_kernel(tpu.AddOp)(ADD, inputs["a"], inputs["b"]).astype(np.int8)
    model = tmp_path / "adder.model"
    _add_model(model)
    write_npz(tmp_path / "input.npz", inputs)
    # TPU inference's stored tensors: the output and the inputs, by name
    write_npz(tmp_path / "tpu_raw.npz", {**inputs, "y": expect})
    for name, level in (("verify_top.json", "top"), ("verify_tpu.json", "tpu")):
        doc = {"comparisons": [{"level": level, "test": "t", "ref": "r", "passed": True, "compared": 1}]}
        (tmp_path / name).write_text(json.dumps(doc))
    return tmp_path, expect


def test_cli_run_writes_outputs_and_profile(files, capsys):
    d, expect = files
    code = main(
        [
            "run",
            str(d / "adder.model"),
            "--input",
            str(d / "input.npz"),
            "--output",
            str(d / "out.npz"),
            "--profile",
            str(d / "profile.json"),
        ]
    )
    assert code == 0
    out = read_npz(d / "out.npz")["y"]  # float32 real values by default: scale * (stored - zero point)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, np.float32(0.06) * (expect.astype(np.float32) - 1), rtol=1e-6)
    profile = json.loads((d / "profile.json").read_text())
    assert profile["ddr_read_bytes"] == 2 * 210 and profile["ddr_write_bytes"] == 210
    assert profile["time_ms"] == pytest.approx(profile["total_cycles"] / 5e8 * 1e3)
    assert "6 GDMA + 2 BDC commands on toy" in capsys.readouterr().out


def test_cli_run_names_outputs_as_the_source_model(files, capsys):
    """An output lowering renamed (the .model's ``source``) is written under the source model's name, in its
    stored type with --stored; `tpubuild compare` then pairs it with a reference by that name."""
    d, expect = files
    _add_model(d / "renamed.model", source="sum")
    args = ["run", str(d / "renamed.model"), "--input", str(d / "input.npz")]
    assert main([*args, "--output", str(d / "stored.npz"), "--stored"]) == 0
    stored = read_npz(d / "stored.npz")
    assert list(stored) == ["sum"] and stored["sum"].dtype == np.int8
    np.testing.assert_array_equal(stored["sum"], expect)
    assert main([*args, "--output", str(d / "real.npz")]) == 0
    assert list(read_npz(d / "real.npz")) == ["sum"]
    write_npz(d / "ref.npz", {"sum": np.float32(0.06) * (expect.astype(np.float32) - 1)})
    capsys.readouterr()
    assert main(["compare", str(d / "real.npz"), str(d / "ref.npz")]) == 0
    assert "1 compared, 0 below" in capsys.readouterr().out


def test_cli_run_reports_a_bad_file_without_traceback(files, capsys):
    d, _ = files
    (d / "bad.model").write_bytes(b"TPUMODEL" + b"\0" * 4)
    assert main(["run", str(d / "bad.model"), "--input", str(d / "input.npz"), "--output", str(d / "o.npz")]) == 2
    err = capsys.readouterr().err
    assert "bad.model: truncated" in err and "Traceback" not in err


def _verify(d, mode="INT8"):
    stages.run_chip(str(d / "adder.model"), str(d / "input.npz"), str(d / "chip_outs.npz"), str(d / "profile.json"))
    stages.verify_chip(
        "adder",
        "toy-int8",
        mode,
        str(d / "adder.model"),
        str(d / "chip_outs.npz"),
        str(d / "tpu_raw.npz"),
        str(d / "verify_top.json"),
        str(d / "verify_tpu.json"),
        str(d / "profile.json"),
        {"cos": 0.99, "euc": 0.9},
        str(d / "verify.json"),
    )
    return json.loads((d / "verify.json").read_text())


def test_verify_chip_writes_all_four_levels(files):
    d, _ = files
    doc = _verify(d)
    assert doc["levels"] == ["onnx", "top", "tpu", "chip"] and doc["passed"]
    assert [c["level"] for c in doc["comparisons"]] == ["top", "tpu", "chip"]
    chip = doc["comparisons"][-1]
    assert chip["compared"] == 1 and chip["tensors"][0]["label"] == "EQUAL"
    assert doc["chip"]["total_cycles"] > 0


def test_verify_chip_int8_demands_bit_exactness(files):
    d, expect = files
    off_by_one = expect.copy()
    off_by_one[0, 0, 0, 0] += 1  # one LSB somewhere: cos stays ~1, but INT8 must be EQUAL
    raw = read_npz(d / "tpu_raw.npz")
    write_npz(d / "tpu_raw.npz", {**raw, "y": off_by_one})
    with pytest.raises(TpuBuildError, match=r"y: SIMILAR \(required: EQUAL\)"):
        _verify(d)
    assert not (d / "verify.json").exists()
    doc = _verify(d, mode="BF16")  # a float mode is judged by the tolerance
    assert doc["comparisons"][-1]["tensors"][0]["label"] == "SIMILAR"
