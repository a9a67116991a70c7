"""INT8 accuracy per zoo model: ours per calibration method (and with the mixed-precision search) vs onnxruntime's.

    python bench/int8_accuracy.py [--models REGEX] [--methods max,percentile,kl,mse,auto] [--samples 16]
                                  [--eval 4] [--asym] [--search-method M] [--no-search] [--no-ort]

For each manifest in configs/models (and configs/models/torch when torch is
installed) with an INT8 target (or those whose name
matches --models), on the same data:

- calibration: the first --samples samples of the manifest's calibration set
  (its `count` at most); evaluation: the manifest's test input plus the last
  --eval samples of the set, held out from calibration when the set is large
  enough (the table says how many evaluation samples were also calibration ones);
- ours: one statistics pass, then per method a calibration table, the INT8
  lowering for bm1684x (symmetric; --asym adds asymmetric) and TPU inference
  (the chip's exact arithmetic); "+qtable" is the manifest's method with its
  `quantize_table` (the ops it pins stay float), as the manifest builds it;
  "+search" is the mixed-precision search (tpubuild/lower/search.py, with the
  manifest's `mixed_precision` options or their defaults: target cos 0.99 on
  the calibration samples where INT8 alone is worst, of the first `pool`,
  starting from the manifest's quantize_table, as the search stage does) on top of the manifest's method's table (or
  --search-method's), symmetric, with how many tensors it kept in float;
- onnxruntime: its recommended flow, the model at opset 13 at least (per-channel
  needs it), quant_pre_process (shape inference and graph optimization, which
  folds batch norms into convolutions), then quantize_static, QDQ, per-channel
  weights, its defaults otherwise (uint8 asymmetric activations, int8 symmetric weights),
  MinMax and Entropy calibration on the same calibration samples, run by
  onnxruntime (which fuses QDQ into its int8 kernels).

Every variant is compared with onnxruntime's float outputs of the source model:
`cos` is the lowest cosine over evaluation samples and outputs, `mean` its
mean, `max|err|` the largest absolute error relative to the float output's
largest |value|, `top1` the fraction of positions whose argmax agrees (along
the class axis; for PP-OCR det's probability map, the intersection over union
of the text masks at DB's threshold 0.3, 1 when both are empty), and for detection
heads `scores` the lowest cosine of the class-score channels on their own
(mini_yolo: channels 4.. of [1, 24, anchors], next to boxes in pixels).
The last lines per model say whether ours is at least as close to float as
onnxruntime's best: as the manifest builds it (its method, symmetric, with the
search if it asks for one) and the best of our variants. onnxruntime 1.32's
quantize_static gives its entropy calibrator no bin count, so it histograms
into 128 bins for 128 levels: a single candidate, the full range, and Entropy
comes out equal to MinMax. The manifest's test input may be one of its
calibration samples (PP-OCR's line_05). Slow: start with --samples 4 --eval 2.
"""

from __future__ import annotations

import argparse
import itertools
import importlib.util
import math
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

METHODS = ("max", "percentile", "kl", "mse", "auto")
CHIP = "bm1684x"


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


def build(manifest: Path, build_dir: Path, name: str) -> None:
    from tpubuild.testing import run_doit

    run = run_doit(f"canonicalize:{name}", manifests=manifest, build=build_dir, timeout=None)
    if run.returncode != 0:
        raise RuntimeError(f"building {name}'s canonical.mlir failed:\n{run.stdout}{run.stderr}")


def cosine(a, b) -> float:
    from tpubuild.verify.similarity import cosine as cos

    return cos(a, b)


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


class Model:
    """One manifest's data, float reference and our compiler state."""

    def __init__(self, manifest: Path, build_dir: Path, n_cal: int, n_eval: int):
        from tpubuild.build.manifest import load_manifest
        from tpubuild.build.paths import ModelPaths
        from tpubuild.build.tasks import source_file
        from tpubuild.build.files import read_npz
        from tpubuild.calib.data import Samples
        from tpubuild.calib.files import find_files
        from tpubuild.ir.mlir import load_module
        from tpubuild.top.inference import weights_for
        from tpubuild.verify.reference import onnx_tensors, output_names

        self.m = m = load_manifest(manifest)
        p = ModelPaths.of(build_dir, m.name)
        self.onnx = source_file(m, p)
        self.module = load_module(p.canonical_mlir)
        self.weights = weights_for(self.module, p.canonical_mlir)
        inputs = [{**s.config(), "preprocess": s.preprocess} for s in m.inputs]
        files = find_files(m.calibration["data"], m.file.parent)
        every = list(Samples.of(files, inputs))
        n_cal = min(n_cal, m.calibration.get("count", len(every)), len(every))
        self.cal = every[:n_cal]
        held = every[n_cal:][-n_eval:] if n_eval else []
        self.reused = max(0, n_eval - len(held))
        extra = every[:n_cal][-self.reused :] if self.reused else []
        self.eval = [read_npz(p.input_npz)] + held + extra
        self.out_names = output_names(self.onnx)
        self.refs = [[onnx_tensors(self.onnx, s)[n] for n in self.out_names] for s in self.eval]
        self.head = HEADS.get(m.name, Head())

    def ours(self, entries, asymmetric: bool, qtable=None) -> list[list[np.ndarray]]:
        from tpubuild.build.chips import load_chip
        from tpubuild.calib.calibrate import apply_table
        from tpubuild.ir import mlir
        from tpubuild.lower.lowering import lower_module
        from tpubuild.top.inference import run

        tpu, w = lower_module(
            apply_table(self.module, entries),
            self.weights,
            chip=load_chip(CHIP),
            mode="INT8",
            asymmetric=asymmetric,
            cali=entries,
            qtable=qtable,
        )
        names = mlir.output_names(tpu)
        return [[run(tpu, w, s, all_tensors=False)[n] for n in names] for s in self.eval]


class Reader:
    """onnxruntime's CalibrationDataReader over our calibration samples."""

    def __init__(self, samples):
        self.it = iter(samples)

    def get_next(self):
        return next(self.it, None)


def ort_outputs(model: Model, method: str, workdir: Path) -> list[list[np.ndarray]]:
    """onnxruntime's recommended flow: quant_pre_process (shape inference, BN folding), then quantize_static."""
    import contextlib
    import io
    import logging

    import onnxruntime as ort
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    pre = workdir / f"{model.m.name}_pre.onnx"
    out = workdir / f"{model.m.name}_{method}.onnx"
    feeds = _typed(model.onnx, model.cal)
    logging.getLogger().setLevel(logging.ERROR)  # its "consider pre-processing" warnings
    with contextlib.redirect_stdout(io.StringIO()):  # the entropy calibrator prints its progress
        if not pre.exists():
            _pre_process(quant_pre_process, model.onnx, pre)
        quantize_static(
            str(pre),
            str(out),
            Reader(feeds),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            calibrate_method=getattr(CalibrationMethod, method),
        )
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(out), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return [sess.run(names, feed) for feed in _typed(model.onnx, model.eval)]


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


def row(label: str, r: dict, note: str = "") -> str:
    def f(x, digits=5):
        return "     -" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"

    return (
        f"  {label:<24} {f(r['cos'])} {f(r['mean'])} {f(r['err'], 4):>8} {f(r['top1'], 3):>6} "
        f"{f(r['scores']):>7}  {note}"
    )


def default_path(model: Model):
    """What a manifest without tuning fields builds: calibration's default method on the samples it does not hold
    back, then the mixed-precision search judged on those it does (as the calibrate and search stages)."""
    from tpubuild.build.chips import load_chip
    from tpubuild.build.manifest import DEFAULT_METHOD
    from tpubuild.calib.calibrate import apply_table, calibrate, validation_samples
    from tpubuild.lower.search import SearchConfig, search

    entries, _ = calibrate(model.module, model.weights, model.cal, DEFAULT_METHOD)
    config = SearchConfig()
    pool = validation_samples(model.cal) or model.cal[: max(config.pool, config.samples)]
    found = search(
        apply_table(model.module, entries),
        model.weights,
        chip=load_chip(CHIP),
        cali=entries,
        asymmetric=False,
        samples=pool,
        config=config,
    )
    return entries, found


def bench_model(manifest: Path, args, workdir: Path) -> None:
    from tpubuild.calib.calibrate import collect_stats, compute_entries

    from tpubuild.build.manifest import load_manifest

    t0 = time.perf_counter()
    build(manifest, Path(args.build_dir), load_manifest(manifest).name)
    model = Model(manifest, Path(args.build_dir), args.samples, args.eval)
    print(
        f"\n{model.m.name}: {len(model.cal)} calibration samples, {len(model.eval)} evaluation inputs "
        f"(test input + {len(model.eval) - 1}, {model.reused} of them also calibration samples)"
    )
    print(f"  {'variant':<24} {'cos':>7} {'mean':>7} {'max|err|':>8} {'top1':>6} {'scores':>7}")
    stats, _ = collect_stats(model.module, model.weights, model.cal)
    results: dict[str, dict] = {}
    tables = {}
    configured = model.m.calibration.get("method", "kl")
    if args.default:
        start = time.perf_counter()
        entries, found = default_path(model)
        results["ours default"] = metrics(model.ours(entries, False, found.table), model.refs, model.head)
        note = f"{len(found.chosen)} tensors / {len(found.table)} ops float, {found.lowerings} lowerings"
        print(row("ours default", results["ours default"], f"{note}, {time.perf_counter() - start:.0f} s"), flush=True)
        print("    per evaluation input: " + " ".join(f"{c:.4f}" for c in results["ours default"]["each"]))
    for method in dict.fromkeys([*args.methods, configured]):
        start = time.perf_counter()
        tune = itertools.islice(iter(model.cal), 8) if method == "auto" else ()
        tables[method] = compute_entries(model.module, model.weights, stats, method, tune)
        for asym in (False, True) if args.asym else (False,):
            label = f"ours {method}" + (" asym" if asym else "")
            results[label] = metrics(model.ours(tables[method], asym), model.refs, model.head)
            print(row(label, results[label], f"{time.perf_counter() - start:.0f} s"), flush=True)
    search_method = args.search_method or configured
    options = dict(model.m.mixed_precision or {})
    qtable = None
    if model.m.quantize_table is not None:
        from tpubuild.lower.qtable import read_quantize_table

        start = time.perf_counter()
        qtable = read_quantize_table(model.m.quantize_table)
        label = f"ours {configured}+qtable"
        results[label] = metrics(model.ours(tables[configured], False, qtable), model.refs, model.head)
        print(
            row(
                label,
                results[label],
                f"the manifest's quantize table ({len(qtable)} ops float), {time.perf_counter() - start:.0f} s",
            ),
            flush=True,
        )
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
        results[label] = metrics(model.ours(entries, False, found.table), model.refs, model.head)
        extra = len(found.table) - len(found.user)
        note = (
            f"{len(found.chosen)} tensors / {extra} ops float{' besides the manifest table' if found.user else ''}, "
            f"{found.lowerings} lowerings, {time.perf_counter() - start:.0f} s"
            + ("" if found.reached else ", target not reached")
        )
        print(row(label, results[label], note), flush=True)
    ort_best = None
    if not args.no_ort:
        for method in ("MinMax", "Entropy"):
            start = time.perf_counter()
            label = f"onnxruntime {method}"
            try:
                results[label] = metrics(ort_outputs(model, method, workdir), model.refs, model.head)
            except Exception as err:  # onnxruntime's quantizer raises many types; report and go on
                print(f"  {label:<24} failed: {type(err).__name__}: {str(err).splitlines()[0][:100]}")
                continue
            print(row(label, results[label], f"{time.perf_counter() - start:.0f} s"), flush=True)
            ort_best = max(ort_best or -2.0, results[label]["cos"])
    searched = options.get("search") and not args.no_search and search_method == configured
    as_built = (
        f"ours {configured}+search"
        if searched
        else f"ours {configured}+qtable"
        if model.m.quantize_table is not None
        else f"ours {configured}"
    )
    ours_best = max((r["cos"], k) for k, r in results.items() if k.startswith("ours"))
    for what, (cos, label) in (
        ("as the manifest builds it", (results.get(as_built, {}).get("cos"), as_built)),
        ("best of ours", ours_best),
    ):
        if cos is None:
            continue
        verdict = (
            "n/a (no onnxruntime result)"
            if ort_best is None
            else f"{'yes' if cos >= ort_best else 'NO'} (ours {cos:.5f}, onnxruntime {ort_best:.5f})"
        )
        print(f"  at least as close to float as onnxruntime, {what} ({label[5:]}): {verdict}")
    print(f"  {time.perf_counter() - t0:.0f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=".", help="regex over model names (default: every INT8 model)")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated calibration methods")
    ap.add_argument("--samples", type=int, default=16, help="calibration samples (at most the manifest's count)")
    ap.add_argument("--eval", type=int, default=4, help="evaluation samples besides the test input")
    ap.add_argument("--asym", action="store_true", help="also lower asymmetric INT8")
    ap.add_argument(
        "--search-method",
        default=None,
        help="the table the mixed-precision search starts from (default: the manifest's method)",
    )
    ap.add_argument("--no-search", action="store_true")
    ap.add_argument("--default", action="store_true", help="also the default path (no tuning fields)")
    ap.add_argument("--no-ort", action="store_true")
    ap.add_argument("--build-dir", default=str(REPO / "build"))
    ap.add_argument("--manifest", action="append", default=[], help="a manifest outside the zoo (repeatable)")
    args = ap.parse_args()
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        ap.error(f"unknown methods {unknown}; expected some of {list(METHODS)}")
    from tpubuild.build.manifest import load_manifest

    manifests = []
    folders = [REPO / "configs" / "models"]
    if importlib.util.find_spec("torch") is not None:  # the torch-optional manifests export with torch
        folders.append(REPO / "configs" / "models" / "torch")
    paths = [Path(m).resolve() for m in args.manifest] or sorted(p for f in folders for p in f.glob("*.yaml"))
    for path in paths:
        m = load_manifest(path)
        if any(t.mode == "INT8" for t in m.targets) and m.calibration and re.search(args.models, m.name):
            manifests.append(path)
    print(f"INT8 accuracy vs float on {CHIP}: {len(manifests)} models, methods {', '.join(args.methods)}")
    with tempfile.TemporaryDirectory(prefix="int8_accuracy_") as tmp:
        for manifest in manifests:
            try:
                bench_model(manifest, args, Path(tmp))
            except RuntimeError as err:
                print(f"\n{manifest.stem}: {err}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
