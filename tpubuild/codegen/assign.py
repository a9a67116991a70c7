"""Memory assign: DDR addresses for weights and for every tensor that leaves local memory (addr.mlir).

DDR holds, from address 0: the weights, packed in order of first use, each
aligned to the chip's DDR alignment; then the activations. An activation lives
in DDR when it crosses a group boundary (a group's load or store, a global
op's operand or result) or is a graph input or output; tensors inside a group
never get a DDR address. Its lifetime runs over group steps, from the group
that produces it (graph inputs: from the start) to the last group that reads
it (graph outputs: to the end). A Reshape's result shares its input's buffer.
Buffers whose lifetimes do not meet share bytes: each of a few greedy orders
(largest first, longest-lived first, earliest first) places every buffer at
the lowest free aligned offset, the smallest peak wins, and when it is above the
bound a seeded local search over nearby orders (two buffers swapped at a time)
looks for a lower one. The stage reports
that peak next to the lower bound — the most bytes alive at any one step.

addr.mlir is lg.mlir with ``addr`` on every top.Input/top.Weight op and on
every compute op (one DDR address per result, -1 for a result that stays in
local memory) and the module attributes ``addr.weight_bytes``,
``addr.activation_base``, ``addr.activation_bytes``,
``addr.activation_lower_bound``, ``addr.ddr_bytes``; state TPU_ADDRESSED.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xdsl.dialects.builtin import ModuleOp

from tpubuild.build.chips import Chip
from tpubuild.codegen import alloc
from tpubuild.codegen.graph import Graph, build_graph
from tpubuild.codegen.layergroup import ALIAS, FOLD, Group, channel_redirects, packs_of, read_groups
from tpubuild.errors import TpuBuildError
from tpubuild.ir import mlir
from tpubuild.ir.base import TensorOp
from tpubuild.ir.params import int_array, int_attr, read_int, read_ints
from tpubuild.ir.top import InputOp, WeightOp


@dataclass
class Assignment:
    weights: dict[str, int]  # weight -> DDR address
    activations: dict[str, int]  # DDR tensor -> address
    weight_bytes: int
    activation_base: int
    activation_bytes: int  # peak of the activation region
    lower_bound: int  # most bytes alive at one step
    buffers: list[alloc.Buffer]  # activation buffers (one per alias class), offsets relative to the base
    members: dict[str, str]  # tensor -> its buffer's key
    fills: list[int] = field(default_factory=list)  # per fold group (in order): its zero-point slot

    @property
    def ddr_bytes(self) -> int:
        return self.activation_base + self.activation_bytes

    @property
    def ratio(self) -> float:
        return self.activation_bytes / self.lower_bound if self.lower_bound else 1.0


def ddr_lifetimes(graph: Graph, groups: list[Group]) -> dict[str, tuple[int, int]]:
    """Tensor -> (first, last) group step for every activation that lives in DDR. A channel shuffle's
    or Split's results that the producing group's stores write (``layergroup.channel_redirects``) live
    from that group's step: their bytes stay apart from the group's inputs."""
    span: dict[str, list[int]] = {}
    end = len(groups)

    def touch(tensor: str, step: int) -> None:
        s = span.setdefault(tensor, [step, step])
        s[0], s[1] = min(s[0], step), max(s[1], step)

    redirected = channel_redirects(graph, groups)
    for name in graph.inputs:
        touch(name, 0)
    for step, group in enumerate(groups):
        for t in group.inputs:
            touch(t, step)
        for t in group.outputs:
            touch(t, step)
            for piece in redirected.get(t, (0, ()))[1]:
                touch(piece.dest, step)
    for name in graph.outputs:
        touch(name, end)
    return {t: (s[0], s[1]) for t, s in span.items()}


def _alias_roots(graph: Graph, groups: list[Group]) -> dict[str, str]:
    """Tensor -> the tensor whose buffer it shares (a Reshape's result shares its input's)."""
    root: dict[str, str] = {}

    def find(t: str) -> str:
        while root.get(t, t) != t:
            t = root[t]
        return t

    for group in groups:
        if group.kind == ALIAS:
            node = graph.ops[group.ops[0]]
            src = graph.data_inputs(node)[0]
            root[node.name] = find(src)
    return {t: find(t) for t in root}


ORDERS = {
    "size": lambda b: (-b.size, b.start, b.key),
    "lifetime": lambda b: (-(b.end - b.start), -b.size, b.key),
    "start": lambda b: (b.start, -b.size, b.key),
}


def assign(graph: Graph, groups: list[Group], chip: Chip) -> Assignment:
    align = chip.ddr_align
    weights, fills, weight_bytes = _weight_offsets(graph, groups, chip)
    buffers, members = _activation_buffers(graph, groups, align)
    peak, offsets = _place_activations(buffers, align)
    base = alloc.align_up(weight_bytes, align)
    if base + peak > chip.ddr_bytes:
        raise TpuBuildError(
            f"the model needs {base + peak} bytes of DDR ({weight_bytes} of weights, {peak} of "
            f"activations); {chip.name} has {chip.ddr_bytes}",
            hint="use a smaller input shape or batch, or a chip with more DDR",
        )
    activations = {t: base + offsets[r] for t, r in members.items() if r in offsets}
    return Assignment(
        weights, activations, weight_bytes, base, peak, alloc.live_bound(buffers), buffers, members, fills
    )


def _weight_offsets(graph: Graph, groups: list[Group], chip: Chip) -> tuple[dict[str, int], list[int], int]:
    """Each weight's offset in the weight blob (a pack's weights interleaved in its rows), the fold groups'
    fill slots after them, and the blob's size."""
    align = chip.ddr_align
    weights: dict[str, int] = {}
    offset = 0
    packs = packs_of(graph, groups, chip)
    for node in graph.ops:
        for w in graph.weights_of(node):
            if w in weights:
                continue
            pack = packs.get(w)
            if pack is None:
                weights[w] = offset
                offset = alloc.align_up(offset + graph.tensors[w].nbytes, align)
                continue
            # a pack's rows interleave its weights: each weight's address is its offset in row 0
            weights.update({m: offset + at for m, at in zip(pack.weights, pack.offsets, strict=True)})
            offset = alloc.align_up(offset + pack.nbytes, align)
    # a fold group's padding rows broadcast its input's zero point from a slot of its own (codegen)
    fills = []
    for group in groups:
        if group.layout == FOLD:
            fills.append(offset)
            offset += align
    return weights, fills, offset


def _activation_buffers(graph: Graph, groups: list[Group], align: int) -> tuple[list[alloc.Buffer], dict[str, str]]:
    """One DDR buffer per alias root (its members' lifetimes merged, their largest size), and tensor -> root."""
    life = ddr_lifetimes(graph, groups)
    roots = _alias_roots(graph, groups)
    merged: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    members: dict[str, str] = {}
    for t, (a, b) in life.items():
        r = roots.get(t, t)
        members[t] = r
        span = merged.setdefault(r, [a, b])
        span[0], span[1] = min(span[0], a), max(span[1], b)
        sizes[r] = max(sizes.get(r, 0), alloc.align_up(graph.tensors[t].nbytes, align))
    buffers = [alloc.Buffer(r, a, b, sizes[r]) for r, (a, b) in sorted(merged.items())]
    return buffers, members


def _place_activations(buffers: list[alloc.Buffer], align: int) -> tuple[int, dict[str, int]]:
    """The lowest peak of the greedy orders' placements (improved by swaps when above the live bound)."""
    placed = []
    for order in ORDERS.values():
        offsets = alloc.place(buffers, align=align, order=order, what="DDR activations")
        placed.append((alloc.peak(buffers, offsets), offsets, order))
    peak, offsets, order = min(placed, key=lambda p: p[0])  # the first of equal peaks
    if peak > alloc.live_bound(buffers):
        # greedy orders can fragment (a transformer block's q/k/v around its qkv tensors): search
        # nearby orders, swapping two buffers at a time
        improved, trial = alloc.improve(buffers, sorted(buffers, key=order), align=align)
        if improved < peak:
            peak, offsets = improved, trial
    return peak, offsets


def annotate(module: ModuleOp, a: Assignment) -> None:
    for op in mlir.body_ops(module):
        if not isinstance(op, TensorOp):
            continue
        if isinstance(op, WeightOp):
            if op.loc_name in a.weights:
                op.attributes["addr"] = int_attr(a.weights[op.loc_name])
        elif isinstance(op, InputOp):
            op.attributes["addr"] = int_attr(a.activations[op.loc_name])
        elif op.results and "ginfo" in op.attributes:
            op.attributes["addr"] = int_array([a.activations.get(name, -1) for name in op.names])
    for key, value in (
        ("weight_bytes", a.weight_bytes),
        ("activation_base", a.activation_base),
        ("activation_bytes", a.activation_bytes),
        ("activation_lower_bound", a.lower_bound),
        ("ddr_bytes", a.ddr_bytes),
    ):
        module.attributes[f"addr.{key}"] = int_attr(value)
    if a.fills:
        module.attributes["addr.fills"] = int_array(a.fills)
    mlir.set_module_attrs(module, state="TPU_ADDRESSED")


def memory_assign(module: ModuleOp, chip: Chip) -> tuple[ModuleOp, Assignment]:
    """lg.mlir -> addr.mlir (in place), with the assignment."""
    mlir.require_state(
        module, "TPU_GROUPED", "memory assign reads a grouped module", hint="run the layergroup stage first"
    )
    graph = build_graph(module)
    groups = read_groups(module, graph)
    a = assign(graph, groups, chip)
    annotate(module, a)
    return module, a


def read_fills(module: ModuleOp) -> list[int]:
    """Each fold group's zero-point slot (in group order) of an addr.mlir."""
    attr = module.attributes.get("addr.fills")
    return read_ints(attr) if attr is not None else []


def read_assignment(module: ModuleOp) -> tuple[dict[str, int], dict[str, int]]:
    """(weight -> address, DDR tensor -> address) of an addr.mlir."""
    weights: dict[str, int] = {}
    acts: dict[str, int] = {}
    for op in mlir.body_ops(module):
        if not isinstance(op, TensorOp) or "addr" not in op.attributes:
            continue
        attr = op.attributes["addr"]
        if isinstance(op, WeightOp):
            weights[op.loc_name] = read_int(attr)
        elif isinstance(op, InputOp):
            acts[op.loc_name] = read_int(attr)
        else:
            for name, v in zip(op.names, read_ints(attr), strict=True):
                if v >= 0:
                    acts[name] = v
    return weights, acts
