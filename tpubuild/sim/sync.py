"""Race check: GDMA and BDC commands that sync does not order must not touch the same bytes.

Waits are counters over in-order queues, so happens-before is simple: GDMA g
(1-based) runs after BDC b iff ``b <= max(wait_bdc of GDMA 1..g)``, and before
BDC b iff ``g <= max(wait_gdma of BDC 1..b)``. For each GDMA the unordered BDC
commands form one contiguous id range, found by bisection, so the check costs
little more than the pairs it inspects. A conflicting pair (a write and any
access to a common byte, in a common lane for local memory) is a sync bug in
the command stream: the result would depend on timing. The simulator refuses
such a stream rather than produce one of its possible results.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

import numpy as np

from tpubuild.codegen import commands as cmd
from tpubuild.codegen.commands import Bdc, Direction, Gdma, Space
from tpubuild.codegen.model_file import ChipParams, ModelFile, ModelFileError
from tpubuild.sim.memory import ddr_extent


@dataclass(frozen=True)
class Access:
    space: Space
    lo: int
    hi: int
    lanes: int  # local: bitmask of lanes; DDR: 0
    write: bool
    what: str
    block: tuple  # DDR: (addr, shape, strides, dtype) for the exact byte check

    def conflicts(self, other: Access) -> bool:
        if self.space != other.space or not (self.write or other.write):
            return False
        if self.lo >= other.hi or other.lo >= self.hi:
            return False
        if self.space == Space.LOCAL:
            return bool(self.lanes & other.lanes)
        return _ddr_bytes_overlap(self.block, other.block)


def _lane_mask(lane_start: int, c: int, lanes: int) -> int:
    if c >= lanes:
        return (1 << lanes) - 1
    mask = 0
    for ch in range(c):
        mask |= 1 << ((lane_start + ch) % lanes)
    return mask


def _local(
    chip: ChipParams, addr: int, lane_start: int, shape, dtype: str, write: bool, what: str, plane: int = 0
) -> Access:
    size = cmd.local_bytes(shape, dtype, lane_start, chip.lanes, chip.eu_bytes, plane)
    return Access(Space.LOCAL, addr, addr + size, _lane_mask(lane_start, shape[1], chip.lanes), write, what, ())


def _ddr(addr: int, shape, strides, dtype: str, write: bool, what: str) -> Access:
    lo, hi = ddr_extent(addr, shape, strides, dtype)
    return Access(Space.DDR, lo, hi, 0, write, what, (addr, tuple(shape), tuple(strides), dtype))


def _ddr_bytes_overlap(a: tuple, b: tuple) -> bool:
    """Whether two strided DDR blocks share a byte (their extents overlap; check the bytes themselves)."""
    sets = []
    for addr, shape, strides, dtype in (a, b):
        size = cmd.itemsize(dtype)
        offs = np.zeros((), np.int64)
        for d, s in zip(shape, strides, strict=True):
            offs = offs[..., None] + np.arange(d, dtype=np.int64) * s
        starts = addr + offs.ravel() * size
        sets.append((starts[:, None] + np.arange(size)).ravel())
    return bool(np.intersect1d(sets[0], sets[1]).size)


def gdma_accesses(chip: ChipParams, g: Gdma) -> list[Access]:
    if g.direction == Direction.DDR2DDR:
        return [
            _ddr(g.ddr_addr, g.shape, g.ddr_strides, g.dtype, False, "source"),
            _ddr(g.dst_addr, g.shape, g.dst_strides, g.dtype, True, "destination"),
        ]
    load = g.direction == Direction.LOAD
    return [
        _ddr(g.ddr_addr, g.shape, g.ddr_strides, g.dtype, not load, "DDR side"),
        _local(chip, g.local_addr, g.lane_start, g.shape, g.dtype, load, "local side", g.local_plane),
    ]


def bdc_accesses(chip: ChipParams, b: Bdc) -> list[Access]:
    out = []
    for j, t in enumerate((*b.operands, *b.results)):
        write = j >= len(b.operands)
        what = f"result {j - len(b.operands)}" if write else f"operand {j}"
        if t.space == Space.LOCAL:
            out.append(_local(chip, t.addr, t.lane_start, t.shape, t.dtype, write, what, t.plane))
        elif t.space == Space.DDR:
            out.append(_ddr(t.addr, t.shape, t.strides, t.dtype, write, what))
    return out


def check_races(model: ModelFile) -> None:
    """ModelFileError naming the first unordered conflicting GDMA/BDC pair, if any."""
    chip = model.header.chip
    g_after = list(itertools.accumulate((g.wait_bdc for g in model.gdma), max, initial=0))[1:]
    b_after = list(itertools.accumulate((b.wait_gdma for b in model.bdc), max, initial=0))[1:]
    bdc_acc: dict[int, list[Access]] = {}
    for gi, g in enumerate(model.gdma):
        gid = gi + 1
        first = g_after[gi]  # BDC ids <= first finished before this GDMA
        # BDC ids whose prefix wait is >= gid start after this GDMA
        last = bisect.bisect_left(b_after, gid)
        if first >= last:
            continue
        g_acc = gdma_accesses(chip, g)
        for bi in range(first, last):
            if bi not in bdc_acc:
                bdc_acc[bi] = bdc_accesses(chip, model.bdc[bi])
            for a in g_acc:
                for b in bdc_acc[bi]:
                    if a.conflicts(b):
                        raise ModelFileError(
                            f"race: GDMA {gid} ({a.what}, {'writes' if a.write else 'reads'} {a.space.name} "
                            f"[{a.lo}, {a.hi})) and BDC {bi + 1} ({model.bdc[bi].op} {b.what}, "
                            f"{'writes' if b.write else 'reads'} [{b.lo}, {b.hi})) are not ordered by any wait",
                            section="gdma",
                            command=gi,
                            hint="the command stream needs a wait between these two commands",
                        )
