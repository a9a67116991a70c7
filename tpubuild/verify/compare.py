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

An output may have parts (slices along one axis: a Concat's inputs, or what the manifest declares;
tpubuild/verify/parts.py): each part is compared on its own and decides as well, so that a small part
cannot hide behind a large one. The report's ``decided_cos`` is the lowest cosine of what decided (the
outputs and their parts judged by similarity; every tensor when every tensor decides; not a tensor CLOSE
below the tolerance's cosine, which its elementwise bound decided, unless all were); ``min_cos`` stays
the lowest over every tensor compared, intermediate ones included (a cause to look for, not the verdict).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np

from tpubuild.verify.parts import Part, tiny_bound
from tpubuild.verify.similarity import CLOSE, Tolerance, similarity


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
    for t, r in zip(test_outputs, ref_outputs, strict=False):
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
    parts: Mapping[str, Sequence[Part]] | None = None,
    steps: Mapping[str, float] | None = None,
    atols: Mapping[str, float] | None = None,
) -> dict:
    """A JSON-able report: per pair the metrics and label, plus minima and the verdict.

    ``decide``: "all" (every compared tensor must meet ``tol``) or "outputs" (every one
    of ``test_outputs`` must be compared and meet it; the rest is reported only).
    ``parts``: by test tensor name, the parts of that tensor, each compared with the same
    slice of its counterpart (``report["parts"]``) and deciding too; ``steps``: calibration
    thresholds by TOP tensor name, for the tiny-part rule (parts.judge_part); ``atols``: by reference tensor
    name, CLOSE's absolute bound where it is wider than ``tol``'s (bounded_outputs).
    """
    if decide not in ("all", "outputs"):
        raise ValueError(f"decide must be 'all' or 'outputs', not {decide!r}")
    rows = []
    outputs = set(test_outputs)
    for t, r in pair_tensors(test, ref, test_outputs, ref_outputs):
        wider = (atols or {}).get(r, 0.0)
        sim = similarity(test[t], ref[r], replace(tol, atol=wider) if wider > tol.atol else tol)
        row = {"name": t, "shape": list(np.shape(test[t]))}
        if t != r:
            row["ref_name"] = r
        row.update(sim.to_dict())
        row["output"] = t in outputs
        rows.append(row)
    paired_test = {row["name"] for row in rows}
    paired_ref = {row.get("ref_name", row["name"]) for row in rows}
    compared = len(rows)
    part_rows = _part_rows(test, ref, rows, parts or {}, tol, steps)
    if decide == "outputs":
        deciding = [row for row in rows if row["output"]]
        passed = bool(outputs) and outputs <= paired_test and all(row["passed"] for row in deciding)
    else:
        deciding = rows
        passed = compared > 0 and all(row["passed"] for row in rows)
    passed = passed and all(row["passed"] for row in part_rows)
    # the cosine of what decided: a tiny part's cosine is noise, its max abs error decided; so did the
    # elementwise bound of a tensor CLOSE below the tolerance's cosine (a map of sigmoids near 1e-7), unless
    # every output passed so (then their cosine is the only figure there is)
    judged = [row for row in deciding if not _close_only(row, tol)] or list(deciding)
    judged += [row for row in part_rows if row["rule"] == "similarity"]
    return {
        "tolerance": {"cos": tol.cos, "euc": tol.euc},
        "decided_by": "graph outputs" if decide == "outputs" else "every tensor",
        "compared": compared,
        "failed": sum(not row["passed"] for row in rows),
        "passed": passed,
        "min_cos": _min([row["cos"] for row in rows]),
        "min_euc": _min([row["euc"] for row in rows]),
        "min_sqnr": _min([row["sqnr"] for row in rows]),
        "decided_cos": _min([row["cos"] for row in judged]),
        "decided_euc": _min([row["euc"] for row in judged]),
        "decided_sqnr": _min([row["sqnr"] for row in judged]),
        "only_in_test": sorted(set(test) - paired_test),
        "only_in_ref": sorted(set(ref) - paired_ref),
        "tensors": rows,
        "parts": part_rows,
    }


# CLOSE's absolute bound for the result of an op whose values lie in [-1, 1] (a probability), in steps of a 16-bit
# result over that range (calibrate.RESULT_LEVELS), as the tiny-part rule gives INT8 4 of its steps. Smaller
# differences change no use of a probability; where every value is that small (a seal detector's map of a page
# without seals, all below 4e-7), its cosine is rounding noise: BF16 passed it above euc 0.90 one build and failed
# at 0.82 the next, with every value within 1.3e-7 of float.
BOUNDED_STEPS = 4.0


def bounded_outputs(module) -> dict[str, float]:
    """CLOSE's bound (BOUNDED_STEPS) by graph output name, for the outputs a Sigmoid, Softmax, HardSigmoid or
    Tanh makes."""
    from tpubuild.calib.calibrate import BOUNDED, RESULT_LEVELS
    from tpubuild.ir.mlir import return_op, value_name

    atol = BOUNDED_STEPS / RESULT_LEVELS
    return {value_name(v): atol for v in return_op(module).operands if isinstance(v.owner, BOUNDED)}


def _close_only(row: Mapping, tol: Tolerance) -> bool:
    """Whether a compared tensor passed by CLOSE's elementwise bound alone, its cosine or euc below ``tol``."""
    return row["label"] == CLOSE and not (row["cos"] >= tol.cos and row["euc"] >= tol.euc)


def _part_rows(test, ref, rows: list[dict], parts: Mapping[str, Sequence[Part]], tol: Tolerance, steps) -> list[dict]:
    """One row per part of a compared tensor: its slice of both sides, judged (parts.judge_part)."""
    from tpubuild.verify.parts import judge_part, part_step

    out = []
    for row in rows:
        t = row["name"]
        r = row.get("ref_name", t)
        for part in parts.get(t, ()):
            a, b = part.slice(test[t]), part.slice(ref[r])
            judged = judge_part(a, b, tol, part_step(part, steps))
            out.append(
                {"name": f"{r}[{part.name}]", "of": t, "shape": list(np.shape(a)), **part.to_dict(), **judged.to_dict()}
            )
    return out


def shown_cos(comp: Mapping) -> float | str:
    """The cosine a summary shows for a comparison: what decided it (``decided_cos``), else its minimum
    (verify files written before parts existed)."""
    return comp.get("decided_cos", comp.get("min_cos", math.nan))


def jsonable(value):
    """Non-finite floats as strings ('inf', '-inf', 'nan'): strict JSON has no Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def failed_parts(report: dict) -> list[dict]:
    """The parts that failed, lowest cosine first."""
    failed = [row for row in report.get("parts", ()) if not row["passed"]]
    return sorted(failed, key=lambda row: (row["cos"] == row["cos"], row["cos"]))


def format_part(row: dict) -> str:
    """A part's verdict in words: its slice, and the figures of the rule that judged it."""
    where = f"{row['name']} (axis {row['axis']}, {row['range'][0]}:{row['range'][1]})"
    if row.get("rule") == "tiny":
        return (
            f"{where}: {row['label']}, float values too small for their INT8 step ({row['step']:.3g}): max abs err "
            f"{row['max_abs']:.3g} (at most {tiny_bound(row['step']):.3g})"
        )
    return (
        f"{where}: {row['label']}, cos {row['cos']:.6f}, euc {row['euc']:.6f}, SQNR {row['sqnr']:.1f} dB, "
        f"max abs err {row['max_abs']:.3g}"
    )


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
