"""The no-op fast path: `doit compile` when nothing changed since a build that changed nothing.

doit's own up-to-date check costs ~0.2 ms a task (a DB read, the config digest,
a stat per file), which is most of a second for a zoo of 200 models (4,000+
tasks). When a whole `doit compile` run found every task up to date, the
progress reporter records a stamp (<build>/.noop.json): a digest of the task
graph (every task's name, file_dep, targets, task_dep and config), a digest of
the state (mtime, size, inode) of every file those tasks name, taken before
doit checked them and again after, and the state of the doit DB. The next
`doit compile` generates the graph as usual and, if the stamp still matches
all three, prints the recorded output and exits without running doit's checks:
whatever doit would look at is as it was when doit last found it up to date.

Anything else (an edited manifest, chip or source, a touched file, a new
calibration image, another doit run or `doit forget` writing the DB, a new
compiler version in the configs, other doit options or tasks) runs doit in
full. A stamp is only written by a run in which no task ran and none failed,
so the first no-op after a build is a full one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

STAMP = ".noop.json"
FORMAT = 1

# The graph of the last generation in this process (remember()): the reporter stamps it.
_current: dict[str, Any] | None = None

_VALUE_OPTIONS = {"-f", "--file", "-d", "--dir", "-n", "--process", "-P", "--parallel-type"}
_FLAG_OPTIONS = {"-c", "--continue"}


def selects_compile(args: Sequence[str]) -> bool:
    """True for doit command lines that run `compile` and nothing else: [run] [compile], with only
    options that cannot change what a no-op prints (dodo file, folder, parallelism, --continue)."""
    rest = []
    it = iter(args)
    for arg in it:
        if arg in _VALUE_OPTIONS:
            next(it, None)
        elif (
            arg in _FLAG_OPTIONS
            or arg.split("=", 1)[0] in _VALUE_OPTIONS
            or (arg[:2] in ("-n", "-P", "-f", "-d") and len(arg) > 2)
        ):
            continue
        else:
            rest.append(arg)
    return rest in ([], ["run"], ["compile"], ["run", "compile"])


def graph_digest(tasks: Iterable[Mapping[str, Any]], build_dir: str | os.PathLike) -> tuple[str, list[str]] | None:
    """(digest of the graph, every file its tasks name); None if a task is never up to date.

    Only ever compared with the digest of an earlier generation, so any deterministic
    serialisation will do: repr() of each config (the same code builds its keys in the
    same order, and other code is another compiler version, in the configs) is ~5x
    cheaper than canonical JSON, and this runs on every doit invocation.
    """
    from doit import __version__ as doit_version
    from doit.tools import config_changed

    h = hashlib.sha256(repr((FORMAT, str(doit_version), str(build_dir))).encode())
    files: set[str] = set()
    for t in tasks:
        parts = [str(t.get("basename")), str(t.get("name")), "A" if t.get("actions") else "-"]
        for check in t.get("uptodate", ()):
            if check is True:
                continue
            if not isinstance(check, config_changed):
                return None
            parts.append(repr(check.config))
        file_dep, targets = t.get("file_dep", ()), t.get("targets", ())
        parts += ["\x1f".join(file_dep), "\x1f".join(targets), "\x1f".join(t.get("task_dep", ()))]
        h.update("\x1e".join(parts).encode() + b"\x1d")
        files.update(file_dep)
        files.update(targets)
    return h.hexdigest(), sorted(files)


def remember(
    tasks: Sequence[Mapping[str, Any]], build_dir: str | os.PathLike, db_file: str | os.PathLike
) -> dict[str, Any] | None:
    """Digest the graph just generated, for the reporter's stamp and the fast path."""
    global _current
    graph = graph_digest(tasks, build_dir)
    _current = (
        None
        if graph is None
        else {
            "digest": graph[0],
            "files": graph[1],
            "build_dir": str(build_dir),
            "db_file": str(db_file),
            "tasks": sum(1 for t in tasks if t.get("actions")),
        }
    )
    return _current


def current() -> dict[str, Any] | None:
    return _current


# File times have the kernel's clock tick (a few ms): a file written again within the tick it was
# stat'ed in, at the same size, would look unchanged. So, as git does with its index, a state in
# which some file is younger than this is never stamped (the next no-op run stamps it instead).
# TPUBUILD_NOOP_SETTLE (seconds) changes it, for tests.
RACY_NS = int(float(os.environ.get("TPUBUILD_NOOP_SETTLE", "2")) * 1e9)


def file_states(paths: Iterable[str], *, settled: bool = False) -> str | None:
    """A digest of each file's mtime, size and inode; None if one is missing (or, with ``settled``,
    if one changed within the last RACY_NS)."""
    h = hashlib.sha256()
    newest = 0
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            return None
        newest = max(newest, st.st_mtime_ns)
        h.update(f"{path}\0{st.st_mtime_ns}\0{st.st_size}\0{st.st_ino}\n".encode())
    if settled and time.time_ns() - newest < RACY_NS:
        return None
    return h.hexdigest()


def db_state(db_file: str | os.PathLike) -> list[int] | None:
    try:
        st = os.stat(db_file)
    except OSError:
        return None
    return [st.st_mtime_ns, st.st_size, st.st_ino]


def stamp_file(build_dir: str | os.PathLike) -> Path:
    return Path(build_dir) / STAMP


def forget(build_dir: str | os.PathLike) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(stamp_file(build_dir))


def save(graph: Mapping[str, Any], files: str, output: str) -> None:
    """Record that doit found every task of ``graph`` up to date, the files being in state ``files``."""
    from tpubuild.build.files import write_text

    doc = {
        "format": FORMAT,
        "graph": graph["digest"],
        "files": files,
        "db": db_state(graph["db_file"]),
        "output": output,
        "tasks": graph["tasks"],
    }
    with contextlib.suppress(OSError):  # only a speed-up
        write_text(stamp_file(graph["build_dir"]), json.dumps(doc))


def try_fast_noop(
    args: Sequence[str],
    tasks: Sequence[Mapping[str, Any]],
    build_dir: str | os.PathLike,
    db_file: str | os.PathLike,
    out=None,
) -> bool:
    """If ``args`` run `compile` and the stamp matches, print the recorded output and return True."""
    start = time.perf_counter()
    graph = remember(tasks, build_dir, db_file)
    if graph is None or not selects_compile(args) or os.environ.get("TPUBUILD_NOOP", "").lower() == "off":
        return False
    try:
        doc = json.loads(stamp_file(build_dir).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if (
        not isinstance(doc, dict)
        or doc.get("format") != FORMAT
        or doc.get("graph") != graph["digest"]
        or doc.get("db") != db_state(db_file)
        or doc.get("files") != file_states(graph["files"])
    ):
        return False
    out = out or sys.stdout
    out.write(doc.get("output", ""))
    out.write(
        f"{doc.get('tasks')} tasks up to date: nothing changed since the last build "
        f"(checked in {time.perf_counter() - start:.2f} s without doit's per-task checks; "
        "TPUBUILD_NOOP=off runs them)\n"
    )
    out.flush()
    return True
