"""The artifact cache: keys, restore instead of recompute, corrupt entries, pruning, the CLI, and
a second build tree rebuilt from cache by doit without calling any stage function."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from tpubuild.build import cache as cache_mod
from tpubuild.build.cache import ArtifactCache, cache_root, run_cached, stage_key
from tpubuild.cli import main as cli_main
from tpubuild.testing import run_doit, save_onnx, snapshot_code


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("TPUBUILD_ARTIFACT_CACHE", str(root))
    return root


def write_stage(calls: list, inp: str, out_a: str, out_b: str, scale: int = 2) -> None:
    """A toy stage: two outputs computed from one input; records each call."""
    calls.append(out_a)
    data = Path(inp).read_bytes()
    Path(out_a).write_bytes(data * scale)
    Path(out_b).write_text(f"{len(data)} bytes\n")
    print(f"built {Path(out_a).name}")


def toy(tmp: Path, calls: list, content: bytes = b"weights", scale: int = 2):
    """(kwargs, spec) of a toy stage reading tmp/in.bin and writing tmp/out/{a,b}."""
    (tmp / "out").mkdir(parents=True, exist_ok=True)
    inp = tmp / "in.bin"
    inp.write_bytes(content)
    kwargs = {
        "calls": calls,
        "inp": str(inp),
        "out_a": str(tmp / "out" / "a"),
        "out_b": str(tmp / "out" / "b"),
        "scale": scale,
    }
    spec = {"inputs": [str(inp)], "targets": [kwargs["out_a"], kwargs["out_b"]], "config": {"scale": scale}}
    return kwargs, spec


def run_toy(tmp: Path, calls: list, **kw) -> str:
    kwargs, spec = toy(tmp, calls, **kw)
    # the list of calls is not an option of the stage: keep it out of the key
    func = lambda **k: write_stage(calls, **k)  # noqa: E731  (the stage function under test, named for the cache key)
    return run_cached("toy:m", func, {k: v for k, v in kwargs.items() if k != "calls"}, spec)


def outputs(tmp: Path) -> tuple[bytes, bytes]:
    return (tmp / "out" / "a").read_bytes(), (tmp / "out" / "b").read_bytes()


# -- keys -------------------------------------------------------------------------------------------


def test_key_depends_on_content_config_options_task_and_compiler_but_not_folders(tmp_path):
    def key(folder: Path, content=b"x", config=None, options=None, task="s:m", compiler="1"):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "in").write_bytes(content)
        opts = {"in": str(folder / "in"), "out": str(folder / "out"), "model": "m", **(options or {})}
        return stage_key(task, compiler, config or {"tol": 0.9}, opts, [str(folder / "in")], [str(folder / "out")])

    base = key(tmp_path / "a")
    assert key(tmp_path / "b" / "deeper") == base  # another build tree, same content
    assert key(tmp_path / "c", content=b"y") != base
    assert key(tmp_path / "d", config={"tol": 0.99}) != base
    assert key(tmp_path / "e", options={"model": "other"}) != base
    assert key(tmp_path / "f", task="s:other") != base
    assert key(tmp_path / "g", compiler="2") != base


def test_key_of_a_path_outside_inputs_is_its_content(tmp_path):
    table = tmp_path / "qtable"
    table.write_text("conv1 F32\n")
    k1 = stage_key("s:m", "1", {}, {"qtable": str(table)}, [], [str(tmp_path / "o")])
    table.write_text("conv1 BF16\n")
    k2 = stage_key("s:m", "1", {}, {"qtable": str(table)}, [], [str(tmp_path / "o")])
    assert k1 != k2


# -- restore instead of recompute -------------------------------------------------------------------


def test_second_tree_is_restored_without_running_the_stage(tmp_path, cache_dir, capsys):
    calls: list = []
    assert run_toy(tmp_path / "one", calls) == "miss"
    assert len(calls) == 1
    assert capsys.readouterr().out == "built a\n"
    assert run_toy(tmp_path / "two", calls) == "hit"
    assert len(calls) == 1, "the stage ran again"
    assert outputs(tmp_path / "two") == outputs(tmp_path / "one") == (b"weights" * 2, b"7 bytes\n")
    assert capsys.readouterr().out == "built a\n"  # its console output is replayed
    assert ArtifactCache(cache_dir).events() == {"miss": 1, "store": 1, "hit": 1}


def test_changed_option_or_input_misses(tmp_path, cache_dir):
    calls: list = []
    run_toy(tmp_path / "one", calls)
    assert run_toy(tmp_path / "two", calls, scale=3) == "miss"
    assert outputs(tmp_path / "two")[0] == b"weights" * 3
    assert run_toy(tmp_path / "three", calls, content=b"other") == "miss"
    assert outputs(tmp_path / "three")[0] == b"other" * 2
    assert len(calls) == 3


def test_restored_file_is_replaced_not_edited_by_the_next_write(tmp_path, cache_dir):
    """Restores may be hard links to the entry: a stage publishing over one must not touch the entry."""
    calls: list = []
    run_toy(tmp_path / "one", calls)
    run_toy(tmp_path / "two", calls)
    from tpubuild.build.files import write_bytes

    write_bytes(tmp_path / "two" / "out" / "a", b"new")
    assert run_toy(tmp_path / "three", calls) == "hit"
    assert outputs(tmp_path / "three")[0] == b"weights" * 2


def test_restore_clears_what_a_successful_run_removes(tmp_path, cache_dir):
    """A verify stage that passes deletes the failure it kept for the reports; a restore does too."""
    calls: list = []
    run_toy(tmp_path / "one", calls)
    kwargs, spec = toy(tmp_path / "two", calls)
    stale = tmp_path / "two" / "out" / "verify.failed.json"
    stale.write_text("{}")
    func = lambda **k: write_stage(calls, **k)  # noqa: E731  (the stage function under test, named for the cache key)
    how = run_cached("toy:m", func, {k: v for k, v in kwargs.items() if k != "calls"}, {**spec, "clears": [str(stale)]})
    assert how == "hit" and not stale.exists()


def test_failing_stage_stores_nothing(tmp_path, cache_dir):
    def fail(**_):
        raise RuntimeError("boom")

    kwargs, spec = toy(tmp_path, [])
    with pytest.raises(RuntimeError):
        run_cached("toy:m", fail, {}, spec)
    assert list(ArtifactCache(cache_dir).entries()) == []


def test_corrupt_entry_is_ignored_removed_and_rebuilt(tmp_path, cache_dir, capsys):
    calls: list = []
    run_toy(tmp_path / "one", calls)
    cache = ArtifactCache(cache_dir)
    (entry,) = cache.entries()
    member = entry.path / "0"
    os.chmod(member, 0o644)
    member.write_bytes(b"weightz" * 2)  # same size, other bytes: only the digest tells
    assert run_toy(tmp_path / "two", calls) == "miss"
    assert len(calls) == 2
    assert outputs(tmp_path / "two")[0] == b"weights" * 2
    assert "corrupt entry" in capsys.readouterr().err
    assert cache.events()["corrupt"] == 1
    assert run_toy(tmp_path / "three", calls) == "hit"  # stored afresh
    assert len(calls) == 2


@pytest.mark.parametrize("damage", ["meta", "missing"])
def test_unreadable_or_incomplete_entry_is_a_miss(tmp_path, cache_dir, damage):
    calls: list = []
    run_toy(tmp_path / "one", calls)
    (entry,) = ArtifactCache(cache_dir).entries()
    if damage == "meta":
        (entry.path / "meta.json").write_text("{not json")
    else:
        (entry.path / "1").unlink()
    assert run_toy(tmp_path / "two", calls) == "miss"
    assert outputs(tmp_path / "two") == outputs(tmp_path / "one")


def test_off_disables(tmp_path, monkeypatch):
    monkeypatch.delenv("TPUBUILD_ARTIFACT_CACHE", raising=False)
    monkeypatch.setenv("TPUBUILD_CACHE", "off")
    assert cache_root() is None
    calls: list = []
    assert run_toy(tmp_path / "one", calls) == "off"
    assert run_toy(tmp_path / "two", calls) == "off"
    assert len(calls) == 2
    monkeypatch.setenv("TPUBUILD_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c" / "artifacts"
    from tpubuild.build.fetch import cache_dir

    monkeypatch.setenv("TPUBUILD_CACHE", "off")
    assert cache_dir() == Path.home() / ".cache" / "tpubuild"  # wheels still have a home


def _race(args) -> tuple[str, bytes]:
    tmp, root = args
    os.environ["TPUBUILD_ARTIFACT_CACHE"] = root
    calls: list = []
    how = run_toy(Path(tmp), calls)
    return how, (Path(tmp) / "out" / "a").read_bytes()


def test_concurrent_processes_agree(tmp_path, cache_dir):
    jobs = [(str(tmp_path / f"t{i}"), str(cache_dir)) for i in range(4)]
    with multiprocessing.get_context("fork").Pool(4) as pool:
        results = pool.map(_race, jobs)
    assert all(out == b"weights" * 2 for _, out in results)
    cache = ArtifactCache(cache_dir)
    (entry,) = cache.entries()  # one entry, intact
    assert cache.lookup(entry.key) is not None
    assert cache.events().get("store") == 1
    leftovers = list((cache_dir / "tmp").iterdir()) if (cache_dir / "tmp").exists() else []
    assert leftovers == []


# -- prune, stats, CLI ------------------------------------------------------------------------------


def _three_entries(tmp_path: Path) -> list:
    calls: list = []
    for i, content in enumerate([b"a" * 100, b"b" * 200, b"c" * 300]):
        run_toy(tmp_path / f"t{i}", calls, content=content)
    entries = sorted(ArtifactCache(cache_root()).entries(), key=lambda e: e.bytes)
    now = time.time()
    for age_days, entry in zip([10, 5, 0], entries, strict=True):  # the smallest was used longest ago
        t = now - age_days * 86400
        os.utime(entry.path / "meta.json", (t, t))
    return entries


def test_prune_older_than_and_max_bytes(tmp_path, cache_dir):
    entries = _three_entries(tmp_path)
    cache = ArtifactCache(cache_dir)
    assert cache.prune(older_than_days=7) == (1, entries[0].bytes)
    assert {e.key for e in cache.entries()} == {entries[1].key, entries[2].key}
    assert cache.prune(max_bytes=entries[2].bytes) == (1, entries[1].bytes)  # least recently used goes first
    assert [e.key for e in cache.entries()] == [entries[2].key]


def test_restore_counts_as_use_for_pruning(tmp_path, cache_dir):
    entries = _three_entries(tmp_path)
    calls: list = []
    assert run_toy(tmp_path / "again", calls, content=b"a" * 100) == "hit"  # the oldest, used now
    ArtifactCache(cache_dir).prune(older_than_days=7)
    assert entries[0].key in {e.key for e in ArtifactCache(cache_dir).entries()}


def test_cli_stats_and_prune(tmp_path, cache_dir, capsys):
    entries = _three_entries(tmp_path)
    assert cli_main(["cache", "stats"]) == 0
    out = capsys.readouterr().out
    total = sum(e.bytes for e in entries)
    assert f"{cache_dir}: 3 entries, {cache_mod.format_bytes(total)}" in out
    assert "toy" in out and "3 misses" in out
    assert cli_main(["cache", "prune", "--older-than", "7"]) == 0
    assert "removed 1 entries" in capsys.readouterr().out
    assert cli_main(["cache", "prune", "--max-bytes", "0"]) == 0
    assert "removed 2 entries" in capsys.readouterr().out
    assert list(ArtifactCache(cache_dir).entries()) == []
    assert cli_main(["cache", "prune"]) == 2  # nothing to prune by
    capsys.readouterr()
    assert cli_main(["cache", "prune", "--max-bytes", "1.5K"]) == 0


def test_size_limit_evicts_least_recently_used_per_group(tmp_path, cache_dir, monkeypatch):
    """With TPUBUILD_CACHE_MAX_SIZE, a store trims its key's group (first hex digit) to its 1/16 share."""
    calls: list = []
    for i in range(49):  # 49 entries in 16 groups: some group holds at least 4
        run_toy(tmp_path / f"u{i}", calls, content=b"%04d" % i * 250)
    cache = ArtifactCache(cache_dir)
    everything = sorted(cache.entries(), key=lambda e: e.meta["created"])
    assert len(everything) == 49  # the default limit (10G) evicts nothing here
    size = everything[0].bytes
    limit = 16 * 3 * size  # a share of three entries, trimmed down to 2.4: two stay

    by_group: dict[str, list] = {}
    for e in everything:
        by_group.setdefault(e.key[0], []).append(e)
    group = max(by_group.values(), key=len)
    protected = group[0]  # the least recently used, but the one "just stored": it stays
    assert cache.trim_group(protected.key, limit) == len(group) - 2
    kept = {e.key for e in cache.entries() if e.key[0] == protected.key[0]}
    assert kept == {protected.key, group[-1].key}  # and the most recently used other one
    assert cache.events().get("evict") == len(group) - 2
    assert {e.key for e in cache.entries() if e.key[0] != protected.key[0]} == {
        e.key for e in everything if e.key[0] != protected.key[0]
    }  # other groups untouched
    assert cache.trim_group(protected.key, 0) == 0  # 0: no limit

    monkeypatch.setenv("TPUBUILD_CACHE_MAX_SIZE", str(limit))  # a store trims its own group
    run_toy(tmp_path / "last", calls, content=b"last" * 250)
    newest = max(cache.entries(), key=lambda e: e.meta["created"])
    assert sum(e.bytes for e in cache.entries() if e.key[0] == newest.key[0]) <= limit / 16


# -- under doit ------------------------------------------------------------------------------------

MANIFEST = """\
name: {name}
source: tiny.onnx
inputs:
  - name: x
    shape: [2, 4]
    range: [-1, 1]
tolerance:
  top: {{cos: {cos}, euc: 0.999}}
"""

# Loaded at start-up (PYTHONPATH) in the second build: any stage function that runs fails the build.
TRAP = """\
import inspect
import tpubuild.build.stages as stages

def _trap(*args, **kwargs):
    raise RuntimeError("a stage function ran")

for _name, _func in list(vars(stages).items()):
    if inspect.isfunction(_func) and _func.__module__ == stages.__name__ and not _name.startswith("_"):
        setattr(stages, _name, _trap)
"""


def tiny_onnx(path: Path) -> None:
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"], name="mm"),
        helper.make_node("Relu", ["mm"], ["y"], name="act"),
    ]
    save_onnx(
        path,
        nodes,
        {"x": ["N", 4]},
        {"y": ["N", 3]},
        {"w": np.random.default_rng(3).standard_normal((4, 3)).astype(np.float32)},
    )


def doit(
    code: Path, models: Path, build: Path, cache: Path, *, trap: Path | None = None
) -> subprocess.CompletedProcess:
    # the compiler version (in every key) digests the sources: run on a snapshot of them (snapshot_code)
    return run_doit(
        "compile",
        manifests=models,
        build=build,
        code=code,
        TPUBUILD_ARTIFACT_CACHE=str(cache),
        PYTHONPATH=os.pathsep.join([str(trap)] * bool(trap) + [str(code)]),
    )


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_fresh_build_tree_from_cache_runs_no_stage(tmp_path):
    models, cache = tmp_path / "models", tmp_path / "cache"
    models.mkdir()
    code = snapshot_code(tmp_path / "code")
    tiny_onnx(models / "tiny.onnx")
    (models / "a.yaml").write_text(MANIFEST.format(name="a", cos=0.99999))
    first = doit(code, models, tmp_path / "b1", cache)
    assert first.returncode == 0, first.stdout + first.stderr
    log = ArtifactCache(cache).events()
    assert log.get("miss") == log.get("store") == 5 and "hit" not in log  # transform ... compile

    trap = tmp_path / "trap"
    trap.mkdir()
    (trap / "sitecustomize.py").write_text(TRAP)
    second = doit(code, models, tmp_path / "b2", cache, trap=trap)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "a stage function ran" not in second.stdout + second.stderr
    assert ArtifactCache(cache).events().get("hit") == 5
    assert "5 restored from the artifact cache" in second.stdout
    assert "verification summary: a" in second.stdout  # compile's output, replayed
    assert tree(tmp_path / "b2" / "a") == tree(tmp_path / "b1" / "a")

    # the trap works: a changed option misses, so verify_top runs and fails
    (models / "a.yaml").write_text(MANIFEST.format(name="a", cos=0.9999))
    third = doit(code, models, tmp_path / "b2", cache, trap=trap)
    assert third.returncode != 0
    assert "a stage function ran" in third.stdout + third.stderr
    assert "FAIL verify_top" in third.stdout
    # without the trap it builds, and the first tree then restores the new verify_top from cache
    assert doit(code, models, tmp_path / "b2", cache).returncode == 0
    before = ArtifactCache(cache).events().get("hit")
    again = doit(code, models, tmp_path / "b1", cache, trap=trap)
    assert again.returncode == 0, again.stdout + again.stderr
    assert ArtifactCache(cache).events().get("hit") == before + 2  # verify_top and compile
    assert json.loads((tmp_path / "b1" / "a" / "verify_top.json").read_text()) == json.loads(
        (tmp_path / "b2" / "a" / "verify_top.json").read_text()
    )
