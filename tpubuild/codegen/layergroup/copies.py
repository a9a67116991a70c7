"""Copy rules: layout ops (Permute; Slice and Gather of a constant index) as one strided DDR-to-DDR copy."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from tpubuild.codegen.commands import Shape4, shape4
from tpubuild.codegen.graph import Graph
from tpubuild.ir import top, tpu

Block = tuple[int, ...]
CopyDims = tuple[list[tuple[int, int]], int]  # (size, source stride) per output dim, source offset
_COPIES: dict[type, Callable[[Graph, object, Mapping[str, int]], CopyDims | None]] = {}


def copy_for(*classes: type):
    def register(fn):
        for cls in classes:
            _COPIES[cls] = fn
        return fn

    return register


def _row_major(shape: Sequence[int]) -> list[int]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return strides


@copy_for(tpu.PermuteOp)
def _permute_copy(graph: Graph, node, scalars) -> CopyDims:
    shape = graph.tensors[node.inputs[0]].shape
    src = _row_major(shape)
    return [(shape[a], src[a]) for a in node.op.params.order], 0


@copy_for(tpu.MIRROR[top.SliceOp])
def _slice_copy(graph: Graph, node, scalars) -> CopyDims | None:
    """Slice with positive steps: every output dim a strided run of the source."""
    p = node.op.params
    data = [t for t in node.inputs if t is not None]
    if len(data) != 1 or any(step <= 0 for step in p.steps):
        return None
    src = _row_major(graph.tensors[data[0]].shape)
    out = graph.tensors[node.name].shape
    return (
        [(out[i], src[i] * p.steps[i]) for i in range(len(out))],
        sum(o * st for o, st in zip(p.offset, src, strict=True)),
    )


@copy_for(tpu.MIRROR[top.GatherOp])
def _gather_copy(graph: Graph, node, scalars) -> CopyDims | None:
    """Gather of one constant index: the source without that dim, at the index's offset along it."""
    if len(node.inputs) != 2 or node.inputs[1] is None:
        return None
    index = graph.tensors[node.inputs[1]]
    if not index.weight or index.shape != ():
        return None
    shape = graph.tensors[node.inputs[0]].shape
    axis = node.op.params.axis % len(shape)
    src = _row_major(shape)
    at = scalars.get(node.inputs[1], 0) % shape[axis]
    return [(shape[i], src[i]) for i in range(len(shape)) if i != axis], at * src[axis]


def as_copy(graph: Graph, node, scalars: Mapping[str, int] | None = None) -> tuple[Shape4, Shape4, int] | None:
    """A layout op (Permute; and Slice, Gather of a constant index, which otherwise run as global
    ops) as one strided DDR-to-DDR copy: (block, source strides in elements, source offset in
    elements) over at most 4 dims, merging output dims that stay adjacent in the source; None if it
    needs more dims. ``scalars``: the values of scalar index weights (planning needs none)."""
    fn = _COPIES.get(type(node.op))
    found = fn(graph, node, scalars or {}) if fn else None
    if found is None:
        return None
    dims, offset = found
    merged: list[list[int]] = []
    for size, stride in dims:
        if size == 1:
            continue
        if merged and merged[-1][1] == stride * size:
            merged[-1] = [merged[-1][0] * size, stride]
        else:
            merged.append([size, stride])
    if len(merged) > 4:
        return None
    merged = [[1, 0]] * (4 - len(merged)) + merged
    return shape4([m[0] for m in merged]), shape4([m[1] for m in merged]), offset
