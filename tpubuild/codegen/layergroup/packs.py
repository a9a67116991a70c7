"""Weight packs: an op's weights that put the same dim on lanes, interleaved in DDR and loaded by one GDMA."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tpubuild.build.chips import Chip
from tpubuild.codegen.graph import Graph
from tpubuild.codegen.layergroup.folds import find_folds
from tpubuild.codegen.layergroup.groups import FOLD, LOCAL, SPREAD, Group
from tpubuild.codegen.slicing import align


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
