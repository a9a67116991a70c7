"""The planner's facts: per-op costs and rules, the tensors' lane layout, a run of ops' structure and
slicing limits, and the alternate planners (lane spread, folds) it owns."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Self

from tpubuild.build.chips import Chip
from tpubuild.codegen import cost
from tpubuild.codegen.cost import nchw
from tpubuild.codegen.graph import Graph
from tpubuild.codegen.layergroup.copies import as_copy
from tpubuild.codegen.layergroup.folds import Fold, find_folds, fold_graph, spread_graph
from tpubuild.codegen.layergroup.groups import (
    ALIAS,
    ALIAS_OPS,
    CHANNEL,
    COPY,
    FOLD,
    GLOBAL,
    LOCAL,
    SPREAD,
    Group,
    OpFacts,
    Range,
    TensorFacts,
)
from tpubuild.codegen.layergroup.packs import Pack, pack_of
from tpubuild.codegen.layergroup.redirects import _CHANNEL_READERS
from tpubuild.codegen.slicing import exact_f32, local_rule, weight_lane_bytes
from tpubuild.ir import tpu


def _layout_free(graph: Graph, node) -> bool:
    rule = local_rule(graph, node)
    return (
        rule is not None
        and rule.layout_free
        and not any(isinstance(graph.ops[u].op, _CHANNEL_READERS) for u in graph.tensors[node.name].users)
    )


def _elsewhere(node) -> OpFacts:
    """Facts of an op a spread planner never plans (it is not layout-free)."""
    return OpFacts(node.index, node.name, GLOBAL, None, [], [], 0, 0, 0.0, 1, 0, 0)


class PlannerFacts:
    """``exact_f32``: F32 GEMM ops run on whole tensors (``slicing.blas_f32``), so the chip's F32
    results equal TPU inference's; off, they slice like every other op (tests of the halo math).

    Layout-free ops (``Rule.layout_free``) may also run in the lane-spread layout: ``self.spread`` is a
    second planner over ``spread_graph`` that plans only them (``spread_ops``); the search takes its
    estimate for a run of such ops where it is cheaper, and a global layout-free op runs spread.
    Likewise ``self.fold`` plans over ``fold_graph``, for groups that start with a foldable conv.
    ``layout``: which of the three this planner is."""

    def __init__(
        self,
        graph: Graph,
        chip: Chip,
        *,
        exact_f32: bool = True,
        spread_ops: frozenset[int] | None = None,
        layout: str = CHANNEL,
        folds: Sequence[Fold] = (),
    ):
        self.g, self.chip = graph, chip
        self.exact_f32 = exact_f32
        self.layout_name = SPREAD if spread_ops is not None else layout
        self.folded = {f.input: f for f in folds} if layout == FOLD else {}  # X' -> its fold
        self.t: dict[str, TensorFacts] = {}
        for name, t in graph.tensors.items():
            s4 = nchw(t.shape)
            self.t[name] = TensorFacts(
                s4, t.dtype.itemsize, math.ceil(s4[1] / chip.lanes), s4[1] * s4[3] * t.dtype.itemsize
            )
        self.spread: Self | None = None
        self.free: frozenset[int] = frozenset()  # layout-free ops whose spread layout uses more lanes
        self.folds: dict[int, Fold] = {}  # first op of a fold group -> its fold
        self.fold: dict[int, Self] = {}  # first op of a fold group -> the planner of its fold graph
        if self.layout_name == CHANNEL:
            for f in find_folds(graph, chip):
                self.folds[f.start] = f
                self.fold[f.start] = type(self)(
                    fold_graph(graph, [f]), chip, exact_f32=exact_f32, layout=FOLD, folds=[f]
                )
            free = [node.index for node in graph.ops if _layout_free(graph, node)]
            if free:
                sg = spread_graph(graph, free, chip.lanes)
                self.spread = type(self)(sg, chip, exact_f32=exact_f32, spread_ops=frozenset(free))
                self.free = frozenset(
                    p for p in free if nchw(sg.tensors[graph.ops[p].name].shape) != self.t[graph.ops[p].name].shape4
                )
        self.packs: dict[str, Pack] = {}  # weight -> the pack its op loads it in (channel layout: ``_facts``)
        self.ops = [
            self._facts(node) if spread_ops is None or node.index in spread_ops else _elsewhere(node)
            for node in graph.ops
        ]
        if self.spread is not None:
            for p in self.free:  # a global layout-free op runs spread (codegen.Emitter.global_op)
                self.ops[p].global_cycles = self.spread.ops[p].global_cycles
        self._structure: dict[tuple[int, int], tuple] = {}
        self.unfit: set[tuple[int, int]] = set()  # runs the estimate fits that no exact plan does (``plan``)
        self._memo: dict[tuple[int, int, int, int], tuple[bool, int]] = {}
        self._sequences: dict[tuple[int, int], list[tuple[int, int]]] = {}
        # the last op reading each tensor (past the end for graph outputs): a group's outputs are the
        # tensors it produces that someone after it reads
        self._last_read = {
            name: len(graph.ops) if t.graph_output else max(t.users, default=-1) for name, t in graph.tensors.items()
        }

    def _facts(self, node) -> OpFacts:
        g, chip = self.g, self.chip
        rule = local_rule(g, node)
        if rule is not None and self.exact_f32:
            rule = exact_f32(g, node, rule)
        # a Permute is always a copy; Slice and Gather only instead of running as global ops
        copy = as_copy(g, node) if isinstance(node.op, tpu.PermuteOp) or rule is None else None
        kind = ALIAS if isinstance(node.op, ALIAS_OPS) else COPY if copy is not None else LOCAL if rule else GLOBAL
        out_rank = len(g.tensors[node.name].shape)
        operands = [
            (k, t, len(g.tensors[t].shape) == out_rank)
            for k, t in enumerate(node.inputs)
            if t is not None and not g.tensors[t].weight
        ]
        weights = list(dict.fromkeys(g.weights_of(node)))
        # a folded conv's filter is W' (``Fold``), loaded as it is; a spread group's weights are single values
        folded = {f.conv for f in self.folded.values()}
        pack = (
            pack_of(g, node)
            if self.layout_name in (CHANNEL, FOLD) and kind == LOCAL and node.index not in folded
            else None
        )
        in_shapes = [g.tensors[t].shape if t is not None else () for t in node.inputs]
        out_shapes = [g.tensors[o].shape for o in node.outputs if o in g.tensors]
        dtype = self._compute_dtype(node)
        compute = cost.compute_cycles(chip, node.kind, node.op.params, in_shapes, out_shapes, dtype)
        read_from = list(dict.fromkeys(x for x in node.inputs if x is not None))
        reads = cost.ddr_reads(
            node.kind, [g.tensors[t].shape for t in read_from], out_shapes, [g.tensors[t].nbytes for t in read_from]
        )
        writes = [g.tensors[o].nbytes for o in node.outputs if o in g.tensors]
        nbytes = sum(reads) + sum(writes)
        if kind == COPY:  # one DDR-to-DDR transfer reading and writing every byte
            gcycles = cost.copy_cycles(chip, g.tensors[node.name].nbytes)
        else:
            gcycles = (
                0
                if kind == ALIAS
                else cost.global_cycles(chip, node.kind, node.op.params, in_shapes, out_shapes, dtype, reads, writes)
            )
        if pack is not None:  # one buffer and one transfer, named by the pack's key
            weights = [pack.key]
            self.packs.update({w: pack for w in pack.weights})
            wlane, wcycles = pack.lane_bytes(chip), cost.gdma_cycles(chip, pack.nbytes)
        else:
            wlane = sum(weight_lane_bytes(chip, g.tensors[w].shape, g.tensors[w].dtype.itemsize) for w in weights)
            wcycles = sum(cost.gdma_cycles(chip, g.tensors[w].nbytes) for w in weights)
        s4 = nchw(g.tensors[node.name].shape)
        return OpFacts(
            node.index,
            node.name,
            kind,
            rule,
            operands,
            weights,
            wlane,
            wcycles,
            compute,
            s4[0] * s4[2],
            gcycles,
            nbytes,
        )

    def weight_nbytes(self, w: str) -> int:
        """DDR bytes of loading weight w: its pack's when it is one's key."""
        return self.packs[w].nbytes if w in self.packs else self.g.tensors[w].nbytes

    def layout(self, group: Group) -> Self:
        """The planner of ``group``'s layout."""
        if group.layout == FOLD:
            return self.fold.get(group.ops[0], self)
        return self.spread if group.layout == SPREAD and self.spread is not None else self

    def load_cycles(self, t: str, r: Range) -> int:
        """GDMA cycles of loading rows ``r`` of group input t: one transfer, or a folded input's pieces."""
        fold = self.folded.get(t)
        if fold is None:
            return self.t[t].gdma_cycles(self.chip, r[1] - r[0], r[3] - r[2])
        row = (r[1] - r[0]) * fold.ic * fold.w * self.t[t].esize
        return sum(cost.gdma_cycles(self.chip, rows * row) for _, _, rows, _ in fold.pieces(r[2], r[3]))

    def spreads(self, i: int, j: int) -> bool:
        """May ops[i:j] run in the lane-spread layout, and does it use more lanes there?"""
        return (
            self.spread is not None
            and any(p in self.free for p in range(i, j))
            and all(self.spread.ops[p].kind == LOCAL for p in range(i, j))
        )

    def _compute_dtype(self, node):
        data = [t for t in node.inputs if t is not None and not self.g.tensors[t].weight]
        first = data[0] if data else node.outputs[0]
        return self.g.tensors[first].dtype

    # ---- group structure ------------------------------------------------------------------------

    def structure(self, i: int, j: int):
        """(inputs, outputs, weights, last in-group reader of each produced tensor) of ops[i:j]."""
        key = (i, j)
        if key not in self._structure:
            produced = {self.ops[p].name: p for p in range(i, j)}
            inputs: dict[str, None] = {}
            weights: dict[str, None] = {}
            last: dict[str, int] = {}
            for p in range(i, j):
                f = self.ops[p]
                for _, t, _ in f.operands:
                    if t in produced:
                        last[t] = p
                    else:
                        inputs.setdefault(t)
                for w in f.weights:
                    weights.setdefault(w)
            outputs = [name for name in produced if self._last_read[name] >= j]
            self._structure[key] = (list(inputs), outputs, list(weights), last)
            if len(self._structure) > 4096:
                self._structure.clear()
                self._structure[key] = (list(inputs), outputs, list(weights), last)
        return self._structure[key]

    def limits(self, i: int, j: int) -> tuple[int, int]:
        """The most N and H slices ops[i:j] allows (1 where an op keeps the dim whole)."""
        _, outputs, _, _ = self.structure(i, j)
        n_max = min(self.t[o].shape4[0] for o in outputs) if outputs else 1
        h_max = min(self.t[o].shape4[2] for o in outputs) if outputs else 1
        for p in range(i, j):
            rule = self.ops[p].slice_rule
            if not rule.n_split:
                n_max = 1
            if not rule.h_split:
                h_max = 1
            elif rule.min_rows > 1:
                # a slice of the op's result holds about its rows / slices (one fewer through an upsample)
                h_max = min(h_max, self.t[self.ops[p].name].shape4[2] // (rule.min_rows + 1))
        return n_max, max(h_max, 1)
