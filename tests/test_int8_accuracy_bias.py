"""A dead filter's channel is its bias: INT8 must keep it (PP-OCRv4 rec has filters of 1e-40).

Per-channel weight scales follow max|w_c|, so such a channel's scale is 1e-42; its
bias in accumulator units then overflows int32 (and int64 in the cast) and its
requantization multiplier rounds to 0. The lowering raises the weight scale until
the bias fits (quant.bias_safe_scales), as TFLite's quantizer does.
"""

from __future__ import annotations

import numpy as np
from onnx import helper

from tpubuild.build.chips import load_chip
from tpubuild.calib.calibrate import apply_table, calibrate
from tpubuild.frontend import convert_onnx
from tpubuild.ir import mlir
from tpubuild.lower.lowering import lower_module
from tpubuild.lower.quant import BIAS_LIMIT, bias_safe_scales, quantize_bias
from tpubuild.top.canonicalize import canonicalize
from tpubuild.top.inference import run


def test_quantize_bias_saturates_with_the_right_sign():
    got = quantize_bias(np.array([0.5, -0.5, 3.0, np.inf], np.float32), np.array([1e-40, 1e-40, 1e-30, 1.0]))
    assert got.tolist() == [2**31 - 1, -(2**31), 2**31 - 1, 2**31 - 1]


def test_bias_safe_scales_only_raise_what_overflows():
    scales = np.array([0.01, 1e-42, 0.02])
    bias = np.array([5.0, 0.25, -3.0])
    got = bias_safe_scales(scales, bias, in_scale=0.1)
    assert got[0] == 0.01 and got[2] == 0.02
    assert got[1] == 0.25 / (0.1 * BIAS_LIMIT)
    assert np.all(np.abs(bias) / (0.1 * got) <= BIAS_LIMIT)


def test_a_dead_filter_keeps_its_bias_in_int8(make_model, tmp_path):
    import onnx

    rng = np.random.default_rng(2)
    w = (rng.standard_normal((3, 2, 3, 3)) * 0.5).astype(np.float32)
    w[1] = 1e-40  # a dead filter, as trained networks have
    b = np.array([0.1, 0.7, -0.2], np.float32)
    model = make_model(
        [helper.make_node("Conv", ["x", "w", "b"], ["y"], name="y", pads=[1, 1, 1, 1])],
        {"x": np.zeros((1, 2, 6, 6), np.float32)},
        initializers={"w": w, "b": b},
    )
    onnx.save(model, tmp_path / "m.onnx")
    module, weights = canonicalize(*convert_onnx(tmp_path / "m.onnx", {"x": (1, 2, 6, 6)}, "m", "w.npz"), "c.npz")
    samples = [{"x": rng.uniform(-1, 1, (1, 2, 6, 6)).astype(np.float32)} for _ in range(4)]
    cali, _ = calibrate(module, weights, samples, "max")
    tm, tw = lower_module(apply_table(module, cali), weights, chip=load_chip("bm1684x"), mode="INT8", cali=cali)
    (out,) = mlir.output_names(tm)
    y = run(tm, tw, samples[0], all_tensors=False)[out]
    step = cali["y"].threshold / 127
    np.testing.assert_allclose(y[0, 1], 0.7, atol=step)  # the dead channel is its bias
    ref = run(module, weights, samples[0])["y"]
    np.testing.assert_allclose(y, ref, atol=4 * step)
