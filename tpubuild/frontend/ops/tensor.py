"""Indexing and layout: Expand, Tile, Gather, GatherElements, GatherND, Scatter(Elements/ND), Trilu,
CumSum, Split, Slice, Pad, DepthToSpace, SpaceToDepth, TopK, OneHot.

Shape-like operands (shape, repeats, split, starts/ends, pads, K) must be known at
compile time; they become op parameters.
"""

from __future__ import annotations

import math

import numpy as np

from tpubuild.frontend.onnx_graph import Const, Ctx, Node, dtype_of_value, shape_of
from tpubuild.frontend.ops.common import norm_axis, result_names
from tpubuild.frontend.registry import converter
from tpubuild.ir import top


def _ints(array) -> list[int]:
    return [int(v) for v in np.asarray(array).reshape(-1)]


# ---- Expand / Tile ------------------------------------------------------------


@converter("Expand", since=8)
def _(node: Node, ctx: Ctx):
    shape = _ints(ctx.const(node, 1, "shape"))
    return [ctx.emit(top.ExpandOp, [node.input(0)], top.ShapeParams(tuple(shape)), name=node.outputs[0])]


@converter("Tile", since=6)
def _(node: Node, ctx: Ctx):
    repeats = _ints(ctx.const(node, 1, "repeats"))
    return [ctx.emit(top.TileOp, [node.input(0)], top.TileParams(tuple(repeats)), name=node.outputs[0])]


# ---- Gather -------------------------------------------------------------------


@converter("Gather", since=1)
def _(node: Node, ctx: Ctx):
    x = node.input(0)
    axis = norm_axis(node.attrs.get("axis", 0), len(shape_of(x)))
    return [ctx.emit(top.GatherOp, [x, node.input(1)], top.AxisParams(axis), name=node.outputs[0])]


@converter("GatherElements", since=11)
def _(node: Node, ctx: Ctx):
    x = node.input(0)
    axis = norm_axis(node.attrs.get("axis", 0), len(shape_of(x)))
    return [ctx.emit(top.GatherElementsOp, [x, node.input(1)], top.AxisParams(axis), name=node.outputs[0])]


@converter("GatherND", since=11)
def _(node: Node, ctx: Ctx):
    p = top.GatherNDParams(int(node.attrs.get("batch_dims", 0)))
    return [ctx.emit(top.GatherNDOp, [node.input(0), node.input(1)], p, name=node.outputs[0])]


# ---- Scatter ------------------------------------------------------------------


def _scatter(node: Node, ctx: Ctx, cls, axis: int = 0):
    p = top.ScatterParams(axis, node.attrs.get("reduction", "none"))
    return [ctx.emit(cls, [node.input(0), node.input(1), node.input(2)], p, name=node.outputs[0])]


@converter("Scatter", since=9)  # deprecated at opset 11 as ScatterElements
@converter("ScatterElements", since=11)
def _(node: Node, ctx: Ctx):
    axis = norm_axis(node.attrs.get("axis", 0), len(shape_of(node.input(0))))
    return _scatter(node, ctx, top.ScatterElementsOp, axis)


@converter("ScatterND", since=11)
def _(node: Node, ctx: Ctx):
    return _scatter(node, ctx, top.ScatterNDOp)


# ---- Trilu / CumSum -------------------------------------------------------------


@converter("Trilu", since=14)
def _(node: Node, ctx: Ctx):
    k = ctx.const(node, 1, "k")
    p = top.TriluParams(bool(node.attrs.get("upper", 1)), 0 if k is None else _ints(k)[0])
    return [ctx.emit(top.TriluOp, [node.input(0)], p, name=node.outputs[0])]


@converter("CumSum", since=11)
def _(node: Node, ctx: Ctx):
    x = node.input(0)
    axis = norm_axis(_ints(ctx.const(node, 1, "axis"))[0], len(shape_of(x)))
    p = top.CumSumParams(axis, bool(node.attrs.get("exclusive", 0)), bool(node.attrs.get("reverse", 0)))
    return [ctx.emit(top.CumSumOp, [x], p, name=node.outputs[0])]


# ---- Split --------------------------------------------------------------------


def _split(node: Node, ctx: Ctx, sizes: list[int] | None, num_outputs: int | None = None):
    x = node.input(0)
    shape = shape_of(x)
    axis = norm_axis(node.attrs.get("axis", 0), len(shape))
    dim = shape[axis]
    if sizes is None:
        count = num_outputs or len(node.outputs)
        if num_outputs:  # opset 18: equal chunks of ceil(dim / n), the last one smaller
            chunk = math.ceil(dim / count)
            sizes = [min(chunk, dim - i * chunk) for i in range(count)]
        elif dim % count:
            raise ValueError(f"dim {axis} of {shape} does not split evenly into {count} outputs")
        else:
            sizes = [dim // count] * count
    names = result_names(node.outputs, len(sizes))
    return ctx.emit_multi(top.SplitOp, [x], top.SplitParams(axis, tuple(sizes)), names=names)


@converter("Split", since=1)
def _(node: Node, ctx: Ctx):
    given = ctx.const(node, 1, "split")
    sizes = given if given is not None else node.attrs.get("split")
    return _split(node, ctx, _ints(sizes) if sizes is not None and len(sizes) else None)


@converter("Split", since=2)
def _(node: Node, ctx: Ctx):
    sizes = node.attrs.get("split")
    return _split(node, ctx, _ints(sizes) if sizes else None)


@converter("Split", since=13)
def _(node: Node, ctx: Ctx):
    sizes = ctx.const(node, 1, "split")
    return _split(node, ctx, _ints(sizes) if sizes is not None else None, node.attrs.get("num_outputs"))


# ---- Slice --------------------------------------------------------------------


def _slice(node: Node, ctx: Ctx, starts, ends, axes, steps):
    x = node.input(0)
    shape = shape_of(x)
    rank = len(shape)
    axes = list(range(len(starts))) if axes is None else [norm_axis(a, rank) for a in axes]
    steps = [1] * len(starts) if steps is None else steps
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise ValueError(f"starts {starts}, ends {ends}, axes {axes} and steps {steps} differ in length")
    if len(set(axes)) != len(axes):
        raise ValueError(f"axes {axes} repeat")
    offset, stops, strides = [0] * rank, list(shape), [1] * rank
    for a, start, end, step in zip(axes, starts, ends, steps, strict=True):
        if step == 0:
            raise ValueError("slice step 0")
        # python's slice arithmetic is ONNX's clamping rule (including INT64_MAX/MIN ends)
        offset[a], stops[a], strides[a] = slice(start, end, step).indices(shape[a])
    p = top.SliceParams(tuple(offset), tuple(stops), tuple(strides))
    return [ctx.emit(top.SliceOp, [x], p, name=node.outputs[0])]


@converter("Slice", since=1)
def _(node: Node, ctx: Ctx):
    a = node.attrs
    return _slice(node, ctx, a["starts"], a["ends"], a.get("axes"), None)


@converter("Slice", since=10)
def _(node: Node, ctx: Ctx):
    parts = [ctx.const(node, i, what) for i, what in enumerate(("starts", "ends", "axes", "steps"), start=1)]
    starts, ends, axes, steps = (None if v is None else _ints(v) for v in parts)
    return _slice(node, ctx, starts, ends, axes, steps)


# ---- Pad ----------------------------------------------------------------------


def _pad(node: Node, ctx: Ctx, pads, value, axes=None):
    x = node.input(0)
    rank = len(shape_of(x))
    pads = _ints(pads)
    if axes is not None:
        axes = [norm_axis(a, rank) for a in _ints(axes)]
        full = [0] * (2 * rank)
        for i, a in enumerate(axes):
            full[a], full[rank + a] = pads[i], pads[len(axes) + i]
        pads = full
    if len(pads) != 2 * rank:
        raise ValueError(f"{len(pads)} pads for rank {rank}")
    mode = node.attrs.get("mode", "constant")
    p = top.PadParams(tuple(pads), float(value) if value is not None else 0.0, mode)
    return [ctx.emit(top.PadOp, [x], p, name=node.outputs[0])]


@converter("Pad", since=1)
def _(node: Node, ctx: Ctx):
    return _pad(node, ctx, node.attrs["paddings"], node.attrs.get("value", 0.0))


@converter("Pad", since=2)
def _(node: Node, ctx: Ctx):
    return _pad(node, ctx, node.attrs["pads"], node.attrs.get("value", 0.0))


@converter("Pad", since=11)
def _(node: Node, ctx: Ctx):
    value = ctx.const(node, 2, "constant_value")
    value = None if value is None or np.asarray(value).size == 0 else np.asarray(value).reshape(-1)[0]
    return _pad(node, ctx, ctx.const(node, 1, "pads"), value, ctx.const(node, 3, "axes"))


# ---- DepthToSpace / SpaceToDepth ----------------------------------------------


@converter("DepthToSpace", since=1)
def _(node: Node, ctx: Ctx):
    block = node.attrs["blocksize"]
    crd = node.attrs.get("mode", "DCR") == "CRD"
    p = top.Depth2SpaceParams(block, block, is_CRD=crd)
    return [ctx.emit(top.Depth2SpaceOp, [node.input(0)], p, name=node.outputs[0])]


@converter("SpaceToDepth", since=1)
def _(node: Node, ctx: Ctx):
    block = node.attrs["blocksize"]
    p = top.Depth2SpaceParams(block, block, is_CRD=node.attrs.get("mode", "DCR") == "CRD", is_inversed=True)
    return [ctx.emit(top.Depth2SpaceOp, [node.input(0)], p, name=node.outputs[0])]


# ---- TopK ---------------------------------------------------------------------


def _topk(node: Node, ctx: Ctx, k: int):
    x = node.input(0)
    axis = norm_axis(node.attrs.get("axis", -1), len(shape_of(x)))
    p = top.TopKParams(
        axis, int(k), largest=bool(node.attrs.get("largest", 1)), sorted=bool(node.attrs.get("sorted", 1))
    )
    return ctx.emit_multi(top.TopKOp, [x], p, names=result_names(node.outputs, 2))


@converter("TopK", since=1)
def _(node: Node, ctx: Ctx):
    return _topk(node, ctx, node.attrs["k"])


@converter("TopK", since=10)
def _(node: Node, ctx: Ctx):
    return _topk(node, ctx, _ints(ctx.const(node, 1, "K"))[0])


@converter("OneHot", since=9)
def _(node: Node, ctx: Ctx):
    """values[1] where an index (negatives counted from the end, float ones truncated) equals the position on the
    new axis, values[0] elsewhere: compares against the classes, then a Where."""
    indices, out = node.input(0), node.outputs[0]
    depth = int(np.asarray(ctx.const(node, 1, "depth")).reshape(-1)[0])
    off_on = np.asarray(ctx.const(node, 2, "values")).reshape(-1)
    shape = shape_of(indices)
    axis = norm_axis(int(node.attrs.get("axis", -1)), len(shape) + 1)
    if dtype_of_value(indices).kind == "f":
        indices = ctx.emit(top.CastOp, [indices], top.CastParams("int64"), name=f"{out}_int")
    dtype = dtype_of_value(indices)
    column = ctx.emit(top.ReshapeOp, [indices], top.ShapeParams((*shape[:axis], 1, *shape[axis:])), name=f"{out}_col")
    classes = np.arange(depth).reshape((1,) * axis + (depth,) + (1,) * (len(shape) - axis))
    hits = [
        ctx.emit(
            top.CompareOp,
            [column, Const(k.astype(dtype), f"{out}_{what}")],
            top.CompareParams("Equal"),
            name=f"{out}_is_{what}",
        )
        for k, what in ((classes, "class"), (classes - depth, "class_from_end"))
    ]
    hit = ctx.emit(top.CompareOp, hits, top.CompareParams("Or"), name=f"{out}_hit")
    on, off = Const(off_on[1:2].reshape(()), f"{out}_on"), Const(off_on[0:1].reshape(()), f"{out}_off")
    return [ctx.emit(top.WhereOp, [hit, on, off], name=out)]
