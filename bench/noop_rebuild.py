"""How long does a no-op `doit compile` take over a zoo of N manifests? (goal: under 1 s for 200)

    python bench/noop_rebuild.py [--count 200] [--runs 5] [--build-all] [--keep]

Writes N copies of configs/models/demo_cnn.yaml (different names) to a temp
folder and brings every task up to date, then times `doit compile` with
nothing to do, as a subprocess and by wall clock: Python start-up, dodo.py
loading every manifest and generating the task graph, the up-to-date check and
the output. The first no-op after a build is doit's full per-task check (and
records the no-op stamp, tpubuild/build/noop.py); the --runs after it are what
a user sees on every later `doit compile` with nothing changed. Prints both,
the best and median of --runs, their CPU time, and the ratio to the 1 s goal.

Bringing 200 models up to date by building each would take many minutes, so by
default the first copy is built with doit and the others are clones of it: its
build folder copied under each name, and each clone's tasks recorded in the
doit DB as doit itself records a success (file_dep states and the config
digest), so the timed run sees exactly what it would after a real build.
--build-all builds every copy instead.

The compiler (dodo.py, tpubuild/, configs/) is snapshotted into the temp folder
first: the compiler version covers the sources, so an edit made in the
checkout while the bench runs would otherwise make the timed runs rebuild.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOAL_SECONDS = 1.0


def names(count: int) -> list[str]:
    width = max(2, len(str(count - 1)))
    return [f"demo_cnn_{i:0{width}d}" for i in range(count)]


def make_zoo(folder: Path, count: int) -> list[str]:
    template = (REPO / "configs" / "models" / "demo_cnn.yaml").read_text()
    models = REPO / "models"
    text = template.replace("../../models/", f"{models}/")
    for name in names(count):
        (folder / f"{name}.yaml").write_text(text.replace("name: demo_cnn", f"name: {name}"))
    return names(count)


def snapshot(dest: Path) -> Path:
    """Copy what dodo.py loads (dodo.py, tpubuild/, configs/) to ``dest``; returns the copy's root."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    dest.mkdir()
    shutil.copy2(REPO / "dodo.py", dest / "dodo.py")
    for folder in ("tpubuild", "configs"):
        shutil.copytree(REPO / folder, dest / folder, ignore=ignore)
    return dest


def doit(code: Path, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "doit", "-f", str(code / "dodo.py"), *args],
        env={**env, "PYTHONPATH": str(code)},
        capture_output=True,
        text=True,
    )


def clone_builds(build: Path, first: str, others: list[str]) -> None:
    """Copy build/<first> to build/<other> (the .model file renamed), keeping mtimes."""
    src = build / first
    for name in others:
        dst = build / name
        shutil.copytree(src, dst, copy_function=shutil.copy2)
        for model in dst.rglob(f"{first}.model"):
            model.rename(model.with_name(f"{name}.model"))


def record_success(code: Path, manifests: Path, build: Path, models: list[str]) -> None:
    """Record every task of ``models`` in the doit DB as a successful run would (doit's own API)."""
    sys.path.insert(0, str(code))
    from doit.dependency import Dependency, SqliteDB
    from doit.loader import load_tasks

    from tpubuild.build.tasks import doit_config, find_manifests, zoo_tasks

    wanted = set(models)
    namespace = {"task_tpubuild": lambda: zoo_tasks(find_manifests([str(manifests)]), build.resolve())}
    # the checker dodo.py configures: doit re-runs a task whose recorded checker is another ("checker_changed")
    checker = doit_config(build)["check_file_uptodate"]
    dep = Dependency(SqliteDB, str(build / ".doit.db"), checker_cls=checker)
    for task in load_tasks(namespace):
        model = task.name.partition(":")[2].partition("/")[0]
        if not task.actions or model not in wanted:
            continue
        for check, _, _ in task.uptodate:
            if hasattr(check, "_calc_digest"):  # config_changed: doit sets it while checking
                check.config_digest = check._calc_digest()
        task.save_extra_values()
        dep.save_success(task)
    dep.close()


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# docs/benchmarks.md (bench/page.py): the arguments of `make bench` (quick) and `make bench-all` (all)
PAGE = {"quick": ["--count", "200", "--runs", "3"], "all": ["--count", "200", "--runs", "5"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the result as JSON (bench/page.py)")
    parser.add_argument("--count", type=int, default=200, help="number of manifests (default 200)")
    parser.add_argument("--runs", type=int, default=5, help="timed no-op runs (default 5)")
    parser.add_argument("--build-all", action="store_true", help="build every copy instead of cloning the first")
    parser.add_argument("--keep", action="store_true", help="keep the temp folder and print its path")
    args = parser.parse_args()
    result: dict = {}
    with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):  # --json: stdout is the result
        code = _bench(args, result)
    if args.json and result:
        print(json.dumps(result))
    return code


def _bench(args: argparse.Namespace, result: dict) -> int:
    root = Path(tempfile.mkdtemp(prefix="tpubuild-bench-"))
    try:
        code = snapshot(root / "code")
        (root / "models").mkdir()
        models = make_zoo(root / "models", args.count)
        build = root / "build"
        # the artifact cache would make later runs of this bench restore instead of build: keep it out
        env = {
            **os.environ,
            "TPUBUILD_MANIFESTS": str(root / "models"),
            "TPUBUILD_BUILD_DIR": str(build),
            "TPUBUILD_ARTIFACT_CACHE": "off",
        }
        start = time.perf_counter()
        first = doit(code, ["-n", "2", "compile" if args.build_all else f"compile:{models[0]}"], env)
        if first.returncode != 0:
            print(first.stdout[-3000:], first.stderr[-3000:], sep="\n")
            print("bench: the initial build failed", file=sys.stderr)
            return 1
        if not args.build_all:
            clone_builds(build, models[0], models[1:])
            record_success(code, root / "models", build, models[1:])
        how = "built" if args.build_all else f"built 1, cloned {args.count - 1}"
        print(f"set-up of {args.count} models ({how}): {time.perf_counter() - start:.1f} s")

        def noop(extra_env: dict[str, str]) -> tuple[float, float, subprocess.CompletedProcess]:
            start, cpu = time.perf_counter(), _children_cpu()
            run = doit(code, ["compile"], {**env, **extra_env})
            wall, cpu = time.perf_counter() - start, _children_cpu() - cpu
            ran = [line for line in run.stdout.splitlines() if line.startswith(".  ")]
            if run.returncode != 0 or ran:
                print(run.stdout[-2000:], run.stderr[-2000:], sep="\n")
                raise SystemExit(f"bench: the no-op run was not a no-op (exit {run.returncode}, ran {ran[:5]})")
            return wall, cpu, run

        # the first no-op after a build: doit checks every task (and the no-op stamp is recorded)
        full_wall, full_cpu, run = noop({})
        tasks = sum(line.startswith("-- ") for line in run.stdout.splitlines())
        print(f"first no-op after the build (doit checks all {tasks} tasks): {full_wall:.3f} s, CPU {full_cpu:.3f} s")
        times, cpus = [], []
        for _ in range(args.runs):
            wall, cpu, run = noop({})
            times.append(wall)
            cpus.append(cpu)
        best, median = min(times), statistics.median(times)
        fast = "without doit's per-task checks" in run.stdout
        print(
            f"no-op `doit compile` over {args.count} manifests ({tasks} tasks{', no-op stamp' if fast else ''}): "
            f"best {best:.3f} s, median {median:.3f} s ({args.runs} runs); "
            f"CPU time (user+sys) median {statistics.median(cpus):.3f} s"
        )
        if os.getloadavg()[0] > (os.cpu_count() or 1):
            print(
                f"note: load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs: wall times include "
                "waiting for a CPU; the CPU time is what the run costs"
            )
        print(
            f"ratio to the {GOAL_SECONDS:.0f} s goal: {median / GOAL_SECONDS:.2f} "
            f"({'meets' if median < GOAL_SECONDS else 'misses'} the goal)"
        )
        result.update(
            title=f"No-op rebuild: `doit compile` with nothing to do over {args.count} manifests",
            goal=f"under {GOAL_SECONDS:g} s wall for 200 manifests",
            peer="doit's own up-to-date check of every task (the first no-op after the build, same run)",
            columns=["figure", "ours (no-op stamp)", "peer (doit's checks)", "goal met"],
            rows=[
                [f"wall s, median of {args.runs}", f"{median:.3f}", f"{full_wall:.3f}", _met(median < GOAL_SECONDS)],
                [f"CPU s (user+sys), median of {args.runs}", f"{statistics.median(cpus):.3f}", f"{full_cpu:.3f}", ""],
                ["tasks", str(tasks), str(tasks), ""],
            ],
            notes=[
                f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs: wall times include waiting for a "
                "CPU; the CPU time is what the run costs"
            ],
        )
        return 0
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def _met(ok: bool) -> str:
    return "yes" if ok else "no"


if __name__ == "__main__":
    sys.exit(main())
