"""Offset assignment for buffers with lifetimes: local memory inside a group, DDR for activations.

A buffer is alive over an inclusive range of steps; two buffers alive at a
common step must not share a byte. Placement is greedy: buffers in a given
order (largest first by default), each at the lowest aligned offset that is
free for its whole lifetime. Local memory adds banks: a buffer is placed, when
it can be, outside the banks of the buffers it must not conflict with (the
other operands of the ops that use it). The result is checked: an overlap is a
compile error (AllocError), never a result, and so is a buffer past the capacity.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tpubuild.errors import TpuBuildError


@dataclass(frozen=True)
class Buffer:
    key: str
    start: int  # first step alive
    end: int  # last step alive (inclusive)
    size: int

    def meets(self, other: Buffer) -> bool:
        return self.start <= other.end and other.start <= self.end


class AllocError(TpuBuildError):
    """Buffers that do not fit the memory."""


def align_up(x: int, a: int) -> int:
    return -(-x // a) * a


def _lowest_gap(busy: list[tuple[int, int]], size: int, align: int) -> int:
    """Lowest aligned offset of a free run of ``size`` bytes, given busy [lo, hi) ranges sorted by lo."""
    offset = 0
    for lo, hi in busy:
        if offset + size <= lo:
            return offset
        offset = max(offset, align_up(hi, align))
    return offset


def place(
    buffers: Sequence[Buffer],
    *,
    align: int,
    order: Callable[[Buffer], Any] | None = None,
    bank_bytes: int = 0,
    avoid: Mapping[str, Iterable[str]] | None = None,
    capacity: int | None = None,
    what: str = "memory",
) -> dict[str, int]:
    """Offsets for ``buffers`` (key -> offset). ``avoid[key]``: buffers whose banks ``key`` should not share."""
    ordered = sorted(buffers, key=order or (lambda b: (-b.size, b.start, b.key)))
    placed: list[tuple[Buffer, int]] = []
    offsets: dict[str, int] = {}
    for buf in ordered:
        busy = sorted((off, off + b.size) for b, off in placed if b.meets(buf) and b.size)
        offset = _lowest_gap(busy, buf.size, align)
        if bank_bytes and avoid and buf.size:
            offset = _bank_clean(buf, busy, offset, align, bank_bytes, offsets, avoid, placed, capacity)
        offsets[buf.key] = offset
        placed.append((buf, offset))
    check(buffers, offsets, capacity=capacity, what=what)
    return offsets


def _banks(offset: int, size: int, bank_bytes: int) -> range:
    return range(offset // bank_bytes, (offset + max(size, 1) - 1) // bank_bytes + 1)


def _bank_clean(
    buf: Buffer,
    busy: list[tuple[int, int]],
    fallback: int,
    align: int,
    bank_bytes: int,
    offsets: Mapping[str, int],
    avoid: Mapping[str, Iterable[str]],
    placed: list[tuple[Buffer, int]],
    capacity: int | None,
) -> int:
    """The lowest free offset whose banks hold none of ``avoid[buf]`` (already placed); else ``fallback``."""
    sizes = {b.key: b.size for b, _ in placed}
    taken = {bank for k in avoid.get(buf.key, ()) if k in offsets for bank in _banks(offsets[k], sizes[k], bank_bytes)}
    if not taken:
        return fallback
    limit = capacity if capacity is not None else max([hi for _, hi in busy] + [fallback + buf.size])
    candidates = sorted(
        {0, fallback}
        | {align_up(hi, align) for _, hi in busy}
        | {b * bank_bytes for b in range(limit // bank_bytes + 1)}
    )
    for offset in candidates:
        end = offset + buf.size
        if end > limit:
            break
        if any(lo < end and offset < hi for lo, hi in busy):
            continue
        if taken.isdisjoint(_banks(offset, buf.size, bank_bytes)):
            return offset
    return fallback


def check(
    buffers: Sequence[Buffer], offsets: Mapping[str, int], *, capacity: int | None = None, what: str = "memory"
) -> None:
    """Raise AllocError if two buffers alive together overlap or one ends past ``capacity``."""
    by_start = sorted(buffers, key=lambda b: (offsets[b.key], b.key))
    for i, a in enumerate(by_start):
        a_lo = offsets[a.key]
        for b in by_start[i + 1 :]:
            b_lo = offsets[b.key]
            if b_lo >= a_lo + a.size:
                break
            if a.size and b.size and a.meets(b):
                raise AllocError(
                    f"{what}: {a.key} [{a_lo}, {a_lo + a.size}) overlaps {b.key} "
                    f"[{b_lo}, {b_lo + b.size}) while both are alive"
                )
    if capacity is not None:
        over = [b for b in buffers if offsets[b.key] + b.size > capacity]
        if over:
            b = max(over, key=lambda x: offsets[x.key] + x.size)
            raise AllocError(
                f"{what}: {len(over)} buffer(s) do not fit {capacity} bytes; {b.key} ends at {offsets[b.key] + b.size}"
            )


def peak(buffers: Sequence[Buffer], offsets: Mapping[str, int]) -> int:
    return max((offsets[b.key] + b.size for b in buffers), default=0)


def live_bound(buffers: Sequence[Buffer]) -> int:
    """Max over steps of the bytes alive at that step: no placement can use less."""
    events: dict[int, int] = {}
    for b in buffers:
        events[b.start] = events.get(b.start, 0) + b.size
        events[b.end + 1] = events.get(b.end + 1, 0) - b.size
    best = live = 0
    for step in sorted(events):
        live += events[step]
        best = max(best, live)
    return best


def improve(
    buffers: Sequence[Buffer], order: Sequence[Buffer], *, align: int, budget: int = 4_000_000, seed: int = 0
) -> tuple[int, dict[str, int]]:
    """A local search over placement orders from ``order``: swap two buffers, re-place greedily, keep the
    order if its peak is no worse; stops at the live-bytes bound or after about ``budget`` buffer-pair
    checks. Deterministic (seeded)."""
    import random

    rng = random.Random(seed)
    bound = live_bound(buffers)
    current = list(order)
    rank = {b.key: i for i, b in enumerate(current)}
    offsets = place(current, align=align, order=lambda b: rank[b.key])
    best = peak(current, offsets)
    rounds = max(0, budget // max(len(current) ** 2, 1))
    for _ in range(rounds):
        if best <= bound or len(current) < 2:
            break
        i, j = sorted(rng.sample(range(len(current)), 2))
        current[i], current[j] = current[j], current[i]
        rank = {b.key: k for k, b in enumerate(current)}
        trial = place(current, align=align, order=lambda b, rank=rank: rank[b.key])
        value = peak(current, trial)
        if value <= best:
            best, offsets = value, trial
        else:
            current[i], current[j] = current[j], current[i]
    return best, offsets
