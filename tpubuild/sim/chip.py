"""Run a model file on the simulated chip: DDR + local memories, GDMA moves, BDC kernels.

The simulator knows only the model file. BDC commands call the same
reference kernels as TPU inference (tpubuild.kernels) on tiles gathered from
local memory, so a correctly sliced INT8 model reproduces TPU inference's
bits. Commands run whole, in the cycle model's start order, after a race
check has shown that any order the waits allow gives the same result.

``Program`` does everything that does not depend on the inputs once, when
the model is loaded: parameters decoded, races checked, the cycle model
replayed, every command's blocks checked and made numpy views into the
chip's memories. A run then only moves data through the views and calls
the kernels.
"""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from tpubuild.codegen import commands as cmd
from tpubuild.codegen.commands import Bdc, Direction, Gdma, Space
from tpubuild.codegen.model_file import ModelFile, ModelFileError, read_model, tpu_op_class
from tpubuild.errors import TpuBuildError
from tpubuild.ir.types import dtype_from_name
from tpubuild.kernels import get_kernel, halfcast
from tpubuild.sim import cycles
from tpubuild.sim.memory import Memories, Where, channel_view, ddr_extent, gather, scatter
from tpubuild.sim.sync import check_races


@dataclass(frozen=True)
class RunResult:
    outputs: dict[str, np.ndarray]  # graph outputs by name, in their stored types
    profile: dict                   # cycles.profile(): cycles, time, DDR bytes, utilisation


def run_file(path: str | os.PathLike, inputs: Mapping[str, np.ndarray]) -> RunResult:
    model = read_model(path)
    try:
        return simulate(model, inputs)
    except TpuBuildError as err:
        raise err.with_context(file=str(path)) from None


def decoded_params(model: ModelFile) -> list:
    """Each BDC's parameters as its op's PARAMS dataclass (identical texts decoded once)."""
    cache: dict[tuple[str, str], object] = {}
    out = []
    for i, b in enumerate(model.bdc):
        key = (b.op, b.params)
        if key not in cache:
            op_cls = tpu_op_class(b.op)
            if op_cls is None:
                raise ModelFileError(f"unknown op {b.op!r}", section="bdc", command=i)
            try:
                cache[key] = cmd.decode_params(op_cls.PARAMS, b.params)
            except ValueError as e:
                raise ModelFileError(f"{b.op}: {e}", section="bdc", command=i) from None
        out.append(cache[key])
    return out


def simulate(model: ModelFile, inputs: Mapping[str, np.ndarray], *, races: bool = True) -> RunResult:
    """Run the command streams on ``inputs`` (by graph input name); outputs in their stored types."""
    return Program(model, races=races).run(inputs)


class Program:
    """A model file ready to run, any number of times, one run at a time (the memories are its own)."""

    def __init__(self, model: ModelFile, *, races: bool = True):
        header = model.header
        params = decoded_params(model)
        if races:
            check_races(model)
        schedule = cycles.replay(model, params)
        self.profile = cycles.profile(model, params, schedule)
        self.mem = mem = Memories(header.chip, header.ddr_size)
        self.weights = np.frombuffer(model.weights, np.uint8)
        if header.weight_base + self.weights.size > mem.ddr.size:
            raise Where("weights", 0).error(f"[{header.weight_base}, {header.weight_base + self.weights.size}) "
                                            f"is outside DDR [0, {mem.ddr.size})")
        self.weight_base = header.weight_base
        mem.ddr[self.weight_base:self.weight_base + self.weights.size] = self.weights
        self.written = _Written()
        self.inputs = [(t, self._io_view(t, "input", write=True)) for t in header.inputs]
        self.steps = [_gdma_step(mem, i, model.gdma[i], self.written) if engine == "gdma"
                      else _BdcStep(mem, i, model.bdc[i], params[i], self.written)
                      for engine, i in schedule.order()]
        self.outputs = [(t, self._io_view(t, "output")) for t in header.outputs]
        self.ddr_reset, self.local_reset = self.written.ddr.merged(), self.written.local.merged()
        self.fresh = True  # the memories hold zeros and the weights only
        self.lock = threading.Lock()

    def _io_view(self, t, what: str, write: bool = False) -> np.ndarray:
        block = (1, 1, 1, int(np.prod(t.shape, dtype=np.int64)))
        where = Where("header", 0, f"{what} {t.name!r}")
        view = self.mem.ddr_view(t.ddr_addr, block, cmd.contiguous_strides(block), t.dtype, where, write=write)
        if write:
            self.written.ddr.add(*ddr_extent(t.ddr_addr, block, cmd.contiguous_strides(block), t.dtype))
        return view

    def run(self, inputs: Mapping[str, np.ndarray]) -> RunResult:
        """Run the command streams on ``inputs`` (by graph input name); outputs in their stored types."""
        data = [_input(t, inputs) for t, _ in self.inputs]
        with self.lock:
            if not self.fresh:
                self._reset()
            self.fresh = False
            for (t, view), array in zip(self.inputs, data):
                if view.size:
                    view[...] = array.reshape(view.shape)
            for step in self.steps:
                step.run()
            outputs = {t.name: view.copy().reshape(t.shape) for t, view in self.outputs}
        return RunResult(outputs, copy.deepcopy(self.profile))

    def _reset(self) -> None:
        """Back to zeros and the weights wherever an earlier run wrote: each run starts from the same
        memories, as on a freshly loaded chip."""
        ddr, lo_w, hi_w = self.mem.ddr, self.weight_base, self.weight_base + self.weights.size
        for lo, hi in self.ddr_reset:
            ddr[lo:hi] = 0
            if lo < hi_w and lo_w < hi:
                ddr[max(lo, lo_w):min(hi, hi_w)] = self.weights[max(lo, lo_w) - lo_w:min(hi, hi_w) - lo_w]
        for lo, hi in self.local_reset:
            self.mem.local[:, lo:hi] = 0


class _Ranges:
    """Byte ranges, merged on demand."""

    def __init__(self):
        self.spans: list[tuple[int, int]] = []

    def add(self, lo: int, hi: int) -> None:
        if lo < hi:
            self.spans.append((lo, hi))

    def merged(self) -> list[tuple[int, int]]:
        out: list[list[int]] = []
        for lo, hi in sorted(self.spans):
            if out and lo <= out[-1][1]:
                out[-1][1] = max(out[-1][1], hi)
            else:
                out.append([lo, hi])
        return [(lo, hi) for lo, hi in out]


class _Written:
    """What the commands write: DDR byte ranges, and local byte ranges (in every lane, to keep it simple)."""

    def __init__(self):
        self.ddr, self.local = _Ranges(), _Ranges()

    def local_block(self, mem: Memories, addr: int, lane_start: int, shape, dtype: str, plane: int) -> None:
        chip = mem.chip
        self.local.add(addr, addr + cmd.local_bytes(shape, dtype, lane_start, chip.lanes, chip.eu_bytes, plane))


class _Copy:
    """A GDMA command: copies between views (one pair per run of channels of its local side)."""

    def __init__(self, pairs: list[tuple[np.ndarray, np.ndarray]]):
        self.pairs = pairs

    def run(self) -> None:
        for dst, src in self.pairs:
            dst[...] = src


def _gdma_step(mem: Memories, i: int, g: Gdma, written: _Written) -> _Copy:
    where = Where("gdma", i)
    if g.direction == Direction.DDR2DDR:
        src = mem.ddr_view(g.ddr_addr, g.shape, g.ddr_strides, g.dtype, where)
        dst = mem.ddr_view(g.dst_addr, g.shape, g.dst_strides, g.dtype, where, write=True)
        lo, hi = ddr_extent(g.dst_addr, g.shape, g.dst_strides, g.dtype)
        written.ddr.add(lo, hi)
        if 0 in g.shape:
            return _Copy([])
        # numpy copies overlapping blocks as if through a buffer, as the chip's read-then-write does
        return _Copy([(dst, src)])
    load = g.direction == Direction.LOAD
    ddr = mem.ddr_view(g.ddr_addr, g.shape, g.ddr_strides, g.dtype, where, write=not load)
    pieces = mem.local_pieces(g.local_addr, g.lane_start, g.shape, g.dtype, where, g.local_plane)
    if load:
        written.local_block(mem, g.local_addr, g.lane_start, g.shape, g.dtype, g.local_plane)
        return _Copy([(view, channel_view(ddr, c0, c1, view)) for c0, c1, view in pieces])
    written.ddr.add(*ddr_extent(g.ddr_addr, g.shape, g.ddr_strides, g.dtype))
    return _Copy([(channel_view(ddr, c0, c1, view), view) for c0, c1, view in pieces])


class _Block:
    """A BDC operand or result: where it lives (a DDR view or local pieces) and the shape the kernel sees."""

    def __init__(self, mem: Memories, t: cmd.Tensor, where: Where, write: bool, written: _Written):
        self.shape, self.view, self.size = tuple(t.shape), tuple(t.view), t.size()
        self.dtype = dtype_from_name(t.dtype)
        if int(np.prod(self.view, dtype=np.int64)) != self.size:
            raise where.error(f"view {t.view} does not hold the {self.size} elements of block {t.shape}")
        self.ddr = self.pieces = None
        if t.space == Space.DDR:
            self.ddr = mem.ddr_view(t.addr, t.shape, t.strides, t.dtype, where, write=write)
            if write:
                written.ddr.add(*ddr_extent(t.addr, t.shape, t.strides, t.dtype))
        else:
            self.pieces = mem.local_pieces(t.addr, t.lane_start, t.shape, t.dtype, where, t.plane)
            if write:
                written.local_block(mem, t.addr, t.lane_start, t.shape, t.dtype, t.plane)

    def read(self) -> np.ndarray:
        if self.ddr is not None:
            block = self.ddr.copy()
        elif self.pieces:
            block = gather(self.pieces, self.shape, self.dtype)
        else:
            block = np.zeros(self.shape, self.dtype)
        return block.reshape(self.view)

    def write(self, values: np.ndarray) -> None:
        if self.size == 0:
            return
        block = values.reshape(self.shape)
        if self.ddr is not None:
            self.ddr[...] = block
        else:
            scatter(self.pieces, block)


class _BdcStep:
    """A BDC command: its kernel and parameters, its operands' and results' blocks."""

    def __init__(self, mem: Memories, i: int, b: Bdc, params, written: _Written):
        self.index, self.op, self.params = i, b.op, params
        self.kernel = get_kernel(tpu_op_class(b.op))
        self.operands = [None if t.space == Space.NONE else _Block(mem, t, Where("bdc", i, f"operand {j}"), False, written)
                         for j, t in enumerate(b.operands)]
        self.results = [None if t.space == Space.NONE else _Block(mem, t, Where("bdc", i, f"result {j}"), True, written)
                        for j, t in enumerate(b.results)]

    def run(self) -> None:
        args = [None if o is None else o.read() for o in self.operands]
        try:
            result = self.kernel(self.params, *args)
        except Exception as e:  # noqa: BLE001 - parameters and tiles come from the file: any kernel failure is the file's
            raise Where("bdc", self.index).error(f"{self.op} failed on its tiles: {type(e).__name__}: {e}") from None
        results = result if isinstance(result, tuple) else (result,)
        if len(results) != len(self.results):
            raise Where("bdc", self.index).error(f"{self.op} produced {len(results)} results, the command describes "
                                                 f"{len(self.results)}")
        for j, (block, r) in enumerate(zip(self.results, results)):
            if block is None:
                continue  # a result nobody reads
            r = np.asarray(r)
            if r.size != block.size:
                raise Where("bdc", self.index).error(f"{self.op} result {j} has shape {r.shape}, its block "
                                                     f"{block.shape} holds {block.size} elements")
            block.write(halfcast.astype(r, block.dtype))


def _input(t, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
    if t.name not in inputs:
        raise TpuBuildError(f"no data for model input {t.name!r} (inputs given: {sorted(inputs)})",
                            hint="the input npz must hold one array per model input, named as the input")
    array = np.asarray(inputs[t.name])
    if array.shape != t.shape and array.size != int(np.prod(t.shape)):
        raise TpuBuildError(f"input {t.name!r} has shape {array.shape}, the model expects {t.shape}")
    return array.astype(dtype_from_name(t.dtype), copy=False)
