"""Compare two sets of tensors by name, as every verification stage does.

Tensors are paired by name (every stage names a tensor after the ONNX output
that produced it). Graph outputs whose names differ between the two sides are
paired by position, if their shapes agree. Comparing nothing is a failure,
never a vacuous pass.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from tpubuild.verify.similarity import Tolerance, similarity


def pair_tensors(test: Mapping[str, np.ndarray], ref: Mapping[str, np.ndarray],
                 test_outputs: Sequence[str] = (), ref_outputs: Sequence[str] = ()) -> list[tuple[str, str]]:
    """(test name, ref name) pairs: common names in sorted order, then outputs by position."""
    pairs = [(name, name) for name in sorted(test.keys() & ref.keys())]
    free_test = [n for n in test_outputs if n in test and n not in ref]
    free_ref = [n for n in ref_outputs if n in ref and n not in test]
    for t, r in zip(free_test, free_ref):
        if np.shape(test[t]) == np.shape(ref[r]):
            pairs.append((t, r))
    return pairs


def _min(values: list[float]) -> float:
    return min(values) if values else math.nan


def compare_tensors(test: Mapping[str, np.ndarray], ref: Mapping[str, np.ndarray], tol: Tolerance, *,
                    test_outputs: Sequence[str] = (), ref_outputs: Sequence[str] = ()) -> dict:
    """A JSON-able report: per pair the metrics and label, plus minima and the verdict."""
    rows = []
    for t, r in pair_tensors(test, ref, test_outputs, ref_outputs):
        sim = similarity(test[t], ref[r], tol)
        row = {"name": t, "shape": list(np.shape(test[t]))}
        if t != r:
            row["ref_name"] = r
        row.update(sim.to_dict())
        rows.append(row)
    paired_test = {row["name"] for row in rows}
    paired_ref = {row.get("ref_name", row["name"]) for row in rows}
    compared = len(rows)
    return {
        "tolerance": {"cos": tol.cos, "euc": tol.euc},
        "compared": compared,
        "failed": sum(not row["passed"] for row in rows),
        "passed": compared > 0 and all(row["passed"] for row in rows),
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


def worst(report: dict, count: int = 5) -> list[dict]:
    """The failing tensors with the lowest cosine first (NaN and NOT MATCH first of all)."""
    failed = [row for row in report["tensors"] if not row["passed"]]
    return sorted(failed, key=lambda row: (row["cos"] == row["cos"], row["cos"]))[:count]


def format_row(row: dict) -> str:
    name = row["name"] + (f" <-> {row['ref_name']}" if "ref_name" in row else "")
    return (f"{name}: {row['label']}, cos {row['cos']:.6f}, euc {row['euc']:.6f}, "
            f"SQNR {row['sqnr']:.1f} dB, max abs err {row['max_abs']:.3g}")
