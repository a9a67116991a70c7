"""Time and peak memory of calibration for N samples on a manifest (goal: PP-OCRv4 det, 200 samples, <= 2 GB).

    python bench/calibration.py [MANIFEST] [--samples 50 200] [--method kl] [--build-dir DIR]

MANIFEST defaults to configs/models/ppocrv4_det.yaml if present, else demo_cnn.
Builds the model's canonical.mlir through doit (cached in --build-dir, default
build/), then runs calibration (tpubuild.calib.calibrate) once per sample count,
each in a fresh process so its peak RSS is its own. The manifest's calibration
files are repeated as needed to reach N samples: time and memory behave as for
N distinct samples. Prints, per count: seconds, seconds per sample, RSS after
loading the model, peak RSS, and the peak's ratio to the smallest count's (1.0
= memory does not grow with the sample count) and to the 2 GB goal.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOAL_BYTES = 2 * 1024**3


def rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def rss_now_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(manifest: str, build_dir: str, samples: int, method: str) -> None:
    """One measurement, printed as JSON on the last line."""
    sys.path.insert(0, str(REPO))
    from tpubuild.build.inputs import of_module
    from tpubuild.build.manifest import load_manifest
    from tpubuild.build.paths import ModelPaths
    from tpubuild.calib.calibrate import calibrate
    from tpubuild.calib.data import Samples
    from tpubuild.calib.files import find_files
    from tpubuild.ir.mlir import load_module
    from tpubuild.top.inference import weights_for

    m = load_manifest(manifest)
    p = ModelPaths.of(build_dir, m.name)
    files = find_files(m.calibration["data"], m.file.parent)
    if not files:
        raise SystemExit(f"{manifest}: calibration.data matches no file")
    repeated = files * (-(-samples // len(files)))
    module = load_module(p.canonical_mlir)
    inputs = of_module([s.config() for s in m.inputs], module, file=str(manifest))
    weights = weights_for(module, p.canonical_mlir)
    loaded = rss_now_bytes()
    start = time.perf_counter()
    entries, header = calibrate(module, weights, Samples.of(repeated, inputs, samples), method)
    seconds = time.perf_counter() - start
    print(
        json.dumps(
            {
                "samples": samples,
                "seconds": seconds,
                "loaded": loaded,
                "peak": rss_peak_bytes(),
                "tensors": len(entries),
                "files": len(files),
            }
        )
    )


def build_canonical(manifest: Path, build_dir: Path) -> str:
    from tpubuild.build.manifest import load_manifest
    from tpubuild.testing import run_doit

    name = load_manifest(manifest).name
    run = run_doit(f"canonicalize:{name}", manifests=manifest, build=build_dir, timeout=None)
    if run.returncode != 0:
        raise SystemExit(f"building canonical.mlir failed:\n{run.stdout}{run.stderr}")
    return name


def main() -> int:
    default = REPO / "configs" / "models" / "ppocrv4_det.yaml"
    if not default.exists():
        default = REPO / "configs" / "models" / "demo_cnn.yaml"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("manifest", nargs="?", default=str(default))
    ap.add_argument("--samples", type=int, nargs="+", default=[50, 200])
    ap.add_argument("--method", default="kl")
    ap.add_argument("--build-dir", default=str(REPO / "build"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.manifest, args.build_dir, args.samples[0], args.method)
        return 0
    manifest, build_dir = Path(args.manifest).resolve(), Path(args.build_dir).resolve()
    sys.path.insert(0, str(REPO))
    name = build_canonical(manifest, build_dir)
    print(f"calibration of {name} ({manifest.name}), method {args.method}")
    print(
        f"{'samples':>8} {'seconds':>9} {'s/sample':>9} {'RSS loaded':>11} {'peak RSS':>10} "
        f"{'peak/first':>10} {'peak/2GB':>9}"
    )
    first = None
    for n in args.samples:
        run = subprocess.run(
            [
                sys.executable,
                __file__,
                str(manifest),
                "--child",
                "--samples",
                str(n),
                "--method",
                args.method,
                "--build-dir",
                str(build_dir),
            ],
            capture_output=True,
            text=True,
        )
        if run.returncode != 0:
            print(run.stdout + run.stderr)
            return 1
        r = json.loads(run.stdout.strip().splitlines()[-1])
        first = first or r["peak"]
        print(
            f"{n:>8} {r['seconds']:>9.1f} {r['seconds'] / n:>9.3f} {r['loaded'] / 2**20:>9.0f}MB "
            f"{r['peak'] / 2**20:>8.0f}MB {r['peak'] / first:>10.3f} {r['peak'] / GOAL_BYTES:>9.3f}"
        )
    print(f"({r['tensors']} tensors calibrated; {r['files']} calibration files, repeated to reach each count)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
