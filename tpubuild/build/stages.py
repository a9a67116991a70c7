"""Stage functions: each a pure function from files (and plain options) to files.

doit calls these through tasks.py, the CLI and tests call them directly. They
import the compiler lazily so that loading the task graph stays cheap, and
publish their outputs with all_or_nothing so a failed stage leaves no target.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tpubuild.errors import TpuBuildError


def transform(
    onnx_path: str,
    inputs: Sequence[Mapping[str, Any]],
    model: str,
    test_input: str | None,
    out_mlir: str,
    out_weights: str,
    out_input: str,
    test_sample: Mapping[str, Any] | None = None,
    out_source: str | None = None,
    left_out: bool = False,
) -> None:
    """ONNX -> origin.mlir + its weights, and the test input every later check feeds.

    Without ``test_input``, ``test_sample`` ({data_files, count}: the calibration samples, read with
    ``inputs`` as calibrate reads them) gives the test input: the sample calibration holds back (calib/data.py,
    split_test_sample); without either, generated noise. ``out_source``: a JSON file saying which it was.
    ``left_out``: the test_input is a calibration file that calibration leaves out (tasks.calibration_files)."""
    from tpubuild.build.external_data import check_beside
    from tpubuild.build.files import all_or_nothing, write_npz
    from tpubuild.build.inputs import freeze, of_onnx
    from tpubuild.build.testinput import describe_source, make_inputs
    from tpubuild.frontend import convert_onnx, load_onnx

    check_beside(Path(onnx_path))  # onnx.load's own error for a missing one speaks of a file "not regular"
    onnx_model = load_onnx(onnx_path)
    specs, fixed = of_onnx(inputs, onnx_model, file=onnx_path)
    freeze(onnx_model, fixed)
    held = None
    if not test_input and test_sample:
        from tpubuild.calib.data import Samples, split_test_sample

        held = split_test_sample(Samples.of(test_sample["data_files"], specs, test_sample.get("count")))[1]
    test = make_inputs(model, specs, test_input, held)
    source = json.dumps({"source": describe_source(test_input, held, left_out)}, indent=1) + "\n"
    shapes = {spec["name"]: spec["shape"] for spec in specs}
    module, weights = convert_onnx(onnx_model, shapes, model, Path(out_weights).name, file=onnx_path)
    outs = [out_mlir, out_weights, out_input] + ([out_source] if out_source else [])
    with all_or_nothing(*outs) as tmp:
        _save_module(module, tmp[0])
        weights.save(tmp[1])
        write_npz(tmp[2], test)
        if out_source:
            tmp[3].write_text(source, encoding="utf-8")


def reference(onnx_path: str, input_npz: str, out: str, inputs: Sequence[Mapping[str, Any]] = ()) -> None:
    """onnxruntime on the source model: every tensor, by name; the inputs with a fixed value (``inputs``: the
    manifest's entries) fed it."""
    import onnx

    from tpubuild.build.files import read_npz, write_npz
    from tpubuild.build.inputs import of_onnx
    from tpubuild.verify.reference import onnx_tensors

    fixed = {}
    if any("value" in entry for entry in inputs):
        fixed = of_onnx(inputs, onnx.load(onnx_path, load_external_data=False), file=onnx_path)[1]
    tensors = onnx_tensors(onnx_path, {**read_npz(input_npz), **fixed})
    write_npz(out, tensors)


def canonicalize(in_mlir: str, in_weights: str, out_mlir: str, out_weights: str) -> None:
    """origin.mlir -> canonical.mlir (TOP patterns), with its own weight file."""
    from tpubuild.build.files import all_or_nothing
    from tpubuild.ir.mlir import load_module
    from tpubuild.ir.weights import WeightStore
    from tpubuild.top.canonicalize import canonicalize as run_patterns

    module, weights = run_patterns(load_module(in_mlir), WeightStore.load(in_weights), Path(out_weights).name)
    with all_or_nothing(out_mlir, out_weights) as (tmp_mlir, tmp_weights):
        _save_module(module, tmp_mlir)
        weights.save(tmp_weights)


def calibrate(
    model: str,
    in_mlir: str,
    inputs: Sequence[Mapping[str, Any]],
    data_files: Sequence[str],
    count: int | None,
    method: str,
    user_table: str | None,
    out_mlir: str,
    out_table: str,
    searched: bool = False,
    hold_back_test: bool = False,
) -> None:
    """canonical.mlir + calibration data -> cali_table and cali.mlir (same weights: canonical_weights.npz);
    ``searched``: a mixed-precision search reads them, and takes the samples' TOP outputs from this process;
    ``hold_back_test``: the last sample is the test input (no test_input), which calibration never reads."""
    from tpubuild.build.files import all_or_nothing
    from tpubuild.calib.calibrate import apply_table, calibrate as run_calibration, check_state
    from tpubuild.calib.table import format_table, read_table
    from tpubuild.forked import processes
    from tpubuild.ir.mlir import file_key, load_module
    from tpubuild.top.inference import keep_outputs, weights_for

    module = load_module(in_mlir)
    check_state(module, in_mlir)
    user = read_table(user_table)[1] if user_table else None
    samples = _calibration_samples(module, in_mlir, data_files, inputs, count, hold_back_test)
    outputs: list | None = [] if searched else None
    entries, header = run_calibration(
        module, weights_for(module, in_mlir), samples, method, user, outputs, processes=processes()
    )
    text = format_table(entries, ["tpubuild calibration table", f"model: {model}", *header])
    with all_or_nothing(out_mlir, out_table) as (tmp_mlir, tmp_table):
        _save_module(apply_table(module, entries), tmp_mlir)
        tmp_table.write_text(text, encoding="utf-8")
    if outputs:
        keep_outputs(file_key(out_mlir), outputs)  # for the search, in this process (top.inference)


def _calibration_samples(
    module, in_mlir: str, data_files: Sequence[str], inputs, count: int | None, hold_back_test: bool
):
    """The calibration samples a stage reads: without the held-back test sample when ``hold_back_test``;
    ``inputs`` (the manifest's) completed from the module's."""
    from tpubuild.build.inputs import of_module
    from tpubuild.calib.data import Samples, split_test_sample

    samples = Samples.of(data_files, of_module(inputs, module, file=in_mlir), count)
    return split_test_sample(samples)[0] if hold_back_test else samples


def _read_source(path: str) -> str:
    return json.loads(Path(path).read_text(encoding="utf-8"))["source"]


def _save_module(module, path: Path) -> None:
    from tpubuild.ir.mlir import save_module

    save_module(module, str(path))


def _top_outputs(mlir_path: str) -> list[str]:
    from tpubuild.ir.mlir import load_module
    from tpubuild.top.inference import output_names

    return list(output_names(load_module(mlir_path)))


def verify_top(
    model: str,
    onnx_path: str,
    origin_mlir: str,
    canonical_mlir: str,
    input_npz: str,
    onnx_outs: str,
    tolerance: Mapping[str, float],
    out_origin_outs: str,
    out_top_outs: str,
    out_json: str,
    input_source: str | None = None,
) -> None:
    """TOP inference of origin and canonical, each compared with onnxruntime by tensor name.

    Fails (publishing nothing) if either comparison is below tolerance or compares nothing.
    ``input_source``: transform's note of where the test input came from, recorded as ``test_input``.
    """
    from tpubuild.build.files import all_or_nothing, read_npz, write_npz
    from tpubuild.top.inference import infer_file
    from tpubuild.verify.compare import compare_tensors, jsonable
    from tpubuild.verify.reference import output_names
    from tpubuild.verify.similarity import FLOAT32_ATOL

    tol = _tolerance(tolerance, atol=FLOAT32_ATOL)
    inputs = read_npz(input_npz)
    ref = read_npz(onnx_outs)
    ref_outputs = output_names(onnx_path)
    levels = []
    for level, mlir in (("origin", origin_mlir), ("canonical", canonical_mlir)):
        tensors = infer_file(mlir, inputs)
        report = compare_tensors(tensors, ref, tol, test_outputs=_top_outputs(mlir), ref_outputs=ref_outputs)
        levels.append((level, mlir, tensors, report))
    doc = {
        "model": model,
        "stage": "verify_top",
        **({"test_input": _read_source(input_source)} if input_source else {}),
        "comparisons": [
            {"level": "top", "test": f"{Path(mlir).name}", "ref": Path(onnx_outs).name, **report}
            for _, mlir, _, report in levels
        ],
    }
    failures = [_failure_text(level, report) for level, _, _, report in levels if not report["passed"]]
    if failures:
        _keep_failure(out_json, doc)
        raise TpuBuildError(
            "TOP inference does not match onnxruntime:\n" + "\n".join(failures),
            model=model,
            stage="verify_top",
            hint=f"to inspect: tpubuild infer {canonical_mlir} --input {input_npz} --output top.npz "
            f"--all-tensors && tpubuild compare top.npz {onnx_outs}",
        )
    _forget_failure(out_json)
    text = json.dumps(jsonable(doc), indent=1, sort_keys=True) + "\n"
    with all_or_nothing(out_origin_outs, out_top_outs, out_json) as (tmp_origin, tmp_top, tmp_json):
        write_npz(tmp_origin, levels[0][2])
        write_npz(tmp_top, levels[1][2])
        tmp_json.write_text(text, encoding="utf-8")


def lower(
    model: str,
    in_mlir: str,
    cali_table: str | None,
    quantize_table: str | None,
    chip: str,
    mode: str,
    asymmetric: bool,
    out_mlir: str,
    out_weights: str,
    top_outs: str | None = None,
    bias_correction: str | None = None,
) -> None:
    """canonical.mlir (float targets) or cali.mlir + cali_table (INT8) -> tpu.mlir + tpu_weights.npz; an F16
    target reads top_outs.npz too, for the values float16 cannot hold (lowering.overflowing); an INT8 one the
    search's bias_correction.npz (lower/bias.py)."""
    from tpubuild.build.chips import load_chip
    from tpubuild.build.files import all_or_nothing, read_npz
    from tpubuild.calib.table import read_table
    from tpubuild.ir.mlir import load_module
    from tpubuild.lower.lowering import lower_module
    from tpubuild.lower.qtable import read_quantize_table
    from tpubuild.top.inference import weights_for

    target = load_chip(chip)
    target.check_mode(mode)  # before any work
    module = load_module(in_mlir)
    cali = read_table(cali_table)[1] if cali_table else None
    qtable = read_quantize_table(quantize_table) if quantize_table else None
    tpu_module, weights = lower_module(
        module,
        weights_for(module, in_mlir),
        chip=target,
        mode=mode,
        asymmetric=asymmetric,
        cali=cali,
        qtable=qtable,
        weight_file=Path(out_weights).name,
        absmax=_absmax(top_outs) if top_outs else None,
        bias_corrections=read_npz(bias_correction) if bias_correction else None,
    )
    with all_or_nothing(out_mlir, out_weights) as (tmp_mlir, tmp_weights):
        _save_module(tpu_module, tmp_mlir)
        weights.save(tmp_weights)


def _absmax(npz: str) -> dict[str, float]:
    """Each float tensor's largest finite magnitude in an npz of TOP's outputs."""
    import numpy as np

    with np.load(npz) as z:
        out = {}
        for name in z.files:
            a = z[name]
            if a.dtype.kind == "f" and a.size:
                finite = np.abs(a[np.isfinite(a)])
                out[name] = float(finite.max()) if finite.size else 0.0
        return out


def search_qtable(
    model: str,
    target: str,
    in_mlir: str,
    cali_table: str,
    user_table: str | None,
    inputs: Sequence[Mapping[str, Any]],
    data_files: Sequence[str],
    chip: str,
    asymmetric: bool,
    options: Mapping[str, Any],
    out_table: str,
    out_bias: str,
    hold_back_test: bool = False,
    count: int | None = None,
    bias_correction: bool = True,
) -> None:
    """cali.mlir + cali_table + calibration samples -> bias_correction.npz, the mean error INT8 leaves in each
    conv's and matmul's output taken out of its bias (tpubuild/lower/bias.py) where that does better over the
    search's pool (empty where not), and qtable.txt: the user's quantize table plus the fewest tensors kept in
    float for every output to reach the target cosine with those corrections (tpubuild/lower/search.py);
    ``hold_back_test``: the samples calibration reads (its ``count``), without the held-back test sample."""
    from tpubuild.build.chips import load_chip
    from tpubuild.build.files import all_or_nothing, npz_bytes
    from tpubuild.calib.table import read_table
    from tpubuild.forked import processes
    from tpubuild.ir.mlir import file_key, load_module
    from tpubuild.lower.bias import bias_corrections, correction_samples
    from tpubuild.lower.qtable import read_quantize_table
    from tpubuild.lower.search import SearchConfig, format_result, search, search_pool
    from tpubuild.top.inference import kept_outputs, weights_for

    config = SearchConfig.of(options)
    module = load_module(in_mlir)
    # the samples calibration reads: without the held-back test sample when there is one (it is their last)
    every = _calibration_samples(module, in_mlir, data_files, inputs, count, hold_back_test)
    samples, pool = search_pool(every, config)
    if not samples:
        raise TpuBuildError(
            "no calibration sample to search a quantize table with",
            model=model,
            stage="search",
            hint="check calibration.data in the manifest",
        )
    user = read_quantize_table(user_table) if user_table else {}
    key = file_key(in_mlir)
    refs = {i: outputs for i, sample in enumerate(samples) if (outputs := kept_outputs(key, sample)) is not None}
    weights, target_chip, cali = weights_for(module, in_mlir), load_chip(chip), read_table(cali_table)[1]
    corrections = (
        bias_corrections(
            module,
            weights,
            chip=target_chip,
            cali=cali,
            asymmetric=asymmetric,
            samples=correction_samples(every),
            qtable=user,
        )
        if bias_correction
        else {}
    )
    result = search(
        module,
        weights,
        chip=target_chip,
        cali=cali,
        asymmetric=asymmetric,
        samples=samples,
        config=config,
        user=user,
        log=lambda line: print(f"{model}/{target}: {line}", flush=True),
        processes=processes(),
        refs=refs,
        bias_corrections=corrections,
    )
    header = ["tpubuild quantize table", f"model: {model}", f"target: {target}", f"pool: {pool}"]
    with all_or_nothing(out_table, out_bias) as (tmp_table, tmp_bias):
        tmp_table.write_text(format_result(result, header), encoding="utf-8")
        tmp_bias.write_bytes(npz_bytes(result.bias_corrections))
    verdict = "reached" if result.reached else "NOT reached (the table keeps the best found)"
    print(
        f"{model}/{target}: {len(result.chosen)} tensors ({len(result.table) - len(user)} ops) in "
        f"{result.mode} (the table's ops: {result.float_macs:.1%} of the multiply-accumulates), "
        f"cos {result.int8_score:.6f} -> {result.score:.6f}, target {result.target} {verdict}; "
        f"{result.lowerings} lowerings"
    )


def share_qtable(source: str, target: str, out_table: str, source_bias: str, out_bias: str) -> None:
    """Another target's searched table and bias corrections as this target's: the same lines, the table's header
    naming both, and the same corrections."""
    from tpubuild.build.files import all_or_nothing

    lines = Path(source).read_text().splitlines()
    lines = [
        f"# target: {target} (searched as {line[len('# target: ') :]}: the same INT8 lowering)"
        if line.startswith("# target: ")
        else line
        for line in lines
    ]
    with all_or_nothing(out_table, out_bias) as (tmp_table, tmp_bias):
        tmp_table.write_text("\n".join(lines) + "\n", encoding="utf-8")
        tmp_bias.write_bytes(Path(source_bias).read_bytes())


# The modules the stages import when they run (inside them: loading dodo.py stays cheap). A doit process with
# no task yet imports them ahead (dispatch.py): at the start of a build one process waits for the source and
# its ONNX import, about a second in which it can do this instead of in its later stages.
STAGE_MODULES = (
    "onnxruntime",
    "tpubuild.frontend",
    "tpubuild.verify.reference",
    "tpubuild.top.canonicalize",
    "tpubuild.top.inference",
    "tpubuild.calib.calibrate",
    "tpubuild.lower.lowering",
    "tpubuild.lower.int8",
    "tpubuild.lower.inference",
    "tpubuild.verify.compare",
    "tpubuild.codegen.layergroup",
    "tpubuild.codegen.assign",
    "tpubuild.codegen.codegen",
    "tpubuild.sim.chip",
    "tpubuild.verify.charts",
)


def import_stage_modules() -> None:
    import importlib

    for name in STAGE_MODULES:
        # an ImportError is left to the stage that needs it, which reports it as its error
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def verify_tpu(
    model: str,
    target: str,
    tpu_mlir: str,
    top_mlir: str,
    input_npz: str,
    top_outs: str,
    tolerance: Mapping[str, float],
    out_tpu_outs: str,
    out_tpu_raw: str,
    out_json: str,
    outputs: Mapping[str, Any] | None = None,
    cali_table: str | None = None,
    quantize_table: str | None = None,
    mode: str | None = None,
) -> None:
    """TPU inference (real values) vs TOP inference by tensor name, plus per-output max abs error and top-1.

    The graph outputs decide (as TPU-MLIR's model_deploy without --compare_all): each must
    pair with TOP's (by name or position) and meet ``tolerance`` (cos, euc; and top1 and
    max_abs when given), and so must each part of an output (a Concat's inputs, or the
    manifest's ``outputs`` parts; tpubuild/verify/parts.py), a tiny part by the tiny-part
    rule with the thresholds of ``cali_table`` (INT8). Every other tensor is compared and
    reported, never failing: its quantization error depends on its own range and size (an
    SE block's 48 pooled values sit far from float while the outputs do not). Fails
    (publishing nothing) otherwise; an INT8 failure's hint is int8_failure_hint's.
    Keeps the stored bits too (tpu_raw.npz): what the chip simulation must reproduce.
    ``quantize_table``: the table lowering read (for the hint only). ``mode``: the target's (an F16
    tensor is CLOSE within FLOAT16_ATOL; an output a Sigmoid, Softmax... makes within
    BOUNDED_STEPS steps of a 16-bit result).
    """
    import numpy as np

    from tpubuild.build.files import all_or_nothing, read_npz, write_npz
    from tpubuild.ir.mlir import load_module
    from tpubuild.lower.inference import infer_tpu
    from tpubuild.top.inference import output_names
    from tpubuild.verify.compare import bounded_outputs, compare_tensors, jsonable
    from tpubuild.verify.parts import output_parts
    from tpubuild.verify.similarity import FLOAT16_ATOL

    tol = _tolerance(tolerance, atol=FLOAT16_ATOL if mode == "F16" else None)
    raw, real = infer_tpu(tpu_mlir, read_npz(input_npz))
    ref = read_npz(top_outs)
    top_module = load_module(top_mlir)
    tpu_outputs, top_outputs = _top_outputs(tpu_mlir), list(output_names(top_module))
    # graph outputs by position (a lowered output may be a cast of the named tensor), judged beyond one cosine
    pairs = [(t, r) for t, r in zip(tpu_outputs, top_outputs, strict=False) if np.shape(real[t]) == np.shape(ref[r])]
    if len(pairs) != len(top_outputs):
        raise TpuBuildError(
            f"the TPU graph's outputs {tpu_outputs} do not pair with TOP's {top_outputs} "
            "(by position, with equal shapes)",
            model=model,
            stage="verify_tpu",
            file=tpu_mlir,
        )
    by_top = output_parts(top_module, outputs, {r: np.shape(ref[r]) for r in top_outputs})
    parts = {t: by_top[r] for t, r in pairs if r in by_top}
    thresholds = _thresholds(cali_table)
    report = compare_tensors(
        real,
        ref,
        tol,
        test_outputs=tpu_outputs,
        ref_outputs=top_outputs,
        decide="outputs",
        parts=parts,
        steps=thresholds,
        atols=bounded_outputs(top_module),
    )
    report["outputs"] = [_output_checks(t, r, real[t], ref[r], tolerance) for t, r in pairs]
    report["passed"] = report["passed"] and all(out["passed"] for out in report["outputs"])
    doc = {
        "model": model,
        "stage": "verify_tpu",
        "target": target,
        "comparisons": [
            {"level": "tpu", "test": f"{target}/{Path(tpu_mlir).name}", "ref": Path(top_outs).name, **report}
        ],
    }
    if not report["passed"]:
        _keep_failure(out_json, doc)
        inspect = (
            f"to inspect: tpubuild infer {tpu_mlir} --input {input_npz} --output tpu.npz "
            f"--all-tensors --real && tpubuild compare tpu.npz {top_outs}"
        )
        if cali_table:
            from tpubuild.build.paths import failed_json

            hint = int8_failure_hint(target, quantize_table, str(failed_json(out_json))) + "; " + inspect
        else:
            hint = inspect + "; pin the worst ops to a wider float mode in a quantize table"
        raise TpuBuildError(
            f"TPU inference ({target}) does not match TOP inference:\n" + _failure_text("tpu", report),
            model=model,
            stage="verify_tpu",
            hint=hint,
        )
    _forget_failure(out_json)
    text = json.dumps(jsonable(doc), indent=1, sort_keys=True) + "\n"
    with all_or_nothing(out_tpu_outs, out_tpu_raw, out_json) as (tmp_outs, tmp_raw, tmp_json):
        write_npz(tmp_outs, real)
        write_npz(tmp_raw, raw)
        tmp_json.write_text(text, encoding="utf-8")


# the quantize table's header line saying how many samples calibration read (search.search_pool)
_POOL = re.compile(r"# pool: (?:all (\d+)|\d+ of the (\d+)) calibration samples")
# fewer calibration samples than this: a failing INT8 target's hint asks for more
FEW_SAMPLES = 32


def int8_failure_hint(target: str, quantize_table: str | None, failed_file: str | None = None) -> str:
    """What a user does about an INT8 target whose outputs (or parts) are too far from float: what the
    mixed-precision path kept in float, and how to widen it; loosening the tolerance only last, as what hides
    the problem rather than what fixes it."""
    from tpubuild.lower.search import ALL_FLOAT_LINE

    table = Path(quantize_table) if quantize_table else None
    lines = table.read_text(encoding="utf-8").splitlines() if table is not None and table.is_file() else None
    kept = None if lines is None else sum(1 for line in lines if line.strip() and not line.lstrip().startswith("#"))
    where = f"{target}/{table.name}" if table is not None and table.parent.name == target else str(table)
    if lines is None or not any("mixed-precision search" in line for line in lines):
        kept_text = "no tensor" if lines is None else f"only the quantize table's {kept} ops"
        first = (
            f"{kept_text} of {target} stay in float, as the search is off: remove mixed_precision: "
            "{search: false} from the manifest so that the search keeps in float what INT8 cannot hold"
        )
    elif any("TARGET NOT REACHED: the fewest tensors found that hold" in line for line in lines):
        first = (
            f"the search's target is beyond what its float mode reaches with every op in float, so it kept the "
            f"{kept} ops ({where}) that hold its floor on the calibration samples, and the test input is further "
            "from float: give calibration.data more inputs like the test input, or pin the ops furthest from float "
            "(report.html) in a quantize table"
        )
    elif all_float := next((line for line in lines if line.startswith(f"# {ALL_FLOAT_LINE} ")), None):
        mode, score = all_float[len(f"# {ALL_FLOAT_LINE} ") :].split(",")[0].split(": ")
        first = (
            f"with every op in {mode}, the chip's float mode, the model reaches only cos {score} on the "
            f"calibration samples ({where}), and no table the search tried came nearer its target: the model "
            f"needs more precision than {mode} carries on these inputs. Compile it for a chip with F16 or F32, "
            "or, if the test input is not of the kind the model is made for, give one that is (test_input) and "
            "calibration data like it"
        )
    elif any("TARGET NOT REACHED" in line for line in lines):
        first = (
            f"the search kept {kept} ops in float ({where}) but ran out of lowerings before its target: raise "
            "mixed_precision.max_lowerings"
        )
    else:
        first = (
            f"the search reached its target on the calibration samples held back for it, keeping {kept} ops in "
            f"float ({where}), but the test input is further from float: give calibration.data more inputs like "
            "the test input, or raise mixed_precision.target_cos so that more stays in float"
        )
    found = next((m for line in lines or [] if (m := _POOL.match(line))), None)
    read = int(found.group(1) or found.group(2)) if found else None
    if read is not None and read < FEW_SAMPLES:
        first += (
            f"; calibration read only {read} samples, and a table found on so few holds on others by chance: give "
            "calibration.data a few dozen to a hundred inputs of the kind the model is used on"
        )
    return (
        f"{first}; calibration.method and calibration.count change the INT8 scales themselves"
        + (f"; every output and part compared is in {failed_file}" if failed_file else "")
        + "; loosening tolerance.tpu.INT8 hides the problem rather than fixing it"
    )


def _thresholds(cali_table: str | None) -> dict[str, float] | None:
    """Calibration thresholds by tensor name (the tiny-part rule's INT8 scale), or None without a table."""
    if not cali_table:
        return None
    from tpubuild.calib.table import read_table

    return {name: entry.threshold for name, entry in read_table(cali_table)[1].items()}


def run_chip(model_file: str, input_npz: str, out_outs: str, out_profile: str) -> None:
    """The simulated chip on the test input: its outputs (stored types) and its cycle estimate."""
    from tpubuild.build.files import all_or_nothing, read_npz, write_npz
    from tpubuild.sim.chip import run_file

    result = run_file(model_file, read_npz(input_npz))
    text = json.dumps(result.profile, indent=1, sort_keys=True) + "\n"
    with all_or_nothing(out_outs, out_profile) as (tmp_outs, tmp_profile):
        write_npz(tmp_outs, result.outputs)
        tmp_profile.write_text(text, encoding="utf-8")


# What Chip vs Tpu must reach per mode: the chip runs TPU inference's kernels, so INT8 is
# bit-exact by construction and F32 differs at most by summation order inside a slice.
CHIP_REQUIRED = {"INT8": ("EQUAL",), "F32": ("EQUAL", "CLOSE")}


def verify_chip(
    model: str,
    target: str,
    mode: str,
    model_file: str,
    chip_outs: str,
    tpu_raw: str,
    verify_top_json: str,
    verify_tpu_json: str,
    profile_json: str,
    tolerance: Mapping[str, float],
    out_json: str,
) -> None:
    """Chip outputs vs TPU inference's stored outputs -> verify.json with every level (ONNX, Top, Tpu, Chip).

    INT8 targets must match bit for bit, F32 within float round-off (CLOSE), BF16/F16 within
    ``tolerance``. Fails (publishing nothing) otherwise or when no output pairs by name.
    """
    from tpubuild.build.files import read_npz, write_text
    from tpubuild.verify.compare import compare_tensors, jsonable
    from tpubuild.verify.similarity import NOT_MATCH, NOT_SIMILAR

    chip = read_npz(chip_outs)
    raw = read_npz(tpu_raw)
    missing = sorted(set(chip) - set(raw))
    if missing:
        raise TpuBuildError(
            f"chip outputs {missing} are not tensors of TPU inference ({Path(tpu_raw).name})",
            model=model,
            stage="verify_chip",
            file=model_file,
            hint="codegen must name the model's outputs as tpu.mlir's graph outputs",
        )
    tpu_doc = json.loads(Path(verify_tpu_json).read_text(encoding="utf-8"))
    report = compare_tensors(
        chip, {name: raw[name] for name in chip}, _tolerance(tolerance), parts=_parts_of(tpu_doc, "tpu")
    )
    required = CHIP_REQUIRED.get(mode)
    if required:
        for row in report["tensors"] + report["parts"]:
            row["required"] = " or ".join(required)
            row["passed"] = row["label"] in required
        report["failed"] = sum(not row["passed"] for row in report["tensors"])
        report["passed"] = (
            report["compared"] > 0 and report["failed"] == 0 and all(row["passed"] for row in report["parts"])
        )
    chip_level = {"level": "chip", "test": f"{target}/{Path(model_file).name}", "ref": Path(tpu_raw).name, **report}
    if not report["passed"]:
        _keep_failure(out_json, {"model": model, "stage": "verify_chip", "target": target, "comparisons": [chip_level]})
        lines = [
            f"  {row['name']}: {row['label']}"
            + (f" (required: {row['required']})" if "required" in row else "")
            + f", cos {row['cos']:.6f}, max abs err {row['max_abs']:.3g}"
            for row in report["tensors"] + report["parts"]
            if not row["passed"] or row["label"] in (NOT_MATCH, NOT_SIMILAR)
        ]
        raise TpuBuildError(
            f"the simulated chip ({target}) does not reproduce TPU inference:\n" + "\n".join(lines),
            model=model,
            stage="verify_chip",
            hint=f"to inspect: tpubuild run {model_file} --input <input.npz> --output chip.npz && "
            f"tpubuild compare chip.npz {tpu_raw}",
        )
    _forget_failure(out_json)
    top_doc = json.loads(Path(verify_top_json).read_text(encoding="utf-8"))
    levels = top_doc["comparisons"] + tpu_doc["comparisons"] + [chip_level]
    profile = json.loads(Path(profile_json).read_text(encoding="utf-8"))
    doc = {
        "model": model,
        "stage": "verify_chip",
        "target": target,
        "levels": ["onnx", "top", "tpu", "chip"],
        "comparisons": levels,
        "passed": all(c["passed"] for c in levels),
        **({"test_input": top_doc["test_input"]} if "test_input" in top_doc else {}),
        "chip": {k: profile[k] for k in ("total_cycles", "time_ms", "ddr_read_bytes", "ddr_write_bytes")},
    }
    write_text(out_json, json.dumps(jsonable(doc), indent=1, sort_keys=True) + "\n")


def layergroup(model: str, chip: str, in_mlir: str, out_mlir: str) -> None:
    """tpu.mlir -> lg.mlir: layer groups, their slicing and local memory (group info on every op)."""
    from tpubuild.build.chips import load_chip
    from tpubuild.codegen.layergroup import layer_group
    from tpubuild.ir.mlir import load_module

    module, groups = layer_group(load_module(in_mlir), load_chip(chip))
    local = sum(g.kind == "local" for g in groups)
    _save_module(module, Path(out_mlir))
    print(f"{model}: {len(groups)} groups ({local} local), estimated {sum(g.cycles for g in groups)} cycles")


def assign(model: str, chip: str, in_mlir: str, out_mlir: str) -> None:
    """lg.mlir -> addr.mlir: DDR addresses of weights and activations; prints peak vs lower bound."""
    from tpubuild.build.chips import load_chip
    from tpubuild.codegen.assign import memory_assign
    from tpubuild.ir.mlir import load_module

    module, a = memory_assign(load_module(in_mlir), load_chip(chip))
    _save_module(module, Path(out_mlir))
    print(
        f"{model}: weights {a.weight_bytes} B, activations {a.activation_bytes} B "
        f"(lower bound {a.lower_bound} B, x{a.ratio:.3f})"
    )


def codegen(model: str, chip: str, in_mlir: str, in_weights: str, out_model: str) -> None:
    """addr.mlir + tpu_weights.npz -> <model>.model: weights blob and the GDMA/BDC command streams."""
    from tpubuild.build.chips import load_chip
    from tpubuild.codegen.codegen import codegen as emit
    from tpubuild.codegen.model_file import write_model
    from tpubuild.ir.mlir import load_module
    from tpubuild.ir.weights import WeightStore

    model_file = emit(load_module(in_mlir), WeightStore.load(in_weights), load_chip(chip))
    write_model(out_model, model_file)
    print(
        f"{model}: {len(model_file.gdma)} GDMA + {len(model_file.bdc)} BDC commands, "
        f"{len(model_file.weights)} weight bytes, DDR {model_file.header.ddr_size} bytes"
    )


def _parts_of(doc: Mapping[str, Any], level: str) -> dict:
    """The parts a verify document judged at ``level``, by output name (the chip judges the TPU's parts)."""
    from tpubuild.verify.parts import Part

    parts: dict[str, list] = {}
    for comp in doc["comparisons"]:
        if comp["level"] == level:
            for row in comp.get("parts", ()):
                parts.setdefault(row["of"], []).append(Part.from_dict(row))
    return parts


def _keep_failure(out_json: str, doc: dict) -> None:
    """A failing comparison, kept beside the JSON it would have published (never a target) for the reports."""
    from tpubuild.build.files import write_text
    from tpubuild.build.paths import failed_json
    from tpubuild.verify.compare import jsonable

    write_text(failed_json(out_json), json.dumps(jsonable({**doc, "passed": False}), indent=1, sort_keys=True) + "\n")


def _forget_failure(out_json: str) -> None:
    from tpubuild.build.paths import failed_json

    failed_json(out_json).unlink(missing_ok=True)


def _tolerance(tolerance: Mapping[str, float], atol: float | None = None):
    """The manifest's ``{cos, euc}`` as a Tolerance; ``atol``: CLOSE's absolute bound, if not CLOSE_ATOL."""
    from tpubuild.verify.similarity import CLOSE_ATOL, Tolerance

    return Tolerance(float(tolerance["cos"]), float(tolerance["euc"]), CLOSE_ATOL if atol is None else atol)


def _output_checks(name: str, ref_name: str, test, ref, tolerance: Mapping[str, float]) -> dict:
    """An output's max abs error and top-1 agreement, failing against tolerance's max_abs / top1 if given."""
    import numpy as np

    from tpubuild.verify.similarity import max_abs_error

    out = {
        "name": name,
        "ref_name": ref_name,
        "max_abs": max_abs_error(test, ref),
        "ref_max_abs": float(np.max(np.abs(ref))) if np.size(ref) else 0.0,
        "top1_agreement": _top1(test, ref),
    }
    problems = []
    bad = int(np.size(test) - np.count_nonzero(np.isfinite(test)))
    if bad > np.size(ref) - np.count_nonzero(np.isfinite(ref)):
        problems.append(f"{bad} of {np.size(test)} values NaN or infinite (float overflowed or divided by 0)")
    if "max_abs" in tolerance and not out["max_abs"] <= float(tolerance["max_abs"]):
        problems.append(f"max abs error {out['max_abs']:.4g} > {tolerance['max_abs']}")
    if "top1" in tolerance and out["top1_agreement"] is not None and out["top1_agreement"] < float(tolerance["top1"]):
        problems.append(f"top-1 agreement {out['top1_agreement']:.4f} < {tolerance['top1']}")
    out["problems"], out["passed"] = problems, not problems
    return out


def _top1(test, ref) -> float | None:
    """The fraction of rows (all but the last dim) whose argmax agrees; None for a scalar or one-wide output."""
    import numpy as np

    test, ref = np.asarray(test), np.asarray(ref)
    if test.ndim == 0 or test.shape[-1] < 2:
        return None
    return float(np.mean(np.argmax(test, axis=-1) == np.argmax(ref, axis=-1)))


def _failure_text(level: str, report: dict) -> str:
    from tpubuild.verify.compare import failed_parts, format_part, format_row, worst

    if report["compared"] == 0:
        return f"  {level}: no tensor name in common with onnxruntime's, so nothing was compared"
    tol = f"cos {report['tolerance']['cos']}, euc {report['tolerance']['euc']}"
    if report.get("decided_by") != "graph outputs":
        lines = [f"  {level}: {report['failed']} of {report['compared']} tensors below {tol}; worst:"]
        return "\n".join(lines + [f"    {format_row(row)}" for row in worst(report)])
    lines = [f"  {level}: graph outputs (or their parts) failing:"]
    lines += [f"    {format_row(row)} (below {tol})" for row in worst(report, outputs=True)]
    lines += [
        f"    {out['name']}: {'; '.join(out['problems'])}" for out in report.get("outputs", []) if out["problems"]
    ]
    lines += [f"    part {format_part(row)}" for row in failed_parts(report)]
    inner = [row for row in worst(report, count=report["compared"]) if not row["output"]]
    if inner:
        lines.append(f"  {len(inner)} other tensors below {tol} (reported, not deciding); worst:")
        lines += [f"    {format_row(row)}" for row in inner[:5]]
    return "\n".join(lines)


SUMMARY_HEADER = f"{'level':<10} {'compared':<44} {'tensors':>7} {'cos':>10} {'euc':>10} {'SQNR':>10}  result"
SUMMARY_NOTE = (
    "cos, euc, SQNR: the lowest of what decides each level (top: every tensor; tpu: the graph outputs and "
    "their parts; chip: the outputs and parts); report.html shows the intermediate minimum"
)


def summary_lines(verify_jsons: Sequence[str]) -> list[str]:
    """One line per comparison in the given verify JSON files, then one per output part of it."""
    lines = [SUMMARY_HEADER]
    for path in verify_jsons:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        comparisons = doc["comparisons"]
        if doc.get("stage") == "verify_chip":  # its Top and Tpu levels are the files before it in the list
            comparisons = [c for c in comparisons if c["level"] == "chip"]
        elif doc.get("stage") == "verify_iree":  # a cpu target's: its Top level is verify_top.json's
            comparisons = [c for c in comparisons if c["level"] == "iree"]
        for comp in comparisons:
            lines.append(summary_row(comp))
            lines += [summary_part_row(row) for row in comp.get("parts", ())]
    return lines


def summary_row(comp: Mapping[str, Any]) -> str:
    """A comparison's summary line: the figures of what decided it (compare.shown_cos), and its verdict."""
    from tpubuild.verify.compare import shown_cos

    what = f"{comp['test']} vs {comp['ref']}"
    euc, sqnr = comp.get("decided_euc", comp["min_euc"]), comp.get("decided_sqnr", comp["min_sqnr"])
    return (
        f"{comp['level']:<10} {what:<44} {comp['compared']:>7} {_num(shown_cos(comp), 6):>10} "
        f"{_num(euc, 6):>10} {_num(sqnr, 1, ' dB'):>10}  {'PASS' if comp['passed'] else 'FAIL'}"
    )


def summary_part_row(row: Mapping[str, Any]) -> str:
    """A part's line under its comparison; a tiny part shows the max abs error that judged it."""
    what = f"  part {row['name']} (axis {row['axis']}, {row['range'][0]}:{row['range'][1]})"
    verdict = "PASS" if row["passed"] else "FAIL"
    if row.get("rule") == "tiny":
        from tpubuild.verify.parts import tiny_bound

        bound = tiny_bound(row["step"])
        return f"{'':<10} {what:<52} tiny part: max abs err {row['max_abs']:.3g} (at most {bound:.3g})  {verdict}"
    return (
        f"{'':<10} {what:<52} {_num(row['cos'], 6):>10} {_num(row['euc'], 6):>10} "
        f"{_num(row['sqnr'], 1, ' dB'):>10}  {verdict}"
    )


def _test_input_source(verify_jsons: Sequence[str]) -> str | None:
    """Where the test input came from, as verify_top.json records it."""
    for path in verify_jsons:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        if "test_input" in doc:
            return doc["test_input"]
    return None


def _num(value, digits: int, unit: str = "") -> str:
    return value if isinstance(value, str) else f"{value:.{digits}f}{unit}"


def summarize(model: str, verify_jsons: Sequence[str], out_summary: str) -> None:
    """Print the per-stage verification summary and keep it as summary.txt."""
    from tpubuild.build.files import write_text

    head = [f"verification summary: {model}"]
    source = _test_input_source(verify_jsons)
    if source:
        head.append(f"test input: {source}")
    text = "\n".join(head + summary_lines(verify_jsons) + [SUMMARY_NOTE]) + "\n"
    write_text(out_summary, text)
    print(text, end="")
