"""The chip's memories: one DDR byte array and per-lane local memory, with checked block access.

Every access names the command doing it; a block reaching outside its memory
raises ModelFileError with the command index and the byte range, before any
byte moves. A block is a numpy view into the memory (a local block: one view
per run of its channels, see ``local_pieces``), so a prepared program checks
each command's blocks once and then moves data through the views. Layouts are
docs/model_format.md's "Memories".
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tpubuild.codegen import commands as cmd
from tpubuild.codegen.model_file import ChipParams, ModelFileError
from tpubuild.ir.types import dtype_from_name


def ddr_extent(addr: int, shape: Sequence[int], strides: Sequence[int], dtype: str) -> tuple[int, int]:
    """[lo, hi) bytes a strided DDR block touches (empty block: (addr, addr))."""
    if 0 in shape:
        return addr, addr
    return addr, addr + (sum((d - 1) * s for d, s in zip(shape, strides, strict=True)) + 1) * cmd.itemsize(dtype)


class Where:
    """The command an access belongs to, for error messages."""

    def __init__(self, engine: str, index: int, what: str = ""):
        self.engine, self.index, self.what = engine, index, what

    def error(self, problem: str) -> ModelFileError:
        prefix = f"{self.what}: " if self.what else ""
        return ModelFileError(
            prefix + problem,
            section=self.engine,
            command=self.index,
            hint="the command stream is inconsistent; rebuild the model",
        )


# A local block's channels as views: (first channel, end channel, view). A view is (n, c', h, w) for
# channels in consecutive lanes of one slot, or (n, slots, lanes, h, w) for whole slots.
Pieces = list[tuple[int, int, np.ndarray]]


def channel_view(block: np.ndarray, c0: int, c1: int, like: np.ndarray) -> np.ndarray:
    """Channels [c0, c1) of an (n, c, h, w) array shaped as the piece ``like`` (a view, never a copy:
    a store writes through it)."""
    part = block[:, c0:c1]
    if like.ndim == 4:
        return part
    n, c, h, w = part.shape
    s = part.strides
    slots, lanes = like.shape[1], like.shape[2]
    return np.lib.stride_tricks.as_strided(
        part, (n, slots, lanes, h, w), (s[0], lanes * s[1], *s[1:]), writeable=part.flags.writeable
    )


def gather(pieces: Pieces, shape, dtype: np.dtype) -> np.ndarray:
    """A local block's elements as a new C-order (n, c, h, w) array."""
    if len(pieces) == 1:
        return pieces[0][2].copy()
    out = np.empty(shape, dtype)
    for c0, c1, view in pieces:
        # channels of a new C-order array: reshape splits them into (slots, lanes) without a copy
        out[:, c0:c1].reshape(view.shape)[...] = view
    return out


def scatter(pieces: Pieces, values: np.ndarray) -> None:
    """Write an (n, c, h, w) array into a local block."""
    for c0, c1, view in pieces:
        view[...] = values[:, c0:c1].reshape(view.shape)  # (as_strided costs more than the copy of a small tile)


class Memories:
    def __init__(self, chip: ChipParams, ddr_size: int):
        self.chip = chip
        self.ddr = np.zeros(ddr_size, np.uint8)
        self.local = np.zeros((chip.lanes, chip.lane_bytes), np.uint8)

    # ---- DDR ----

    def ddr_view(self, addr: int, shape, strides, dtype: str, where: Where, *, write: bool = False) -> np.ndarray:
        """The block as a view into DDR (an empty block: an empty array)."""
        if any(s < 0 for s in strides):
            raise where.error(f"negative DDR stride in {tuple(strides)}")
        lo, hi = ddr_extent(addr, shape, strides, dtype)
        if hi > self.ddr.size:
            raise where.error(f"DDR range [{lo}, {hi}) is outside DDR [0, {self.ddr.size})")
        dt = dtype_from_name(dtype)
        if 0 in shape:
            return np.zeros(shape, dt)
        if write and 0 in strides and any(d > 1 for d, s in zip(shape, strides, strict=True) if s == 0):
            raise where.error(f"a DDR write with stride 0 over a dimension > 1 ({tuple(shape)}, {tuple(strides)})")
        # (a dimension of size 1 never steps: its stride may be anything)
        return np.ndarray(
            tuple(shape),
            dt,
            buffer=self.ddr,
            offset=addr,
            strides=tuple(s * dt.itemsize if d > 1 else 0 for d, s in zip(shape, strides, strict=True)),
        )

    # ---- local memory ----

    def local_pieces(self, addr: int, lane_start: int, shape, dtype: str, where: Where, plane: int = 0) -> Pieces:
        """The block as views into local memory: the channels from ``lane_start`` to the last lane
        (slot 0), the whole slots after them, and the first lanes of a last, partial slot -- the
        ones that exist (none for an empty block)."""
        lanes = self.chip.lanes
        if lane_start >= lanes:
            raise where.error(f"lane_start {lane_start} >= {lanes} lanes")
        n, c, h, w = shape
        if plane and plane < h * w * cmd.itemsize(dtype):
            raise where.error(f"plane stride {plane} is smaller than a {h} x {w} {dtype} plane")
        end = addr + cmd.local_bytes(shape, dtype, lane_start, lanes, self.chip.eu_bytes, plane)
        if end > self.chip.lane_bytes:
            raise where.error(f"local range [{addr}, {end}) is outside a lane's {self.chip.lane_bytes} bytes")
        if 0 in shape:
            return []
        dt = dtype_from_name(dtype)
        plane = plane or cmd.plane_bytes(h, w, dtype, self.chip.eu_bytes)
        row = self.local.strides[0]
        # only the data bytes of each plane are in a view: a view's last plane may end where the next
        # buffer starts
        n_step, hw = cmd.lane_slots(lane_start, c, lanes) * plane, (w * dt.itemsize, dt.itemsize)

        def view(lane: int, slot: int, dims: tuple, strides: tuple) -> np.ndarray:
            return np.ndarray(dims, dt, buffer=self.local, offset=lane * row + addr + slot * plane, strides=strides)

        first = min(c, lanes - lane_start)
        pieces = [(0, first, view(lane_start, 0, (n, first, h, w), (n_step, row, *hw)))]
        full, rest = divmod(c - first, lanes)
        if full:
            pieces.append((first, first + full * lanes, view(0, 1, (n, full, lanes, h, w), (n_step, plane, row, *hw))))
        if rest:
            pieces.append((c - rest, c, view(0, 1 + full, (n, rest, h, w), (n_step, row, *hw))))
        return pieces
