"""The alternate layouts a group may run in: the lane-spread graph of layout-free ops, and folds (a
small-IC integer conv's kernel rows folded into its input's channels, ``Fold``, ``fold_graph``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tpubuild.build.chips import Chip
from tpubuild.codegen.graph import Graph
from tpubuild.codegen.slicing import spread_shape
from tpubuild.ir import tpu


def spread_graph(graph: Graph, ops: Sequence[int], lanes: int) -> Graph:
    """``graph`` with the activations of ``ops`` (layout-free ops) in their lane-spread shapes
    (``slicing.spread_shape``: a function of the shape, so an op's operands and result agree)."""
    tensors = dict(graph.tensors)
    for p in ops:
        node = graph.ops[p]
        for t in [*graph.data_inputs(node), *(o for o in node.outputs if o in tensors)]:
            tensors[t] = dataclasses.replace(graph.tensors[t], shape=spread_shape(graph.tensors[t].shape, lanes))
    return Graph(graph.ops, tensors, graph.inputs, graph.outputs)


@dataclass(frozen=True)
class Fold:
    """A conv whose kh kernel rows are folded into its input's channels (TPU-MLIR's "3ic" for small-IC
    convs): input X (n, ic, H, W) becomes X' (n, kh * ic, OH, W) with X'[:, dy * ic + c, r] =
    X[:, c, r * sh + dy * dh - pt] (the zero point where that row is padding), the filter W'[o, dy * ic
    + c, 0, dx] = W[o, c, dy, dx], and the conv a 1 x kw conv with stride (1, sw), pads (0, pl, 0, pr):
    the cube reduces kh * ic channels per EU chunk instead of ic, kh times fewer chunks.

    When X is the quantizing Cast of a float tensor (a model's input), the fold starts at the Cast: its
    float input is loaded folded, padding rows as 0.0, which the Cast turns into the zero point."""

    start: int  # the first op of a fold group: the conv, or the Cast before it
    conv: int  # op index
    input: str  # the group input loaded folded
    through: str | None  # the Cast's result (X), folded too; None: ``input`` is X
    weight: str
    n: int
    ic: int
    h: int
    w: int
    kh: int
    sh: int
    dh: int
    pt: int
    zp: float  # what a padding row of ``input`` holds: X's zero point, or 0.0 before a Cast

    def pieces(self, lo: int, hi: int) -> list[tuple[int, int, int, int | None]]:
        """How rows [lo, hi) of X' are made: (dy, first row, rows, first source row of X or None: fill
        with the zero point), per kernel row dy the padding rows before, the run of X's rows, those after."""
        out = []
        for dy in range(self.kh):
            shift = dy * self.dh - self.pt  # X' row r reads X row r * sh + shift
            first = max(lo, -(shift // self.sh))  # ceil(-shift / sh): the first row inside X
            end = min(hi, (self.h - 1 - shift) // self.sh + 1)
            if first >= end:
                out.append((dy, lo, hi - lo, None))
                continue
            if first > lo:
                out.append((dy, lo, first - lo, None))
            out.append((dy, first, end - first, first * self.sh + shift))
            if end < hi:
                out.append((dy, end, hi - end, None))
        return out

    def weight_data(self, w: np.ndarray) -> np.ndarray:
        """W (oc, ic, kh, kw) as W' (oc, kh * ic, 1, kw)."""
        oc, ic, kh, kw = w.shape
        return np.ascontiguousarray(np.asarray(w).transpose(0, 2, 1, 3)).reshape(oc, kh * ic, 1, kw)


def find_folds(graph: Graph, chip: Chip) -> list[Fold]:
    """The convs worth folding: 2-D, one group, kh * ic within the lanes and fewer EU chunks of input
    channels that way; the input and the filter read by this conv alone (their layout changes with the
    fold). The chip stays bit-exact: integer sums are exact in any order, and a float conv's GEMM sums
    over (kernel row, channel, kernel column) folded or not (``kernels.nn.gemm_order``) as long as every
    kernel row meets the input somewhere (else the kernel drops it and the unfolded sum is shorter)."""
    folds = []
    for node in graph.ops:
        if not isinstance(node.op, tpu.ConvOp) or node.inputs[0] is None or node.inputs[1] is None:
            continue
        p = node.op.params
        x, w = graph.tensors[node.inputs[0]], graph.tensors[node.inputs[1]]
        if (
            len(p.kernel_shape) != 2
            or p.group != 1
            or x.weight
            or not w.weight
            or len(x.shape) != 4
            or len(x.users) != 1
            or len(w.users) != 1
            or x.graph_output
        ):
            continue
        n, ic, h, width = x.shape
        kh = p.kernel_shape[0]
        out_h = graph.tensors[node.name].shape[2]
        if x.dtype.kind not in "iu" and out_h < -(-max(p.pads[0], p.pads[2]) // p.strides[0]) + 1:
            continue
        eu = max(chip.eu_bytes // x.dtype.itemsize, 1)
        if kh < 2 or ic * kh > chip.lanes or -(-ic * kh // eu) >= kh * -(-ic // eu):
            continue
        start, source, through, fill = node.index, node.inputs[0], None, p.in_zp[0] if getattr(p, "in_zp", ()) else 0
        cast = graph.ops[x.producer] if x.producer is not None else None
        if cast is not None and isinstance(cast.op, tpu.CastOp) and cast.inputs[0] is not None:
            before = graph.tensors[cast.inputs[0]]
            zero = cast.op.params.zero_point
            # quantize(0.0) = round(0 * 1/scale) + zero point: the padding value, whatever the scale
            if (
                before.dtype.kind == "f"
                and not before.weight
                and len(before.users) == 1
                and before.shape == x.shape
                and not before.graph_output
                and zero == fill
            ):
                start, source, through, fill = cast.index, cast.inputs[0], node.inputs[0], 0.0
        folds.append(
            Fold(
                start,
                node.index,
                source,
                through,
                node.inputs[1],
                n,
                ic,
                h,
                width,
                kh,
                p.strides[0],
                (p.dilations or (1, 1))[0],
                p.pads[0],
                fill,
            )
        )
    return folds


def fold_graph(graph: Graph, folds: Sequence[Fold]) -> Graph:
    """``graph`` with each fold's conv, input and filter as the folded conv sees them."""
    tensors = dict(graph.tensors)
    ops = list(graph.ops)
    for f in folds:
        node = graph.ops[f.conv]
        p = node.op.params
        out_h = graph.tensors[node.name].shape[2]
        oc, _, _, kw = graph.tensors[f.weight].shape
        for t in (f.input, f.through):
            if t is not None:
                tensors[t] = dataclasses.replace(graph.tensors[t], shape=(f.n, f.kh * f.ic, out_h, f.w))
        tensors[f.weight] = dataclasses.replace(graph.tensors[f.weight], shape=(oc, f.kh * f.ic, 1, kw))
        nd = 2
        folded = dataclasses.replace(
            p,
            kernel_shape=(1, kw),
            strides=(1, p.strides[1]),
            pads=(0, p.pads[1], 0, p.pads[1 + nd]),
            dilations=(1, (p.dilations or (1, 1))[1]),
        )
        op = tpu.ConvOp.make(
            list(node.op.operands), folded, name=node.name, result_types=[r.type for r in node.op.results]
        )
        op.drop_all_references()  # a description for the planner, never part of the module
        ops[f.conv] = dataclasses.replace(node, op=op)
    return Graph(ops, tensors, graph.inputs, graph.outputs)
