"""The doit task graph, driven as a user drives it: `doit` in a subprocess on temp manifests.

Each test builds a small zoo (two manifests sharing one tiny ONNX model) in its
own build tree, then checks which tasks ran by parsing doit's console output
(".  task" = executed, "-- task" = up to date).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from tpubuild.testing import doit_cmd, doit_env, run_doit, save_onnx, snapshot_code, tasks_marked, upstream_check

REPO = Path(__file__).resolve().parents[1]
STAGES = ("transform", "reference", "canonicalize", "verify_top", "compile")

MANIFEST = """\
name: {name}
source: tiny.onnx
inputs:
  - name: x
    shape: [{batch}, 4]
    range: [-1, 1]
tolerance:
  top: {{cos: 0.99999, euc: 0.999}}
"""


def tiny_onnx(path: Path, op: str = "Relu") -> None:
    """y = op(x @ w + b), batch dimension dynamic."""
    rng = np.random.default_rng(7)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"], name="mm"),
        helper.make_node("Add", ["mm", "b"], ["add"], name="add"),
        helper.make_node(op, ["add"], ["y"], name="act"),
    ]
    save_onnx(
        path,
        nodes,
        {"x": ["N", 4]},
        {"y": ["N", 3]},
        {"w": rng.standard_normal((4, 3)).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)},
    )


class Zoo:
    """Manifests in tmp/models, build tree in tmp/build, doit run on the repo's dodo.py."""

    def __init__(self, root: Path):
        self.models = root / "models"
        self.build = root / "build"
        self.code = snapshot_code(root / "code")  # sources edited during the run must not rebuild everything
        self.models.mkdir()
        tiny_onnx(self.models / "tiny.onnx")

    def manifest(self, name: str, batch: int = 2, text: str | None = None) -> Path:
        path = self.models / f"{name}.yaml"
        path.write_text(text if text is not None else MANIFEST.format(name=name, batch=batch))
        return path

    def env(self, **extra: str) -> dict[str, str]:
        return doit_env(self.models, self.build, self.code, **extra)

    def cmd(self, *args: str) -> list[str]:
        return doit_cmd(*args, code=self.code)

    def doit(self, *args: str) -> subprocess.CompletedProcess:
        return run_doit(*args, manifests=self.models, build=self.build, code=self.code)


def executed(out: str) -> set[str]:
    return tasks_marked(out, ".  ")


def skipped(out: str) -> set[str]:
    return tasks_marked(out, "-- ")


def all_tasks(*models: str) -> set[str]:
    return {f"{stage}:{m}" for m in models for stage in STAGES}


@pytest.fixture
def zoo(tmp_path) -> Zoo:
    return Zoo(tmp_path)


@pytest.fixture
def built(zoo) -> Zoo:
    """A zoo of models a and b, built once."""
    zoo.manifest("a")
    zoo.manifest("b")
    run = zoo.doit("compile")
    assert run.returncode == 0, run.stdout + run.stderr
    assert executed(run.stdout) == all_tasks("a", "b")
    return zoo


def test_list_shows_stage_tasks(zoo):
    zoo.manifest("a")
    out = zoo.doit("list", "--all").stdout
    for task in all_tasks("a"):
        assert task in out
    assert "fetch" not in out  # a path source needs no fetch task


def test_build_outputs_and_summary(built):
    root = built.build / "a"
    for name in (
        "origin.mlir",
        "origin_weights.npz",
        "input.npz",
        "onnx_outs.npz",
        "canonical.mlir",
        "canonical_weights.npz",
        "origin_outs.npz",
        "top_outs.npz",
        "verify_top.json",
        "summary.txt",
    ):
        assert (root / name).is_file(), name
    summary = (root / "summary.txt").read_text()
    assert summary.count("PASS") == 2 and "FAIL" not in summary
    assert not list(built.build.rglob("*.tmp")), "temp files left behind"


def test_noop_rebuild_runs_nothing(built):
    run = built.doit("compile")
    assert run.returncode == 0
    assert executed(run.stdout) == set()
    assert skipped(run.stdout) == all_tasks("a", "b")
    assert "PASS" in run.stdout  # the saved summary of up-to-date models is still shown


def test_tolerance_change_reruns_only_verification(built):
    built.manifest("a", text=MANIFEST.format(name="a", batch=2).replace("cos: 0.99999", "cos: 0.9999"))
    run = built.doit("compile")
    assert run.returncode == 0, run.stdout
    assert executed(run.stdout) == {"verify_top:a", "compile:a"}


def test_shape_change_reruns_from_transform(built):
    built.manifest("a", batch=3)
    run = built.doit("compile")
    assert run.returncode == 0, run.stdout
    assert executed(run.stdout) == all_tasks("a")


def test_range_change_stops_early_on_identical_ir(built):
    """A new test input re-runs transform, but origin.mlir is byte-identical, so canonicalize is skipped."""
    built.manifest("a", text=MANIFEST.format(name="a", batch=2).replace("[-1, 1]", "[0, 2]"))
    run = built.doit("compile")
    assert run.returncode == 0, run.stdout
    assert executed(run.stdout) == {"transform:a", "reference:a", "verify_top:a", "compile:a"}


def test_deleted_target_is_rebuilt(built):
    (built.build / "a" / "canonical.mlir").unlink()
    run = built.doit("compile")
    assert "canonicalize:a" in executed(run.stdout)
    assert executed(run.stdout) <= {"canonicalize:a", "verify_top:a", "compile:a"}


def test_bad_manifest_fails_only_its_model(zoo):
    zoo.manifest("good")
    bad = zoo.manifest("bad", text=MANIFEST.format(name="bad", batch=2).replace("[2, 4]", "[2, four]"))
    run = zoo.doit("compile")
    assert run.returncode != 0
    assert executed(run.stdout) >= all_tasks("good")
    assert (zoo.build / "good" / "summary.txt").is_file()
    assert str(bad) in run.stdout and "inputs[0].shape[1]" in run.stdout
    assert "Traceback" not in run.stdout + run.stderr


def test_failing_stage_leaves_no_target(zoo):
    """An unsupported op: transform fails with the op named, and writes nothing."""
    tiny_onnx(zoo.models / "tiny.onnx", op="Det")
    zoo.manifest("a")
    run = zoo.doit("compile")
    assert run.returncode != 0
    assert "Det" in run.stdout and "transform" in run.stdout
    assert "Traceback" not in run.stdout + run.stderr
    leftovers = [p.name for p in (zoo.build / "a").iterdir()] if (zoo.build / "a").exists() else []
    assert not {"origin.mlir", "origin_weights.npz", "input.npz"} & set(leftovers)
    assert not [n for n in leftovers if n.endswith(".tmp")]


def test_corrupt_onnx_fails_cleanly(zoo):
    zoo.manifest("a")
    data = (zoo.models / "tiny.onnx").read_bytes()
    (zoo.models / "tiny.onnx").write_bytes(data[: len(data) // 3])
    run = zoo.doit("compile")
    assert run.returncode != 0
    assert "tiny.onnx" in run.stdout and "Traceback" not in run.stdout + run.stderr
    assert not (zoo.build / "a" / "origin.mlir").exists()


def test_clean_removes_targets(built):
    run = built.doit("clean")
    assert run.returncode == 0, run.stdout + run.stderr
    assert not [p for p in (built.build / "a").iterdir()]


def test_parallel_build(zoo):
    zoo.manifest("a")
    zoo.manifest("b")
    run = zoo.doit("-n", "2", "compile")
    assert run.returncode == 0, run.stdout + run.stderr
    assert executed(run.stdout) == all_tasks("a", "b")
    assert executed(zoo.doit("compile").stdout) == set()


def test_two_concurrent_runs_keep_the_db_sound(zoo):
    zoo.manifest("a")
    zoo.manifest("b")
    procs = [
        subprocess.Popen(zoo.cmd("compile"), env=zoo.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    again = zoo.doit("compile")
    assert again.returncode == 0
    assert executed(again.stdout) == set(), again.stdout


@pytest.mark.parametrize("jobs", [[], ["-n", "2"]], ids=["serial", "parallel"])
def test_sigterm_keeps_finished_tasks(zoo, jobs):
    """SIGTERM while compile:b runs: every task that finished before it is not run again."""
    zoo.manifest("a")
    zoo.manifest("b")
    env = zoo.env(TPUBUILD_DEBUG_DELAY="compile:b=60")
    proc = subprocess.Popen(
        zoo.cmd(*jobs, "compile"), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen = []
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(".  compile:b"):
            break
        assert time.monotonic() < deadline, "".join(seen)
    time.sleep(0.5)  # inside the delayed action now
    proc.send_signal(signal.SIGTERM)
    rest = proc.communicate(timeout=60)[0]
    assert proc.returncode == 128 + signal.SIGTERM, rest
    assert "Traceback" not in rest
    finished = executed("".join(seen)) - {"compile:b"}
    assert finished >= all_tasks("b") - {"compile:b"}, seen
    assert not (zoo.build / "b" / "summary.txt").exists()

    again = zoo.doit("compile")
    assert again.returncode == 0, again.stdout
    assert "compile:b" in executed(again.stdout)
    assert not finished & executed(again.stdout), again.stdout


def test_shipped_models_build_and_verify(tmp_path):
    """The repo's own manifests (demo CNN, transformer block) build to canonical.mlir and match
    onnxruntime on every compared tensor; upstream MLIR parses every .mlir they produce."""
    import json

    build = tmp_path / "build"
    # these two only: the rest of configs/models (real models, some of hundreds of MB) is bench/real_models.py's
    shipped = os.pathsep.join(str(REPO / "configs" / "models" / f"{m}.yaml") for m in ("demo_cnn", "tiny_transformer"))
    run = run_doit("compile", manifests=shipped, build=build)
    assert run.returncode == 0, run.stdout + run.stderr
    for model in ("demo_cnn", "tiny_transformer"):
        doc = json.loads((build / model / "verify_top.json").read_text())
        for comp in doc["comparisons"]:
            assert comp["passed"] and comp["compared"] > 0, comp
            assert comp["min_cos"] >= 0.99999, comp
        for name in ("origin.mlir", "canonical.mlir"):
            upstream_check(build / model / name, "-o", os.devnull)


@pytest.mark.parametrize("first", ["a", "b", "d"])
def test_first_stages_are_dispatched_before_other_ready_tasks(tmp_path, first):
    """doit_config's dispatcher (dispatch._next_by_priority): of the tasks ready at once (after c), the one of the
    highest ``meta["priority"]`` runs first (the search, before F32/BF16 stages). doit's own order among them
    is that of a set."""
    from doit.cmd_base import ModuleTaskLoader
    from doit.doit_cmd import DoitMain

    from tpubuild.build.tasks import doit_config

    order = []

    def task_x():
        yield {"basename": "c", "actions": [lambda: order.append("c")]}
        for name in ("a", "b", "d"):
            yield {
                "basename": name,
                "actions": [lambda name=name: order.append(name)],
                "task_dep": ["c"],
                **({"meta": {"priority": 1}} if name == first else {}),
            }
        yield {"basename": "all", "actions": None, "task_dep": ["a", "b", "d"]}

    config = {**doit_config(tmp_path), "reporter": "zero", "default_tasks": ["all"]}
    assert DoitMain(ModuleTaskLoader({"DOIT_CONFIG": config, "task_x": task_x})).run([]) == 0
    assert order[:2] == ["c", first] and sorted(order) == ["a", "b", "c", "d"]


def test_next_by_priority_takes_the_highest_priority_first_then_doits_order():
    from collections import deque
    from types import SimpleNamespace

    from tpubuild.build.dispatch import _next_by_priority

    reads = []

    class Meta(dict):
        def get(self, key, default=None):
            reads.append(self["name"])
            return super().get(key, default)

    def node(name, priority=None):
        return SimpleNamespace(
            name=name,
            task=SimpleNamespace(meta=Meta(name=name, **({} if priority is None else {"priority": priority}))),
        )

    dispatcher = SimpleNamespace()
    ready = deque([node("report", -1), node("lg"), node("search", 1), node("assign"), node("cal", 1)])
    picked = [_next_by_priority(dispatcher, ready, []).name for _ in range(2)]
    # tasks doit makes ready meanwhile join their priority's queue after those ready before them
    ready.extend([node("verify"), node("calibrate2", 1)])
    picked += [_next_by_priority(dispatcher, ready, []).name for _ in range(5)]
    assert picked == ["search", "cal", "calibrate2", "lg", "assign", "verify", "report"]
    # each task's priority is read once, not at every pick (a zoo's no-op has thousands ready at once)
    assert sorted(reads) == sorted(["report", "lg", "search", "assign", "cal", "verify", "calibrate2"])
    # nothing ready: doit's own next node (the next task it was asked to run)
    assert _next_by_priority(dispatcher, ready, []) is None


def test_a_task_runs_in_the_process_that_made_its_inputs(tmp_path):
    """doit_config's runner (dispatch.py): with two processes, each stage of a chain goes to the process that
    ran the stage before it (which holds its module parsed), while an independent task keeps the other busy."""
    from doit.cmd_base import ModuleTaskLoader
    from doit.doit_cmd import DoitMain

    from tpubuild.build.tasks import doit_config

    def stamp(path, delay):
        time.sleep(delay)
        Path(path).write_text(str(os.getpid()))

    def task_x():
        yield {"basename": "a", "actions": [(stamp, [tmp_path / "a", 0.0])], "targets": [str(tmp_path / "a")]}
        previous = "a"
        for name in ("b", "c", "d"):
            yield {
                "basename": name,
                "actions": [(stamp, [tmp_path / name, 0.3])],
                "targets": [str(tmp_path / name)],
                "file_dep": [str(tmp_path / previous)],
            }
            previous = name
        # ready with b, short: the other process is free (held) each time one of b, c, d becomes ready
        yield {"basename": "side", "actions": [(stamp, [tmp_path / "side", 0.1])], "task_dep": ["a"]}
        yield {"basename": "all", "actions": None, "task_dep": ["d", "side"]}

    config = {**doit_config(tmp_path / "build"), "reporter": "zero", "default_tasks": ["all"]}
    assert DoitMain(ModuleTaskLoader({"DOIT_CONFIG": config, "task_x": task_x})).run(["-n", "2"]) == 0
    pids = {name: (tmp_path / name).read_text() for name in ("a", "b", "c", "d", "side")}
    assert pids["b"] == pids["c"] == pids["d"], pids
    assert len(set(pids.values())) == 2, pids  # both processes ran tasks


def test_processes_get_tasks_by_what_they_made_and_ran():
    """dispatch.assign with History.rank: a task to a process that made its inputs, else one that ran its stage;
    jobs in doit's order, ties to the first free process."""
    from types import SimpleNamespace

    from doit.runner import JobHold

    from tpubuild.build.dispatch import History, assign

    def task(name, deps=(), meta=None):
        return SimpleNamespace(name=name, file_dep=set(deps), targets=[f"{name}.out"], meta=meta)

    tasks = {
        t.name: t
        for t in (
            task("lower:m/I"),
            task("lg:m/I", ["lower:m/I.out"]),
            task("verify:m/I", ["lower:m/I.out"]),
            task("lg:m/F"),
            task("report:m/I", ["verify:m/I.out"]),
        )
    }
    history = History(3)
    history.ran(2, tasks["lg:m/F"])
    history.ran(0, tasks["lower:m/I"])
    hold = JobHold()

    def given(names, free):
        jobs = [SimpleNamespace(name=n) if isinstance(n, str) else n for n in names]
        found = assign(jobs, free, lambda job, process: history.rank(tasks[job.name], process))
        return {p: getattr(j, "name", j) for p, j in found.items()}

    # both read what process 0 made: the first in doit's order goes there, the other to one that ran its stage
    # if one is free, else to the first free one
    assert given(["verify:m/I", "lg:m/I", hold], [1, 2, 0]) == {0: "verify:m/I", 2: "lg:m/I", 1: hold}
    assert given(["lg:m/I", "verify:m/I", hold], [1, 2, 0]) == {0: "lg:m/I", 1: "verify:m/I", 2: hold}
    assert given(["lg:m/F", None, None], [1, 2, 0]) == {2: "lg:m/F", 1: None, 0: None}
    history.ran(1, tasks["verify:m/I"])
    history.ran(0, task("report:m/F"))
    # process 1 made the report's input; process 0 has drawn a page: what a task reads decides first
    assert given(["report:m/I", hold], [0, 1]) == {1: "report:m/I", 0: hold}


def test_a_full_disk_fails_the_stage_in_words(tmp_path):
    """ENOSPC while a stage writes (a zoo build on a small disk): the task fails naming the model, the stage and
    the file, and what to do, without a traceback; any other OSError is a bug and keeps its traceback."""
    import errno

    from tpubuild.build.tasks import run_stage

    def full(out_mlir):
        raise OSError(errno.ENOSPC, "No space left on device", out_mlir)

    failed = run_stage("lower:m/bm1684x-F16", full, {"out_mlir": str(tmp_path / "tpu.mlir")})
    message = failed.get_msg()
    assert "model m/bm1684x-F16, stage lower" in message and "tpu.mlir" in message and "disk is full" in message
    assert "free space" in message and "Traceback" not in message

    def broken(out_mlir):
        raise OSError(errno.EACCES, "Permission denied", out_mlir)

    with pytest.raises(PermissionError):
        run_stage("lower:m/bm1684x-F16", broken, {"out_mlir": str(tmp_path / "tpu.mlir")})
