"""Which files a calibration.data glob names. No numpy here: the doit task graph calls it on every load."""

from __future__ import annotations

import glob as globlib
from pathlib import Path

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")
ARRAY_SUFFIXES = (".npz", ".npy")


def find_files(pattern: str, base: str | Path) -> list[Path]:
    """The files a glob (relative to ``base``, ``**`` recursive) matches, sorted; only known kinds."""
    found = [Path(p) for p in globlib.glob(str(Path(base) / pattern), recursive=True)]
    return sorted(p.resolve() for p in found if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES + ARRAY_SUFFIXES)
