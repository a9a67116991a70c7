"""Calibration of a real model: the stage's table and cali.mlir, user tables, data loading, memory."""

from __future__ import annotations

import gc
import os
import shutil
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from tpubuild.build import stages
from tpubuild.calib.calibrate import AUTO_CANDIDATES, BOUNDED, activation_values, calibrate, collect_stats
from tpubuild.calib.data import InputSpec, Samples, find_files, preprocess_image
from tpubuild.calib.stats import batch_stats
from tpubuild.calib.table import Entry, format_table, read_table
from tpubuild.calib.thresholds import threshold
from tpubuild.errors import TpuBuildError
from tpubuild.ir import mlir
from tpubuild.ir.quant import CalibratedType
from tpubuild.top.inference import infer_file, run, weights_for
from tpubuild.testing import upstream_check

REPO = Path(__file__).resolve().parents[1]
PHOTOS = sorted((REPO / "models" / "calib" / "photos").glob("*.jpg"))
PREPROCESS = {
    "mean": [123.675, 116.28, 103.53],
    "scale": [0.0171, 0.0175, 0.0174],
    "pixel_format": "rgb",
    "resize": [32, 32],
}
INPUTS = [{"name": "input", "shape": [1, 3, 32, 32], "dtype": "float32", "preprocess": PREPROCESS}]


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    """build/demo_cnn/canonical.mlir (+ weights) of the shipped demo CNN."""
    root = tmp_path_factory.mktemp("demo")
    stages.transform(
        str(REPO / "models" / "demo_cnn.onnx"),
        [{k: v for k, v in INPUTS[0].items() if k != "preprocess"}],
        "demo_cnn",
        None,
        str(root / "origin.mlir"),
        str(root / "origin_weights.npz"),
        str(root / "input.npz"),
    )
    stages.canonicalize(
        str(root / "origin.mlir"),
        str(root / "origin_weights.npz"),
        str(root / "canonical.mlir"),
        str(root / "canonical_weights.npz"),
    )
    return root / "canonical.mlir"


def calibrate_stage(demo: Path, out: Path, *, method="kl", count=8, files=PHOTOS, table=None) -> tuple[Path, Path]:
    out.mkdir(exist_ok=True)
    shutil.copy(demo.parent / "canonical_weights.npz", out / "canonical_weights.npz")
    cali, tab = out / "cali.mlir", out / "cali_table"
    stages.calibrate(
        "demo_cnn",
        str(demo),
        INPUTS,
        [str(f) for f in files],
        count,
        method,
        str(table) if table else None,
        str(cali),
        str(tab),
    )
    return cali, tab


def calibrated_types(module) -> dict[str, CalibratedType]:
    return {
        name: v.type.element_type
        for name, v in activation_values(module).items()
        if isinstance(v.type.element_type, CalibratedType)
    }


def test_shipped_photos_exist():
    assert len(PHOTOS) >= 32


def test_stage_writes_table_and_cali_mlir(demo, tmp_path):
    cali, tab = calibrate_stage(demo, tmp_path)
    header, entries = read_table(tab)
    canonical = mlir.load_module(demo)
    names = list(activation_values(canonical))
    assert list(entries) == names and "input" in names
    # 8 samples read, the fifth held back for validation
    assert "# method: kl" in header and "# sample number: 7" in header and "# model: demo_cnn" in header
    module = mlir.load_module(cali)
    assert mlir.module_attr(module, "state") == "TOP_CALIBRATED"
    assert mlir.module_attr(module, "weight_file") == "canonical_weights.npz"
    types = calibrated_types(module)
    assert set(types) == set(names)
    for name, e in entries.items():
        assert 0 < e.threshold <= max(-e.min, e.max)
        lo, hi = (-e.threshold if e.min < 0 else 0.0), e.threshold
        assert (types[name].min.data, types[name].max.data) == (lo, hi), name


def test_relu_outputs_are_unsigned_ranges(demo, tmp_path):
    _, tab = calibrate_stage(demo, tmp_path)
    entries = read_table(tab)[1]
    assert entries["stem.relu"].min == 0.0  # Conv with fused ReLU
    assert entries["block2.relu6"].max <= 6.0
    assert entries["input"].min < 0  # normalized pixels


def test_cali_mlir_parses_upstream_and_runs(demo, tmp_path):
    cali, _ = calibrate_stage(demo, tmp_path)
    upstream_check(cali, "-o", os.devnull)
    assert "!quant.calibrated<f32<" in cali.read_text()
    x = {"input": preprocess_image(PHOTOS[0], InputSpec.of(INPUTS[0]))[None]}
    got = infer_file(cali, x)
    ref = infer_file(demo, x)
    assert set(got) == set(ref)
    for name in ref:
        np.testing.assert_array_equal(got[name], ref[name], err_msg=name)
        assert got[name].dtype == np.float32


def test_deterministic(demo, tmp_path):
    a = calibrate_stage(demo, tmp_path / "a", method="auto")
    b = calibrate_stage(demo, tmp_path / "b", method="auto")
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]


def test_streaming_stats_equal_batch_stats(demo):
    """Stats from the observer (tensors freed as they die) equal those of full dumps of every sample."""
    module = mlir.load_module(demo)
    weights = weights_for(module, demo)
    samples = list(Samples.of(PHOTOS[:6], INPUTS))
    stats, n = collect_stats(module, weights, samples)
    assert n == 6
    dumps = [run(module, weights, s) for s in samples]
    for name, s in stats.items():
        b = batch_stats([d[name] for d in dumps])
        np.testing.assert_array_equal(s.hist, b.hist, err_msg=name)
        assert (s.min, s.max, s.range, s.zeros) == (b.min, b.max, b.range, b.zeros), name


def test_two_processes_give_the_same_statistics_and_outputs(demo):
    """collect_stats with a forked process for the odd samples: the same statistics as one process's (bit for
    bit), and every sample's outputs, in the samples' order."""
    module = mlir.load_module(demo)
    weights = weights_for(module, demo)
    samples = Samples.of(PHOTOS[:5], INPUTS)
    one_out, two_out = [], []
    one, n1 = collect_stats(module, weights, samples, one_out)
    two, n2 = collect_stats(module, weights, samples, two_out, processes=2)
    assert n1 == n2 == 5 and list(one) == list(two)
    for name in one:
        np.testing.assert_array_equal(one[name].hist, two[name].hist, err_msg=name)
        assert (one[name].min, one[name].max, one[name].range, one[name].zeros, one[name].samples) == (
            two[name].min,
            two[name].max,
            two[name].range,
            two[name].zeros,
            two[name].samples,
        ), name
    assert len(two_out) == 5
    for (s1, o1), (s2, o2) in zip(one_out, two_out, strict=True):
        np.testing.assert_array_equal(s1["input"], s2["input"])
        assert all(np.array_equal(a, b) for a, b in zip(o1, o2, strict=True))


def test_two_processes_give_the_same_auto_table(demo):
    """auto's candidates and tuning with a forked process taking every other tensor and sample: the same
    thresholds as one process's, bit for bit."""
    module = mlir.load_module(demo)
    weights = weights_for(module, demo)
    samples = Samples.of(PHOTOS, INPUTS, 8)
    one, _ = calibrate(module, weights, samples, "auto", processes=1)
    two, _ = calibrate(module, weights, samples, "auto", processes=2)
    assert one == two
    # the tuned tensors took other thresholds than their first candidate somewhere: the tuning decided
    stats, _ = collect_stats(module, weights, samples, hold_back=True)
    assert any(two[name].threshold != threshold(s, AUTO_CANDIDATES[0]) for name, s in stats.items())


def test_an_error_in_the_second_process_names_the_tensor(demo):
    """A sample the forked process calibrates (the second) holds NaN: the error says so here, with the tensor."""
    module = mlir.load_module(demo)
    weights = weights_for(module, demo)
    samples = list(Samples.of(PHOTOS[:2], INPUTS))
    samples[1] = {"input": np.full_like(samples[1]["input"], np.nan)}
    with pytest.raises(TpuBuildError, match="cannot calibrate: the tensor holds NaN") as err:
        collect_stats(module, weights, samples, processes=2)
    assert err.value.loc == "input"


def test_auto_picks_a_candidate_per_tensor(demo):
    module = mlir.load_module(demo)
    weights = weights_for(module, demo)
    samples = Samples.of(PHOTOS, INPUTS, 8)
    stats, _ = collect_stats(module, weights, samples, hold_back=True)
    entries, header = calibrate(module, weights, samples, "auto")
    assert "tune number: 7" in header  # the 7 samples of the statistics (the fifth is held back)
    picked = set()
    bounded = {name for name, v in activation_values(module).items() if isinstance(v.owner, BOUNDED)}
    for name, e in entries.items():
        if name in bounded:  # their bound or max, whatever the method
            continue
        cands = {m: threshold(stats[name], m) for m in AUTO_CANDIDATES}
        assert e.threshold in cands.values(), name
        picked |= {m for m, t in cands.items() if t == e.threshold}
    assert len(picked) > 1  # not one method in disguise


def test_changing_method_changes_thresholds(demo, tmp_path):
    _, kl = calibrate_stage(demo, tmp_path / "kl", method="kl")
    _, mx = calibrate_stage(demo, tmp_path / "max", method="max")
    a, b = read_table(kl)[1], read_table(mx)[1]
    assert all(a[n].threshold <= b[n].threshold for n in a)
    assert any(a[n].threshold < b[n].threshold for n in a)


# ---- user tables -------------------------------------------------------------


def test_user_table_entries_win(demo, tmp_path):
    _, computed = calibrate_stage(demo, tmp_path / "first")
    user = tmp_path / "user_table"
    user.write_text("# edited by hand\nblock1.b.bn 1.25 -9.0 6.0\n")
    cali, tab = calibrate_stage(demo, tmp_path / "second", table=user)
    entries, before = read_table(tab)[1], read_table(computed)[1]
    assert entries["block1.b.bn"] == Entry(1.25, -9.0, 6.0)
    assert all(entries[n] == before[n] for n in before if n != "block1.b.bn")
    t = calibrated_types(mlir.load_module(cali))["block1.b.bn"]
    assert (t.min.data, t.max.data) == (-1.25, 1.25)


def test_full_user_table_needs_no_data(demo, tmp_path):
    _, computed = calibrate_stage(demo, tmp_path / "first")
    entries = {n: Entry(e.threshold * 0.5, e.min, e.max) for n, e in read_table(computed)[1].items()}
    user = tmp_path / "user_table"
    user.write_text(format_table(entries))
    _, tab = calibrate_stage(demo, tmp_path / "second", files=[], table=user)
    header, got = read_table(tab)
    assert got == entries
    assert any("user table" in h for h in header)


def test_user_table_with_unknown_tensor_is_refused(demo, tmp_path):
    user = tmp_path / "user_table"
    user.write_text("no_such_tensor 1.0 0.0 1.0\n")
    with pytest.raises(TpuBuildError, match="no_such_tensor"):
        calibrate_stage(demo, tmp_path / "out", table=user)
    assert not (tmp_path / "out" / "cali.mlir").exists()


def test_no_data_is_a_clear_error(demo, tmp_path):
    with pytest.raises(TpuBuildError, match="calibration.data"):
        calibrate_stage(demo, tmp_path, files=[])


def test_non_f32_module_is_refused(demo, tmp_path):
    cali, _ = calibrate_stage(demo, tmp_path / "a")
    with pytest.raises(TpuBuildError, match="TOP_F32"):
        stages.calibrate(
            "demo_cnn",
            str(cali),
            INPUTS,
            [str(PHOTOS[0])],
            1,
            "kl",
            None,
            str(tmp_path / "b.mlir"),
            str(tmp_path / "b_table"),
        )


# ---- calibration data --------------------------------------------------------


def test_find_files_sorted_and_filtered(tmp_path):
    for name in ("b.npz", "a.npy", "c.png", "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in find_files("*", tmp_path)] == ["a.npy", "b.npz", "c.png"]


def test_npz_and_npy_samples(tmp_path):
    rng = np.random.default_rng(0)
    one = rng.standard_normal((1, 3, 4, 4)).astype(np.float32)
    stack = rng.standard_normal((5, 1, 3, 4, 4)).astype(np.float32)
    np.savez(tmp_path / "a.npz", whatever=one)
    np.save(tmp_path / "b.npy", stack)
    specs = [{"name": "x", "shape": [1, 3, 4, 4]}]
    got = list(Samples.of(find_files("*", tmp_path), specs))
    assert len(got) == 6
    np.testing.assert_array_equal(got[0]["x"], one)
    np.testing.assert_array_equal(np.stack([g["x"] for g in got[1:]]), stack)
    assert len(list(Samples.of(find_files("*", tmp_path), specs, count=3))) == 3


def test_npz_with_two_inputs(tmp_path):
    np.savez(tmp_path / "s.npz", a=np.ones((2, 2), np.float32), b=np.zeros((3,), np.int64))
    specs = [{"name": "a", "shape": [2, 2]}, {"name": "b", "shape": [3], "dtype": "int64"}]
    (sample,) = Samples.of([tmp_path / "s.npz"], specs)
    assert sample["b"].dtype == np.int64 and sample["a"].shape == (2, 2)
    with pytest.raises(TpuBuildError, match="no array for input"):
        list(Samples.of([tmp_path / "s.npz"], [*specs, {"name": "c", "shape": [1]}]))


def test_wrong_shape_is_named(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((2, 2), np.float32))
    with pytest.raises(TpuBuildError, match=r"shape \[2, 2\]; expected \[1, 3, 4, 4\]"):
        list(Samples.of([tmp_path / "x.npy"], [{"name": "x", "shape": [1, 3, 4, 4]}]))


@pytest.mark.parametrize("fmt", ["rgb", "bgr"])
def test_image_preprocess(tmp_path, fmt):
    """A 2x3 image, no resize: (pixel - mean) * scale per channel, channels first, in the asked order."""
    from PIL import Image

    pixels = np.arange(18, dtype=np.uint8).reshape(2, 3, 3) * 10
    Image.fromarray(pixels, "RGB").save(tmp_path / "img.png")
    spec = InputSpec.of(
        {
            "name": "x",
            "shape": [1, 3, 2, 3],
            "preprocess": {"mean": [1, 2, 3], "scale": [0.5, 0.25, 2.0], "pixel_format": fmt},
        }
    )
    got = preprocess_image(tmp_path / "img.png", spec)
    chw = pixels.astype(np.float32).transpose(2, 0, 1)
    if fmt == "bgr":
        chw = chw[::-1]
    expect = (chw - np.array([1, 2, 3], np.float32)[:, None, None]) * np.array([0.5, 0.25, 2.0], np.float32)[
        :, None, None
    ]
    np.testing.assert_allclose(got, expect, rtol=1e-6)


def test_image_gray_resize_and_crop(tmp_path):
    from PIL import Image

    Image.new("RGB", (40, 20), (90, 90, 90)).save(tmp_path / "img.png")
    spec = InputSpec.of({"name": "x", "shape": [2, 1, 8, 8], "preprocess": {"pixel_format": "gray", "resize": [8, 12]}})
    got = list(
        Samples.of([tmp_path / "img.png"] * 4, [{"name": "x", "shape": [2, 1, 8, 8], "preprocess": spec.preprocess}])
    )
    assert len(got) == 2 and got[0]["x"].shape == (2, 1, 8, 8)
    np.testing.assert_array_equal(got[0]["x"], np.full((2, 1, 8, 8), 90.0, np.float32))


def test_image_preprocess_channels_last(tmp_path):
    """A TensorFlow export's [N, H, W, 3] input gets the pixels NCHW would, channels last; a shape both layouts
    fit ([1, 3, 3, 3]) is NCHW unless channel_format says NHWC."""
    from PIL import Image

    pixels = (np.arange(27, dtype=np.uint8).reshape(3, 3, 3) * 9)[:, :, ::-1]
    Image.fromarray(np.ascontiguousarray(pixels), "RGB").save(tmp_path / "img.png")
    pre = {"mean": [1, 2, 3], "scale": [0.5, 0.25, 2.0], "pixel_format": "bgr"}
    chw = preprocess_image(tmp_path / "img.png", InputSpec.of({"name": "x", "shape": [1, 3, 3, 3], "preprocess": pre}))
    nhwc = {"name": "x", "shape": [2, 3, 3, 3], "preprocess": {**pre, "channel_format": "nhwc"}}
    (sample,) = Samples.of([tmp_path / "img.png"] * 2, [nhwc])
    assert sample["x"].shape == (2, 3, 3, 3)
    np.testing.assert_array_equal(sample["x"][1], chw.transpose(1, 2, 0))
    assert not np.array_equal(chw, chw.transpose(1, 2, 0))  # (the layouts differ on this image)
    Image.new("RGB", (4, 5), (10, 20, 30)).save(tmp_path / "tall.png")
    (sample,) = Samples.of([tmp_path / "tall.png"], [{"name": "x", "shape": [1, 5, 4, 3]}])
    np.testing.assert_array_equal(sample["x"][0, 4, 3], [10, 20, 30])  # NHWC from the shape alone


@pytest.mark.parametrize(
    ("shape", "channel_format", "message"),
    [
        ([1, 16], None, "an NCHW or NHWC input with 1 or 3 channels"),
        ([1, 4, 8, 8], None, "an NCHW or NHWC input with 1 or 3 channels"),
        ([1, 8, 8, 3], "nchw", "an NCHW input with 1 or 3 channels"),
    ],
)
def test_images_need_an_image_input(tmp_path, shape, channel_format, message):
    from PIL import Image

    Image.new("RGB", (4, 4)).save(tmp_path / "img.png")
    pre = {"channel_format": channel_format} if channel_format else None
    with pytest.raises(TpuBuildError, match=message):
        list(Samples.of([tmp_path / "img.png"], [{"name": "x", "shape": shape, "preprocess": pre}]))


def test_images_for_a_two_input_model_name_the_inputs_and_the_fixed_value_way_out(tmp_path):
    """PaddleDetection exports take a scale factor beside the image (rapid_table_det's obj_det)."""
    from PIL import Image

    Image.new("RGB", (4, 4)).save(tmp_path / "img.png")
    specs = [{"name": "image", "shape": [1, 3, 4, 4]}, {"name": "scale_factor", "shape": [1, 2]}]
    with pytest.raises(TpuBuildError, match=r"has 2 \(image, scale_factor\)") as err:
        list(Samples.of([tmp_path / "img.png"], specs))
    assert "fixed `value`" in (err.value.hint or "")


def test_unreadable_image_names_the_file(tmp_path):
    (tmp_path / "bad.png").write_bytes(b"not a png")
    with pytest.raises(TpuBuildError, match="bad.png"):
        list(Samples.of([tmp_path / "bad.png"], INPUTS))


# ---- memory ------------------------------------------------------------------


def _peak_bytes(demo: Path, samples: Path, count: int) -> int:
    module = mlir.load_module(demo)
    weights = weights_for(module, demo)
    data = Samples.of([samples], [{"name": "input", "shape": [1, 3, 32, 32]}], count)
    # both traced runs start from the same state: lazy caches (kernels, op params) filled, garbage collected
    calibrate(module, weights, Samples.of([samples], [{"name": "input", "shape": [1, 3, 32, 32]}], 2), "kl")
    gc.collect()
    tracemalloc.start()
    try:
        calibrate(module, weights, data, "kl")
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_does_not_grow_with_samples(demo, tmp_path):
    """Peak traced memory for 200 samples is within 10 % of that for 50 (numpy reports to tracemalloc)."""
    rng = np.random.default_rng(0)
    np.save(tmp_path / "samples.npy", rng.uniform(-2, 2, (200, 1, 3, 32, 32)).astype(np.float32))
    small = _peak_bytes(demo, tmp_path / "samples.npy", 50)
    large = _peak_bytes(demo, tmp_path / "samples.npy", 200)
    assert large < small * 1.1, (small, large)


# ---- auto: the tuning step ---------------------------------------------------


def test_tune_prefers_the_candidate_that_disturbs_consumers_least(make_model, convert):
    """x -> Relu -> Mul by 2: a far too wide (all rounds to 0) or far too narrow range loses to a sane one."""
    from onnx import helper

    from tpubuild.calib.tune import tune

    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Mul", ["r", "two"], ["y"])]
    model = make_model(nodes, {"x": x}, initializers={"two": np.float32(2.0)})
    module, weights = convert(model, {"x": [1, 64]})
    samples = [{"x": rng.standard_normal((1, 64)).astype(np.float32)} for _ in range(4)]
    for cands in ([1000.0, 4.0], [0.01, 4.0], [4.0, 1000.0]):
        chosen = tune(module, weights, samples, {"x": cands}, {"x": 127})
        assert chosen == {"x": 4.0}, cands
    # a graph output has no consumer: it is judged on itself
    outs = mlir.output_names(module)
    chosen = tune(module, weights, samples, {outs[0]: [0.001, 9.0]}, {outs[0]: 255})
    assert chosen[outs[0]] == 9.0


@pytest.mark.parametrize("method", ["kl", "percentile", "mse"])
def test_bounded_outputs_keep_their_whole_range(make_model, convert, method):
    """A sigmoid map that is mostly ~0 with a few pixels ~1 (a detector's text map): clipping methods
    would cut the rare high values, which are the signal; a bounded op's threshold is its max."""
    from onnx import helper

    from tpubuild.calib.calibrate import compute_entries

    rng = np.random.default_rng(0)

    def sample():  # as PP-OCRv4 det's map: 87% near 0, 12% near 1, a few values between (KL alone: 0.24)
        x = rng.normal(-12.0, 2.0, (1, 1, 64, 64))
        x[..., :8, :] = rng.normal(8.0, 1.5, (1, 1, 8, 64))
        x[..., 8:9, :] = rng.uniform(-5.0, 5.0, (1, 1, 1, 64))
        return {"x": x.astype(np.float32)}

    nodes = [helper.make_node("Sigmoid", ["x"], ["p"]), helper.make_node("Relu", ["x"], ["r"])]
    model = make_model(nodes, sample(), outputs=["p", "r"])
    module, weights = convert(model, {"x": [1, 1, 64, 64]})
    stats, _ = collect_stats(module, weights, [sample() for _ in range(4)])
    entries = compute_entries(module, weights, stats, method)
    assert entries["p"].threshold == pytest.approx(stats["p"].max, rel=1e-3) and entries["p"].threshold > 0.99
    assert entries["r"].threshold == threshold(stats["r"], method)  # unbounded: the method decides


def test_saturating_readers_bound_the_threshold(make_model, convert):
    """A tensor read only by HardSigmoid / Sigmoid needs no threshold past where their stored result stops
    changing: HardSigmoid(x/6 + 1/2) is 1 from x = 3; a 16-bit sigmoid result is 0 up to -ln(2^17 - 3). The INT8
    result is then as close to float as with the wide threshold (nothing is lost), and closer on the slope."""
    from onnx import helper

    from tpubuild.build.chips import load_chip
    from tpubuild.calib.calibrate import RESULT_LEVELS, apply_table, compute_entries
    from tpubuild.lower.inference import dequantized
    from tpubuild.lower.lowering import lower_module

    rng = np.random.default_rng(0)

    def sample():
        return {"x": rng.normal(0.0, 1.5, (1, 64, 8, 8)).astype(np.float32)}

    # the convolutions' results: mostly on the slope, 4 channels far past it (as a squeeze-excite gate
    # input calibrated to 95)
    offsets = np.where(np.arange(64) < 4, 100.0, 0.0).astype(np.float32) * np.array([1, -1] * 32, np.float32)

    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"]),
        helper.make_node("HardSigmoid", ["c"], ["g"], alpha=1.0 / 6, beta=0.5),
        helper.make_node("Conv", ["x", "w", "b"], ["d"]),
        helper.make_node("Sigmoid", ["d"], ["s"]),
        helper.make_node("Conv", ["x", "w", "b"], ["e"]),
        helper.make_node("HardSigmoid", ["e"], ["h"]),
        helper.make_node("Relu", ["e"], ["r"]),
    ]
    model = make_model(
        nodes,
        sample(),
        outputs=["g", "s", "h", "r", "c"],
        initializers={"w": np.eye(64, dtype=np.float32).reshape(64, 64, 1, 1), "b": offsets},
    )
    module, weights = convert(model, {"x": [1, 64, 8, 8]})
    samples = [sample() for _ in range(4)]
    stats, _ = collect_stats(module, weights, samples)
    entries = compute_entries(module, weights, stats, "max")
    assert stats["c"].absmax > 95
    assert entries["d"].threshold == pytest.approx(np.log(2 * RESULT_LEVELS / entries["s"].threshold - 1))
    # c is also a graph output, e is also read by a Relu: their values past the bound still matter
    assert entries["c"].threshold == threshold(stats["c"], "max")
    assert entries["e"].threshold == threshold(stats["e"], "max")
    wide = {**entries, "c": Entry(threshold(stats["c"], "max"), entries["c"].min, entries["c"].max)}
    mc = model.graph.output
    del mc[-1]  # c no longer a graph output: HardSigmoid is its only reader
    module, weights = convert(model, {"x": [1, 64, 8, 8]})
    entries = compute_entries(module, weights, stats, "max")
    assert entries["c"].threshold == pytest.approx(3.0, rel=1e-6)
    chip = load_chip("bm1684x")
    test = sample()
    ref = run(module, weights, test)["g"]
    errors = []
    for table in (wide, entries):
        tpu, w = lower_module(apply_table(module, table), weights, chip=chip, mode="INT8", cali=table)
        out = dequantized(tpu, run(tpu, w, test))
        errors.append(float(np.max(np.abs(np.asarray(out["g"], np.float64).reshape(ref.shape) - ref))))
    assert errors[1] < 0.01 and errors[1] < errors[0] / 10, errors  # the input's and the gate's rounding


def test_saturating_readers_bound_the_threshold_through_moves(make_model, convert):
    """YOLOv8's class logits reach their Sigmoid through Reshape and Concat, and run 40 below zero where the
    sigmoid's result stopped changing at -12: the bound reaches back through ops that only move values. A value
    that a move passes on to a reader that does not saturate (here a Relu) keeps the method's threshold."""
    from onnx import helper

    from tpubuild.calib.calibrate import RESULT_LEVELS, compute_entries

    rng = np.random.default_rng(3)

    def sample():
        return {"x": rng.normal(-20.0, 10.0, (1, 3, 4, 4)).astype(np.float32)}

    shape = np.array([1, 3, 16], np.int64)
    nodes = [
        helper.make_node("Reshape", ["x", "shape"], ["flat"]),
        helper.make_node("Neg", ["x"], ["y"]),
        helper.make_node("Reshape", ["y", "shape"], ["flat_y"]),
        helper.make_node("Concat", ["flat", "flat_y"], ["joint"], axis=2),
        helper.make_node("Sigmoid", ["joint"], ["s"]),
        helper.make_node("Abs", ["x"], ["z"]),
        helper.make_node("Transpose", ["z"], ["zt"], perm=[0, 2, 3, 1]),
        helper.make_node("Sigmoid", ["zt"], ["zs"]),
        helper.make_node("Relu", ["zt"], ["zr"]),
    ]
    model = make_model(nodes, sample(), outputs=["s", "zs", "zr"], initializers={"shape": shape})
    module, weights = convert(model, {"x": [1, 3, 4, 4]})
    stats, _ = collect_stats(module, weights, [sample() for _ in range(4)])
    entries = compute_entries(module, weights, stats, "max")
    bound = np.log(2 * RESULT_LEVELS / entries["s"].threshold - 1)
    assert stats["x"].absmax > 3 * bound
    for name in ("flat", "y", "flat_y", "joint"):
        assert entries[name].threshold == pytest.approx(bound), name
    for name in ("x", "z", "zt"):  # x: Neg and Abs read it too
        assert entries[name].threshold == threshold(stats[name], "max"), name


def test_small_vectors_take_their_max(make_model, convert):
    """Pooled features and logits: a few hundred values per sample, each one signal; the histogram
    methods would clip the channel that decides the output. Larger tensors are the method's."""
    from onnx import helper

    from tpubuild.calib.calibrate import VECTOR_SIZE, compute_entries

    rng = np.random.default_rng(1)

    def sample(n):
        x = rng.standard_normal((1, n)).astype(np.float32)
        x[0, 0] = 12.0  # one channel far above the rest, in every image
        return x

    nodes = [helper.make_node("Relu", ["v"], ["rv"]), helper.make_node("Relu", ["m"], ["rm"])]
    n_small, n_big = VECTOR_SIZE // 4, VECTOR_SIZE * 4
    model = make_model(nodes, {"v": sample(n_small), "m": sample(n_big)}, outputs=["rv", "rm"])
    module, weights = convert(model, {"v": [1, n_small], "m": [1, n_big]})
    samples = [{"v": sample(n_small), "m": sample(n_big)} for _ in range(8)]
    stats, _ = collect_stats(module, weights, samples)
    entries = compute_entries(module, weights, stats, "kl")
    assert threshold(stats["v"], "kl") < 6.0 and threshold(stats["m"], "kl") < 6.0  # KL clips the channel
    assert entries["v"].threshold == entries["rv"].threshold == pytest.approx(12.0)
    assert entries["m"].threshold == threshold(stats["m"], "kl")
