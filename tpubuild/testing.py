"""Helpers for tests and benches: the upstream MLIR check every stage's files must pass."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def mlir_opt() -> str:
    """torch-mlir-opt beside the running interpreter (the dev extra installs it), else on PATH."""
    beside = Path(sys.executable).parent / "torch-mlir-opt"
    found = str(beside) if beside.exists() else shutil.which("torch-mlir-opt")
    if not found:
        raise AssertionError("torch-mlir-opt not found: install the dev dependencies (pip install -e '.[dev]')")
    return found


def upstream_check(path: str | os.PathLike, *extra: str) -> str:
    """Parse and verify ``path`` with upstream MLIR (unregistered dialects allowed); returns what it prints."""
    proc = subprocess.run([mlir_opt(), "--allow-unregistered-dialect", "--verify-each", *extra, str(path)],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"upstream MLIR rejected {path}:\n{proc.stderr[:4000]}")
    return proc.stdout
