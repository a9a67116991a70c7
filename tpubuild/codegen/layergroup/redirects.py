"""Channel redirects: a Reshape or channel Split whose result a local group reads in another layout, as pieces."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from tpubuild.codegen.graph import Graph
from tpubuild.codegen.layergroup.groups import ALIAS, COPY, GLOBAL, LOCAL, SPREAD, Group
from tpubuild.ir import top, tpu

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
