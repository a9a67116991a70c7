"""How long does a no-op `doit compile` take over a zoo of N manifests? (goal: under 1 s for 20)

    python bench/noop_rebuild.py [--count 20] [--runs 5] [--keep]

Writes N copies of configs/models/demo_cnn.yaml (different names) to a temp
folder, builds them once with `doit -n 2 compile`, then times `doit compile`
with nothing to do, as a subprocess and by wall clock: Python start-up, dodo.py
loading every manifest, doit's up-to-date checks and its output. Prints the
best and median of --runs and the ratio to the 1 s goal.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOAL_SECONDS = 1.0


def make_zoo(folder: Path, count: int) -> None:
    template = (REPO / "configs" / "models" / "demo_cnn.yaml").read_text()
    source = (REPO / "models" / "demo_cnn.onnx").resolve()
    for i in range(count):
        text = template.replace("name: demo_cnn", f"name: demo_cnn_{i:02d}")
        text = text.replace("source: ../../models/demo_cnn.onnx", f"source: {source}")
        (folder / f"demo_cnn_{i:02d}.yaml").write_text(text)


def doit(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "doit", "-f", str(REPO / "dodo.py"), *args],
                          env=env, capture_output=True, text=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=20, help="number of manifests (default 20)")
    parser.add_argument("--runs", type=int, default=5, help="timed no-op runs (default 5)")
    parser.add_argument("--keep", action="store_true", help="keep the temp folder and print its path")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="tpubuild-bench-"))
    try:
        (root / "models").mkdir()
        make_zoo(root / "models", args.count)
        env = {**os.environ, "TPUBUILD_MANIFESTS": str(root / "models"), "TPUBUILD_BUILD_DIR": str(root / "build")}
        start = time.perf_counter()
        first = doit(["-n", "2", "compile"], env)
        if first.returncode != 0:
            print(first.stdout[-3000:], first.stderr[-3000:], sep="\n")
            print("bench: the initial build failed", file=sys.stderr)
            return 1
        print(f"initial build of {args.count} models: {time.perf_counter() - start:.1f} s")

        times = []
        for _ in range(args.runs):
            start = time.perf_counter()
            run = doit(["compile"], env)
            times.append(time.perf_counter() - start)
            ran = [line for line in run.stdout.splitlines() if line.startswith(".  ")]
            if run.returncode != 0 or ran:
                print(f"bench: the no-op run was not a no-op (exit {run.returncode}, ran {ran[:5]})", file=sys.stderr)
                return 1
        best, median = min(times), statistics.median(times)
        print(f"no-op `doit compile` over {args.count} manifests: best {best:.3f} s, median {median:.3f} s "
              f"({args.runs} runs)")
        print(f"ratio to the {GOAL_SECONDS:.0f} s goal: {median / GOAL_SECONDS:.2f} "
              f"({'meets' if median < GOAL_SECONDS else 'misses'} the goal)")
        return 0
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
