"""Atomic, deterministic file writes.

Every artifact goes through here: it is written to a temp file in the target's
folder and moved into place with os.replace, so a failed or interrupted stage
never leaves a partial target. npz files are written with fixed zip metadata
(numpy's savez stamps the current time), so the same arrays give the same bytes.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

# numpy (and ml_dtypes) are imported by the npz functions only: the task graph and the
# doit reporters write small text files through here on every run, numpy or not (~0.3 s)

_EPOCH = (1980, 1, 1, 0, 0, 0)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# mkstemp makes 0600 files; artifacts get the mode a plain open() would give them
_MODE = 0o666 & ~_umask()


def _temp_beside(target: Path) -> Path:
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.fchmod(fd, _MODE)
    os.close(fd)
    return Path(tmp)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside ``path``; on success it replaces ``path``, on error it is removed."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_beside(target)
    try:
        yield tmp
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


# .npy has no descr for ml_dtypes (bfloat16, float8...): np.load gives them back as raw
# void; such arrays are stored as their same-width unsigned bits, and this member says which
_EXTRA_DTYPES = "__ml_dtypes__"


def _storable(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    import numpy as np

    out: dict[str, np.ndarray] = {}
    extra: list[str] = []
    for name in sorted(arrays):
        a = np.asarray(arrays[name], order="C")  # (ascontiguousarray turns 0-d into 1-d)
        if a.dtype.kind == "V" and a.dtype.names is None:
            extra.append(f"{name}={a.dtype.name}")
            a = a.view(np.dtype(f"u{a.dtype.itemsize}"))
        out[name] = a
    if extra:
        out[_EXTRA_DTYPES] = np.array(extra)
    return out


def npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    """A deterministic .npz (uncompressed, sorted members, fixed timestamps) readable by np.load."""
    buf = io.BytesIO()
    _write_npz(buf, arrays)
    return buf.getvalue()


def write_npz(path: str | os.PathLike, arrays: Mapping[str, np.ndarray]) -> None:
    """npz_bytes(arrays) to ``path``, atomically, streamed: a stage's tensors can be hundreds of MB, and the
    bytes made in memory first were three copies of them."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        _write_npz(f, arrays)


def _write_npz(f, arrays: Mapping[str, np.ndarray]) -> None:
    import numpy as np

    with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        stored = _storable(arrays)
        for name in sorted(stored):
            info = zipfile.ZipInfo(name + ".npy", date_time=_EPOCH)
            info.external_attr = 0o644 << 16
            info.file_size = stored[name].nbytes  # (and its header): zip64 or not, as for a member of known size
            with zf.open(info, "w") as member:
                np.lib.format.write_array(member, stored[name], allow_pickle=False)


def read_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Load every array of an npz eagerly (no pickles), closing the file."""
    import ml_dtypes
    import numpy as np

    with np.load(path, allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files}
    for entry in arrays.pop(_EXTRA_DTYPES, np.array([], str)).tolist():
        name, dtype = entry.rsplit("=", 1)
        arrays[name] = arrays[name].view(np.dtype(getattr(ml_dtypes, dtype)))
    return arrays


def link_or_copy(src: str | os.PathLike, dst: str | os.PathLike) -> bool:
    """Put ``src`` at ``dst`` (not there yet): a hard link where the file system allows, else a copy; True if
    linked. A missing ``src`` raises FileNotFoundError. The caches and cluster workers hand out their read-only
    files this way: stages publish by rename, so they never write into a linked file."""
    try:
        os.link(src, dst)
        return True
    except FileNotFoundError:
        raise
    except OSError:  # another file system, or links not allowed
        shutil.copyfile(src, dst)
        return False


@contextlib.contextmanager
def all_or_nothing(*paths: str | os.PathLike) -> Iterator[list[Path]]:
    """Temp paths for several outputs of one stage: all are published together, or none.

    On failure the temps are removed and so are stale copies of the targets, so a
    failed stage never leaves a target that looks current.
    """
    targets = [Path(p) for p in paths]
    temps: list[Path] = []
    try:
        for t in targets:
            t.parent.mkdir(parents=True, exist_ok=True)
            temps.append(_temp_beside(t))
        yield temps
        for tmp, t in zip(temps, targets, strict=True):
            os.replace(tmp, t)
    except BaseException:
        for p in temps + targets:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        raise


def write_with(path: str | os.PathLike, writer: Callable[[Path], None]) -> None:
    """Call ``writer(tmp_path)`` and publish the result atomically."""
    with atomic_path(path) as tmp:
        writer(tmp)
