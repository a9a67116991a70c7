"""Tensor/layout/sequence converters on one-node models, checked against onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from tpubuild.ir import mlir, top

R = np.random.default_rng(4321)


def randn(*shape, dtype=np.float32):
    return R.standard_normal(shape).astype(dtype)


def node(op, inputs, outputs=("y",), **attrs):
    return helper.make_node(op, list(inputs), list(outputs), name=f"{op}_node", **attrs)


def i64(*values):
    return np.array(values, dtype=np.int64)


def op_names(module):
    return [op.name for op in mlir.body_ops(module) if isinstance(op, top.TopOp)]


# ---- ConvTranspose ------------------------------------------------------------

DECONV_CASES = {
    "basic": ((1, 2, 4, 4), (2, 3, 3, 3), dict()),
    "strides": ((1, 2, 3, 4), (2, 3, 3, 3), dict(strides=[2, 2])),
    "pads": ((1, 1, 3, 3), (1, 2, 3, 3), dict(strides=[3, 2], pads=[1, 2, 1, 2])),
    "output_padding": ((1, 2, 3, 3), (2, 2, 3, 3), dict(strides=[3, 2], output_padding=[1, 1])),
    "dilations": ((1, 1, 3, 3), (1, 1, 2, 2), dict(dilations=[2, 2])),
    "groups": ((1, 4, 3, 3), (4, 2, 3, 3), dict(group=2, strides=[2, 2])),
    "depthwise": ((2, 3, 4, 4), (3, 1, 2, 2), dict(group=3, strides=[2, 2])),
    "output_shape": ((1, 1, 3, 3), (1, 2, 3, 3), dict(strides=[3, 2], output_shape=[10, 8])),
    "same_upper": ((1, 1, 3, 3), (1, 2, 3, 3), dict(strides=[2, 2], auto_pad="SAME_UPPER")),
    "same_lower": ((1, 1, 3, 4), (1, 2, 2, 3), dict(strides=[2, 2], auto_pad="SAME_LOWER")),
    "conv1d": ((1, 2, 5), (2, 3, 3), dict(strides=[2], pads=[1, 0])),
    "conv3d": ((1, 1, 3, 4, 2), (1, 2, 3, 3, 2), dict(strides=[1, 2, 1])),
}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", DECONV_CASES)
def test_conv_transpose(check_onnx, case, bias):
    xs, ws, attrs = DECONV_CASES[case]
    inits = {"w": randn(*ws)}
    ins = ["x", "w"]
    if bias:
        inits["b"] = randn(ws[1] * attrs.get("group", 1))
        ins.append("b")
    check_onnx(node("ConvTranspose", ins, **attrs), {"x": randn(*xs)}, initializers=inits, opset=17)


def test_conv_transpose_is_deconv(convert, make_model):
    model = make_model(
        node("ConvTranspose", ["x", "w"], strides=[2, 2]),
        {"x": randn(1, 2, 3, 3)},
        initializers={"w": randn(2, 4, 2, 2)},
    )
    module, _ = convert(model, {"x": [1, 2, 3, 3]})
    assert "top.Deconv" in op_names(module)


# ---- Expand / Tile ------------------------------------------------------------


@pytest.mark.parametrize(
    "x_shape,shape", [((3, 1), (2, 3, 4)), ((1, 4), (3, 1)), ((2, 3), (2, 3)), ((3,), (2, 1, 3)), ((4, 1, 2), (1,))]
)
def test_expand(check_onnx, x_shape, shape):
    check_onnx(node("Expand", ["x", "s"]), {"x": randn(*x_shape)}, initializers={"s": i64(*shape)})


@pytest.mark.parametrize("x_shape,repeats", [((2, 3), (2, 1)), ((2, 1, 3), (1, 3, 2)), ((4,), (3,))])
def test_tile(check_onnx, x_shape, repeats):
    check_onnx(node("Tile", ["x", "r"]), {"x": randn(*x_shape)}, initializers={"r": i64(*repeats)})


def test_tile_int(check_onnx):
    check_onnx(node("Tile", ["x", "r"]), {"x": i64(1, 2, 3).reshape(1, 3)}, initializers={"r": i64(2, 2)})


# ---- Gather / GatherElements ------------------------------------------------------------

GATHER_CASES = {
    "axis0": ((5, 4), 0, np.array([0, 3, -1, 2])),
    "axis1_2d_indices": ((3, 5, 2), 1, np.array([[0, 4], [-2, 1]])),
    "scalar_index": ((2, 6, 3), 1, np.array(2)),
    "last_axis": ((2, 3, 4), -1, np.array([3, 0])),
}


@pytest.mark.parametrize("case", GATHER_CASES)
@pytest.mark.parametrize("const_indices", [True, False])
def test_gather(check_onnx, case, const_indices):
    shape, axis, idx = GATHER_CASES[case]
    idx = idx.astype(np.int64)
    inputs = {"x": randn(*shape)}
    if const_indices:
        check_onnx(node("Gather", ["x", "i"], axis=axis), inputs, initializers={"i": idx}, opset=13)
    else:
        check_onnx(node("Gather", ["x", "i"], axis=axis), {**inputs, "i": idx}, opset=13)


def test_gather_embedding(check_onnx):
    """A constant table indexed by run-time ids (an embedding lookup)."""
    ids = R.integers(0, 10, (2, 5)).astype(np.int64)
    check_onnx(node("Gather", ["table", "ids"]), {"ids": ids}, initializers={"table": randn(10, 8)})


def test_gather_int32_indices(check_onnx):
    check_onnx(node("Gather", ["x", "i"], axis=1), {"x": randn(2, 5)}, initializers={"i": np.array([4, 0], np.int32)})


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_elements(check_onnx, axis):
    x = randn(3, 4)
    dim = x.shape[axis]
    idx = R.integers(-dim, dim, (2, 4) if axis == 0 else (3, 3)).astype(np.int64)
    check_onnx(node("GatherElements", ["x", "i"], axis=axis), {"x": x, "i": idx})


@pytest.mark.parametrize("batch_dims", [0, 1])
def test_gather_nd(check_onnx, batch_dims):
    x = randn(2, 3, 4)
    idx = np.array([[[1], [0]], [[2], [-1]]], np.int64) if batch_dims else np.array([[0, 2], [1, -1]], np.int64)
    check_onnx(node("GatherND", ["x", "i"], batch_dims=batch_dims), {"x": x}, initializers={"i": idx}, opset=13)


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
@pytest.mark.parametrize("axis", [0, -1])
def test_scatter_elements(check_onnx, axis, reduction):
    x = randn(3, 4)
    if axis == 0:
        idx = (
            np.array([[0, 2, 1, 0], [2, 1, 0, 1]], np.int64)
            if reduction == "none"
            else np.array([[0, 2, 1, 0], [0, 2, -2, 1]], np.int64)
        )  # repeats accumulate
    else:
        idx = np.array([[3, 0], [1, -1], [2, 0]], np.int64)
    check_onnx(
        node("ScatterElements", ["x", "i", "u"], axis=axis, reduction=reduction),
        {"x": x, "u": randn(*idx.shape)},
        initializers={"i": idx},
        opset=18,
    )


@pytest.mark.parametrize("reduction", ["none", "add", "max"])
def test_scatter_nd(check_onnx, reduction):
    x = randn(4, 3, 2)
    idx = np.array([[1], [3]], np.int64) if reduction == "none" else np.array([[1, 0], [1, 0], [-1, 2]], np.int64)
    upd = randn(2, 3, 2) if reduction == "none" else randn(3, 2)
    check_onnx(
        node("ScatterND", ["x", "i", "u"], reduction=reduction), {"x": x, "u": upd}, initializers={"i": idx}, opset=18
    )


@pytest.mark.parametrize("upper", [0, 1])
@pytest.mark.parametrize("k", [None, -1, 2])
def test_trilu(check_onnx, upper, k):
    inits = {} if k is None else {"k": np.array(k, np.int64)}
    check_onnx(
        node("Trilu", ["x"] + ([] if k is None else ["k"]), upper=upper),
        {"x": randn(2, 4, 5)},
        initializers=inits,
        opset=14,
    )


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
def test_cumsum(check_onnx, exclusive, reverse):
    check_onnx(
        node("CumSum", ["x", "a"], exclusive=exclusive, reverse=reverse),
        {"x": randn(3, 5)},
        initializers={"a": np.array(-1, np.int64)},
        opset=14,
    )


def test_cumsum_int(check_onnx):
    check_onnx(
        node("CumSum", ["x", "a"]),
        {"x": i64(1, 2, 3, 4).reshape(2, 2)},
        initializers={"a": np.array(0, np.int32)},
        opset=14,
    )


# ---- Split ------------------------------------------------------------------------


def test_split_equal(check_onnx):
    check_onnx(node("Split", ["x"], ["a", "b", "c"], axis=1), {"x": randn(2, 6, 3)}, opset=13)


def test_split_sizes_input(check_onnx):
    check_onnx(
        node("Split", ["x", "s"], ["a", "b"], axis=-1), {"x": randn(2, 7)}, initializers={"s": i64(3, 4)}, opset=13
    )


def test_split_sizes_attr(check_onnx):
    check_onnx(node("Split", ["x"], ["a", "b", "c"], axis=0, split=[1, 2, 3]), {"x": randn(6, 2)}, opset=11)


def test_split_num_outputs_uneven(check_onnx):
    check_onnx(node("Split", ["x"], ["a", "b", "c"], axis=1, num_outputs=3), {"x": randn(2, 7)}, opset=18)


def test_split_is_one_multi_result_op(convert, make_model):
    model = make_model(node("Split", ["x"], ["a", "b"], axis=0), {"x": randn(4, 2)}, opset=13)
    module, _ = convert(model, {"x": [4, 2]})
    (split,) = [op for op in mlir.body_ops(module) if isinstance(op, top.SplitOp)]
    assert split.names == ["a", "b"]
    # the FusedLoc survives the generic-form round trip
    again = mlir.parse_module(mlir.print_module(module))
    (split2,) = [op for op in mlir.body_ops(again) if isinstance(op, top.SplitOp)]
    assert split2.names == ["a", "b"]


# ---- Slice ----------------------------------------------------------------------

BIG = np.iinfo(np.int64).max
SLICE_CASES = {
    "basic": ((5, 6), (1, 0), (4, 5), None, None),
    "axes": ((4, 5, 6), (1,), (-1,), (2,), None),
    "steps": ((8, 6), (0, 1), (8, 6), (0, 1), (2, 3)),
    "negative_steps": ((6, 5), (-1, 4), (-BIG, 0), (0, 1), (-1, -2)),
    "negative_step_mid": ((10,), (8,), (1,), None, (-3,)),
    "clamped": ((4, 4), (-100, 2), (BIG, 100), (0, 1), None),
    "negative_axes": ((3, 4, 5), (1, 1), (3, 4), (-1, -2), None),
    "empty": ((4, 3), (3,), (1,), (0,), None),
}


@pytest.mark.parametrize("case", SLICE_CASES)
def test_slice(check_onnx, case):
    shape, starts, ends, axes, steps = SLICE_CASES[case]
    inits = {"starts": i64(*starts), "ends": i64(*ends)}
    ins = ["x", "starts", "ends"]
    if axes is not None or steps is not None:
        inits["axes"] = i64(*(axes if axes is not None else range(len(starts))))
        ins.append("axes")
    if steps is not None:
        inits["steps"] = i64(*steps)
        ins.append("steps")
    check_onnx(node("Slice", ins), {"x": randn(*shape)}, initializers=inits, opset=13)


def test_slice_opset1_attrs(check_onnx):
    check_onnx(node("Slice", ["x"], starts=[1, 0], ends=[3, -1], axes=[0, 2]), {"x": randn(4, 3, 5)}, opset=9)


def test_slice_runtime_starts_refused(convert, make_model):
    from tpubuild.errors import TpuBuildError

    model = make_model(node("Slice", ["x", "s", "e"]), {"x": randn(4, 3), "s": i64(1), "e": i64(3)}, opset=13)
    with pytest.raises(TpuBuildError, match="must be known at compile time"):
        convert(model, {"x": [4, 3], "s": [1], "e": [1]})


# ---- Pad --------------------------------------------------------------------------

PAD_CASES = {
    "constant": ((1, 2, 3, 4), (0, 0, 1, 2, 0, 0, 2, 1), "constant"),
    "reflect": ((1, 2, 4, 5), (0, 0, 2, 1, 0, 0, 1, 3), "reflect"),
    "edge": ((2, 3, 4), (0, 1, 2, 1, 0, 3), "edge"),
    "negative": ((3, 5), (1, -1, -1, 2), "constant"),
}


@pytest.mark.parametrize("case", PAD_CASES)
def test_pad(check_onnx, case):
    shape, pads, mode = PAD_CASES[case]
    check_onnx(node("Pad", ["x", "p"], mode=mode), {"x": randn(*shape)}, initializers={"p": i64(*pads)}, opset=13)


def test_pad_constant_value(check_onnx):
    check_onnx(
        node("Pad", ["x", "p", "v"]),
        {"x": randn(2, 3)},
        initializers={"p": i64(1, 0, 0, 2), "v": np.array(1.5, np.float32)},
        opset=13,
    )


def test_pad_axes_opset18(check_onnx):
    check_onnx(
        node("Pad", ["x", "p", "", "a"], mode="edge"),
        {"x": randn(2, 3, 4)},
        initializers={"p": i64(1, 2, 0, 1), "a": i64(-1, 1)},
        opset=18,
    )


def test_pad_wrap_opset19(check_onnx):
    check_onnx(node("Pad", ["x", "p"], mode="wrap"), {"x": randn(3, 4)}, initializers={"p": i64(1, 2, 2, 1)}, opset=19)


def test_pad_opset2_attr(check_onnx):
    check_onnx(node("Pad", ["x"], pads=[0, 1, 1, 0], mode="reflect"), {"x": randn(3, 4)}, opset=10)


# ---- Resize / Upsample ---------------------------------------------------------------

RESIZE_CASES = {
    # name: (input shape, scales or None, sizes or None, attrs)
    "nearest_up2": ((1, 2, 3, 4), (1, 1, 2, 2), None, dict(mode="nearest")),
    "nearest_asym_floor": (
        (1, 1, 3, 5),
        (1, 1, 2, 1.5),
        None,
        dict(mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
    ),
    "nearest_ceil_half_pixel": ((1, 1, 4, 4), None, (1, 1, 7, 9), dict(mode="nearest", nearest_mode="ceil")),
    "nearest_prefer_ceil_asym": (
        (1, 1, 4, 4),
        None,
        (1, 1, 8, 7),
        dict(mode="nearest", nearest_mode="round_prefer_ceil", coordinate_transformation_mode="asymmetric"),
    ),
    "nearest_floor_align": (
        (1, 1, 4, 4),
        None,
        (1, 1, 8, 8),
        dict(mode="nearest", nearest_mode="floor", coordinate_transformation_mode="align_corners"),
    ),
    "nearest_down": ((1, 2, 8, 6), (1, 1, 0.5, 0.5), None, dict(mode="nearest")),
    "linear_half_pixel": ((1, 2, 3, 4), (1, 1, 2, 2), None, dict(mode="linear")),
    "linear_down": ((1, 1, 8, 8), (1, 1, 0.6, 0.6), None, dict(mode="linear")),
    "linear_align_corners": (
        (1, 2, 3, 4),
        None,
        (1, 2, 7, 9),
        dict(mode="linear", coordinate_transformation_mode="align_corners"),
    ),
    "linear_asymmetric": (
        (1, 2, 3, 4),
        (1, 1, 2, 3),
        None,
        dict(mode="linear", coordinate_transformation_mode="asymmetric"),
    ),
    "linear_pytorch_half_pixel": (
        (1, 1, 4, 4),
        None,
        (1, 1, 3, 1),
        dict(mode="linear", coordinate_transformation_mode="pytorch_half_pixel"),
    ),
    "linear_sizes": ((2, 3, 5, 6), None, (2, 3, 8, 4), dict(mode="linear")),
    # 1/49 * 49 is not exactly 1 in floating point: still the 'one output' rule of pytorch_half_pixel
    "pytorch_half_pixel_to_one": (
        (1, 1, 2, 49),
        None,
        (1, 1, 2, 1),
        dict(mode="linear", coordinate_transformation_mode="pytorch_half_pixel"),
    ),
    "cubic": ((1, 1, 4, 4), (1, 1, 2, 2), None, dict(mode="cubic")),
    "cubic_exclude": ((1, 1, 4, 4), (1, 1, 1.5, 1.5), None, dict(mode="cubic", cubic_coeff_a=-0.5, exclude_outside=1)),
    "linear_3d": ((1, 3, 5), (1, 1, 2.5), None, dict(mode="linear")),
}


@pytest.mark.parametrize("opset", [13, 19])
@pytest.mark.parametrize("case", RESIZE_CASES)
def test_resize(check_onnx, case, opset):
    shape, scales, sizes, attrs = RESIZE_CASES[case]
    inits = {"roi": np.array([], np.float32)}
    if scales is not None:
        inits["scales"] = np.array(scales, np.float32)
        ins = ["x", "roi", "scales"]
    else:
        inits["sizes"] = i64(*sizes)
        ins = ["x", "roi", "", "sizes"]
    check_onnx(node("Resize", ins, **attrs), {"x": randn(*shape)}, initializers=inits, opset=opset)


def test_resize_opset11_scales(check_onnx):
    check_onnx(
        node("Resize", ["x", "roi", "scales"], mode="linear", coordinate_transformation_mode="align_corners"),
        {"x": randn(1, 2, 3, 3)},
        initializers={"roi": np.array([], np.float32), "scales": np.array([1, 1, 2, 2], np.float32)},
        opset=11,
    )


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_resize_opset10(check_onnx, mode):
    check_onnx(
        node("Resize", ["x", "scales"], mode=mode),
        {"x": randn(1, 2, 3, 4)},
        initializers={"scales": np.array([1, 1, 2, 1.5], np.float32)},
        opset=10,
    )


@pytest.mark.parametrize("policy", ["not_larger", "not_smaller"])
def test_resize_axes_keep_aspect(check_onnx, policy):
    check_onnx(
        node("Resize", ["x", "", "", "sizes"], mode="nearest", axes=[3, 2], keep_aspect_ratio_policy=policy),
        {"x": randn(1, 1, 4, 6)},
        initializers={"sizes": i64(9, 5)},
        opset=18,
    )


# ---- OneHot, Hardmax ---------------------------------------------------------------------------


@pytest.mark.parametrize("axis", [-1, 0, 1])
@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.float32])
def test_one_hot(check_onnx, axis, dtype):
    """Negative indices count from the end; out of range ones give no hit; float indices truncate."""
    indices = np.array([[0, 3, -1], [-5, 5, 2]]).astype(dtype)
    if dtype == np.float32:
        indices = indices + np.float32(0.6)
    check_onnx(
        node("OneHot", ["indices", "depth", "values"], axis=axis),
        {"indices": indices},
        # (the type combinations onnxruntime implements: depth as the indices)
        initializers={"depth": np.array(5, dtype), "values": np.array([-1.5, 2.0], np.float32)},
        opset=11,
    )


@pytest.mark.parametrize("axis", [-1, 1])
def test_hardmax_takes_the_first_maximum(check_onnx, axis):
    x = R.integers(0, 3, (2, 4, 5)).astype(np.float32)  # ties
    check_onnx(node("Hardmax", ["x"], axis=axis), {"x": x}, opset=13)


# ---- GridSample ---------------------------------------------------------------------------


@pytest.mark.parametrize("align_corners", [0, 1])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
def test_grid_sample(check_onnx, mode, padding_mode, align_corners):
    """Against onnxruntime, with grid points out to 2.5x the borders (several reflections) and some exactly on
    pixel centres and halfway between them (nearest's ties go to even)."""
    grid = R.uniform(-2.5, 2.5, (2, 5, 6, 2)).astype(np.float32)
    grid[0, 0, :5] = [[-1, -1], [1, 1], [0, 0], [-0.75, 0.25], [0.125, -0.5]]
    check_onnx(
        node("GridSample", ["x", "grid"], mode=mode, padding_mode=padding_mode, align_corners=align_corners),
        {"x": randn(2, 3, 4, 5), "grid": grid},
        opset=16,
    )


@pytest.mark.parametrize("align_corners", [0, 1])
def test_affine_grid_then_grid_sample(check_onnx, align_corners):
    """A spatial transformer: the grid of theta over the output size, then sampled from."""
    theta = (np.eye(2, 3) + R.uniform(-0.3, 0.3, (2, 2, 3))).astype(np.float32)
    check_onnx(
        [
            node("AffineGrid", ["theta", "size"], ["grid"], align_corners=align_corners),
            node("GridSample", ["x", "grid"], ["y"], align_corners=align_corners),
        ],
        {"x": randn(2, 3, 5, 7), "theta": theta},
        ["y", "grid"],
        initializers={"size": i64(2, 3, 4, 6)},
        opset=20,
    )


def test_grid_sample_volumetric(check_onnx):
    check_onnx(
        node("GridSample", ["x", "grid"], mode="linear", padding_mode="border"),
        {"x": randn(1, 2, 3, 4, 5), "grid": R.uniform(-1.2, 1.2, (1, 2, 3, 4, 3)).astype(np.float32)},
        opset=20,
    )


def test_resize_half_pixel_symmetric(check_onnx):
    check_onnx(
        node("Resize", ["x", "", "scales"], mode="linear", coordinate_transformation_mode="half_pixel_symmetric"),
        {"x": randn(1, 1, 4, 5)},
        initializers={"scales": np.array([1, 1, 0.7, 1.7], np.float32)},
        opset=19,
    )


def test_resize_tf_crop_and_resize(check_onnx):
    check_onnx(
        node(
            "Resize",
            ["x", "roi", "", "sizes"],
            mode="linear",
            coordinate_transformation_mode="tf_crop_and_resize",
            extrapolation_value=10.0,
        ),
        {"x": randn(1, 1, 4, 4)},
        initializers={"roi": np.array([0, 0, 0.4, 0.6, 1, 1, 1.2, 1.7], np.float32), "sizes": i64(1, 1, 3, 3)},
        opset=13,
    )


@pytest.mark.parametrize("mode", ["linear", "cubic"])
def test_resize_antialias(check_onnx, mode):
    check_onnx(
        node("Resize", ["x", "", "scales"], mode=mode, antialias=1),
        {"x": randn(1, 2, 9, 8)},
        initializers={"scales": np.array([1, 1, 0.45, 0.6], np.float32)},
        opset=18,
    )


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_upsample(check_onnx, mode):
    check_onnx(
        node("Upsample", ["x", "s"], mode=mode),
        {"x": randn(1, 2, 3, 3)},
        initializers={"s": np.array([1, 1, 2, 3], np.float32)},
        opset=9,
    )


def test_upsample_opset7_attr(check_onnx):
    check_onnx(node("Upsample", ["x"], mode="nearest", scales=[1.0, 1.0, 2.0, 2.0]), {"x": randn(1, 2, 3, 3)}, opset=7)


# ---- DepthToSpace / SpaceToDepth -----------------------------------------------------


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space(check_onnx, mode):
    check_onnx(node("DepthToSpace", ["x"], blocksize=2, mode=mode), {"x": randn(2, 8, 3, 4)}, opset=13)


def test_space_to_depth(check_onnx):
    check_onnx(node("SpaceToDepth", ["x"], blocksize=3), {"x": randn(1, 2, 6, 9)}, opset=13)


def test_space_to_depth_crd():
    """Mode CRD (opset 25; onnxruntime lacks it): the inverse of DepthToSpace CRD."""
    from tpubuild.kernels import get_kernel

    x = randn(2, 3, 4, 6)
    fold = get_kernel(top.Depth2SpaceOp)(top.Depth2SpaceParams(2, 2, is_CRD=True, is_inversed=True), x)
    assert fold.shape == (2, 12, 2, 3)
    back = get_kernel(top.Depth2SpaceOp)(top.Depth2SpaceParams(2, 2, is_CRD=True), fold)
    np.testing.assert_array_equal(back, x)
    # CRD keeps each input channel's block together: output channels c*4 .. c*4+3 come from channel c
    np.testing.assert_array_equal(
        fold[:, 4:8],
        get_kernel(top.Depth2SpaceOp)(top.Depth2SpaceParams(2, 2, is_CRD=True, is_inversed=True), x[:, 1:2]),
    )


# ---- Einsum ------------------------------------------------------------------------

EINSUM_CASES = {
    "bhid,bhjd->bhij": ((2, 3, 4, 5), (2, 3, 6, 5)),
    "bhij,bhjd->bhid": ((2, 3, 4, 6), (2, 3, 6, 5)),
    "bid,jd->bij": ((2, 4, 5), (6, 5)),
    "bij,bjk->bik": ((3, 2, 4), (3, 4, 5)),
    "ij,jk": ((3, 4), (4, 5)),  # implicit output
    "bnqd,bnkd->bnqk": ((1, 2, 3, 4), (1, 2, 5, 4)),
    "ibnd,jbnd->bnij": ((3, 2, 4, 5), (6, 2, 4, 5)),
    "i,j->ij": ((3,), (4,)),
    "ij,ij->i": ((3, 4), (3, 4)),
    "abc,cd->abd": ((2, 3, 4), (4, 5)),
    "bhwc,hkc->bhwk": ((2, 3, 4, 5), (3, 6, 5)),
}


@pytest.mark.parametrize("equation", EINSUM_CASES)
def test_einsum_lowered(check_onnx, convert, make_model, equation):
    a, b = EINSUM_CASES[equation]
    inputs = {"a": randn(*a), "b": randn(*b)}
    check_onnx(node("Einsum", ["a", "b"], equation=equation), inputs, opset=13)
    module, _ = convert(make_model(node("Einsum", ["a", "b"], equation=equation), inputs, opset=13), {"a": a, "b": b})
    assert "top.Einsum" not in op_names(module) and "top.MatMul" in op_names(module)


def test_einsum_const_operand(check_onnx, convert, make_model):
    """A projection by a constant: the weight is transposed at compile time and one MatMul remains."""
    inputs, inits = {"a": randn(2, 3, 4)}, {"w": randn(5, 4)}
    check_onnx(node("Einsum", ["a", "w"], equation="bid,jd->bij"), inputs, initializers=inits, opset=13)
    module, _ = convert(
        make_model(node("Einsum", ["a", "w"], equation="bid,jd->bij"), inputs, initializers=inits, opset=13),
        {"a": [2, 3, 4]},
    )
    assert [n for n in op_names(module) if n not in ("top.Input", "top.Weight", "top.None")] == ["top.MatMul"]


@pytest.mark.parametrize(
    "equation,shapes",
    [
        ("ij->ji", [(3, 4)]),
        ("ii->i", [(4, 4)]),
        ("ij->i", [(3, 4)]),
        ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)]),
        ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)]),
    ],
)
def test_einsum_general(check_onnx, equation, shapes):
    names = [f"x{i}" for i in range(len(shapes))]
    check_onnx(
        node("Einsum", names, equation=equation), {n: randn(*s) for n, s in zip(names, shapes, strict=True)}, opset=13
    )


# ---- TopK -------------------------------------------------------------------------


@pytest.mark.parametrize("largest", [1, 0])
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_topk(check_onnx, axis, largest):
    x = randn(4, 5, 6)
    check_onnx(
        node("TopK", ["x", "k"], ["values", "indices"], axis=axis, largest=largest),
        {"x": x},
        initializers={"k": i64(3)},
        opset=11,
    )


def test_topk_ties_keep_index_order(check_onnx):
    x = np.array([[1, 3, 3, 2, 3, 1], [0, 0, 0, 0, 0, 0]], np.float32)
    check_onnx(node("TopK", ["x", "k"], ["values", "indices"]), {"x": x}, initializers={"k": i64(4)}, opset=11)
    check_onnx(
        node("TopK", ["x", "k"], ["values", "indices"], largest=0), {"x": x}, initializers={"k": i64(4)}, opset=11
    )


def test_topk_opset1_attr(check_onnx):
    check_onnx(node("TopK", ["x"], ["values", "indices"], k=2), {"x": randn(3, 5)}, opset=9)


def test_topk_int64(check_onnx):
    x = R.integers(-50, 50, (3, 7)).astype(np.int64)
    check_onnx(node("TopK", ["x", "k"], ["values", "indices"]), {"x": x}, initializers={"k": i64(3)}, opset=11)


# ---- LSTM / GRU ----------------------------------------------------------------------


def _rnn_inputs(gates, seq, batch, inp, hidden, dirs, bias, initial, cell=False, peep=False):
    inits = {"W": randn(dirs, gates * hidden, inp) * 0.5, "R": randn(dirs, gates * hidden, hidden) * 0.5}
    names = ["X", "W", "R"]
    names.append("B" if bias else "")
    if bias:
        inits["B"] = randn(dirs, 2 * gates * hidden) * 0.3
    names.append("")  # sequence_lens
    if initial:
        inits["h0"] = randn(dirs, batch, hidden)
        names.append("h0")
        if cell:
            inits["c0"] = randn(dirs, batch, hidden)
            names.append("c0")
    if peep:
        if not initial:
            names.extend(["", ""])
        inits["P"] = randn(dirs, 3 * hidden) * 0.3
        names.append("P")
    return names, inits


RNN_VARIANTS = {
    "forward": dict(direction="forward", bias=False, initial=False),
    "reverse_bias": dict(direction="reverse", bias=True, initial=False),
    "bidirectional_initial": dict(direction="bidirectional", bias=True, initial=True),
}


@pytest.mark.parametrize("variant", RNN_VARIANTS)
def test_lstm(check_onnx, variant):
    v = RNN_VARIANTS[variant]
    dirs = 2 if v["direction"] == "bidirectional" else 1
    names, inits = _rnn_inputs(4, 5, 2, 3, 4, dirs, v["bias"], v["initial"], cell=True)
    check_onnx(
        node("LSTM", names, ["Y", "Y_h", "Y_c"], hidden_size=4, direction=v["direction"]),
        {"X": randn(5, 2, 3)},
        initializers=inits,
        opset=14,
    )


def test_lstm_peepholes_clip(check_onnx):
    names, inits = _rnn_inputs(4, 4, 3, 2, 5, 1, True, True, cell=True, peep=True)
    check_onnx(
        node("LSTM", names, ["Y", "Y_h", "Y_c"], hidden_size=5, clip=0.8),
        {"X": randn(4, 3, 2)},
        initializers=inits,
        opset=14,
    )


def test_lstm_only_last_state(check_onnx):
    names, inits = _rnn_inputs(4, 3, 2, 3, 4, 1, True, False)
    check_onnx(
        node("LSTM", names, ["", "Y_h"], hidden_size=4),
        {"X": randn(3, 2, 3)},
        outputs=["Y_h"],
        initializers=inits,
        opset=14,
    )


@pytest.mark.parametrize("op,outs", [("LSTM", ["Y", "Y_h", "Y_c"]), ("GRU", ["Y", "Y_h"])])
def test_rnn_batch_first(convert, make_model, op, outs):
    """layout=1 (onnxruntime refuses it): equal to layout 0 on the transposed input, outputs transposed back."""
    from tpubuild.top.inference import run

    gates = 4 if op == "LSTM" else 3
    names, inits = _rnn_inputs(gates, 3, 2, 3, 4, 2, True, True, cell=op == "LSTM")
    x = randn(3, 2, 3)  # [seq, batch, input]
    batch_first = {k: np.swapaxes(v, 0, 1) if k in ("h0", "c0") else v for k, v in inits.items()}
    seq_model = make_model(
        node(op, names, outs, hidden_size=4, direction="bidirectional"), {"X": x}, initializers=inits, opset=14
    )
    from onnxruntime import InferenceSession

    expect = InferenceSession(seq_model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"X": x})
    bf_model = make_model(
        node(op, names, outs, hidden_size=4, direction="bidirectional", layout=1),
        {"X": np.swapaxes(x, 0, 1)},
        initializers=batch_first,
        opset=14,
    )
    module, weights = convert(bf_model, {"X": [2, 3, 3]})
    got = run(module, weights, {"X": np.swapaxes(x, 0, 1)})
    np.testing.assert_allclose(got["Y"], np.transpose(expect[0], (2, 0, 1, 3)), rtol=1e-4, atol=1e-5)
    for name, ref in zip(outs[1:], expect[1:], strict=True):
        np.testing.assert_allclose(got[name], np.swapaxes(ref, 0, 1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("linear_before_reset", [0, 1])
@pytest.mark.parametrize("variant", RNN_VARIANTS)
def test_gru(check_onnx, variant, linear_before_reset):
    v = RNN_VARIANTS[variant]
    dirs = 2 if v["direction"] == "bidirectional" else 1
    names, inits = _rnn_inputs(3, 5, 2, 3, 4, dirs, v["bias"], v["initial"])
    check_onnx(
        node(
            "GRU", names, ["Y", "Y_h"], hidden_size=4, direction=v["direction"], linear_before_reset=linear_before_reset
        ),
        {"X": randn(5, 2, 3)},
        initializers=inits,
        opset=14,
    )


@pytest.mark.parametrize("variant", RNN_VARIANTS)
def test_rnn(check_onnx, variant):
    v = RNN_VARIANTS[variant]
    dirs = 2 if v["direction"] == "bidirectional" else 1
    names, inits = _rnn_inputs(1, 5, 2, 3, 4, dirs, v["bias"], v["initial"])
    check_onnx(
        node("RNN", names, ["Y", "Y_h"], hidden_size=4, direction=v["direction"]),
        {"X": randn(5, 2, 3)},
        initializers=inits,
        opset=14,
    )


def test_rnn_relu_activation(check_onnx):
    names, inits = _rnn_inputs(1, 4, 2, 3, 3, 2, True, False)
    check_onnx(
        node("RNN", names, ["Y", "Y_h"], hidden_size=3, direction="bidirectional", activations=["Relu", "Tanh"]),
        {"X": randn(4, 2, 3)},
        initializers=inits,
        opset=14,
    )


def test_gru_runtime_weights(check_onnx):
    check_onnx(
        node("GRU", ["X", "W", "R"], ["Y", "Y_h"], hidden_size=3),
        {"X": randn(4, 1, 2), "W": randn(1, 9, 2), "R": randn(1, 9, 3)},
        opset=14,
    )


# ---- MatMul batch broadcast (top.MatMul) -------------------------------------------------


@pytest.mark.parametrize(
    "a_shape,b_shape", [((2, 1, 3, 4), (1, 5, 4, 2)), ((3, 4), (2, 2, 4, 5)), ((7, 2, 3, 4), (4, 6))]
)
def test_matmul_batch_broadcast(check_onnx, a_shape, b_shape):
    check_onnx(node("MatMul", ["a", "b"]), {"a": randn(*a_shape), "b": randn(*b_shape)})


# ---- older opsets brought forward ------------------------------------------------------


def _opset6_add(y_shape, axis):
    from onnx import TensorProto

    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "y"], ["z"], broadcast=1, axis=axis)],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4]),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, list(y_shape)),
        ],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 3, 4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 6)], ir_version=3)


def test_opset6_broadcast_add_upgraded(convert):
    """Opset 6 Add broadcasts by `broadcast`/`axis`; onnx's version converter rewrites it to opset 7."""
    from tpubuild.top.inference import run

    x, y = randn(2, 3, 4), randn(3, 4)
    module, weights = convert(_opset6_add(y.shape, 1), {"x": [2, 3, 4], "y": [3, 4]})
    np.testing.assert_allclose(run(module, weights, {"x": x, "y": y})["z"], x + y[None], rtol=1e-6)


def test_opset6_upgrade_impossible_is_refused(convert):
    """A mid-axis broadcast has no opset-7 form the version converter can write: a clear refusal."""
    from tpubuild.errors import TpuBuildError

    with pytest.raises(TpuBuildError, match=r"unsupported ONNX ops at opset 6: Add \(nodes: 'z'\)"):
        convert(_opset6_add((3,), 1), {"x": [2, 3, 4], "y": [3]})


# ---- shared converters fixed along the way -----------------------------------------------


@pytest.mark.parametrize("axis", [-1, 1])
def test_layer_norm_mean_inv_std_dev(check_onnx, axis):
    """LayerNormalization's optional Mean/InvStdDev outputs: top.LayerNorm with its stats results."""
    check_onnx(
        node("LayerNormalization", ["x", "s", "b"], ["y", "mean", "inv_std"], axis=axis, epsilon=1e-3),
        {"x": randn(2, 3, 5)},
        initializers={
            "s": randn(*(3, 5)[axis:] if axis == 1 else (5,)),
            "b": randn(*(3, 5)[axis:] if axis == 1 else (5,)),
        },
        opset=17,
    )


def test_prelu_opset6_per_channel(convert):
    """Before opset 7 a [C] slope applies along dim 1, not numpy-broadcast on the last dim."""
    from onnx import TensorProto, numpy_helper

    from tpubuild.top.inference import run

    slope = np.array([0.1, -0.5, 2.0], np.float32)
    graph = helper.make_graph(
        [helper.make_node("PRelu", ["x", "s"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 4])],
        initializer=[numpy_helper.from_array(slope, "s")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 6)], ir_version=3)
    x = randn(2, 3, 4)
    module, weights = convert(model, {"x": [2, 3, 4]})
    expect = np.where(x >= 0, x, x * slope[None, :, None])
    np.testing.assert_allclose(run(module, weights, {"x": x})["y"], expect, rtol=1e-6)


def test_unused_results_get_unique_names(convert, make_model):
    """Unused (empty) ONNX outputs of two unnamed nodes still give every TOP result its own name."""
    nodes = [
        helper.make_node("TopK", ["x", "k"], ["", "i1"], axis=1),
        helper.make_node("TopK", ["x", "k"], ["", "i2"], axis=0),
    ]
    model = make_model(nodes, {"x": randn(3, 4)}, ["i1", "i2"], initializers={"k": i64(2)}, opset=11)
    module, _ = convert(model, {"x": [3, 4]})
    names = [n for op in mlir.body_ops(module) if isinstance(op, top.TopKOp) for n in op.names]
    assert len(names) == len(set(names)) == 4 and {"i1", "i2"} <= set(names)


MAXPOOL_INDICES_CASES = {
    "basic": ((2, 3, 6, 6), dict(kernel_shape=[2, 2], strides=[2, 2])),
    "pads_overlap": ((1, 2, 5, 7), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    "column_major": ((2, 2, 5, 4), dict(kernel_shape=[2, 3], strides=[1, 1], pads=[0, 1, 1, 0], storage_order=1)),
    "ceil_dilated": ((1, 2, 8, 8), dict(kernel_shape=[2, 2], dilations=[2, 2], strides=[2, 2], ceil_mode=1)),
    "pool1d": ((2, 3, 9), dict(kernel_shape=[3], strides=[2], pads=[1, 1])),
}


@pytest.mark.parametrize("case", MAXPOOL_INDICES_CASES)
def test_maxpool_indices(check_onnx, case):
    """MaxPool's Indices output: top.MaxPoolWithMask (flat int64 positions, batch and channel included)."""
    shape, attrs = MAXPOOL_INDICES_CASES[case]
    check_onnx(node("MaxPool", ["x"], ["y", "i"], **attrs), {"x": randn(*shape)}, opset=12)


def test_maxpool_storage_order_without_indices(check_onnx):
    """storage_order orders only the Indices; without them it changes nothing."""
    check_onnx(node("MaxPool", ["x"], kernel_shape=[2, 2], storage_order=1), {"x": randn(1, 2, 4, 4)}, opset=12)
