"""Bias correction (tpubuild/lower/bias.py): the mean error INT8 leaves in a conv's output channels is taken out
of its bias, and the search stage writes what it took (bias_correction.npz) for lowering to apply.

The conv's filters are made so that INT8's per-channel rounding errs the same way in each filter (every weight
but the largest sits 0.45 of a step above the grid): on positive inputs its output is then off by a mean, which
a global average pool keeps while it averages the noise away. The errors asserted are measured here, from TPU
inference against TOP inference, on inputs the correction never saw.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from tpubuild.build.chips import load_chip
from tpubuild.calib.calibrate import apply_table, calibrate
from tpubuild.frontend import convert_onnx
from tpubuild.ir import mlir
from tpubuild.lower.bias import bias_corrections
from tpubuild.lower.inference import dequantized
from tpubuild.lower.lowering import lower_module
from tpubuild.top.canonicalize import canonicalize
from tpubuild.top.inference import run
from tpubuild.testing import run_doit

BM1684X = load_chip("bm1684x")
SHAPE = (1, 3, 12, 12)


def _filters(rng, out_channels: int) -> np.ndarray:
    """Filters whose INT8 rounding is all one way: weights 0.45 of a step above the grid of their channel."""
    steps = rng.integers(-60, 60, size=(out_channels, 3, 3, 3)).astype(np.float64) + 0.45
    steps[:, 0, 0, 0] = 127  # the channel's largest: its scale is 1/127
    return (steps / 127).astype(np.float32)


def _model(make_model, tmp_path):
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="c1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="r1"),
        helper.make_node("GlobalAveragePool", ["r1"], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="flat"),
        helper.make_node("Gemm", ["flat", "wf", "bf"], ["logits"], name="logits", transB=1),
    ]
    inits = {
        "w1": _filters(rng, 8),
        "b1": np.full(8, 0.5, np.float32),
        "wf": (rng.standard_normal((4, 8)) * 0.5).astype(np.float32),
        "bf": np.zeros(4, np.float32),
    }
    path = tmp_path / "model.onnx"
    path.write_bytes(make_model(nodes, {"x": np.zeros(SHAPE, np.float32)}, initializers=inits).SerializeToString())
    return path


class Fitted:
    """The model calibrated and corrected on 16 samples; 8 more it never saw."""

    def __init__(self, make_model, tmp_path):
        module, weights = convert_onnx(_model(make_model, tmp_path), {"x": SHAPE}, "test", "origin_weights.npz")
        module, self.weights = canonicalize(module, weights, "canonical_weights.npz")
        rng = np.random.default_rng(11)
        samples = [{"x": rng.uniform(0, 1, SHAPE).astype(np.float32)} for _ in range(24)]
        fit, self.held_out = samples[:16], samples[16:]
        self.cali, _ = calibrate(module, self.weights, fit, "max")
        self.module = apply_table(module, self.cali)
        self.corrections = bias_corrections(
            self.module, self.weights, chip=BM1684X, cali=self.cali, asymmetric=False, samples=fit
        )

    def lower(self, corrections, qtable=None):
        return lower_module(
            self.module,
            self.weights,
            chip=BM1684X,
            mode="INT8",
            cali=self.cali,
            qtable=qtable,
            bias_corrections=corrections,
        )

    def mean_error(self, corrections) -> float:
        """The largest mean error of a logit over the held-out samples."""
        tpu, tw = self.lower(corrections)
        errors = []
        for s in self.held_out:
            got = dequantized(tpu, run(tpu, tw, s, all_tensors=False))[mlir.output_names(tpu)[0]]
            want = run(self.module, self.weights, s, all_tensors=False)[mlir.output_names(self.module)[0]]
            errors.append(got.astype(np.float64) - want)
        return float(np.abs(np.mean(errors, axis=0)).max())


@pytest.fixture
def fitted(make_model, tmp_path):
    return Fitted(make_model, tmp_path)


def test_correction_takes_the_mean_error_out(fitted):
    assert fitted.corrections, "the conv's mean error is many accumulator steps"
    plain, corrected = fitted.mean_error(None), fitted.mean_error(fitted.corrections)
    assert plain > 0.02  # the filters' rounding shows at the logits
    assert corrected < plain / 4


def _conv_and_head(tpu):
    ops = [op for op in mlir.body_ops(tpu) if op.name in ("tpu.Conv", "tpu.MatMul")]
    assert [op.name for op in ops] == ["tpu.Conv", "tpu.MatMul"]
    return ops


def test_the_float_head_is_corrected_for_the_int8_conv_before_it(fitted):
    conv_name, head_name = (op.loc_name for op in _conv_and_head(fitted.lower(None)[0]))
    assert {conv_name, head_name} <= set(fitted.corrections)
    plain, corrected = fitted.lower(None), fitted.lower(fitted.corrections)
    biases = [
        {op.loc_name: tw[mlir.value_name(op.operands[2])] for op in _conv_and_head(tpu)}
        for tpu, tw in (plain, corrected)
    ]
    assert not np.array_equal(biases[1][conv_name], biases[0][conv_name])  # int32, fewer accumulator steps
    np.testing.assert_allclose(biases[1][head_name], biases[0][head_name] - fitted.corrections[head_name], atol=1e-6)


def _manifest(tmp_path, make_model, extra: str = "") -> str:
    _model(make_model, tmp_path)
    rng = np.random.default_rng(5)
    (tmp_path / "calib").mkdir()
    for i in range(12):
        np.savez(tmp_path / "calib" / f"s{i:02d}.npz", x=rng.uniform(0, 1, SHAPE).astype(np.float32))
    text = (
        "name: bc\nsource: model.onnx\ninputs:\n  - {name: x, shape: [1, 3, 12, 12]}\n"
        f"calibration: {{data: 'calib/*.npz'{extra}}}\ntargets:\n  - {{chip: bm1684x, mode: INT8}}\n"
    )
    (tmp_path / "bc.yaml").write_text(text)
    return str(tmp_path / "bc.yaml")


@pytest.mark.parametrize("switch", ["", ", bias_correction: false"])
def test_the_search_stage_writes_what_lowering_applies(make_model, tmp_path, switch):
    manifest = _manifest(tmp_path, make_model, switch)
    build = tmp_path / "build"
    done = run_doit("lower:bc/bm1684x-INT8", manifests=manifest, build=build)
    assert done.returncode == 0, done.stdout + done.stderr
    target = build / "bc" / "bm1684x-INT8"
    with np.load(target / "bias_correction.npz") as z:
        corrections = {k: z[k] for k in z.files}
    weights = np.load(target / "tpu_weights.npz")
    conv = next(op for op in mlir.body_ops(mlir.load_module(target / "tpu.mlir")) if op.name == "tpu.Conv")
    bias = weights[conv.operands[2].owner.loc_name]
    if switch:
        assert corrections == {}
        assert "bias corrections" not in (target / "qtable.txt").read_text()
    else:
        assert conv.loc_name in corrections  # and the classifier's float head, after it
        # kept: INT8 alone does better with them over the search's pool
        assert f"bias corrections: {len(corrections)} ops, kept:" in (target / "qtable.txt").read_text()
    # the stored int32 bias is the float bias less the correction, on the accumulator's grid
    elem = conv.operands[2].type.element_type
    scales = np.asarray(elem.scale_list)
    want = 0.5 - corrections.get(conv.loc_name, np.zeros(8, np.float32)).astype(np.float64)
    np.testing.assert_array_equal(bias, np.round(want / scales).astype(np.int32))


def test_the_search_keeps_corrections_only_where_int8_does_better(fitted):
    from tpubuild.lower.search import SearchConfig, search

    def offered(corrections, config=None):
        return search(
            fitted.module,
            fitted.weights,
            chip=BM1684X,
            cali=fitted.cali,
            asymmetric=False,
            samples=fitted.held_out,
            config=config or SearchConfig(),
            bias_corrections=corrections,
        )

    good = offered(fitted.corrections)
    assert good.bias is not None and good.bias.kept and good.bias_corrections == fitted.corrections
    assert good.bias.corrected[1] < good.bias.plain[1] / 10
    # the same corrections the wrong way: INT8 does worse with them, and the search lowers without
    bad = offered({name: -3 * delta for name, delta in fitted.corrections.items()})
    assert bad.bias is not None and not bad.bias.kept and bad.bias_corrections == {}
    assert bad.int8_score == good.bias.plain[0] and "not kept" in bad.bias.line()
    # better, but short of a target that INT8 alone then misses: the search keeps tensors in float instead
    short = offered(fitted.corrections, SearchConfig(target_cos=1 - good.bias.corrected[1] / 100, max_lowerings=4))
    assert short.bias is not None and not short.bias.kept and short.bias_corrections == {}
    assert short.bias.corrected == good.bias.corrected and "below the target" in short.bias.line()


def test_corrections_a_pool_of_sure_inputs_cannot_judge_are_kept_unless_clearly_worse():
    from tpubuild.lower.search import BiasChoice

    # PP-OCR cls on 19 lines: a hair worse on the pool, while they fix an unsure input
    assert BiasChoice(52, (0.99951, 5.65e-5), (0.99941, 7.07e-5), 0.995).kept
    # twice as far from float at worst: clearly worse
    assert not BiasChoice(47, (0.995, 5.1e-3), (0.990, 6.2e-3), 0.98).kept
    # better, but INT8 alone still short of the target: the search runs on the plain model
    assert not BiasChoice(27, (0.958, 1.3e-2), (0.969, 9.0e-3), 0.995).kept
