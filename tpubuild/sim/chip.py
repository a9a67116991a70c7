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

import bisect
import functools
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
from tpubuild.kernels import Operand, get_kernel, halfcast
from tpubuild.kernels import prepare as prepare_kernel
from tpubuild.sim import cycles
from tpubuild.sim.memory import Memories, Where, channel_view, gather, scatter
from tpubuild.sim.sync import check_races


@dataclass(frozen=True)
class RunResult:
    outputs: dict[str, np.ndarray]  # graph outputs by name, in their stored types
    profile: dict  # cycles.profile(): cycles, time, DDR bytes, utilisation


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
    return Program(model, races=races, reuse=False).run(inputs)


class Program:
    """A model file ready to run, any number of times, one run at a time (the memories are its own).

    ``reuse``: prepare for many runs -- weight tiles read once, kernels prepared for their tiles,
    a result handed to the commands reading it (and not written when nothing else reads it): two
    shadow runs that cost about one run. False for a single run (``simulate``).
    """

    def __init__(self, model: ModelFile, *, races: bool = True, reuse: bool = True):
        header = model.header
        params = decoded_params(model)
        if races:
            check_races(model)
        schedule = cycles.replay(model, params)
        self.profile = cycles.profile(model, params, schedule)
        self.mem = mem = Memories(header.chip, header.ddr_size)
        weights = np.frombuffer(model.weights, np.uint8)
        if header.weight_base + weights.size > mem.ddr.size:
            raise Where("weights", 0).error(
                f"[{header.weight_base}, {header.weight_base + weights.size}) is outside DDR [0, {mem.ddr.size})"
            )
        mem.ddr[header.weight_base : header.weight_base + weights.size] = weights
        self.weights, self.weight_base = weights, header.weight_base
        self.inputs = [(t, _io_view(mem, t, "input", write=True)) for t in header.inputs]
        self.steps = [
            _gdma_step(mem, i, model.gdma[i]) if engine == "gdma" else _BdcStep(mem, i, model.bdc[i], params[i])
            for engine, i in schedule.order()
        ]
        self.outputs = [(t, _io_view(mem, t, "output")) for t in header.outputs]
        accesses = (
            [(True, view) for _, view in self.inputs]
            + [a for step in self.steps for a in step.accesses]
            + [(False, view) for _, view in self.outputs]
        )
        self.accesses = accesses  # for the bytes to restore before a second run (a single run needs none)
        self.stale: tuple | None = None
        if reuse:
            fixed = _Fixed(mem, accesses)
            for step in self.steps:
                step.prepare(fixed)
            tiles = _Tiles(mem)
            for step in self.steps:
                step.forward(tiles)
            for step in self.steps:
                step.finish()  # (a tile is stored once a later command reads it: known at the end)
        self.fresh = True  # the memories hold zeros and the weights only
        self.lock = threading.Lock()

    def run(self, inputs: Mapping[str, np.ndarray]) -> RunResult:
        """Run the command streams on ``inputs`` (by graph input name); outputs in their stored types."""
        data = [_input(t, inputs) for t, _ in self.inputs]
        with self.lock:
            if not self.fresh:
                # what an earlier run left where this one reads before writing: back to a fresh chip's
                if self.stale is None:
                    self.stale = self._stale()
                ddr_stale, ddr_initial, local_stale = self.stale
                self.mem.ddr[ddr_stale] = ddr_initial
                self.mem.local.reshape(-1)[local_stale] = 0
            self.fresh = False
            for (_, view), array in zip(self.inputs, data, strict=True):
                if view.size:
                    view[...] = array.reshape(view.shape)
            for step in self.steps:
                step.run()
            outputs = {t.name: view.copy().reshape(t.shape) for t, view in self.outputs}
        return RunResult(outputs, cycles.copy_profile(self.profile))

    def _stale(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The DDR bytes to restore before a run and their values on a fresh chip (zero, or the weights'),
        the local bytes to zero."""
        ddr = _stale_bytes(self.mem.ddr, self.accesses)
        initial = np.zeros(ddr.size, np.uint8)
        in_weights = (ddr >= self.weight_base) & (ddr < self.weight_base + self.weights.size)
        initial[in_weights] = self.weights[ddr[in_weights] - self.weight_base]
        return ddr, initial, _stale_bytes(self.mem.local, self.accesses)


def _io_view(mem: Memories, t, what: str, write: bool = False) -> np.ndarray:
    block = (1, 1, 1, int(np.prod(t.shape, dtype=np.int64)))
    return mem.ddr_view(
        t.ddr_addr, block, cmd.contiguous_strides(block), t.dtype, Where("header", 0, f"{what} {t.name!r}"), write=write
    )


def _stale_bytes(memory: np.ndarray, accesses: list[tuple[bool, np.ndarray]]) -> np.ndarray:
    """The bytes of ``memory`` a run reads before it writes them, among those a run writes (flat indices):
    all a run must restore for the next run to start as on a fresh chip.

    A shadow run over byte masks, the accesses in run order. A command stream that reads only what it
    wrote has none; bytes never written keep their first values anyway.
    """
    base = memory.__array_interface__["data"][0]
    ours = [
        (write, v)
        for write, v in accesses
        if v.size and base <= v.__array_interface__["data"][0] < base + memory.nbytes
    ]
    written, stale = np.zeros(memory.size, np.bool_), np.zeros(memory.size, np.bool_)
    spans = _merged(_extent(v, base) for write, v in ours if write)

    for write, v in ours:
        if write:
            _mask(v, base, written)[...] = True
        elif _meets(_extent(v, base), spans):  # (reads of the weights never do)
            m = _mask(v, base, stale)
            np.logical_or(m, ~_mask(v, base, written), out=m)
    index = np.concatenate(
        [np.zeros(0, np.intp)] + [lo + np.flatnonzero(stale[lo:hi] & written[lo:hi]) for lo, hi in spans]
    )
    return index


def _extent(v: np.ndarray, base: int) -> tuple[int, int]:
    lo = v.__array_interface__["data"][0] - base
    return lo, lo + sum((d - 1) * s for d, s in zip(v.shape, v.strides, strict=True)) + v.dtype.itemsize


def _merged(spans) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def _meets(span: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    """Whether ``span`` overlaps one of the sorted, disjoint ``spans``."""
    lo, hi = span
    i = bisect.bisect_left(spans, (hi,))  # the spans starting before hi: only the last can reach past lo
    return i > 0 and spans[i - 1][1] > lo


def _address(v: np.ndarray) -> int:
    return v.__array_interface__["data"][0]


def _mask(v: np.ndarray, base: int, of: np.ndarray) -> np.ndarray:
    """The bytes of the view ``v`` (into a memory at address ``base``) in ``of``, an array with one entry
    per byte of the memory: the view's shape and strides, with a last axis of the element size."""
    scale = of.itemsize
    return np.ndarray(
        v.shape,
        np.dtype((of.dtype, (v.dtype.itemsize,))),
        buffer=of,
        offset=(_address(v) - base) * scale,
        strides=tuple(s * scale for s in v.strides),
    )


class _Fixed:
    """Which bytes hold the same values at a point of every run, in run order: DDR bytes no command
    writes (the weights), and local bytes last written by a GDMA load of such bytes. A shadow run
    keeps those local bytes' values in an image of local memory, so an operand made of them (a
    weight tile) is read once, when the model is prepared."""

    def __init__(self, mem: Memories, accesses: list[tuple[bool, np.ndarray]]):
        self.ddr_base, self.local_base = _address(mem.ddr), _address(mem.local)
        self.local_end = self.local_base + mem.local.nbytes
        self.ddr_written = np.zeros(mem.ddr.size, np.bool_)  # (zeros: only the pages of written bytes are touched)
        for write, v in accesses:
            if write and v.size and not self.is_local(v):
                _mask(v, self.ddr_base, self.ddr_written)[...] = True
        self.local = np.zeros(mem.local.shape, np.bool_)
        self.image = np.zeros_like(mem.local)

    def is_local(self, v: np.ndarray) -> bool:
        return self.local_base <= _address(v) < self.local_end

    def holds(self, v: np.ndarray) -> bool:
        """Whether every byte of ``v`` is fixed here."""
        if self.is_local(v):
            return bool(_mask(v, self.local_base, self.local).all())
        return not _mask(v, self.ddr_base, self.ddr_written).any()

    def value(self, v: np.ndarray) -> np.ndarray:
        """``v``'s fixed elements (a view into the image for local memory, DDR itself for DDR)."""
        if not self.is_local(v):
            return v
        return np.ndarray(v.shape, v.dtype, buffer=self.image, offset=_address(v) - self.local_base, strides=v.strides)

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        """A GDMA copy: its local destination is fixed if its source is, with the source's values."""
        if not self.is_local(dst):
            return  # a DDR destination is written by the run: never fixed
        fixed = self.holds(src)
        _mask(dst, self.local_base, self.local)[...] = fixed
        if fixed:
            self.value(dst)[...] = self.value(src)

    def written(self, v: np.ndarray) -> None:
        if self.is_local(v):
            _mask(v, self.local_base, self.local)[...] = False


class _Tile:
    """A local block a command writes: whether memory must hold it (a command reads its bytes there),
    and for a BDC result, how many BDC operands take the result itself (``array``) instead."""

    def __init__(self, index: int, geometry: tuple | None):
        self.index, self.geometry = index, geometry  # geometry: a BDC result's dtype, shape and views
        self.stored, self.readers = False, 0
        self.array: np.ndarray | None = None  # the result itself, set by the run that computes it


class _Tiles:
    """A shadow run over local memory that knows, per byte, the tile last written there. A BDC operand
    that is exactly a BDC result still in place (same element type, shape and views, no byte written
    since) takes that result's array (C order, read-only: what reading it back gives); a tile no
    command reads in memory is not written there. Stale bytes are restored before each run anyway,
    so a tile left unwritten is never read: any read in memory of its bytes would have stored it."""

    def __init__(self, mem: Memories):
        self.base, self.end = _address(mem.local), _address(mem.local) + mem.local.nbytes
        self.owner = np.zeros(mem.local.size, np.int32)  # per byte: 1 + the tile last written there, 0: none
        self.tiles: list[_Tile] = []

    def is_local(self, v: np.ndarray) -> bool:
        return self.base <= _address(v) < self.end

    def owners(self, views) -> set[int]:
        """The tiles (-1: none) owning the bytes of ``views``."""
        out: set[int] = set()
        for v in views:
            m = _mask(v, self.base, self.owner)
            lo, hi = int(m.min()), int(m.max())
            # (bincount: a tile index is small, sorting a big tile's bytes for np.unique is not)
            out.update([lo - 1] if lo == hi else (np.flatnonzero(np.bincount(m.ravel())) - 1).tolist())
        return out

    def read(self, views) -> None:
        for i in self.owners([v for v in views if v.size and self.is_local(v)]):
            if i >= 0:
                self.tiles[i].stored = True

    def write(self, views, geometry: tuple | None = None) -> _Tile | None:
        views = [v for v in views if v.size and self.is_local(v)]
        if not views:
            return None
        tile = _Tile(len(self.tiles), geometry)
        self.tiles.append(tile)
        for v in views:
            _mask(v, self.base, self.owner)[...] = tile.index + 1
        return tile

    def result(self, geometry: tuple, views) -> _Tile | None:
        """The BDC result all of ``views`` hold, with this geometry, or None."""
        if not views or not all(v.size and self.is_local(v) for v in views):
            return None
        owners = self.owners(views)
        first = min(owners)
        tile = self.tiles[first] if len(owners) == 1 and first >= 0 else None
        return tile if tile is not None and tile.geometry == geometry else None


class _Copy:
    """A GDMA command: copies between views (one pair per run of channels of its local side)."""

    def __init__(self, pairs: list[tuple[np.ndarray, np.ndarray]]):
        self.pairs = pairs
        self.accesses = [(False, src) for _, src in pairs] + [(True, dst) for dst, _ in pairs]

    def prepare(self, fixed: _Fixed) -> None:
        for dst, src in self.pairs:
            fixed.copy(dst, src)

    def forward(self, tiles: _Tiles) -> None:
        """Leave out the loads of local tiles nothing reads in memory (weights the BDC steps hold)."""
        self.kept = []
        for dst, src in self.pairs:
            tiles.read([src])
            self.kept.append((dst, src, tiles.write([dst])))  # (None: a DDR destination)

    def finish(self) -> None:
        self.pairs = [(dst, src) for dst, src, tile in self.kept if tile is None or tile.stored]
        del self.kept

    def run(self) -> None:
        for dst, src in self.pairs:
            dst[...] = src


def _gdma_step(mem: Memories, i: int, g: Gdma) -> _Copy:
    where = Where("gdma", i)
    if g.direction == Direction.DDR2DDR:
        src = mem.ddr_view(g.ddr_addr, g.shape, g.ddr_strides, g.dtype, where)
        dst = mem.ddr_view(g.dst_addr, g.shape, g.dst_strides, g.dtype, where, write=True)
        # numpy copies overlapping blocks as if through a buffer, as the chip's read-then-write does
        return _Copy([] if 0 in g.shape else [(dst, src)])
    load = g.direction == Direction.LOAD
    ddr = mem.ddr_view(g.ddr_addr, g.shape, g.ddr_strides, g.dtype, where, write=not load)
    pieces = mem.local_pieces(g.local_addr, g.lane_start, g.shape, g.dtype, where, g.local_plane)
    if load:
        return _Copy([(view, channel_view(ddr, c0, c1, view)) for c0, c1, view in pieces])
    return _Copy([(channel_view(ddr, c0, c1, view), view) for c0, c1, view in pieces])


class _Block:
    """A BDC operand or result: its views into DDR or local memory, and the shape the kernel sees."""

    def __init__(self, mem: Memories, t: cmd.Tensor, where: Where, write: bool):
        self.shape, self.view, self.size = tuple(t.shape), tuple(t.view), t.size()
        self.dtype = dtype_from_name(t.dtype)
        if int(np.prod(self.view, dtype=np.int64)) != self.size:
            raise where.error(f"view {t.view} does not hold the {self.size} elements of block {t.shape}")
        if t.space == Space.DDR:
            ddr = mem.ddr_view(t.addr, t.shape, t.strides, t.dtype, where, write=write)
            self.pieces = [(0, t.shape[1], ddr)] if self.size else []
        else:
            self.pieces = mem.local_pieces(t.addr, t.lane_start, t.shape, t.dtype, where, t.plane)
        # one view (a DDR block, a local block within the lanes of one slot): no gather
        self.whole = self.pieces[0][2] if len(self.pieces) == 1 else None
        self.geometry = (
            self.dtype,
            self.shape,
            tuple((c0, c1, _address(v), v.shape, v.strides) for c0, c1, v in self.pieces),
        )

    def views(self) -> list[np.ndarray]:
        return [v for _, _, v in self.pieces]

    def read(self) -> np.ndarray:
        if self.whole is not None:
            return self.whole.copy().reshape(self.view)
        if not self.pieces:
            return np.zeros(self.view, self.dtype)
        return gather(self.pieces, self.shape, self.dtype).reshape(self.view)

    def fixed_value(self, fixed: _Fixed) -> np.ndarray | None:
        """The block's elements if every run finds the same ones here (read-only), else None."""
        if not self.pieces or not all(fixed.holds(v) for _, _, v in self.pieces):
            return None
        pieces = [(c0, c1, fixed.value(v)) for c0, c1, v in self.pieces]
        value = (pieces[0][2].copy() if len(pieces) == 1 else gather(pieces, self.shape, self.dtype)).reshape(self.view)
        value.flags.writeable = False  # shared by every run: kernels read their operands, never write them
        return value

    def write(self, values: np.ndarray) -> None:
        if self.whole is not None:
            self.whole[...] = values.reshape(self.shape)
        elif self.pieces:
            scatter(self.pieces, values.reshape(self.shape))


class _Value:
    """An operand every run finds the same: read when the model is prepared."""

    def __init__(self, value: np.ndarray):
        self.value = value

    def read(self) -> np.ndarray:
        return self.value


class _Forwarded:
    """An operand that is a BDC result still in place: that result's array."""

    def __init__(self, tile: _Tile, view: tuple):
        self.tile, self.view = tile, view

    def read(self) -> np.ndarray:
        array = self.tile.array
        assert array is not None, "a forwarded result is computed before a later command reads it"
        return array.reshape(self.view)


class _BdcStep:
    """A BDC command: its kernel (prepared for its operands' shapes and fixed values), its operands'
    and results' blocks."""

    def __init__(self, mem: Memories, i: int, b: Bdc, params):
        self.index, self.op, self.params = i, b.op, params
        op_class = tpu_op_class(b.op)
        if op_class is None:
            raise Where("bdc", i).error(f"unknown op {b.op}")
        self.op_class = op_class
        self.kernel = functools.partial(get_kernel(self.op_class), params)
        self.blocks = [
            None if t.space == Space.NONE else _Block(mem, t, Where("bdc", i, f"operand {j}"), False)
            for j, t in enumerate(b.operands)
        ]
        # what each run reads: the blocks, then (prepare, forward) fixed values and results still in place
        self.operands: list[_Block | _Value | _Forwarded | None] = list(self.blocks)
        self.results = [
            None if t.space == Space.NONE else _Block(mem, t, Where("bdc", i, f"result {j}"), True)
            for j, t in enumerate(b.results)
        ]
        self.accesses = [(False, v) for o in self.blocks if o is not None for _, _, v in o.pieces] + [
            (True, v) for r in self.results if r is not None for _, _, v in r.pieces
        ]
        self.tiles: list[_Tile | None] = [None] * len(self.results)  # (forward() may hand results on)

    def prepare(self, fixed: _Fixed) -> None:
        values = [None if o is None else o.fixed_value(fixed) for o in self.blocks]
        for r in self.results:
            for _, _, v in r.pieces if r is not None else ():
                fixed.written(v)
        try:
            self.kernel = prepare_kernel(
                self.op_class,
                self.params,
                [
                    Operand(None, None, None) if o is None else Operand(o.view, o.dtype, value)
                    for o, value in zip(self.blocks, values, strict=True)
                ],
            )
        except Exception as e:  # noqa: BLE001 - as a kernel's: the parameters and shapes come from the file
            raise Where("bdc", self.index).error(
                f"{self.op} cannot be prepared for its tiles: {type(e).__name__}: {e}"
            ) from None
        self.operands = [o if value is None else _Value(value) for o, value in zip(self.blocks, values, strict=True)]

    def forward(self, tiles: _Tiles) -> None:
        """Operands that are results still in place take them; results nothing reads in memory stay out of it."""
        for j, o in enumerate(self.operands):
            if isinstance(o, _Block):
                tile = tiles.result(o.geometry, o.views())
                if tile is None:
                    tiles.read(o.views())
                else:
                    tile.readers += 1
                    self.operands[j] = _Forwarded(tile, o.view)
        self.tiles = [None if r is None else tiles.write(r.views(), r.geometry) for r in self.results]

    def finish(self) -> None:
        pass

    def run(self) -> None:
        args = [None if o is None else o.read() for o in self.operands]
        try:
            result = self.kernel(*args)
        except Exception as e:  # noqa: BLE001 - parameters and tiles come from the file: any kernel failure is the file's
            raise Where("bdc", self.index).error(f"{self.op} failed on its tiles: {type(e).__name__}: {e}") from None
        results = result if isinstance(result, tuple) else (result,)
        if len(results) != len(self.results):
            raise Where("bdc", self.index).error(
                f"{self.op} produced {len(results)} results, the command describes {len(self.results)}"
            )
        for j, (block, r) in enumerate(zip(self.results, results, strict=True)):
            if block is None:
                continue  # a result nobody reads
            r = np.asarray(r)
            if r.size != block.size:
                raise Where("bdc", self.index).error(
                    f"{self.op} result {j} has shape {r.shape}, its block {block.shape} holds {block.size} elements"
                )
            values = r if r.dtype == block.dtype else halfcast.astype(r, block.dtype)
            tile = self.tiles[j]
            if tile is not None and tile.readers:
                # as TPU inference hands a result on: in the kernel's own layout (a channels-last conv
                # output stays so for the next conv), read-only (other kernels' operand)
                tile.array = array = values.reshape(block.shape).view()
                array.flags.writeable = False
            if tile is None or tile.stored:
                block.write(values)


def _input(t, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
    if t.name not in inputs:
        raise TpuBuildError(
            f"no data for model input {t.name!r} (inputs given: {sorted(inputs)})",
            hint="the input npz must hold one array per model input, named as the input",
        )
    array = np.asarray(inputs[t.name])
    if array.shape != t.shape and array.size != int(np.prod(t.shape)):
        raise TpuBuildError(f"input {t.name!r} has shape {array.shape}, the model expects {t.shape}")
    return array.astype(dtype_from_name(t.dtype), copy=False)
