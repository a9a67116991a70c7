"""What does building on a Dask cluster cost, and what would more workers give? (issue 18's goals)

    python bench/distributed.py [--models a,b,...] [--workers 2] [--synthetic 1000] [--skip-zoo]

1. The zoo (configs/models, or --models) built twice from an empty build folder and an empty artifact cache:
   `tpubuild compile -j N` locally (doit -n N), then on a LocalCluster of N single-threaded process workers on
   this machine (`tpubuild compile --scheduler`, the cache a folder): same cores, and the same processes (the
   workers are not daemonic, so a stage forks its second process there as it does locally). Prints both wall
   times and their ratio (goal: at most 1.15, what scheduling and the cache round trips cost).
2. From that cluster run's per-stage durations (Dask's task stream: the time each stage ran on its worker), the
   simulated makespan of the same dependency graph on 1, 2, 4, ..., 64 workers: list scheduling, the ready task
   heading the longest remaining chain first; the critical path is the floor no worker count goes below.
3. The scheduling overhead per task: --synthetic copies of demo_cnn (each its own name, so its own test input
   and cache keys) whose stages do nothing but write their targets, built on the same cluster: everything a stage
   costs besides its work (doit's checks, the cache key, lookups, the submit, the worker's fetch and store, the
   restore), as wall time x workers / tasks (goal: at most 20 ms a task), and the CPU time per task of this
   process (the doit client and the scheduler run here) and of the workers, which other load does not lengthen.

The compiler is imported from this checkout; the temp folders are removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# this file's name is the package's: its folder (first on the path when run as a script) must not shadow it
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(REPO))
RATIO_GOAL = 1.15
OVERHEAD_GOAL_MS = 20.0


def compile_cmd(manifests: list[str], build: Path, jobs: int, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "tpubuild.cli", "compile", *manifests, "--build-dir", str(build), "-j", str(jobs)]
    return cmd + list(extra)


def timed(cmd: list[str], env: Mapping[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, cwd=REPO)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
        raise SystemExit(f"{' '.join(cmd[:4])} failed ({proc.returncode})")
    return seconds, proc.stdout.strip().splitlines()[-1]


def manifests_of(models: str | None) -> list[str]:
    folder = REPO / "configs" / "models"
    if not models:
        return [str(folder)]
    return [str(folder / f"{name}.yaml") for name in models.split(",")]


def stage_durations(stream: list[dict]) -> dict[str, float]:
    """Task id -> seconds it ran on a worker, from Dask's task stream (keys are '<task id>-<12 hex>')."""
    durations: dict[str, float] = {}
    for record in stream:
        key = str(record["key"])
        task_id = key.rsplit("-", 1)[0]
        compute = [s for s in record.get("startstops", ()) if s.get("action") == "compute"]
        durations[task_id] = durations.get(task_id, 0.0) + sum(s["stop"] - s["start"] for s in compute)
    return durations


def dependency_graph(manifests: list[str], build: Path) -> dict[str, set[str]]:
    """Task id -> the task ids it waits for (a task making one of its file_dep), over the real task graph."""
    from tpubuild.build.tasks import find_manifests, zoo_tasks

    tasks = [t for t in zoo_tasks(find_manifests(manifests), build) if t.get("actions")]
    maker = {target: f"{t['basename']}:{t['name']}" for t in tasks for target in t.get("targets", ())}
    return {f"{t['basename']}:{t['name']}": {maker[f] for f in t.get("file_dep", ()) if f in maker} for t in tasks}


def simulate(deps: Mapping[str, set[str]], cost: Mapping[str, float], workers: int) -> float:
    """The makespan of list scheduling on ``workers``: a free worker takes the ready task with the longest chain
    of work still behind it (its 'bottom level')."""
    users: dict[str, list[str]] = {t: [] for t in deps}
    for task, before in deps.items():
        for b in before:
            users[b].append(task)
    level: dict[str, float] = {}
    for task in _topological(deps, users)[::-1]:
        level[task] = cost.get(task, 0.0) + max((level[u] for u in users[task]), default=0.0)
    waiting = {t: len(b) for t, b in deps.items()}
    ready = [(-level[t], t) for t, n in waiting.items() if n == 0]
    heapq.heapify(ready)
    running: list[tuple[float, str]] = []  # (finish time, task)
    now, idle = 0.0, workers
    while True:
        while ready and idle:
            _, task = heapq.heappop(ready)
            heapq.heappush(running, (now + cost.get(task, 0.0), task))
            idle -= 1
        if not running:
            return now
        now, task = heapq.heappop(running)
        idle += 1
        for u in users[task]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (-level[u], u))


def critical_path(deps: Mapping[str, set[str]], cost: Mapping[str, float]) -> float:
    users: dict[str, list[str]] = {t: [] for t in deps}
    for task, before in deps.items():
        for b in before:
            users[b].append(task)
    longest: dict[str, float] = {}
    for task in _topological(deps, users):
        longest[task] = cost.get(task, 0.0) + max((longest[b] for b in deps[task]), default=0.0)
    return max(longest.values(), default=0.0)


def _topological(deps: Mapping[str, set[str]], users: Mapping[str, list[str]]) -> list[str]:
    waiting = {t: len(b) for t, b in deps.items()}
    order = [t for t, n in waiting.items() if n == 0]
    for task in order:  # grows while it is walked
        for u in users[task]:
            waiting[u] -= 1
            if waiting[u] == 0:
                order.append(u)
    return order


@contextlib.contextmanager
def local_cluster(workers: int, folder: Path):
    """``workers`` single-threaded process workers, not daemonic: as a local build's stages, a stage on a worker
    forks a second process for half of its samples (tpubuild.forked; a daemonic process may have no children),
    so both builds use the same processes on the same cores."""
    import dask
    from distributed import LocalCluster

    with (
        dask.config.set({"distributed.worker.daemon": False}),
        LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            local_directory=str(folder),
        ) as cluster,
    ):
        yield cluster


def zoo(args, tmp: Path) -> None:
    from distributed import Client, get_task_stream

    manifests = manifests_of(args.models)
    local, local_line = timed(
        compile_cmd(manifests, tmp / "local", args.workers), {"TPUBUILD_ARTIFACT_CACHE": str(tmp / "cache-local")}
    )
    print(f"local   (doit -n {args.workers}):                {local:7.1f} s   {local_line}", flush=True)
    # the zoo's build tree and cache take about 33 GB (every tensor of every level is kept): two at once can fill
    # a disk
    for folder in ("local", "cache-local"):
        shutil.rmtree(tmp / folder, ignore_errors=True)
    with (
        local_cluster(args.workers, tmp / "workers") as cluster,
        Client(cluster) as client,
        get_task_stream(client) as stream,
    ):
        env = {"TPUBUILD_ARTIFACT_CACHE": str(tmp / "cache-cluster")}
        cmd = compile_cmd(manifests, tmp / "cluster", args.workers, "--scheduler", cluster.scheduler_address)
        remote, remote_line = timed(cmd, env)
        print(f"cluster ({args.workers} workers x 1 thread):     {remote:7.1f} s   {remote_line}", flush=True)
        records = stream.data
    ratio = remote / local
    verdict = "met" if ratio <= RATIO_GOAL else "NOT met"
    print(f"wall-time ratio cluster / local: {ratio:.3f}  (goal <= {RATIO_GOAL}: {verdict})")

    cost = stage_durations(records)
    deps = dependency_graph(manifests, tmp / "cluster")
    total, floor = sum(cost.get(t, 0.0) for t in deps), critical_path(deps, cost)
    print(
        f"\nsimulated makespan of this graph ({len(deps)} tasks, {total:.1f} s of stage work measured on the "
        f"workers; critical path {floor:.1f} s):"
    )
    print(f"{'workers':>8} {'makespan s':>11} {'speed-up':>9} {'vs critical path':>17}")
    workers = 1
    one = simulate(deps, cost, 1)
    while workers <= 64:
        span = simulate(deps, cost, workers)
        print(f"{workers:>8} {span:>11.1f} {one / span:>8.2f}x {span / floor if floor else 0:>16.2f}x")
        workers *= 2


def _no_stage(**kwargs) -> None:
    """A stage that does nothing but write its targets (the option names starting with out_), a few bytes each."""
    for name, value in kwargs.items():
        if name.startswith("out") and isinstance(value, str):
            Path(value).parent.mkdir(parents=True, exist_ok=True)
            Path(value).write_text(f"{name}\n", encoding="utf-8")


def synthetic(args, tmp: Path) -> None:
    folder = tmp / "synthetic"
    folder.mkdir()
    text = (REPO / "configs" / "models" / "demo_cnn.yaml").read_text(encoding="utf-8")
    text = text.replace("../../models/", f"{REPO}/models/")
    for i in range(args.synthetic):
        (folder / f"demo_cnn_{i:04d}.yaml").write_text(text.replace("name: demo_cnn", f"name: demo_cnn_{i:04d}"))
    workers_before = _cpu(resource.RUSAGE_CHILDREN)
    with local_cluster(args.workers, tmp / "workers-synthetic") as cluster:
        os.environ["TPUBUILD_SCHEDULER"] = cluster.scheduler_address
        os.environ["TPUBUILD_ARTIFACT_CACHE"] = str(tmp / "cache-synthetic")
        start, here = time.perf_counter(), _cpu(resource.RUSAGE_SELF)
        tasks, code = _run_no_stages(folder, tmp / "build-synthetic")
        seconds, here = time.perf_counter() - start, _cpu(resource.RUSAGE_SELF) - here
    workers = _cpu(resource.RUSAGE_CHILDREN) - workers_before  # (their whole life: start and warm-up included)
    if code != 0:
        raise SystemExit(f"the synthetic build failed ({code})")
    per_task = seconds * args.workers / tasks * 1000
    print(
        f"\nscheduling overhead: {args.synthetic} synthetic manifests, {tasks} tasks whose stages do nothing, on "
        f"{args.workers} workers in {seconds:.1f} s: {per_task:.1f} ms per task (wall x workers / tasks; "
        f"goal <= {OVERHEAD_GOAL_MS:g} ms: {'met' if per_task <= OVERHEAD_GOAL_MS else 'NOT met'})\n"
        f"CPU time per task: {here / tasks * 1000:.1f} ms in this process (the doit client and the scheduler), "
        f"{workers / tasks * 1000:.1f} ms in the workers; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} "
        "cores at the end (other processes' work lengthens the wall time)"
    )


def _cpu(who: int) -> float:
    """User and system CPU seconds of this process (RUSAGE_SELF) or of its ended children (RUSAGE_CHILDREN)."""
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _run_no_stages(manifests: Path, build: Path) -> tuple[int, int]:
    """doit over ``manifests`` on the cluster, every stage function replaced by ``_no_stage``; (tasks, exit code)."""
    from doit.cmd_base import ModuleTaskLoader
    from doit.doit_cmd import DoitMain

    from tpubuild.build.tasks import doit_config, find_manifests, zoo_tasks

    config = doit_config(build)
    tasks = []
    for task in zoo_tasks(find_manifests([str(manifests)]), build):
        if task.get("actions"):
            call, (task_id, _func, kwargs, spec) = task["actions"][0]
            task = {**task, "actions": [(call, [task_id, _no_stage, kwargs, spec])]}
        tasks.append(task)

    def task_tpubuild():
        """The no-op stages."""
        yield from (dict(t) for t in tasks)

    main = DoitMain(ModuleTaskLoader({"DOIT_CONFIG": config, "task_tpubuild": task_tpubuild}))
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):  # a table of every synthetic target
        code = main.run(["run", "compile"])
    return sum(1 for t in tasks if t.get("actions")), code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="comma-separated manifest names (default: the whole zoo)")
    parser.add_argument("--workers", type=int, default=2, help="workers (and local doit processes); default 2")
    parser.add_argument("--synthetic", type=int, default=1000, help="synthetic manifests for the overhead (0: skip)")
    parser.add_argument("--skip-zoo", action="store_true", help="only the overhead")
    parser.add_argument("--keep", action="store_true", help="keep the temp folder")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tpubuild-distributed-"))
    try:
        if not args.skip_zoo:
            zoo(args, tmp)
        if args.synthetic:
            synthetic(args, tmp)
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
