"""Shape and layout: Reshape, Flatten, Squeeze, Unsqueeze, Transpose, Concat."""

from __future__ import annotations

import math

import numpy as np

from tpubuild.frontend.onnx_graph import Ctx, Node, shape_of
from tpubuild.frontend.ops.common import norm_axis
from tpubuild.frontend.registry import converter
from tpubuild.ir import top


def _reshape(node: Node, ctx: Ctx, shape) -> list:
    return [
        ctx.emit(top.ReshapeOp, [node.input(0)], top.ShapeParams(tuple(int(d) for d in shape)), name=node.outputs[0])
    ]


def resolve_reshape(in_shape, target, allowzero: bool = False) -> list[int]:
    """ONNX Reshape's target with 0 (copy the input dim) and -1 (infer) resolved."""
    out = [int(d) for d in target]
    if not allowzero:
        out = [in_shape[i] if d == 0 else d for i, d in enumerate(out)]
    if out.count(-1) > 1:
        raise ValueError(f"reshape target {[int(d) for d in target]} has more than one -1")
    if -1 in out:
        known = math.prod(d for d in out if d != -1)
        total = math.prod(in_shape)
        if known == 0 or total % known:
            raise ValueError(f"cannot reshape {tuple(in_shape)} to {[int(d) for d in target]}")
        out[out.index(-1)] = total // known
    if math.prod(out) != math.prod(in_shape):
        raise ValueError(f"cannot reshape {tuple(in_shape)} to {[int(d) for d in target]}")
    return out


@converter("Reshape", since=5)
def _(node: Node, ctx: Ctx):
    target = ctx.const(node, 1, "shape")
    return _reshape(node, ctx, resolve_reshape(shape_of(node.input(0)), target, bool(node.attrs.get("allowzero", 0))))


@converter("Flatten", since=1)
def _(node: Node, ctx: Ctx):
    shape = shape_of(node.input(0))
    axis = node.attrs.get("axis", 1)
    axis = axis % len(shape) if axis != len(shape) else axis
    return _reshape(node, ctx, (math.prod(shape[:axis]), math.prod(shape[axis:])))


def _squeeze(node: Node, ctx: Ctx, axes) -> list:
    shape = shape_of(node.input(0))
    if axes is None:
        keep = [d for d in shape if d != 1]
    else:
        drop = {norm_axis(int(a), len(shape)) for a in axes}
        if any(shape[a] != 1 for a in drop):
            raise ValueError(f"cannot squeeze axes {sorted(drop)} of shape {shape}")
        keep = [d for i, d in enumerate(shape) if i not in drop]
    return _reshape(node, ctx, keep)


def _unsqueeze(node: Node, ctx: Ctx, axes) -> list:
    shape = list(shape_of(node.input(0)))
    rank = len(shape) + len(axes)
    for a in sorted(norm_axis(int(a), rank) for a in axes):
        shape.insert(a, 1)
    return _reshape(node, ctx, shape)


@converter("Squeeze", since=1)
def _(node: Node, ctx: Ctx):
    return _squeeze(node, ctx, node.attrs.get("axes"))


@converter("Squeeze", since=13)
def _(node: Node, ctx: Ctx):
    axes = ctx.const(node, 1, "axes")
    return _squeeze(node, ctx, None if axes is None else np.asarray(axes).tolist())


@converter("Unsqueeze", since=1)
def _(node: Node, ctx: Ctx):
    return _unsqueeze(node, ctx, node.attrs["axes"])


@converter("Unsqueeze", since=13)
def _(node: Node, ctx: Ctx):
    return _unsqueeze(node, ctx, np.asarray(ctx.const(node, 1, "axes")).tolist())


@converter("Transpose", since=1)
def _(node: Node, ctx: Ctx):
    rank = len(shape_of(node.input(0)))
    perm = node.attrs.get("perm") or list(reversed(range(rank)))
    return [ctx.emit(top.PermuteOp, [node.input(0)], top.PermuteParams(tuple(perm)), name=node.outputs[0])]


@converter("Concat", since=4)
def _(node: Node, ctx: Ctx):
    rank = len(shape_of(node.input(0)))
    axis = norm_axis(node.attrs["axis"], rank)
    return [ctx.emit(top.ConcatOp, list(node.inputs), top.AxisParams(axis), name=node.outputs[0])]
