"""The compiler version that every stage's config_changed includes.

A released version number alone would let a rebuilt compiler reuse artifacts
made by an older one, so the version carries a digest of the package sources:
editing any tpubuild/*.py invalidates every stage (conservative but never stale).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import tpubuild

PACKAGE_DIR = Path(tpubuild.__file__).resolve().parent


@functools.cache
def compiler_version() -> str:
    """'<__version__>+<12 hex of the sources>', computed once per process (a few ms)."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        digest.update(path.relative_to(PACKAGE_DIR).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return f"{tpubuild.__version__}+{digest.hexdigest()[:12]}"
