"""Inference speed on the zoo: TOP inference of canonical.mlir (and the simulated chip) vs onnxruntime.

    python bench/infer_speed.py [--models REGEX] [--repeat N] [--threads N] [--clock cpu|wall] [--no-sim]
                                 [--build-dir DIR] [--reuse]

For each manifest of configs/models (the top folder: demo_cnn, tiny_transformer,
the `light` models, PP-OCR det/rec/cls) whose name matches --models, builds
canonical.mlir and the test input with doit (`canonicalize:<model>`; the fetch
cache keeps the wheels), then times on the same input, in this process:

- ORT: onnxruntime on the source model, default graph optimizations (what a user
  would run), ``--threads`` intra-op threads;
- TOP: tpubuild.top.inference's Plan of canonical.mlir, run on the input with
  live tensors only (as calibration runs it), numpy's BLAS on ``--threads`` threads;
- SIM: the simulated chip (tpubuild.sim.chip.Program, run on the input) on the
  model file of the manifest's first F32 target (doit `codegen:<model>/<target>`),
  when the backend can build it; `-` when the model has no F32 target, `fail`
  when a stage fails.

Loading (parsing the module, reading weights, planning it, creating the session,
reading the model file and preparing its Program: parameters decoded, race
check, cycle model, every command's memory views) is not timed; the SIM line
shows what preparing took. Each figure is the best of --repeat runs after one
warm-up run, in CPU time of this process by default: with one thread that is the
run's own work, which other jobs on a shared machine disturb far less than the
elapsed time (they still share the caches and memory bandwidth: expect +-30% on a
busy machine; --clock wall for elapsed time, the figure to use with --threads
above 1). Prints per model ms and the ratios to onnxruntime (goals: TOP <= 3x,
SIM <= 10x) and 1 - the lowest output cosine against onnxruntime (a speed-up that
changes results shows here); then the totals over the models that ran.

Default build tree: build/ of the repo (the same artifacts `doit` makes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path


def _threads_from_argv() -> str:
    # BLAS reads its thread count when numpy is first imported: set it before any import of numpy
    for i, arg in enumerate(sys.argv):
        if arg == "--threads" and i + 1 < len(sys.argv):
            return sys.argv[i + 1]
        if arg.startswith("--threads="):
            return arg.split("=", 1)[1]
    return "1"


_THREADS = _threads_from_argv()
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = _THREADS

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402  (after the BLAS thread variables, which numpy reads at import)

TOP_GOAL, SIM_GOAL = 3.0, 10.0


def manifests(pattern: str) -> list[Path]:
    files = sorted((REPO / "configs" / "models").glob("*.yaml"))
    return [f for f in files if re.search(pattern, f.stem)]


def doit_run(manifest: Path, build_dir: Path, tasks: list[str]) -> tuple[bool, str]:
    """Build ``tasks`` in a subprocess (a big model's build memory goes with it); (ok, output tail)."""
    env = {
        **os.environ,
        "TPUBUILD_MANIFESTS": str(manifest),
        "TPUBUILD_BUILD_DIR": str(build_dir),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "doit", "-f", str(REPO / "dodo.py"), "run", *tasks],
        env=env,
        capture_output=True,
        text=True,
    )
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
    return proc.returncode == 0, tail


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
clock = CLOCKS["cpu"]


def timed(fn, repeat: int) -> tuple[float, object]:
    """Best (least disturbed) seconds of ``repeat`` calls after a warm-up call, and the last result."""
    result = fn()
    times = []
    for _ in range(repeat):
        start = clock()
        result = fn()
        times.append(clock() - start)
    return min(times), result


def ort_session(path: Path, threads: int):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def min_cos(ours: dict, ref: dict) -> float:
    from tpubuild.verify.similarity import cosine

    shared = [n for n in ref if n in ours]
    return min((cosine(np.asarray(ours[n], np.float64), ref[n]) for n in shared), default=float("nan"))


def time_ort(source: Path, inputs: dict, threads: int, repeat: int) -> tuple[float, dict]:
    """onnxruntime's seconds and its outputs (float64), the session gone after (big models' memory)."""
    session = ort_session(source, threads)
    names = [o.name for o in session.get_outputs()]
    feeds = {a.name: inputs[a.name] for a in session.get_inputs()}
    seconds, values = timed(lambda: session.run(names, feeds), repeat)
    return seconds, {n: np.asarray(v, np.float64) for n, v in zip(names, values, strict=True)}


def time_top(mlir_path: Path, inputs: dict, ref: dict, repeat: int) -> tuple[float, float]:
    """TOP inference's seconds (live tensors only) and its lowest output cosine against ``ref``."""
    from tpubuild.ir import mlir
    from tpubuild.top import inference

    module = mlir.load_module(mlir_path)
    weights = inference.weights_for(module, mlir_path)
    plan = inference.Plan(module, weights)  # made once, as onnxruntime's session is
    seconds, ours = timed(lambda: plan.run(inputs, all_tensors=False), repeat)
    return seconds, min_cos(ours, ref)


def bench_model(file: Path, build_dir: Path, repeat: int, threads: int, sim: bool, reuse: bool) -> dict:
    from tpubuild.build.files import read_npz
    from tpubuild.build.manifest import load_manifest
    from tpubuild.build.paths import ModelPaths
    from tpubuild.build.tasks import source_file

    m = load_manifest(file)
    p = ModelPaths.of(build_dir, m.name)
    row: dict = {"name": m.name}
    print(f"== {m.name}", flush=True)
    ok, tail = (
        (p.canonical_mlir.is_file(), "no canonical.mlir")
        if reuse
        else doit_run(file, build_dir, [f"canonicalize:{m.name}"])
    )
    if not ok:
        row["error"] = "build failed"
        print("  canonicalize failed:\n" + tail, flush=True)
        return row
    if reuse and source_file(m, p).stat().st_mtime > p.canonical_mlir.stat().st_mtime:
        print(
            f"  warning: {source_file(m, p).name} is newer than canonical.mlir (--reuse times stale "
            "artifacts: the cosines compare different models)",
            flush=True,
        )
    inputs = read_npz(p.input_npz)

    row["ort"], ref = time_ort(source_file(m, p), inputs, threads, repeat)
    row["top"], row["top_cos"] = time_top(p.canonical_mlir, inputs, ref, repeat)
    print(
        f"  ORT {row['ort'] * 1e3:9.2f} ms   TOP {row['top'] * 1e3:9.2f} ms  ({row['top'] / row['ort']:.2f}x)"
        f"   outputs vs onnxruntime: 1 - min cos {1 - row['top_cos']:.1e}",
        flush=True,
    )
    if sim:
        bench_sim(m, p, file, build_dir, repeat, inputs, ref, row, reuse)
    return row


def bench_sim(m, p, file: Path, build_dir: Path, repeat: int, inputs: dict, ref: dict, row: dict, reuse: bool) -> None:
    target = next((t for t in m.targets if t.mode == "F32"), None)
    if target is None:
        row["sim"] = None
        return
    model_file = p.target(target.id).model_file
    ok, tail = (
        (model_file.is_file(), "no model file")
        if reuse
        else doit_run(file, build_dir, [f"codegen:{m.name}/{target.id}"])
    )
    if not ok:
        row["sim"] = "fail"
        print(f"  codegen:{m.name}/{target.id} failed:\n{tail}", flush=True)
        return
    from tpubuild.codegen.model_file import ModelFileError
    from tpubuild.errors import TpuBuildError
    from tpubuild.sim.chip import Program, read_model

    try:
        model = read_model(model_file)
        start = clock()
        program = Program(model)  # made once, as onnxruntime's session is
        prepared = clock() - start
        row["sim"], result = timed(lambda: program.run(inputs), repeat)
    except (ModelFileError, TpuBuildError) as err:
        row["sim"] = "fail"
        print(f"  the simulator refused {model_file.name}: {str(err).splitlines()[0]}", flush=True)
        return
    row["sim_cos"] = min_cos(result.outputs, ref)
    print(
        f"  SIM {row['sim'] * 1e3:9.2f} ms  ({row['sim'] / row['ort']:.2f}x, {target.id}; preparing: "
        f"{prepared * 1e3:.1f} ms)   outputs vs onnxruntime: 1 - min cos {1 - row['sim_cos']:.1e}",
        flush=True,
    )


def print_table(rows: list[dict], threads: int, clock_name: str) -> None:
    print(
        f"\n{'model':<22}{'ORT ms':>10}{'TOP ms':>11}{'TOP/ORT':>9}{'1-cos':>10}"
        f"{'SIM ms':>11}{'SIM/ORT':>9}{'1-cos':>10}"
    )
    done = [r for r in rows if "top" in r]
    for r in rows:
        if "top" not in r:
            print(f"{r['name']:<22}  {r['error']}")
            continue
        sim = r.get("sim")
        sim_ms = f"{sim * 1e3:.2f}" if isinstance(sim, float) else (sim or "-")
        sim_ratio = f"{sim / r['ort']:.2f}x" if isinstance(sim, float) else ""
        sim_cos = f"{1 - r['sim_cos']:.1e}" if "sim_cos" in r else ""
        print(
            f"{r['name']:<22}{r['ort'] * 1e3:>10.2f}{r['top'] * 1e3:>11.2f}{r['top'] / r['ort']:>8.2f}x"
            f"{1 - r['top_cos']:>10.1e}{sim_ms:>11}{sim_ratio:>9}{sim_cos:>10}"
        )
    if not done:
        return
    ort_total, top_total = sum(r["ort"] for r in done), sum(r["top"] for r in done)
    print(f"{'total':<22}{ort_total * 1e3:>10.2f}{top_total * 1e3:>11.2f}{top_total / ort_total:>8.2f}x")
    simmed = [r for r in done if isinstance(r.get("sim"), float)]
    if simmed:
        so, ss = sum(r["ort"] for r in simmed), sum(r["sim"] for r in simmed)
        print(f"{'total (simulated)':<22}{so * 1e3:>10.2f}{'':>11}{'':>9}{'':>10}{ss * 1e3:>11.2f}{ss / so:>8.2f}x")
    over = [r["name"] for r in done if r["top"] / r["ort"] > TOP_GOAL]
    print(
        f"\nTOP within {TOP_GOAL:g}x of onnxruntime: {len(done) - len(over)} of {len(done)} models"
        + (f" (over: {', '.join(over)})" if over else "")
        + f"; {threads} thread(s) each, {clock_name} time"
    )


# docs/benchmarks.md (bench/page.py): the arguments of `make bench` (quick) and `make bench-all` (all)
PAGE = {"quick": ["--models", "^demo_cnn$|^tiny_transformer$", "--repeat", "3"], "all": []}


def top_goal_met(ort: float, top: float) -> bool:
    """DESIGN.md's goal: within TOP_GOAL x of onnxruntime where it takes 1 ms or more, else under 1 ms more."""
    return top / ort <= TOP_GOAL if ort >= 1e-3 else top - ort < 1e-3


def page(rows: list[dict], threads: int, clock_name: str) -> dict:
    """The result as docs/benchmarks.md shows it (bench/page.py's convention)."""
    table = []
    for r in rows:
        if "top" not in r:
            table.append([r["name"], "-", "-", "-", "-", "-", r.get("error", "failed")])
            continue
        sim = r.get("sim")
        table.append(
            [
                r["name"],
                f"{r['ort'] * 1e3:.2f}",
                f"{r['top'] * 1e3:.2f}",
                f"{r['top'] / r['ort']:.2f}x",
                f"{sim * 1e3:.2f}" if isinstance(sim, float) else "-",
                f"{1 - r['top_cos']:.1e}",
                "yes" if top_goal_met(r["ort"], r["top"]) else "no",
            ]
        )
    return {
        "title": "Inference speed: TOP inference (numpy) and the simulated chip vs onnxruntime",
        "goal": f"TOP inference within {TOP_GOAL:g}x of onnxruntime where onnxruntime takes 1 ms or more, under "
        "1 ms more than it on smaller models (DESIGN.md, Numerics)",
        "peer": f"onnxruntime on the source model, same process and input, {threads} thread(s), {clock_name} time",
        "columns": ["model", "onnxruntime ms (peer)", "TOP ms", "TOP/ORT", "SIM ms", "TOP 1-cos", "goal met"],
        "rows": table,
        "notes": [f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs at the end of the run"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the result as JSON (bench/page.py)")
    parser.add_argument("--models", default=".", metavar="REGEX", help="manifest names to run (re.search)")
    parser.add_argument("--repeat", type=int, default=3, metavar="N", help="timed runs per figure (the best counts)")
    parser.add_argument(
        "--threads",
        type=int,
        default=int(_THREADS),
        metavar="N",
        help="onnxruntime intra-op threads and BLAS threads (default 1)",
    )
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="cpu",
        help="cpu: this process's CPU time (default; steady on a shared machine), wall: elapsed",
    )
    parser.add_argument("--no-sim", action="store_true", help="skip the simulated chip")
    parser.add_argument("--build-dir", default=str(REPO / "build"), help="build tree (default: the repo's build/)")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="time the artifacts the build tree has, without running doit (any edit of "
        "tpubuild/ makes every stage out of date; this compares kernels on the same files)",
    )
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    files = manifests(args.models)
    if not files:
        raise SystemExit(f"no manifest in configs/models matches {args.models!r}")
    build_dir = Path(args.build_dir).resolve()
    with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):  # --json: stdout is the result
        rows = [bench_model(f, build_dir, args.repeat, args.threads, not args.no_sim, args.reuse) for f in files]
        print_table(rows, args.threads, args.clock)
    if args.json:
        print(json.dumps(page(rows, args.threads, args.clock)))
    return 0 if all("top" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
