"""An assembler for command streams written by hand (tests, examples, bug reports).

It numbers commands, packs weights, bump-allocates DDR and local memory, and
builds a ModelFile; the caller states every wait. Weights sit at DDR address
0 (the weight base), activations from ``act_base`` on.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tpubuild.codegen import commands as cmd
from tpubuild.codegen.commands import Bdc, Direction, Gdma, Tensor, shape4
from tpubuild.codegen.model_file import ChipParams, Header, IoTensor, ModelFile

DDR_ALIGN = 64


class Assembler:
    def __init__(self, chip: ChipParams, *, model: str = "hand", mode: str = "", act_base: int = 1 << 20):
        self.chip = chip
        self.model, self.mode = model, mode
        self.weights = bytearray()
        self.act_base = self.act_top = act_base
        self.local_top = 0
        self.gdma: list[Gdma] = []
        self.bdc: list[Bdc] = []
        self.inputs: list[IoTensor] = []
        self.outputs: list[IoTensor] = []

    # ---- memory ----

    def weight(self, array: np.ndarray) -> int:
        """Pack an array's bytes into the weight blob; its DDR address."""
        addr = cmd.align_up(len(self.weights), DDR_ALIGN)
        self.weights += b"\0" * (addr - len(self.weights)) + np.ascontiguousarray(array).tobytes()
        return addr

    def ddr(self, nbytes: int) -> int:
        addr = cmd.align_up(self.act_top, DDR_ALIGN)
        self.act_top = addr + nbytes
        return addr

    def local(self, shape: Sequence[int], dtype: str, lane_start: int = 0) -> int:
        """A local buffer for an (n, c, h, w) tensor; its byte offset in every lane."""
        addr = cmd.align_up(self.local_top, self.chip.eu_bytes)
        self.local_top = addr + cmd.local_bytes(shape, dtype, lane_start, self.chip.lanes, self.chip.eu_bytes)
        return addr

    def input(self, name: str, shape: Sequence[int], dtype: str, scale: float = 1.0, zero_point: int = 0) -> IoTensor:
        t = IoTensor(name, tuple(shape), dtype, 0, scale, zero_point)
        t = IoTensor(name, t.shape, dtype, self.ddr(t.nbytes), scale, zero_point)
        self.inputs.append(t)
        return t

    def output(
        self, name: str, shape: Sequence[int], dtype: str, scale: float = 1.0, zero_point: int = 0, source: str = ""
    ) -> IoTensor:
        """A graph output; ``source``: its name in the source model where it differs."""
        t = IoTensor(name, tuple(shape), dtype, 0, scale, zero_point)
        t = IoTensor(name, t.shape, dtype, self.ddr(t.nbytes), scale, zero_point, source)
        self.outputs.append(t)
        return t

    # ---- commands (each returns its id) ----

    def load(
        self,
        ddr_addr: int,
        ddr_strides: Sequence[int],
        local_addr: int,
        shape: Sequence[int],
        dtype: str,
        *,
        lane_start: int = 0,
        wait_bdc: int = 0,
    ) -> int:
        return self._gdma(Direction.LOAD, ddr_addr, ddr_strides, local_addr, shape, dtype, lane_start, wait_bdc)

    def store(
        self,
        local_addr: int,
        ddr_addr: int,
        ddr_strides: Sequence[int],
        shape: Sequence[int],
        dtype: str,
        *,
        lane_start: int = 0,
        wait_bdc: int = 0,
    ) -> int:
        return self._gdma(Direction.STORE, ddr_addr, ddr_strides, local_addr, shape, dtype, lane_start, wait_bdc)

    def copy(
        self,
        src: int,
        src_strides: Sequence[int],
        dst: int,
        dst_strides: Sequence[int],
        shape: Sequence[int],
        dtype: str,
        *,
        wait_bdc: int = 0,
    ) -> int:
        g = Gdma(
            len(self.gdma) + 1,
            wait_bdc,
            Direction.DDR2DDR,
            dtype,
            src,
            shape4(src_strides),
            0,
            0,
            shape4(shape),
            dst,
            shape4(dst_strides),
        )
        self.gdma.append(g)
        return g.id

    def _gdma(self, direction, ddr_addr, ddr_strides, local_addr, shape, dtype, lane_start, wait_bdc) -> int:
        g = Gdma(
            len(self.gdma) + 1,
            wait_bdc,
            direction,
            dtype,
            ddr_addr,
            tuple(ddr_strides),
            local_addr,
            lane_start,
            tuple(shape),
        )
        self.gdma.append(g)
        return g.id

    def compute(
        self, op: type | str, params, operands: Sequence[Tensor], results: Sequence[Tensor], *, wait_gdma: int = 0
    ) -> int:
        name = op if isinstance(op, str) else op.name
        b = Bdc.make(len(self.bdc) + 1, wait_gdma, name, params, operands, results)
        self.bdc.append(b)
        return b.id

    def build(self) -> ModelFile:
        if len(self.weights) > self.act_base:
            raise ValueError(
                f"{len(self.weights)} weight bytes overlap activations from {self.act_base}; raise act_base"
            )
        header = Header(
            model=self.model,
            mode=self.mode,
            chip=self.chip,
            ddr_size=cmd.align_up(self.act_top, DDR_ALIGN),
            weight_base=0,
            inputs=tuple(self.inputs),
            outputs=tuple(self.outputs),
        )
        return ModelFile(header, bytes(self.weights), tuple(self.gdma), tuple(self.bdc))
