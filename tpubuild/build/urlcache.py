"""The artifact cache at an fsspec URL: a path (NFS), file://, or s3://bucket/prefix (any S3-compatible store).

The same entries as the folder cache (cache.py), so a local build and a cluster build sharing a cache hit each
other's: <root>/<key[:2]>/<key>/meta.json with the targets as 0, 1, ... by position. Beside them, raw files by
their sha256, <root>/blobs/<sha[:2]>/<sha>: the sources a cluster build's client uploads for its workers
(a manifest's .onnx, calibration data) and the files workers fetch by content key (docs/distributed.md).

What makes an entry visible is its meta.json. On a local file system an entry is written in <root>/tmp/ and
renamed into place, as cache.py does; on an object store (no rename) the members are uploaded first and
meta.json last, each object put whole, so a reader never sees an entry whose files are not all there, and a
writer killed midway leaves members without a meta.json, which no lookup reads (the next store overwrites them).
Every file read from the cache is checked against its sha256; an entry that does not match is reported,
dropped and rebuilt, as the folder cache does.

The endpoint of s3:// is the standard AWS_ENDPOINT_URL when it is set (moto, MinIO, Ceph); credentials come
from the usual AWS variables or files.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpubuild.build.cache import FORMAT, Entry, _check_meta, file_digest
from tpubuild.build.files import link_or_copy
from tpubuild.errors import TpuBuildError

_META = "meta.json"


def is_url(text: str) -> bool:
    """True for 'scheme://...' (file:// included); a plain path is not a URL."""
    return "://" in text


def open_fs(url: str):
    """(fsspec file system, root path inside it) for ``url``; s3:// gets AWS_ENDPOINT_URL as its endpoint."""
    try:
        import fsspec
    except ImportError:
        raise TpuBuildError(
            f"the artifact cache {url} is a URL, which needs fsspec",
            hint="pip install 'tpubuild[cluster]' (fsspec, s3fs, dask, distributed)",
        ) from None
    protocol = url.split("://", 1)[0]
    options: dict[str, Any] = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    if protocol in ("s3", "s3a") and endpoint:
        # recent botocore reads AWS_ENDPOINT_URL itself; passing it keeps older stacks and s3fs's own client in line
        options["client_kwargs"] = {"endpoint_url": endpoint}
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except (ImportError, ValueError) as err:
        raise TpuBuildError(
            f"cannot open the artifact cache {url}: {err}",
            hint="s3:// needs s3fs (pip install 'tpubuild[cluster]'); other schemes their fsspec package",
        ) from None
    return fs, root.rstrip("/")


class UrlCache:
    """The artifact cache through fsspec: lookup, restore and store as cache.ArtifactCache, plus blobs by sha256."""

    def __init__(self, url: str):
        self.url = url
        self.fs, self.root = open_fs(url)
        self.local = "file" in _protocols(self.fs)
        # blobs this process knows are stored (put or checked): no second round trip for them
        self.known: set[str] = set()

    def __reduce__(self):  # to workers by URL: a file system object carries connections and credentials
        return (UrlCache, (self.url,))

    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def entry_dir(self, key: str) -> str:
        return self._path(key[:2], key)

    def blob_path(self, sha: str) -> str:
        return self._path("blobs", sha[:2], sha)

    # -- entries ----------------------------------------------------------------------------

    def lookup(self, key: str) -> Entry | None:
        """The entry for ``key`` if its meta.json is there and describes it (members are checked on restore)."""
        try:
            meta = json.loads(self._read(self._path(key[:2], key, _META)))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            self._discard(key, f"unreadable meta.json ({err})")
            return None
        problem = _check_meta(meta, key)
        if problem:
            self._discard(key, problem)
            return None
        return Entry(key, Path(self.entry_dir(key)), meta)

    def restore(self, entry: Entry, targets: Sequence[str]) -> bool:
        """Download the entry's files as ``targets`` (all or none, each checked against its sha256);
        False if one is missing or corrupt (the entry is then dropped). From a cache on a local file system
        the targets are hard links of its read-only files where it allows, as the folder cache restores."""
        files = entry.meta["files"]
        if len(files) != len(targets):
            return False
        try:
            with _published(targets) as temps:
                for i, (tmp, f) in enumerate(zip(temps, files, strict=True)):
                    member = self._path(entry.key[:2], entry.key, str(i))
                    if self.local:
                        link_or_copy(member, tmp)
                    else:
                        self.fs.get_file(member, tmp)
                    if file_digest(tmp) != f["sha256"]:
                        raise _Corrupt(f"file {i} ({f['name']}) does not match its digest")
        except FileNotFoundError:
            self._discard(entry.key, "a member is missing")
            return False
        except _Corrupt as err:
            self._discard(entry.key, str(err))
            return False
        if self.local:  # its last use, as the folder cache keeps it (an object store has no cheap equivalent)
            with contextlib.suppress(OSError):
                os.utime(self._path(entry.key[:2], entry.key, _META))
        return True

    def store(
        self, key: str, task_id: str, targets: Sequence[str], stdout: str, digests: Sequence[str] | None = None
    ) -> bool:
        """Add the freshly built ``targets`` under ``key``, each also as a blob (the next stage's inputs);
        False if the entry was there already. ``digests``: their sha256s, when the caller has them."""
        if self._exists(self._path(key[:2], key, _META)):
            return False
        shas = list(digests) if digests is not None else [file_digest(t) for t in targets]
        files = [
            {"name": Path(t).name, "size": os.path.getsize(t), "sha256": sha}
            for t, sha in zip(targets, shas, strict=True)
        ]
        meta = {"format": FORMAT, "key": key, "task": task_id, "created": time.time(), "files": files, "stdout": stdout}
        text = json.dumps(meta, indent=1, sort_keys=True) + "\n"
        final = self.entry_dir(key)
        if self.local:
            self._store_local(final, targets, text)
        else:
            for i, target in enumerate(targets):
                self.fs.put_file(str(target), f"{final}/{i}")
            self.fs.pipe_file(f"{final}/{_META}", text.encode("utf-8"))  # last: it makes the entry visible
        for target, f in zip(targets, files, strict=True):
            self.put_blob(target, f["sha256"])
        return True

    def _store_local(self, final: str, targets: Sequence[str], meta_text: str) -> None:
        """As cache.ArtifactCache.store: built in <root>/tmp/, renamed into place (the first of two writers wins).
        Members are hard links of the targets where the file system allows (a stage's fresh targets, never
        written again: stages publish by rename), read-only like every cache file."""
        base = Path(self._path("tmp"))
        base.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=base))
        try:
            for i, target in enumerate(targets):
                link_or_copy(target, tmp / str(i))
                os.chmod(tmp / str(i), 0o444)
            (tmp / _META).write_text(meta_text, encoding="utf-8")
            Path(final).parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):  # another process stored the same key first
                os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def log(self, event: str, task_id: str) -> None:
        """The folder cache's event log is an O_APPEND file; object stores cannot append, so nothing is kept."""

    # -- blobs: files by content ------------------------------------------------------------

    def has_blob(self, sha: str) -> bool:
        if sha in self.known:
            return True
        if self._exists(self.blob_path(sha)):
            self.known.add(sha)
            return True
        return False

    def put_blob(self, path: str | os.PathLike, sha: str | None = None) -> str:
        """Store the file at ``path`` by its sha256 (once); returns the sha256."""
        sha = sha or file_digest(path)
        if self.has_blob(sha):
            return sha
        dst = self.blob_path(sha)
        if self.local:  # whole or not at all: a reader checks the digest, but a rename is cheap
            tmp = f"{dst}.{uuid.uuid4().hex}.tmp"
            self.fs.makedirs(self._path("blobs", sha[:2]), exist_ok=True)
            try:
                os.link(path, tmp)  # a stage's fresh target: never written again (stages publish by rename)
            except OSError:
                self.fs.put_file(str(path), tmp)
            os.replace(tmp, dst)
        else:
            self.fs.put_file(str(path), dst)
        self.known.add(sha)
        return sha

    def get_blob(self, sha: str, dest: str | os.PathLike, source: str | None = None) -> None:
        """Download the blob ``sha`` (or the cache file ``source``, an entry member) to ``dest``, checked."""
        src = self._path(source) if source else self.blob_path(sha)
        tmp = f"{dest}.{uuid.uuid4().hex}.tmp"
        try:
            try:
                self.fs.get_file(src, tmp)
            except FileNotFoundError:
                if not source:
                    raise
                src = self.blob_path(sha)  # the entry was pruned: its stage stored each file as a blob too
                self.fs.get_file(src, tmp)
        except FileNotFoundError:
            raise TpuBuildError(
                f"the artifact cache {self.url} has no file {sha[:12]} ({src})",
                hint="an entry was pruned during the build; run the build again",
            ) from None
        if file_digest(tmp) != sha:
            os.unlink(tmp)
            with contextlib.suppress(OSError):
                self.fs.rm_file(src)
            raise TpuBuildError(
                f"the artifact cache file {src} does not match its sha256 {sha[:12]}; it was dropped",
                hint="run the build again: the stage that made it runs again",
            )
        os.replace(tmp, dest)

    # -- statistics, pruning ----------------------------------------------------------------

    def listing(self) -> list[_Item]:
        """Every complete entry and every blob, from one listing of the cache: their files (inode, bytes), the
        entries' last use (meta.json's modification time: a restore from a local cache touches it; on an object
        store it is when the entry was stored) and when each blob was stored."""
        try:
            found = self.fs.find(self.root, detail=True)
        except FileNotFoundError:
            found = {}
        entries: dict[str, _Item] = {}
        items: list[_Item] = []
        for path, info in found.items():
            parts = path.rstrip("/").split("/")[-3:]
            file = (int(info.get("ino") or 0), int(info.get("size") or 0))
            if len(parts) == 3 and parts[0] == "blobs":
                items.append(_Item("blob", parts[2], _mtime(info), [path], [file]))
            elif len(parts) == 3 and len(parts[0]) == 2 and parts[1].startswith(parts[0]):
                item = entries.setdefault(parts[1], _Item("entry", parts[1], -1.0, [], []))
                item.paths.append(path)
                if parts[2] == _META:
                    item.last_use = _mtime(info)
                else:
                    item.files.append(file)
        return items + [e for e in entries.values() if e.last_use >= 0]  # (members without meta.json: no entry)

    def stats(self) -> dict[str, Any]:
        """As ArtifactCache.stats, plus the blobs; no event log (an object store cannot append)."""
        items = self.listing()
        entries = [i for i in items if i.kind == "entry"]
        paths = [self._path(e.name[:2], e.name, _META) for e in entries]
        metas = self.fs.cat(paths, on_error="omit") if paths else {}
        sizes = {e.name: e.bytes for e in entries}
        per_stage: dict[str, list[int]] = {}
        for path, text in metas.items():
            key = path.rstrip("/").split("/")[-2]
            try:
                stage = str(json.loads(text).get("task", "?")).partition(":")[0]
            except (ValueError, AttributeError):
                continue
            row = per_stage.setdefault(stage, [0, 0])
            row[0] += 1
            row[1] += sizes.get(key, 0)
        blobs = [i for i in items if i.kind == "blob"]
        return {
            "root": self.url,
            "entries": len(entries),
            "bytes": sum(e.bytes for e in entries),
            "stages": per_stage,
            "events": {},
            "max_bytes": 0,
            "blobs": len(blobs),
            "blob_bytes": sum(b.bytes for b in blobs),
            "total_bytes": _disk_bytes(items),
        }

    def prune(
        self, max_bytes: int | None = None, older_than_days: float | None = None, now: float | None = None
    ) -> tuple[int, int]:
        """Remove entries and blobs unused for ``older_than_days``, then the least recently used until the cache
        holds at most ``max_bytes`` (entries and blobs together; a blob is wanted only while a build that uploaded
        or stored it runs). An entry goes meta.json first, so a reader misses it rather than finding it partial.
        Returns (entries and blobs removed, bytes freed)."""
        now = time.time() if now is None else now
        items = sorted(self.listing(), key=lambda i: i.last_use)
        names: dict[int, int] = {}  # inode -> listed names still there (a local store links members and blobs)
        for item in items:
            for ino, _ in item.files:
                names[ino] = names.get(ino, 0) + 1
        total, removed, freed = _disk_bytes(items), 0, 0
        for item in items:
            old = older_than_days is not None and now - item.last_use > older_than_days * 86400
            if not old and (max_bytes is None or total <= max_bytes):
                continue
            self._remove(item)
            size = 0
            for ino, nbytes in item.files:
                names[ino] -= 1
                size += nbytes if not ino or not names[ino] else 0  # an inode's bytes go with its last name
            removed, freed, total = removed + 1, freed + size, total - size
        return removed, freed

    def _remove(self, item: _Item) -> None:
        with contextlib.suppress(OSError):
            if item.kind == "blob":
                self.fs.rm_file(item.paths[0])
                return
            self.fs.rm_file(self._path(item.name[:2], item.name, _META))
            self.fs.rm(self.entry_dir(item.name), recursive=True)

    # -- helpers ----------------------------------------------------------------------------

    def _read(self, path: str) -> bytes:
        """The bytes of cache file ``path`` (on a local file system without fsspec's layers: a stage looks up its
        entry twice)."""
        if self.local:
            with open(path, "rb") as f:
                return f.read()
        return self.fs.cat_file(path)

    def _exists(self, path: str) -> bool:
        return os.path.exists(path) if self.local else self.fs.exists(path)

    def _discard(self, key: str, problem: str) -> None:
        print(f"tpubuild: artifact cache: ignoring corrupt entry {self.entry_dir(key)} ({problem})", file=sys.stderr)
        with contextlib.suppress(OSError):
            self.fs.rm(self.entry_dir(key), recursive=True)


@contextlib.contextmanager
def _published(targets: Sequence[str]):
    """Temp names beside ``targets`` (no file made yet): all are published together on success, or none, and
    stale copies of the targets are removed (files.all_or_nothing without its empty temp files, which a hard
    link would only replace)."""
    temps = [f"{os.path.dirname(t)}/.{os.path.basename(t)}.{uuid.uuid4().hex}.tmp" for t in targets]
    try:
        for t in targets:
            os.makedirs(os.path.dirname(t), exist_ok=True)
        yield temps
        for tmp, t in zip(temps, targets, strict=True):
            os.replace(tmp, t)
    except BaseException:
        for p in [*temps, *targets]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        raise


@dataclass
class _Item:
    """An entry (name: its key) or a blob (name: its sha256) of a cache at a URL, for stats and prune."""

    kind: str
    name: str
    last_use: float
    paths: list[str]
    files: list[tuple[int, int]]  # (inode, bytes) of its members or of the blob; inode 0 on a store without them

    @property
    def bytes(self) -> int:
        return sum(nbytes for _, nbytes in self.files)


def _disk_bytes(items: Sequence[_Item]) -> int:
    """What ``items`` hold on their store, an inode several of them share counted once."""
    seen: set[int] = set()
    total = 0
    for item in items:
        for ino, nbytes in item.files:
            if not ino or ino not in seen:
                total += nbytes
            seen.add(ino)
    return total


def _mtime(info: dict[str, Any]) -> float:
    """An fsspec listing's modification time in seconds (local: mtime; s3fs: LastModified, a datetime)."""
    when: Any = info.get("mtime", info.get("LastModified", info.get("last_modified")))
    if isinstance(when, datetime.datetime):
        return when.timestamp()
    try:
        return float(when)
    except (TypeError, ValueError):
        return 0.0


class _Corrupt(Exception):
    """A cache member whose bytes do not match meta.json."""


def _protocols(fs) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)
