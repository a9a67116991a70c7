"""INT8 accuracy against float, per model and output part: ours as a manifest without tuning fields builds it, beside
onnxruntime's quantize_static and TPU-MLIR's defaults (issue 17's table).

    python bench/int8_accuracy.py [--models REGEX] [--manifest PATH ...] [--samples N] [--reserve 4] [--eval N]
                                  [--no-ort] [--no-tpumlir] [--venv DIR] [--json OUT]
    python bench/int8_accuracy.py --methods max,percentile,kl,mse,auto [--asym] [--search-method M] [--no-search]
                                  [--default] ...   (the older per-method variants of ours instead)

Models: each manifest in configs/models (and configs/models/torch when torch is
installed) with an INT8 target and calibration data whose name matches --models,
or the manifests given with --manifest (repeatable; models outside the zoo).

Data, the same arrays for every column:

- calibration: the samples the build reads (the manifest's `calibration.data`,
  sorted, at most its `count`). When that is every sample of the set (no
  `count`, or one as large as the set), the last --reserve samples (default 4)
  are left out of calibration for evaluation: as the manifest with `count:
  <set size - reserve>` builds it (`count` is no tuning field). --samples N
  reads fewer, to debug quickly (then ours is not as the manifest builds it;
  the output says so).
- evaluation: inputs calibration never read, which the output names: the
  samples of the set after those calibration reads (at most --eval of them,
  default all), plus the manifest's `test_input` when it is no calibration
  file. The samples calibration holds back from its statistics (every 5th of the
  first 40) are NOT among them: the mixed-precision search chose its table on them.

Columns, each the lowest cosine against onnxruntime float (the source ONNX model)
over the evaluation inputs, per output part:

- ours: what a manifest with no tuning fields builds for bm1684x INT8
  (symmetric): calibration with the default method (`auto`) on the calibration
  samples minus those held back, then the mixed-precision search with default
  options judged on the calibration samples where INT8 alone is furthest from float
  (calibrate and search stages; a manifest's
  `method`, `table`, `quantize_table` and `mixed_precision` are ignored), output by
  TPU inference (the chip's exact arithmetic; the simulator is bit-exact with it);
- onnxruntime MinMax, Percentile, Entropy: its recommended flow on the same
  calibration samples (all the build reads, held-back ones included): the model
  at opset 13 at least, quant_pre_process (shape inference, batch-norm folding),
  quantize_static with QDQ and per-channel weights, its defaults otherwise
  (int8 activations, asymmetric; int8 symmetric weights), run by onnxruntime. The
  ranges come from its own calibrator (create_calibrator), handed to quantize_static
  as a calibration cache; for MinMax with the options quantize_static itself
  gives it. Percentile: 2048 bins of |x|, symmetric (its defaults), at 99.99%
  (CalibPercentile, which quantize_static forwards; TensorRT's default, and the
  one its docstring states) instead of its 99.999%, which on demo_cnn (10 samples)
  gave every range equal to MinMax's (0 of 16 tensors differ by more than 1%). For Entropy
  quantize_static gives the calibrator no bin count (extra_options cannot carry
  one), so it histograms into 128 bins for 128 quantized bins: a single
  candidate, the full range, and Entropy comes out as MinMax. Here its calibrator
  gets num_bins 512: 193 candidate ranges (2048, as its Percentile's histogram,
  took 77 s on demo_cnn's 16 tensors alone: its search over candidates is Python loops).
  The output counts the tensors whose range differs from MinMax's by more than 1%;
- TPU-MLIR 1.30.2 defaults, where its venv exists (.anchors/tpumlir-venv or
  --venv): model_transform, run_calibration (KL plus its auto-tune) on the same
  calibration samples, model_deploy --quantize INT8 --chip bm1684x (symmetric),
  then model_runner on the .bmodel (bm1684x cmodel) per evaluation input; driven
  by bench/vs_tpumlir.py's functions. When model_deploy's own check refuses its
  INT8 outputs it deploys again with a tolerance nothing fails (as vs_tpumlir.py).

Output parts: a graph output made by a Concat (through a Permute) is judged per
Concat input (tpubuild.verify.parts.concat_parts on canonical.mlir), so box
coordinates cannot hide class scores; other outputs whole. On an input where a
part's largest |float value| is below PART_SIGNAL of its output's (class
scores of an image with nothing to detect), that part is not
judged; the `n` column says on how many inputs each part was.

Per model two verdicts: ours at least the best peer's cosine on every part, and
ours >= 0.99 on every part; a summary line at the end. --json OUT writes the
table as {"title", "goal", "columns", "rows"}. Slow (TPU-MLIR's tools and our
search take minutes per model on two cores): try --samples 10 --eval 2 first.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import itertools
import json
import logging
import math
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

METHODS = ("max", "percentile", "kl", "mse", "auto")
ORT_METHODS = ("MinMax", "Percentile", "Entropy")
# extra options for onnxruntime's create_calibrator, per method: quantize_static's own, except Entropy's bins
ORT_CALIBRATOR_OPTIONS = {"MinMax": {}, "Percentile": {"percentile": 99.99}, "Entropy": {"num_bins": 512}}
CHIP = "bm1684x"
GOAL_COS = 0.99
TITLE = "INT8 accuracy vs float per output part (bm1684x): ours by default vs onnxruntime and TPU-MLIR"
GOAL = f"ours >= the best peer on every model and output part, and >= {GOAL_COS} everywhere (issue 17)"


def build(manifest: Path, build_dir: Path, name: str) -> None:
    from tpubuild.testing import run_doit

    run = run_doit(f"canonicalize:{name}", manifests=manifest, build=build_dir, timeout=None)
    if run.returncode != 0:
        raise RuntimeError(f"building {name}'s canonical.mlir failed:\n{run.stdout}{run.stderr}")


def cosine(a, b) -> float:
    from tpubuild.verify.similarity import cosine as cos

    return cos(a, b)


# ---- output parts (pure helpers) ----------------------------------------------------------------


def part_label(output: str, part) -> str:
    """'output0' for a whole output, 'output0[:, 4:24]' for a part (axis, start, stop)."""
    if part is None:
        return output
    axis, start, stop = part
    return f"{output}[{':, ' * axis}{start}:{stop}]"


# A part with signal on an input: its largest |float value| at least this share of its output's. One rule for
# every column, whatever its quantizer (verification's tiny-part rule needs our calibration's steps); mini_yolo's
# class scores peak at 3-6e-4 of its box coordinates and are judged
PART_SIGNAL = 1e-4


def output_parts(module) -> list[list[tuple[int, int, int]]]:
    """Per graph output, the (axis, start, stop) of the parts verification judges (tpubuild/verify/parts.py)."""
    from tpubuild.ir import mlir
    from tpubuild.verify.parts import concat_parts

    found = concat_parts(module)
    return [[(p.axis, p.start, p.stop) for p in found.get(name, [])] for name in mlir.output_names(module)]


def part_cosine(test: np.ndarray, ref: np.ndarray, part) -> float | None:
    """The cosine of a part (axis, start, stop; None: the whole output) of ``test`` against ``ref``; None when
    the part has no signal in ``ref``: its largest |value| below PART_SIGNAL of the output's."""
    test = np.asarray(test, np.float64).reshape(np.shape(ref))
    ref = np.asarray(ref, np.float64)
    if part is None:
        return cosine(test, ref)
    axis, start, stop = part
    index = (slice(None),) * axis + (slice(start, stop),)
    t, r = test[index], ref[index]
    peak = float(np.max(np.abs(ref))) if ref.size else 0.0
    if not r.size or float(np.max(np.abs(r))) < PART_SIGNAL * peak:
        return None
    return cosine(t, r)


@dataclass
class Cell:
    """One column's figure for one part: the lowest cosine over the inputs where the part has signal."""

    cos: float | None = None
    worst: int | None = None  # the evaluation input (index) where it is lowest
    judged: int = 0  # inputs with signal in the part
    each: list[float | None] = field(default_factory=list)  # per evaluation input (None: no signal there)


def lowest_by_part(outs, refs, parts) -> list[Cell]:
    """outs[input][output] vs refs[input][output]; parts[output]: its parts ([] for the whole output). A Cell per
    (output, part) in that order."""
    cells = []
    for o, output_parts in enumerate(parts):
        for part in output_parts or [None]:
            cell = Cell()
            for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
                c = part_cosine(out[o], ref[o], part)
                cell.each.append(c)
                if c is None:
                    continue
                cell.judged += 1
                if cell.cos is None or c < cell.cos:
                    cell.cos, cell.worst = c, i
            cells.append(cell)
    return cells


# ---- one model's data ---------------------------------------------------------------------------


class Model:
    """One manifest's calibration and evaluation data, float reference and canonical TOP module."""

    def __init__(self, manifest: Path, build_dir: Path, cap: int | None, reserve: int, max_eval: int | None):
        from tpubuild.build.inputs import of_source
        from tpubuild.build.manifest import load_manifest
        from tpubuild.build.paths import ModelPaths
        from tpubuild.build.tasks import calibration_files, source_file
        from tpubuild.build.files import read_npz
        from tpubuild.calib.data import Samples
        from tpubuild.calib.files import IMAGE_SUFFIXES
        from tpubuild.ir import mlir
        from tpubuild.ir.mlir import load_module
        from tpubuild.top.inference import weights_for

        self.m = m = load_manifest(manifest)
        self.paths = p = ModelPaths.of(build_dir, m.name)
        self.module = load_module(p.canonical_mlir)
        self.weights = weights_for(self.module, p.canonical_mlir)
        # the manifest's inputs as the stages complete them
        self.specs = of_source(m, source_file(m, p))
        self.onnx = at_manifest_shapes(source_file(m, p), {s["name"]: s["shape"] for s in self.specs}, p.root)
        # what the build's calibration reads: never the manifest's test_input (tasks.calibration_files)
        files = [Path(f) for f in calibration_files(m)[0]]
        every = list(Samples.of(files, self.specs))
        one_per_file = len(every) == len(files) and all(f.suffix.lower() in IMAGE_SUFFIXES for f in files)
        names = [f.name if one_per_file else f"sample {i}" for i, f in enumerate(files if one_per_file else every)]
        count = m.calibration.get("count")
        built = min(count or len(every), len(every))
        notes = [f"{m.calibration['data']}: {len(every)} samples, the build reads {built}"]
        if built >= len(every) and reserve:
            built = max(1, len(every) - reserve)
            notes.append(f"the last {len(every) - built} kept for evaluation (as `count: {built}` builds)")
        read = built if cap is None else min(cap, built)
        if read < built:
            notes.append(f"--samples {cap}: calibration reads {read} (NOT as the manifest builds)")
        self.cal = every[:read]
        from tpubuild.calib.calibrate import validation_samples

        held = len(validation_samples(self.cal))
        notes.append(f"calibration {read} ({read - held} statistics, {held} held back)")
        self.note = "; ".join(notes)
        # evaluation: after the samples the build reads (the same inputs with --samples)
        rest = list(zip(names[built:], every[built:], strict=True))[: max_eval if max_eval is not None else None]
        self.eval_names = [n for n, _ in rest]
        self.eval = [s for _, s in rest]
        test = m.test_input
        if test is not None and test.resolve() not in {f.resolve() for f in files}:
            self.eval_names.append(f"{test.name} (test_input)")
            self.eval.append(read_npz(p.input_npz))
        elif test is not None and test.resolve() in {f.resolve() for f in files[:built]} and one_per_file:
            self.note += f"; test_input {test.name} is a calibration file: not used"
        self.out_names = mlir.output_names(self.module)
        self.parts = output_parts(self.module)
        self.refs = float_outputs(self.onnx, self.eval)
        if self.refs and len(self.refs[0]) != len(self.out_names):
            raise RuntimeError(f"{m.name}: {len(self.refs[0])} ONNX outputs but {len(self.out_names)} TOP outputs")
        self.labels = [
            part_label(n, part) for n, ps in zip(self.out_names, self.parts, strict=True) for part in ps or [None]
        ]

    def ours(self, entries, asymmetric: bool, qtable=None, bias_corrections=None) -> list[list[np.ndarray]]:
        """TPU inference's real-valued graph outputs per evaluation input, lowered with ``entries``, ``qtable``
        and ``bias_corrections``."""
        from tpubuild.build.chips import load_chip
        from tpubuild.calib.calibrate import apply_table
        from tpubuild.ir import mlir
        from tpubuild.lower.inference import dequantize
        from tpubuild.lower.lowering import lower_module
        from tpubuild.top.inference import Plan

        tpu, w = lower_module(
            apply_table(self.module, entries),
            self.weights,
            chip=load_chip(CHIP),
            mode="INT8",
            asymmetric=asymmetric,
            cali=entries,
            qtable=qtable,
            bias_corrections=bias_corrections,
        )
        names = mlir.output_names(tpu)
        types = [v.type.element_type for v in mlir.return_op(tpu).operands]
        plan = Plan(tpu, w)
        outs = []
        for s in self.eval:
            found = plan.run(s, all_tensors=False)
            outs.append([dequantize(np.asarray(found[n]), t) for n, t in zip(names, types, strict=True)])
        return outs


def at_manifest_shapes(onnx_file: Path, shapes, folder: Path) -> Path:
    """The source model, or a copy in ``folder`` whose fixed input dims are the manifest's (as the build runs it:
    tpubuild.frontend.onnx_graph.set_input_shapes) for onnxruntime's float run and quantize_static."""
    import onnx

    from tpubuild.frontend.onnx_graph import set_input_shapes

    model = onnx.load(str(onnx_file))
    if not set_input_shapes(model, shapes):
        return onnx_file
    copy = folder / f"{onnx_file.stem}.manifest_shapes.onnx"
    onnx.save(model, str(copy))
    return copy


def float_outputs(onnx_file: Path, samples) -> list[list[np.ndarray]]:
    """onnxruntime's float outputs of the source model per sample, in graph order."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(onnx_file), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return [sess.run(names, feed) for feed in _typed(onnx_file, samples)]


def default_path(model: Model):
    """What a manifest without tuning fields builds: calibration's default method on the samples it does not hold
    back, then the bias corrections and the mixed-precision search judged on the worst of them (as the calibrate
    and search stages): the calibration table and the search's result (its table and the bias corrections it kept)."""
    from tpubuild.build.chips import load_chip
    from tpubuild.build.manifest import DEFAULT_METHOD
    from tpubuild.calib.calibrate import apply_table, calibrate
    from tpubuild.lower.bias import bias_corrections, correction_samples
    from tpubuild.lower.search import SearchConfig, search, search_pool

    entries, _ = calibrate(model.module, model.weights, model.cal, DEFAULT_METHOD)
    config = SearchConfig()
    pool, _ = search_pool(model.cal, config)  # as the search stage
    module, chip = apply_table(model.module, entries), load_chip(CHIP)
    corrections = bias_corrections(
        module, model.weights, chip=chip, cali=entries, asymmetric=False, samples=correction_samples(model.cal)
    )
    found = search(
        module,
        model.weights,
        chip=chip,
        cali=entries,
        asymmetric=False,
        samples=pool,
        config=config,
        bias_corrections=corrections,
    )
    return entries, found


# ---- onnxruntime --------------------------------------------------------------------------------


class Reader:
    """onnxruntime's CalibrationDataReader over our calibration samples."""

    def __init__(self, samples):
        self.it = iter(samples)

    def get_next(self):
        return next(self.it, None)


def ort_quantized(model: Model, method: str, workdir: Path):
    """onnxruntime's recommended flow (quant_pre_process, then quantize_static, QDQ, per-channel) with ranges from
    its calibrator (ORT_CALIBRATOR_OPTIONS); its outputs per evaluation input and the ranges {tensor: (lo, hi)}."""
    import onnxruntime as ort
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, quantize_static
    from onnxruntime.quantization.calibrate import create_calibrator, save_tensors_data
    from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry
    from onnxruntime.quantization.shape_inference import quant_pre_process

    pre = workdir / f"{model.m.name}_pre.onnx"
    out = workdir / f"{model.m.name}_{method}.onnx"
    cache = workdir / f"{model.m.name}_{method}.ranges.json"
    calibrate_method = getattr(CalibrationMethod, method)
    logging.getLogger().setLevel(logging.ERROR)  # its "consider pre-processing" warnings
    # the histogram calibrators print their progress; its tools write temporary external-data files to the
    # working folder
    with contextlib.redirect_stdout(io.StringIO()), contextlib.chdir(workdir):
        if not pre.exists():
            _pre_process(quant_pre_process, model.onnx, pre)
        with tempfile.TemporaryDirectory(prefix="ort_calib_") as tmp:
            calibrator = create_calibrator(
                pre,
                list(set(QLinearOpsRegistry) | set(QDQRegistry)),  # what quantize_static gives it by default
                augmented_model_path=str(Path(tmp) / "augmented.onnx"),
                calibrate_method=calibrate_method,
                extra_options=ORT_CALIBRATOR_OPTIONS[method],
            )
            calibrator.collect_data(Reader(_typed(model.onnx, model.cal)))
            ranges = calibrator.compute_data()
            del calibrator
        save_tensors_data(ranges, cache)
        quantize_static(
            str(pre),
            str(out),
            None,
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            calibrate_method=calibrate_method,
            calibration_cache_path=cache,
        )
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(out), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    outs = [sess.run(names, feed) for feed in _typed(model.onnx, model.eval)]
    return outs, {k: _range(v.range_value) for k, v in ranges.items()}


def _range(value) -> tuple[float, float]:
    """onnxruntime's (lowest, highest) of a tensor, as floats (its values are numpy arrays of any shape)."""
    lo, hi = value
    return float(np.min(lo)), float(np.max(hi))


def ranges_differ(a: dict, b: dict, rel: float = 0.01) -> tuple[int, int]:
    """How many tensors of ``a`` have a range (lo, hi) differing from ``b``'s by more than ``rel`` of b's span."""
    differ = 0
    for name, (lo, hi) in a.items():
        if name not in b:
            continue
        blo, bhi = b[name]
        span = max(abs(bhi - blo), 1e-12)
        differ += abs(lo - blo) > rel * span or abs(hi - bhi) > rel * span
    return differ, len(a)


def _typed(onnx_file: Path, samples) -> list[dict[str, np.ndarray]]:
    """The samples as the model's inputs' element types (MiniLM reads int64 token ids)."""
    import onnx
    from onnx.helper import tensor_dtype_to_np_dtype

    graph = onnx.load(str(onnx_file), load_external_data=False).graph
    dtypes = {i.name: tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type) for i in graph.input}
    return [{k: np.asarray(v, dtypes.get(k, np.float32)) for k, v in s.items()} for s in samples]


def _pre_process(quant_pre_process, src: Path, dst: Path) -> None:
    """IR 7 with initializers apart from graph inputs, opset 13 at least (per-channel DequantizeLinear
    needs its axis), then quant_pre_process; without its symbolic shape inference if that gives up
    (PP-OCR rec), else none."""
    import onnx
    from onnx import version_converter

    model = onnx.load(str(src))
    # before IR 4 every initializer is also a graph input (light_densenet121); the quantized model's
    # new constants then come out as required inputs onnxruntime refuses to run without
    inits = {t.name for t in model.graph.initializer}
    data = [i for i in model.graph.input if i.name not in inits]
    del model.graph.input[:]
    model.graph.input.extend(data)
    model.ir_version = max(model.ir_version, 7)
    if next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) < 13:
        model = version_converter.convert_version(model, 13)
    upgraded = dst.with_suffix(".opset.onnx")
    onnx.save(model, str(upgraded))
    for options in ({}, {"skip_symbolic_shape": True}):
        try:
            quant_pre_process(str(upgraded), str(dst), **options)
            return
        except Exception:  # onnxruntime raises a bare Exception when shape inference is incomplete
            continue
    upgraded.replace(dst)


# ---- TPU-MLIR -----------------------------------------------------------------------------------


def tpumlir_outputs(model: Model, venv: Path, workdir: Path) -> tuple[list[list[np.ndarray]] | None, str]:
    """TPU-MLIR's defaults (vs_tpumlir.py's driver): transform, calibration on our calibration samples, INT8
    bm1684x deploy, then model_runner on the .bmodel per evaluation input; (outputs or None, a note)."""
    import vs_tpumlir as vt

    work = workdir / f"tpumlir_{model.m.name}"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    written = vt.prepare_tpumlir(model.m, model.paths, work)
    for i in range(len(model.cal), written):  # calibration here reads fewer (reserve, --samples)
        (work / "cali" / f"{i:04d}.npz").unlink()
    log = work / "tpumlir.log"
    tm = vt.TpuMlir(venv, work, model.m.name, log)
    start = time.perf_counter()
    steps = [
        ("model_transform", lambda: tm.transform([spec["shape"] for spec in model.specs])),
        ("run_calibration", lambda: tm.calibrate(len(model.cal))),
    ]
    for step, call in steps:
        _, ok = call()
        if not ok:
            return None, f"{step} failed (log {log}):\n" + vt.tail(log)
    logged = log.stat().st_size
    _, ok = tm.deploy(CHIP, "INT8", False)
    note = ""
    if not ok and b"npz compare FAILED" in log.read_bytes()[logged:]:
        note = "its own TPU-vs-TOP check refused the INT8 outputs, deployed again without it; "
        _, ok = tm.deploy(CHIP, "INT8", False, vt.NO_TOLERANCE)
    if not ok:
        return None, "model_deploy failed:\n" + vt.tail(log)
    bmodel = f"{model.m.name}_{CHIP}_int8.bmodel"
    outs = []
    for i, sample in enumerate(model.eval):
        np.savez(work / f"eval_{i}.npz", **sample)
        _, ok = tm.tool("model_runner", "--input", f"eval_{i}.npz", "--model", bmodel, "--output", f"out_{i}.npz")
        if not ok:
            return None, f"model_runner failed on {model.eval_names[i]}:\n" + vt.tail(log)
        with np.load(work / f"out_{i}.npz") as data:
            outs.append([data[k] for k in data.files])
    return outs, note + f"{time.perf_counter() - start:.0f} s"


# ---- the table ----------------------------------------------------------------------------------


@dataclass
class Result:
    """One model's table: a Cell per (column, part)."""

    name: str
    labels: list[str]
    inputs: str
    columns: dict[str, list[Cell]] = field(default_factory=dict)
    eval_names: list[str] = field(default_factory=list)

    def best_peer(self, k: int) -> tuple[float | None, str | None]:
        found = [(c[k].cos, name) for name, c in self.columns.items() if name != "ours" and c[k].cos is not None]
        return max(found) if found else (None, None)

    def verdicts(self) -> tuple[bool | None, bool]:
        """(ours >= the best peer on every part, None without a peer; ours >= GOAL_COS on every part)."""
        ours = self.columns["ours"]
        peers = [(ours[k].cos, self.best_peer(k)[0]) for k in range(len(self.labels))]
        judged = [(o, p) for o, p in peers if p is not None and o is not None]
        beats = None if not judged else all(o >= p for o, p in judged)
        return beats, all(c.cos is None or c.cos >= GOAL_COS for c in ours)


def _f(x: float | None, width: int = 9) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}.6f}"


def print_result(r: Result, notes: list[str]) -> None:
    cols = list(r.columns)
    width = max(len(x) for x in [*r.labels, "output part"]) + 2
    heads = {"ours": "ours", "TPU-MLIR": "TPU-MLIR"} | {f"ort {m}": f"ort {m}" for m in ORT_METHODS}
    print(
        f"  {'output part':<{width}}{'n':>3}"
        + "".join(f"{heads.get(c, c):>15}" for c in cols)
        + f"{'best peer':>12}  ours' worst input"
    )
    for k, label in enumerate(r.labels):
        ours = r.columns["ours"][k]
        best, _ = r.best_peer(k)
        worst = "" if ours.worst is None else r.eval_names[ours.worst]
        print(
            f"  {label:<{width}}{ours.judged:>3}"
            + "".join(f"{_f(r.columns[c][k].cos, 15)}" for c in cols)
            + f"{_f(best, 12)}  {worst}"
        )
    for note in notes:
        print(f"  {note}")
    beats, good = r.verdicts()
    ours = r.columns["ours"]
    below = [
        f"{label} {ours[k].cos:.6f} < {r.best_peer(k)[1]} {r.best_peer(k)[0]:.6f}"
        for k, label in enumerate(r.labels)
        if ours[k].cos is not None and r.best_peer(k)[0] is not None and ours[k].cos < r.best_peer(k)[0]
    ]
    low = [
        f"{label} {ours[k].cos:.6f} on {r.eval_names[ours[k].worst]}"
        for k, label in enumerate(r.labels)
        if ours[k].cos is not None and ours[k].cos < GOAL_COS
    ]
    for k, label in enumerate(r.labels):
        if ours[k].judged == 0:
            print(f"  {label}: no signal on any evaluation input (PART_SIGNAL): judged nowhere, by no column")
        if ours[k].cos is not None and ours[k].cos < GOAL_COS:
            each = ", ".join(
                f"{n} {'-' if c is None else f'{c:.4f}'}" for n, c in zip(r.eval_names, ours[k].each, strict=True)
            )
            print(f"  ours on {label} per input: {each}")
    print(
        f"  {r.name}: ours >= best peer on every part: "
        + ("n/a (no peer result)" if beats is None else "yes" if beats else "NO (" + "; ".join(below) + ")")
    )
    print(f"  {r.name}: ours >= {GOAL_COS} everywhere: " + ("yes" if good else "NO (" + "; ".join(low) + ")"))


def bench_table(manifest: Path, args, workdir: Path) -> Result:
    t0 = time.perf_counter()
    from tpubuild.build.manifest import load_manifest

    m = load_manifest(manifest)
    build(manifest, Path(args.build_dir), m.name)
    model = Model(manifest, Path(args.build_dir), args.samples, args.reserve, args.eval)
    print(f"\n{m.name}: {model.note}", flush=True)
    print(f"  evaluation: {len(model.eval)} inputs calibration never read: {', '.join(model.eval_names)}", flush=True)
    tuning = [
        k
        for k, present in (
            ("calibration.method", "method" in m.calibration),
            ("calibration.table", "table" in m.calibration),
            ("quantize_table", m.quantize_table is not None),
            ("mixed_precision", m.mixed_precision is not None),
        )
        if present
    ]
    notes = [f"ours: the manifest's {', '.join(tuning)} ignored (the default path)"] if tuning else []
    if not model.eval:
        raise RuntimeError("no input calibration never read: raise --reserve or give a test_input")
    r = Result(m.name, model.labels, f"{len(model.eval)} held-out inputs", eval_names=model.eval_names)
    start = time.perf_counter()
    entries, found = default_path(model)
    ours = model.ours(entries, False, found.table, found.bias_corrections)
    r.columns["ours"] = lowest_by_part(ours, model.refs, model.parts)
    notes.append(
        f"ours: {len(found.chosen)} tensors / {len(found.table)} ops kept in {found.mode} by the search "
        f"(searched cos {found.int8_score:.5f} -> {found.score:.5f}"
        + ("" if found.reached else ", target NOT reached")
        + f"), {found.lowerings} lowerings, {time.perf_counter() - start:.0f} s"
    )
    if found.bias is not None:
        notes.append(f"ours: {found.bias.line()}")
    print(f"  ours done ({time.perf_counter() - start:.0f} s)", flush=True)
    if not args.no_ort:
        minmax = None
        for method in ORT_METHODS:
            start = time.perf_counter()
            try:
                outs, ranges = ort_quantized(model, method, workdir)
            except Exception as err:  # onnxruntime's quantizer raises many types; report and go on
                notes.append(f"ort {method} failed: {type(err).__name__}: {str(err).splitlines()[0][:100]}")
                continue
            r.columns[f"ort {method}"] = lowest_by_part(outs, model.refs, model.parts)
            if method == "MinMax":
                minmax = ranges
            elif minmax is not None:
                d, n = ranges_differ(ranges, minmax)
                notes.append(f"ort {method}: {d} of {n} tensor ranges differ from MinMax's (> 1%)")
            print(f"  ort {method} done ({time.perf_counter() - start:.0f} s)", flush=True)
    venv = Path(args.venv).resolve()
    if args.no_tpumlir:
        pass
    elif not (venv / "bin" / "model_deploy").is_file():
        notes.append(f"TPU-MLIR: no venv at {venv}")
    else:
        start = time.perf_counter()
        outs, note = tpumlir_outputs(model, venv, workdir)
        if outs is None:
            notes.append(f"TPU-MLIR: {note}")
        else:
            r.columns["TPU-MLIR"] = lowest_by_part(outs, model.refs, model.parts)
            notes.append(f"TPU-MLIR 1.30.2: {note}")
        print(f"  TPU-MLIR done ({time.perf_counter() - start:.0f} s)", flush=True)
    notes.append(f"{time.perf_counter() - t0:.0f} s")
    print_result(r, notes)
    return r


def json_table(results: list[Result]) -> dict:
    peers = ["onnxruntime MinMax", "onnxruntime Percentile 99.99", "onnxruntime Entropy (512 bins)", "TPU-MLIR 1.30.2"]
    columns = ["model", "output part", "inputs judged", "ours (default)", *peers, "best peer", "ours >= best peer"]
    columns += [f"ours >= {GOAL_COS}"]
    rows = []
    for r in results:
        for k, label in enumerate(r.labels):
            ours = r.columns["ours"][k]
            best, _ = r.best_peer(k)
            keys = [f"ort {m}" for m in ORT_METHODS] + ["TPU-MLIR"]
            rows.append(
                [r.name, label, ours.judged, ours.cos]
                + [r.columns[c][k].cos if c in r.columns else None for c in keys]
                + [best, None if best is None or ours.cos is None else ours.cos >= best]
                + [None if ours.cos is None else ours.cos >= GOAL_COS]
            )
    return {"title": TITLE, "goal": GOAL, "columns": columns, "rows": rows}


def summary(results: list[Result], failed: list[str]) -> str:
    beats = [r.name for r in results if r.verdicts()[0]]
    comparable = [r.name for r in results if r.verdicts()[0] is not None]
    good = [r.name for r in results if r.verdicts()[1]]
    behind = [n for n in comparable if n not in beats]
    low = [r.name for r in results if not r.verdicts()[1]]
    text = (
        f"summary: ours >= the best peer on every part on {len(beats)} of {len(comparable)} models"
        + (f" (not: {', '.join(behind)})" if behind else "")
        + f"; ours >= {GOAL_COS} on every part on {len(good)} of {len(results)}"
        + (f" (not: {', '.join(low)})" if low else "")
    )
    return text + (f"; failed to run: {', '.join(failed)}" if failed else "")


# ---- the older per-method variants (--methods) ---------------------------------------------------


@dataclass(frozen=True)
class Head:
    """How to read a model's output beyond cosine: the class axis for top-1 (None: no classes), and for
    detection heads the class-score channels (axis, first channel)."""

    top1_axis: int | None = -1
    scores: tuple[int, int] | None = None
    mask: float | None = None  # a probability map: `top1` is the IoU of its pixels above this


HEADS = {
    "mini_yolo": Head(top1_axis=None, scores=(1, 4)),
    "yolox": Head(top1_axis=None, scores=(2, 4)),
    # DB's own binarisation threshold: the text mask PaddleOCR draws boxes from
    "ppocrv4_det": Head(top1_axis=None, mask=0.3),
}


def top1(test: np.ndarray, ref: np.ndarray, axis: int) -> float:
    return float(np.mean(np.argmax(test, axis=axis) == np.argmax(ref, axis=axis)))


def metrics(outs: list[list[np.ndarray]], refs: list[list[np.ndarray]], head: Head) -> dict:
    """outs[sample][output] vs refs[sample][output]."""
    cos, err, agree, scores = [], [], [], []
    for o_s, r_s in zip(outs, refs, strict=True):
        for o, r in zip(o_s, r_s, strict=True):
            o, r = np.asarray(o, np.float64).reshape(r.shape), np.asarray(r, np.float64)
            cos.append(cosine(o, r))
            peak = float(np.max(np.abs(r))) or 1.0
            err.append(float(np.max(np.abs(o - r))) / peak)
            if head.scores is not None:
                axis, first = head.scores
                idx = [slice(None)] * r.ndim
                idx[axis] = slice(first, None)
                so, sr = o[tuple(idx)], r[tuple(idx)]
                scores.append(cosine(so, sr))
                agree.append(top1(so, sr, axis))
            elif head.mask is not None:
                om, rm = o > head.mask, r > head.mask
                union = np.count_nonzero(om | rm)
                agree.append(np.count_nonzero(om & rm) / union if union else 1.0)
            elif head.top1_axis is not None and r.ndim and r.shape[head.top1_axis] >= 2:
                agree.append(top1(o, r, head.top1_axis))
    return {
        "cos": min(cos),
        "mean": float(np.mean(cos)),
        "err": max(err),
        "top1": float(np.mean(agree)) if agree else math.nan,
        "scores": min(scores) if scores else math.nan,
        "each": [
            min(cosine(np.asarray(o, np.float64).reshape(r.shape), r) for o, r in zip(o_s, r_s, strict=True))
            for o_s, r_s in zip(outs, refs, strict=True)
        ],
    }


def row(label: str, r: dict, note: str = "") -> str:
    def f(x, digits=5):
        return "     -" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"

    return (
        f"  {label:<24} {f(r['cos'])} {f(r['mean'])} {f(r['err'], 4):>8} {f(r['top1'], 3):>6} "
        f"{f(r['scores']):>7}  {note}"
    )


def bench_methods(manifest: Path, args, workdir: Path) -> None:
    """The older table: ours per calibration method (--methods), with the manifest's quantize table and search,
    onnxruntime's methods; whole outputs (cos, mean, max|err|, top1, detection scores), same data as the issue's."""
    from tpubuild.build.manifest import load_manifest
    from tpubuild.calib.calibrate import collect_stats, compute_entries

    t0 = time.perf_counter()
    build(manifest, Path(args.build_dir), load_manifest(manifest).name)
    model = Model(manifest, Path(args.build_dir), args.samples, args.reserve, args.eval)
    head = HEADS.get(model.m.name, Head())
    print(f"\n{model.m.name}: {model.note}")
    print(f"  evaluation: {len(model.eval)} inputs calibration never read: {', '.join(model.eval_names)}")
    print(f"  {'variant':<24} {'cos':>7} {'mean':>7} {'max|err|':>8} {'top1':>6} {'scores':>7}")
    stats, _ = collect_stats(model.module, model.weights, model.cal)
    results: dict[str, dict] = {}
    tables = {}
    configured = model.m.calibration.get("method", "auto")
    if args.default:
        start = time.perf_counter()
        entries, found = default_path(model)
        results["ours default"] = metrics(
            model.ours(entries, False, found.table, found.bias_corrections), model.refs, head
        )
        note = f"{len(found.chosen)} tensors / {len(found.table)} ops float, {found.lowerings} lowerings"
        print(row("ours default", results["ours default"], f"{note}, {time.perf_counter() - start:.0f} s"), flush=True)
        print("    per evaluation input: " + " ".join(f"{c:.4f}" for c in results["ours default"]["each"]))
    for method in dict.fromkeys([*args.methods, configured]):
        start = time.perf_counter()
        tune = itertools.islice(iter(model.cal), 8) if method == "auto" else ()
        tables[method] = compute_entries(model.module, model.weights, stats, method, tune)
        for asym in (False, True) if args.asym else (False,):
            label = f"ours {method}" + (" asym" if asym else "")
            results[label] = metrics(model.ours(tables[method], asym), model.refs, head)
            print(row(label, results[label], f"{time.perf_counter() - start:.0f} s"), flush=True)
    search_method = args.search_method or configured
    options = dict(model.m.mixed_precision or {})
    qtable = None
    if model.m.quantize_table is not None:
        from tpubuild.lower.qtable import read_quantize_table

        qtable = read_quantize_table(model.m.quantize_table)
        label = f"ours {configured}+qtable"
        results[label] = metrics(model.ours(tables[configured], False, qtable), model.refs, head)
        print(row(label, results[label], f"the manifest's quantize table ({len(qtable)} ops float)"), flush=True)
    if not args.no_search:
        from tpubuild.build.chips import load_chip
        from tpubuild.calib.calibrate import apply_table
        from tpubuild.lower.search import SearchConfig, search

        start = time.perf_counter()
        if search_method not in tables:
            tune = itertools.islice(iter(model.cal), 8) if search_method == "auto" else ()
            tables[search_method] = compute_entries(model.module, model.weights, stats, search_method, tune)
        entries = tables[search_method]
        config = SearchConfig.of(options)
        found = search(
            apply_table(model.module, entries),
            model.weights,
            chip=load_chip(CHIP),
            cali=entries,
            asymmetric=False,
            samples=model.cal[: max(config.pool, config.samples)],
            config=config,
            user=qtable,
        )
        label = f"ours {search_method}+search"
        results[label] = metrics(model.ours(entries, False, found.table), model.refs, head)
        extra = len(found.table) - len(found.user)
        note = (
            f"{len(found.chosen)} tensors / {extra} ops float{' besides the manifest table' if found.user else ''}, "
            f"{found.lowerings} lowerings, {time.perf_counter() - start:.0f} s"
            + ("" if found.reached else ", target not reached")
        )
        print(row(label, results[label], note), flush=True)
    ort_best = None
    if not args.no_ort:
        for method in ORT_METHODS:
            start = time.perf_counter()
            label = f"onnxruntime {method}"
            try:
                outs, _ = ort_quantized(model, method, workdir)
            except Exception as err:  # onnxruntime's quantizer raises many types; report and go on
                print(f"  {label:<24} failed: {type(err).__name__}: {str(err).splitlines()[0][:100]}")
                continue
            results[label] = metrics(outs, model.refs, head)
            print(row(label, results[label], f"{time.perf_counter() - start:.0f} s"), flush=True)
            ort_best = max(ort_best or -2.0, results[label]["cos"])
    ours_best = max((r["cos"], k) for k, r in results.items() if k.startswith("ours"))
    cos, label = ours_best
    verdict = (
        "n/a (no onnxruntime result)"
        if ort_best is None
        else f"{'yes' if cos >= ort_best else 'NO'} (ours {cos:.5f}, onnxruntime {ort_best:.5f})"
    )
    print(f"  at least as close to float as onnxruntime, best of ours ({label[5:]}): {verdict}")
    print(f"  {time.perf_counter() - t0:.0f} s")


# ---- main ---------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=".", help="regex over model names (default: every INT8 model)")
    ap.add_argument("--manifest", action="append", default=[], help="a manifest outside the zoo (repeatable)")
    ap.add_argument("--samples", type=int, default=None, help="calibration reads at most this many (debugging)")
    ap.add_argument(
        "--reserve",
        type=int,
        default=4,
        help="when the build reads the whole calibration set, its last N samples are evaluation's (default 4)",
    )
    ap.add_argument("--eval", type=int, default=None, help="at most this many held-out samples (default all)")
    ap.add_argument("--no-ort", action="store_true")
    ap.add_argument("--no-tpumlir", action="store_true")
    ap.add_argument(
        "--venv",
        default=str(REPO / ".anchors" / "tpumlir-venv"),
        help="TPU-MLIR 1.30.2's venv (default .anchors/tpumlir-venv; without it, no TPU-MLIR column)",
    )
    ap.add_argument("--json", metavar="OUT", help="write the table as JSON {title, goal, columns, rows}")
    ap.add_argument("--build-dir", default=str(REPO / "build"))
    legacy = ap.add_argument_group("the older per-method variants of ours instead of the issue's table")
    legacy.add_argument("--methods", default="", help=f"comma-separated calibration methods of {', '.join(METHODS)}")
    legacy.add_argument("--asym", action="store_true", help="also lower asymmetric INT8")
    legacy.add_argument("--search-method", default=None, help="the table the search starts from (default: manifest's)")
    legacy.add_argument("--no-search", action="store_true")
    legacy.add_argument("--default", action="store_true", help="also the default path (no tuning fields)")
    args = ap.parse_args()
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        ap.error(f"unknown methods {unknown}; expected some of {list(METHODS)}")
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # vs_tpumlir's driver
    from tpubuild.build.manifest import load_manifest

    manifests = []
    folders = [REPO / "configs" / "models"]
    if importlib.util.find_spec("torch") is not None:  # the torch-optional manifests export with torch
        folders.append(REPO / "configs" / "models" / "torch")
    paths = [Path(p).resolve() for p in args.manifest] or sorted(p for f in folders for p in f.glob("*.yaml"))
    for path in paths:
        m = load_manifest(path)
        if any(t.mode == "INT8" for t in m.targets) and m.calibration and re.search(args.models, m.name):
            manifests.append(path)
    if args.methods:
        print(f"INT8 accuracy vs float on {CHIP}: {len(manifests)} models, methods {', '.join(args.methods)}")
    else:
        print(f"{TITLE}: {len(manifests)} models\ngoal: {GOAL}")
    results, failed = [], []
    with tempfile.TemporaryDirectory(prefix="int8_accuracy_") as tmp:
        for manifest in manifests:
            try:
                if args.methods:
                    bench_methods(manifest, args, Path(tmp))
                else:
                    results.append(bench_table(manifest, args, Path(tmp)))
            except RuntimeError as err:
                print(f"\n{manifest.stem}: {err}")
                failed.append(manifest.stem)
    if args.methods:
        return 0
    print("\n" + summary(results, failed))
    if args.json:
        Path(args.json).write_text(json.dumps(json_table(results), indent=1) + "\n")
        print(f"table written to {args.json}")
    return 0 if not failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
