"""The calibration table text format: write/read round trip, TPU-MLIR compatibility, errors."""

from __future__ import annotations

import re

import pytest

from tpubuild.calib.table import Entry, format_table, parse_table, read_table
from tpubuild.errors import TpuBuildError
from tpubuild.lower.qtable import read_quantize_table

ENTRIES = {
    "input": Entry(2.640000104904175, -2.1100001335144043, 2.640000104904175),
    "conv1/relu": Entry(3.1875, 0.0, 4.52),
    "tiny": Entry(1.2345678901234567e-21, -1e-22, 3e-21),
    "huge": Entry(6.02e23, -7.5e23, 1e23),
}
# TPU-MLIR's import-calibration-table pattern for an entry line
TPU_MLIR_LINE = re.compile(r"\S+\s+[-0-9.e]+\s+[-0-9.e]+\s+[-0-9.e]+")


def test_round_trip_is_exact(tmp_path):
    text = format_table(ENTRIES, ["tpubuild calibration table", "method: kl"])
    path = tmp_path / "cali_table"
    path.write_text(text)
    header, entries = read_table(path)
    assert entries == ENTRIES
    assert list(entries) == list(ENTRIES)  # order kept
    assert header == ["# tpubuild calibration table", "# method: kl", "# op_name threshold min max"]


def test_lines_match_tpu_mlir_parser():
    for line in format_table(ENTRIES).splitlines():
        assert line.startswith("#") or TPU_MLIR_LINE.fullmatch(line), line


def test_reads_a_tpu_mlir_table():
    text = """# genetated time: 2024-01-01 00:00:00
# histogram number: 2048
# sample number: 32
###
# op_name    threshold    min    max
images 2.6400001 -2.1179039 2.6400001
conv_0 11.7712574 0.0000000 19.3034210

#int4_th
conv_0 5.0 0.0 19.3
#weight_scale
conv_0_weight 2 0.1 0.2
"""
    header, entries = parse_table(text)
    assert entries == {"images": Entry(2.6400001, -2.1179039, 2.6400001), "conv_0": Entry(11.7712574, 0.0, 19.3034210)}
    assert header[1] == "# histogram number: 2048"


@pytest.mark.parametrize(
    "line, problem",
    [
        ("a 1.0 0.0", "expected 4 fields"),
        ("a one 0.0 1.0", "must be numbers"),
        ("a 0 -1 1", "threshold must be > 0"),
        ("a 1 2 1", "min is greater than max"),
        ("a nan 0 1", "finite"),
    ],
)
def test_bad_lines_name_the_line(line, problem):
    with pytest.raises(TpuBuildError, match=f"line 2: .*{problem}"):
        parse_table(f"# header\n{line}\n", file="t.txt")


def test_duplicate_names_are_refused():
    with pytest.raises(TpuBuildError, match="listed twice"):
        parse_table("a 1 0 1\na 2 0 2\n")


def test_whitespace_in_a_name_cannot_be_written():
    with pytest.raises(TpuBuildError, match="whitespace"):
        format_table({"a b": Entry(1.0, 0.0, 1.0)})


@pytest.mark.parametrize("read, what", [(read_table, "calibration table"), (read_quantize_table, "quantize table")])
def test_missing_or_unreadable_table_file(tmp_path, read, what):
    with pytest.raises(TpuBuildError, match=f"{what} not found") as err:
        read(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(err.value) and "manifest" in err.value.hint
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00 not utf-8")
    with pytest.raises(TpuBuildError, match=f"cannot read the {what}"):
        read(tmp_path / "binary")


def test_calibrated_range_is_symmetric_or_unsigned():
    assert Entry(3.0, -1.0, 5.0).calibrated_range() == (-3.0, 3.0)
    assert Entry(3.0, 0.0, 5.0).calibrated_range() == (0.0, 3.0)
