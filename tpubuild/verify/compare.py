"""Compare two sets of tensors by name, as every verification stage does.

Tensors are paired by name (every stage names a tensor after the ONNX output
that produced it). Graph outputs whose names differ between the two sides are
paired by position, if their shapes agree. Comparing nothing is a failure,
never a vacuous pass.

Which tensors decide the verdict is the caller's choice (``decide``): every
tensor compared (TOP vs onnxruntime, as TPU-MLIR's model_transform), or only
the graph outputs (Tpu vs Top, as TPU-MLIR's model_deploy without
--compare_all), the other tensors still compared and reported. Then the outputs
must all have been compared: an output without a counterpart fails.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from tpubuild.verify.similarity import Tolerance, similarity


def pair_tensors(
    test: Mapping[str, np.ndarray],
    ref: Mapping[str, np.ndarray],
    test_outputs: Sequence[str] = (),
    ref_outputs: Sequence[str] = (),
) -> list[tuple[str, str]]:
    """(test name, ref name) pairs: common names in sorted order, then outputs by position.

    An output pairs by position when its name is not the reference's, even if the reference
    output is paired by name too: a lowered output is often a cast (``y_f32``) of a tensor
    that keeps the name (``y``), and both are worth comparing.
    """
    pairs = [(name, name) for name in sorted(test.keys() & ref.keys())]
    for t, r in zip(test_outputs, ref_outputs):
        if t != r and t in test and t not in ref and r in ref and np.shape(test[t]) == np.shape(ref[r]):
            pairs.append((t, r))
    return pairs


def _min(values: list[float]) -> float:
    return min(values) if values else math.nan


def compare_tensors(
    test: Mapping[str, np.ndarray],
    ref: Mapping[str, np.ndarray],
    tol: Tolerance,
    *,
    test_outputs: Sequence[str] = (),
    ref_outputs: Sequence[str] = (),
    decide: str = "all",
) -> dict:
    """A JSON-able report: per pair the metrics and label, plus minima and the verdict.

    ``decide``: "all" (every compared tensor must meet ``tol``) or "outputs" (every one
    of ``test_outputs`` must be compared and meet it; the rest is reported only).
    """
    if decide not in ("all", "outputs"):
        raise ValueError(f"decide must be 'all' or 'outputs', not {decide!r}")
    rows = []
    outputs = set(test_outputs)
    for t, r in pair_tensors(test, ref, test_outputs, ref_outputs):
        sim = similarity(test[t], ref[r], tol)
        row = {"name": t, "shape": list(np.shape(test[t]))}
        if t != r:
            row["ref_name"] = r
        row.update(sim.to_dict())
        row["output"] = t in outputs
        rows.append(row)
    paired_test = {row["name"] for row in rows}
    paired_ref = {row.get("ref_name", row["name"]) for row in rows}
    compared = len(rows)
    if decide == "outputs":
        deciding = [row for row in rows if row["output"]]
        passed = bool(outputs) and outputs <= paired_test and all(row["passed"] for row in deciding)
    else:
        passed = compared > 0 and all(row["passed"] for row in rows)
    return {
        "tolerance": {"cos": tol.cos, "euc": tol.euc},
        "decided_by": "graph outputs" if decide == "outputs" else "every tensor",
        "compared": compared,
        "failed": sum(not row["passed"] for row in rows),
        "passed": passed,
        "min_cos": _min([row["cos"] for row in rows]),
        "min_euc": _min([row["euc"] for row in rows]),
        "min_sqnr": _min([row["sqnr"] for row in rows]),
        "only_in_test": sorted(set(test) - paired_test),
        "only_in_ref": sorted(set(ref) - paired_ref),
        "tensors": rows,
    }


def jsonable(value):
    """Non-finite floats as strings ('inf', '-inf', 'nan'): strict JSON has no Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def worst(report: dict, count: int = 5, *, outputs: bool = False) -> list[dict]:
    """The failing tensors (graph outputs only, with ``outputs``) with the lowest cosine first (NaN and
    NOT MATCH first of all)."""
    failed = [row for row in report["tensors"] if not row["passed"] and (row.get("output") or not outputs)]
    return sorted(failed, key=lambda row: (row["cos"] == row["cos"], row["cos"]))[:count]


def format_row(row: dict) -> str:
    name = row["name"] + (f" <-> {row['ref_name']}" if "ref_name" in row else "")
    return (
        f"{name}: {row['label']}, cos {row['cos']:.6f}, euc {row['euc']:.6f}, "
        f"SQNR {row['sqnr']:.1f} dB, max abs err {row['max_abs']:.3g}"
    )
