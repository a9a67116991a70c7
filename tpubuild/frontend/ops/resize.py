"""Resize (opsets 10-19) and Upsample -> top.Interp with the output shape and scales resolved; GridSample ->
top.GridSample, and AffineGrid (the grid of a spatial transformer) as a MatMul."""

from __future__ import annotations

import math

import numpy as np

from tpubuild.frontend.onnx_graph import Const, Ctx, Node, shape_of
from tpubuild.frontend.ops.common import norm_axis
from tpubuild.frontend.registry import converter
from tpubuild.ir import top

_MODES = {"nearest": "nearest", "linear": "linear", "bilinear": "linear", "cubic": "cubic", "bicubic": "cubic"}


def _mode(node: Node) -> str:
    mode = node.attrs.get("mode", "nearest")
    if mode not in _MODES:
        raise NotImplementedError(f"{node.op_type} mode {mode!r} is not supported")
    return _MODES[mode]


def _given(array) -> list[float] | None:
    """A scales/sizes/roi input, None when absent or empty (opset 11 passes empty tensors)."""
    if array is None or np.asarray(array).size == 0:
        return None
    return [float(v) for v in np.asarray(array).reshape(-1)]


def _legacy(node: Node, ctx: Ctx, scales):
    """Upsample and Resize-10: output = floor(input * scale), asymmetric coordinates, nearest rounds down."""
    x = node.input(0)
    shape = shape_of(x)
    scales = [float(s) for s in scales]
    if len(scales) != len(shape):
        raise ValueError(f"{len(scales)} scales for rank {len(shape)}")
    out = [int(math.floor(d * s)) for d, s in zip(shape, scales, strict=True)]
    p = top.InterpParams(tuple(out), tuple(scales), _mode(node), "asymmetric", "floor")
    return [ctx.emit(top.InterpOp, [x], p, name=node.outputs[0])]


@converter("Upsample", since=7)
def _(node: Node, ctx: Ctx):
    return _legacy(node, ctx, node.attrs["scales"])


@converter("Upsample", since=9)
def _(node: Node, ctx: Ctx):
    return _legacy(node, ctx, _given(ctx.const(node, 1, "scales")))


@converter("Resize", since=10)
def _(node: Node, ctx: Ctx):
    return _legacy(node, ctx, _given(ctx.const(node, 1, "scales")))


def _round_half_up(v: float) -> int:
    return int(v + 0.5)


@converter("Resize", since=11)
def _(node: Node, ctx: Ctx):
    """Scales or sizes over ``axes`` (opset 18; all dims before), expanded to every dim."""
    x = node.input(0)
    shape = shape_of(x)
    rank = len(shape)
    a = node.attrs
    axes = [norm_axis(int(v), rank) for v in a["axes"]] if a.get("axes") else list(range(rank))
    roi_in, scales_in, sizes_in = (
        _given(ctx.const(node, i, what)) for i, what in ((1, "roi"), (2, "scales"), (3, "sizes"))
    )
    scales, out = [1.0] * rank, list(shape)
    if sizes_in is not None:
        if len(sizes_in) != len(axes):
            raise ValueError(f"{len(sizes_in)} sizes for axes {axes}")
        ratios = {ax: size / shape[ax] for ax, size in zip(axes, sizes_in, strict=True)}
        policy = a.get("keep_aspect_ratio_policy", "stretch")
        if policy in ("not_larger", "not_smaller"):
            one = (min if policy == "not_larger" else max)(ratios.values())
            ratios = {ax: one for ax in axes}
            sizes_in = [_round_half_up(one * shape[ax]) for ax in axes]
        elif policy != "stretch":
            raise ValueError(f"unknown keep_aspect_ratio_policy {policy!r}")
        for ax, size in zip(axes, sizes_in, strict=True):
            scales[ax], out[ax] = ratios[ax], int(size)
    elif scales_in is not None:
        if len(scales_in) != len(axes):
            raise ValueError(f"{len(scales_in)} scales for axes {axes}")
        for ax, s in zip(axes, scales_in, strict=True):
            scales[ax], out[ax] = s, int(math.floor(s * shape[ax]))
    else:
        raise ValueError("Resize needs scales or sizes")
    mode = _mode(node)
    coord = a.get("coordinate_transformation_mode", "half_pixel")
    roi: tuple[float, ...] = ()
    if coord == "tf_crop_and_resize":
        if roi_in is None or len(roi_in) != 2 * len(axes):
            raise ValueError(f"tf_crop_and_resize needs an roi of {2 * len(axes)} values")
        full = [0.0] * rank + [1.0] * rank
        for i, ax in enumerate(axes):
            full[ax], full[rank + ax] = roi_in[i], roi_in[len(axes) + i]
        roi = tuple(full)
    p = top.InterpParams(
        tuple(out),
        tuple(scales),
        mode,
        coord,
        a.get("nearest_mode", "round_prefer_floor"),
        cubic_coeff_a=float(a.get("cubic_coeff_a", -0.75)),
        exclude_outside=bool(a.get("exclude_outside", 0)),
        antialias=bool(a.get("antialias", 0)) and mode != "nearest",
        roi=roi,
        extrapolation_value=float(a.get("extrapolation_value", 0.0)),
    )
    return [ctx.emit(top.InterpOp, [x], p, name=node.outputs[0])]


@converter("GridSample", since=16)
def _(node: Node, ctx: Ctx):
    """Opset 16's 2-D form (mode bilinear, bicubic or nearest); opset 20 renamed the modes and allowed N-D."""
    x, grid = node.input(0), node.input(1)
    mode = node.attrs["mode"]  # (the schema's default: bilinear, or linear from opset 20)
    if mode not in _MODES:
        raise NotImplementedError(f"GridSample mode {mode!r} is not supported")
    p = top.GridSampleParams(_MODES[mode], node.attrs["padding_mode"], bool(node.attrs["align_corners"]))
    return [ctx.emit(top.GridSampleOp, [x, grid], p, name=node.outputs[0])]


@converter("AffineGrid", since=20)
def _(node: Node, ctx: Ctx):
    """The sampling grid of affine transforms theta [N, k, k + 1] over an output of ``size`` (known at compile
    time): each output point's normalised coordinates (x first, then 1) times theta, as one MatMul."""
    theta, out = node.input(0), node.outputs[0]
    size = [int(d) for d in np.asarray(ctx.const(node, 1, "size")).reshape(-1)]
    n, spatial = size[0], size[2:]
    k = len(spatial)
    if shape_of(theta) != (n, k, k + 1):
        raise ValueError(f"theta {list(shape_of(theta))} does not fit size {size}: expected [{n}, {k}, {k + 1}]")
    align = bool(node.attrs.get("align_corners", 0))

    def steps(length: int) -> np.ndarray:
        if align:
            return np.linspace(-1.0, 1.0, length) if length > 1 else np.zeros(1)
        return (2 * np.arange(length) + 1) / length - 1

    axes = np.meshgrid(*[steps(d) for d in spatial], indexing="ij")  # D, H, W order
    base = np.stack([*axes[::-1], np.ones_like(axes[0])], axis=-1).reshape(1, -1, k + 1)  # x, y(, z), 1
    theta_t = ctx.emit(top.PermuteOp, [theta], top.PermuteParams((0, 2, 1)), name=f"{out}_theta_T")
    points = Const(base.astype(np.float32), f"{out}_base")
    flat = ctx.emit(top.MatMulOp, [points, theta_t, None], name=f"{out}_flat")
    return [ctx.emit(top.ReshapeOp, [flat], top.ShapeParams((n, *spatial, k)), name=out)]
