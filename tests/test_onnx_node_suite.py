"""A representative subset of the ONNX backend node tests, run as bench/onnx_node_tests.py runs them.

Frontend + canonicalize + TOP inference against the expected outputs the onnx
generators compute (regenerated deterministically on first use; the whole
suite is the bench's job, and the `slow` test below).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "onnx_node_tests.py"


def _bench():
    spec = importlib.util.spec_from_file_location("onnx_node_tests", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = _bench()

NODE_CASES = [
    # tensor / layout / sequence ops
    "test_convtranspose",
    "test_convtranspose_1d",
    "test_convtranspose_3d",
    "test_convtranspose_autopad_same",
    "test_convtranspose_dilations",
    "test_convtranspose_group_2_image_3",
    "test_convtranspose_output_shape",
    "test_convtranspose_pads",
    "test_expand_dim_changed",
    "test_tile_precomputed",
    "test_gather_2d_indices",
    "test_gather_negative_indices",
    "test_gather_elements_negative_indices",
    "test_gathernd_example_int32_batch_dim1",
    "test_scatter_elements_with_duplicate_indices",
    "test_scatternd_max",
    "test_tril_neg",
    "test_triu_one_row",
    "test_cumsum_1d_reverse_exclusive",
    "test_split_2d_uneven_split_opset18",
    "test_split_variable_parts_default_axis_opset13",
    "test_split_zero_size_splits_opset13",
    "test_split_equal_parts_2d",
    "test_slice_neg_steps",
    "test_slice_negative_axes",
    "test_slice_end_out_of_bounds",
    "test_constant_pad_axes",
    "test_reflect_pad",
    "test_edge_pad",
    "test_wrap_pad",
    "test_resize_upsample_scales_nearest",
    "test_resize_downsample_sizes_nearest_not_smaller",
    "test_resize_upsample_sizes_nearest_round_prefer_ceil_asymmetric",
    "test_resize_upsample_sizes_nearest_floor_align_corners",
    "test_resize_upsample_scales_linear_align_corners",
    "test_resize_downsample_scales_linear",
    "test_resize_downsample_sizes_linear_pytorch_half_pixel",
    "test_resize_upsample_scales_cubic_A_n0p5_exclude_outside",
    "test_resize_downsample_scales_linear_antialias",
    "test_resize_tf_crop_and_resize_axes_3_2",
    "test_resize_upsample_scales_linear_half_pixel_symmetric",
    "test_upsample_nearest",
    "test_depthtospace_crd_mode_example",
    "test_spacetodepth_example",
    "test_einsum_batch_matmul",
    "test_einsum_transpose",
    "test_einsum_sum",
    "test_top_k_negative_axis",
    "test_top_k_same_values_largest",
    "test_top_k_smallest",
    "test_lstm_with_peepholes",
    "test_lstm_bidirectional",
    "test_gru_with_initial_bias",
    "test_gru_reverse",
    "test_simple_rnn_batchwise",
    "test_matmul_bcast",
    "test_matmul_4d_1d",
    # the rest of the frontend, a few each
    "test_conv_with_strides_and_asymmetric_padding",
    "test_averagepool_2d_ceil",
    "test_maxpool_2d_same_lower",
    "test_gemm_all_attributes",
    "test_reshape_zero_and_negative_dim",
    "test_softmax_axis_0",
    "test_layer_normalization_3d_axis1_epsilon",
    "test_layer_normalization_4d_axis_negative_2_expanded",
    "test_center_crop_pad_crop_and_pad_expanded",
    "test_where_long_example",
]

PYTORCH_CASES = [
    ("pytorch-converted", "test_ConvTranspose2d"),
    ("pytorch-converted", "test_PixelShuffle"),
    ("pytorch-converted", "test_Embedding"),
    ("pytorch-converted", "test_GLU_dim"),
    ("pytorch-converted", "test_ReflectionPad2d"),
    ("pytorch-converted", "test_PReLU_2d_multiparam"),
    ("pytorch-operator", "test_operator_chunk"),
    ("pytorch-operator", "test_operator_index"),
    ("pytorch-operator", "test_operator_repeat_dim_overflow"),
    ("pytorch-operator", "test_operator_pad"),
]


def _case(suite: str, name: str):
    path = bench.suite_dir(suite) / name
    assert (path / "model.onnx").exists(), f"no case {suite}/{name}"
    return bench.Case(suite, name, path)


def _assert_passes(case) -> None:
    result = bench.run_case(case)
    assert result.status == "pass", f"{case.suite}/{case.name} [{result.op}]: {result.status}: {result.reason}"


@pytest.mark.parametrize("name", NODE_CASES)
def test_node_case(name):
    _assert_passes(_case("node", name))


@pytest.mark.parametrize("suite,name", PYTORCH_CASES)
def test_pytorch_case(suite, name):
    _assert_passes(_case(suite, name))


def test_unsupported_ops_are_reported_not_failed():
    """A case using an op without a converter is out of scope, with the op named."""
    result = bench.run_case(_case("node", "test_det_2d"))
    assert result.status == "unsupported" and "Det" in result.reason


def test_frozen_inputs_are_counted():
    """Resize's scales are a graph input in the test; the bench freezes them and says so."""
    result = bench.run_case(_case("node", "test_resize_upsample_scales_nearest"))
    assert result.status == "pass" and result.frozen == ("scales",)


@pytest.mark.slow
def test_full_suites_pass_rate():
    """The bench's goal: at least 95% of the supported cases pass, in every suite."""
    for suite in bench.SUITES:
        results = [bench.run_case(c) for c in bench.list_cases(suite)]
        supported = [r for r in results if r.status != "unsupported"]
        passed = sum(r.status == "pass" for r in supported)
        assert supported and passed / len(supported) >= 0.95, (
            f"{suite}: {passed}/{len(supported)}: "
            + "; ".join(f"{r.case.name}: {r.reason}" for r in supported if r.status == "fail")[:2000]
        )
