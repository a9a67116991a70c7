"""Helpers for tests and benches: the upstream MLIR check every stage's files must pass, small ONNX models,
doit runs."""

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
    proc = subprocess.run(
        [mlir_opt(), "--allow-unregistered-dialect", "--verify-each", *extra, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        raise AssertionError(f"upstream MLIR rejected {path}:\n{proc.stderr[:4000]}")
    return proc.stdout


REPO = Path(__file__).resolve().parents[1]


def save_onnx(
    path: str | os.PathLike,
    nodes: list,
    inputs: dict[str, list],
    outputs: dict[str, list],
    weights: dict | None = None,
    *,
    opset: int = 17,
) -> None:
    """A small float32 ONNX model from its nodes: inputs/outputs map names to shapes (str = symbolic dim),
    weights become initializers. IR version 8 so that every onnxruntime and TPU-MLIR's onnx 1.14 read it."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    def values(specs: dict[str, list]) -> list:
        return [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in specs.items()]

    graph = helper.make_graph(
        nodes,
        Path(path).stem,
        values(inputs),
        values(outputs),
        initializer=[numpy_helper.from_array(a, n) for n, a in (weights or {}).items()],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8), str(path))


def doit_env(manifests: str | os.PathLike, build: str | os.PathLike, code: Path = REPO, **env: str) -> dict[str, str]:
    """The environment of a doit run over `manifests` (a folder, or files joined by os.pathsep) into `build`,
    importing tpubuild from `code`; extra variables as keywords."""
    path = os.pathsep.join([str(code), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {
        **os.environ,
        "TPUBUILD_MANIFESTS": str(manifests),
        "TPUBUILD_BUILD_DIR": str(build),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": path,
        **env,
    }


def doit_cmd(*args: str, code: Path = REPO) -> list[str]:
    return [sys.executable, "-m", "doit", "-f", str(Path(code) / "dodo.py"), *args]


def run_doit(
    *args: str,
    manifests: str | os.PathLike,
    build: str | os.PathLike,
    code: Path = REPO,
    timeout: float | None = 600,
    cwd: str | os.PathLike | None = None,
    **env: str,
) -> subprocess.CompletedProcess:
    """`doit ARGS` on code/dodo.py in a subprocess with doit_env's environment."""
    return subprocess.run(
        doit_cmd(*args, code=code),
        env=doit_env(manifests, build, code, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def tasks_marked(out: str, marker: str = ".  ") -> set[str]:
    """Tasks doit's console output lists with `marker`: ".  " ran, "-- " was up to date."""
    return {line[len(marker) :].strip() for line in out.splitlines() if line.startswith(marker)}


def snapshot_code(dest: Path) -> Path:
    """A copy of what dodo.py loads (dodo.py, tpubuild, configs) to run doit on (code=...): the compiler
    version digests the sources, and edits to the checkout while a test runs would change it."""
    ignore = shutil.ignore_patterns("__pycache__")
    dest.mkdir()
    shutil.copy2(REPO / "dodo.py", dest / "dodo.py")
    for folder in ("tpubuild", "configs"):
        shutil.copytree(REPO / folder, dest / folder, ignore=ignore)
    return dest
