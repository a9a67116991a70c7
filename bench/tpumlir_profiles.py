"""TPU-MLIR's own cycle-model estimates for the zoo's targets, for bench/backend.py to print beside ours.

    python bench/tpumlir_profiles.py [MANIFEST ...] [--venv .anchors/tpumlir-venv] [--build-dir build]
                                      [--out bench/tpumlir_profiles.json] [--work DIR]

MANIFEST defaults to every configs/models/*.yaml. TPU-MLIR (tpu-mlir==1.30.2, from
../shared/anchors/tpumlir-setup.sh; without it this script says so and exits 0)
compiles each manifest on the same ONNX file and calibration samples as ours
(bench/vs_tpumlir.py's prepare_tpumlir): ``model_transform``, ``run_calibration``
(its defaults) when the manifest has an INT8 target, and one ``model_deploy
--debug`` per target on a chip whose estimates it prints (bm1684x, bm1688; for
cv183x it writes no profile). An INT8 target deploys with the same quantize table
as ours: the manifest's ``quantize_table``, or the table our mixed-precision search
wrote into --build-dir (``doit search:<model>/<target>``) when the manifest searches
one; TPU-MLIR reads the same ``op_name MODE`` lines. ``--debug`` leaves
``compiler_profile_0.txt``: every TIU (BDC) and GDMA command of TPU-MLIR's cost
model with its cycles, the GDMA ones with direction and bytes, ending in
``runtime: X ms``. Per target this writes into --out (JSON, keyed
``<model>/<target>``):

- ms: that runtime, TPU-MLIR's estimate of the whole model on the chip;
- tiu_ms, gdma_ms: each engine's busy time (the sum of its commands' cycles, at the
  clock the runtime implies);
- ddr_mb: the bytes its GDMA commands move between DDR and local memory;
- groups: its local layer groups (tpu.Group ops of its final mlir).

These are deterministic outputs of TPU-MLIR's compiler (the same figures on any
machine), so the file is kept in the repository and bench/backend.py reads it by
default; run this again after changing a manifest's model or targets.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from vs_tpumlir import TpuMlir, input_specs, model_suffix, prepare_tpumlir  # noqa: E402  (after sys.path: bench/ is not a package)

CHIPS = ("bm1684x", "bm1688")  # the chips model_deploy --debug writes a cycle profile for
DEFAULT_OUT = REPO / "bench" / "tpumlir_profiles.json"

_COMMAND = re.compile(r"\|t:(\d+)(?:\|dr:(\d+)\|sz:(\d+))?")
_RUNTIME = re.compile(r"runtime: ([0-9.eE+-]+)ms")
_TOTAL = re.compile(r"TCYC : (\d+)")


def read_profile(text: str) -> dict:
    """compiler_profile_0.txt -> ms, tiu_ms, gdma_ms, ddr_mb. Each line holds a TIU command on its left, a GDMA
    command on its right, or both; a GDMA command carries its direction (0: DDR to local, 1: local to DDR)."""
    runtime, total = _RUNTIME.search(text), _TOTAL.search(text)
    if runtime is None or total is None:
        raise ValueError("no 'runtime: X ms' / 'TCYC : N' in the profile")
    ms_per_cycle = float(runtime.group(1)) / int(total.group(1))
    tiu = gdma = moved = 0
    for line in text.splitlines():
        for match in _COMMAND.finditer(line):
            cycles, direction, size = match.groups()
            if direction is None:
                tiu += int(cycles)
            else:
                gdma += int(cycles)
                moved += int(size) if direction in ("0", "1") else 0
    return {
        "ms": float(runtime.group(1)),
        "tiu_ms": round(tiu * ms_per_cycle, 6),
        "gdma_ms": round(gdma * ms_per_cycle, 6),
        "ddr_mb": round(moved / 1e6, 6),
    }


def quantize_table(m, build_dir: Path, target) -> Path | None:
    """The table our INT8 target lowers with: the manifest's, or our search's (None: none, or not built)."""
    from tpubuild.build.paths import ModelPaths

    if target.mode != "INT8":
        return None
    if m.mixed_precision and m.mixed_precision.get("search"):
        searched = ModelPaths.of(build_dir, m.name).target(target.id).qtable
        return searched if searched.is_file() else None
    return m.quantize_table


def profile_model(m, build_dir: Path, venv: Path, work: Path) -> dict[str, dict]:
    from tpubuild.build.paths import ModelPaths

    targets = [t for t in m.targets if t.chip in CHIPS]
    if not targets:
        return {}
    paths = ModelPaths.of(build_dir, m.name)
    samples = prepare_tpumlir(m, paths, work)
    tm = TpuMlir(venv, work, m.name, work / "tpumlir.log")
    _, ok = tm.transform([spec["shape"] for spec in input_specs(m, paths)])
    if ok and any(t.mode == "INT8" for t in targets):
        _, ok = tm.calibrate(samples)
    if not ok:
        print(f"  {m.name}: TPU-MLIR's transform or calibration failed (see {tm.log})", flush=True)
        return {}
    found = {}
    for t in targets:
        model = f"{m.name}_{t.id}.{model_suffix(t.chip)}"
        args = ["--mlir", f"{m.name}.mlir", "--quantize", t.mode, "--chip", t.chip, "--model", model, "--debug"]
        table = quantize_table(m, build_dir, t)
        if t.mode == "INT8":
            args += ["--calibration_table", f"{m.name}_cali_table"] + (["--asymmetric"] if t.asymmetric else [])
            if table is not None:
                args += ["--quantize_table", str(table)]
        profile = work / "compiler_profile_0.txt"
        profile.unlink(missing_ok=True)
        spent, ok = tm.tool("model_deploy", *args)
        if not ok or not profile.is_file():
            print(f"  {m.name}/{t.id}: TPU-MLIR's model_deploy failed (see {tm.log})", flush=True)
            continue
        row = read_profile(profile.read_text(errors="replace"))
        final = next(work.glob(f"{m.name}_{t.chip}_{t.mode.lower()}*_final.mlir"), None)
        row["groups"] = final.read_text(errors="replace").count('"tpu.Group"') if final else None
        row["quantize_table"] = table is not None
        for stale in work.glob(f"{m.name}_{t.chip}_*_final.mlir"):
            stale.unlink()
        found[f"{m.name}/{t.id}"] = row
        print(
            f"  {m.name}/{t.id}: {row['ms']:.4f} ms (TIU {row['tiu_ms']:.4f}, GDMA {row['gdma_ms']:.4f}, "
            f"{row['ddr_mb']:.2f} MB, {row['groups']} groups){' with our quantize table' if table else ''}; "
            f"deploy {spent.wall:.1f} s",
            flush=True,
        )
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("manifests", nargs="*")
    ap.add_argument("--venv", default=str(REPO / ".anchors" / "tpumlir-venv"))
    ap.add_argument(
        "--build-dir",
        default=str(REPO / "build"),
        help="our build tree: the fetched ONNX files, test inputs and searched quantize tables",
    )
    ap.add_argument("--out", default=str(DEFAULT_OUT), help=f"JSON to update (default {DEFAULT_OUT.relative_to(REPO)})")
    ap.add_argument("--work", help="TPU-MLIR's folder (default: a temporary one, removed after)")
    args = ap.parse_args()
    from tpubuild.build.manifest import load_manifest
    from tpubuild.build.tasks import find_manifests

    venv = Path(args.venv).resolve()
    if not (venv / "bin" / "model_deploy").is_file():
        print(f"tpumlir_profiles: skipped: no TPU-MLIR in {venv} (../shared/anchors/tpumlir-setup.sh {venv})")
        return 0
    out = Path(args.out)
    doc = json.loads(out.read_text()) if out.is_file() else {"targets": {}}
    root = Path(args.work).resolve() if args.work else Path(tempfile.mkdtemp(prefix="tpumlir_profiles-"))
    try:
        for path in find_manifests(args.manifests or [str(REPO / "configs/models")]):
            m = load_manifest(path)
            work = root / m.name
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            print(f"== {m.name}", flush=True)
            doc["targets"].update(profile_model(m, Path(args.build_dir).resolve(), venv, work))
            doc["measured"] = time.strftime("%Y-%m-%d", time.gmtime())
            doc["tpu_mlir"] = "1.30.2"
            doc["targets"] = dict(sorted(doc["targets"].items()))
            out.write_text(json.dumps(doc, indent=1) + "\n")
    finally:
        if not args.work:
            shutil.rmtree(root, ignore_errors=True)
    print(f"TPU-MLIR's estimates of {len(doc['targets'])} targets in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
