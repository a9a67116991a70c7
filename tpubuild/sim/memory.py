"""The chip's memories: one DDR byte array and per-lane local memory, with checked block access.

Every access names the command doing it; a block reaching outside its memory
raises ModelFileError with the command index and the byte range, before any
byte moves. Layouts are docs/model_format.md's "Memories".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from tpubuild.codegen import commands as cmd
from tpubuild.codegen.model_file import ChipParams, ModelFileError
from tpubuild.ir.types import dtype_from_name


def ddr_extent(addr: int, shape: Sequence[int], strides: Sequence[int], dtype: str) -> tuple[int, int]:
    """[lo, hi) bytes a strided DDR block touches (empty block: (addr, addr))."""
    if 0 in shape:
        return addr, addr
    return addr, addr + (sum((d - 1) * s for d, s in zip(shape, strides)) + 1) * cmd.itemsize(dtype)


class Where:
    """The command an access belongs to, for error messages."""

    def __init__(self, engine: str, index: int, what: str = ""):
        self.engine, self.index, self.what = engine, index, what

    def error(self, problem: str) -> ModelFileError:
        prefix = f"{self.what}: " if self.what else ""
        return ModelFileError(prefix + problem, section=self.engine, command=self.index,
                              hint="the command stream is inconsistent; rebuild the model")


class Memories:
    def __init__(self, chip: ChipParams, ddr_size: int):
        self.chip = chip
        self.ddr = np.zeros(ddr_size, np.uint8)
        self.local = np.zeros((chip.lanes, chip.lane_bytes), np.uint8)

    # ---- DDR ----

    def _ddr_view(self, addr: int, shape, strides, dtype: str, where: Where) -> np.ndarray:
        if any(s < 0 for s in strides):
            raise where.error(f"negative DDR stride in {tuple(strides)}")
        lo, hi = ddr_extent(addr, shape, strides, dtype)
        if hi > self.ddr.size:
            raise where.error(f"DDR range [{lo}, {hi}) is outside DDR [0, {self.ddr.size})")
        dt = dtype_from_name(dtype)
        if 0 in shape:
            return np.zeros(shape, dt)
        # (a dimension of size 1 never steps: its stride may be anything)
        return np.ndarray(tuple(shape), dt, buffer=self.ddr, offset=addr,
                          strides=tuple(s * dt.itemsize if d > 1 else 0 for d, s in zip(shape, strides)))

    def read_ddr(self, addr: int, shape, strides, dtype: str, where: Where) -> np.ndarray:
        return self._ddr_view(addr, shape, strides, dtype, where).copy()

    def write_ddr(self, addr: int, shape, strides, dtype: str, values: np.ndarray, where: Where) -> None:
        view = self._ddr_view(addr, shape, strides, dtype, where)
        if 0 in shape:
            return
        if 0 in strides and any(d > 1 for d, s in zip(shape, strides) if s == 0):
            raise where.error(f"a DDR write with stride 0 over a dimension > 1 ({tuple(shape)}, {tuple(strides)})")
        view[...] = values

    # ---- local memory ----

    def _local_region(self, addr: int, lane_start: int, shape, dtype: str, where: Where, plane: int = 0):
        lanes = self.chip.lanes
        if lane_start >= lanes:
            raise where.error(f"lane_start {lane_start} >= {lanes} lanes")
        n, c, h, w = shape
        slots = cmd.lane_slots(lane_start, c, lanes)
        if plane and plane < h * w * cmd.itemsize(dtype):
            raise where.error(f"plane stride {plane} is smaller than a {h} x {w} {dtype} plane")
        end = addr + cmd.local_bytes(shape, dtype, lane_start, lanes, self.chip.eu_bytes, plane)
        if end > self.chip.lane_bytes:
            raise where.error(f"local range [{addr}, {end}) is outside a lane's {self.chip.lane_bytes} bytes")
        plane = plane or cmd.plane_bytes(h, w, dtype, self.chip.eu_bytes)
        nbytes = h * w * cmd.itemsize(dtype)
        # (lane, n, slot, byte) over the data bytes of every plane: a view's last plane may end where
        # the next buffer starts, so never reshape whole planes
        lane_stride = self.local.strides[0]
        region = np.lib.stride_tricks.as_strided(self.local[:, addr:], (lanes, n, slots, nbytes),
                                                 (lane_stride, slots * plane, plane, 1), writeable=True)
        chans = lane_start + np.arange(c)
        return region, chans % lanes, chans // lanes, nbytes

    def read_local(self, addr: int, lane_start: int, shape, dtype: str, where: Where, plane: int = 0) -> np.ndarray:
        n, c, h, w = shape
        dt = dtype_from_name(dtype)
        if 0 in shape:
            return np.zeros(shape, dt)
        region, lane_idx, slot_idx, nbytes = self._local_region(addr, lane_start, shape, dtype, where, plane)
        raw = region[lane_idx, :, slot_idx, :nbytes]  # (c, n, bytes)
        return np.ascontiguousarray(raw.transpose(1, 0, 2)).view(dt).reshape(n, c, h, w)

    def write_local(self, addr: int, lane_start: int, shape, dtype: str, values: np.ndarray, where: Where,
                    plane: int = 0) -> None:
        n, c, h, w = shape
        if 0 in shape:
            return
        region, lane_idx, slot_idx, nbytes = self._local_region(addr, lane_start, shape, dtype, where, plane)
        data = np.ascontiguousarray(values, dtype_from_name(dtype)).reshape(n, c, h * w)
        region[lane_idx, :, slot_idx, :nbytes] = data.view(np.uint8).reshape(n, c, nbytes).transpose(1, 0, 2)

    # ---- Bdc tensor descriptors ----

    def read_tensor(self, t: cmd.Tensor, where: Where) -> np.ndarray | None:
        if t.space == cmd.Space.NONE:
            return None
        if t.space == cmd.Space.DDR:
            block = self.read_ddr(t.addr, t.shape, t.strides, t.dtype, where)
        else:
            block = self.read_local(t.addr, t.lane_start, t.shape, t.dtype, where, t.plane)
        if math.prod(t.view) != block.size:
            raise where.error(f"view {t.view} does not hold the {block.size} elements of block {t.shape}")
        return block.reshape(t.view)

    def write_tensor(self, t: cmd.Tensor, values: np.ndarray, where: Where) -> None:
        if t.space == cmd.Space.NONE:
            return  # a result nobody reads
        block = values.reshape(t.shape)
        if t.space == cmd.Space.DDR:
            self.write_ddr(t.addr, t.shape, t.strides, t.dtype, block, where)
        else:
            self.write_local(t.addr, t.lane_start, t.shape, t.dtype, block, where, t.plane)
