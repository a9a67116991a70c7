"""Cluster builds (tpubuild/build/cluster.py) with real parts: distributed.LocalCluster with process workers (two at
most, one thread each, each in its own folder), and S3 served on 127.0.0.1 by moto's server mode through s3fs.

A demo_cnn manifest with one INT8 target (every kind of stage, calibration included) is built once locally; the
cluster builds must give the same bytes, whatever happens to a worker on the way.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

distributed = pytest.importorskip("distributed")
pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

REPO = Path(__file__).resolve().parents[1]
# files of a build folder that are not artifacts: doit's DB, the no-op stamp, caches of the summary table
NOT_ARTIFACTS = {".doit.db", ".noop.json", ".manifests.json", ".zoo_table.json"}
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("manifests")
    path = folder / "demo_cnn.yaml"
    path.write_text(
        textwrap.dedent(f"""\
        name: demo_cnn
        source: {REPO / "models" / "demo_cnn.onnx"}
        inputs:
          - name: input
            shape: [1, 3, 32, 32]
            dtype: float32
            range: [-1.0, 1.0]
            preprocess:
              mean: [123.675, 116.28, 103.53]
              scale: [0.0171, 0.0175, 0.0174]
              pixel_format: rgb
              resize: [32, 32]
        calibration: {{data: "{REPO / "models" / "calib" / "photos" / "*.jpg"}", count: 8, method: kl}}
        targets:
          - {{chip: bm1684x, mode: INT8}}
        """),
        encoding="utf-8",
    )
    return path


def compile_cmd(manifest: Path, build: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tpubuild.cli", "compile", str(manifest), "--build-dir", str(build), *extra]


def run(cmd: list[str], timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **env}, cwd=REPO)


def artifacts(build: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(build)): p.read_bytes()
        for p in sorted(build.rglob("*"))
        if p.is_file() and p.name not in NOT_ARTIFACTS
    }


def summary(out: str) -> list[str]:
    """The verification summary and the zoo table of a build's output (no times, no paths)."""
    keep = ("level", "top ", "tpu ", "chip ", "demo_cnn ", "summary:")
    return [line for line in out.splitlines() if line.startswith(keep)]


@pytest.fixture(scope="module")
def local_build(manifest, tmp_path_factory) -> tuple[dict[str, bytes], list[str]]:
    build = tmp_path_factory.mktemp("local") / "build"
    proc = run(compile_cmd(manifest, build, "-j", "2"), TPUBUILD_ARTIFACT_CACHE="off")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return artifacts(build), summary(proc.stdout)


@pytest.fixture(scope="module")
def s3(tmp_path_factory) -> Iterator[str]:
    """moto's S3 on 127.0.0.1 (a real HTTP endpoint) with a bucket; AWS_* set for the workers and the client."""
    import boto3

    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in [*S3_ENV, "AWS_ENDPOINT_URL"]}
    os.environ.update({**S3_ENV, "AWS_ENDPOINT_URL": endpoint})
    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="tpubuild")
        yield "s3://tpubuild/artifacts"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def local_cluster(folder: Path, workers: int = 2, **env: str):
    """A LocalCluster of process workers, one thread each, in ``folder`` (each worker has its own folder in it);
    ``env`` is set while the workers start, so they inherit it."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return distributed.LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            local_directory=str(folder),
            host="127.0.0.1",
        )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_s3_cache_store_restore_and_corrupt_entry(s3, tmp_path):
    """UrlCache against moto's S3: an entry stored is found and restored byte for byte; a member whose bytes no
    longer match is reported, dropped, and a miss."""
    from tpubuild.build.urlcache import UrlCache

    cache = UrlCache(s3 + "/unit")
    a, b = tmp_path / "a.bin", tmp_path / "b.txt"
    a.write_bytes(os.urandom(3000))
    b.write_text("hello", encoding="utf-8")
    key = "ab" + "0" * 62
    assert cache.lookup(key) is None
    assert cache.store(key, "stage:m", [str(a), str(b)], "printed\n")
    assert not cache.store(key, "stage:m", [str(a), str(b)], "printed\n")  # there already
    entry = cache.lookup(key)
    assert entry is not None and entry.meta["stdout"] == "printed\n"
    out = [tmp_path / "out" / "a.bin", tmp_path / "out" / "b.txt"]
    assert cache.restore(entry, [str(p) for p in out])
    assert out[0].read_bytes() == a.read_bytes() and out[1].read_text(encoding="utf-8") == "hello"
    cache.fs.pipe_file(f"{cache.entry_dir(key)}/1", b"tampered")
    assert not cache.restore(cache.lookup(key), [str(p) for p in out])
    assert cache.lookup(key) is None  # dropped
    assert not out[0].exists() and not out[1].exists()  # all or nothing


@pytest.mark.parametrize("where", ["s3", "file"])
def test_url_cache_stats_and_prune(where, s3, tmp_path, monkeypatch, capsys):
    """`tpubuild cache stats` and `prune` on a cache at a URL: entries by stage and the cluster builds' blobs;
    prune removes the least recently used (blobs too) down to the size asked, an entry's meta.json first."""
    from tpubuild.build.urlcache import UrlCache
    from tpubuild.cli import main as cli_main

    url = f"{s3}/stats" if where == "s3" else f"file://{tmp_path / 'cache'}"
    cache = UrlCache(url)
    files = []
    for i, size in enumerate((1000, 2000, 3000)):
        f = tmp_path / f"t{i}.bin"
        f.write_bytes(bytes([i]) * size)
        files.append(f)
        assert cache.store(f"{i:02d}" + "a" * 62, f"stage{i % 2}:m{i}", [str(f)], "")
        time.sleep(1.1 if where == "s3" else 0.05)  # (S3 keeps modification times in seconds)
    source = tmp_path / "source.onnx"  # a source a cluster build's client uploaded
    source.write_bytes(b"onnx" * 1000)
    cache.put_blob(source)
    monkeypatch.setenv("TPUBUILD_ARTIFACT_CACHE", url)
    assert cli_main(["cache", "stats"]) == 0
    out = capsys.readouterr().out
    assert f"artifact cache {url}: 3 entries, 5.9 KB (no size limit)" in out
    assert "stage0" in out and "stage1" in out and "and 4 blobs" in out
    source_bytes = 4000
    # on a local file system a stored target's blob is a hard link of its entry's member: counted once
    stored = 6000 + source_bytes + (0 if where == "file" else 6000)
    assert cache.listing() and sum(i.bytes for i in cache.listing()) == 12000 + source_bytes
    assert cli_main(["cache", "prune", "--max-bytes", str(stored - 2500)]) == 0
    assert "removed " in capsys.readouterr().out
    from tpubuild.build.urlcache import _disk_bytes

    assert _disk_bytes(cache.listing()) <= stored - 2500
    assert cache.lookup("00" + "a" * 62) is None  # the least recently used entry went, whole
    newest = cache.lookup("02" + "a" * 62)
    assert newest is not None and cache.restore(newest, [str(tmp_path / "back.bin")])
    assert cli_main(["cache", "prune", "--older-than", "0"]) == 0
    assert "0 entries" in capsys.readouterr().out and cache.listing() == []


def test_cluster_build_on_s3_gives_the_local_bytes(manifest, local_build, s3, tmp_path):
    """Two process workers, the cache on S3: every artifact byte-identical to the local build, the same summary;
    a second cluster build into an empty folder restores everything from S3."""
    local, local_summary = local_build
    with local_cluster(tmp_path / "workers") as cluster:
        build = tmp_path / "build"
        proc = run(compile_cmd(manifest, build, "--scheduler", cluster.scheduler_address, "--cache", s3))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert artifacts(build) == local
        assert summary(proc.stdout) == local_summary
        assert "15 ran (0 restored from the artifact cache)" in proc.stdout
        again = run(compile_cmd(manifest, tmp_path / "again", "--scheduler", cluster.scheduler_address, "--cache", s3))
        assert again.returncode == 0, again.stdout + again.stderr
        assert "15 ran (15 restored from the artifact cache)" in again.stdout
        assert artifacts(tmp_path / "again") == local
        # each worker worked in its own folder (removed with the cluster), and left no stage's file behind: besides
        # its copies of files by sha256, its scratch folders (kept for the next stage) hold folders only
        folders = sorted(p for p in (tmp_path / "workers").glob("**/worker-*/tpubuild") if p.is_dir())
        assert len(folders) == 2
        for f in folders:
            assert (f / "blobs").is_dir()
            assert not [q for q in f.rglob("*") if not q.is_dir() and q.relative_to(f).parts[0] != "blobs"]


def _processing(client, prefix: str) -> str | None:
    """The address of the worker running the Dask task whose key starts with ``prefix``."""
    for address, keys in client.processing().items():
        if any(str(k).startswith(prefix) for k in keys):
            return address
    return None


def _wait_for(what, timeout: float = 120.0, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the build ended first:\n{out}\n{err}")
        time.sleep(0.2)
    pytest.fail("timed out")


def test_worker_killed_mid_stage_still_gives_the_local_bytes(manifest, local_build, tmp_path):
    """The worker running lower has made its outputs but stored none when it is killed (SIGKILL, by pid): Dask runs
    the stage again on a worker, the build ends with the local bytes, and the cache holds no partial entry."""
    cache = tmp_path / "cache"
    stage = "lower:demo_cnn/bm1684x-INT8"
    delay = {"TPUBUILD_DEBUG_DELAY": f"store:{stage}=4"}
    with local_cluster(tmp_path / "workers", **delay) as cluster, distributed.Client(cluster) as client:
        build = tmp_path / "build"
        cmd = compile_cmd(manifest, build, "--scheduler", cluster.scheduler_address, "--cache", f"file://{cache}")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        try:
            address = _wait_for(lambda: _processing(client, stage), proc=proc)
            time.sleep(1.0)  # in the delay after the stage ran, before the store
            pid = client.run(os.getpid, workers=[address])[address]
            os.kill(pid, signal.SIGKILL)
            out, err = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, out + err
    assert artifacts(build) == local_build[0]
    for meta in cache.glob("??/*/meta.json"):  # every entry complete
        members = len(json.loads(meta.read_text(encoding="utf-8"))["files"])
        assert sorted(p.name for p in meta.parent.iterdir()) == sorted(["meta.json", *map(str, range(members))])
    assert not [p for p in cache.glob("??/*") if not (p / "meta.json").exists()]


def _mapped_and_gc() -> tuple[tuple[int, int], tuple[int, ...]]:
    """Bytes glibc's malloc mapped afresh for two numpy arrays of 4 MiB made one after the other, and the GC
    thresholds. Mapped bytes rather than page faults: where transparent huge pages are always on, a fresh mapping
    faults in a few huge pages and its cost no longer shows in the fault count."""
    import ctypes
    import ctypes.util
    import gc

    import numpy as np

    class Mallinfo2(ctypes.Structure):  # glibc's malloc.h, all size_t
        names = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
        _fields_ = [(name, ctypes.c_size_t) for name in (*names, "keepcost")]

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallinfo2.restype = Mallinfo2

    def mapped() -> int:
        before = libc.mallinfo2().hblkhd
        block = np.ones(1 << 20, np.float32)
        grown = libc.mallinfo2().hblkhd - before
        del block  # freed before the next: a heap block would be reused, a mapped one is unmapped
        return grown

    return (mapped(), mapped()), gc.get_threshold()


def test_a_worker_runs_stages_with_the_local_processes_malloc_and_gc(tmp_path):
    """Dask's nanny starts workers with MALLOC_TRIM_THRESHOLD_ set, which pins glibc's mmap threshold at 128 KiB:
    every numpy temporary of 4 MiB is mapped, zero-filled and unmapped anew, the second as the first. Before its
    first stage a worker takes back the malloc and GC settings of a local build's stage processes, after which
    such a block comes from the heap and a freed one is reused."""
    from tpubuild.build import cluster as cluster_module

    with local_cluster(tmp_path / "workers", workers=1) as cluster, distributed.Client(cluster) as client:
        (dask_set,) = client.run(_mapped_and_gc).values()
        client.run(cluster_module._as_a_local_stage_process)
        (ours,) = client.run(_mapped_and_gc).values()
    assert min(dask_set[0]) >= 4 << 20 and dask_set[1] != (10_000, 10, 10)
    assert ours[0] == (0, 0) and ours[1] == (10_000, 10, 10)


def test_worker_of_another_compiler_version_is_refused(manifest, tmp_path):
    """A `dask worker` running an edited copy of tpubuild refuses the stage; the error names both versions."""
    from tpubuild.build.version import compiler_version
    from tpubuild.testing import snapshot_code

    code = snapshot_code(tmp_path / "code")
    with open(code / "tpubuild" / "errors.py", "a", encoding="utf-8") as f:
        f.write("\n# an edit: another compiler\n")
    env = {**os.environ, "PYTHONPATH": str(code)}
    theirs = subprocess.run(
        [sys.executable, "-c", "from tpubuild.build.version import compiler_version as v; print(v())"],
        env=env,
        cwd=tmp_path,  # not the checkout: python -c puts the current folder first on the path
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert theirs != compiler_version()
    with local_cluster(tmp_path / "workers", workers=0) as cluster:
        worker = subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_worker", cluster.scheduler_address, "--nthreads", "1"]
            + ["--no-dashboard", "--local-directory", str(tmp_path / "other")],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            with distributed.Client(cluster) as client:
                client.wait_for_workers(1, timeout=60)
            proc = run(
                compile_cmd(manifest, tmp_path / "build", "--scheduler", cluster.scheduler_address)
                + ["--cache", str(tmp_path / "cache")]
            )
        finally:
            worker.terminate()
            worker.wait(30)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert f"its tpubuild is {theirs}, the client's is {compiler_version()}" in text
    assert "transform:demo_cnn: refused by the Dask worker" in text


def test_unreachable_scheduler_fails_fast_without_a_traceback(manifest, tmp_path):
    """Nothing listens at the address: one error naming it and what to do, quickly, for tpubuild and doit alike."""
    address = f"tcp://127.0.0.1:{_free_port()}"
    start = time.monotonic()
    proc = run(
        compile_cmd(manifest, tmp_path / "build", "--scheduler", address, "--cache", str(tmp_path / "cache")),
        TPUBUILD_SCHEDULER_TIMEOUT="3",
    )
    assert time.monotonic() - start < 30
    assert proc.returncode != 0
    assert f"tpubuild: error: cannot reach the Dask scheduler at {address}" in proc.stderr
    assert "dask scheduler" in proc.stderr and "Traceback" not in proc.stdout + proc.stderr
    doit = run(
        [sys.executable, "-m", "doit", "-f", str(REPO / "dodo.py"), "compile"],
        TPUBUILD_SCHEDULER=address,
        TPUBUILD_SCHEDULER_TIMEOUT="3",
        TPUBUILD_MANIFESTS=str(manifest),
        TPUBUILD_BUILD_DIR=str(tmp_path / "build"),
        TPUBUILD_ARTIFACT_CACHE=str(tmp_path / "cache"),
    )
    assert doit.returncode != 0
    assert f"cannot reach the Dask scheduler at {address}" in doit.stderr and "Traceback" not in doit.stderr


def test_scheduler_gone_stops_the_build_with_one_error_and_keeps_finished_tasks(manifest, tmp_path):
    """The scheduler closes while a stage runs: one clear error, no traceback, and doit's DB has every task that
    finished before (the next run resumes from there)."""
    stage = "verify_tpu:demo_cnn/bm1684x-INT8"
    build = tmp_path / "build"
    cluster = local_cluster(tmp_path / "workers", TPUBUILD_DEBUG_DELAY=f"{stage}=30")
    try:
        with distributed.Client(cluster) as client:
            cmd = compile_cmd(manifest, build, "--scheduler", cluster.scheduler_address)
            proc = subprocess.Popen(
                cmd + ["--cache", str(tmp_path / "cache")],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=REPO,
                env={**os.environ, "TPUBUILD_SCHEDULER_TIMEOUT": "3"},
            )
            _wait_for(lambda: _processing(client, stage), proc=proc)
    finally:
        cluster.close()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert err.count("tpubuild: error: lost the Dask scheduler") == 1, out + err
    assert "Traceback" not in out + err
    with sqlite3.connect(build / ".doit.db") as db:
        done = {row[0] for row in db.execute("SELECT task_id FROM doit")}
    assert {"transform:demo_cnn", "canonicalize:demo_cnn", "lower:demo_cnn/bm1684x-INT8"} <= done
    assert stage not in done


def test_loading_the_graph_imports_no_dask(tmp_path, manifest):
    """dodo.py runs on every doit call: neither it nor a scheduler named in the environment imports dask,
    distributed, fsspec or s3fs before a build starts."""
    code = textwrap.dedent(f"""
        import runpy, sys
        sys.argv = ["doit", "list"]
        runpy.run_path({str(REPO / "dodo.py")!r})
        print(sorted(m for m in ("dask", "distributed", "fsspec", "s3fs", "numpy") if m in sys.modules))
    """)
    for scheduler in ("", "tcp://127.0.0.1:1"):
        env = {
            **os.environ,
            "TPUBUILD_MANIFESTS": str(manifest),
            "TPUBUILD_BUILD_DIR": str(tmp_path / "build"),
            "TPUBUILD_SCHEDULER": scheduler,
        }
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr


def test_files_named_in_options_travel_with_the_inputs(tmp_path):
    """A float target's lower reads the user's quantize table through its options only (its config holds the
    digest): the client ships every existing file the options name, once, besides the inputs and targets."""
    from tpubuild.build.cluster import _named_files

    table, mlir = tmp_path / "user.qtable", tmp_path / "canonical.mlir"
    table.write_text("x F32\n", encoding="utf-8")
    mlir.write_text("", encoding="utf-8")
    options = {
        "in_mlir": str(mlir),
        "quantize_table": str(table),
        "tables": [str(table)],
        "search_dir": str(tmp_path),
        "out_mlir": str(tmp_path / "tpu.mlir"),
        "mode": "F32",
    }
    assert _named_files(options, {str(mlir), str(tmp_path / "tpu.mlir")}) == [str(table)]


def test_scratch_paths_keep_the_build_folder_s_places_and_come_back(tmp_path):
    """A worker's scratch folder stands for the stage's deepest build folder; files outside the build folder sit at
    their full path below .outside; text with scratch paths in it gets the client's paths back."""
    from tpubuild.build.cluster import Session, _Mirror

    session = Session.__new__(Session)  # only root_of: no client, no cache
    session.build = "/home/me/zoo/build"
    request = {
        "targets": ["/home/me/zoo/build/m/bm1684x-INT8/tpu.mlir"],
        "clears": [],
        "inputs": [{"path": "/home/me/zoo/build/m/cali.mlir"}, {"path": "/home/me/zoo/models/user.qtable"}],
        "kwargs": {"in_mlir": "/home/me/zoo/build/m/cali.mlir", "mode": "INT8", "out": "/home/me/zoo/build/m/x"},
    }
    root = session.root_of(request)
    assert root == "/home/me/zoo/build/m"
    here = _Mirror(tmp_path / "s", root)
    assert here.path("/home/me/zoo/build/m/bm1684x-INT8/tpu.mlir") == f"{tmp_path}/s/bm1684x-INT8/tpu.mlir"
    assert here.path("/home/me/zoo/build/m") == f"{tmp_path}/s"
    assert here.path("/home/me/zoo/models/user.qtable") == f"{tmp_path}/s/.outside/home/me/zoo/models/user.qtable"
    assert here.map({"a": ["/home/me/zoo/build/m/cali.mlir", "rel", 3]}) == {"a": [f"{tmp_path}/s/cali.mlir", "rel", 3]}
    text = f"{tmp_path}/s/cali.mlir: bad, see {tmp_path}/s/.outside/home/me/zoo/models/user.qtable"
    assert here.back(text) == "/home/me/zoo/build/m/cali.mlir: bad, see /home/me/zoo/models/user.qtable"


def test_scratch_folder_is_emptied_of_files_and_reused(tmp_path, monkeypatch):
    """A stage's scratch folder comes back empty of files for the next stage (its folders kept); one holding more
    folders than SCRATCH_FOLDERS is removed whole."""
    from tpubuild.build import cluster

    monkeypatch.setattr(cluster, "_scratch_root", lambda: tmp_path)
    monkeypatch.setattr(cluster, "_FREE", {})
    with cluster._scratch() as first:
        (first / "a" / "b").mkdir(parents=True)
        (first / "a" / "b" / "t.mlir").write_text("x", encoding="utf-8")
        (first / "top.npz").write_text("y", encoding="utf-8")
    with cluster._scratch() as second:
        assert second == first
        assert not [p for p in second.rglob("*") if not p.is_dir()] and (second / "a" / "b").is_dir()
        for i in range(cluster.SCRATCH_FOLDERS + 1):
            (second / f"d{i}").mkdir()
    assert not second.exists()
    with cluster._scratch() as third:
        assert third != second
