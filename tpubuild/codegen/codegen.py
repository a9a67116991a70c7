"""Codegen: addr.mlir + weights -> the .model file's command streams (commands.py, model_file.py).

Every group becomes commands in the two queues:

- a local group: its steps in ``layergroup.schedule``'s order -- slice 0's
  input tiles, the weights op by op (later ops' weights load while earlier ops
  compute), then per slice the input tiles loaded, one BDC per op on local
  tiles (a windowed op's H pads trimmed to the slice), the output rows stored;
  software-pipelined with two buffers for inputs and outputs, so slice t+1
  loads and slice t-1 stores while slice t computes. Each step's wait becomes
  the id of the last command of the step it waits for;
- a global op: one BDC reading and writing DDR directly; a Permute that is a
  strided copy over at most 4 merged dims: one DDR-to-DDR GDMA;
- a Reshape: nothing (its result shares its input's DDR buffer).

Groups run one after another: a group's first transfer waits for the previous
group's last compute (local memory is reused), a global op waits for every
transfer before it. A tile is described by its (n, c, h, w) block and the
kernel-facing view of the same elements; a reader (or a store) needing fewer
rows than the tile holds gets a view: an address offset into the tile with the
tile's plane stride.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
from xdsl.dialects.builtin import ModuleOp, TensorType

from tpubuild.build.chips import Chip
from tpubuild.codegen import commands as cmd
from tpubuild.codegen import cost
from tpubuild.codegen.assign import read_assignment, read_fills
from tpubuild.codegen.commands import Bdc, Direction, Gdma, Tensor
from tpubuild.codegen.cost import nchw
from tpubuild.codegen.graph import Graph, build_graph
from tpubuild.codegen.layergroup import (
    ALIAS,
    COPY,
    FOLD,
    GLOBAL,
    LOCAL,
    START,
    Group,
    Piece,
    Planner,
    Range,
    as_copy,
    channel_redirects,
    logical_shape,
    packs_of,
    read_groups,
    schedule,
    weight_block,
)
from tpubuild.codegen.model_file import ChipParams, Header, IoTensor, ModelFile
from tpubuild.errors import TpuBuildError
from tpubuild.ir import mlir
from tpubuild.ir.params import read_int
from tpubuild.ir.quant import UniformType
from tpubuild.ir.weights import WeightStore


def _dtype(graph: Graph, t: str) -> str:
    return graph.tensors[t].dtype.name


def _strides4(shape4) -> tuple[int, int, int, int]:
    return cmd.shape4(cmd.contiguous_strides(shape4))


def _extent(r: Range) -> tuple[int, int]:
    """(n, h) rows of a range."""
    return r[1] - r[0], r[3] - r[2]


class Emitter:
    def __init__(
        self,
        graph: Graph,
        groups: list[Group],
        chip: Chip,
        weight_addr: Mapping[str, int],
        act_addr: Mapping[str, int],
        *,
        prefetch: bool = True,
        scalars: Mapping[str, int] | None = None,
    ):
        self.g, self.groups, self.chip = graph, groups, chip
        self.prefetching = prefetch
        self.scalars = scalars or {}  # scalar integer weights (a Gather's index) by name
        # the ops' true slice geometry (windows and all): lg.mlir's ranges say how they were sliced
        self.planner = Planner(graph, chip, exact_f32=False)
        self.channel = self.planner  # the ops in their channel layout (``layout`` may switch self.g/planner)
        self.w_addr, self.a_addr = weight_addr, act_addr
        self.fills: dict[str, int] = {}  # folded input -> DDR address of its zero point (memory assign's fill slots)
        self.gdma: list[Gdma] = []
        self.bdc: list[Bdc] = []
        self.early: dict[int, dict[int, tuple[set[str], int]]] = {}  # group id -> its transfers emitted early
        self.packs = packs_of(graph, groups, chip)  # weight -> the pack its op loads it in
        self.redirected = self._redirects()  # output -> (its reader not emitted, where its channels go)
        self.stored: Group | None = None  # the last local group emitted (its last store may still be running)

    # ---- queues ----

    def _gdma(
        self,
        direction: Direction,
        t: str,
        ddr_addr: int,
        local_addr: int,
        block,
        wait_bdc: int,
        strides=None,
        plane: int = 0,
    ) -> int:
        g = Gdma(
            len(self.gdma) + 1,
            wait_bdc,
            direction,
            _dtype(self.g, t),
            ddr_addr,
            tuple(strides) if strides is not None else _strides4(block),
            local_addr,
            0,
            tuple(block),
            dst_strides=(plane, 0, 0, 0),
        )
        self.gdma.append(g)
        return g.id

    def _bdc(self, node, params, operands, results, wait_gdma: int) -> int:
        b = Bdc.make(len(self.bdc) + 1, wait_gdma, node.kind, params, operands, results)
        self.bdc.append(b)
        return b.id

    @contextlib.contextmanager
    def layout(self, group: Group) -> Iterator[None]:
        """Emit ``group`` in its layout: a spread or fold group's tensors take that layout's graph's
        shapes, so every tile, view and DDR block below is of those (n, c, h, w)."""
        saved = self.g, self.planner
        self.planner = self.channel.layout(group)
        self.g = self.planner.g
        try:
            yield
        finally:
            self.g, self.planner = saved

    # ---- DDR blocks ----

    def ddr_tensor(self, t: str, graph: Graph | None = None) -> Tensor:
        """A whole DDR tensor, its kernel view the shape ``graph`` (default: self.g) gives it."""
        tensor = self.g.tensors[t]
        addr = self.w_addr[t] if tensor.weight else self.a_addr[t]
        block = (1, 1, 1, max(math.prod(tensor.shape), 1) if tensor.shape else 1)
        return Tensor.ddr(addr, block, _dtype(self.g, t), view=(graph or self.g).tensors[t].shape)

    def ddr_rows(self, t: str, r: Range) -> tuple[int, tuple, tuple]:
        """(address, block, strides) of rows ``r`` of DDR tensor t."""
        n, c, h, w = nchw(self.g.tensors[t].shape)
        es = self.g.tensors[t].dtype.itemsize
        addr = self.a_addr[t] + (r[0] * c * h * w + r[2] * w) * es
        return addr, (r[1] - r[0], c, r[3] - r[2], w), (c * h * w, h * w, w, 1)

    # ---- emission ----

    def _redirects(self) -> dict[str, tuple[int, list[Piece]]]:
        """``layergroup.channel_redirects`` whose results are in DDR: the group's stores write them
        (memory assign kept their bytes apart from the group's inputs: they live from its step), or,
        for an addr.mlir assigned otherwise, those whose bytes are apart anyway or whose group has one
        slice (its loads all precede its store in the queue). -> output -> (reader, its pieces)."""
        g = self.g
        found: dict[str, tuple[int, list[Piece]]] = {}
        by_output = {o: group for group in self.groups for o in group.outputs}
        for o, (reader, pieces) in channel_redirects(g, self.groups).items():
            group = by_output[o]
            pieces = [piece for piece in pieces if piece.dest in self.a_addr]
            if group.slices == 1 or all(
                self.a_addr[i] + g.tensors[i].nbytes <= self.a_addr[pc.dest]
                or self.a_addr[pc.dest] + g.tensors[pc.dest].nbytes <= self.a_addr[i]
                for i in group.inputs
                for pc in pieces
            ):
                found[o] = (reader, pieces)
        return found

    def run(self) -> None:
        skipped = {reader for reader, _ in self.redirected.values()}
        order = [group for group in self.groups if group.kind != ALIAS and group.ops[0] not in skipped]
        for k, group in enumerate(order):
            if group.kind == COPY:
                self.copy_op(group)
            elif group.kind == GLOBAL:
                self.global_op(group)
            else:
                # the next local group, past global ops and copies (they use no local memory)
                between = []
                for later in order[k + 1 :]:
                    if later.kind == LOCAL:
                        self.local_group(group, later if self.prefetching else None, between)
                        break
                    between.append(later)
                else:
                    self.local_group(group)

    def global_op(self, group: Group) -> None:
        """One BDC on DDR tensors; a layout-free op's kernel sees them in their lane-spread shapes (the
        cycle model spreads its work over the lanes those use)."""
        node = self.g.ops[group.ops[0]]
        spread = self.channel.spread
        views = spread.g if spread is not None and node.index in self.channel.free else self.g
        operands = [Tensor.none() if t is None else self.ddr_tensor(t, views) for t in node.inputs]
        results = [self.ddr_tensor(o, views) for o in node.outputs]
        self._bdc(node, node.op.params, operands, results, wait_gdma=len(self.gdma))

    def copy_op(self, group: Group) -> None:
        """A layout op as one DDR-to-DDR strided GDMA (after every compute before it): ``as_copy``."""
        node = self.g.ops[group.ops[0]]
        copy = as_copy(self.g, node, self.scalars)
        assert copy is not None, "a copy group's op is a copy (as_copy, when it was planned)"
        block, strides, offset = copy
        src, dst = node.input(0), node.name
        g = Gdma(
            len(self.gdma) + 1,
            len(self.bdc),
            Direction.DDR2DDR,
            _dtype(self.g, dst),
            self.a_addr[src] + offset * self.g.tensors[src].dtype.itemsize,
            strides,
            0,
            0,
            block,
            self.a_addr[dst],
            _strides4(block),
        )
        self.gdma.append(g)

    def local_group(self, group: Group, nxt: Group | None = None, between: Sequence[Group] = ()) -> None:
        """The group's steps in ``layergroup.schedule``'s order, each step's wait mapped to command ids;
        before its last store, the transfers of ``nxt`` (the next local group, after the global ops and
        copies ``between``) that may run early."""
        with self.layout(group):
            self._local_group(group, nxt, between)

    def _local_group(self, group: Group, nxt: Group | None, between: Sequence[Group]) -> None:
        self.planner.check(group)  # lg.mlir is a file: never emit commands from an overlapping plan
        prev_bdc = len(self.bdc)  # local memory is reused: the group starts after the previous computes
        # the previous local group's last store reads its output tiles; when this group's loads went
        # early, its first compute waits for them only, so if it may write those bytes it waits for
        # every transfer before this group too (without early loads its own loads come after the store)
        floor = len(self.gdma) if self._overlaps_stored(group) else 0
        self.stored = group
        early = self.early.pop(group.id, {})
        loads = group.weight_loads(self.g, self.packs)
        steps = schedule(len(group.ops), group.slices, group.copies, [bool(w) for w in loads])
        last_id: list[int] = []  # per step: the id of its last command in its queue
        for index, step in enumerate(steps):
            if nxt is not None and index == len(steps) - 1:
                self.early[nxt.id] = self.prefetch(nxt, group, prev_bdc, between)
            wait = prev_bdc if step.wait == START else max((last_id[i] for i in step.after), default=0)
            done, last = early.get(index, ((), 0))
            if step.queue == "gdma":
                late = [t for t in self.transfers(group, step, loads) if t not in done]
                for t in late:
                    self.transfer(group, step, t, wait)
                if late or not done:
                    last = len(self.gdma)
            else:
                self.local_op(group, group.ops[step.op], step.slice, max(wait, floor))
                floor = 0  # later computes follow this one in the queue
                last = len(self.bdc)
            last_id.append(last)

    def _overlaps_stored(self, group: Group) -> bool:
        """Does a local buffer of ``group`` overlap an output tile of the local group emitted before it?"""
        prev = self.stored
        if prev is None:
            return False
        tiles = [(prev.addrs[k], prev.addrs[k] + prev.sizes[k]) for o in prev.outputs for k in prev.buffer_keys(o)]
        return any(not (a + group.sizes[k] <= lo or hi <= a) for k, a in group.addrs.items() for lo, hi in tiles)

    @staticmethod
    def transfers(group: Group, step, loads: list[list[str]]) -> list[str]:
        """The tensors a GDMA step moves, one command each."""
        return {"load": group.inputs, "weights": loads[step.op] if step.op >= 0 else [], "store": group.outputs}[
            step.kind
        ]

    def transfer(self, group: Group, step, t: str, wait: int) -> None:
        s = step.slice
        if step.kind == "load" and t in self.planner.folded:
            self.folded_load(group, t, s, wait)
        elif step.kind == "load":
            addr, block, strides = self.ddr_rows(t, group.ranges[t][s])
            self._gdma(Direction.LOAD, t, addr, group.addrs[f"{t}#{s % group.copies}"], block, wait, strides)
        elif step.kind == "weights" and t in self.packs:  # the whole pack: its rows as bytes
            pack = self.packs[t]
            block = (1, pack.channels, 1, pack.row)
            self.gdma.append(
                Gdma(
                    len(self.gdma) + 1,
                    wait,
                    Direction.LOAD,
                    "uint8",
                    self.w_addr[t],
                    _strides4(block),
                    group.addrs[f"{t}#0"],
                    0,
                    block,
                )
            )
        elif step.kind == "weights":
            block = weight_block(self.g.tensors[t].shape)
            self._gdma(Direction.LOAD, t, self.w_addr[t], group.addrs[f"{t}#0"], block, wait)
        elif t in self.redirected:
            self.redirected_store(group, t, s, wait)
        else:
            addr, block, strides = self.ddr_rows(t, group.own[t][s])
            local, _, plane = self.view(group, t, s % group.copies, group.ranges[t][s], group.own[t][s])
            self._gdma(Direction.STORE, t, addr, local, block, wait, strides, plane)

    def folded_load(self, group: Group, t: str, s: int, wait: int) -> None:
        """Rows of a folded input X' (``layergroup.Fold``): per kernel row dy, X's rows r * sh + dy * dh - pt
        (one strided block into lanes dy * ic...), and the padding rows as a broadcast of the zero point."""
        fold = self.planner.folded[t]
        r = group.ranges[t][s]
        dtype = _dtype(self.g, t)
        es = self.g.tensors[t].dtype.itemsize
        base = group.addrs[f"{t}#{s % group.copies}"]
        plane = cmd.plane_bytes(r[3] - r[2], fold.w, dtype, self.chip.eu_bytes)
        image = fold.ic * fold.h * fold.w
        for dy, first, rows, source in fold.pieces(r[2], r[3]):
            block = (r[1] - r[0], fold.ic, rows, fold.w)
            if source is None:
                addr, strides = self.fills[t], (0, 0, 0, 0)
            else:
                addr = self.a_addr[t] + (r[0] * image + source * fold.w) * es
                strides = (image, fold.h * fold.w, fold.sh * fold.w, 1)
            self.gdma.append(
                Gdma(
                    len(self.gdma) + 1,
                    wait,
                    Direction.LOAD,
                    dtype,
                    addr,
                    strides,
                    base + (first - r[2]) * fold.w * es,
                    dy * fold.ic,
                    block,
                    dst_strides=(plane, 0, 0, 0),
                )
            )

    def redirected_store(self, group: Group, t: str, s: int, wait: int) -> None:
        """Rows of t's tile to its reader's results: per piece, channels [first, first + count) of the
        tile (a view from lane first % lanes, slot first // lanes) to channels at, at + stride, ... of
        the piece's tensor."""
        _, pieces = self.redirected[t]
        _, _, h, w = nchw(self.g.tensors[t].shape)
        es = self.g.tensors[t].dtype.itemsize
        have, own = group.ranges[t][s], group.own[t][s]
        local, _, plane = self.view(group, t, s % group.copies, have, own)
        plane = plane or cmd.plane_bytes(have[3] - have[2], w, self.g.tensors[t].dtype.name, self.chip.eu_bytes)
        for pc in pieces:
            channels = nchw(self.g.tensors[pc.dest].shape)[1]
            g = Gdma(
                len(self.gdma) + 1,
                wait,
                Direction.STORE,
                _dtype(self.g, t),
                self.a_addr[pc.dest] + (pc.at * h * w + own[2] * w) * es,
                (channels * h * w, pc.stride * h * w, w, 1),
                local + pc.first // self.chip.lanes * plane,
                pc.first % self.chip.lanes,
                (1, pc.count, own[3] - own[2], w),
                dst_strides=(plane, 0, 0, 0),
            )
            self.gdma.append(g)

    def prefetch(
        self, nxt: Group, cur: Group, prev_bdc: int, between: Sequence[Group]
    ) -> dict[int, tuple[set[str], int]]:
        """Emit now, while ``cur``'s last slice (and the global ops ``between``) compute, the transfers
        of ``nxt`` that need nothing of them: its weights and its first input tiles whose local bytes no
        buffer of ``cur`` uses and whose DDR bytes neither cur's last store (rows its earlier slices
        stored are there) nor a group between writes. They wait for the computes before ``cur`` (every
        earlier group is done with local memory then). -> per step of nxt: (tensors moved, last id)."""
        local = [(cur.addrs[k], cur.addrs[k] + cur.sizes[k]) for k in cur.addrs if cur.sizes[k]]
        last = cur.slices - 1  # cur's earlier slices are stored before the prefetch in the queue
        later = [(self.a_addr[o], self.a_addr[o] + self.g.tensors[o].nbytes) for b in between for o in b.outputs]
        # a redirected store writes rows of every piece's tensor: all of each counts
        later += [
            (self.a_addr[pc.dest], self.a_addr[pc.dest] + self.g.tensors[pc.dest].nbytes)
            for o in cur.outputs
            if o in self.redirected
            for pc in self.redirected[o][1]
        ]

        def apart(lo: int, hi: int, used) -> bool:
            return all(hi <= a or b <= lo for a, b in used)

        def unwritten(t: str) -> bool:
            """Are the DDR bytes nxt's first tile of t reads apart from those written after now?"""
            lo = self.a_addr[t]
            if not apart(lo, lo + self.g.tensors[t].nbytes, later):
                return False
            for o in cur.outputs:
                if apart(
                    lo, lo + self.g.tensors[t].nbytes, [(self.a_addr[o], self.a_addr[o] + self.g.tensors[o].nbytes)]
                ):
                    continue
                r, w = nxt.ranges[t][0], cur.own[o][last]
                # rows compare only in one layout: a spread group's rows are not the channel layout's
                if (
                    t != o
                    or cur.layout != nxt.layout
                    or not (r[1] <= w[0] or w[1] <= r[0] or r[3] <= w[2] or w[3] <= r[2])
                ):
                    return False
            return True

        # what hides behind cur's last slice: past nxt's first op's operands, an early transfer that
        # does not fit there would only delay cur's last store and what waits for it
        cur_steps, cur_cycles = self.channel.layout(cur).timed_steps(cur)
        budget = sum(
            d for step, d in zip(cur_steps, cur_cycles, strict=True) if step.queue == "bdc" and step.slice == last
        )
        budget += sum(self.channel.ops[b.ops[0]].global_cycles for b in between if b.kind == GLOBAL)
        with self.layout(nxt):
            return self._prefetch(nxt, prev_bdc, budget, local, unwritten)

    def _prefetch(self, nxt: Group, prev_bdc: int, budget: int, local, unwritten) -> dict[int, tuple[set[str], int]]:
        """``prefetch``'s transfers of nxt, in nxt's layout."""

        def apart(lo: int, hi: int, used) -> bool:
            return all(hi <= a or b <= lo for a, b in used)

        loads = nxt.weight_loads(self.g, self.packs)
        steps = schedule(len(nxt.ops), nxt.slices, nxt.copies, [bool(w) for w in loads])
        early: dict[int, tuple[set[str], int]] = {}
        for index, step in enumerate(steps):
            if step.kind not in ("load", "weights") or step.slice != 0:
                continue
            moved: set[str] = set()
            for t in self.transfers(nxt, step, loads):
                key = f"{t}#0"
                if not apart(nxt.addrs[key], nxt.addrs[key] + nxt.sizes[key], local):
                    continue
                if step.kind == "load" and not unwritten(t):
                    continue
                nbytes = (
                    self.planner.weight_nbytes(t)
                    if step.kind == "weights"
                    else self.planner.t[t].ddr_bytes(*_extent(nxt.ranges[t][0]))
                )
                spend = cost.gdma_cycles(self.chip, nbytes)
                if step.op > 0 and spend > budget:
                    continue
                budget -= spend
                self.transfer(nxt, step, t, prev_bdc)
                moved.add(t)
            if moved:
                early[index] = (moved, len(self.gdma))
        return early

    def view(self, group: Group, t: str, copy: int, have: Range, need: Range) -> tuple[int, tuple, int]:
        """(address, block, plane) of rows ``need`` of t's tile holding rows ``have``: the tile's own
        block, or a view at an offset into it with the tile's plane stride."""
        f = self.planner.t[t]
        n, c, h, w = f.shape4
        addr = group.addrs[f"{t}#{copy}"]
        block = (need[1] - need[0], c, need[3] - need[2], w)
        if need == have:
            return addr, block, 0
        if not (have[0] <= need[0] and need[1] <= have[1] and have[2] <= need[2] and need[3] <= have[3]):
            raise TpuBuildError(
                f"rows {need} of {t!r} are not inside its tile {have}",
                hint="a layer-group bug: please report it with the model",
            )
        plane = cmd.plane_bytes(have[3] - have[2], w, f"{self.g.tensors[t].dtype.name}", self.chip.eu_bytes)
        slots = cmd.lane_slots(0, c, self.chip.lanes)
        addr += (need[0] - have[0]) * slots * plane + (need[2] - have[2]) * w * f.esize
        return addr, block, plane

    def local_op(self, group: Group, p: int, s: int, wait_gdma: int) -> None:
        g = self.g
        node = g.ops[p]
        params, tiles = self.planner.op_tiles(group, p, s)
        operands = []
        for tile in tiles:
            if tile is None:
                operands.append(Tensor.none())
            elif tile[1] is None and tile[0] in self.packs:  # a weight, a view of its pack's rows
                pack, tensor = self.packs[tile[0]], g.tensors[tile[0]]
                at = pack.offsets[pack.weights.index(tile[0])]
                operands.append(
                    Tensor.local(
                        group.addrs[f"{pack.key}#0"] + at,
                        0,
                        weight_block(tensor.shape),
                        tensor.dtype.name,
                        view=tensor.shape,
                        plane=cmd.align_up(pack.row, self.chip.eu_bytes),
                    )
                )
            elif tile[1] is None:  # a weight, whole
                tensor = g.tensors[tile[0]]
                operands.append(
                    Tensor.local(
                        group.addrs[f"{tile[0]}#0"], 0, weight_block(tensor.shape), tensor.dtype.name, view=tensor.shape
                    )
                )
            else:
                t, need = tile
                copy = s % group.copies if t in group.inputs or t in group.outputs else 0
                addr, block, plane = self.view(group, t, copy, group.ranges[t][s], need)
                operands.append(
                    Tensor.local(
                        addr, 0, block, _dtype(g, t), view=logical_shape(g.tensors[t].shape, need), plane=plane
                    )
                )
        out_r = group.ranges[node.name][s]
        out4 = self.planner.t[node.name].shape4
        copy = s % group.copies if node.name in group.outputs else 0
        block = (out_r[1] - out_r[0], out4[1], out_r[3] - out_r[2], out4[3])
        result = Tensor.local(
            group.addrs[f"{node.name}#{copy}"],
            0,
            block,
            _dtype(g, node.name),
            view=logical_shape(g.tensors[node.name].shape, out_r),
        )
        self._bdc(node, params, operands, [result], wait_gdma)


def _io(module: ModuleOp, graph: Graph, name: str, addr: int, source: str = "") -> IoTensor:
    t = graph.tensors[name]
    scale, zp = 1.0, 0
    ttype = _types(module).get(name)
    if ttype is not None and isinstance(ttype.element_type, UniformType) and ttype.element_type.quant_axis < 0:
        scale, zp = float(ttype.element_type.scale_list[0]), int(ttype.element_type.zero_point_list[0])
    return IoTensor(name, tuple(t.shape), t.dtype.name, addr, scale, zp, source)


def _types(module: ModuleOp) -> dict[str, TensorType]:
    from tpubuild.lower.inference import tensor_types

    return tensor_types(module)


def codegen(module: ModuleOp, weights: WeightStore, chip: Chip, *, prefetch: bool = True) -> ModelFile:
    """An addressed module (addr.mlir) and its weights -> the model file's contents. ``prefetch`` off:
    every group starts after the previous one's last compute (its cycles are then layer group's estimate)."""
    mlir.require_state(module, "TPU_ADDRESSED", "codegen reads an addressed module", hint="run the assign stage first")
    graph = build_graph(module)
    groups = read_groups(module, graph)
    w_addr, a_addr = read_assignment(module)
    # a folded conv's filter is stored as the folded conv reads it (W'), and its input's zero point in
    # its fill slot (the padding rows of X' broadcast it)
    scalars = {
        name: int(np.asarray(weights[name]).reshape(()))
        for name, t in graph.tensors.items()
        if t.weight and t.shape == () and t.dtype.kind in "iu" and name in w_addr
    }
    emitter = Emitter(graph, groups, chip, w_addr, a_addr, prefetch=prefetch, scalars=scalars)
    blob = bytearray(read_int(module.attributes["addr.weight_bytes"]))
    folded_weights = {}
    for group, addr in zip([g for g in groups if g.layout == FOLD], read_fills(module), strict=True):
        f = emitter.channel.folds.get(group.ops[0])
        if f is None:
            continue
        folded_weights[f.weight] = f
        emitter.fills[f.input] = addr
        value = np.asarray([f.zp], dtype=graph.tensors[f.input].dtype).tobytes()
        blob[addr : addr + len(value)] = value
    for name, pack in emitter.packs.items():
        if name == pack.key:
            data = pack.data([np.asarray(weights[w]).astype(graph.tensors[w].dtype, copy=False) for w in pack.weights])
            blob[w_addr[name] : w_addr[name] + len(data)] = data
    for name, addr in w_addr.items():
        if name in emitter.packs:
            continue
        t = graph.tensors[name]
        array = np.asarray(weights[name])
        if name in folded_weights:
            array = folded_weights[name].weight_data(array)
        data = np.ascontiguousarray(array.astype(t.dtype, copy=False)).tobytes()
        if len(data) != t.nbytes:
            raise TpuBuildError(
                f"weight {name!r} holds {len(data)} bytes, its type says {t.nbytes}",
                hint="the weight file does not belong to this module; rebuild it",
            )
        blob[addr : addr + len(data)] = data
    emitter.run()
    from tpubuild.lower.inference import source_output_names

    sources = source_output_names(module)
    header = Header(
        model=mlir.module_attr(module, "name", "") or "",
        chip=ChipParams.from_chip(chip),
        ddr_size=read_int(module.attributes["addr.ddr_bytes"]),
        weight_base=0,
        inputs=tuple(_io(module, graph, n, a_addr[n]) for n in graph.inputs),
        outputs=tuple(_io(module, graph, n, a_addr[n], sources.get(n, "")) for n in graph.outputs),
        mode=mlir.module_attr(module, "mode", "") or "",
    )
    return ModelFile(header, bytes(blob), tuple(emitter.gdma), tuple(emitter.bdc))
