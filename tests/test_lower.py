"""Lowering TOP -> TPU: small ONNX models lowered to every mode, TPU inference against TOP inference.

TOP inference is itself checked against onnxruntime (test_frontend_*); here the
TPU result of each tensor is compared with TOP's by name, with DESIGN.md's
tolerances: F32 bit-equal, BF16/F16 cos >= 0.99 and euc >= 0.90, INT8 cos >= 0.99
on these small models (the default bar is 0.90).
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import helper
from xdsl.dialects.builtin import bf16, f16, f32

from tpubuild.build.chips import load_chip
from tpubuild.calib.calibrate import apply_table, calibrate
from tpubuild.errors import TpuBuildError
from tpubuild.frontend import convert_onnx
from tpubuild.ir import mlir, top, tpu
from tpubuild.ir.quant import UniformType
from tpubuild.ir.weights import WeightStore
from tpubuild.lower.inference import dequantized
from tpubuild.lower.lowering import lower_module
from tpubuild.lower.qtable import parse_quantize_table
from tpubuild.testing import upstream_check
from tpubuild.top.canonicalize import canonicalize
from tpubuild.top.inference import run
from tpubuild.verify.similarity import cosine, euclidean

BM1684X = load_chip("bm1684x")


def node(op, inputs, output, **attrs):
    return helper.make_node(op, list(inputs), [output], name=output, **attrs)


def randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def cnn_model(make_model):
    """conv+relu, maxpool, residual add, 1x1 conv, sigmoid gate (SiLU-like Mul), concat, GAP, gemm, softmax."""
    rng = np.random.default_rng(3)
    x = np.zeros((1, 3, 16, 16), np.float32)
    nodes = [
        node("Conv", ["x", "w1", "b1"], "c1", pads=[1, 1, 1, 1]),
        node("Relu", ["c1"], "r1"),
        node("MaxPool", ["r1"], "p1", kernel_shape=[2, 2], strides=[2, 2]),
        node("Conv", ["p1", "w2", "b2"], "c2", pads=[1, 1, 1, 1]),
        node("Add", ["p1", "c2"], "res"),
        node("Relu", ["res"], "res_relu"),
        node("Conv", ["res_relu", "w3", "b3"], "c3"),
        node("Sigmoid", ["c3"], "gate"),
        node("Mul", ["c3", "gate"], "silu"),  # canonicalize fuses these into top.SiLU
        node("Concat", ["res_relu", "silu"], "cat", axis=1),
        node("AveragePool", ["cat"], "pool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        node("GlobalAveragePool", ["pool"], "gap"),
        node("Flatten", ["gap"], "flat"),
        node("Gemm", ["flat", "wf", "bf"], "logits", transB=1),
        node("Softmax", ["logits"], "probs", axis=-1),
    ]
    inits = {
        "w1": randn(rng, 8, 3, 3, 3, scale=0.4),
        "b1": randn(rng, 8, scale=0.1),
        "w2": randn(rng, 8, 8, 3, 3, scale=0.15),
        "b2": randn(rng, 8, scale=0.1),
        "w3": randn(rng, 4, 8, 1, 1, scale=0.4),
        "b3": randn(rng, 4, scale=0.1),
        "wf": randn(rng, 5, 12, scale=0.8),
        "bf": randn(rng, 5, scale=0.1),
    }
    return make_model(nodes, {"x": x}, initializers=inits)


class Built:
    """A model's canonical TOP module, its weights, a calibration table and a test input."""

    def __init__(self, model: onnx.ModelProto, shapes: dict, tmp_path: Path, samples: int = 8, seed: int = 0):
        path = tmp_path / "model.onnx"
        onnx.save(model, path)
        module, weights = convert_onnx(path, shapes, "test", "origin_weights.npz")
        self.module, self.weights = canonicalize(module, weights, "canonical_weights.npz")
        rng = np.random.default_rng(seed)
        self.samples = [
            {k: rng.uniform(-1, 1, s).astype(np.float32) for k, s in shapes.items()} for _ in range(samples)
        ]
        self.cali, _ = calibrate(self.module, self.weights, self.samples, "max")
        self.inputs = {k: rng.uniform(-1, 1, s).astype(np.float32) for k, s in shapes.items()}
        self.top = run(self.module, self.weights, self.inputs)
        self.tmp = tmp_path

    def lower(self, mode: str, *, asymmetric=False, chip=BM1684X, qtable=None, module=None):
        """Lowered, printed and parsed back (as a stage file is), with its weights saved and reloaded."""
        tm, tw = lower_module(
            module or self.module,
            self.weights,
            chip=chip,
            mode=mode,
            asymmetric=asymmetric,
            cali=self.cali,
            qtable=qtable,
        )
        tag = f"{chip.name}-{mode}{'-asym' if asymmetric else ''}"
        tw.save(self.tmp / f"{tag}.npz")
        return mlir.parse_module(mlir.print_module(tm)), WeightStore.load(self.tmp / f"{tag}.npz")

    def tpu(self, mode: str, **kw):
        tm, tw = self.lower(mode, **kw)
        raw = run(tm, tw, self.inputs)
        return tm, raw, dequantized(tm, raw)


@pytest.fixture
def cnn(make_model, tmp_path) -> Built:
    return Built(cnn_model(make_model), {"x": (1, 3, 16, 16)}, tmp_path)


def ops_of(module, cls) -> list:
    return [op for op in mlir.body_ops(module) if isinstance(op, cls)]


def op_named(module, name):
    (op,) = [op for op in mlir.body_ops(module) if getattr(op, "loc_name", None) == name]
    return op


def similarity_by_name(real: dict, ref: dict) -> dict[str, tuple[float, float]]:
    common = sorted(set(real) & set(ref))
    assert len(common) >= 5, common
    return {n: (cosine(real[n], ref[n]), euclidean(real[n], ref[n])) for n in common}


# ---- F32 -----------------------------------------------------------------------------


def test_f32_is_within_a_few_float32_ulps_of_top(cnn):
    """F32 TPU inference computes TOP's float32 arithmetic, but its convs sum through other GEMMs (pixel-major,
    one per output row, as the chip slices them; TOP's output-channel-major over every pixel), and BLAS sums
    each in its own order: on FMA kernels (numpy's OpenBLAS, Haswell) the bits differ, on others they may
    not. What holds everywhere: every tensor within a few float32 ULPs of its largest magnitude (measured
    at most 3 through this net), where a real difference (a bias, a pad, a tap) is millions of them."""
    tm, raw, real = cnn.tpu("F32")
    compared = sorted(set(real) & set(cnn.top))
    assert len(compared) == len(cnn.top)
    for name in compared:
        ref = np.asarray(cnn.top[name])
        assert real[name].dtype == ref.dtype == np.float32 and real[name].shape == ref.shape, name
        ulp = np.spacing(np.abs(ref).max())
        np.testing.assert_allclose(real[name], ref, rtol=0, atol=16 * ulp, err_msg=name)
    assert not ops_of(tm, tpu.CastOp)
    assert {op.name for op in mlir.body_ops(tm)} <= {"top.Input", "top.Weight", "top.None", "func.return"} | {
        c.name for c in tpu.TPU_OPS
    }
    assert mlir.module_attr(tm, "state") == "TPU_LOWERED"
    assert (mlir.module_attr(tm, "chip"), mlir.module_attr(tm, "mode"), mlir.module_attr(tm, "asymmetric")) == (
        "bm1684x",
        "F32",
        "false",
    )


# ---- BF16 / F16 ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode, elem, dtype", [("BF16", bf16, ml_dtypes.bfloat16), ("F16", f16, np.float16)])
def test_half_modes_meet_tolerance(cnn, mode, elem, dtype):
    tm, raw, real = cnn.tpu(mode)
    for name, (cos, euc) in similarity_by_name(real, cnn.top).items():
        assert cos >= 0.99 and euc >= 0.90, (name, cos, euc)
    # every computing op in the mode's type, a cast at the input and one back at the output
    conv = op_named(tm, "r1")  # (the first conv, its ReLU fused)
    assert conv.result_types[0].element_type == elem and raw["r1"].dtype == dtype
    cast_in = op_named(tm, f"x_{mode.lower()}")
    assert isinstance(cast_in, tpu.CastOp) and cast_in.operands[0].owner.name == "top.Input"
    assert mlir.output_names(tm) == ["probs_f32"] and raw["probs_f32"].dtype == np.float32
    # weights stored in the mode's type (bf16 as its raw bits in the npz) and read back as such
    weight = conv.operands[1].owner
    assert isinstance(weight, top.WeightOp) and weight.result_types[0].element_type == elem


def test_half_mode_rounds_every_op_result(cnn):
    """BF16 results are bf16 values: exactly representable, so a second rounding changes nothing."""
    _, raw, _ = cnn.tpu("BF16")
    for name in ("r1", "res_relu", "silu", "logits"):
        as_f32 = raw[name].astype(np.float32)
        np.testing.assert_array_equal(as_f32.astype(ml_dtypes.bfloat16).astype(np.float32), as_f32)


def test_half_modes_hold_constants_in_their_range(make_model, tmp_path):
    """An exporter's "very negative" (float32's lowest, in a BERT-style padding mask) would round to -inf in
    bfloat16 and float16, and 0 * -inf is NaN at every unmasked place: it saturates at the type's largest."""
    rng = np.random.default_rng(5)
    nodes = [
        node("MatMul", ["x", "w"], "scores"),
        node("Sub", ["one", "mask"], "masked"),
        node("Mul", ["masked", "lowest"], "bias"),
        node("Add", ["scores", "bias"], "biased"),
        node("Softmax", ["biased"], "attn", axis=-1),
    ]
    x, mask = randn(rng, 1, 4, 8), np.ones((1, 1, 8), np.float32)
    inits = {"w": randn(rng, 8, 8), "one": np.float32(1), "lowest": np.float32(np.finfo(np.float32).min)}
    onnx.save(make_model(nodes, {"x": x, "mask": mask}, initializers=inits), tmp_path / "m.onnx")
    module, weights = convert_onnx(tmp_path / "m.onnx", {"x": x.shape, "mask": mask.shape}, "m", "w.npz")
    module, weights = canonicalize(module, weights, "c.npz")
    mask[..., 5:] = 0
    ref = run(module, weights, {"x": x, "mask": mask})["attn"]
    assert ref[..., 5:].max() == 0 and np.isfinite(ref).all()
    for mode in ("BF16", "F16"):
        tm, tw = lower_module(module, weights, chip=BM1684X, mode=mode)
        got = dequantized(tm, run(tm, tw, {"x": x, "mask": mask}))["attn"]
        assert np.isfinite(got).all() and got[..., 5:].max() == 0, mode
        assert cosine(got, ref) > 0.999, mode


def test_f16_computes_a_guarded_log_in_f32(make_model, tmp_path):
    """log(x^2 + 1e-10), min-max normalised (an audio model's log spectrum): float16 has no 1e-10 and squares
    small x to 0, so the log would read 0 (-inf, then NaN after the normalisation) or, with eps held at
    float16's smallest, a floor 7 below the model's that moves every quiet value. The guard and the log
    compute in F32; bfloat16 has float32's exponent range and keeps them."""
    nodes = [
        node("Mul", ["x", "x"], "power"),
        node("Add", ["power", "eps"], "guarded"),
        node("Log", ["guarded"], "logp"),
        node("ReduceMin", ["logp"], "floor", keepdims=1),
        node("Sub", ["logp", "floor"], "above"),
        node("ReduceMax", ["above"], "top", keepdims=1),
        node("Div", ["above", "top"], "norm"),
    ]
    x = np.array([[0, 1e-7, 1e-6, 1e-5, 3e-3, 1e-2, 0.3, 2.0]], np.float32)
    model = make_model(nodes, {"x": x}, initializers={"eps": np.float32(1e-10)})
    built = Built(model, {"x": x.shape}, tmp_path)
    ref = run(built.module, built.weights, {"x": x})["norm"]
    tm, tw = built.lower("F16")
    assert [op_named(tm, n).result_types[0].element_type for n in ("power", "guarded", "logp")] == [f16, f32, f32]
    got = dequantized(tm, run(tm, tw, {"x": x}))["norm"]
    assert np.isfinite(got).all() and np.abs(got - ref)[0, 4:].max() < 2e-3, (got, ref)
    tm, _ = built.lower("BF16")
    assert op_named(tm, "logp").result_types[0].element_type == bf16


def test_f16_keeps_a_normalize_guard_through_an_expand(make_model, tmp_path):
    """torch's F.normalize as exported: x / Expand(Clip(ReduceL2(x), min=1e-12)). A zero row (Swin V2's padded
    window tokens) is 0 / 1e-12 = 0 in float; in float16 the guard is 0 and the row 0 / 0 = NaN. The Div, the
    Expand between and the guard compute in F32."""
    nodes = [
        node("ReduceL2", ["x"], "norm", axes=[-1], keepdims=1),
        node("Clip", ["norm", "eps"], "guard"),
        node("Expand", ["guard", "shape"], "wide"),
        node("Div", ["x", "wide"], "unit"),
    ]
    x = np.random.default_rng(3).standard_normal((1, 4, 8)).astype(np.float32)
    x[0, 1] = 0
    inits = {"eps": np.float32(1e-12), "shape": np.array(x.shape, np.int64)}
    built = Built(make_model(nodes, {"x": x}, initializers=inits), {"x": x.shape}, tmp_path)
    ref = run(built.module, built.weights, {"x": x})["unit"]
    assert np.isfinite(ref).all() and not ref[0, 1].any()
    tm, tw = built.lower("F16")
    assert [op_named(tm, n).result_types[0].element_type for n in ("norm", "guard", "wide", "unit")] == [
        f16,
        f32,
        f32,
        f32,
    ]
    got = dequantized(tm, run(tm, tw, {"x": x}))["unit"]
    assert np.isfinite(got).all() and not got[0, 1].any()
    assert cosine(got, ref) > 0.999


def test_f16_computes_values_beyond_its_range_in_f32(make_model, tmp_path):
    """openWakeWord's melspectrogram: int16-scaled audio, a DFT as a MatMul, its power, a mel filterbank with
    zeros, a log. The DFT gives 1e4-1e5 and the power 1e9: inf in float16, then inf * 0 = NaN in the
    filterbank. The ops that read or write such values compute in F32 (their size from TOP's outputs on the
    test input); the scaling after the log, back in float16's range, is float16 again."""
    rng = np.random.default_rng(3)
    mel = np.where(rng.random((64, 8)) < 0.5, 0, rng.random((64, 8))).astype(np.float32)
    inits = {"dft": randn(rng, 512, 64, scale=0.1), "mel": mel, "eps": np.float32(1e-3), "ten": np.float32(10)}
    nodes = [
        node("MatMul", ["x", "dft"], "spectrum"),
        node("Mul", ["spectrum", "spectrum"], "power"),
        node("MatMul", ["power", "mel"], "melpower"),
        node("Add", ["melpower", "eps"], "guarded"),
        node("Log", ["guarded"], "logmel"),
        node("Mul", ["logmel", "ten"], "db"),
    ]
    x = rng.uniform(-20000, 20000, (1, 512)).astype(np.float32)
    model = make_model(nodes, {"x": x}, ["db"], initializers=inits)
    built = Built(model, {"x": x.shape}, tmp_path)
    ref = run(built.module, built.weights, {"x": x})
    absmax = {name: float(np.abs(a).max()) for name, a in ref.items()}

    def lowered_f16(absmax):
        tm, tw = lower_module(built.module, built.weights, chip=BM1684X, mode="F16", absmax=absmax)
        return tm, dequantized(tm, run(tm, tw, {"x": x}))["db"]

    tm, got = lowered_f16(absmax)
    types = [op_named(tm, n).result_types[0].element_type for n in ("spectrum", "power", "guarded", "logmel", "db")]
    assert types == [f32, f32, f32, f32, f16]
    assert np.isfinite(got).all() and cosine(got, ref["db"]) > 0.9999
    _, unguarded = lowered_f16({})  # nothing measured: float16 throughout
    assert not np.isfinite(unguarded).all()


# ---- INT8 ----------------------------------------------------------------------------


@pytest.mark.parametrize("asymmetric", [False, True])
def test_int8_meets_tolerance(cnn, asymmetric):
    tm, raw, real = cnn.tpu("INT8", asymmetric=asymmetric)
    sims = similarity_by_name(real, cnn.top)
    for name, (cos, euc) in sims.items():
        assert cos >= 0.99 and euc >= 0.85, (name, cos, euc)
    assert np.argmax(real["probs"]) == np.argmax(cnn.top["probs"])
    assert raw["c2"].dtype == np.int8
    assert mlir.module_attr(tm, "asymmetric") == str(asymmetric).lower()


def test_int8_structure(cnn):
    tm, raw, _ = cnn.tpu("INT8")
    conv = op_named(tm, "c2")
    w_type = conv.operands[1].type.element_type
    b_type = conv.operands[2].type.element_type
    assert isinstance(w_type, UniformType) and w_type.storage_type == "i8" and w_type.quant_axis == 0
    assert len(w_type.scale_list) == 8 and len(conv.params.multiplier) == 8 == len(conv.params.rshift)
    assert isinstance(b_type, UniformType) and b_type.storage_type == "i32"
    # the bias scale of each channel is s_in * s_w
    in_scale = conv.operands[0].type.element_type.scale_list[0]
    assert b_type.scale_list == pytest.approx([in_scale * s for s in w_type.scale_list])
    # after a ReLU the tensor is unsigned with 255 steps
    r1 = op_named(tm, "r1")
    assert r1.result_types[0].element_type.storage_type == "u8" and raw["r1"].dtype == np.uint8
    # the sigmoid (or SiLU, where canonicalize fuses x * sigmoid(x)) is a table; the pooled vector and the head
    # stay float (int8.vector_region), the input of the pool becoming float; read only by the softmax after the
    # last conv, they compute in F32 as it does (int8.output_tail), but for the fully connected layer, whose
    # weights F32 would double: it takes the chip's float mode (F16), weights and all
    assert ops_of(tm, tpu.LutOp)
    softmax = op_named(tm, "probs")
    assert isinstance(softmax, tpu.SoftmaxOp) and softmax.result_types[0].element_type == f32
    logits = op_named(tm, "logits")
    assert [op_named(tm, "gap").result_types[0].element_type, logits.result_types[0].element_type] == [f32, f16]
    assert logits.operands[1].type.element_type == f16
    assert isinstance(op_named(tm, "gap").operands[0].owner, tpu.CastOp)
    assert isinstance(op_named(tm, "x_i8"), tpu.CastOp)
    # maxpool keeps its input's quantization (exact)
    p1 = op_named(tm, "p1")
    assert p1.result_types[0].element_type == p1.operands[0].type.element_type


@pytest.mark.parametrize(
    "op, fn",
    [
        ("Sigmoid", lambda x: 1 / (1 + np.exp(-x))),
        ("Tanh", np.tanh),
        ("Exp", np.exp),
        ("Softplus", lambda x: np.log1p(np.exp(x))),
    ],
)
def test_int8_lut_is_exact_to_half_a_step(make_model, tmp_path, op, fn):
    """A table entry is f(real input) rounded once: within half an output step of the float function."""
    rng = np.random.default_rng(2)
    model = make_model(
        # a conv reads y: ops after the last conv stay float (int8.output_tail)
        [node("Conv", ["x", "w", "b"], "c"), node(op, ["c"], "y"), node("Conv", ["y", "wh"], "head")],
        {"x": np.zeros((1, 3, 6, 6), np.float32)},
        ["y", "head"],
        initializers={"w": randn(rng, 4, 3, 1, 1), "b": randn(rng, 4, scale=0.1), "wh": randn(rng, 4, 4, 1, 1)},
    )
    built = Built(model, {"x": (1, 3, 6, 6)}, tmp_path)
    tm, raw, real = built.tpu("INT8")
    lut = op_named(tm, "y")
    assert isinstance(lut, tpu.LutOp) and lut.operands[1].type.get_shape() == (256,)
    y_type = lut.result_types[0].element_type
    assert y_type.storage_type == ("u8" if op != "Tanh" else "i8")  # non-negative results: 255 steps
    expect = fn(real["c"].astype(np.float64))
    assert np.max(np.abs(real["y"] - expect)) <= y_type.scale_list[0] / 2 + 1e-6


def test_int8_chain_of_table_ops_is_one_table(make_model, tmp_path):
    """hardswish, then x * a + b (PP-LCNetV3's learnable affine block): one table over the conv output,
    computed in float, so one rounding; a tensor with a second user is materialized."""
    rng = np.random.default_rng(4)
    nodes = [
        node("Conv", ["x", "w", "b"], "c"),
        node("HardSwish", ["c"], "hs"),
        node("Mul", ["hs", "a"], "scaled"),
        node("Add", ["scaled", "beta"], "affine"),
        node("Sigmoid", ["affine"], "gate"),
        node("Add", ["affine", "gate"], "out"),
        node("Conv", ["out", "wh"], "head"),  # ops after the last conv stay float (int8.output_tail)
    ]
    model = make_model(
        nodes,
        {"x": np.zeros((1, 3, 6, 6), np.float32)},
        ["out", "head"],
        initializers={
            "w": randn(rng, 4, 3, 1, 1),
            "b": randn(rng, 4, scale=0.1),
            "a": np.array(0.7, np.float32),
            "beta": np.array(0.2, np.float32),
            "wh": randn(rng, 4, 4, 1, 1),
        },
    )
    built = Built(model, {"x": (1, 3, 6, 6)}, tmp_path)
    tm, raw, real = built.tpu("INT8")
    affine = op_named(tm, "affine")
    assert isinstance(affine, tpu.LutOp) and affine.operands[0].owner.loc_name == "c"
    assert "hs" not in raw and "scaled" not in raw  # computed inside the table
    assert isinstance(op_named(tm, "gate"), tpu.LutOp) and isinstance(op_named(tm, "out"), tpu.AddOp)
    c = real["c"].astype(np.float64)
    expect = c * np.clip(c / 6 + 0.5, 0, 1) * 0.7 + 0.2
    assert np.max(np.abs(real["affine"] - expect)) <= affine.result_types[0].element_type.scale_list[0] / 2 + 1e-6


def test_int8_data_movement_keeps_the_quantization_and_is_exact(make_model, tmp_path):
    rng = np.random.default_rng(6)
    nodes = [
        node("Conv", ["x", "w", "b"], "c"),
        helper.make_node("Pad", ["c", "pads", "pv"], ["pad"], name="pad", mode="constant"),
        node("Transpose", ["pad"], "t", perm=[0, 2, 3, 1]),
        node("Reshape", ["t", "shape"], "r"),
        helper.make_node("Slice", ["r", "starts", "ends", "axes"], ["s"], name="s"),
        helper.make_node("Resize", ["c", "", "scales"], ["up"], name="up", mode="nearest"),
        # products read them: ops after the last conv or matmul stay float (int8.output_tail)
        node("MatMul", ["s", "ws"], "s_head"),
        node("Conv", ["up", "wh"], "up_head"),
    ]
    inits = {
        "ws": randn(rng, 4, 4),
        "wh": randn(rng, 4, 4, 1, 1),
        "w": randn(rng, 4, 3, 1, 1),
        "b": randn(rng, 4, scale=0.1),
        "pads": np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64),
        "pv": np.array(0.5, np.float32),
        "shape": np.array([1, 64, 4], np.int64),
        "starts": np.array([3], np.int64),
        "ends": np.array([40], np.int64),
        "axes": np.array([1], np.int64),
        "scales": np.array([1, 1, 2, 2], np.float32),
    }
    model = make_model(
        nodes, {"x": np.zeros((1, 3, 6, 6), np.float32)}, ["s", "up", "s_head", "up_head"], initializers=inits
    )
    built = Built(model, {"x": (1, 3, 6, 6)}, tmp_path)
    tm, raw, real = built.tpu("INT8")
    c_type = op_named(tm, "c").result_types[0].element_type
    for name in ("pad", "t", "r", "s", "up"):
        assert op_named(tm, name).result_types[0].element_type == c_type, name
    # exact: moving stored values around commutes with dequantization
    np.testing.assert_array_equal(
        real["s"],
        np.transpose(
            np.pad(real["c"], [(0, 0), (0, 0), (1, 1), (1, 1)], constant_values=real["pad"][0, 0, 0, 0]), (0, 2, 3, 1)
        ).reshape(1, 64, 4)[:, 3:40],
    )
    np.testing.assert_array_equal(real["up"], real["c"].repeat(2, axis=2).repeat(2, axis=3))
    # the pad value 0.5 in stored units: the nearest representable value
    assert abs(real["pad"][0, 0, 0, 0] - 0.5) <= c_type.scale_list[0] / 2


def test_half_mode_keeps_a_constant_bias_f32(cnn):
    tm, _ = cnn.lower("BF16")
    conv = op_named(tm, "c2")
    assert conv.operands[1].type.element_type == bf16 and conv.operands[2].type.element_type == f32


def test_int8_on_cv183x_falls_back_to_bf16(cnn):
    tm, _, real = cnn.tpu("INT8", chip=load_chip("cv183x"))
    assert op_named(tm, "probs").result_types[0].element_type == bf16
    assert cosine(real["probs"], cnn.top["probs"]) >= 0.99


def test_int8_from_cali_mlir_is_the_same(cnn):
    """Lowering reads cali.mlir's calibrated types as f32: the same TPU module as from canonical.mlir."""
    cali_module = apply_table(cnn.module.clone(), cnn.cali)
    a, _ = cnn.lower("INT8")
    b, _ = cnn.lower("INT8", module=mlir.parse_module(mlir.print_module(cali_module)))
    assert mlir.print_module(a) == mlir.print_module(b)


def test_int8_without_calibration_is_refused(cnn):
    with pytest.raises(TpuBuildError, match="calibration"):
        lower_module(cnn.module, cnn.weights, chip=BM1684X, mode="INT8")


def test_int8_missing_tensor_names_it(cnn):
    cali = {k: v for k, v in cnn.cali.items() if k != "c2"}
    with pytest.raises(TpuBuildError, match="'c2'") as err:
        lower_module(cnn.module, cnn.weights, chip=BM1684X, mode="INT8", cali=cali)
    assert err.value.loc == "c2"


# ---- Concat: per-branch requantization, and float where one scale cannot hold both --------------


def concat_model(make_model, ratio: float):
    rng = np.random.default_rng(5)
    nodes = [
        node("Conv", ["x", "wa", "ba"], "a"),
        node("Conv", ["x", "wb", "bb"], "b"),
        node("Concat", ["a", "b"], "cat", axis=1),
        node("Relu", ["cat"], "out"),
        node("Conv", ["out", "wm"], "mixed"),
    ]
    inits = {
        "wa": randn(rng, 4, 3, 1, 1),
        "ba": randn(rng, 4, scale=0.1),
        "wb": randn(rng, 4, 3, 1, 1, scale=1 / ratio),
        "bb": randn(rng, 4, scale=0.1 / ratio),
        "wm": randn(rng, 2, 8, 1, 1),
    }
    return make_model(nodes, {"x": np.zeros((1, 3, 8, 8), np.float32)}, ["out", "mixed"], initializers=inits)


def test_concat_requantizes_each_branch(make_model, tmp_path):
    built = Built(concat_model(make_model, 8.0), {"x": (1, 3, 8, 8)}, tmp_path)
    tm, raw, real = built.tpu("INT8")
    cat = op_named(tm, "cat")
    assert isinstance(cat, tpu.ConcatOp) and len(cat.params.multiplier) == 2
    in_scales = [v.type.element_type.scale_list[0] for v in cat.operands]
    assert in_scales[0] > 4 * in_scales[1]  # each branch quantized at its own scale before the join
    for name in ("a", "b", "cat", "out"):
        assert cosine(real[name], built.top[name]) >= 0.99, name


def test_concat_of_disparate_ranges_stays_float(make_model, tmp_path):
    built = Built(concat_model(make_model, 1000.0), {"x": (1, 3, 8, 8)}, tmp_path)
    tm, raw, real = built.tpu("INT8")
    assert op_named(tm, "cat").result_types[0].element_type == f16
    assert op_named(tm, "out").result_types[0].element_type == f16  # and what passes its values on
    # an op that mixes them computes at its input's threshold, as it would anyway: INT8
    assert isinstance(op_named(tm, "mixed").result_types[0].element_type, UniformType)
    small = real["out"][:, 4:]
    ref = built.top["out"][:, 4:]
    # the small branch keeps its own resolution: a shared 8-bit scale would have zeroed it
    assert np.count_nonzero(ref) > 10 and cosine(small, ref) >= 0.99


# ---- transformer-ish: matmul of two activations, layernorm, GELU table ------------------------


@pytest.mark.parametrize("mode", ["BF16", "F16", "INT8"])
def test_attention_block(attention_model, tmp_path, mode):
    built = Built(attention_model(1), {"x": (1, 6, 16)}, tmp_path)
    tm, raw, real = built.tpu(mode)
    for name, (cos, euc) in similarity_by_name(real, built.top).items():
        assert cos >= 0.99 and euc >= 0.85, (name, cos, euc)
    if mode == "INT8":
        scores = op_named(tm, "scores")
        assert all(isinstance(v.type.element_type, UniformType) for v in scores.operands[:2])
        assert isinstance(op_named(tm, "act"), tpu.LutOp)
        assert op_named(tm, "ln").result_types[0].element_type == f16


# ---- quantize table ------------------------------------------------------------------------


def test_quantize_table_pins_ops_to_a_float_mode(cnn):
    qtable = parse_quantize_table("# keep the residual path exact\nc2 F32\nres_relu f16\n")
    assert qtable == {"c2": "F32", "res_relu": "F16"}
    tm, raw, real = cnn.tpu("INT8", qtable=qtable)
    assert op_named(tm, "c2").result_types[0].element_type == f32
    assert op_named(tm, "res_relu").result_types[0].element_type == f16
    assert isinstance(op_named(tm, "r1").result_types[0].element_type, UniformType)
    # c2 reads its input dequantized to f32, and res reads c2 cast to f16
    assert isinstance(op_named(tm, "c2").operands[0].owner, tpu.CastOp)
    assert isinstance(op_named(tm, "p1_f32"), tpu.CastOp) and isinstance(op_named(tm, "c2_f16"), tpu.CastOp)
    assert cosine(real["res_relu"], cnn.top["res_relu"]) >= 0.999


def test_quantize_table_in_a_bf16_target(cnn):
    tm, _, real = cnn.tpu("BF16", qtable={"logits": "F32"})
    assert op_named(tm, "logits").result_types[0].element_type == f32
    assert op_named(tm, "r1").result_types[0].element_type == bf16


def test_quantize_table_never_lowers_a_target_s_precision(cnn):
    tm, _, _ = cnn.tpu("F32", qtable={"c2": "F16", "logits": "BF16"})
    assert op_named(tm, "c2").result_types[0].element_type == f32
    assert op_named(tm, "logits").result_types[0].element_type == f32
    tm, _, _ = cnn.tpu("F16", qtable={"c2": "BF16"})
    assert op_named(tm, "c2").result_types[0].element_type == bf16


@pytest.mark.parametrize(
    "text, match", [("c2 INT8\n", "line 1"), ("c2\n", "line 1"), ("# ok\nc2 F16 extra\n", "line 2")]
)
def test_quantize_table_syntax_errors(text, match):
    with pytest.raises(TpuBuildError, match=match):
        parse_quantize_table(text)


def test_quantize_table_unknown_op_refused(cnn):
    with pytest.raises(TpuBuildError, match="no_such_op"):
        cnn.lower("INT8", qtable={"no_such_op": "F16"})


def test_quantize_table_mode_the_chip_lacks_refused(cnn):
    with pytest.raises(TpuBuildError, match="F16.*BF16, INT8"):
        cnn.lower("INT8", chip=load_chip("cv183x"), qtable={"c2": "F16"})


# ---- chips -----------------------------------------------------------------------------


def test_unsupported_mode_refused_with_the_supported_list(cnn):
    with pytest.raises(TpuBuildError, match="cv183x does not support mode F32; it supports BF16, INT8"):
        cnn.lower("F32", chip=load_chip("cv183x"))


def test_unknown_chip_lists_known_ones():
    with pytest.raises(TpuBuildError, match="bm1684x, bm1688, cv183x"):
        load_chip("bm9999")


# ---- upstream MLIR parses every mode's file ------------------------------------------------------


def test_every_mode_parses_upstream(cnn, tmp_path):
    for mode, asym in (("F32", False), ("BF16", False), ("F16", False), ("INT8", False), ("INT8", True)):
        tm, _ = cnn.lower(mode, asymmetric=asym)
        path = tmp_path / f"tpu-{mode}-{asym}.mlir"
        mlir.save_module(tm, path)
        upstream_check(path)
