"""PyTorch sources: export in the fetch stage, then the ONNX flow. Skipped without torch (an optional extra)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tpubuild.build import fetch
from tpubuild.errors import TpuBuildError
from tpubuild.testing import run_doit

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "models" / "torch_examples.py"
MANIFEST = REPO / "configs" / "models" / "torch" / "tiny_torch_cnn.yaml"

NET = """\
import torch
def make():
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear({n}, 5))
"""


def export(tmp_path: Path, factory: str, name: str = "a.onnx", **kwargs) -> bytes:
    out = tmp_path / name
    fetch.export_torch(factory, [1, 3, 16, 16], "x", str(out), **kwargs)
    return out.read_bytes()


def test_export_is_deterministic(tmp_path):
    factory = f"{EXAMPLE}:tiny_cnn"
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    first = export(tmp_path, factory)
    assert torch.equal(torch.random.get_rng_state(), state), "the export changed the caller's random state"
    # again in a fresh process (its own hash seed and torch state)
    code = (
        "import sys; from tpubuild.build import fetch; "
        "fetch.export_torch(sys.argv[1], [1, 3, 16, 16], 'x', sys.argv[2])"
    )
    subprocess.run(
        [sys.executable, "-c", code, factory, str(tmp_path / "b.onnx")],
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "random"},
    )
    assert (tmp_path / "b.onnx").read_bytes() == first

    import onnx

    model = onnx.load_model_from_string(first)
    assert [i.name for i in model.graph.input] == ["x"]
    assert {o.version for o in model.opset_import if o.domain == ""} == {17}


def test_torch_manifest_builds_and_matches_torch(tmp_path):
    """configs/models/torch/tiny_torch_cnn.yaml through doit; TOP inference agrees with onnxruntime and with torch."""
    build = tmp_path / "build"
    run = run_doit("verify_top:tiny_torch_cnn", manifests=MANIFEST, build=build)
    assert run.returncode == 0, run.stdout + run.stderr
    folder = build / "tiny_torch_cnn"
    for comp in json.loads((folder / "verify_top.json").read_text())["comparisons"]:
        assert comp["passed"] and comp["compared"] > 0 and comp["min_cos"] >= 0.99999, comp

    # the factory's own forward on the same input (it is built under the same seed as the export)
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import torch_examples
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    torch.manual_seed(0)
    net = torch_examples.tiny_cnn()
    with np.load(folder / "input.npz") as f:
        x = f["image"]
    with torch.no_grad():
        expected = net(torch.from_numpy(x)).numpy()
    import onnx

    (name,) = [o.name for o in onnx.load(str(folder / "source.onnx")).graph.output]
    with np.load(folder / "top_outs.npz") as f:
        out = f[name]
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-6)


def test_dotted_module_beside_the_manifest_is_tracked(tmp_path):
    """`torch: "nets.tiny:make"` imports from the manifest's folder; editing that file re-exports."""
    models = tmp_path / "models"
    (models / "nets").mkdir(parents=True)
    net = models / "nets" / "tiny.py"
    net.write_text(NET.format(n=4 * 14 * 14))
    (models / "t.yaml").write_text(
        "name: t\nsource: {torch: 'nets.tiny:make', example_shape: [1, 3, 16, 16]}\n"
        "inputs: [{name: x, shape: [1, 3, 16, 16]}]\n"
    )
    env = {**os.environ, "TPUBUILD_MANIFESTS": str(models), "TPUBUILD_BUILD_DIR": str(tmp_path / "build")}
    cmd = [sys.executable, "-m", "doit", "-f", str(REPO / "dodo.py"), "fetch:t"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stdout + first.stderr
    fetched = tmp_path / "build" / "t" / "source.onnx"
    exported = fetched.read_bytes()
    assert "-- fetch:t" in subprocess.run(cmd, env=env, capture_output=True, text=True).stdout

    net.write_text(NET.format(n=4 * 14 * 14).replace("ReLU()", "Sigmoid()"))
    again = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert ".  fetch:t" in again.stdout, again.stdout + again.stderr
    assert fetched.read_bytes() != exported


def test_factory_errors(tmp_path):
    with pytest.raises(TpuBuildError, match="cannot import the model factory 'no_such_pkg.nets:make'"):
        export(tmp_path, "no_such_pkg.nets:make")
    (tmp_path / "f.py").write_text("def make():\n    return 3\n")
    with pytest.raises(TpuBuildError, match="returned a int, not a torch.nn.Module"):
        export(tmp_path, f"{tmp_path / 'f.py'}:make")
    with pytest.raises(TpuBuildError, match="cannot import the model factory"):
        export(tmp_path, f"{tmp_path / 'f.py'}:missing")
    # a factory that fails (a checkpoint with keys the module lacks, say) is the user's error, not a traceback
    (tmp_path / "h.py").write_text("def make():\n    raise KeyError('similarity_weight')\n")
    with pytest.raises(TpuBuildError, match=r"factory '.*h.py:make' raised KeyError: 'similarity_weight'"):
        export(tmp_path, f"{tmp_path / 'h.py'}:make")
    (tmp_path / "g.py").write_text(NET.format(n=7))  # Linear's size is wrong for the example input
    with pytest.raises(TpuBuildError, match="torch.onnx.export failed"):
        export(tmp_path, f"{tmp_path / 'g.py'}:make")
    assert not (tmp_path / "a.onnx").exists()
