"""The command line bench/torchvision_sweep.py and bench/trained_torch.py share: manifests written into a
temp folder (with whatever data a script makes there), built by one `tpubuild compile`."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(
    argv: list[str] | None,
    doc: str | None,
    models: Sequence[str],
    manifest: Callable[[str], str],
    prepare: Callable[[Path], None] = lambda folder: None,
) -> int:
    """``[MODEL ...] [--build-dir DIR] [-j N] [--list]``: each model's ``manifest(name)`` as ``<name>.yaml`` in a
    temp folder that ``prepare`` fills first (its paths are relative to it); the exit status is 1 if any target
    fails."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    ap.add_argument("models", nargs="*", help=f"default: all ({', '.join(models)})")
    ap.add_argument("--build-dir", help="keep the build here (default: a temp folder, removed)")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    ap.add_argument("--list", action="store_true", help="print the manifests and stop")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.models) - set(models))
    if unknown:
        ap.error(f"unknown model(s) {unknown}; known: {list(models)}")
    names = args.models or list(models)
    if args.list:
        for name in names:
            print(f"# {name}.yaml\n{manifest(name)}")
        return 0
    with tempfile.TemporaryDirectory(prefix="tpubuild-sweep-") as tmp:
        folder = Path(tmp)
        prepare(folder)
        for name in names:
            (folder / f"{name}.yaml").write_text(manifest(name))
        build = Path(args.build_dir) if args.build_dir else folder / "build"
        cmd = [sys.executable, "-m", "tpubuild.cli", "compile", *(str(folder / f"{n}.yaml") for n in names)]
        return subprocess.run([*cmd, "--build-dir", str(build), "-j", str(args.jobs)], cwd=REPO).returncode and 1
