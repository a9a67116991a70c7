"""Layer group: which consecutive ops run together from local memory, how they are sliced, where tiles live.

A group is a run of consecutive ops (in the module's topological order) that
the chip executes slice by slice without touching DDR in between: per slice it
loads the group's inputs, computes every op on local tiles and stores the
group's outputs; weights are loaded once. Slices split N first, then H; an
output's rows are split evenly and every op's needed input rows — with the
halo of a conv or pool window — are propagated backwards through the group
(``slicing.Rule``), a tensor read by several ops holding the union. The
schedule is software-pipelined (load slice i+1 and store slice i-1 while
computing slice i), so group inputs and outputs get two buffers each.

The grouping is chosen by dynamic programming over the op order: best[j] =
min over i of best[i] + cycles(group ops[i:j]), where a group's cycles come
from the cost model (``cost.py``, shared with the simulator) at its best slicing
(the fewest slices that fit, or a few more when pipelining pays). Ops without a
slice rule (or whose single-op group cannot fit) run as global ops, reading and
writing DDR directly; a Reshape is an alias of its input's DDR buffer.

Local memory is allocated per group by lifetime (position in the group's op
order): weights, inputs and outputs live across the whole step, intermediate
tensors from their producer to their last reader; offsets are EU-aligned, an
op's output avoids its inputs' banks where possible, and a group that does not
fit is re-sliced — the final check raises, never overlaps.

lg.mlir is tpu.mlir plus group info (as TPU-MLIR's): each op gets a ``ginfo``
dictionary (group, id, kind; for local ops the output's local addresses and
size per lane, scratch buffer, and per slice n_idx/n_slice/h_idx/h_slice of
the rows it computes); the module's ``lg.groups`` lists every group with its
slicing, estimated cycles and DDR bytes, and its loads, stores and weights
with their local addresses and per-slice ranges.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from xdsl.dialects.builtin import ArrayAttr, DictionaryAttr, IntegerAttr, ModuleOp, StringAttr
from xdsl.ir import Attribute

from tpubuild.build.chips import Chip
from tpubuild.codegen import alloc, cost
from tpubuild.codegen.commands import Shape4, shape4
from tpubuild.codegen.cost import nchw
from tpubuild.codegen.graph import Graph, build_graph
from tpubuild.codegen.slicing import Rule, align, exact_f32, local_rule, spread_shape, weight_lane_bytes
from tpubuild.errors import TpuBuildError
from tpubuild.ir import mlir, top, tpu
from tpubuild.ir.params import int_array, int_attr

LOCAL, GLOBAL, ALIAS, COPY = "local", "global", "alias", "copy"
CHANNEL, SPREAD, FOLD = "channel", "spread", "fold"  # a local group's layout (Group.layout)
# the longest run the search tries as one group: longer ones cost search time and cut less DDR traffic; 24 split
# DenseNet's dense blocks and PP-OCR's stages (48: 33 zoo targets 1-23% fewer cycles, the stage up to 2x slower)
MAX_GROUP_OPS = 48
ALIAS_OPS = (tpu.ReshapeOp,)

Range = tuple[int, int, int, int]  # n_lo, n_hi, h_lo, h_hi in the tensor's (n, c, h, w) view


def split(total: int, parts: int, index: int) -> tuple[int, int]:
    return index * total // parts, (index + 1) * total // parts


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


def with_h_pads(params, top: int, bottom: int):
    """A windowed op's parameters with its H pads replaced by a slice's."""
    pads = list(params.pads)
    nd = len(params.kernel_shape)
    pads[0], pads[nd] = top, bottom
    return dataclasses.replace(params, pads=tuple(pads))


def logical_shape(full_shape: Sequence[int], r: Range) -> tuple[int, ...]:
    """The kernel-facing shape of rows ``r`` of a tensor: its sliced dims (N; H of a rank-4 tensor) shrunk."""
    if len(full_shape) == 4:
        return (r[1] - r[0], full_shape[1], r[3] - r[2], full_shape[3])
    if len(full_shape) == 3:
        return (r[1] - r[0], full_shape[1], full_shape[2])
    return tuple(full_shape)


def weight_block(shape: Sequence[int]) -> tuple[int, int, int, int]:
    """A weight's local block: its first non-unit dim on lanes, the rest one row (``slicing.weight_lane_bytes``)."""
    dims = list(shape)
    while len(dims) > 1 and dims[0] == 1:
        dims.pop(0)
    if not dims:
        dims = [1]
    return (1, dims[0], 1, math.prod(dims[1:]))


@dataclass(frozen=True)
class Pack:
    """An op's weights that put the same dim on lanes (a conv's filter and bias), loaded by one GDMA:
    DDR holds them as ``channels`` rows of ``row`` bytes, row c holding each weight's row c at its
    offset (aligned to 4 bytes), and local memory as one (1, channels, 1, row) byte block; each weight
    is a view into it (its offset, the block's plane stride). TPU-MLIR packs a conv's per-channel
    parameters alike: one short-row transfer per parameter costs the GDMA a fixed cost each."""

    weights: tuple[str, ...]
    offsets: tuple[int, ...]  # bytes into a row
    channels: int
    row: int  # bytes

    @property
    def nbytes(self) -> int:
        return self.channels * self.row

    @property
    def key(self) -> str:
        """The weight that names the pack (its buffer, its transfer, its DDR address)."""
        return self.weights[0]

    def lane_bytes(self, chip: Chip) -> int:
        return math.ceil(self.channels / chip.lanes) * align(self.row, chip.eu_bytes)

    def data(self, arrays: Sequence[np.ndarray]) -> bytes:
        """The DDR bytes of the pack from its weights' values (each in its own dtype)."""
        out = np.zeros((self.channels, self.row), np.uint8)
        for array, offset in zip(arrays, self.offsets, strict=True):
            rows = np.ascontiguousarray(array).reshape(self.channels, -1).view(np.uint8)
            out[:, offset : offset + rows.shape[1]] = rows
        return out.tobytes()


def pack_of(graph: Graph, node) -> Pack | None:
    """The pack of ``node``'s weights: two or more, read by this op alone, with the same dim on lanes."""
    weights = list(dict.fromkeys(graph.weights_of(node)))
    if len(weights) < 2 or any(graph.tensors[w].users != [node.index] for w in weights):
        return None
    blocks = [weight_block(graph.tensors[w].shape) for w in weights]
    if len({b[1] for b in blocks}) != 1:
        return None
    offsets, row = [], 0
    for w, b in zip(weights, blocks, strict=True):
        row = align(row, 4)
        offsets.append(row)
        row += b[3] * graph.tensors[w].dtype.itemsize
    return Pack(tuple(weights), tuple(offsets), blocks[0][1], row)


def packs_of(graph: Graph, groups: Sequence[Group], chip: Chip) -> dict[str, Pack]:
    """Weight -> its pack, for the ops of channel-layout and fold local groups but a fold group's
    folded conv (what layer group planned them with: ``Planner._facts``; a global op reads its weights
    whole from DDR, a folded conv its W')."""
    folded = {f.start: f.conv for f in find_folds(graph, chip)}
    found: dict[str, Pack] = {}
    for group in groups:
        if group.kind != LOCAL or group.layout == SPREAD:
            continue
        for p in group.ops:
            if group.layout == FOLD and p == folded.get(group.ops[0]):
                continue
            pack = pack_of(graph, graph.ops[p])
            if pack is not None:
                found.update({w: pack for w in pack.weights})
    return found


# ---- per-op and per-tensor facts the search reuses ------------------------------------------------


@dataclass
class TensorFacts:
    shape4: tuple[int, int, int, int]
    esize: int
    c_lane: int  # channels per lane
    row: int  # bytes of one (n, h) row over all channels and w: DDR bytes = n * h * row

    def lane_bytes(self, chip: Chip, n: int, h: int) -> int:
        return n * self.c_lane * align(h * self.shape4[3] * self.esize, chip.eu_bytes)

    def ddr_bytes(self, n: int, h: int) -> int:
        return n * h * self.row

    def gdma_cycles(self, chip: Chip, n: int, h: int, store: bool = False) -> int:
        """One transfer of ``n`` x ``h`` rows of the tensor to local memory (``store``: back to DDR)."""
        return cost.gdma_cycles(chip, self.ddr_bytes(n, h), store)


@dataclass
class OpFacts:
    index: int
    name: str  # the op's (first) result tensor
    kind: str  # LOCAL, GLOBAL or ALIAS
    rule: Rule | None
    operands: list[tuple[int, str, bool]]  # (operand index, activation tensor, same rank as the result)
    weights: list[str]
    weight_lane: int  # bytes per lane of all its weights
    weight_cycles: int  # GDMA cycles to load them
    compute: float  # cycles of the whole op's arithmetic
    rows: int  # n x h of its result: compute scales with the share of these a slice computes
    global_cycles: int
    global_bytes: int  # DDR bytes read and written as a global op (or alone, unsliced)

    @property
    def slice_rule(self) -> Rule:
        """The slice rule of an op placed in a local group (an op without one never is)."""
        if self.rule is None:
            raise ValueError(f"{self.name}: a {self.kind} op has no slice rule")
        return self.rule


# ---- a planned group ----------------------------------------------------------------------------


@dataclass
class Group:
    """One group as planned (and as lg.mlir records it)."""

    id: int
    kind: str
    ops: list[int]
    n_secs: int = 1
    h_secs: int = 1
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    weights: list[str] = field(default_factory=list)
    ranges: dict[str, list[Range]] = field(default_factory=dict)  # tensor -> per slice: rows held locally
    own: dict[str, list[Range]] = field(default_factory=dict)  # output -> per slice: rows stored
    sizes: dict[str, int] = field(default_factory=dict)  # buffer key -> bytes per lane
    addrs: dict[str, int] = field(default_factory=dict)  # buffer key -> local address
    copies: int = 1
    cycles: int = 0
    ddr_bytes: int = 0
    lmem_bytes: int = 0
    # CHANNEL: channel c in lane c % lanes. SPREAD: a group of layout-free ops on its tensors'
    # ``slicing.spread_shape`` (``spread_graph``). FOLD: a group starting with a small-IC integer conv
    # whose kernel rows are folded into its input's channels (``fold_graph``). Ranges count rows of the
    # tensors' shapes in that layout's graph.
    layout: str = CHANNEL

    @property
    def slices(self) -> int:
        return self.n_secs * self.h_secs

    def weight_loads(self, graph: Graph, packs: Mapping[str, Pack]) -> list[list[str]]:
        """Per op of the group, the weights loaded before it: those no earlier op of the group uses
        (a weight two ops share is loaded once, for the first); a pack as its key."""
        seen: set[str] = set()
        loads = []
        for p in self.ops:
            names = [packs[w].key if w in packs else w for w in graph.weights_of(graph.ops[p])]
            new = [w for w in dict.fromkeys(names) if w not in seen]
            seen.update(new)
            loads.append(new)
        return loads

    def buffer_keys(self, tensor: str) -> list[str]:
        n = self.copies if tensor in self.inputs or tensor in self.outputs else 1
        return [f"{tensor}#{c}" for c in range(n)]


@dataclass
class Estimate:
    cycles: int
    n_secs: int
    h_secs: int
    index: int  # position in the slicing sequence
    layout: str = CHANNEL  # the planner it comes from (``Planner.spread``, ``Planner.fold``)


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


class Planner:
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
        self.spread: Planner | None = None
        self.free: frozenset[int] = frozenset()  # layout-free ops whose spread layout uses more lanes
        self.folds: dict[int, Fold] = {}  # first op of a fold group -> its fold
        self.fold: dict[int, Planner] = {}  # first op of a fold group -> the planner of its fold graph
        if self.layout_name == CHANNEL:
            for f in find_folds(graph, chip):
                self.folds[f.start] = f
                self.fold[f.start] = Planner(fold_graph(graph, [f]), chip, exact_f32=exact_f32, layout=FOLD, folds=[f])
            free = [node.index for node in graph.ops if _layout_free(graph, node)]
            if free:
                sg = spread_graph(graph, free, chip.lanes)
                self.spread = Planner(sg, chip, exact_f32=exact_f32, spread_ops=frozenset(free))
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

    def layout(self, group: Group) -> Planner:
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

    def sequence(self, i: int, j: int) -> list[tuple[int, int]]:
        """Slicings in the order they are tried: N first (each distinct slice size once), then H."""
        seq = self._sequences.get((i, j))
        if seq is None:
            if len(self._sequences) > 1 << 14:
                self._sequences.clear()
            seq = self._sequences[(i, j)] = self._sequence(i, j)
        return seq

    def _sequence(self, i: int, j: int) -> list[tuple[int, int]]:
        n_max, h_max = self.limits(i, j)
        seq, seen = [], set()
        for ns in range(1, n_max + 1):
            step = -(-n_max // ns)
            if step not in seen:
                seen.add(step)
                seq.append((ns, 1))
        ns = seq[-1][0]
        seen = set()
        for hs in range(2, h_max + 1):
            # only slice counts that change the tallest output slice (and so the working set)
            tallest = -(-h_max // hs)
            if tallest not in seen:
                seen.add(tallest)
                seq.append((ns, hs))
        return seq

    # ---- ranges ---------------------------------------------------------------------------------

    def ranges(self, i: int, j: int, ns: int, hs: int, ni: int, hi: int | None) -> dict[str, Range]:
        """Rows each tensor of ops[i:j] holds in slice (ni, hi); ``hi=None``: a middle slice of the
        tallest size (what the search sizes buffers by). A tensor read by several ops holds the union of
        their rows; each reader sees a view of its own rows (an address offset, the tile's plane stride)."""
        _, outputs, _, _ = self.structure(i, j)
        need: dict[str, Range] = {}
        for o in outputs:
            need[o] = self.own_range(o, ns, hs, ni, hi)
        for p in range(j - 1, i - 1, -1):
            f = self.ops[p]
            r = need.get(f.name)
            o4 = self.t[f.name].shape4
            if r is None:
                r = self.own_range(f.name, ns, hs, ni, hi)
            if not f.slice_rule.rows:  # whole rows in, whole rows out (and whole N unless it slices N)
                r = (r[0], r[1], 0, o4[2]) if f.slice_rule.n_split else (0, o4[0], 0, o4[2])
            r = (r[0], r[1], *f.slice_rule.computed(r[2], r[3], o4[2]))
            need[f.name] = r
            for k, t, same in f.operands:
                s4 = self.t[t].shape4
                if same:
                    n_lo, n_hi = (r[0], r[1]) if s4[0] == o4[0] else (0, s4[0])
                    h_lo, h_hi, _, _ = f.slice_rule.in_h_range(k, r[2], r[3], s4[2], o4[2])
                else:
                    n_lo, n_hi, h_lo, h_hi = 0, s4[0], 0, s4[2]
                old = need.get(t)
                if old is not None:
                    n_lo, n_hi = min(n_lo, old[0]), max(n_hi, old[1])
                    h_lo, h_hi = min(h_lo, old[2]), max(h_hi, old[3])
                need[t] = (n_lo, n_hi, h_lo, h_hi)
        return need

    def own_range(self, tensor: str, ns: int, hs: int, ni: int, hi: int | None) -> Range:
        n, _, h, _ = self.t[tensor].shape4
        if hi is None:
            n_len, h_len = -(-n // ns), -(-h // hs)
            h_lo = (h - h_len) // 2
            return 0, n_len, h_lo, h_lo + h_len
        return (*split(n, ns, ni), *split(h, hs, hi))

    # ---- one slicing's cost and fit -------------------------------------------------------------

    def slice_costs(self, i: int, j: int, need: dict[str, Range], own: dict[str, Range]) -> tuple[int, int, int, int]:
        """(load cycles, compute cycles, store cycles, DDR bytes) of one slice."""
        chip = self.chip
        inputs, outputs, _, _ = self.structure(i, j)
        load = store = nbytes = 0
        for t in inputs:
            r = need[t]
            load += self.load_cycles(t, r)
            nbytes += self.t[t].ddr_bytes(r[1] - r[0], r[3] - r[2])
        for o in outputs:
            r = own[o]
            store += self.t[o].gdma_cycles(chip, r[1] - r[0], r[3] - r[2], store=True)
            nbytes += self.t[o].ddr_bytes(r[1] - r[0], r[3] - r[2])
        compute = 0
        for p in range(i, j):
            f = self.ops[p]
            r = need[f.name]
            s4 = self.t[f.name].shape4
            frac = (r[1] - r[0]) * (r[3] - r[2]) / (s4[0] * s4[2])
            compute += chip.bdc_overhead + math.ceil(f.compute * frac)
        return load, compute, store, nbytes

    def buffers(self, i: int, j: int, sizes: dict[str, int], copies: int) -> tuple[list[alloc.Buffer], dict]:
        """Local buffers of ops[i:j] (per lane) with lifetimes in group positions, and bank conflicts."""
        inputs, outputs, weights, last = self.structure(i, j)
        m = j - i
        bufs: list[alloc.Buffer] = []
        for w in weights:
            bufs.append(alloc.Buffer(f"{w}#0", 0, m - 1, sizes[w]))
        whole = set(inputs) | set(outputs)
        for t in list(inputs) + list(outputs):
            bufs += [alloc.Buffer(f"{t}#{c}", 0, m - 1, sizes[t]) for c in range(copies)]
        avoid: dict[str, list[str]] = {}
        for p in range(i, j):
            f = self.ops[p]
            if f.name not in whole:
                bufs.append(alloc.Buffer(f"{f.name}#0", p - i, last.get(f.name, p) - i, sizes[f.name]))
            scratch = sizes.get(f"{f.name}#buf", 0)
            if scratch:
                bufs.append(alloc.Buffer(f"{f.name}#buf", p - i, p - i, scratch))
            outs = [f"{f.name}#{c}" for c in range(copies if f.name in whole else 1)]
            ins = [f"{t}#{c}" for _, t, _ in f.operands for c in range(copies if t in whole else 1)]
            for o in outs:
                avoid.setdefault(o, []).extend(ins)
                for x in ins:
                    avoid.setdefault(x, []).append(o)
        return bufs, avoid

    def sizes_of(self, i: int, j: int, needs: Sequence[dict[str, Range]]) -> dict[str, int]:
        chip = self.chip
        sizes: dict[str, int] = {}
        for need in needs:
            for t, r in need.items():
                b = self.t[t].lane_bytes(chip, r[1] - r[0], r[3] - r[2])
                if b > sizes.get(t, 0):
                    sizes[t] = b
        _, _, weights, _ = self.structure(i, j)
        for w in weights:
            t = self.g.tensors[w]
            sizes[w] = (
                self.packs[w].lane_bytes(chip)
                if w in self.packs
                else weight_lane_bytes(chip, t.shape, t.dtype.itemsize)
            )
        for p in range(i, j):
            f = self.ops[p]
            if f.slice_rule.buffer_factor:
                sizes[f"{f.name}#buf"] = align(
                    int(sizes[f.name] * f.slice_rule.buffer_factor * 4 / self.t[f.name].esize), chip.eu_bytes
                )
        return sizes

    def estimate(self, i: int, j: int, ns: int, hs: int) -> tuple[bool, int]:
        """(fits, cycles) of ops[i:j] at this slicing, sized by a middle slice of the tallest size.

        The search's inner loop: one pass, no allocation (the live-bytes bound decides the fit;
        ``finalize`` places the buffers for real and re-slices in the rare case that fails).
        """
        key = (i, j, ns, hs)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        chip, facts = self.chip, self.t
        inputs, outputs, _, last = self.structure(i, j)
        need = self.ranges(i, j, ns, hs, 0, None)
        copies = 2 if ns * hs > 1 else 1
        base = load = store = compute = 0
        for t in inputs:
            r = need[t]
            f = facts[t]
            base += copies * f.lane_bytes(chip, r[1] - r[0], r[3] - r[2])
            load += self.load_cycles(t, r)
        for o in outputs:
            r = need[o]
            f = facts[o]
            base += copies * f.lane_bytes(chip, r[1] - r[0], r[3] - r[2])
            own = self.own_range(o, ns, hs, 0, None)
            store += f.gdma_cycles(chip, own[1] - own[0], own[3] - own[2], store=True)
        whole = set(inputs) | set(outputs)
        m = j - i
        diff = [0] * (m + 1)
        gdma_t = bdc_t = load  # slice 0: weights load op by op behind its input tiles while ops compute
        for p in range(i, j):
            op = self.ops[p]
            r = need[op.name]
            f = facts[op.name]
            base += op.weight_lane
            c = chip.bdc_overhead + math.ceil(op.compute * (r[1] - r[0]) * (r[3] - r[2]) / op.rows)
            compute += c
            if op.weight_cycles:
                gdma_t += op.weight_cycles
                bdc_t = max(bdc_t, gdma_t)
            bdc_t += c
            size = f.lane_bytes(chip, r[1] - r[0], r[3] - r[2])
            if op.name not in whole:
                diff[p - i] += size
                diff[last.get(op.name, p) - i + 1] -= size
            if op.slice_rule.buffer_factor:
                scratch = int(size * op.slice_rule.buffer_factor * 4 / f.esize)
                diff[p - i] += scratch
                diff[p - i + 1] -= scratch
        live = top = 0
        for d in diff:
            live += d
            top = max(top, live)
        if base + top > chip.lmem_bytes:
            result = (False, 0)
        else:
            result = (True, pipelined_after_first(ns * hs, load, compute, store, gdma_t, bdc_t))
        self._memo[key] = result
        if len(self._memo) > 1 << 16:
            self._memo.clear()
        return result

    def best_local(self, i: int, j: int, hint: int = 0) -> Estimate | None:
        """The cheapest slicing of ops[i:j] among the fewest slices that fit and about 2x and 4x as many
        (more slices overlap more DMA with compute but add halo rows and command overheads), in the
        channel layout or, for layout-free ops, the lane-spread one; None: none fits."""
        best = self._best_local(i, j, hint)
        alts = [self.spread] if self.spread is not None and self.spreads(i, j) else []
        if i in self.folds and j > self.folds[i].conv:  # X' never leaves the group
            alts.append(self.fold[i])
        for planner in alts:
            alt = planner._best_local(i, j, hint)
            if alt is not None and (best is None or alt.cycles < best.cycles):
                best = alt
        return best

    def _best_local(self, i: int, j: int, hint: int = 0) -> Estimate | None:
        seq = self.sequence(i, j)
        first = self._first_fit(i, j, seq, min(hint, len(seq) - 1))
        if first is None:
            return None
        k0 = seq[first][0] * seq[first][1]
        tried = [first]
        for factor in (2, 4):
            idx = next((x for x in range(first, len(seq)) if seq[x][0] * seq[x][1] >= factor * k0), None)
            if idx is not None and idx not in tried:
                tried.append(idx)
        best: Estimate | None = None
        for idx in tried:
            fits, cycles = self.estimate(i, j, *seq[idx])
            if fits and (best is None or cycles < best.cycles):
                best = Estimate(cycles, seq[idx][0], seq[idx][1], first, self.layout_name)
        return best

    def _first_fit(self, i: int, j: int, seq: list[tuple[int, int]], hint: int) -> int | None:
        """The first slicing in ``seq`` that fits, searching from ``hint`` (fit only improves along seq)."""
        if self.estimate(i, j, *seq[hint])[0]:
            lo = hint
            while lo > 0 and self.estimate(i, j, *seq[lo - 1])[0]:
                lo -= 1
            return lo
        # gallop forward, then bisect
        step, lo, hi = 1, hint, None
        while True:
            idx = lo + step
            if idx >= len(seq):
                idx = len(seq) - 1
                if idx == lo or not self.estimate(i, j, *seq[idx])[0]:
                    return None
                hi = idx
                break
            if self.estimate(i, j, *seq[idx])[0]:
                hi = idx
                break
            lo, step = idx, step * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.estimate(i, j, *seq[mid])[0]:
                hi = mid
            else:
                lo = mid
        return hi

    # ---- the search -----------------------------------------------------------------------------

    def alone_cycles(self, p: int) -> tuple[int, str, Estimate | None]:
        """(cycles, kind, local estimate) of op p in a group of its own (or as a global op)."""
        f = self.ops[p]
        if f.kind == ALIAS:
            return 0, ALIAS, None
        if f.kind == LOCAL:
            e = self.best_local(p, p + 1)
            if e is not None and e.cycles <= f.global_cycles:
                return e.cycles, LOCAL, e
        return f.global_cycles, (COPY if f.kind == COPY else GLOBAL), None

    def search(self) -> list[tuple[int, int, str, Estimate | None]]:
        """Dynamic programming over the op order: [(first op, end, kind, estimate)] covering every op."""
        n = len(self.ops)
        best = [0] + [math.inf] * n
        choice: list[tuple[int, str, Estimate | None]] = [(0, GLOBAL, None)] * (n + 1)  # [0]: never read
        for j in range(1, n + 1):
            cycles, kind, est = self.alone_cycles(j - 1)
            best[j], choice[j] = best[j - 1] + cycles, (j - 1, kind, est)
            if self.ops[j - 1].kind != LOCAL:
                continue
            hint = est.index if est else 0
            for i in range(j - 2, max(-1, j - 1 - MAX_GROUP_OPS), -1):
                if self.ops[i].kind != LOCAL or (i, j) in self.unfit:
                    break
                e = self.best_local(i, j, hint)
                if e is None:
                    break
                hint = e.index
                if best[i] + e.cycles < best[j]:
                    best[j], choice[j] = best[i] + e.cycles, (i, LOCAL, e)
        groups = []
        j = n
        while j > 0:
            i, kind, est = choice[j]
            groups.append((i, j, kind, est))
            j = i
        return groups[::-1]

    # ---- the final plan -------------------------------------------------------------------------

    def finalize(self, gid: int, i: int, j: int, ns: int, hs: int) -> Group | None:
        """Exact ranges for every slice, local addresses, cycles; None if it does not fit at this slicing."""
        inputs, outputs, weights, _ = self.structure(i, j)
        needs, owns = [], []
        for ni in range(ns):
            for hi in range(hs):
                needs.append(self.ranges(i, j, ns, hs, ni, hi))
                owns.append({o: self.own_range(o, ns, hs, ni, hi) for o in outputs})
        if hs > 1 and any(
            need[self.ops[p].name][3] - need[self.ops[p].name][2] < self.ops[p].slice_rule.min_rows
            for p in range(i, j)
            for need in needs
        ):
            return None  # (``limits`` keeps H slices this tall; a guard for the exact F32 bits)
        sizes = self.sizes_of(i, j, needs)
        copies = 2 if ns * hs > 1 else 1
        bufs, avoid = self.buffers(i, j, sizes, copies)
        try:
            addrs = alloc.place(
                bufs,
                align=self.chip.eu_bytes,
                bank_bytes=self.chip.lmem_bank_bytes,
                avoid=avoid,
                capacity=self.chip.lmem_bytes,
                what="local memory",
            )
        except alloc.AllocError:
            return None
        per_slice = [self.slice_costs(i, j, need, own) for need, own in zip(needs, owns, strict=True)]
        wbytes = sum(self.weight_nbytes(w) for w in weights)
        keyed = {b.key: b.size for b in bufs}
        group = Group(
            gid,
            LOCAL,
            list(range(i, j)),
            ns,
            hs,
            inputs,
            outputs,
            weights,
            ranges={t: [need[t] for need in needs] for t in needs[0]},
            own={o: [own[o] for own in owns] for o in outputs},
            sizes=keyed,
            addrs=addrs,
            copies=copies,
            ddr_bytes=wbytes + sum(c[3] for c in per_slice),
            lmem_bytes=alloc.peak(bufs, addrs),
            layout=self.layout_name,
        )
        group.cycles = self.replay(group)
        return group

    # ---- one op on one slice (codegen emits exactly this) -----------------------------------------

    def op_tiles(self, group: Group, p: int, s: int) -> tuple[object, list]:
        """(params as executed, per operand: None, (weight, None) or (tensor, rows needed)) of op p in
        slice s: a windowed op's H pads trimmed to the slice, a sized op's output shape the slice's, each
        activation's rows from its rule."""
        node = self.g.ops[p]
        f = self.ops[p]
        out_r = group.ranges[node.name][s]
        out4 = self.t[node.name].shape4
        out_rank = len(self.g.tensors[node.name].shape)
        params = node.op.params
        operands: list = []
        for k, t in enumerate(node.inputs):
            if t is None:
                operands.append(None)
                continue
            if self.g.tensors[t].weight:
                operands.append((t, None))
                continue
            s4 = self.t[t].shape4
            if len(self.g.tensors[t].shape) == out_rank:
                n_lo, n_hi = (out_r[0], out_r[1]) if s4[0] == out4[0] else (0, s4[0])
                h_lo, h_hi, top, bottom = f.slice_rule.in_h_range(k, out_r[2], out_r[3], s4[2], out4[2])
                if k == 0 and f.slice_rule.window is not None:
                    params = with_h_pads(params, top, bottom)
            else:
                n_lo, n_hi, h_lo, h_hi = 0, s4[0], 0, s4[2]
            operands.append((t, (n_lo, n_hi, h_lo, h_hi)))
        if f.slice_rule.sized:
            params = dataclasses.replace(params, shape=logical_shape(self.g.tensors[node.name].shape, out_r))
        return params, operands

    def check(self, group: Group) -> None:
        """Raise AllocError unless the group's local buffers (as recorded) fit and never overlap while alive."""
        sizes = {k.rsplit("#", 1)[0] if not k.endswith("#buf") else k: v for k, v in group.sizes.items()}
        i, j = group.ops[0], group.ops[-1] + 1
        bufs, _ = self.buffers(i, j, sizes, group.copies)
        missing = [b.key for b in bufs if b.key not in group.addrs]
        if missing:
            raise alloc.AllocError(f"group {group.id}: no local address for {', '.join(missing[:3])}")
        alloc.check(bufs, group.addrs, capacity=self.chip.lmem_bytes, what=f"group {group.id} local memory")

    def replay(self, group: Group) -> int:
        """Cycles of the group's commands (``schedule`` with the cost model's cycles of each): what the
        simulator's cycle model replays for this group."""
        steps, durations = self.timed_steps(group)
        return replay_steps(steps, durations)

    def timed_steps(self, group: Group) -> tuple[list[Step], list[int]]:
        """The group's ``schedule`` and the cost model's cycles of each step."""
        chip, g = self.chip, self.g
        loads = group.weight_loads(g, self.packs)
        steps = schedule(len(group.ops), group.slices, group.copies, [bool(w) for w in loads])
        durations = []
        for step in steps:
            if step.kind == "load":
                d = sum(self.load_cycles(t, group.ranges[t][step.slice]) for t in group.inputs)
            elif step.kind == "store":
                d = sum(
                    self.t[o].gdma_cycles(chip, r[1] - r[0], r[3] - r[2], store=True)
                    for o in group.outputs
                    for r in [group.own[o][step.slice]]
                )
            elif step.kind == "weights":
                d = sum(cost.gdma_cycles(chip, self.weight_nbytes(w)) for w in loads[step.op])
            else:
                p = group.ops[step.op]
                node = g.ops[p]
                params, operands = self.op_tiles(group, p, step.slice)
                ins = [
                    ()
                    if o is None
                    else g.tensors[o[0]].shape
                    if o[1] is None
                    else logical_shape(g.tensors[o[0]].shape, o[1])
                    for o in operands
                ]
                out = logical_shape(g.tensors[node.name].shape, group.ranges[node.name][step.slice])
                d = max(1, cost.bdc_cycles(chip, node.kind, params, ins, [out], self._compute_dtype(node)))
            durations.append(d)
        return steps, durations

    def plan(self) -> list[Group]:
        groups = self._plan_once()
        while groups is None:  # a run the search chose has no exact plan: search again without it
            groups = self._plan_once()
        self._alternate(groups)
        return groups

    def _plan_once(self) -> list[Group] | None:
        """The search's choice settled into exact groups; None when a run it chose as one group has no exact
        plan as one (the search sizes groups by a middle slice): that run is then ``unfit``, and the next
        search picks the best grouping without it instead of the run falling apart in _settle's halves."""
        groups: list[Group] = []
        chosen = self.search()
        k = 0
        while k < len(chosen):
            i, j, kind, est = chosen[k]
            if kind != LOCAL:
                groups.append(self._single(len(groups), i, kind))
                k += 1
                continue
            assert est is not None, "the search's local groups carry their estimate"
            placed = self._place(len(groups), i, j, est)
            if j - i > 1 and not (len(placed) == 1 and placed[0].kind == LOCAL):
                self.unfit.add((i, j))
                return None
            # the search sizes groups by a middle slice: where it split a run of ops that also fits as
            # one group, the exact plans decide (a near tie in the estimate can hide a real difference)
            while k + 1 < len(chosen) and chosen[k + 1][2] == LOCAL and chosen[k + 1][1] - i <= MAX_GROUP_OPS:
                j2, est2 = chosen[k + 1][1], chosen[k + 1][3]
                merged = self.best_local(i, j2)
                if merged is None or est2 is None:
                    break
                whole = self._place(len(groups), i, j2, merged)
                split = placed + self._place(len(groups) + len(placed), j, j2, est2)
                if sum(g.cycles for g in whole) >= sum(g.cycles for g in split):
                    break
                placed, j, k = whole, j2, k + 1
            groups.extend(placed)
            k += 1
        return groups

    def _place(self, gid: int, i: int, j: int, est: Estimate) -> list[Group]:
        """The exact groups of the search's choice ops[i:j] at ``est``."""
        if est.layout == CHANNEL:
            return self._settle(gid, i, j, est)
        settled = self.layout(Group(0, LOCAL, [i], layout=est.layout))._settle(gid, i, j, est)
        whole = len(settled) == 1 and settled[0].kind == LOCAL
        # the search's estimate sizes a middle slice: keep the other layout only if its exact
        # plan beats the channel layout's too
        base = self._best_local(i, j)
        channel = self._settle(gid, i, j, base) if base is not None else None
        if whole and (channel is None or settled[0].cycles < sum(g.cycles for g in channel)):
            return settled
        if est.layout == SPREAD and channel is None:
            return settled
        # (a fold group split up would store X' to DDR: the ops run in the channel layout)
        return channel if channel is not None else self._settle(gid, i, j, Estimate(0, 1, 1, 0))

    def _alternate(self, groups: Sequence[Group]) -> None:
        """Every other local group is mirrored to the top of local memory
        (``capacity - addr - size``: the same buffers, overlaps and banks, upside down), so two
        neighbours that fit together use disjoint bytes and codegen can load the next one's
        weights and first tiles while the current one still computes (``Emitter.prefetch``)."""
        cap = self.chip.lmem_bytes
        flip = False
        for group in groups:
            if group.kind != LOCAL:  # global ops and copies between use no local memory
                continue
            if flip and all(
                group.addrs[k] % self.chip.eu_bytes == 0 == (cap - group.sizes[k]) % self.chip.eu_bytes
                for k in group.addrs
            ):
                group.addrs = {k: cap - a - group.sizes[k] for k, a in group.addrs.items()}
                self.layout(group).check(group)
            flip = not flip

    def _settle(self, gid: int, i: int, j: int, est: Estimate) -> list[Group]:
        """The group at its estimated slicing, re-sliced until the exact plan fits; split if it never does."""
        seq = self.sequence(i, j)
        start = seq.index((est.n_secs, est.h_secs)) if (est.n_secs, est.h_secs) in seq else 0
        for ns, hs in seq[start:]:
            group = self.finalize(gid, i, j, ns, hs)
            if group is not None:
                return [group]
        if j - i == 1:
            return [self._single(gid, i, GLOBAL)]
        # it never fits as one group: its two halves, each settled the same way (and halved again if need be),
        # not every op alone (a run of 48 ops the search sized by a middle slice fell apart into 48 groups)
        return self._halves(gid, i, j)

    def _halves(self, gid: int, i: int, j: int) -> list[Group]:
        """ops[i:mid] and ops[mid:j], each one local group at its best estimate if it fits, else halved again."""
        out: list[Group] = []
        for a, b in ((i, (i + j) // 2), ((i + j) // 2, j)):
            e, at = self.best_local(a, b), gid + len(out)
            if e is not None:
                out += self._settle(at, a, b, e)
            else:
                out += [self._single(at, a, GLOBAL)] if b - a == 1 else self._halves(at, a, b)
        return out

    def _single(self, gid: int, p: int, kind: str) -> Group:
        f = self.ops[p]
        node = self.g.ops[p]
        inputs = list(dict.fromkeys(t for _, t, _ in f.operands))
        outputs = [o for o in node.outputs if o in self.g.tensors]
        return Group(
            gid,
            kind,
            [p],
            inputs=inputs,
            outputs=outputs,
            weights=f.weights,
            cycles=f.global_cycles if kind in (GLOBAL, COPY) else 0,
            ddr_bytes=f.global_bytes if kind in (GLOBAL, COPY) else 0,
        )


# readers that take a result's channels in runs (a channel shuffle's Reshape, a channel Split): codegen
# stores those runs to their places directly (``channel_redirects``), which needs the channel layout
_CHANNEL_READERS = (tpu.ReshapeOp, tpu.MIRROR[top.SplitOp])


@dataclass(frozen=True)
class Piece:
    """Channels [first, first + count) of a tile stored to channels at, at + stride, ... of ``dest``."""

    dest: str
    first: int
    count: int
    stride: int = 1
    at: int = 0


def _shuffle_pieces(g: Graph, kinds: Mapping[int, str], o: str) -> tuple[int, list[Piece]] | None:
    """o -> Reshape (n, g, C/g, h, w) -> Permute (0, 2, 1, 3, 4) (a copy): run j of C/g channels goes
    to channels j, j + g, ... of the permute's result."""
    t = g.tensors[o]
    reshape = g.ops[t.users[0]]
    r = g.tensors[reshape.name]
    if kinds.get(reshape.index) != ALIAS or len(r.users) != 1 or r.graph_output or len(r.shape) != 5:
        return None
    permute = g.ops[r.users[0]]
    if (
        kinds.get(permute.index) != COPY
        or not isinstance(permute.op, tpu.PermuteOp)
        or tuple(permute.op.params.order) != (0, 2, 1, 3, 4)
        or (r.shape[0], r.shape[1] * r.shape[2], r.shape[3], r.shape[4]) != tuple(t.shape)
    ):
        return None
    groups, run = r.shape[1], r.shape[2]
    return permute.index, [Piece(permute.name, j * run, run, groups, j) for j in range(groups)]


def _split_pieces(g: Graph, kinds: Mapping[int, str], o: str) -> tuple[int, list[Piece]] | None:
    """o -> Split along channels (a global op): result k takes its run of channels."""
    node = g.ops[g.tensors[o].users[0]]
    if kinds.get(node.index) != GLOBAL or not isinstance(node.op, tpu.MIRROR[top.SplitOp]):
        return None
    if node.op.params.axis % 4 != 1 or len(node.outputs) != len(node.op.params.split_size):
        return None
    firsts = np.cumsum((0, *node.op.params.split_size))
    return node.index, [
        Piece(out, int(firsts[k]), int(n))
        for k, (out, n) in enumerate(zip(node.outputs, node.op.params.split_size, strict=True))
    ]


def channel_redirects(graph: Graph, groups: Sequence[Group]) -> dict[str, tuple[int, list[Piece]]]:
    """Outputs of channel-layout local groups (4-D, n = 1, one reader, not a graph output) whose reader
    is a channel shuffle (Reshape (n, C, h, w) -> (n, g, C/g, h, w), Permute (0, 2, 1, 3, 4), a copy)
    or a channel Split (a global op): the group's store writes the reader's results directly, runs of
    the tile's channels to their channels there (one strided store per ``Piece``), and the reader does
    not run. Memory assign makes those results live from the producing group's step (they are
    written then); codegen emits the stores. -> output -> (the reader's op index, its pieces)."""
    kinds = {p: group.kind for group in groups for p in group.ops}
    found: dict[str, tuple[int, list[Piece]]] = {}
    for group in groups:
        if group.kind != LOCAL or group.layout == SPREAD:  # pieces are runs of channels
            continue
        for o in group.outputs:
            t = graph.tensors[o]
            if t.graph_output or len(t.shape) != 4 or t.shape[0] != 1 or len(t.users) != 1:
                continue
            hit = _shuffle_pieces(graph, kinds, o) or _split_pieces(graph, kinds, o)
            if hit is not None:
                found[o] = hit
    return found


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


def pipelined_after_first(k: int, load: int, compute: int, store: int, gdma_t: int, bdc_t: int) -> int:
    """Cycles of k equal slices in ``schedule``'s order, slice 0's compute having ended at ``bdc_t`` and
    the GDMA queue (its loads and the weights) at ``gdma_t``: then slice t+1 loads and slice t-1 stores
    (one GDMA engine) while slice t computes."""
    if k == 1:
        return bdc_t + store
    return max(bdc_t, gdma_t + load) + (k - 2) * max(load + store, compute) + max(store, compute) + store


@dataclass(frozen=True)
class Step:
    """One step of a local group's command streams: ``queue`` "gdma" (a load of slice ``slice``'s
    inputs, the weights of op ``op``, a store of a slice's outputs) or "bdc" (op ``op`` of a slice).
    ``wait``: the index of the step of the other queue this one waits for (START: the previous group's
    last compute; NONE: only its own queue's order); ``after``: every step of the other queue it needs
    (``wait`` is the last of them in this order; codegen may emit a group's first transfers early,
    before the previous group's last store, so their command ids no longer follow this order)."""

    queue: str
    kind: str
    slice: int
    op: int = -1
    wait: int = -1
    after: tuple[int, ...] = ()


START, NONE = -2, -1


def schedule(n_ops: int, slices: int, copies: int, weighted: Sequence[bool]) -> list[Step]:
    """The order codegen emits a local group's steps in, and their waits (one list for both queues).

    GDMA: slice 0's loads, the weights op by op, slice 1's loads, then slice t's loads and slice t-2's
    stores; BDC: every op of slice 0 (each waiting for its weights, so later weights load while earlier
    ops compute), then slice by slice. A load into buffer s % 2 waits for the compute of slice s - 2
    that read it; a slice's first op waits for its loads and for the store of slice s - 2 that read its
    output buffer; a store waits for its slice's last op.
    """
    order = _StepOrder(n_ops, copies)
    order.load(0)
    order.weight_loads(weighted)
    if slices == 1:
        order.compute(0)
        order.store(0)
        return order.steps
    order.load(1)
    order.compute(0)
    for t in range(2, slices + 2):
        if t < slices:
            order.load(t)
        order.store(t - 2)
        if 1 <= t - 1 < slices:
            order.compute(t - 1)
    return order.steps


class _StepOrder:
    """``schedule``'s steps as they are appended, with the indices later steps wait for."""

    def __init__(self, n_ops: int, copies: int):
        self.n_ops, self.copies = n_ops, copies
        self.steps: list[Step] = []
        self.loads: dict[int, int] = {}
        self.stores: dict[int, int] = {}
        self.last_op: dict[int, int] = {}
        self.weights: dict[int, int] = {}

    def load(self, s: int) -> None:
        self.loads[s] = len(self.steps)
        reuse = s >= self.copies  # the buffer held slice s - copies: its compute must be done
        self.steps.append(
            Step(
                "gdma",
                "load",
                s,
                wait=self.last_op[s - self.copies] if reuse else START,
                after=(self.last_op[s - self.copies],) if reuse else (),
            )
        )

    def weight_loads(self, weighted: Sequence[bool]) -> None:
        for p in range(self.n_ops):
            if weighted[p]:
                self.weights[p] = len(self.steps)
                self.steps.append(Step("gdma", "weights", 0, p, wait=NONE))

    def store(self, s: int) -> None:
        self.stores[s] = len(self.steps)
        self.steps.append(Step("gdma", "store", s, wait=self.last_op[s], after=(self.last_op[s],)))

    def compute(self, s: int) -> None:
        for p in range(self.n_ops):
            waits = [self.loads[s]] if p == 0 else []
            if p == 0 and s >= self.copies:
                waits.append(self.stores[s - self.copies])
            if s == 0 and p in self.weights:
                waits.append(self.weights[p])
            self.steps.append(Step("bdc", "compute", s, p, wait=max(waits) if waits else NONE, after=tuple(waits)))
        self.last_op[s] = len(self.steps) - 1


def replay_steps(steps: Sequence[Step], durations: Sequence[int]) -> int:
    """Makespan of ``steps`` on two in-order queues with their waits (START: time 0)."""
    end = [0] * len(steps)
    free = {"gdma": 0, "bdc": 0}
    for i, (step, d) in enumerate(zip(steps, durations, strict=True)):
        start = max(free[step.queue], end[step.wait] if step.wait >= 0 else 0)
        end[i] = free[step.queue] = start + d
    return max(free.values())


# ---- lg.mlir ------------------------------------------------------------------------------------


def _slices_attr(ranges: Sequence[Range]) -> dict[str, Attribute]:
    return {
        "n_idx": int_array([r[0] for r in ranges]),
        "n_slice": int_array([r[1] - r[0] for r in ranges]),
        "h_idx": int_array([r[2] for r in ranges]),
        "h_slice": int_array([r[3] - r[2] for r in ranges]),
    }


def _tensor_attr(group: Group, tensor: str, ranges: Sequence[Range]) -> DictionaryAttr:
    keys = group.buffer_keys(tensor)
    return DictionaryAttr(
        {
            "tensor": StringAttr(tensor),
            "addr": int_array([group.addrs[k] for k in keys]),
            "size": int_attr(group.sizes[keys[0]]),
            **_slices_attr(ranges),
        }
    )


def annotate(module: ModuleOp, graph: Graph, groups: Sequence[Group]) -> None:
    """Write the plan into the module: ``ginfo`` on every op, ``lg.groups`` on the module, state TPU_GROUPED."""
    for group in groups:
        for pos, p in enumerate(group.ops):
            node = graph.ops[p]
            info: dict[str, Attribute] = {
                "group": int_attr(group.id),
                "id": int_attr(pos),
                "kind": StringAttr(group.kind),
            }
            if group.kind == LOCAL:
                keys = group.buffer_keys(node.name)
                info.update(
                    {
                        "out_addr": int_array([group.addrs[k] for k in keys]),
                        "out_size": int_attr(group.sizes[keys[0]]),
                        "buffer_addr": int_attr(group.addrs.get(f"{node.name}#buf", 0)),
                        "buffer_size": int_attr(group.sizes.get(f"{node.name}#buf", 0)),
                        **_slices_attr(group.ranges[node.name]),
                    }
                )
            node.op.attributes["ginfo"] = DictionaryAttr(info)
    entries = []
    for group in groups:
        entry: dict[str, Attribute] = {
            "id": int_attr(group.id),
            "kind": StringAttr(group.kind),
            "ops": ArrayAttr([StringAttr(graph.ops[p].name) for p in group.ops]),
            "n_secs": int_attr(group.n_secs),
            "h_secs": int_attr(group.h_secs),
            "cycles": int_attr(group.cycles),
            "ddr_bytes": int_attr(group.ddr_bytes),
        }
        if group.kind == LOCAL:
            entry.update(
                {
                    "lmem_bytes": int_attr(group.lmem_bytes),
                    "layout": StringAttr(group.layout),
                    "loads": ArrayAttr([_tensor_attr(group, t, group.ranges[t]) for t in group.inputs]),
                    "stores": ArrayAttr([_tensor_attr(group, o, group.own[o]) for o in group.outputs]),
                    "weights": ArrayAttr(
                        [
                            DictionaryAttr(
                                {
                                    "tensor": StringAttr(w),
                                    "addr": int_attr(group.addrs[f"{w}#0"]),
                                    "size": int_attr(group.sizes[f"{w}#0"]),
                                }
                            )
                            for w in group.weights
                        ]
                    ),
                }
            )
        entries.append(DictionaryAttr(entry))
    module.attributes["lg.groups"] = ArrayAttr(entries)
    mlir.set_module_attrs(module, state="TPU_GROUPED")


def layer_group(module: ModuleOp, chip: Chip, *, exact_f32: bool = True) -> tuple[ModuleOp, list[Group]]:
    """Plan tpu.mlir's groups for ``chip`` and annotate the module in place (-> lg.mlir)."""
    mlir.require_state(module, "TPU_LOWERED", "layer group reads a lowered module", hint="run the lower stage first")
    graph = build_graph(module)
    groups = Planner(graph, chip, exact_f32=exact_f32).plan()
    annotate(module, graph, groups)
    return module, groups


# ---- reading lg.mlir back -----------------------------------------------------------------------


def _py(attr: Attribute) -> Any:
    """An lg.groups attribute as plain Python: int, str, list or dict (of those)."""
    if isinstance(attr, IntegerAttr):
        return attr.value.data
    if isinstance(attr, StringAttr):
        return attr.data
    if isinstance(attr, ArrayAttr):
        return [_py(a) for a in attr.data]
    if isinstance(attr, DictionaryAttr):
        return {k: _py(v) for k, v in attr.data.items()}
    raise TpuBuildError(f"unexpected attribute {attr} in lg.groups")


def _ranges(d: dict) -> list[Range]:
    return [
        (n, n + ns, h, h + hs) for n, ns, h, hs in zip(d["n_idx"], d["n_slice"], d["h_idx"], d["h_slice"], strict=True)
    ]


def read_groups(module: ModuleOp, graph: Graph | None = None) -> list[Group]:
    """The groups an lg.mlir (or addr.mlir) records, as ``Group`` objects."""
    graph = graph or build_graph(module)
    attr = module.attributes.get("lg.groups")
    if attr is None:
        raise TpuBuildError("the module has no lg.groups attribute", hint="run the layergroup stage first")
    index = {node.name: node.index for node in graph.ops}
    infos = {node.name: _py(node.op.attributes["ginfo"]) for node in graph.ops if "ginfo" in node.op.attributes}
    groups = []
    for d in _py(attr):
        g = Group(
            d["id"],
            d["kind"],
            [index[name] for name in d["ops"]],
            d["n_secs"],
            d["h_secs"],
            cycles=d["cycles"],
            ddr_bytes=d["ddr_bytes"],
        )
        if g.kind == LOCAL:
            g.copies = 2 if g.slices > 1 else 1
            g.lmem_bytes = d["lmem_bytes"]
            g.layout = d.get("layout", CHANNEL)
            for load in d["loads"]:
                g.inputs.append(load["tensor"])
                g.ranges[load["tensor"]] = _ranges(load)
                for c, a in enumerate(load["addr"]):
                    g.addrs[f"{load['tensor']}#{c}"], g.sizes[f"{load['tensor']}#{c}"] = a, load["size"]
            for store in d["stores"]:
                g.outputs.append(store["tensor"])
                g.own[store["tensor"]] = _ranges(store)
            for w in d["weights"]:
                g.weights.append(w["tensor"])
                g.addrs[f"{w['tensor']}#0"], g.sizes[f"{w['tensor']}#0"] = w["addr"], w["size"]
            for p in g.ops:
                name = graph.ops[p].name
                info = infos[name]
                g.ranges[name] = _ranges(info)
                for c, a in enumerate(info["out_addr"]):
                    g.addrs[f"{name}#{c}"], g.sizes[f"{name}#{c}"] = a, info["out_size"]
                if info["buffer_size"]:
                    g.addrs[f"{name}#buf"], g.sizes[f"{name}#buf"] = info["buffer_addr"], info["buffer_size"]
        else:
            node = graph.ops[g.ops[0]]
            g.inputs = list(dict.fromkeys(graph.data_inputs(node)))
            g.outputs = [o for o in node.outputs if o in graph.tensors]
            g.weights = list(dict.fromkeys(graph.weights_of(node)))
        groups.append(g)
    return groups
