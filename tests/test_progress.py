"""The progress reporter: counts and running stages as the build goes, the summary table at the end,
and a batch build that carries on past a broken manifest and a failing stage."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
from doit.exceptions import TaskFailed, UnmetDependency
from doit.task import Task
from onnx import helper

from tpubuild.build.progress import ProgressReporter, split_task, zoo_table
from tpubuild.build.tasks import doit_config
from tpubuild.testing import run_doit, save_onnx


def task(name: str, deps=(), meta=None) -> Task:
    return Task(name, [(lambda: None)], task_dep=list(deps), meta=meta)


def reporter(tasks: list[Task], selected: list[str], tty: bool = False) -> tuple[ProgressReporter, io.StringIO]:
    class Out(io.StringIO):
        def isatty(self):
            return tty

    out = Out()
    rep = ProgressReporter(out, {})
    rep.initialize({t.name: t for t in tasks}, selected)
    return rep, out


def test_split_task():
    assert split_task("lower:demo_cnn/bm1684x-INT8") == ("lower", "demo_cnn", "bm1684x-INT8")
    assert split_task("compile:demo_cnn") == ("compile", "demo_cnn", None)


def test_status_line_counts_and_running_stages(monkeypatch):
    monkeypatch.setenv("TPUBUILD_PROGRESS", "off")
    tasks = [
        task("transform:a"),
        task("transform:b"),
        task("verify_top:a", ["transform:a"]),
        task("lower:b/bm1684x-F32", ["transform:b"]),
        task("other:c"),
    ]
    rep, _ = reporter(tasks, ["verify_top:a", "lower:b/bm1684x-F32"])
    assert rep.total == 4  # other:c is not selected
    rep.skip_uptodate(tasks[0])
    rep.execute_task(tasks[2])
    rep.execute_task(tasks[1])
    line = rep.status_line()
    assert "1/4 tasks" in line and "1 up to date" in line
    assert line.endswith("running: a verify_top, b transform")
    tasks[1].values = {"cache": "hit"}
    rep.add_success(tasks[1])
    rep.execute_task(tasks[3])
    rep.add_failure(tasks[3], TaskFailed("lowering failed"))
    rep.add_failure(tasks[2], UnmetDependency("transform:a"))
    line = rep.status_line()
    assert "4/4 tasks 100%" in line and "1 ran (1 from cache)" in line
    assert "1 failed (b)" in line and "1 skipped" in line and "running" not in line


def test_log_lines_at_every_event_and_tty_redraws(monkeypatch):
    tasks = [task("transform:a"), task("verify_top:a", ["transform:a"])]
    monkeypatch.setenv("TPUBUILD_PROGRESS", "0")
    rep, out = reporter(tasks, ["verify_top:a"])
    rep.execute_task(tasks[0])
    rep.add_success(tasks[0])
    text = out.getvalue()
    assert ".  transform:a\n" in text
    assert "progress [0:00] 1/2 tasks  50%" in text
    monkeypatch.setenv("TPUBUILD_PROGRESS", "10")
    rep, out = reporter(tasks, ["verify_top:a"], tty=True)
    rep.execute_task(tasks[0])
    rep.add_success(tasks[0])
    rep.complete_run()
    text = out.getvalue()
    assert "\r\x1b[K[0:00] 0/2 tasks" in text  # drawn in place
    assert text.endswith("1/2 tasks in 0:00: 1 ran (0 restored from the artifact cache), 0 up to date, 0 failed\n")


def write_json(path: Path, doc) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))


def test_table_rows(tmp_path):
    root = tmp_path / "m"
    write_json(
        root / "verify_top.json",
        {"comparisons": [{"level": "top", "min_cos": 0.99991}, {"level": "top", "min_cos": 0.99995}]},
    )
    write_json(
        root / "chipA-INT8" / "verify.json",
        {
            "comparisons": [
                {"level": "top", "min_cos": 0.99991},
                {"level": "tpu", "min_cos": 0.987654321},
                {"level": "chip", "min_cos": 1.0},
            ],
            "chip": {"time_ms": 1.23456},
        },
    )
    (root / "chipA-INT8" / "m.model").write_bytes(b"\0" * 2048)
    base = [task("transform:m"), task("verify_top:m", ["transform:m"])]
    chain = []
    for t in ("chipA-INT8", "chipA-F32"):
        lower = task(f"lower:m/{t}", ["transform:m"])
        tpu = task(f"verify_tpu:m/{t}", [lower.name])
        codegen = task(f"codegen:m/{t}", [lower.name])
        chip = task(f"verify_chip:m/{t}", [codegen.name, tpu.name, "verify_top:m"])
        chain += [lower, tpu, codegen, chip]
    compile_ = task(
        "compile:m",
        [t.name for t in chain if t.name.startswith("verify")] + ["verify_top:m"],
        meta={"summary": str(root / "summary.txt")},
    )
    broken = task("compile:broken")
    plan = {t.name: t for t in base + chain + [compile_, broken]}
    outcome = {name: "ok" for name in plan}
    outcome.update(
        {
            "verify_tpu:m/chipA-F32": "failed",
            "verify_chip:m/chipA-F32": "blocked",
            "compile:m": "blocked",
            "compile:broken": "failed",
        }
    )
    lines = zoo_table(plan, outcome)
    assert lines[0].startswith("summary: 1 of 3 model targets PASS")
    rows = {tuple(line.split()[:2]): line.split() for line in lines[3:6]}
    assert rows[("m", "chipA-INT8")][2:] == ["PASS", "0.999910", "0.987654", "1.000000", "-", "1.235", "2.0", "KB"]
    assert rows[("m", "chipA-F32")][2:6] == ["FAIL", "verify_tpu", "0.999910", "-"]
    # the failed comparison the verify stage kept for the reports shows how far off it was
    write_json(
        root / "chipA-F32" / "verify_tpu.failed.json",
        {"comparisons": [{"level": "tpu", "min_cos": 0.75}], "passed": False},
    )
    lines = zoo_table(plan, outcome)
    assert lines[4].split()[2:6] == ["FAIL", "verify_tpu", "0.999910", "0.750000!"]
    assert lines[-1].startswith("! the comparison that failed")
    assert rows[("broken", "-")][2:4] == ["FAIL", "manifest"]
    # what was read is remembered by file state; a changed file is read again
    assert (tmp_path / ".zoo_table.json").exists()
    write_json(root / "chipA-INT8" / "verify.json", {"comparisons": [{"level": "tpu", "min_cos": 0.5}], "chip": {}})
    assert "0.500000" in "\n".join(zoo_table(plan, outcome))


def test_doit_config_continues_past_failures(tmp_path):
    assert doit_config(tmp_path)["continue"] is True


def tiny_onnx(path: Path) -> None:
    save_onnx(
        path,
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        {"x": ["N", 4]},
        {"y": ["N", 3]},
        {"w": np.random.default_rng(5).standard_normal((4, 3)).astype(np.float32)},
    )


MANIFEST = "name: {name}\nsource: {source}\ninputs:\n  - {{name: x, shape: [2, 4]}}\n"


def test_batch_build_carries_on_and_ends_with_the_table(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    tiny_onnx(models / "tiny.onnx")
    (models / "garbage.onnx").write_bytes(b"not a protobuf")
    (models / "good.yaml").write_text(MANIFEST.format(name="good", source="tiny.onnx"))
    (models / "bad.yaml").write_text(MANIFEST.format(name="bad", source="garbage.onnx"))
    (models / "broken.yaml").write_text("name: broken\nsource: tiny.onnx\ninputs: 3\n")
    run = run_doit("-n", "2", "compile", manifests=models, build=tmp_path / "build", TPUBUILD_PROGRESS="0")
    out = run.stdout
    assert run.returncode != 0
    assert ".  compile:good" in out, out
    assert (tmp_path / "build" / "good" / "summary.txt").is_file()
    table = out[out.index("summary: 1 of 3 model targets PASS") :].splitlines()
    rows = {line.split()[0]: line.split() for line in table[3:6]}
    assert rows["good"][1:4] == ["-", "PASS", "1.000000"]
    assert rows["bad"][1:4] == ["-", "FAIL", "transform"]
    assert rows["broken"][1:4] == ["-", "FAIL", "manifest"]
    progress = [line for line in out.splitlines() if line.startswith("progress [")]
    assert any("failed (" in line for line in progress), progress
    assert any("running: good" in line or "running: bad" in line for line in progress), progress
    assert out.rstrip().splitlines()[-1].endswith("2 failed, 4 not run (a dependency failed)")
    assert "Dependent task" not in out  # blocked tasks are counted, not each reported
