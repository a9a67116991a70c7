"""Run a model file on the simulated chip: DDR + local memories, GDMA moves, BDC kernels.

The simulator knows only the model file. BDC commands call the same
reference kernels as TPU inference (tpubuild.kernels) on tiles gathered from
local memory, so a correctly sliced INT8 model reproduces TPU inference's
bits. Commands run whole, in the cycle model's start order, after a race
check has shown that any order the waits allow gives the same result.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from tpubuild.codegen import commands as cmd
from tpubuild.codegen.commands import Bdc, Direction, Gdma
from tpubuild.codegen.model_file import ModelFile, ModelFileError, read_model, tpu_op_class
from tpubuild.errors import TpuBuildError
from tpubuild.ir.types import dtype_from_name
from tpubuild.kernels import get_kernel, halfcast
from tpubuild.sim import cycles
from tpubuild.sim.memory import Memories, Where
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
    header = model.header
    params = decoded_params(model)
    if races:
        check_races(model)
    schedule = cycles.replay(model, params)
    mem = Memories(header.chip, header.ddr_size)
    where = Where("weights", 0)
    mem.ddr[_span(header.weight_base, len(model.weights), mem, where)] = np.frombuffer(model.weights, np.uint8)
    for t in header.inputs:
        data = _input(t, inputs)
        mem.write_ddr(t.ddr_addr, _block(t.shape), cmd.contiguous_strides(_block(t.shape)), t.dtype,
                      data.reshape(_block(t.shape)), Where("header", 0, f"input {t.name!r}"))
    for engine, i in schedule.order():
        if engine == "gdma":
            _run_gdma(mem, i, model.gdma[i])
        else:
            _run_bdc(mem, i, model.bdc[i], params[i])
    outputs = {}
    for t in header.outputs:
        block = _block(t.shape)
        outputs[t.name] = mem.read_ddr(t.ddr_addr, block, cmd.contiguous_strides(block), t.dtype,
                                       Where("header", 0, f"output {t.name!r}")).reshape(t.shape)
    return RunResult(outputs, cycles.profile(model, params, schedule))


def _span(addr: int, size: int, mem: Memories, where: Where) -> slice:
    if addr + size > mem.ddr.size:
        raise where.error(f"[{addr}, {addr + size}) is outside DDR [0, {mem.ddr.size})")
    return slice(addr, addr + size)


def _block(shape) -> tuple[int, int, int, int]:
    """Any-rank contiguous tensor as a 1 x 1 x 1 x size block (same bytes)."""
    size = 1
    for d in shape:
        size *= d
    return (1, 1, 1, size)


def _input(t, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
    if t.name not in inputs:
        raise TpuBuildError(f"no data for model input {t.name!r} (inputs given: {sorted(inputs)})",
                            hint="the input npz must hold one array per model input, named as the input")
    array = np.asarray(inputs[t.name])
    if array.shape != t.shape and array.size != int(np.prod(t.shape)):
        raise TpuBuildError(f"input {t.name!r} has shape {array.shape}, the model expects {t.shape}")
    return array.astype(dtype_from_name(t.dtype), copy=False)


def _run_gdma(mem: Memories, i: int, g: Gdma) -> None:
    where = Where("gdma", i)
    if g.direction == Direction.LOAD:
        data = mem.read_ddr(g.ddr_addr, g.shape, g.ddr_strides, g.dtype, where)
        mem.write_local(g.local_addr, g.lane_start, g.shape, g.dtype, data, where, g.local_plane)
    elif g.direction == Direction.STORE:
        data = mem.read_local(g.local_addr, g.lane_start, g.shape, g.dtype, where, g.local_plane)
        mem.write_ddr(g.ddr_addr, g.shape, g.ddr_strides, g.dtype, data, where)
    else:
        data = mem.read_ddr(g.ddr_addr, g.shape, g.ddr_strides, g.dtype, where)
        mem.write_ddr(g.dst_addr, g.shape, g.dst_strides, g.dtype, data, where)


def _run_bdc(mem: Memories, i: int, b: Bdc, params) -> None:
    where = Where("bdc", i)
    args = [mem.read_tensor(t, Where("bdc", i, f"operand {j}")) for j, t in enumerate(b.operands)]
    op_cls = tpu_op_class(b.op)
    try:
        result = get_kernel(op_cls)(params, *args)
    except Exception as e:  # noqa: BLE001 - parameters and tiles come from the file: any kernel failure is the file's
        raise where.error(f"{b.op} failed on its tiles: {type(e).__name__}: {e}") from None
    results = result if isinstance(result, tuple) else (result,)
    if len(results) != len(b.results):
        raise where.error(f"{b.op} produced {len(results)} results, the command describes {len(b.results)}")
    for j, (t, r) in enumerate(zip(b.results, results)):
        if t.space == cmd.Space.NONE:
            continue
        r = np.asarray(r)
        if r.size != t.size():
            raise where.error(f"{b.op} result {j} has shape {r.shape}, its block {t.shape} holds {t.size()} elements")
        mem.write_tensor(t, halfcast.astype(r, dtype_from_name(t.dtype)), Where("bdc", i, f"result {j}"))
