"""The upstream bridge's figures: our TOSA export + iree-compile against IREE's own ONNX path, per zoo model.

    python bench/iree.py [MODEL ...] [--build-dir DIR] [--runs N] [--repeat K] [--no-onnx-path]

For each model (default: every manifest in configs/models), after `doit verify_top:<model>` has built its
canonical.mlir and TOP outputs:

- ours: `tpubuild export --tosa canonical.mlir` then `iree-compile` (llvm-cpu, this CPU): seconds of each;
- IREE's: `iree-import-onnx` on the same ONNX file the build read (with `--opset-version 17` when its opset is
  older, as IREE advises for old models, and with symbolic input dims set to the test input's shape, which our
  build compiles for), then the same `iree-compile`;
- cosine of the vmfb's outputs (IREE runtime, local-sync) against TOP inference's on the test input (goal
  >= 0.99999), the worst output;
- latency: the vmfb (local-sync: one thread) against onnxruntime on one thread (intra and inter op), the
  median of N runs after a warm-up, on the same input.

Tools run as subprocesses (their start-up included on both sides); wall seconds, and in brackets the CPU seconds
the tool used (user + system), which a busy machine does not inflate. With --repeat K each export, import and
compile runs K times and its fastest run counts (the least wall and the least CPU seconds): on this machine one
compile of the same file varies by about 5% in CPU seconds, and the noise only ever adds. The two paths take
turns (ours, IREE's, ours, ...): the machine's speed drifts over minutes, by 10% and more, and would otherwise
favour whichever path ran in a faster spell. Prints one row per model, then the totals.
"""

from __future__ import annotations

import argparse
import compileall
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# this file is bench/iree.py: its folder first on the path would shadow the `iree` package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(REPO))

from tpubuild.build.cpu import COMPILE_FLAGS, Vmfb, iree_tool  # noqa: E402
from tpubuild.build.paths import ModelPaths  # noqa: E402

GOAL_COS = 0.99999
# iree-import-onnx converts older models with onnx's version converter when asked (its --opset-version): without
# it, BatchNormalization and MaxPool of opsets before 17 fail to import
IMPORT_OPSET = 17
TPUBUILD = str(Path(sys.executable).parent / "tpubuild")


def _timed_once(cmd: list[str]) -> tuple[float, float, str]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if result.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed: " + " ".join(result.stderr.strip().splitlines()[-3:])[:300])
    return wall, cpu, result.stderr


def build_top(manifest: Path, model: str, build_dir: Path) -> None:
    """canonical.mlir, input.npz and top_outs.npz of the model (doit: up to date, or built)."""
    cmd = [sys.executable, "-c", _BUILD, str(manifest), str(build_dir), f"verify_top:{model}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"building verify_top:{model} failed: {result.stdout[-500:]} {result.stderr[-500:]}")


_BUILD = (
    "import sys; from tpubuild.build.runner import run_doit; "
    "sys.exit(run_doit([sys.argv[1]], sys.argv[2], ['run', sys.argv[3]]))"
)


def cosine(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    den = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b / den) if den else float(np.array_equal(a, b))


def median_ms(fn, runs: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def onnxruntime_ms(onnx_path: Path, inputs: dict, runs: int) -> float:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    session = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    feed = {n: inputs[n] for n in names}
    return median_ms(lambda: session.run(None, feed), runs)


def bench_model(manifest: Path, build_dir: Path, runs: int, onnx_path: bool, work: Path, repeat: int = 1) -> dict:
    from tpubuild.build.files import read_npz
    from tpubuild.build.manifest import load_manifest
    from tpubuild.build.tasks import source_file
    from tpubuild.ir.mlir import load_module, output_names

    m = load_manifest(manifest)
    row: dict = {"model": m.name}
    build_top(manifest, m.name, build_dir)
    p = ModelPaths.of(build_dir, m.name)
    tosa, vmfb = work / f"{m.name}.tosa.mlir", work / f"{m.name}.vmfb"
    compile_cmd = [iree_tool("iree-compile"), *COMPILE_FLAGS]
    inputs = read_npz(p.input_npz)
    source = source_file(m, p)
    steps = {
        "export": [TPUBUILD, "export", "--tosa", str(p.canonical_mlir), "-o", str(tosa)],
        "compile": [*compile_cmd, str(tosa), "-o", str(vmfb)],
    }
    theirs: dict[str, list[str]] = {}
    if onnx_path:
        imported, built = work / f"{m.name}.onnx.mlir", work / f"{m.name}.onnx.vmfb"
        static = static_copy(source, inputs, work / f"{m.name}.static.onnx")
        row["static"] = static != source
        importer = [str(Path(sys.executable).parent / "iree-import-onnx"), str(static), "-o", str(imported)]
        if onnx_opset(source) < IMPORT_OPSET:
            importer += ["--opset-version", str(IMPORT_OPSET)]
            row["upgraded"] = True
        theirs = {"import": importer, "onnx_compile": [*compile_cmd, str(imported), "-o", str(built)]}
    # the two paths take turns, so that a machine whose speed drifts over minutes slows both alike
    timings: dict[str, list[tuple[float, float]]] = {key: [] for key in [*steps, *theirs]}
    for _ in range(repeat):
        for key, cmd in steps.items():
            timings[key].append(_timed_once(cmd)[:2])
        try:
            for key, cmd in theirs.items():
                timings[key].append(_timed_once(cmd)[:2])
        except RuntimeError as err:
            row["onnx_error"] = str(err)
            theirs = {}
    for key, times in timings.items():
        if times and (key in steps or key in theirs):
            row[key] = (min(t[0] for t in times), min(t[1] for t in times))
    for f in work.glob(f"{m.name}.*onnx*"):
        f.unlink()
    tosa.unlink()
    module = Vmfb(str(vmfb))
    outs = module.run(inputs)
    ref = read_npz(p.top_outs)
    names = output_names(load_module(p.canonical_mlir))
    row["cos"] = min(cosine(outs[n], ref[n]) for n in names)
    row["vmfb_ms"] = median_ms(lambda: module.run(inputs), runs)
    row["ort_ms"] = onnxruntime_ms(source, inputs, runs)
    module = None  # its buffers freed before the next model
    vmfb.unlink()
    return row


def onnx_opset(path: Path) -> int:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def static_copy(path: Path, inputs: dict, out: Path) -> Path:
    """The ONNX file with its graph inputs' symbolic dims set to the test input's, as the manifest fixes them for
    our build (the same file when they are static): both sides then compile the same shapes, where IREE would
    otherwise build shape-generic code."""
    import onnx

    model = onnx.load(str(path))
    changed = False
    for value in model.graph.input:
        if value.name not in inputs:
            continue
        for dim, size in zip(value.type.tensor_type.shape.dim, inputs[value.name].shape, strict=True):
            if not dim.HasField("dim_value"):
                dim.dim_value = int(size)
                changed = True
    if not changed:
        return path
    onnx.save(model, str(out))
    return out


def _secs(pair) -> str:
    return f"{pair[0]:.2f} ({pair[1]:.2f})" if pair else "-"


def report(rows: list[dict], repeat: int = 1) -> None:
    head = (
        f"{'model':<22} {'export s':>13} {'compile s':>15} {'ours s':>15} {'iree-import s':>14} "
        f"{'iree-compile s':>15} {'IREE ONNX s':>15} {'ours/IREE':>9} {'cos vs TOP':>11} {'vmfb ms':>9} "
        f"{'ort 1T ms':>9}"
    )
    print(
        "\nwall seconds (CPU seconds of the tool); ours = tpubuild export + iree-compile, IREE ONNX = "
        "iree-import-onnx + iree-compile on the same ONNX file; latency: median, one thread each"
        + (f"; each tool's fastest of {repeat} runs" if repeat > 1 else "")
    )
    print(head)
    print("-" * len(head))
    faster = 0
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<22} ERROR {r['error']}")
            continue
        ours = (r["export"][0] + r["compile"][0], r["export"][1] + r["compile"][1])
        theirs = None
        if "onnx_compile" in r:
            theirs = (r["import"][0] + r["onnx_compile"][0], r["import"][1] + r["onnx_compile"][1])
        ratio = f"{ours[1] / theirs[1]:.2f}x" if theirs else r.get("onnx_error", "-")[:40]
        ratio += ("*" if r.get("upgraded") else "") + ("+" if r.get("static") else "") if theirs else ""
        faster += bool(theirs and ours[1] <= theirs[1])
        print(
            f"{r['model']:<22} {_secs(r['export']):>13} {_secs(r['compile']):>15} {_secs(ours):>15} "
            f"{_secs(r.get('import')):>14} {_secs(r.get('onnx_compile')):>15} {_secs(theirs):>15} {ratio:>9} "
            f"{r['cos']:>11.7f} {r['vmfb_ms']:>9.3f} {r['ort_ms']:>9.3f}"
        )
    ok = [r for r in rows if "error" not in r]
    print(
        f"\n{sum(r['cos'] >= GOAL_COS for r in ok)} of {len(rows)} models at cosine >= {GOAL_COS} vs TOP; "
        f"export + compile took no more CPU than IREE's ONNX path on {faster} of "
        f"{sum('onnx_compile' in r for r in ok)} where IREE's path built (ratio: CPU seconds, ours / IREE's; "
        f"*: iree-import-onnx --opset-version {IMPORT_OPSET}, the model's opset being older; +: its symbolic input "
        "dims set to the test input's, as our build fixes them)"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", help="model names (configs/models/<name>.yaml); default: all")
    ap.add_argument("--build-dir", default=str(REPO / "build"))
    ap.add_argument("--runs", type=int, default=20, help="latency runs per model (median)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each export, import and compile (fastest counts)")
    ap.add_argument("--no-onnx-path", action="store_true", help="skip IREE's own ONNX import + compile")
    args = ap.parse_args(argv)
    configs = REPO / "configs" / "models"
    manifests = [configs / f"{n}.yaml" for n in args.models] or sorted(configs.glob("*.yaml"))
    # an installed package has its bytecode; a checkout run with PYTHONDONTWRITEBYTECODE would compile every
    # module of `tpubuild export` from source on each call
    compileall.compile_dir(str(REPO / "tpubuild"), quiet=1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tpubuild-iree-") as tmp:
        for manifest in manifests:
            try:
                row = bench_model(
                    manifest, Path(args.build_dir).resolve(), args.runs, not args.no_onnx_path, Path(tmp), args.repeat
                )
            except (RuntimeError, OSError) as err:
                row = {"model": manifest.stem, "error": str(err)[:300]}
            rows.append(row)
            print(row, flush=True)
    report(rows, args.repeat)
    return 0 if all("error" not in r and r["cos"] >= GOAL_COS for r in rows) else 1


if __name__ == "__main__":
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    sys.exit(main())
