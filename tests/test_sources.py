"""Model sources: `prepare` steps in the fetch stage, the {path, prepare} form, and their manifest spelling.

The light model used is the one the pinned onnx wheel installs (the same bytes
configs/models/light_squeezenet.yaml fetches from PyPI), so most of this needs
no download.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from tpubuild.build import fetch
from tpubuild.build.manifest import SCHEMA_PATH, load_manifest
from tpubuild.errors import TpuBuildError
from tpubuild.frontend.prepare import PREPARE_STEPS, prepare_model
from tpubuild.testing import run_doit

REPO = Path(__file__).resolve().parents[1]
SQUEEZENET = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light" / "light_squeezenet.onnx"
SQUEEZENET_SHA256 = "770b0f3c8623e18bf58b53754d710051b4c268248422142980a132bbe6dfe908"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def float_model(
    nodes: list, x_shape: list[int], y_shape: list[int], initializers: dict[str, np.ndarray]
) -> onnx.ModelProto:
    """An opset-17 model of ``nodes`` from the float input x to the float output y."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
        [numpy_helper.from_array(v, k) for k, v in initializers.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def run_ort(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"data_0": x})[0]


def test_prepare_steps_match_schema_and_docs():
    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    assert set(schema["$defs"]["prepare"]["items"]["enum"]) == set(PREPARE_STEPS)
    docs = (REPO / "docs" / "manifest.md").read_text(encoding="utf-8")
    for step in PREPARE_STEPS:
        assert f"| `{step}` |" in docs, f"docs/manifest.md does not describe the prepare step {step}"


PHOTOS = sorted((REPO / "models" / "calib" / "photos").glob("*.jpg"))


def light_samples(name: str) -> dict:
    """What the fetch task hands a light model's steps: its first calibration photos, as calibration reads them."""
    m = load_manifest(REPO / "configs" / "models" / f"{name}.yaml")
    inputs = [{**spec.config(), "preprocess": spec.preprocess} for spec in m.inputs]
    return {"data_files": [str(p) for p in PHOTOS], "inputs": inputs, "count": fetch.PREPARE_SAMPLES}


def test_prepared_light_model_is_deterministic_and_has_real_weights(tmp_path):
    """The light models' steps: same bytes in every process, no constant fills left, unit-scale channels on photos."""
    assert sha256(SQUEEZENET) == SQUEEZENET_SHA256, "the pinned onnx wheel ships a different light_squeezenet"
    steps = load_manifest(REPO / "configs" / "models" / "light_squeezenet.yaml").prepare
    assert steps == ("fill_weights", "normalize_activations")
    samples = light_samples("light_squeezenet")
    first, second = tmp_path / "a.onnx", tmp_path / "b.onnx"
    fetch.prepare_file(str(SQUEEZENET), steps, str(first), samples)
    # again in a fresh process: no hash-seed or process state in the weights
    code = (
        "import sys, json; from tpubuild.build import fetch; "
        f"fetch.prepare_file(sys.argv[1], {list(steps)!r}, sys.argv[2], json.loads(sys.argv[3]))"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(SQUEEZENET), str(second), json.dumps(samples)],
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "random"},
    )
    assert first.read_bytes() == second.read_bytes()

    original, prepared = onnx.load(str(SQUEEZENET)), onnx.load(str(first))
    shapes = {t.name: tuple(numpy_helper.to_array(t)) for t in original.graph.initializer}
    fills = {n.output[0]: shapes[n.input[0]] for n in original.graph.node if n.op_type == "ConstantOfShape"}
    assert len(fills) == 39  # every conv filter, and the biases the exporter did not keep
    assert "ConstantOfShape" not in {n.op_type for n in prepared.graph.node}
    weights = {t.name: numpy_helper.to_array(t) for t in prepared.graph.initializer}
    for name, shape in fills.items():
        w = weights[name]
        assert w.shape == shape and w.dtype == np.float32
        assert len(np.unique(w)) > w.size // 2, f"{name} is still (nearly) constant"
    onnx.checker.check_model(prepared)

    # constant filters make every channel the same, so every class gets the same score;
    # real weights make the classes differ
    x = np.random.default_rng(0).uniform(-1, 1, (1, 3, 224, 224)).astype(np.float32)
    assert np.ptp(run_ort(original, x)) < 1e-6
    assert np.ptp(run_ort(prepared, x)) > 1e-3
    # on photographs the step did not see, every conv output channel has about unit scale
    from tpubuild.calib.data import Samples

    from tpubuild.build.inputs import complete, onnx_inputs

    held = list(Samples.of(PHOTOS[-8:], complete(samples["inputs"], onnx_inputs(prepared), file=str(first))))
    assert not set(PHOTOS[-8:]) & set(PHOTOS[: fetch.PREPARE_SAMPLES])
    convs = [n.output[0] for n in prepared.graph.node if n.op_type == "Conv"]
    prepared.graph.output.extend(onnx.ValueInfoProto(name=c) for c in convs)
    import onnxruntime as ort

    sess = ort.InferenceSession(prepared.SerializeToString(), providers=["CPUExecutionProvider"])
    outs = [sess.run(convs, h) for h in held]
    assert len(convs) == 26
    for i, name in enumerate(convs):
        std = np.concatenate([np.moveaxis(o[i], 1, 0).reshape(o[i].shape[1], -1) for o in outs], axis=1).std(axis=1)
        assert 0.3 < np.median(std) < 3 and std.max() / np.median(std) < 30, (name, np.median(std), std.max())


def test_fetch_gives_normalize_activations_the_first_calibration_samples(tmp_path):
    """The light models' fetch reads their calibration photos (file_dep), hands the step the first
    PREPARE_SAMPLES of them as calibration reads them, and a step that reads no data leaves them out."""
    from tpubuild.build.tasks import model_tasks

    m = load_manifest(REPO / "configs" / "models" / "light_squeezenet.yaml")
    task = next(t for t in model_tasks(m, tmp_path) if t["basename"] == "fetch")
    kwargs = task["actions"][0][1][2]
    # every photo but the test input, which calibration leaves out (tasks.calibration_files)
    assert m.test_input is not None and str(m.test_input) in set(map(str, PHOTOS))
    assert set(map(str, PHOTOS)) - {str(m.test_input)} <= set(task["file_dep"])
    assert str(m.test_input) not in kwargs["samples"]["data_files"]
    assert kwargs["samples"]["count"] == fetch.PREPARE_SAMPLES <= m.calibration["count"]
    assert kwargs["samples"]["inputs"][0]["preprocess"] == m.inputs[0].preprocess
    filled = tmp_path / "m.yaml"
    filled.write_text(
        (REPO / "configs" / "models" / "light_squeezenet.yaml")
        .read_text()
        .replace("prepare: [fill_weights, normalize_activations]", "prepare: [fill_weights]")
        .replace("../../models/", f"{REPO / 'models'}/")
    )
    task = next(t for t in model_tasks(load_manifest(filled), tmp_path) if t["basename"] == "fetch")
    assert "samples" not in task["actions"][0][1][2] and not set(map(str, PHOTOS)) & set(task["file_dep"])


def test_fill_weights_filters_of_unbiased_convs_ignore_flat_regions():
    """A conv without bias (a batch norm after it) gets filters that sum to 0 over each kernel; one with a bias
    keeps random sums."""
    from onnx import helper

    def fill(name: str, shape: list[int]) -> list[onnx.NodeProto]:
        return [
            helper.make_node(
                "ConstantOfShape",
                [f"{name}_shape"],
                [name],
                value=numpy_helper.from_array(np.array([0.02], np.float32)),
            )
        ]

    shapes = {"w1": [8, 3, 3, 3], "w2": [8, 8, 3, 3], "b2": [8], "w3": [4, 8, 1, 1]}
    nodes = [n for k, v in shapes.items() for n in fill(k, v)] + [
        helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["c1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["c2", "w3"], ["y"]),
    ]
    model = float_model(
        nodes,
        [1, 3, 8, 8],
        [1, 4, 8, 8],
        {f"{k}_shape": np.array(v, np.int64) for k, v in shapes.items()},
    )
    got = {t.name: numpy_helper.to_array(t) for t in prepare_model(model, ["fill_weights"]).graph.initializer}
    np.testing.assert_allclose(got["w1"].sum(axis=(2, 3)), 0, atol=1e-6)
    assert np.abs(got["w2"].sum(axis=(2, 3))).min() > 1e-4  # biased: a flat input still moves it
    assert np.abs(got["w3"]).min() > 0  # 1x1: the filter is its own sum, kept


def test_normalize_activations_makes_concat_parts_comparable_and_bn_gains_moderate():
    """DenseNet's pattern: convs of very different scales joined by a Concat, then a batch norm. Per-tensor
    INT8 of the Concat would wipe out the small part and the BN gain amplify the loss; on the samples
    given, every channel leaves the step at unit std and the BN's gains stay near its scale."""
    from onnx import helper

    rng = np.random.default_rng(1)
    inits = {
        "wa": rng.standard_normal((6, 3, 3, 3)).astype(np.float32) * 100,
        "wb": rng.standard_normal((6, 3, 3, 3)).astype(np.float32) * 0.01,
        "scale": np.ones(12, np.float32),
        "shift": np.zeros(12, np.float32),
        "mean": np.zeros(12, np.float32),
        "var": np.ones(12, np.float32),
    }
    # one channel of the second conv much smaller than its neighbours
    inits["wb"][0] *= 1e-3
    nodes = [
        helper.make_node("Conv", ["x", "wa"], ["a"], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["x", "wb"], ["b"], pads=[1, 1, 1, 1]),
        helper.make_node("Concat", ["a", "b"], ["c"], axis=1),
        helper.make_node("BatchNormalization", ["c", "scale", "shift", "mean", "var"], ["y"]),
    ]
    model = float_model(nodes, [1, 3, 16, 16], [1, 12, 16, 16], inits)
    smooth = [
        {"x": np.cumsum(np.random.default_rng(i).standard_normal((1, 3, 16, 16)), axis=3).astype(np.float32)}
        for i in range(4)
    ]
    out = prepare_model(model, ["normalize_activations"], smooth)
    got = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    out.graph.output.extend([onnx.ValueInfoProto(name="c")])
    import onnxruntime as ort

    sess = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    c = np.concatenate([sess.run(["c"], s)[0] for s in smooth])
    std = c.transpose(1, 0, 2, 3).reshape(12, -1).std(axis=1)
    # channel 6 (almost constant) stays small, held at 10x below its tensor's spread, rather than blown up
    np.testing.assert_allclose(np.delete(std, 6), 1.0, rtol=0.01)
    assert std[6] < 0.1
    gains = got["scale"] / np.sqrt(got["var"] + 1e-5)
    assert gains.max() < 25 and np.median(gains) < 1.1, gains


def test_normalize_activations_on_batchnorm_and_gemm():
    """Trained-looking BN statistics that do not fit random filters: the step refits them from data."""
    from onnx import helper

    rng = np.random.default_rng(0)
    inits = {
        "w": rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 50,
        "b": np.full(8, 3.0, np.float32),
        "scale": np.linspace(0.5, 1.5, 8).astype(np.float32),
        "shift": np.linspace(-1, 1, 8).astype(np.float32),
        "mean": np.full(8, 7.0, np.float32),
        "var": np.full(8, 1e-4, np.float32),
        "fc": rng.standard_normal((10, 8)).astype(np.float32),
        "fc_b": np.zeros(10, np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "scale", "shift", "mean", "var"], ["n"]),
        helper.make_node("Relu", ["n"], ["r"]),
        helper.make_node("GlobalAveragePool", ["r"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("Gemm", ["f", "fc", "fc_b"], ["y"], transB=1),
    ]
    model = float_model(nodes, [2, 3, 16, 16], [2, 10], inits)
    model.graph.output.extend([onnx.ValueInfoProto(name="c"), onnx.ValueInfoProto(name="n")])
    out = prepare_model(model, ["normalize_activations"])
    got = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    assert [t.name for t in out.graph.initializer] == list(inits)  # same tensors, same order
    np.testing.assert_array_equal(got["scale"], inits["scale"])  # learned affine parameters are kept

    import onnxruntime as ort

    sess = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    # on the documented probe input the fit is exact up to the 3-digit rounding
    probe = np.random.default_rng(zlib.crc32(b"normalize_activations\0x")).uniform(-1, 1, (2, 3, 16, 16))
    y, c, n = sess.run(["y", "c", "n"], {"x": probe.astype(np.float32)})
    np.testing.assert_allclose(c.std(axis=(0, 2, 3)), 1, rtol=0.01)  # each of the conv's channels (it was ~150)
    # the BN normalizes: per channel, its output has the mean `shift` and the std `scale`
    np.testing.assert_allclose(n.mean(axis=(0, 2, 3)), inits["shift"], atol=0.01)
    np.testing.assert_allclose(n.std(axis=(0, 2, 3)), inits["scale"], rtol=0.01)
    assert abs(y.std() - 1) < 0.005
    # and on another input, roughly
    x = np.random.default_rng(5).uniform(-1, 1, (2, 3, 16, 16)).astype(np.float32)
    y, c, n = sess.run(["y", "c", "n"], {"x": x})
    np.testing.assert_allclose(c.std(axis=(0, 2, 3)), 1, rtol=0.25)
    assert 0.5 < y.std() < 2.0
    np.testing.assert_allclose(n.std(axis=(0, 2, 3)), inits["scale"], rtol=0.25)


def test_normalize_activations_rescales_convs_that_share_a_zero_bias():
    """The TorchScript exporter gives convs whose batch norms it folded one zero bias, read through Identity
    nodes (and the same tensor directly): those convs are rescaled all the same, and the bias stays zeros."""
    from onnx import helper

    rng = np.random.default_rng(0)
    inits = {
        "w1": rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 50,
        "w2": rng.standard_normal((4, 4, 3, 3)).astype(np.float32) * 0.01,
        "w3": rng.standard_normal((4, 4, 1, 1)).astype(np.float32) * 30,
        "zero": np.zeros(4, np.float32),
    }
    nodes = [
        helper.make_node("Identity", ["zero"], ["zero_1"]),
        helper.make_node("Identity", ["zero"], ["zero_2"]),
        helper.make_node("Conv", ["x", "w1", "zero_1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["c1", "w2", "zero_2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["c2", "w3", "zero"], ["y"]),
    ]
    model = float_model(nodes, [2, 3, 16, 16], [2, 4, 16, 16], inits)
    model.graph.output.extend([onnx.ValueInfoProto(name="c1"), onnx.ValueInfoProto(name="c2")])
    out = prepare_model(model, ["normalize_activations"])
    got = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    np.testing.assert_array_equal(got["zero"], 0)

    import onnxruntime as ort

    sess = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(zlib.crc32(b"normalize_activations\0x")).uniform(-1, 1, (2, 3, 16, 16))
    for value in sess.run(["c1", "c2", "y"], {"x": x.astype(np.float32)}):
        np.testing.assert_allclose(value.std(axis=(0, 2, 3)), 1, rtol=0.01)


def test_fill_weights_sees_through_unsqueeze():
    """A Scale layer's gamma reaches its Mul through Unsqueeze (Caffe2 exports): it gets a Mul scale's
    range (0.5, 1.5), not the fallback around 0; its beta, an Add's, stays small."""
    from onnx import helper

    nodes = [
        helper.make_node(
            "ConstantOfShape", ["shape"], ["gamma"], value=numpy_helper.from_array(np.array([0.02], np.float32))
        ),
        helper.make_node(
            "ConstantOfShape", ["shape"], ["beta"], value=numpy_helper.from_array(np.array([0.02], np.float32))
        ),
        helper.make_node("Unsqueeze", ["gamma", "axes"], ["g3"]),
        helper.make_node("Unsqueeze", ["beta", "axes"], ["b3"]),
        helper.make_node("Mul", ["x", "g3"], ["m"]),
        helper.make_node("Add", ["m", "b3"], ["y"]),
    ]
    model = float_model(
        nodes, [1, 6, 4, 4], [1, 6, 4, 4], {"shape": np.array([6], np.int64), "axes": np.array([1, 2], np.int64)}
    )
    got = {t.name: numpy_helper.to_array(t) for t in prepare_model(model, ["fill_weights"]).graph.initializer}
    assert got["gamma"].min() >= 0.5 and got["gamma"].max() <= 1.5
    assert np.abs(got["beta"]).max() <= 0.1


def test_prepare_errors(tmp_path):
    with pytest.raises(TpuBuildError, match=r"unknown prepare step\(s\) \['fill'\]; known: \['fill_weights'"):
        prepare_model(onnx.ModelProto(), ["fill"])
    text = tmp_path / "notes.onnx"
    text.write_text("not a model")
    with pytest.raises(TpuBuildError, match="not a valid ONNX model") as err:
        fetch.prepare_file(str(text), ["fill_weights"], str(tmp_path / "out.onnx"))
    assert str(text) in str(err.value)
    with pytest.raises(TpuBuildError, match="cannot read the source model"):
        fetch.prepare_file(str(tmp_path / "missing.onnx"), ["fill_weights"], str(tmp_path / "out.onnx"))
    assert not (tmp_path / "out.onnx").exists()


def manifest(tmp_path: Path, source: str, name: str = "m") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"name: {name}\nsource: {source}\ninputs: [{{name: data_0, shape: [1, 3, 224, 224]}}]\n")
    return path


def test_source_forms(tmp_path):
    plain = load_manifest(manifest(tmp_path, "m.onnx"))
    assert (plain.source_kind, plain.prepare, plain.needs_fetch) == ("path", (), False)
    assert plain.source_path == (tmp_path / "m.onnx").resolve()
    prepared = load_manifest(manifest(tmp_path, "{path: sub/m.onnx, prepare: [fill_weights]}"))
    assert (prepared.source_kind, prepared.prepare, prepared.needs_fetch) == ("path", ("fill_weights",), True)
    assert prepared.source_path == (tmp_path / "sub" / "m.onnx").resolve()
    in_place = load_manifest(manifest(tmp_path, "{path: m.onnx, prepare: []}"))
    assert not in_place.needs_fetch
    pypi = load_manifest(
        manifest(tmp_path, f"{{pypi: onnx==1.23.2, member: a.onnx, sha256: '{'0' * 64}', prepare: [fill_weights]}}")
    )
    assert (pypi.source_kind, pypi.prepare, pypi.source_path) == ("pypi", ("fill_weights",), None)
    torch = load_manifest(manifest(tmp_path, "{torch: 'nets/net.py:make', example_shape: [1, 3, 8, 8]}"))
    assert torch.source_kind == "torch" and torch.needs_fetch


@pytest.mark.parametrize(
    "source, where, expected",
    [
        ("{path: m.onnx, prepare: [fill]}", "source.prepare[0]", "fill_weights"),
        ("{path: m.onnx, prepare: fill_weights}", "source.prepare", "list of preparation steps"),
        ("{path: m.txt}", "source.path", ".onnx"),
        ("{path: m.onnx, sha256: abc}", "source", "'sha256' was unexpected"),
        (f"{{pypi: a==1, member: b, sha256: '{'0' * 64}', prepare: [x]}}", "source.prepare[0]", "fill_weights"),
        ("{torch: 'net:make', example_shape: [1], prepare: [x]}", "source.prepare[0]", "fill_weights"),
        ("{torch: 'a b.py:make', example_shape: [1]}", None, None),
        ("{torch: 'nets/net.pt:make', example_shape: [1]}", "source.torch", "file.py:factory"),
    ],
)
def test_bad_sources_name_the_field(tmp_path, source, where, expected):
    path = manifest(tmp_path, source)
    if where is None:  # accepted
        load_manifest(path)
        return
    with pytest.raises(TpuBuildError) as err:
        load_manifest(path)
    line = next((ln for ln in str(err.value).splitlines() if ln.strip().startswith(f"{where}:")), None)
    assert line is not None, str(err.value)
    assert expected in line


def doit(tmp_path: Path, manifests: Path, *args: str) -> subprocess.CompletedProcess:
    return run_doit(*args, manifests=manifests, build=tmp_path / "build", timeout=None)


def test_prepare_steps_are_fetch_config(tmp_path):
    """Adding or removing a step refetches; a file source with steps gets a fetch task with the file as file_dep."""
    models = tmp_path / "models"
    models.mkdir()
    yaml = manifest(models, f"{{path: {SQUEEZENET}, prepare: [fill_weights]}}")
    fetched = tmp_path / "build" / "m" / "source.onnx"

    run = doit(tmp_path, models, "fetch:m")
    assert run.returncode == 0, run.stdout + run.stderr
    filled = fetched.read_bytes()
    assert "ConstantOfShape" not in {n.op_type for n in onnx.load_model_from_string(filled).graph.node}
    info = doit(tmp_path, models, "info", "fetch:m").stdout
    assert str(SQUEEZENET) in info, info
    assert "-- fetch:m" in doit(tmp_path, models, "fetch:m").stdout

    # same source, a step added: fetch runs again
    yaml.write_text(
        yaml.read_text().replace("prepare: [fill_weights]", "prepare: [fill_weights, normalize_activations]")
    )
    again = doit(tmp_path, models, "fetch:m")
    assert ".  fetch:m" in again.stdout, again.stdout
    assert fetched.read_bytes() != filled


def test_default_zoo_needs_no_torch():
    """`doit compile` over configs/models works without the torch extra: PyTorch manifests live in a subfolder."""
    from tpubuild.build.tasks import find_manifests

    kinds = {load_manifest(p).source_kind for p in find_manifests([str(REPO / "configs" / "models")])}
    assert "torch" not in kinds
    torch_dir = REPO / "configs" / "models" / "torch"
    assert {load_manifest(p).source_kind for p in torch_dir.glob("*.yaml")} == {"torch"}
