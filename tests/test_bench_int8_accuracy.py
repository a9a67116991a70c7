"""bench/int8_accuracy.py's pure helpers: how a part of a Concat-made output is judged, and the verdicts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "int8_accuracy.py"


def _bench():
    spec = importlib.util.spec_from_file_location("int8_accuracy", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = _bench()


def test_part_label():
    assert bench.part_label("output0", None) == "output0"
    assert bench.part_label("output0", (1, 4, 24)) == "output0[:, 4:24]"
    assert bench.part_label("y", (0, 0, 2)) == "y[0:2]"


def _detections(scores_scale: float) -> np.ndarray:
    """[1, 6, 5]: rows 0..3 box coordinates in pixels, rows 4..5 class scores."""
    rng = np.random.default_rng(0)
    out = np.zeros((1, 6, 5), np.float32)
    out[:, :4] = rng.uniform(0, 320, (1, 4, 5))
    out[:, 4:] = scores_scale * rng.uniform(0, 1, (1, 2, 5))
    return out


def test_part_cosine_judges_a_small_part_on_its_own():
    ref = _detections(1.0)
    test = ref.copy()
    test[:, 4:] = ref[:, 4:][:, ::-1]  # scores destroyed, boxes exact
    assert bench.part_cosine(test, ref, None) > 0.999  # the boxes' norm hides the scores
    assert bench.part_cosine(test, ref, (1, 0, 4)) == pytest.approx(1.0)
    assert bench.part_cosine(test, ref, (1, 4, 6)) < 0.99


def test_part_without_signal_is_not_judged():
    ref = _detections(320 * bench.PART_SIGNAL / 10)  # scores far below PART_SIGNAL of the output's peak
    assert bench.part_cosine(ref + 1.0, ref, (1, 4, 6)) is None
    assert bench.part_cosine(ref, ref, (1, 0, 4)) == pytest.approx(1.0)


def test_lowest_by_part_skips_inputs_without_signal():
    with_signal, without = _detections(1.0), _detections(1e-6)
    noisy = with_signal.copy()
    noisy[:, 4:] += 0.05
    refs = [[with_signal], [without]]
    outs = [[noisy], [without + 1.0]]  # the second input's scores are noise, but carry no signal
    boxes, scores = bench.lowest_by_part(outs, refs, [[(1, 0, 4), (1, 4, 6)]])
    assert boxes.judged == 2 and scores.judged == 1
    assert scores.worst == 0 and scores.cos < 1.0
    whole = bench.lowest_by_part(outs, refs, [[]])
    assert len(whole) == 1 and whole[0].judged == 2


def test_verdicts():
    cell = bench.Cell
    r = bench.Result("m", ["a", "b"], "2 inputs", eval_names=["x", "y"])
    r.columns["ours"] = [cell(0.995, 0, 2), cell(0.999, 1, 1)]
    r.columns["ort MinMax"] = [cell(0.99, 0, 2), cell(0.9995, 0, 1)]
    r.columns["TPU-MLIR"] = [cell(0.98, 0, 2), cell(None, None, 0)]
    assert r.best_peer(1) == (0.9995, "ort MinMax")
    assert r.verdicts() == (False, True)
    r.columns["ours"][1] = cell(0.9999, 1, 1)
    assert r.verdicts() == (True, True)
    r.columns["ours"][0] = cell(0.98, 0, 2)
    assert r.verdicts() == (False, False)
    table = bench.json_table([r])
    assert set(table) == {"title", "goal", "columns", "rows"}
    assert all(len(row) == len(table["columns"]) for row in table["rows"])


def test_ranges_differ():
    a = {"t0": (0.0, 1.0), "t1": (-2.0, 2.0), "t2": (0.0, 5.0)}
    b = {"t0": (0.0, 1.005), "t1": (-2.0, 3.0), "t2": (0.0, 5.0)}
    assert bench.ranges_differ(a, b) == (1, 3)


def test_print_result_names_the_failing_part_and_input(capsys):
    cell = bench.Cell
    r = bench.Result("m", ["out[:, 0:4]", "out[:, 4:6]"], "2 inputs", eval_names=["x.jpg", "y.jpg"])
    r.columns["ours"] = [cell(0.999, 1, 2, [0.9995, 0.999]), cell(0.87, 0, 1, [0.87, None])]
    r.columns["TPU-MLIR"] = [cell(0.998, 0, 2, [0.998, 0.999]), cell(0.95, 0, 1, [0.95, None])]
    bench.print_result(r, ["a note"])
    out = capsys.readouterr().out
    assert "ours on out[:, 4:6] per input: x.jpg 0.8700, y.jpg -" in out
    assert "m: ours >= best peer on every part: NO (out[:, 4:6] 0.870000 < TPU-MLIR 0.950000)" in out
    assert "m: ours >= 0.99 everywhere: NO (out[:, 4:6] 0.870000 on x.jpg)" in out
    r.columns["ours"][1] = cell(None, None, 0, [None, None])
    bench.print_result(r, [])
    assert "out[:, 4:6]: no signal on any evaluation input" in capsys.readouterr().out
