"""Which files a calibration.data glob names. No numpy here: the doit task graph calls it on every load."""

from __future__ import annotations

import fnmatch
import glob as globlib
import os
from pathlib import Path

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")
ARRAY_SUFFIXES = (".npz", ".npy")


def find_files(pattern: str, base: str | Path) -> list[Path]:
    """The files a glob (relative to ``base``, ``**`` recursive) matches, sorted; only known kinds."""
    return [Path(name) for name in find_names(pattern, base)]


def find_names(pattern: str, base: str | Path) -> list[str]:
    """find_files as strings, cheaply (a zoo's no-op build globs every model's data).

    Resolved as Path.resolve() would: the folder is resolved once, `..` removed from
    the pattern, and only matches that are symlinks resolved one by one. A pattern
    whose wildcards are all in its last part (`photos/*.jpg`) lists that one folder.
    """
    full = os.path.normpath(os.path.join(os.path.realpath(base), pattern))
    folder, leaf = os.path.split(full)
    found = []
    if globlib.has_magic(folder) or "**" in leaf:
        for name in globlib.glob(full, recursive=True):
            if _known(name) and os.path.isfile(name):
                found.append(os.path.realpath(name) if os.path.islink(name) else name)
    else:
        try:
            entries = list(os.scandir(folder))
        except OSError:
            entries = []
        names = {e.name: e for e in entries if not e.name.startswith(".") or leaf.startswith(".")}  # as glob
        for name in fnmatch.filter(names, leaf) if globlib.has_magic(leaf) else [leaf] * (leaf in names):
            entry = names[name]
            if _known(name) and entry.is_file():
                found.append(os.path.realpath(entry.path) if entry.is_symlink() else entry.path)
    # ordered as Paths are (component by component): calibration takes the first `count` files
    return sorted(found, key=lambda n: n.split(os.sep))


def _known(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in IMAGE_SUFFIXES + ARRAY_SUFFIXES
