"""Manifest schema and loader: good manifests load, bad ones name file, JSON path and expected form."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tpubuild.build.manifest import DEFAULT_TOLERANCE, json_path, load_manifest
from tpubuild.errors import TpuBuildError

REPO = Path(__file__).resolve().parents[1]

GOOD = """\
name: m1
source: model.onnx
inputs:
  - name: x
    shape: [1, 3, 8, 8]
"""


def write(tmp_path: Path, text: str, name: str = "m.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def error_of(path: Path) -> str:
    with pytest.raises(TpuBuildError) as err:
        load_manifest(path)
    return str(err.value)


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "models").glob("*.yaml")), ids=lambda p: p.stem)
def test_repo_manifests_are_valid(path):
    m = load_manifest(path)
    assert m.name == path.stem
    # the default zoo builds without optional extras: files in the repo or pinned PyPI wheels, no PyTorch
    assert m.source_kind in ("path", "pypi")
    assert m.source_kind == "pypi" or m.source_path.is_file()


def test_defaults_applied(tmp_path):
    m = load_manifest(write(tmp_path, GOOD))
    assert m.name == "m1" and m.inputs[0].shape == (1, 3, 8, 8)
    assert m.inputs[0].dtype is None and m.inputs[0].range is None  # the model's dtype (build/inputs.py)
    assert m.tolerance == DEFAULT_TOLERANCE
    assert m.targets == () and m.test_input is None
    assert m.resolve(m.source) == (tmp_path / "model.onnx").resolve()


def test_full_manifest(tmp_path):
    m = load_manifest(
        write(
            tmp_path,
            GOOD
            + """\
    dtype: float32
    range: [-1, 1]
    preprocess: {mean: [1, 2, 3], scale: [0.5], pixel_format: bgr, resize: [8, 8]}
calibration: {data: "cali/*.npz", count: 10, method: percentile}
quantize_table: qtable.txt
test_input: data/in.npz
targets:
  - {chip: bm1684x, mode: INT8, asymmetric: true}
  - {chip: bm1684x, mode: BF16}
tolerance:
  top: {cos: 0.9999}
  tpu: {INT8: {cos: 0.95, euc: 0.85}}
""",
        )
    )
    assert m.inputs[0].range == (-1.0, 1.0)
    assert m.test_input == (tmp_path / "data" / "in.npz").resolve()
    assert [t.id for t in m.targets] == ["bm1684x-INT8-asym", "bm1684x-BF16"]
    assert m.tolerance["top"] == {"cos": 0.9999, "euc": DEFAULT_TOLERANCE["top"]["euc"]}
    assert m.tolerance["tpu"]["INT8"] == {"cos": 0.95, "euc": 0.85}
    assert m.tolerance["tpu"]["F32"] == DEFAULT_TOLERANCE["tpu"]["F32"]


def test_pypi_and_torch_sources(tmp_path):
    pypi = load_manifest(
        write(
            tmp_path,
            GOOD.replace("source: model.onnx", f"source: {{pypi: 'six==1.16.0', member: six.py, sha256: {'a' * 64}}}"),
            "p.yaml",
        )
    )
    assert pypi.source_kind == "pypi"
    torch = load_manifest(
        write(
            tmp_path,
            GOOD.replace("source: model.onnx", "source: {torch: 'pkg.models:make', example_shape: [1, 3, 8, 8]}"),
            "t.yaml",
        )
    )
    assert torch.source_kind == "torch"


@pytest.mark.parametrize(
    "edit, path, expected",
    [
        (("[1, 3, 8, 8]", "[1, x, 8, 8]"), "inputs[0].shape[1]", "integer >= 1"),
        (("[1, 3, 8, 8]", "[1, 0, 8, 8]"), "inputs[0].shape[1]", "integer >= 1"),
        (("name: m1", "name: 'm 1'"), "name", "identifier"),
        (("source: model.onnx", "source: 5"), "source", "path to an .onnx"),
        (("source: model.onnx", "source: {pypi: six==1.16.0}"), "source", "sha256"),
        (("source: model.onnx", "source: {pypi: six==1.16.0, member: a, sha256: abc}"), "source.sha256", "64"),
        (("source: model.onnx", "source: {torch: 'a:b'}"), "source", "example_shape"),
        (("    shape: [1, 3, 8, 8]", "    shape: [1, 3, 8, 8]\n    dtype: float64"), "inputs[0].dtype", "float32"),
        (("inputs:", "targets: [{chip: bm1684x, mode: INT4}]\ninputs:"), "targets[0].mode", "F32, BF16, F16, INT8"),
        (
            ("inputs:", "targets: [{chip: bm1684x, mode: F32, asymmetric: 'yes'}]\ninputs:"),
            "targets[0].asymmetric",
            "true or false",
        ),
        (("inputs:", "tolerance: {top: {cos: high}}\ninputs:"), "tolerance.top.cos", "number"),
        (("inputs:", "calibration: {data: x, method: median}\ninputs:"), "calibration.method", "max, percentile"),
        (("inputs:", "colour: blue\ninputs:"), "(top level)", "'colour' was unexpected"),
    ],
)
def test_schema_errors_name_file_path_and_form(tmp_path, edit, path, expected):
    old, new = edit
    assert old in GOOD
    manifest = write(tmp_path, GOOD.replace(old, new, 1))
    message = error_of(manifest)
    assert str(manifest) in message
    assert f"  {path}: " in message, message
    assert expected in message, message
    assert "Traceback" not in message


def test_missing_required_field(tmp_path):
    message = error_of(write(tmp_path, "name: m1\ninputs: [{name: x}]\n"))
    assert "'source' is a required property" in message


def test_inputs_may_be_left_to_the_model(tmp_path):
    m = load_manifest(write(tmp_path, "name: m1\nsource: model.onnx\n"))
    assert m.inputs == ()
    m = load_manifest(write(tmp_path, "name: m1\nsource: model.onnx\ninputs: [{preprocess: {mean: [127.5]}}]\n"))
    assert m.inputs[0].name is None and m.inputs[0].shape is None and m.inputs[0].preprocess == {"mean": [127.5]}
    # an empty entry says nothing: a slip, not a choice
    assert "inputs[0]" in error_of(write(tmp_path, "name: m1\nsource: model.onnx\ninputs: [{}]\n", "empty.yaml"))
    # a PyTorch source has no model file to read them from
    torch = "name: m1\nsource: {torch: 'm:f', example_shape: [1, 3]}\n"
    assert "`torch` source needs" in error_of(write(tmp_path, torch, "torch.yaml"))
    message = error_of(write(tmp_path, torch + "inputs: [{name: x}]\n", "torch_shape.yaml"))
    assert "inputs[0]: a `torch` source needs shape" in message


def test_semantic_errors(tmp_path):
    dup = GOOD + "  - name: x\n    shape: [1]\n"
    assert "inputs[1].name" in error_of(write(tmp_path, dup, "dup.yaml"))
    empty_range = GOOD + "    range: [1, 1]\n"
    assert "inputs[0].range" in error_of(write(tmp_path, empty_range, "range.yaml"))
    targets = GOOD + "targets: [{chip: c, mode: F32}, {chip: c, mode: F32, asymmetric: false}]\n"
    assert "targets[1]" in error_of(write(tmp_path, targets, "targets.yaml"))


def test_a_fixed_input_value(tmp_path):
    head = "name: m1\nsource: model.onnx\ninputs:\n"
    m = load_manifest(write(tmp_path, head + "  - {name: x}\n  - {name: sr, value: 16000}\n"))
    assert m.inputs[1].value == 16000 and m.inputs[1].config()["value"] == 16000
    assert "value" not in m.inputs[0].config()  # an entry without one keeps its stage options as before
    # a fixed value is no test input; positions would count differently once the input has left the model
    both = head + "  - {name: sr, value: 16000, range: [0, 1]}\n"
    assert "inputs[0]: a fixed value is no test input" in error_of(write(tmp_path, both, "both.yaml"))
    nameless = head + "  - {shape: [1, 4]}\n  - {name: sr, value: 16000}\n"
    assert "inputs[0]: no name, beside an input with a fixed value" in error_of(write(tmp_path, nameless, "n.yaml"))
    assert "inputs[0].value" in error_of(write(tmp_path, head + "  - {name: sr, value: fast}\n", "s.yaml"))


def test_yaml_syntax_error_names_line(tmp_path):
    message = error_of(write(tmp_path, "name: m1\ninputs: [\n  - oops: {\n"))
    assert "line " in message and "YAML" in message


def test_empty_and_missing_files(tmp_path):
    assert "(top level)" in error_of(write(tmp_path, ""))
    assert "cannot read manifest" in error_of(tmp_path / "absent.yaml")


def test_json_path():
    assert json_path(["inputs", 0, "shape", 1]) == "inputs[0].shape[1]"
    assert json_path([]) == "(top level)"


def test_loading_manifests_imports_no_heavy_modules():
    """dodo.py loads every manifest on every run: no numpy, onnx, xdsl or dask on that path."""
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from tpubuild.build.tasks import find_manifests, zoo_tasks
        tasks = list(zoo_tasks(find_manifests([{str(REPO / "configs" / "models")!r}]), Path({str(REPO / "build")!r})))
        assert tasks
        heavy = ("numpy", "onnx", "onnxruntime", "xdsl", "dask", "distributed", "fsspec", "s3fs")
        print(sorted(m for m in heavy if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
