"""The content-addressed artifact cache under the doit graph.

doit decides whether a stage must run (its file_dep, targets and config); when it
must, run_stage asks this cache first. A stage's key is the sha256 of its input
files' bytes (the task's file_dep, in order), its config (what config_changed
gets), its remaining options, the compiler version and the task id. On a hit
the stage's targets are restored from the cache entry instead of recomputed,
and the stage's console output is replayed; on a miss the stage runs and its
targets are stored. So a fresh checkout, or a second machine sharing the cache
folder, rebuilds the zoo from cache.

Why the task id (stage and model) is in the key: some options reach the outputs
without being in the config (verify_top.json names its model), and two models
that share a source file must not share those artifacts. Paths are not in the
key: inputs and targets are replaced by their position, so the same manifests
built into another folder, or from another checkout, hit.

Entries: <root>/<key[:2]>/<key>/ holds meta.json (each file's name, size and
sha256, the stage's stdout) and the targets as 0, 1, ... by position. An entry
is built in <root>/tmp/ and renamed into place, so a reader never sees half of
one and two processes storing the same key keep the first. A restore checks
every file against meta.json; a corrupt or vanished entry is a miss (and is
removed). Entry files are read-only and restored as hard links where the file
system allows (copies otherwise): stages publish with os.replace, so they never
write into a restored file. meta.json's mtime is the entry's last use (LRU).

Location: $TPUBUILD_ARTIFACT_CACHE, else $TPUBUILD_CACHE/artifacts, else
~/.cache/tpubuild/artifacts. Either variable set to "off" disables the cache.
$TPUBUILD_ARTIFACT_CACHE may also be a URL (s3://bucket/prefix, file:///path):
the same entries through fsspec (urlcache.py), which cluster builds share.

Size: at most $TPUBUILD_CACHE_MAX_SIZE (default 10G; 0 = no limit), kept as
ccache keeps its own: entries fall into 16 groups by their key's first hex digit,
and a store that takes its group past 1/16 of the limit evicts that group's
least recently used entries (never the one just stored) down to 80% of its share.
A store reads one group's meta files, not the whole cache, and a zoo's worth of
builds cannot fill the disk.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpubuild.build.files import link_or_copy

FORMAT = 1
OFF = "off"
_META = "meta.json"
_LOG = "events.log"
_CHUNK = 1 << 20
_GROUPS = 16
DEFAULT_MAX_SIZE = "10G"


def parse_size(text: str) -> int:
    """'500M' -> 524288000 (K, M, G are powers of 1024); ValueError if it is not a byte count."""
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    value = float(text[:-1] if scale > 1 else text) * scale
    if not value >= 0:
        raise ValueError(f"negative byte count {text!r}")
    return int(value)


def max_size() -> int:
    """The cache's size limit in bytes ($TPUBUILD_CACHE_MAX_SIZE; 0: none)."""
    text = os.environ.get("TPUBUILD_CACHE_MAX_SIZE") or DEFAULT_MAX_SIZE
    try:
        return parse_size(text)
    except ValueError:
        print(
            f"tpubuild: TPUBUILD_CACHE_MAX_SIZE={text!r} is not a byte count (e.g. 500M, 10G, 0 for no "
            f"limit); using {DEFAULT_MAX_SIZE}",
            file=sys.stderr,
        )
        return parse_size(DEFAULT_MAX_SIZE)


def cache_root() -> Path | None:
    """The artifact cache folder, or None when it is disabled."""
    own = os.environ.get("TPUBUILD_ARTIFACT_CACHE")
    if own:
        return None if own.lower() == OFF else Path(own)
    base = os.environ.get("TPUBUILD_CACHE")
    if base and base.lower() == OFF:
        return None
    return Path(base or Path.home() / ".cache" / "tpubuild") / "artifacts"


def cache_url() -> str | None:
    """$TPUBUILD_ARTIFACT_CACHE when it is a URL (s3://bucket/prefix, file:///path; urlcache.py), else None."""
    own = os.environ.get("TPUBUILD_ARTIFACT_CACHE") or ""
    return own if "://" in own else None


def file_digest(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _normalize(value: Any, names: Mapping[str, str]) -> Any:
    """``value`` with input/target paths replaced by their role, so keys do not depend on folders.

    Any other string naming an existing file stands for its content, an existing
    folder for nothing (a search path: what is found there is an input already).
    """
    if isinstance(value, Mapping):
        return {str(k): _normalize(v, names) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_normalize(v, names) for v in value]
    if isinstance(value, str):
        if value in names:
            return names[value]
        for path, name in names.items():  # "file.py:factory"
            if value.startswith(path + ":"):
                return name + value[len(path) :]
        if os.path.isabs(value):
            if os.path.isfile(value):
                return f"<file {file_digest(value)}>"
            if os.path.isdir(value):
                return "<dir>"
    return value


def stage_key(
    task_id: str,
    compiler: str,
    config: Mapping[str, Any],
    options: Mapping[str, Any],
    inputs: Sequence[str],
    targets: Sequence[str],
    digest: Callable[[str], str] = file_digest,
) -> str:
    """The cache key of one run of a stage task (see the module docstring); ``digest``: a file's sha256 (a cluster
    build's client knows most already)."""
    names = {str(p): f"<input {i}>" for i, p in enumerate(inputs)}
    names.update({str(p): f"<target {i}>" for i, p in enumerate(targets)})
    header = {
        "format": FORMAT,
        "task": task_id,
        "compiler": compiler,
        "config": config,
        "options": _normalize(options, names),
        "inputs": [digest(p) for p in inputs],
        "targets": len(targets),
    }
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Entry:
    key: str
    path: Path
    meta: dict[str, Any]

    @property
    def bytes(self) -> int:
        return sum(f["size"] for f in self.meta["files"])

    @property
    def last_use(self) -> float:
        try:
            return (self.path / _META).stat().st_mtime
        except OSError:
            return 0.0


class ArtifactCache:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    @classmethod
    def from_env(cls) -> Any:
        """The cache the environment names: this class for a folder, urlcache.UrlCache for a URL; None if off."""
        url = cache_url()
        if url is not None:
            from tpubuild.build.urlcache import UrlCache

            return UrlCache(url)
        root = cache_root()
        return cls(root) if root else None

    def entry_dir(self, key: str) -> Path:
        return self.root / key[:2] / key

    # -- lookup and restore -----------------------------------------------------------------

    def lookup(self, key: str) -> Entry | None:
        """The entry for ``key`` if it is present and intact; a corrupt one is removed."""
        path = self.entry_dir(key)
        try:
            meta = json.loads((path / _META).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            self._discard(path, "unreadable meta.json")
            return None
        problem = _check(path, meta, key)
        if problem:
            self._discard(path, problem)
            return None
        return Entry(key, path, meta)

    def restore(self, entry: Entry, targets: Sequence[str]) -> bool:
        """Publish the entry's files as ``targets`` (all or none); False if the entry vanished meanwhile."""
        from tpubuild.build.files import all_or_nothing

        files = entry.meta["files"]
        if len(files) != len(targets):
            return False
        try:
            with all_or_nothing(*targets) as temps:
                for i, tmp in enumerate(temps):
                    _link_or_copy(entry.path / str(i), tmp)
        except FileNotFoundError:  # pruned by another process between lookup and restore
            return False
        with contextlib.suppress(OSError):
            os.utime(entry.path / _META)
        return True

    # -- store ------------------------------------------------------------------------------

    def store(self, key: str, task_id: str, targets: Sequence[str], stdout: str) -> bool:
        """Add the freshly built ``targets`` under ``key``; False if another process stored it first."""
        final = self.entry_dir(key)
        if (final / _META).exists():
            return False
        tmp = self._tmp_dir()
        try:
            files = []
            for i, target in enumerate(targets):
                dst = tmp / str(i)
                shutil.copyfile(target, dst)
                os.chmod(dst, 0o444)  # a hard-linked restore must not be edited in place
                files.append({"name": Path(target).name, "size": dst.stat().st_size, "sha256": file_digest(dst)})
            meta = {
                "format": FORMAT,
                "key": key,
                "task": task_id,
                "created": time.time(),
                "files": files,
                "stdout": stdout,
            }
            (tmp / _META).write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n", encoding="utf-8")
            final.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(tmp, final)
            except OSError:  # another process stored the same key first (ENOTEMPTY/EEXIST)
                return False
            self.trim_group(key, max_size())
            return True
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    # -- statistics, pruning ----------------------------------------------------------------

    def log(self, event: str, task_id: str) -> None:
        """Append one event (hit, miss, store, corrupt) to the log that `tpubuild cache stats` sums."""
        line = f"{time.time():.0f} {event} {task_id}\n".encode()
        with contextlib.suppress(OSError):
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.root / _LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            try:
                os.write(fd, line)  # one small O_APPEND write: lines of concurrent processes do not mix
            finally:
                os.close(fd)

    def entries(self) -> Iterator[Entry]:
        """Every complete entry (read from meta.json, not checked against its files)."""
        if not self.root.is_dir():
            return
        for shard in sorted(self.root.iterdir()):
            if len(shard.name) == 2 and shard.is_dir():
                yield from self._entries_in(shard)

    def events(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        with contextlib.suppress(FileNotFoundError), open(self.root / _LOG, encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2:
                    counts[parts[1]] = counts.get(parts[1], 0) + 1
        return counts

    def stats(self) -> dict[str, Any]:
        per_stage: dict[str, list[int]] = {}
        total_bytes = 0
        count = 0
        for entry in self.entries():
            count += 1
            size = entry.bytes
            total_bytes += size
            stage = str(entry.meta.get("task", "?")).partition(":")[0]
            row = per_stage.setdefault(stage, [0, 0])
            row[0] += 1
            row[1] += size
        return {
            "root": str(self.root),
            "entries": count,
            "bytes": total_bytes,
            "stages": per_stage,
            "events": self.events(),
            "max_bytes": max_size(),
        }

    def prune(
        self, max_bytes: int | None = None, older_than_days: float | None = None, now: float | None = None
    ) -> tuple[int, int]:
        """Remove entries unused for ``older_than_days``, then the least recently used until the
        cache holds at most ``max_bytes``. Returns (entries removed, bytes freed)."""
        now = time.time() if now is None else now
        entries = sorted(self.entries(), key=lambda e: e.last_use)
        removed, freed = 0, 0
        keep: list[Entry] = []
        for entry in entries:
            if older_than_days is not None and now - entry.last_use > older_than_days * 86400:
                removed, freed = removed + 1, freed + entry.bytes
                self._remove(entry.path)
            else:
                keep.append(entry)
        if max_bytes is not None:
            total = sum(e.bytes for e in keep)
            for entry in keep:  # oldest use first
                if total <= max_bytes:
                    break
                total -= entry.bytes
                removed, freed = removed + 1, freed + entry.bytes
                self._remove(entry.path)
        self._clean_tmp(now)
        return removed, freed

    def trim_group(self, key: str, limit: int) -> int:
        """Evict the least recently used entries of ``key``'s group (never ``key`` itself) once the group
        holds more than its share of ``limit``, down to 80% of that share. Returns the entries removed."""
        if limit <= 0:
            return 0
        share = limit / _GROUPS
        group = [
            e for shard in sorted(self.root.glob(key[0] + "?")) if len(shard.name) == 2 for e in self._entries_in(shard)
        ]
        total = sum(e.bytes for e in group)
        if total <= share:
            return 0
        removed = 0
        for entry in sorted(group, key=lambda e: e.last_use):
            if total <= 0.8 * share:
                break
            if entry.key == key:
                continue
            total -= entry.bytes
            removed += 1
            self._remove(entry.path)
            self.log("evict", str(entry.meta.get("task", "?")))
        return removed

    # -- helpers ----------------------------------------------------------------------------

    @staticmethod
    def _entries_in(shard: Path) -> Iterator[Entry]:
        for path in sorted(shard.iterdir()):
            try:
                meta = json.loads((path / _META).read_text(encoding="utf-8"))
                yield Entry(path.name, path, meta)
            except (OSError, ValueError):
                continue

    def _tmp_dir(self) -> Path:
        base = self.root / "tmp"
        base.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=base))

    def _remove(self, path: Path) -> None:
        """Take the entry out of its place in one rename (readers then miss), then delete it."""
        trash = self.root / "tmp" / f"trash-{uuid.uuid4().hex}"
        trash.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(path, trash)
        except OSError:
            return  # already gone
        _rmtree(trash)

    def _discard(self, path: Path, problem: str) -> None:
        self.log("corrupt", path.name)
        print(f"tpubuild: artifact cache: ignoring corrupt entry {path} ({problem})", file=sys.stderr)
        self._remove(path)

    def _clean_tmp(self, now: float) -> None:
        """Remove leftovers of interrupted stores (older than a day: a live store takes seconds)."""
        base = self.root / "tmp"
        if not base.is_dir():
            return
        for path in base.iterdir():
            with contextlib.suppress(OSError):
                if now - path.stat().st_mtime > 86400:
                    _rmtree(path)


def _rmtree(path: Path) -> None:
    # entry files are read-only, but their folders are not, so unlinking them works
    shutil.rmtree(path, ignore_errors=True)


def _check_meta(meta: Any, key: str) -> str | None:
    """Why ``meta`` is not the meta.json of entry ``key`` (None: it is)."""
    if (
        not isinstance(meta, dict)
        or meta.get("format") != FORMAT
        or meta.get("key") != key
        or not isinstance(meta.get("files"), list)
    ):
        return "meta.json does not describe this entry"
    return None


def _check(path: Path, meta: Mapping[str, Any], key: str) -> str | None:
    """Why the entry at ``path`` cannot be used (None: intact)."""
    problem = _check_meta(meta, key)
    if problem:
        return problem
    for i, f in enumerate(meta["files"]):
        member = path / str(i)
        try:
            if member.stat().st_size != f["size"] or file_digest(member) != f["sha256"]:
                return f"file {i} ({f['name']}) does not match its digest"
        except OSError:
            return f"file {i} ({f['name']}) is missing"
        except (KeyError, TypeError):
            return "meta.json does not describe this entry"
    return None


def _link_or_copy(src: Path, tmp: Path) -> None:
    """Put ``src`` at ``tmp`` (an existing temp file): a hard link if possible, else a writable copy. A vanished
    entry raises FileNotFoundError: the caller falls back to running the stage."""
    os.unlink(tmp)
    if not link_or_copy(src, tmp):
        os.chmod(tmp, 0o644)


class _Tee(io.TextIOBase):
    """A text stream that keeps what is written and passes it on."""

    def __init__(self, stream):
        self.stream = stream
        self.kept = io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def run_cached(
    task_id: str,
    func: Callable[..., Any],
    kwargs: dict[str, Any],
    spec: Mapping[str, Any] | None,
) -> str:
    """Run ``func(**kwargs)`` through the cache; returns what happened: hit, miss or off.

    ``spec``: {"config": ..., "inputs": [...], "targets": [...], "clears": [...]} from the task (None:
    never cached); "clears" are files a successful run removes (not targets), which a restore removes too.
    A stage that raises stores nothing. A cache that cannot be read or written (a
    full disk, a read-only folder) is reported and bypassed: it never fails a build.
    """
    cache = ArtifactCache.from_env() if spec and spec.get("targets") else None
    if cache is None or spec is None:
        func(**kwargs)
        return OFF
    from tpubuild.build.version import compiler_version

    targets = [str(t) for t in spec["targets"]]
    try:
        key = stage_key(
            task_id,
            compiler_version(),
            spec.get("config") or {},
            kwargs,
            [str(p) for p in spec.get("inputs", ())],
            targets,
        )
        entry = cache.lookup(key)
        if entry and cache.restore(entry, targets):
            cache.log("hit", task_id)
            for path in spec.get("clears", ()):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            sys.stdout.write(entry.meta.get("stdout", ""))
            return "hit"
    except OSError as err:
        _warn(cache, err)
        func(**kwargs)
        return OFF
    cache.log("miss", task_id)
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        func(**kwargs)
    try:
        if cache.store(key, task_id, targets, tee.kept.getvalue()):
            cache.log("store", task_id)
    except OSError as err:
        _warn(cache, err)
    return "miss"


def _warn(cache: ArtifactCache, err: OSError) -> None:
    print(
        f"tpubuild: artifact cache {cache.root} not used ({err}); set TPUBUILD_CACHE=off to silence this",
        file=sys.stderr,
    )


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"
