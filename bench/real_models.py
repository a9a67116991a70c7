"""Real models through the frontend: each manifest built to canonical.mlir, TOP inference vs onnxruntime.

    python bench/real_models.py [MODEL ...] [--build-dir DIR]

The models of issue 3 ("Must show" 2): the onnx wheel's `light` architectures
(their ConstantOfShape weight fills replaced by `fill_weights`) and the PP-OCR
det/rec/cls models shipped in rapidocr-onnxruntime, all from configs/models.
One `doit run verify_top:<model>` per model builds every stage before it
(fetch, transform, reference, canonicalize, verify_top); doit's JSON reporter
gives each task's own time (a stage doit found up to date shows `-`). Prints
per model the seconds per stage, the cosine of every graph output of
canonical.mlir's TOP inference against onnxruntime (goal >= 0.99999), and the
op counts ONNX -> origin -> canonical with the op types canonicalize changed;
then one table and the pass count. Exit status 1 if any model fails.

Without --build-dir the build goes to a temp folder that is removed at the end
(wheels stay in the fetch cache, $TPUBUILD_CACHE or ~/.cache/tpubuild).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tpubuild.build.paths import ModelPaths  # noqa: E402  (after sys.path: the repo before an installed copy)

LIGHT = [
    "light_squeezenet",
    "light_bvlc_alexnet",
    "light_zfnet512",
    "light_shufflenet",
    "light_inception_v1",
    "light_inception_v2",
    "light_resnet50",
    "light_densenet121",
    "light_vgg19",
]
OCR = ["ppocr_mobile_v2_cls", "ppocrv4_rec", "ppocrv4_det"]
STAGES = ["fetch", "transform", "reference", "canonicalize", "verify_top"]
GOAL_COS = 0.99999
# ops that carry no computation: the graph's inputs, its constants and absent-operand markers
_NOT_COUNTED = {"top.Input", "top.Weight", "top.None", "func.return"}


def build(name: str, manifest: Path, build_dir: Path) -> dict[str, dict]:
    """Run verify_top:<name> and the stages before it; doit's JSON report of each task by stage.

    A subprocess per model: doit's JSON reporter gives each task's own elapsed time
    (no process start-up or task loading in it), and a big model's memory goes with it.
    """
    report = build_dir / f".{name}.report.json"
    env = {
        **os.environ,
        "TPUBUILD_MANIFESTS": str(manifest),
        "TPUBUILD_BUILD_DIR": str(build_dir),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "doit",
            "-f",
            str(REPO / "dodo.py"),
            "run",
            "--reporter",
            "json",
            "-o",
            str(report),
            f"verify_top:{name}",
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    if not report.is_file():
        raise SystemExit(f"doit wrote no report for {name}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    tasks = json.loads(report.read_text())["tasks"]
    report.unlink()
    return {task["name"].partition(":")[0]: task for task in tasks}


def op_counts(mlir: Path) -> Counter:
    from tpubuild.ir.mlir import body_ops, load_module

    return Counter(op.name for op in body_ops(load_module(mlir)) if op.name not in _NOT_COUNTED)


def onnx_node_count(path: Path) -> int:
    import onnx

    # the graph without the weights: enough to count nodes, and quick for the 575 MB VGG-19
    return len(onnx.load(str(path), load_external_data=False).graph.node)


def output_cosines(p: ModelPaths, source: Path) -> tuple[dict[str, float], dict[str, float]]:
    """Cosine per graph output, canonical and origin TOP inference vs onnxruntime.

    Read from verify_top's artifacts; when that stage failed (and so wrote none),
    inference is run here so that the figures show how far off the model is.
    """
    from tpubuild.build.files import read_npz
    from tpubuild.top.inference import infer_file
    from tpubuild.verify.reference import output_names
    from tpubuild.verify.similarity import cosine

    ref = read_npz(p.onnx_outs)
    names = output_names(source)
    result = []
    for outs, mlir in ((p.top_outs, p.canonical_mlir), (p.origin_outs, p.origin_mlir)):
        tensors = read_npz(outs) if outs.is_file() else infer_file(mlir, read_npz(p.input_npz))
        result.append({n: cosine(tensors[n], ref[n]) if n in tensors else float("nan") for n in names})
    return result[0], result[1]


def last_lines(text: str, count: int = 12) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return "\n".join("    " + line for line in lines[-count:])


def bench_model(name: str, build_dir: Path) -> dict:
    manifest = REPO / "configs" / "models" / f"{name}.yaml"
    p = ModelPaths.of(build_dir, name)
    row: dict = {"name": name, "times": {}, "failed": None}
    print(f"== {name}", flush=True)
    tasks = build(name, manifest, build_dir)
    for stage in STAGES:
        task = tasks.get(stage, {"result": "not run", "elapsed": None})
        ran = task["result"] in ("success", "fail") and task["elapsed"] is not None
        row["times"][stage] = task["elapsed"] if ran else None
        seconds = f"{task['elapsed']:7.2f} s" if ran else "      - "
        # doit reports a task whose dependency failed as failed too, without running it
        result = task["result"] if ran or task["result"] != "fail" else "not run (an earlier stage failed)"
        print(f"  {stage:<13} {seconds}  {result}", flush=True)
        if ran and task["result"] == "fail":
            row["failed"] = row["failed"] or stage
            print(last_lines(task.get("error") or task.get("err") or ""))
    if row["failed"] and row["failed"] != "verify_top":
        return row
    source = p.fetched_source
    row["ops"] = (onnx_node_count(source), op_counts(p.origin_mlir), op_counts(p.canonical_mlir))
    canonical, origin = output_cosines(p, source)
    row["cos"], row["origin_cos"] = canonical, origin
    for out, cos in canonical.items():
        print(f"  output {out!r}: cos {cos:.9f}, 1 - cos {1 - cos:.1e} (origin.mlir: cos {origin[out]:.9f})")
    if p.verify_top.is_file():
        for comp in json.loads(p.verify_top.read_text())["comparisons"]:
            print(f"  every tensor of {comp['test']}: {comp['compared']} compared, min cos {comp['min_cos']:.9f}")
    onnx_nodes, before, after = row["ops"]
    changed = sorted(t for t in set(before) | set(after) if before[t] != after[t])
    print(f"  ops: ONNX {onnx_nodes} nodes -> origin {sum(before.values())} -> canonical {sum(after.values())}")
    if changed:
        print("  changed: " + ", ".join(f"{t.removeprefix('top.')} {before[t]}->{after[t]}" for t in changed))
    return row


def print_table(rows: list[dict]) -> None:
    stages = "".join(f"{s:>13}" for s in STAGES)
    head = f"{'model':<22}{stages}{'total s':>9}{'ops o->c':>12}{'min cos':>13}  result"
    print("\n" + head)
    for row in rows:
        times = row["times"]
        cells = "".join(f"{'-' if times.get(s) is None else f'{times[s]:.2f}':>13}" for s in STAGES)
        total = sum(t for t in times.values() if t is not None)
        if "ops" in row:
            ops = f"{sum(row['ops'][1].values())}->{sum(row['ops'][2].values())}"
            cos = min(row["cos"].values())
            cos_text = f"{cos:.9f}"
        else:
            ops, cos, cos_text = "", float("nan"), ""
        passed = row["failed"] is None and cos >= GOAL_COS
        result = "PASS" if passed else f"FAIL ({row['failed'] or 'cos'})"
        print(f"{row['name']:<22}{cells}{total:>9.1f}{ops:>12}{cos_text:>13}  {result}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", metavar="MODEL", help=f"manifest names (default: all {len(LIGHT + OCR)})")
    parser.add_argument("--build-dir", help="build tree to use and keep (default: a temp folder, removed)")
    args = parser.parse_args()
    models = args.models or LIGHT + OCR
    build = Path(args.build_dir).resolve() if args.build_dir else Path(tempfile.mkdtemp(prefix="tpubuild-real-"))
    try:
        rows = [bench_model(name, build) for name in models]
    finally:
        if not args.build_dir:
            shutil.rmtree(build, ignore_errors=True)
    print_table(rows)
    passed = sum(r["failed"] is None and min(r["cos"].values()) >= GOAL_COS for r in rows)
    print(f"\n{passed} of {len(rows)} models reach cos >= {GOAL_COS} on every output (canonical.mlir vs onnxruntime)")
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
