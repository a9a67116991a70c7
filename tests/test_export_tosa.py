"""The upstream bridge: TOP exported to TOSA, compiled and run by IREE (the cpu target).

The export's text is checked without IREE; everything IREE compiles or runs skips only where the `iree` extra
is absent. Ops are covered by ONNX node cases (one iree-compile for all of them, as bench/onnx_node_tests.py
--iree runs them) and one zoo model through the whole cpu target; the whole zoo is the `slow` test.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tpubuild.errors import TpuBuildError

REPO = Path(__file__).resolve().parents[1]
HAS_IREE = (
    importlib.util.find_spec("iree.compiler") is not None and importlib.util.find_spec("iree.runtime") is not None
)
needs_iree = pytest.mark.skipif(not HAS_IREE, reason="the iree extra (iree-base-compiler, iree-base-runtime) is absent")


def _bench(name: str):
    # not under its own name: bench/iree.py as `iree` would shadow IREE's package
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _top_module(tmp_path, model, inputs):
    from tpubuild.frontend import convert_onnx
    from tpubuild.ir import mlir

    path = tmp_path / "model.onnx"
    path.write_bytes(model.SerializeToString())
    module, weights = convert_onnx(str(path), {k: list(v.shape) for k, v in inputs.items()}, "tiny", "w.npz")
    return mlir.parse_module(mlir.print_module(module)), weights


def test_export_is_upstream_mlir_with_main_and_resources(tmp_path):
    from onnx import helper

    from tpubuild.export.tosa import export_module

    conftest = _conftest()
    x = np.random.default_rng(0).standard_normal((1, 3, 8, 8)).astype(np.float32)
    w = np.random.default_rng(1).standard_normal((4, 3, 3, 3)).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Relu", ["c"], ["y"], name="relu"),
    ]
    model = conftest.make_onnx(nodes, {"x": x}, initializers={"w": w})
    module, weights = _top_module(tmp_path, model, {"x": x})
    text = export_module(module, weights, "tiny")
    assert "func.func @main(%arg0: tensor<1x3x8x8xf32>) -> (tensor<1x4x8x8xf32>)" in text
    assert '"tosa.conv2d"' in text and '"tosa.clamp"' in text
    assert "dense_resource<w0>" in text and "dialect_resources" in text
    assert '"top.' not in text  # nothing of our dialect is left
    assert 'tpubuild.inputs = "[\\"x\\"]"' in text and 'loc("y")' in text


def test_an_op_without_a_rule_is_refused_naming_op_location_and_model(tmp_path, monkeypatch):
    from onnx import helper

    from tpubuild.export import tosa
    from tpubuild.export.tosa import export_module, get_rule
    from tpubuild.ir import top

    get_rule(top.MaxPoolWithMaskOp)  # the rules registered, then this one taken out for the test
    monkeypatch.delitem(tosa._RULES, top.MaxPoolWithMaskOp)
    conftest = _conftest()
    x = np.arange(32, dtype=np.float32).reshape(1, 2, 4, 4)
    node = helper.make_node("MaxPool", ["x"], ["v", "i"], kernel_shape=[2, 2], name="pool")
    model = conftest.make_onnx([node], {"x": x})
    module, weights = _top_module(tmp_path, model, {"x": x})
    with pytest.raises(TpuBuildError) as err:
        export_module(module, weights, "tiny")
    text = str(err.value)
    assert "top.MaxPoolWithMask" in text and "model tiny" in text and "op 'v'" in text and "no TOSA export rule" in text


def test_a_stage_file_past_top_is_refused(tmp_path):
    from tpubuild.export.tosa import export_file

    bad = tmp_path / "tpu.mlir"
    bad.write_text(
        '"builtin.module"() ({\n^bb0:\n}) {module.name = "m", module.state = "TPU_LOWERED"} : () -> ()\n',
        encoding="utf-8",
    )
    with pytest.raises(TpuBuildError, match="only TOP modules"):
        export_file(str(bad), str(tmp_path / "out.mlir"))


def test_cpu_target_modes_are_checked(tmp_path):
    from tpubuild.build.manifest import from_dict
    from tpubuild.build.tasks import check_targets

    base = {"name": "m", "source": "m.onnx", "inputs": [{"name": "x", "shape": [1, 3]}]}
    check_targets(from_dict({**base, "targets": [{"chip": "cpu", "mode": "F32"}]}, tmp_path / "m.yaml"))
    for target, problem in (
        ({"chip": "cpu", "mode": "INT8"}, "does not support mode INT8"),
        ({"chip": "cpu", "mode": "F32", "asymmetric": True}, "no asymmetric"),
    ):
        with pytest.raises(TpuBuildError, match=problem):
            check_targets(from_dict({**base, "targets": [target]}, tmp_path / "m.yaml"))


# a representative op of each family and the tricky variants (pads TOSA wants recomputed, groups, steps,
# computed filters, integer widths, f64 demotion)
NODE_CASES = [
    "test_conv_with_strides_and_asymmetric_padding",
    "test_conv_with_autopad_same",
    "test_convtranspose_pads",
    "test_convtranspose_group_2_image_3",
    "test_maxpool_2d_ceil",
    "test_averagepool_2d_pads_count_include_pad",
    "test_matmul_4d_1d",
    "test_gemm_all_attributes",
    "test_softmax_axis_0",
    "test_logsoftmax_large_number",
    "test_layer_normalization_3d_axis1_epsilon",
    "test_instancenorm_example",
    "test_lrn",
    "test_gelu_default_1",
    "test_hardswish",
    "test_leakyrelu",
    "test_div_int8",
    "test_mod_mixed_sign_float64",
    "test_less_equal_int16",
    "test_where_long_example",
    "test_cast_FLOAT_to_FLOAT16",
    "test_reduce_mean_keepdims_random",
    "test_reduce_log_sum_exp_do_not_keepdims_example",
    "test_argmax_negative_axis_keepdims_random_select_last_index",
    "test_gather_negative_indices",
    "test_gather_elements_negative_indices",
    "test_einsum_batch_matmul",
    "test_cumsum_1d_reverse_exclusive",
    "test_max_uint8",
    "test_div_uint32",
    "test_slice_neg_steps",
    "test_reflect_pad",
    "test_resize_upsample_scales_linear_align_corners",
    "test_resize_downsample_sizes_nearest_not_smaller",
    "test_depthtospace_crd_mode_example",
    "test_expand_dim_changed",
    "test_tril_neg",
    "test_gridsample_reflection_padding",
    "test_gridsample_bicubic_align_corners_1_additional_1",
    "test_gridsample_volumetric_nearest_align_corners_0",
    "test_atan",
    "test_acosh",
]


@needs_iree
def test_node_cases_through_iree(tmp_path):
    bench = _bench("onnx_node_tests")
    results = [bench.run_case(bench.Case("node", n, bench.suite_dir("node") / n)) for n in NODE_CASES]
    assert all(r.status == "pass" for r in results), [(r.case.name, r.reason) for r in results if r.status != "pass"]
    bench.run_iree(results, tmp_path)
    failed = [(r.case.name, r.iree_reason) for r in results if r.iree != "pass"]
    assert not failed, failed


def _conftest():
    spec = importlib.util.spec_from_file_location("tpubuild_tests_conftest", REPO / "tests" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _demo_manifest(tmp_path: Path) -> Path:
    text = (REPO / "configs" / "models" / "demo_cnn.yaml").read_text(encoding="utf-8")
    text = text.replace("../../models/", f"{REPO}/models/")
    start = text.index("targets:")
    end = text.index("tolerance:")
    text = text[:start] + "targets:\n  - {chip: cpu, mode: F32}\n" + text[end:]
    path = tmp_path / "demo_cnn.yaml"
    path.write_text(text, encoding="utf-8")
    return path


@needs_iree
def test_cpu_target_builds_runs_and_verifies(tmp_path):
    """demo_cnn's cpu target through doit: tosa.mlir, the vmfb, IREE's outputs, verify.json's fifth level, the
    page and the summary; then the CLI's export and run on the same files."""
    from tpubuild.build.files import read_npz
    from tpubuild.build.runner import run_doit
    from tpubuild.cli import main

    manifest = _demo_manifest(tmp_path)
    build = tmp_path / "build"
    assert run_doit([str(manifest)], build, ["run", "compile:demo_cnn"]) == 0
    target = build / "demo_cnn" / "cpu-F32"
    doc = json.loads((target / "verify.json").read_text(encoding="utf-8"))
    assert doc["levels"] == ["onnx", "top", "iree"] and doc["passed"]
    (iree,) = [c for c in doc["comparisons"] if c["level"] == "iree"]
    assert iree["compared"] == 1 and iree["min_cos"] >= 0.99999
    assert "Top vs IREE" in (target / "report.html").read_text(encoding="utf-8")
    summary = (build / "demo_cnn" / "summary.txt").read_text(encoding="utf-8")
    assert "iree       cpu-F32/demo_cnn.vmfb vs top_outs.npz" in summary

    exported = tmp_path / "again.mlir"
    assert main(["export", "--tosa", str(build / "demo_cnn" / "canonical.mlir"), "-o", str(exported)]) == 0
    assert exported.read_bytes() == (target / "tosa.mlir").read_bytes()  # the stage's output, byte for byte
    outs = tmp_path / "outs.npz"
    assert (
        main(
            [
                "run",
                str(target / "demo_cnn.vmfb"),
                "--input",
                str(build / "demo_cnn" / "input.npz"),
                "--output",
                str(outs),
            ]
        )
        == 0
    )
    np.testing.assert_array_equal(read_npz(outs)["probs"], read_npz(target / "iree_outs.npz")["probs"])


@needs_iree
def test_iree_verifies_the_export_without_unregistered_dialects(tmp_path):
    """iree-opt parses and verifies the export with only its own dialects registered."""
    from tpubuild.build.cpu import iree_tool
    from tpubuild.export.tosa import export_module

    conftest = _conftest()
    from onnx import helper

    x = np.ones((2, 4), np.float32)
    nodes = [
        helper.make_node("Div", ["x", "x"], ["d"]),
        helper.make_node("Erf", ["d"], ["e"]),
        helper.make_node("ReduceMean", ["e"], ["y"], axes=[1], keepdims=0),
    ]
    model = conftest.make_onnx(nodes, {"x": x}, opset=17)
    module, weights = _top_module(tmp_path, model, {"x": x})
    path = tmp_path / "e.mlir"
    path.write_text(export_module(module, weights, "tiny"), encoding="utf-8")
    done = subprocess.run([iree_tool("iree-opt"), "--verify-each", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
@needs_iree
def test_zoo_cpu_targets_match_top():
    """The goal: every zoo model's vmfb matches TOP at cosine >= 0.99999 on its test input (bench/iree.py)."""
    bench = _bench("iree")
    code = bench.main(["--no-onnx-path", "--runs", "1"])
    assert code == 0


def _top_and_iree(tmp_path, model, inputs: dict) -> tuple[dict, dict]:
    """A model's outputs by TOP inference and by its export compiled and run by IREE (one iree-compile)."""
    from tpubuild.build.cpu import Vmfb, compile_vmfb
    from tpubuild.export.tosa import export_module
    from tpubuild.top.inference import run

    module, weights = _top_module(tmp_path, model, inputs)
    top = run(module, weights, inputs, all_tensors=False)
    path = tmp_path / "export.mlir"
    path.write_text(export_module(module, weights, "tiny"), encoding="utf-8")
    compile_vmfb(str(path), str(tmp_path / "export.vmfb"))
    return top, Vmfb(str(tmp_path / "export.vmfb")).run(inputs)


def _same_bits(top: np.ndarray, got: np.ndarray) -> np.ndarray:
    """Where IREE's value is TOP's bit for bit (a 2/4-bit result read from its carried byte; any NaN equals any)."""
    from tpubuild.export.tosa import CARRIED

    got = got.view(top.dtype) if top.dtype in CARRIED else got
    assert got.dtype == top.dtype and got.shape == top.shape
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[top.dtype.itemsize]
    nan = np.isnan(top.astype(np.float64)) & np.isnan(got.astype(np.float64))
    return (top.view(unsigned) == got.view(unsigned)) | nan


@needs_iree
def test_casts_to_and_from_8_bit_floats_and_2_4_bit_types(tmp_path):
    """ONNX Cast to each 8-bit float (saturating or not, e8m0's three roundings), float4 and the 2/4-bit integers
    and back to float32/float16, on every value of those types, their midpoints (ties) and the values next to
    them, out-of-range values, infinities and NaN: bit for bit as TOP's kernel (ml_dtypes)."""
    import ml_dtypes
    from onnx import TensorProto, helper

    conftest = _conftest()
    values = {0.0, -0.0, 1e-30, -1e-30, 3e38, -3e38, 1e-40}
    for dt in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2fnuz):
        grid = np.unique(np.arange(256, dtype=np.uint8).view(dt).astype(np.float32))
        grid = grid[np.isfinite(grid)]
        mids = (grid[:-1] + grid[1:]) / 2
        big = float(ml_dtypes.finfo(dt).max)
        values.update([*grid, *mids, *np.nextafter(mids, np.float32(np.inf)), *np.nextafter(mids, -np.float32(1e9))])
        values.update([big * 1.03, -big * 1.07, big * 2])
    x = np.array([*sorted(values), np.inf, -np.inf, np.nan, -np.nan, 0.25, 0.75, 1.25, 2.5, 5.0, 5.5, -3.5, 1.1])
    x = x.astype(np.float32).reshape(1, -1)
    ints = np.arange(-20, 20, dtype=np.float32).reshape(1, -1) + 0.5
    nodes, outs = [], []

    def cast(src: str, to: int, name: str, **attrs):
        nodes.append(helper.make_node("Cast", [src], [name], to=to, **attrs))
        outs.append(name)

    floats = ("FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ")
    for t in floats:
        for saturate in (0, 1):
            cast("x", getattr(TensorProto, t), f"{t}{saturate}", saturate=saturate)
    for mode in ("up", "down", "nearest"):
        cast("x", TensorProto.FLOAT8E8M0, f"e8m0_{mode}", round_mode=mode)
    cast("x", TensorProto.FLOAT4E2M1, "f4")
    for t in ("INT4", "UINT4", "INT2", "UINT2"):
        cast("i", getattr(TensorProto, t), t)
    cast("x", TensorProto.FLOAT16, "x16")
    cast("x16", TensorProto.FLOAT8E5M2, "x16_e5m2", saturate=0)
    for narrow in list(outs):
        if narrow != "x16":
            cast(narrow, TensorProto.FLOAT, f"{narrow}_f32")
            cast(narrow, TensorProto.FLOAT16, f"{narrow}_f16")
    model = conftest.make_onnx(nodes, {"x": x, "i": ints}, outs, opset=25)
    top, got = _top_and_iree(tmp_path, model, {"x": x, "i": ints})
    wrong = {n: int((~_same_bits(np.asarray(top[n]), np.asarray(got[n]))).sum()) for n in outs}
    assert not any(wrong.values()), {n: c for n, c in wrong.items() if c}


@needs_iree
def test_zero_size_tensors_and_bool_max_min(tmp_path):
    """TOSA refuses zero-size tensors: empty results are tensor.empty, reductions over an empty axis constants
    (the kernel's identity: 0, 1, -inf, ...), an empty slice is dropped from a concat; ReduceMax/Min of bool is
    any/all on bytes."""
    from onnx import helper

    conftest = _conftest()
    x = np.zeros((2, 0, 4), np.float32)
    z = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([[True, False, False], [True, True, True]])
    axes = np.array([1], np.int64)
    nodes = [helper.make_node(f"Reduce{m}", ["x", "axes"], [m.lower()]) for m in ("Sum", "Prod", "Max", "LogSumExp")]
    nodes += [
        helper.make_node("Abs", ["x"], ["abs"]),
        helper.make_node("Slice", ["z", "start", "stop", "axes"], ["none"]),
        helper.make_node("Concat", ["none", "z"], ["cat"], axis=1),
        helper.make_node("ReduceMax", ["b", "axes"], ["any"], keepdims=0),
        helper.make_node("ReduceMin", ["b", "axes"], ["all"], keepdims=0),
    ]
    outs = ["sum", "prod", "max", "logsumexp", "abs", "cat", "any", "all"]
    inits = {"axes": axes, "start": np.array([2], np.int64), "stop": np.array([2], np.int64)}
    model = conftest.make_onnx(nodes, {"x": x, "z": z, "b": b}, outs, initializers=inits, opset=18)
    top, got = _top_and_iree(tmp_path, model, {"x": x, "z": z, "b": b})
    for name in outs:
        assert _same_bits(np.asarray(top[name]), np.asarray(got[name]).reshape(top[name].shape)).all(), name
    assert np.isneginf(top["max"]).all() and (top["prod"] == 1).all() and top["any"].tolist() == [True, True]


@needs_iree
def test_integer_and_mixed_pow_cumsum_clip_and_bf16_constants(tmp_path):
    """Pow of integers (by squaring, wrapping) and of mixed types (in float, cast back), integer CumSum, Clip
    with min > max (numpy: everything is max), int64 <-> float casts, and bf16 activations' constants."""
    import ml_dtypes
    from onnx import TensorProto, helper

    conftest = _conftest()
    a = np.array([[-3, 2, 7, 0, 5, 3]], np.int64)
    b = np.array([[3, 10, 2, 0, 1, 40]], np.int64)
    f = np.array([[1.5, -2.0, 0.5, 3.0, 2.0, 1.25]], np.float32)
    h = np.array([[-1.5, 0.25, 3.0, -0.01, 2.0, 1.0]], ml_dtypes.bfloat16)
    nodes = [
        helper.make_node("Pow", ["a", "b"], ["ipow"]),
        helper.make_node("Pow", ["f", "b"], ["fpow"]),
        helper.make_node("Pow", ["a", "f"], ["apow"]),
        helper.make_node("CumSum", ["a", "axis"], ["icum"], exclusive=1),
        helper.make_node("Clip", ["f", "two", "one"], ["clip"]),
        helper.make_node("Cast", ["f"], ["f2i"], to=TensorProto.INT64),
        helper.make_node("Cast", ["a"], ["i2f"], to=TensorProto.FLOAT),
        helper.make_node("Celu", ["h"], ["celu"], alpha=2.0),
    ]
    outs = ["ipow", "fpow", "apow", "icum", "clip", "f2i", "i2f", "celu"]
    inits = {"axis": np.array(1, np.int64), "two": np.array(2, np.float32), "one": np.array(1, np.float32)}
    model = conftest.make_onnx(nodes, {"a": a, "b": b, "f": f, "h": h}, outs, initializers=inits, opset=18)
    top, got = _top_and_iree(tmp_path, model, {"a": a, "b": b, "f": f, "h": h})
    for name in outs:
        want = np.asarray(top[name])
        np.testing.assert_allclose(np.asarray(got[name]).astype(np.float64), want.astype(np.float64), rtol=1e-6)
        assert got[name].dtype == want.dtype, name
    assert top["ipow"][0, 5] == 3**40 % 2**64 - 2**64 * (3**40 % 2**64 >= 2**63)  # wrapped, as numpy


@needs_iree
def test_scatter_and_gather_nd(tmp_path):
    """ScatterND and ScatterElements replacing (tosa.scatter) and combining (duplicates all count, negative
    indices from the end), GatherND with batch dims: as TOP's kernels."""
    from onnx import helper

    conftest = _conftest()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 2)).astype(np.float32)
    xi = rng.integers(-50, 50, (3, 5)).astype(np.int32)
    nd_idx = np.array([[1], [-1], [1]], np.int64)  # duplicates: combined in order
    nd_upd = rng.standard_normal((3, 3, 2)).astype(np.float32)
    el_idx = np.array([[1, -1, 0], [4, 2, -5]], np.int64)
    el_upd = rng.integers(-50, 50, (2, 3)).astype(np.int32)
    g_idx = np.array([[[1, 0], [2, 1]], [[0, 1], [-1, 0]], [[2, 0], [0, 1]], [[1, 1], [0, 0]]], np.int64)
    nodes = [
        helper.make_node("ScatterND", ["x", "nd_unique", "nd_upd2"], ["nd_none"]),
        helper.make_node("ScatterND", ["x", "nd_idx", "nd_upd"], ["nd_add"], reduction="add"),
        helper.make_node("ScatterND", ["x", "nd_idx", "nd_upd"], ["nd_mul"], reduction="mul"),
        helper.make_node("ScatterElements", ["xi", "el_idx", "el_upd"], ["el_none"], axis=1),
        helper.make_node("ScatterElements", ["xi", "el_idx", "el_upd"], ["el_max"], axis=1, reduction="max"),
        helper.make_node("GatherND", ["x", "g_idx"], ["gnd"], batch_dims=1),
    ]
    inits = {
        "nd_unique": np.array([[0, 2], [3, 1]], np.int64),
        "nd_upd2": rng.standard_normal((2, 2)).astype(np.float32),
        "nd_idx": nd_idx,
        "nd_upd": nd_upd,
        "el_idx": el_idx,
        "el_upd": el_upd,
        "g_idx": g_idx,
    }
    outs = ["nd_none", "nd_add", "nd_mul", "el_none", "el_max", "gnd"]
    model = conftest.make_onnx(nodes, {"x": x, "xi": xi}, outs, initializers=inits, opset=18)
    top, got = _top_and_iree(tmp_path, model, {"x": x, "xi": xi})
    for name in outs:
        np.testing.assert_allclose(got[name], top[name], rtol=1e-6, err_msg=name)


@needs_iree
def test_topk_in_the_kernels_stable_order(tmp_path):
    """TopK largest and smallest along either axis: ties in index order, NaN first when largest and last when
    smallest, unsigned integers compared unsigned."""
    from onnx import helper

    conftest = _conftest()
    x = np.array([[3.0, np.nan, 1.0, 3.0, -2.0], [0.5, 0.5, np.nan, -1.0, 0.5], [2.0, 1.0, 0.0, 7.0, 1.0]], np.float32)
    u = np.array([[5, 250, 3, 250, 0, 7]], np.uint8)
    nodes = [
        helper.make_node("TopK", ["x", "k3"], ["v_l", "i_l"], axis=1),
        helper.make_node("TopK", ["x", "k3"], ["v_s", "i_s"], axis=1, largest=0),
        helper.make_node("TopK", ["x", "k2"], ["v_0", "i_0"], axis=0),
        helper.make_node("TopK", ["u", "k3"], ["v_u", "i_u"], axis=-1),
    ]
    outs = ["v_l", "i_l", "v_s", "i_s", "v_0", "i_0", "v_u", "i_u"]
    inits = {"k3": np.array([3], np.int64), "k2": np.array([2], np.int64)}
    model = conftest.make_onnx(nodes, {"x": x, "u": u}, outs, initializers=inits, opset=18)
    top, got = _top_and_iree(tmp_path, model, {"x": x, "u": u})
    for name in outs:
        assert _same_bits(np.asarray(top[name]), np.asarray(got[name]).view(top[name].dtype)).all(), name
    assert top["i_l"][0].tolist() == [1, 0, 3] and top["i_s"][1].tolist() == [3, 0, 1]


@needs_iree
def test_lstm_gru_rnn_unrolled(tmp_path):
    """LSTM (bidirectional, peepholes, clip, initial states), GRU (both reset placements, reverse) and RNN (relu
    with an initial state): every output as TOP's kernel within float32 rounding."""
    from onnx import helper

    conftest = _conftest()
    rng = np.random.default_rng(0)
    seq, batch, inp, hs = 4, 2, 3, 5
    x = rng.standard_normal((seq, batch, inp)).astype(np.float32)

    def weights(gates, dirs, prefix):
        return {
            f"{prefix}_w": rng.standard_normal((dirs, gates * hs, inp)).astype(np.float32) * 0.5,
            f"{prefix}_r": rng.standard_normal((dirs, gates * hs, hs)).astype(np.float32) * 0.5,
            f"{prefix}_b": rng.standard_normal((dirs, 2 * gates * hs)).astype(np.float32) * 0.5,
            f"{prefix}_h": rng.standard_normal((dirs, batch, hs)).astype(np.float32),
        }

    inits = {**weights(4, 2, "l"), **weights(3, 1, "g"), **weights(1, 1, "r")}
    inits["l_c"] = rng.standard_normal((2, batch, hs)).astype(np.float32)
    inits["l_p"] = rng.standard_normal((2, 3 * hs)).astype(np.float32)
    nodes = [
        helper.make_node(
            "LSTM",
            ["x", "l_w", "l_r", "l_b", "", "l_h", "l_c", "l_p"],
            ["l_y", "l_yh", "l_yc"],
            hidden_size=hs,
            direction="bidirectional",
            clip=1.5,
        ),
        helper.make_node("GRU", ["x", "g_w", "g_r", "g_b", "", "g_h"], ["g_y", "g_yh"], hidden_size=hs),
        helper.make_node(
            "GRU", ["x", "g_w", "g_r", "g_b"], ["g2_y"], hidden_size=hs, linear_before_reset=1, direction="reverse"
        ),
        helper.make_node(
            "RNN", ["x", "r_w", "r_r", "r_b", "", "r_h"], ["r_y", "r_yh"], hidden_size=hs, activations=["Relu"]
        ),
    ]
    outs = ["l_y", "l_yh", "l_yc", "g_y", "g_yh", "g2_y", "r_y", "r_yh"]
    model = conftest.make_onnx(nodes, {"x": x}, outs, initializers=inits, opset=14)
    top, got = _top_and_iree(tmp_path, model, {"x": x})
    for name in outs:
        np.testing.assert_allclose(got[name], top[name], rtol=1e-5, atol=1e-5, err_msg=name)


@needs_iree
def test_pools_tosa_lacks_tap_by_tap(tmp_path):
    """3-D and dilated pools, and MaxPool's indices (row- and column-major), as the kernel's taps: padded,
    ceil mode, counts with and without the pads."""
    from onnx import helper

    conftest = _conftest()
    rng = np.random.default_rng(0)
    x3 = rng.standard_normal((1, 2, 5, 6, 7)).astype(np.float32)
    x2 = rng.standard_normal((2, 3, 7, 8)).astype(np.float32)
    pool3 = {"kernel_shape": [3, 2, 3], "strides": [2, 1, 2], "pads": [1, 0, 1, 1, 1, 0]}
    nodes = [
        helper.make_node("MaxPool", ["x3"], ["max3"], ceil_mode=1, **pool3),
        helper.make_node("AveragePool", ["x3"], ["avg3"], **pool3),
        helper.make_node("AveragePool", ["x3"], ["avg3_pads"], count_include_pad=1, **pool3),
        helper.make_node("MaxPool", ["x2"], ["dil"], kernel_shape=[2, 3], dilations=[2, 2], pads=[1, 1, 0, 1]),
        helper.make_node("MaxPool", ["x2"], ["mp", "idx"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("MaxPool", ["x2"], ["mp_f", "idx_f"], kernel_shape=[2, 2], storage_order=1),
    ]
    outs = ["max3", "avg3", "avg3_pads", "dil", "mp", "idx", "mp_f", "idx_f"]
    model = conftest.make_onnx(nodes, {"x3": x3, "x2": x2}, outs, opset=19)
    top, got = _top_and_iree(tmp_path, model, {"x3": x3, "x2": x2})
    for name in outs:
        np.testing.assert_allclose(got[name], top[name], rtol=1e-6, atol=1e-7, err_msg=name)
        assert got[name].dtype == top[name].dtype


@needs_iree
def test_float16_sums_accumulate_in_float32(tmp_path):
    """float16 MatMul and the sums of Softmax and ReduceSum accumulate in float32 and round once, as numpy's, and
    Celu computes in float32: within the bench's tolerance of TOP (float16 steps are off by float16 ulps)."""
    from onnx import helper

    conftest = _conftest()
    rng = np.random.default_rng(0)
    a = rng.uniform(0, 1, (4, 512)).astype(np.float16)
    b = rng.uniform(-3, 1, (512, 8)).astype(np.float16)
    nodes = [
        helper.make_node("MatMul", ["a", "b"], ["mm"]),
        helper.make_node("Softmax", ["a"], ["sm"], axis=1),
        helper.make_node("ReduceSum", ["a", "axes"], ["rs"], keepdims=0),
        helper.make_node("Celu", ["b"], ["celu"], alpha=0.7),  # the kernel's float64, rounded once
    ]
    inits = {"axes": np.array([1], np.int64)}
    names = ["mm", "sm", "rs", "celu"]
    model = conftest.make_onnx(nodes, {"a": a, "b": b}, names, initializers=inits, opset=18)
    top, got = _top_and_iree(tmp_path, model, {"a": a, "b": b})
    for name in names:
        assert got[name].dtype == np.float16
        np.testing.assert_allclose(got[name].astype(np.float64), top[name].astype(np.float64), rtol=1e-4, err_msg=name)


@needs_iree
def test_max_and_min_of_infinite_rows(tmp_path):
    """ReduceMax of a row of -inf is -inf and ReduceMin of +inf rows +inf (IREE's tosa.reduce_max starts from
    -FLT_MAX): what an attention mask's all-masked row test relies on; NaN propagates as numpy's."""
    from onnx import helper

    conftest = _conftest()
    x = np.array([[-np.inf, -np.inf, -np.inf], [1.0, np.nan, 2.0], [np.inf, np.inf, np.inf]], np.float32)
    axes = np.array([1], np.int64)
    nodes = [
        helper.make_node("ReduceMax", ["x", "axes"], ["max"]),
        helper.make_node("ReduceMin", ["x", "axes"], ["min"]),
        helper.make_node("Softmax", ["x"], ["sm"], axis=1),
    ]
    model = conftest.make_onnx(nodes, {"x": x}, ["max", "min", "sm"], initializers={"axes": axes}, opset=18)
    top, got = _top_and_iree(tmp_path, model, {"x": x})
    for name in ("max", "min", "sm"):
        np.testing.assert_array_equal(got[name], top[name], err_msg=name)
    assert top["max"][0, 0] == -np.inf and top["min"][2, 0] == np.inf


@needs_iree
def test_bfloat16_sums_round_each_step(tmp_path):
    """bfloat16 ReduceSum as ml_dtypes (TOP's kernel) adds: in order, each partial sum rounded to bfloat16; bit
    for bit (IREE's own bfloat16 sum keeps the partial sums in float32). Softmax uses the same sum, but IREE
    fuses its exp and division without rounding between them: not bit for bit."""
    import ml_dtypes
    from onnx import helper

    conftest = _conftest()
    x = np.random.default_rng(0).uniform(0, 1, (3, 300)).astype(ml_dtypes.bfloat16)
    node = helper.make_node("ReduceSum", ["x", "axes"], ["rs"])
    model = conftest.make_onnx([node], {"x": x}, ["rs"], initializers={"axes": np.array([1], np.int64)}, opset=18)
    top, got = _top_and_iree(tmp_path, model, {"x": x})
    assert _same_bits(np.asarray(top["rs"]), np.asarray(got["rs"])).all()


@needs_iree
def test_einsum_ellipsis_diagonal_and_implicit_output(tmp_path):
    """Einsum with an ellipsis (broadcast batch dims), a repeated subscript (a diagonal) and an implicit output."""
    from onnx import helper

    conftest = _conftest()
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 3, 4, 4)).astype(np.float32)
    b = rng.standard_normal((3, 4, 5)).astype(np.float32)
    nodes = [
        helper.make_node("Einsum", ["a"], ["diag"], equation="...ii->...i"),
        helper.make_node("Einsum", ["a", "b"], ["bmm"], equation="...ij,...jk->...ik"),
        helper.make_node("Einsum", ["a", "b"], ["implicit"], equation="abij,bjk"),
    ]
    outs = ["diag", "bmm", "implicit"]
    model = conftest.make_onnx(nodes, {"a": a, "b": b}, outs, opset=18)
    top, got = _top_and_iree(tmp_path, model, {"a": a, "b": b})
    for name in outs:
        np.testing.assert_allclose(got[name], top[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert top["implicit"].shape == (2, 4, 5)


@needs_iree
def test_conv3d_and_its_transpose(tmp_path):
    """3-D Conv (pads, strides, dilations, bias, a computed filter, two groups) and ConvTranspose through
    tosa.conv3d."""
    from onnx import helper

    conftest = _conftest()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 2, 5, 6, 7)).astype(np.float32)
    w = rng.standard_normal((3, 2, 2, 3, 2)).astype(np.float32)
    wt = rng.standard_normal((2, 3, 3, 2, 2)).astype(np.float32)
    bias = rng.standard_normal(3).astype(np.float32)
    wg = rng.standard_normal((4, 1, 2, 2, 3)).astype(np.float32)
    bg = rng.standard_normal(4).astype(np.float32)
    nodes = [
        helper.make_node(
            "Conv", ["x", "w", "bias"], ["conv"], pads=[1, 0, 1, 0, 1, 1], strides=[2, 1, 2], dilations=[1, 2, 1]
        ),
        helper.make_node("Conv", ["x", "w_in"], ["computed"]),
        helper.make_node("Conv", ["x", "wg", "bg"], ["grouped"], group=2, pads=[0, 1, 1, 0, 1, 1]),
        helper.make_node("ConvTranspose", ["x", "wt"], ["deconv"], strides=[2, 1, 2], pads=[1, 0, 0, 0, 1, 1]),
    ]
    outs = ["conv", "computed", "grouped", "deconv"]
    inputs = {"x": x, "w_in": w}
    initializers = {"w": w, "wt": wt, "bias": bias, "wg": wg, "bg": bg}
    model = conftest.make_onnx(nodes, inputs, outs, initializers=initializers, opset=18)
    top, got = _top_and_iree(tmp_path, model, inputs)
    for name in outs:
        np.testing.assert_allclose(got[name], top[name], rtol=1e-5, atol=1e-5, err_msg=name)


@needs_iree
def test_grouped_convs_through_iree_match_onnxruntime(tmp_path):
    """A grouped 1x1 conv with bias and ReLU (ShuffleNet's: one batched matmul, no conv per group) and a grouped
    3x3 one (a conv per group), against onnxruntime."""
    from onnx import helper

    conftest = _conftest()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 8, 5, 6)).astype(np.float32)
    w1 = rng.standard_normal((12, 2, 1, 1)).astype(np.float32)
    b1 = rng.standard_normal(12).astype(np.float32)
    w2 = rng.standard_normal((6, 6, 3, 3)).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], group=4, name="gconv1x1"),
        helper.make_node("Relu", ["c1"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "w2"], ["y"], group=2, pads=[1, 1, 1, 1], name="gconv3x3"),
    ]
    model = conftest.make_onnx(nodes, {"x": x}, initializers={"w1": w1, "b1": b1, "w2": w2})
    text, got, want = _iree_and_onnxruntime(tmp_path, model, {"x": x}, ["y"])
    assert text.count('"tosa.matmul"') == 1 and text.count('"tosa.conv2d"') == 2
    np.testing.assert_allclose(got["y"], want["y"], rtol=1e-4, atol=1e-4)


def _iree_and_onnxruntime(tmp_path: Path, model, inputs: dict, outs: list[str]) -> tuple[str, dict, dict]:
    """The model's TOSA export, its outputs through IREE, and onnxruntime's."""
    import onnxruntime as ort

    from tpubuild.build.cpu import Vmfb, compile_vmfb
    from tpubuild.export.tosa import export_module

    module, weights = _top_module(tmp_path, model, inputs)
    text = export_module(module, weights, "tiny")
    (tmp_path / "m.tosa.mlir").write_text(text, encoding="utf-8")
    compile_vmfb(str(tmp_path / "m.tosa.mlir"), str(tmp_path / "m.vmfb"))
    got = Vmfb(str(tmp_path / "m.vmfb")).run(inputs)
    want = dict(zip(outs, ort.InferenceSession(model.SerializeToString()).run(outs, inputs), strict=True))
    return text, got, want


@needs_iree
def test_upsampling_and_global_means_take_the_short_forms(tmp_path):
    """DBNet's and FPN's upsampling and squeeze-excite's mean, against onnxruntime: a ConvTranspose whose windows
    tile its output (stride = kernel) is one tosa.matmul, not a conv on a zero-stuffed input; a nearest Resize by
    whole factors a broadcast, not a gather; a mean over H and W one reduction; the general forms stay for the
    rest (a ConvTranspose with overlapping windows, a Resize by 1.5)."""
    from onnx import helper

    conftest = _conftest()
    rng = np.random.default_rng(0)
    x, wt, bt, wo = (rng.standard_normal(s).astype(np.float32) for s in [(1, 4, 6, 5), (4, 3, 2, 2), 3, (4, 2, 3, 3)])
    nodes = [
        helper.make_node("ConvTranspose", ["x", "wt", "bt"], ["up"], strides=[2, 2], name="deconv"),
        helper.make_node("ConvTranspose", ["x", "wo"], ["overlap"], strides=[2, 2], name="deconv_overlap"),
        helper.make_node("Resize", ["x", "", "s2"], ["near"], mode="nearest", name="resize2"),
        helper.make_node("Resize", ["x", "", "s15"], ["near15"], mode="nearest", name="resize15"),
        helper.make_node("ReduceMean", ["x"], ["mean"], axes=[2, 3], keepdims=1, name="mean"),
    ]
    outs = ["up", "overlap", "near", "near15", "mean"]
    inits = {
        "wt": wt,
        "bt": bt,
        "wo": wo,
        "s2": np.array([1, 1, 2, 3], np.float32),
        "s15": np.array([1, 1, 1.5, 1.5], np.float32),
    }
    model = conftest.make_onnx(nodes, {"x": x}, outs, initializers=inits, opset=17)
    text, got, want = _iree_and_onnxruntime(tmp_path, model, {"x": x}, outs)
    # the overlapping deconv's conv, the 1.5 resize's two gathers, one reduction
    assert text.count('"tosa.matmul"') == 1 and text.count('"tosa.conv2d"') == 1
    assert text.count('"tosa.gather"') == 2 and text.count('"tosa.reduce_sum"') == 1
    for name in outs:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)


def _conv_join_model(depthwise: bool):
    """Two 1x1 conv branches of one input joined by a channel Concat, then a float32 Softmax over the channels;
    with ``depthwise``, a depthwise 3x3 conv reads the input first (a MobileNet block)."""
    from onnx import helper

    conftest = _conftest()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 4, 5, 6)).astype(np.float32)
    inits = {n: rng.standard_normal(s).astype(np.float32) for n, s in [("wa", (3, 4, 1, 1)), ("wb", (2, 4, 1, 1))]}
    nodes, src = [], "x"
    if depthwise:
        inits["wd"] = rng.standard_normal((4, 1, 3, 3)).astype(np.float32)
        nodes.append(helper.make_node("Conv", ["x", "wd"], ["dw"], group=4, pads=[1, 1, 1, 1]))
        src = "dw"
    nodes += [
        helper.make_node("Conv", [src, "wa"], ["a"]),
        helper.make_node("Conv", [src, "wb"], ["b"]),
        helper.make_node("Concat", ["a", "b"], ["cat"], axis=1),
        helper.make_node("Softmax", ["cat"], ["probs"], axis=1),
    ]
    return conftest.make_onnx(nodes, {"x": x}, ["cat", "probs"], initializers=inits, opset=17), x


@needs_iree
@pytest.mark.parametrize("depthwise", [False, True])
def test_pointwise_convs_and_softmax_take_the_forms_iree_compiles_best(tmp_path, depthwise):
    """Against onnxruntime: a 1x1 conv is a tosa.matmul, never a tosa.conv2d; in NCHW (its channel Concat a
    contiguous join), unless the model has depthwise convs, which are channels-last only (then a matmul of the
    pixels); a float32 Softmax is one linalg.softmax."""
    model, x = _conv_join_model(depthwise)
    text, got, want = _iree_and_onnxruntime(tmp_path, model, {"x": x}, ["cat", "probs"])
    assert text.count('"tosa.matmul"') == 2 and '"tosa.conv2d"' not in text
    assert ('"tosa.depthwise_conv2d"' in text) == depthwise
    if not depthwise:
        assert '"tosa.transpose"' not in text
    assert text.count('"linalg.softmax"') == 1
    for name in ("cat", "probs"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
