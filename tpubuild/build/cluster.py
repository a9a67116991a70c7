"""Builds on a Dask cluster: doit plans on the client, each stage that must run goes to a Dask worker.

`tpubuild compile --scheduler ADDRESS` (or TPUBUILD_SCHEDULER=ADDRESS for `doit compile`) replaces doit's
runner with ``DaskRunner``. Everything doit does stays on the client: the up-to-date checks, the DB, the
progress line and the summary. What changes is where a stage's action runs (docs/distributed.md):

- the client computes the stage's cache key (cache.stage_key, the key a local build uses) and looks it up in
  the artifact cache, which is a URL both sides can reach (urlcache.py); a hit is restored as in a local build;
- on a miss it makes sure each input file is in the cache by its sha256 (files an earlier stage stored are,
  sources are uploaded once) and submits ``work`` with the content keys to Dask;
- the worker checks that its compiler version is the client's, downloads the inputs by content key into a
  scratch folder of its own (the build folder's paths in the same places relative to each other: _Mirror), runs
  the stage function there and stores the targets and its output under the key; nothing else travels (a stage's
  own error is the one answer the client fetches);
- the client restores the targets into its build tree from the cache, and doit records them as usual.

Nothing here imports dask or distributed at module level: doit_config (tasks.py) imports this module to
install the runner only when a scheduler is named, and the runner connects when the build starts.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import io
import logging
import multiprocessing
import os
import shutil
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from doit.exceptions import TaskError, TaskFailed
from doit.runner import ERROR, JobHold, MThreadRunner

from tpubuild.build.files import link_or_copy
from tpubuild.errors import TpuBuildError

VARIABLE = "TPUBUILD_SCHEDULER"
CONNECT_TIMEOUT = 10.0  # seconds: an unreachable scheduler fails the build this fast
# stages the client keeps submitted per worker thread of the cluster: with two, a small stage's round trip (submit,
# the worker's fetch and store, the answer, the restore) left the workers idle most of the time
IN_FLIGHT = 8


class SchedulerLost(Exception):
    """The connection to the Dask scheduler broke during the build."""


def scheduler_address() -> str | None:
    return os.environ.get(VARIABLE) or None


# -- the client ------------------------------------------------------------------------------


def connect_timeout() -> float:
    """Seconds to reach the scheduler: TPUBUILD_SCHEDULER_TIMEOUT, else CONNECT_TIMEOUT."""
    try:
        return float(os.environ.get("TPUBUILD_SCHEDULER_TIMEOUT") or CONNECT_TIMEOUT)
    except ValueError:
        return CONNECT_TIMEOUT


def connect(address: str, timeout: float | None = None):
    """A distributed.Client of the scheduler at ``address``; a TpuBuildError saying what to do if it is not there."""
    try:
        from distributed import Client
    except ImportError:
        raise TpuBuildError(
            f"a build on the scheduler {address} needs dask and distributed",
            hint="pip install 'tpubuild[cluster]'",
        ) from None
    # the build's own error says the scheduler went away; distributed's log line about it would be a second one
    logging.getLogger("distributed.client").setLevel(logging.CRITICAL)
    try:
        return Client(address, timeout=connect_timeout() if timeout is None else timeout, set_as_default=False)
    except (OSError, TimeoutError, ValueError) as err:
        raise TpuBuildError(
            f"cannot reach the Dask scheduler at {address} ({type(err).__name__}: {err})".replace("\n", " "),
            hint="start one with `dask scheduler` and workers with `dask worker ADDRESS --nthreads 1 --nworkers N`, "
            "then pass its tcp://host:8786 address (--scheduler or TPUBUILD_SCHEDULER)",
        ) from None


def shared_cache_url() -> str:
    """The artifact cache the workers share with the client: TPUBUILD_ARTIFACT_CACHE's URL or folder."""
    from tpubuild.build.cache import cache_root, cache_url

    url = cache_url()
    if url:
        return url
    root = cache_root()
    if root is None:
        raise TpuBuildError(
            "a cluster build moves every artifact through the artifact cache, which is off",
            hint="set TPUBUILD_ARTIFACT_CACHE to s3://bucket/prefix or a folder every worker mounts",
        )
    return str(root.resolve())


class Session:
    """The client's side of a cluster build: the Dask client, the cache, and where each file already is."""

    def __init__(self, client, cache_url: str, build: str | os.PathLike = "/"):
        from tpubuild.build.urlcache import UrlCache
        from tpubuild.build.version import compiler_version

        self.client = client
        self.build = os.path.abspath(build).rstrip("/")  # the build folder: its paths keep their places on a worker
        self.address = client.scheduler.address
        self.cache = UrlCache(cache_url)
        self.compiler = compiler_version()
        # path -> (mtime_ns, size, sha256, cache member or None): digests read once, members known to the cache
        self.files: dict[str, tuple[int, int, str, str | None]] = {}
        self.lock = threading.Lock()

    def threads(self) -> int:
        """The cluster's worker threads (at least 1)."""
        info = self.client.scheduler_info()
        return max(1, sum(w.get("nthreads", 1) for w in info.get("workers", {}).values()))

    def warm_up(self) -> None:
        """Each worker imports the stage modules now, while the first stages' inputs are made (as idle doit
        processes do, dispatch._serve): a module's first import in a process costs seconds."""
        from tpubuild.build.stages import import_stage_modules

        def run() -> None:
            with contextlib.suppress(Exception):  # only a speed-up
                self.client.run(import_stage_modules)

        threading.Thread(target=run, name="tpubuild-warm-up", daemon=True).start()

    def digest(self, path: str) -> str:
        from tpubuild.build.cache import file_digest

        st = os.stat(path)
        with self.lock:
            known = self.files.get(path)
        if known and known[:2] == (st.st_mtime_ns, st.st_size):
            return known[2]
        sha = file_digest(path)
        with self.lock:
            self.files[path] = (st.st_mtime_ns, st.st_size, sha, None)
        return sha

    def _restored(self, entry, targets: Sequence[str]) -> None:
        """Remember that ``targets`` are the members of cache ``entry`` (a later stage's inputs need no upload)."""
        for i, (target, f) in enumerate(zip(targets, entry.meta["files"], strict=True)):
            st = os.stat(target)
            member = f"{entry.key[:2]}/{entry.key}/{i}"
            with self.lock:
                self.files[target] = (st.st_mtime_ns, st.st_size, f["sha256"], member)

    def location(self, path: str) -> dict[str, str | None]:
        """The content key of input ``path`` and where the cache holds it, uploading it once if it does not."""
        sha = self.digest(path)
        with self.lock:
            member = self.files[path][3]
        if member is None:
            self.cache.put_blob(path, sha)
        return {"path": path, "sha256": sha, "member": member}

    def root_of(self, request: Mapping[str, Any]) -> str:
        """The deepest folder holding the request's paths in the build folder (its targets, inputs, the files it
        clears or its options name): where the worker's scratch folder stands for (``_Mirror``)."""
        paths = [*request["targets"], *request["clears"], *(item["path"] for item in request["inputs"])]
        paths += _absolute(request["kwargs"])
        return _common_folder([p for p in paths if p.startswith(self.build + "/")])

    def run(self, task_id: str, func, kwargs: dict[str, Any], spec: Mapping[str, Any], priority: int = 0) -> dict:
        """One stage through the cache and the cluster: {"cache": "hit" | "miss", "stdout": text}; a TpuBuildError
        for the stage's own error, SchedulerLost when the cluster went away."""
        from tpubuild.build.cache import stage_key

        targets = [str(t) for t in spec["targets"]]
        inputs = [str(p) for p in spec.get("inputs", ())]
        key = stage_key(task_id, self.compiler, spec.get("config") or {}, kwargs, inputs, targets, self.digest)
        entry = self.cache.lookup(key)
        if entry and self.cache.restore(entry, targets):
            self._restored(entry, targets)
            _clear(spec)
            return {"cache": "hit", "stdout": entry.meta.get("stdout", "")}
        request = {
            "task_id": task_id,
            "func": func,
            "kwargs": kwargs,
            "targets": targets,
            "clears": list(spec.get("clears", ())),
            "key": key,
            "compiler": self.compiler,
            "cache": self.cache.url,
            "inputs": [self.location(p) for p in [*inputs, *_named_files(kwargs, {*inputs, *targets})]],
        }
        request["root"] = self.root_of(request)
        entry, answer = self._submit(task_id, key, request, priority)
        for path, text in answer.get("kept", {}).items():  # a failed comparison's page, for the reports
            from tpubuild.build.files import write_text

            write_text(path, text)
        if "error" in answer:
            raise TpuBuildError(answer["error"])
        if not (entry and self.cache.restore(entry, targets)):
            raise TpuBuildError(
                f"the worker stored {task_id}'s outputs, but the artifact cache {self.cache.url} does not give them "
                "back",
                hint="check that the client and the workers name the same cache (TPUBUILD_ARTIFACT_CACHE)",
            )
        self._restored(entry, targets)
        _clear(spec)
        return {"cache": "miss", "stdout": entry.meta.get("stdout", "")}

    def _submit(self, task_id: str, key: str, request: dict, priority: int) -> tuple[Any, dict]:
        """``work(request)`` on the cluster (the scheduler reruns it elsewhere if its worker dies): (the cache entry
        it stored, or None; the worker's answer). A stage that ran stored its targets and its output under ``key``,
        so its answer stays on the worker ({}); only when the cache has no entry is it fetched (a stage's error)."""
        try:
            future = self.client.submit(work, request, key=f"{task_id}-{key[:12]}", pure=False, priority=priority)
            try:
                future.exception()  # waits for the stage; moves no data (anything but "finished": raised below)
                if future.status == "finished":
                    entry = self.cache.lookup(key)
                    if entry is not None:
                        return entry, {}
                return self.cache.lookup(key), future.result()
            finally:
                future.release()
        except Exception as err:  # distributed's own types vary by version: judged by the client's state
            if getattr(err, "reason", None) == "scheduler-connection-lost" or self.client.status != "running":
                raise SchedulerLost(self._lost_message(err)) from None
            if type(err).__name__ == "KilledWorker":  # a stage that took several workers down with it
                raise TpuBuildError(
                    f"{task_id}: the Dask workers running it died {err}",
                    hint="look at the workers' logs (memory limit?); the stage is not retried further",
                ) from None
            raise

    def _lost_message(self, err: BaseException) -> str:
        return (
            f"lost the Dask scheduler at {self.address} ({type(err).__name__}); the build stopped. "
            "Every finished stage is recorded: run the same command again once the scheduler is back"
        )

    def close(self) -> None:
        with contextlib.suppress(Exception):  # a scheduler already gone: nothing left to close cleanly
            self.client.close(timeout=2)


def _absolute(value: Any) -> list[str]:
    """The absolute paths among the strings of ``value`` (options: mappings and lists of them)."""
    if isinstance(value, Mapping):
        return [p for v in value.values() for p in _absolute(v)]
    if isinstance(value, (list, tuple)):
        return [p for v in value for p in _absolute(v)]
    return [value] if isinstance(value, str) and os.path.isabs(value) else []


def _named_files(value: Any, known: set[str]) -> list[str]:
    """Existing files the stage's options name besides its inputs and targets (a user's quantize table is in a
    float target's config by digest, not in its file_dep): the worker gets them too, as cache.stage_key keys them
    by content."""
    if isinstance(value, Mapping):
        return [f for v in value.values() for f in _named_files(v, known)]
    if isinstance(value, (list, tuple)):
        return [f for v in value for f in _named_files(v, known)]
    if isinstance(value, str) and value not in known and os.path.isabs(value) and os.path.isfile(value):
        known.add(value)
        return [value]
    return []


def _clear(spec: Mapping[str, Any]) -> None:
    """What a successful run of the stage removes besides writing its targets (a failure page it replaces)."""
    for path in spec.get("clears", ()):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class DaskRunner(MThreadRunner):
    """doit's runner for cluster builds: threads of the client each carry one stage to the cluster and wait.

    doit's thread runner would run each action in its thread, swapping sys.stdout for each (racing between
    threads); here a thread never runs a stage's action: it submits it (``Session.run``) and hands doit the
    outcome, its output and values as a process would (MRunner's result dict). Tasks whose action is not a stage
    (a broken manifest's failure) run in the thread under a lock. IN_FLIGHT threads per worker thread of the
    cluster (or ``-n``, if more), so every worker has a stage and the next ones are queued at the scheduler.
    """

    warms_up = False  # dispatch._serve: the client imports no stage modules

    def __init__(self, dep_manager, reporter, continue_=False, always_execute=False, stream=None, num_process=0):
        super().__init__(dep_manager, reporter, continue_, always_execute, stream, max(1, num_process))
        self.session: Session | None = None
        self.inline = threading.Lock()

    def run_all(self, task_dispatcher):
        address = scheduler_address() or ""
        try:
            # the build folder holds doit's DB (tasks.doit_config)
            build = os.path.dirname(os.path.abspath(self.dep_manager.name))
            self.session = Session(connect(address), shared_cache_url(), build)
        except TpuBuildError as err:
            print(f"tpubuild: error: {err}", file=sys.stderr)
            return ERROR
        # IN_FLIGHT stages per worker thread: a worker that finishes a stage finds the next ones queued at the
        # scheduler (by priority) while the client restores the last one's targets and submits more; each client
        # thread only waits for its stage's answer
        self.num_process = max(self.num_process, IN_FLIGHT * self.session.threads())
        self.session.warm_up()
        try:
            return super().run_all(task_dispatcher)  # its finally saves the DB of every finished task
        except SchedulerLost as err:
            print(f"tpubuild: error: {err}", file=sys.stderr)
            return ERROR
        finally:
            self.session.close()

    def execute_task_subprocess(self, job_q, result_q, reporter_class):
        """A client thread: take a task from ``job_q``, carry it out, put doit's result dict on ``result_q``."""
        self.result_q = result_q
        while True:
            job = job_q.get()
            if job is None:
                return
            if job.type is JobHold.type:
                continue
            task = self.tasks[job.name]  # pyright: ignore[reportOptionalSubscript]  (doit sets tasks before any job)
            # the reporter is doit's, in the main thread: ask it there, as a process's MReporter does
            result_q.put({"name": task.name, "reporter": "execute_task"})
            try:
                result = self._carry(task)
            except SchedulerLost as err:
                result_q.put({"exit": SchedulerLost, "exception": str(err)})
                return
            result_q.put(result)

    def _carry(self, task) -> dict[str, Any]:
        """Run ``task``: its stage on the cluster, anything else here."""
        from tpubuild.build.tasks import run_stage

        result: dict[str, Any] = {"name": task.name}
        action = task.actions[0] if len(task.actions) == 1 else None
        call = getattr(action, "py_callable", None)
        args: list[Any] = list(getattr(action, "args", ()))
        if call is not run_stage or len(args) < 4 or not (args[3] or {}).get("targets"):
            with self.inline:
                failure = task.execute(self.stream)
            if failure:
                result["failure"] = failure
            result.update(
                task=task.pickle_safe_dict(), out=[a.out for a in task.actions], err=[a.err for a in task.actions]
            )
            return result
        task_id, func, kwargs, spec = args[:4]
        task.executed = True
        task.init_options()
        stdout, err = "", ""
        assert self.session is not None
        try:
            outcome = self.session.run(task_id, func, kwargs, spec, (task.meta or {}).get("priority", 0))
            stdout = outcome["stdout"]
            task.values.update({"cache": outcome["cache"]})
        except TpuBuildError as error:
            stage, _, model = task_id.partition(":")
            result["failure"] = TaskFailed(str(error.with_context(model=model, stage=stage)))
        except SchedulerLost:
            raise
        except Exception as error:  # a stage's bug or the cluster's: doit shows it with its traceback
            err = traceback.format_exc()
            result["failure"] = TaskError(f"{task_id} on the cluster: {type(error).__name__}: {error}")
        if stdout and task.verbosity >= 2:  # as doit shows a verbose task's output while it runs
            with self.inline:
                sys.stdout.write(stdout)
                sys.stdout.flush()
        result.update(task=task.pickle_safe_dict(), out=[stdout], err=[err])
        return result


def install(enabled: bool = True) -> None:
    """Make doit's `run` use DaskRunner whatever -n and -P say, or (``enabled`` False) doit's own runners again
    (tasks.doit_config, with or without a scheduler)."""
    import doit.cmd_run as cmd_run
    import doit.runner as runner

    if enabled:
        cmd_run.Runner = cmd_run.MRunner = cmd_run.MThreadRunner = DaskRunner
    else:
        cmd_run.Runner, cmd_run.MRunner, cmd_run.MThreadRunner = runner.Runner, runner.MRunner, runner.MThreadRunner


# -- the worker ------------------------------------------------------------------------------


def work(request: Mapping[str, Any]) -> dict[str, Any]:
    """Run one stage on a Dask worker (the function the client submits): refuse another compiler version, fetch
    the inputs by content key into a scratch folder, run, store the targets in the cache under the client's key.

    Returns {"stdout": text, "seconds": the stage's run time} or {"error": message, "kept": {client path: text}};
    paths in both are the client's. A stage's own error is an answer, not an exception: Dask retries only lost workers.
    """
    from tpubuild.build.version import compiler_version

    task_id = request["task_id"]
    mine = compiler_version()
    if mine != request["compiler"]:
        return {
            "error": f"{task_id}: refused by the Dask worker {_worker_name()}: its tpubuild is {mine}, the client's "
            f"is {request['compiler']}\n  hint: install the client's tpubuild (the same release and sources) on "
            "every worker and restart them"
        }
    _as_a_local_stage_process()
    with _scratch() as scratch:
        return _work_in(request, scratch)


@functools.lru_cache(maxsize=1)
def _as_a_local_stage_process() -> None:
    """This worker process set as a local build's stage processes are, once: its garbage collection
    (tasks.collect_garbage_less), and glibc's malloc keeping freed blocks for reuse.

    Dask's nanny starts workers with MALLOC_TRIM_THRESHOLD_=65536 (distributed.nanny.pre-spawn-environ), which
    also pins glibc's mmap threshold at 128 KiB: every numpy temporary larger than that is mapped, its pages
    faulted in zeroed, and unmapped when freed. ppocrv6_det's calibration took 57 s on a worker, 30 s locally;
    a loop of elementwise ops on 6.5 MB arrays ran 2.5x slower. The thresholds set here are those glibc's
    dynamic ones settle at on 64-bit Linux (32 MiB mapped, twice that trimmed)."""
    from tpubuild.build.tasks import collect_garbage_less

    collect_garbage_less()
    if os.environ.get("MALLOC_TRIM_THRESHOLD_") is None:
        return
    with contextlib.suppress(OSError, AttributeError):  # not glibc: its malloc knows no such setting
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(_M_TRIM_THRESHOLD, 64 << 20)


# glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def _work_in(request: Mapping[str, Any], scratch: Path) -> dict[str, Any]:
    from tpubuild.build.cache import file_digest
    from tpubuild.build.tasks import _debug_delay

    task_id = request["task_id"]
    cache = _cache_at(request["cache"])
    here = _Mirror(scratch, request["root"])
    blobs = os.path.join(scratch.parent, "blobs")  # this worker's copies of files by sha256, beside its scratch folders
    places = [here.path(item["path"]) for item in request["inputs"]]
    for folder in {os.path.dirname(p) for p in [*places, *map(here.path, request["targets"])]}:
        os.makedirs(folder, exist_ok=True)
    for item, place in zip(request["inputs"], places, strict=True):
        _fetch(cache, item, place, blobs)
    kwargs = here.map(request["kwargs"])
    _debug_delay(task_id)
    t0 = time.perf_counter()
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), _processes_here():
            request["func"](**kwargs)
    except TpuBuildError as err:
        stage, _, model = task_id.partition(":")
        kept = {}
        for path in request["clears"]:
            with contextlib.suppress(FileNotFoundError):
                kept[path] = here.back(Path(here.path(path)).read_text(encoding="utf-8"))
        return {"error": here.back(str(err.with_context(model=model, stage=stage))), "kept": kept}
    targets = [here.path(t) for t in request["targets"]]
    digests = [file_digest(t) for t in targets]
    stdout = here.back(out.getvalue())
    _debug_delay(f"store:{task_id}")  # (tests kill a worker here: outputs made, none stored)
    cache.store(request["key"], task_id, targets, stdout, digests)
    # the next stage on this worker reads them without a download
    for target, sha in zip(targets, digests, strict=True):
        _keep_local(target, sha, blobs)
    return {"stdout": stdout, "seconds": round(time.perf_counter() - t0, 2)}


@functools.lru_cache(maxsize=8)
def _cache_at(url: str):
    """The worker's UrlCache of ``url``, made once per process (a file system object, the blobs it knows)."""
    from tpubuild.build.urlcache import UrlCache

    return UrlCache(url)


class _Mirror:
    """The client's absolute paths below a worker's scratch folder. The build folder's paths keep their places
    relative to the deepest folder holding all of the stage's (``root``, the model's folder or a target's): a
    stage reads and writes the same relative places (a module's weight file beside it, a report's graphs two
    folders up), and any path in its options maps the same way. Other files (a manifest's sources, calibration
    data) sit at their full path below ``<scratch>/.outside``, beside the files beside them on the client.

    So a scratch folder holds the same few folders whatever the model, and is kept from stage to stage
    (``_scratch``): on a busy disk making a folder costs up to a millisecond, as much as a small stage's whole
    round trip besides, and the client's full depth for every stage cost more than the stage."""

    OUTSIDE = "/.outside"

    def __init__(self, scratch: Path, root: str):
        self.scratch = str(scratch)
        self.root = root.rstrip("/")

    def path(self, client_path: str) -> str:
        if not client_path.startswith("/"):
            return client_path
        if self.root and (client_path == self.root or client_path.startswith(self.root + "/")):
            return self.scratch + client_path[len(self.root) :]
        return self.scratch + self.OUTSIDE + client_path

    def map(self, value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: self.map(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.map(v) for v in value)
        if isinstance(value, str) and os.path.isabs(value):
            return self.path(value)
        return value

    def back(self, text: str) -> str:
        """Text a stage wrote with the client's paths in it again (its output, its error)."""
        return text.replace(self.scratch + self.OUTSIDE, "").replace(self.scratch, self.root)


def _common_folder(paths: Sequence[str]) -> str:
    """The deepest folder holding every one of ``paths`` (absolute) as a prefix of each of them: '' for none or '/'."""
    if not paths:
        return ""
    try:
        common = os.path.commonpath([os.path.dirname(p) for p in paths])
    except ValueError:
        return ""
    if common == "/" or not all(p.startswith(common + "/") for p in paths):
        return ""  # (a path spelled with '//' or '/./': the whole path, as it is)
    return common


def _scratch_root() -> Path:
    """The worker's own folder (Dask's local directory), else the process's temp folder."""
    try:
        from distributed import get_worker

        base = get_worker().local_directory
    except (ImportError, ValueError):
        base = os.environ.get("TMPDIR", "/tmp")
    return _made(os.path.join(base, "tpubuild"))


# scratch folders no stage is using, by worker folder: emptied of files, their folders kept for the next stage
_FREE: dict[Path, list[Path]] = {}
_FREE_LOCK = threading.Lock()
SCRATCH_FOLDERS = 64  # a scratch folder holding more folders than this is removed whole after its stage


@contextlib.contextmanager
def _scratch() -> Iterator[Path]:
    """A scratch folder for one stage, holding no file: a worker thread's previous one, emptied of files, or a new
    one. Its folders stay from stage to stage: making a folder costs up to a millisecond of system time on a busy
    disk, as much as the rest of a small stage's round trip, while removing the files (hard links, mostly) does
    not. A folder that holds more than SCRATCH_FOLDERS folders, or could not be emptied, is removed whole."""
    base = _scratch_root()
    with _FREE_LOCK:
        free = _FREE.setdefault(base, [])
        root = free.pop() if free else base / uuid.uuid4().hex
    try:
        yield root
    finally:
        try:
            kept = _emptied(root)
        except OSError:
            kept = False
        if kept:
            with _FREE_LOCK:
                _FREE[base].append(root)
        else:
            shutil.rmtree(root, ignore_errors=True)


def _emptied(root: Path) -> bool:
    """Remove every file below ``root``, keeping its folders; False (files may be left) if it holds more than
    SCRATCH_FOLDERS folders."""
    folders = [str(root)]
    seen = 0
    while folders:
        folder = folders.pop()
        seen += 1
        if seen > SCRATCH_FOLDERS:
            return False
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:  # (a stage that failed before its first input)
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                folders.append(entry.path)
            else:
                os.unlink(entry.path)
    return True


@functools.lru_cache(maxsize=64)
def _made(folder: str) -> Path:
    """``folder``, made if missing (once per process: it stays while the worker runs)."""
    os.makedirs(folder, exist_ok=True)
    return Path(folder)


def _blob(blobs: str, sha: str) -> str:
    """Where this worker keeps its copy of the file of sha256 ``sha``."""
    return os.path.join(blobs, sha[:2], sha)


def _fetch(cache, item: Mapping[str, Any], dest: str, blobs: str) -> None:
    """Input ``item`` (its sha256 and cache member) at ``dest``: a hard link of this worker's copy (in ``blobs``),
    or a download."""
    sha = item["sha256"]
    local = _blob(blobs, sha)
    if not os.path.exists(local):
        _made(os.path.dirname(local))
        cache.get_blob(sha, local, item.get("member"))
        os.chmod(local, 0o444)  # linked into scratch folders: a stage replaces its files, never edits them
    link_or_copy(local, dest)


def _keep_local(path: str, sha: str, blobs: str) -> None:
    local = _blob(blobs, sha)
    if not os.path.exists(local):
        _made(os.path.dirname(local))
        with contextlib.suppress(OSError):
            os.link(path, local)


@contextlib.contextmanager
def _processes_here():
    """One process per stage in a daemonic worker (multiprocessing forks no child there; the results of
    tpubuild.forked are the same for any count)."""
    from tpubuild.forked import VARIABLE as PROCESSES

    if not multiprocessing.current_process().daemon:
        yield
        return
    old = os.environ.get(PROCESSES)
    os.environ[PROCESSES] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(PROCESSES, None)
        else:
            os.environ[PROCESSES] = old


def _worker_name() -> str:
    try:
        from distributed import get_worker

        worker = get_worker()
        return f"{worker.address} (pid {os.getpid()})"
    except (ImportError, ValueError):
        return f"pid {os.getpid()}"
