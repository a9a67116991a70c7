"""A QDQ model's own quantization (tpubuild/calib/qdq.py): its INT8 target stores the integers the model's
QuantizeLinear nodes compute, instead of quantizing them again on thresholds of its own.

The models are onnxruntime's: a small float CNN quantized by ``quantize_static`` (QDQ, per-channel int8
weights, int8 activations), and what is compared is TOP inference of that model (which computes what
onnxruntime does) against TPU inference of its INT8 lowering with no quantize table.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from tpubuild.build.chips import load_chip
from tpubuild.calib import calibrate as calibrate_module
from tpubuild.calib.calibrate import apply_table, calibrate
from tpubuild.calib import qdq as qdq_module
from tpubuild.calib.qdq import qdq_entries
from tpubuild.frontend import convert_onnx
from tpubuild.ir import mlir
from tpubuild.lower.lowering import lower_module
from tpubuild.testing import save_onnx
from tpubuild.top.canonicalize import canonicalize
from tpubuild.top.inference import run
from tpubuild.verify.similarity import cosine

SHAPE = (1, 3, 16, 16)


def _samples(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.uniform(-1, 1, SHAPE).astype(np.float32)} for _ in range(n)]


def _qdq_model(tmp_path, symmetric: bool, activations: str = "QInt8") -> str:
    """conv-relu-conv-prelu-maxpool-conv with a residual add-GAP-gemm, quantized by onnxruntime (QDQ; int8 or
    uint8 activations, ``activations``; with ``symmetric``, every activation zero point 0). onnxruntime leaves
    the PReLU in float, between a DequantizeLinear and the MaxPool's QuantizeLinear."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    rng = np.random.default_rng(3)

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32)

    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("PRelu", ["c2", "slope"], ["r2"]),
        helper.make_node("MaxPool", ["r2"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p", "w3", "b3"], ["c3"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c3", "p"], ["res"]),
        helper.make_node("GlobalAveragePool", ["res"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("Gemm", ["f", "fc", "fb"], ["y"]),
    ]
    weights = {"slope": rng.uniform(0.05, 0.3, (16, 1, 1)).astype(np.float32)}
    weights |= {"w1": w(16, 3, 3, 3), "b1": w(16), "w2": w(16, 16, 3, 3), "b2": w(16)}
    weights |= {"w3": w(16, 16, 3, 3), "b3": w(16), "fc": w(16, 10), "fb": w(10)}
    save_onnx(tmp_path / "f.onnx", nodes, {"x": list(SHAPE)}, {"y": [1, 10]}, weights)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.samples = iter(_samples(16, 0))

        def get_next(self):
            return next(self.samples, None)

    quantize_static(
        str(tmp_path / "f.onnx"),
        str(tmp_path / "q.onnx"),
        Reader(),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType[activations],
        weight_type=QuantType.QInt8,
        extra_options={"ActivationSymmetric": symmetric},
    )
    return str(tmp_path / "q.onnx")


def _canonical(path: str):
    module, weights = convert_onnx(path, {"x": SHAPE}, "qdq", "origin_weights.npz")
    return canonicalize(module, weights, "canonical_weights.npz")


def _int8_vs_top(path: str) -> tuple[dict, dict, dict, dict]:
    """The calibration table (statistics of the ORT calibration samples' kind), TOP's and TPU INT8's tensors on
    a held-out sample, and the result type of each tpu.PRelu by name."""
    module, weights = _canonical(path)
    cali, _ = calibrate(module, weights, _samples(16, 1), "auto")
    tm, tw = lower_module(
        apply_table(module, cali), weights, chip=load_chip("bm1684x"), mode="INT8", cali=cali, qtable=None
    )
    sample = _samples(1, 2)[0]
    prelus = {op.loc_name: str(op.results[0].type) for op in tm.walk() if op.name == "tpu.PRelu"}
    return cali, run(module, weights, sample), run(tm, tw, sample), prelus


def _agreement(top: dict, tpu: dict) -> float:
    """The share of the model's quantized activation integers (its QuantizeLinear results) INT8 stores alike."""
    names = [n for n, a in top.items() if n.endswith("_QuantizeLinear_Output") and a.dtype.itemsize == 1 and n in tpu]
    assert len(names) >= 4, names
    same = sum(int(np.sum(top[n] == tpu[n])) for n in names)
    return same / sum(top[n].size for n in names)


def test_a_symmetric_qdq_model_is_stored_on_its_own_grid(tmp_path, monkeypatch):
    path = _qdq_model(tmp_path, symmetric=True)
    model = onnx.load(path)
    scales = {
        node.input[0]: float(numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == node.input[1])))
        for node in model.graph.node
        if node.op_type == "QuantizeLinear" and not any(i.name == node.input[0] for i in model.graph.initializer)
    }
    cali, top, tpu, _ = _int8_vs_top(path)
    # the tensor each QuantizeLinear reads is stored on the model's grid: 127 steps of its scale
    for name, scale in scales.items():
        assert cali[name].threshold == pytest.approx(127 * scale, rel=1e-6), name
    with_grid = _agreement(top, tpu)
    (out,) = [n for n in top if n == "y"]
    cos_with = cosine(tpu[out], top[out])
    assert with_grid == 1.0 and cos_with >= 0.999999

    # statistics alone re-quantize the model's integers on grids of their own
    monkeypatch.setattr(calibrate_module, "qdq_entries", lambda module, weights: {})
    cali_stats, top, tpu, _ = _int8_vs_top(path)
    assert any(cali_stats[n].threshold != pytest.approx(127 * s, rel=1e-6) for n, s in scales.items())
    assert _agreement(top, tpu) < with_grid - 0.05
    assert cosine(tpu[out], top[out]) < cos_with


@pytest.mark.parametrize("activations", ["QInt8", "QUInt8"])
def test_grids_with_zero_points_are_stored_with_them(tmp_path, monkeypatch, activations):
    """onnxruntime's default activations have zero points of their own: no calibration entry (a symmetric
    threshold) can say such a grid, so lowering stores those tensors on it, with its zero point, and rounds onto
    it half to even as QuantizeLinear does; entries are taken only where a symmetric grid is the model's. (For
    uint8, canonicalize fuses the zero point's Add with the [0, 255] Clip: the pattern is found either way.)"""
    path = _qdq_model(tmp_path, symmetric=False, activations=activations)
    module, weights = _canonical(path)
    shifted = [
        op
        for op in module.walk()
        if op.name == "top.Add"
        and op.loc_name.endswith(("QuantizeLinear_Output_shifted", "QuantizeLinear_Output_saturated"))
    ]
    # each pattern's zero point, by the tensor it quantizes (the Add's operand is Round(Div(x, scale)))
    zero_points = {
        mlir.value_name(op.operands[0].owner.operands[0].owner.operands[0]): float(
            weights[op.operands[1].owner.loc_name]
        )
        for op in shifted
    }
    assert any(zp not in (0, -128, 128) for zp in zero_points.values()), zero_points
    # int8 with zero point -128 holds 0 to 255 steps, uint8 with 128 -128 to 127: grids symmetric INT8 has
    symmetric_shift = -128 if activations == "QInt8" else 128
    entries = qdq_entries(module, weights)
    assert {name for name in zero_points if name in entries} == {
        n for n, zp in zero_points.items() if zp == symmetric_shift
    }

    _, top, tpu, prelus = _int8_vs_top(path)
    with_grid, cos_with = _agreement(top, tpu), cosine(tpu["y"], top["y"])
    assert with_grid == 1.0 and cos_with >= 0.999999
    # the PReLU onnxruntime leaves in float between a pair computes in F32, as the model does (in F16, a share
    # of the integers after it came out a step off)
    assert prelus == {"r2": "tensor<1x16x16x16xf32>"}
    monkeypatch.setattr(qdq_module, "model_grids", lambda module, weights: {})
    _, top, tpu, _ = _int8_vs_top(path)
    assert _agreement(top, tpu) < with_grid - 0.05 and cosine(tpu["y"], top["y"]) < cos_with
