"""The no-op fast path (noop.py): a `doit compile` after a build that found nothing to do skips doit's
per-task checks, and anything doit would notice sends the next run through doit in full."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tpubuild.build.noop import selects_compile
from tpubuild.testing import run_doit, snapshot_code, tasks_marked

FAST = "without doit's per-task checks"
MANIFEST = (
    "name: {name}\nsource: tiny.onnx\ninputs:\n  - {{name: x, shape: [2, 4]}}\ntolerance:\n  top: {{cos: {cos}}}\n"
)


def test_selects_compile():
    for args in (
        [],
        ["compile"],
        ["run"],
        ["run", "compile"],
        ["-n", "2", "compile"],
        ["-n2", "--continue"],
        ["-f", "dodo.py", "compile"],
        ["--file=dodo.py", "-P", "thread", "compile"],
        ["run", "-n", "4", "compile"],
    ):
        assert selects_compile(args), args
    for args in (
        ["compile:a"],
        ["list"],
        ["-a", "compile"],
        ["-v", "2", "compile"],
        ["verify_top"],
        ["clean"],
        ["compile", "transform"],
        ["--always-execute"],
        ["-s", "compile"],
    ):
        assert not selects_compile(args), args


def tiny_onnx(path: Path) -> None:
    w = np.random.default_rng(9).standard_normal((4, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        initializer=[numpy_helper.from_array(w, "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)


class Zoo:
    def __init__(self, root: Path):
        self.models, self.build = root / "models", root / "build"
        self.code = snapshot_code(root / "code")
        self.models.mkdir()
        tiny_onnx(self.models / "tiny.onnx")
        for name in ("a", "b"):
            self.manifest(name)

    def manifest(self, name: str, cos: float = 0.99999) -> None:
        (self.models / f"{name}.yaml").write_text(MANIFEST.format(name=name, cos=cos))

    def doit(self, *args: str, **env: str) -> subprocess.CompletedProcess:
        # files younger than TPUBUILD_NOOP_SETTLE are never stamped: these tests change them just before
        return run_doit(
            *args, manifests=self.models, build=self.build, code=self.code, **{"TPUBUILD_NOOP_SETTLE": "0", **env}
        )


def lines(out: str, prefix: str) -> set[str]:
    return tasks_marked(out, prefix)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Zoo:
    """Built, then one no-op (doit's full check, which records the stamp)."""
    zoo = Zoo(tmp_path_factory.mktemp("noop"))
    assert zoo.doit("compile").returncode == 0
    first = zoo.doit("compile")
    assert first.returncode == 0 and FAST not in first.stdout and not lines(first.stdout, ".  ")
    return zoo


def fast_noop(zoo: Zoo, *args: str) -> str:
    run = zoo.doit(*args)
    assert run.returncode == 0, run.stdout + run.stderr
    assert FAST in run.stdout, run.stdout
    return run.stdout


def test_fast_noop_prints_what_doit_would(zoo):
    full = zoo.doit("compile", TPUBUILD_NOOP="off")
    assert FAST not in full.stdout
    fast = fast_noop(zoo, "compile")
    assert (
        lines(fast, "-- ")
        == lines(full.stdout, "-- ")
        == {
            f"{stage}:{m}"
            for m in "ab"
            for stage in ("transform", "reference", "canonicalize", "verify_top", "compile")
        }
    )
    assert fast_noop(zoo, "-n", "2")  # the default task, in parallel
    table = fast[fast.index("summary: 2 of 2 model targets PASS") :]
    assert table.splitlines()[:5] == full.stdout[full.stdout.index("summary:") :].splitlines()[:5]


def test_touched_source_checks_again(zoo):
    src = zoo.models / "tiny.onnx"
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    run = zoo.doit("compile")
    assert FAST not in run.stdout and not lines(run.stdout, ".  ")  # same content: doit finds nothing to do
    fast_noop(zoo, "compile")  # and that run stamped the new state


def test_forgotten_task_runs(zoo):
    assert zoo.doit("forget", "verify_top:a").returncode == 0
    run = zoo.doit("compile")
    assert "verify_top:a" in lines(run.stdout, ".  ")
    assert zoo.doit("compile").returncode == 0  # records the stamp again
    fast_noop(zoo, "compile")


def test_deleted_target_and_changed_manifest_run(zoo):
    (zoo.build / "b" / "top_outs.npz").unlink()
    run = zoo.doit("compile")
    assert "verify_top:b" in lines(run.stdout, ".  ")
    zoo.manifest("b", cos=0.9999)
    run = zoo.doit("compile")
    assert "verify_top:b" in lines(run.stdout, ".  ")
    zoo.manifest("b")
    assert zoo.doit("compile").returncode == 0
    assert zoo.doit("compile").returncode == 0
    fast_noop(zoo, "compile")


def test_other_commands_and_off_go_through_doit(zoo):
    fast_noop(zoo, "compile")
    for args in (["compile:a"], ["-v", "2", "compile"]):
        run = zoo.doit(*args)
        assert run.returncode == 0 and FAST not in run.stdout, args
    assert FAST not in zoo.doit("compile", TPUBUILD_NOOP="off").stdout
    listing = zoo.doit("list")
    assert listing.returncode == 0 and "compile" in listing.stdout


def test_no_stamp_while_files_are_fresh(tmp_path):
    """A file written within the file system's clock tick could change again unseen: no stamp then."""
    zoo = Zoo(tmp_path)
    assert zoo.doit("compile").returncode == 0
    assert zoo.doit("compile", TPUBUILD_NOOP_SETTLE="60").returncode == 0  # a full no-op check...
    assert not (zoo.build / ".noop.json").exists()  # ...that does not stamp files a minute old
    assert zoo.doit("compile").returncode == 0
    assert (zoo.build / ".noop.json").exists()


def test_no_stamp_after_a_failure(tmp_path):
    zoo = Zoo(tmp_path)
    (zoo.models / "broken.yaml").write_text("name: broken\n")
    for _ in range(3):
        run = zoo.doit("compile")
        assert run.returncode != 0 and FAST not in run.stdout
    assert not (zoo.build / ".noop.json").exists()
