"""What a layer group is: op kinds and layouts, the planned ``Group``, the per-op and per-tensor facts the
search reuses (``OpFacts``, ``TensorFacts``), and the slice arithmetic shared by every part."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tpubuild.build.chips import Chip
from tpubuild.codegen import cost
from tpubuild.codegen.graph import Graph
from tpubuild.codegen.slicing import Rule, align
from tpubuild.ir import tpu

if TYPE_CHECKING:
    from tpubuild.codegen.layergroup.packs import Pack


LOCAL, GLOBAL, ALIAS, COPY = "local", "global", "alias", "copy"
CHANNEL, SPREAD, FOLD = "channel", "spread", "fold"  # a local group's layout (Group.layout)
# the longest run the search tries as one group: longer ones cost search time and cut less DDR traffic; 24 split
# DenseNet's dense blocks and PP-OCR's stages (48: 33 zoo targets 1-23% fewer cycles, the stage up to 2x slower)
MAX_GROUP_OPS = 48
ALIAS_OPS = (tpu.ReshapeOp,)

Range = tuple[int, int, int, int]  # n_lo, n_hi, h_lo, h_hi in the tensor's (n, c, h, w) view


def split(total: int, parts: int, index: int) -> tuple[int, int]:
    return index * total // parts, (index + 1) * total // parts


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
