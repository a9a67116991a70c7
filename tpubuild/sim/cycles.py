"""The cycle model: both engines replayed with their sync waits, from the model file alone.

Costs (chip figures from the model header, docs/model_format.md):

- GDMA: ``gdma_latency_cycles + bytes / (ddr_bandwidth / clock_hz)``, bytes
  being what crosses the DDR interface (DDR2DDR counts its read and its write).
- BDC: ``bdc_overhead_cycles`` plus the larger of its compute and, for a
  global BDC, its DDR transfer time. Lanes work on output channels in
  parallel, so an op's per-lane work scales with ``ceil(C / lanes)`` of its
  result block, not with C / lanes: few channels leave lanes idle.
  MAC ops (Conv, Deconv, MatMul) do ``macs_per_lane_per_cycle[dtype]`` MACs per
  lane per cycle (dtype: the first operand's); every other op processes
  ``eu_bytes`` bytes of its result per lane per cycle, times a work factor per
  output element (a pool's window size, a few passes for Softmax/LayerNorm).

Every command takes at least one cycle, so a command always ends after the
ones it waits for start -- the simulator relies on that for its order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from tpubuild.codegen import commands as cmd
from tpubuild.codegen.commands import Bdc, Gdma
from tpubuild.codegen.model_file import ChipParams, ModelFile, tpu_op_class
from tpubuild.ir import top, tpu

MODE_OF_DTYPE = {"int8": "INT8", "uint8": "INT8", "float16": "F16", "bfloat16": "BF16", "float32": "F32"}

# ---- BDC work per op -----------------------------------------------------------------------

def _out_elems(b: Bdc) -> int:
    return sum(t.size() for t in b.results)


def _conv_macs(p, b: Bdc) -> int:
    w = b.operands[1].view  # [OC, IC/group, *kernel]
    return _out_elems(b) * math.prod(w[1:])


def _deconv_macs(p, b: Bdc) -> int:
    w = b.operands[1].view  # [IC, OC/group, *kernel]
    return b.operands[0].size() * math.prod(w[1:])


def _matmul_macs(p, b: Bdc) -> int:
    a = b.operands[0].view
    return _out_elems(b) * (a[-1] if a else 1)


MAC_OPS: dict[type, Callable[[object, Bdc], int]] = {
    tpu.ConvOp: _conv_macs, tpu.MIRROR[top.DeconvOp]: _deconv_macs, tpu.MatMulOp: _matmul_macs,
}


def _window(p, b: Bdc) -> float:
    return float(math.prod(p.kernel_shape))


# passes over each output element for ops that are more than one EU operation per element
WORK_FACTOR: dict[type, Callable[[object, Bdc], float]] = {
    tpu.MaxPoolOp: _window, tpu.AvgPoolOp: _window,
    tpu.SoftmaxOp: lambda p, b: 5.0, tpu.LayerNormOp: lambda p, b: 6.0,
}


def bdc_macs(b: Bdc, params) -> int:
    fn = MAC_OPS.get(tpu_op_class(b.op))
    return fn(params, b) if fn else 0


def _lane_rounds(t: cmd.Tensor, lanes: int) -> int:
    """Elements per lane of a result block when its channels spread over the lanes."""
    n, c, h, w = t.shape
    return n * math.ceil(c / lanes) * h * w


def bdc_compute_cycles(chip: ChipParams, b: Bdc, params) -> float:
    op_cls = tpu_op_class(b.op)
    out = b.results[0]
    per_lane = sum(_lane_rounds(t, chip.lanes) for t in b.results)
    macs = bdc_macs(b, params)
    if macs:
        mode = MODE_OF_DTYPE.get(b.operands[0].dtype)
        rate = chip.macs_per_lane_per_cycle.get(mode) or min(chip.macs_per_lane_per_cycle.values(), default=1.0)
        total_out = max(_out_elems(b), 1)
        return per_lane * (macs / total_out) / rate
    factor = WORK_FACTOR.get(op_cls)
    work = factor(params, b) if factor else 1.0
    return per_lane * cmd.itemsize(out.dtype) / chip.eu_bytes * work


def bdc_cycles(chip: ChipParams, b: Bdc, params) -> int:
    compute = bdc_compute_cycles(chip, b, params)
    read, written = b.ddr_bytes()
    transfer = (read + written) * chip.clock_hz / chip.ddr_bandwidth
    return max(1, chip.bdc_overhead_cycles + math.ceil(max(compute, transfer)))


def gdma_cycles(chip: ChipParams, g: Gdma) -> int:
    read, written = g.ddr_bytes()
    return max(1, chip.gdma_latency_cycles + math.ceil((read + written) * chip.clock_hz / chip.ddr_bandwidth))


# ---- replay ---------------------------------------------------------------------------------

@dataclass
class Schedule:
    """Start and end cycle of every command of both queues."""

    gdma_start: list[int] = field(default_factory=list)
    gdma_end: list[int] = field(default_factory=list)
    bdc_start: list[int] = field(default_factory=list)
    bdc_end: list[int] = field(default_factory=list)

    @property
    def total(self) -> int:
        return max(self.gdma_end[-1] if self.gdma_end else 0, self.bdc_end[-1] if self.bdc_end else 0)

    def order(self) -> list[tuple[str, int]]:
        """Every command by start cycle (ties: GDMA first, then queue order)."""
        events = [(s, 0, i) for i, s in enumerate(self.gdma_start)] + [(s, 1, i) for i, s in enumerate(self.bdc_start)]
        events.sort()
        return [("gdma" if e == 0 else "bdc", i) for _, e, i in events]


def replay(model: ModelFile, bdc_params: list) -> Schedule:
    """Both in-order queues with their waits; ``bdc_params`` are the decoded params of each BDC."""
    chip = model.header.chip
    gdma, bdc = model.gdma, model.bdc
    s = Schedule()
    free_g = free_b = 0
    while len(s.gdma_end) < len(gdma) or len(s.bdc_end) < len(bdc):
        moved = False
        while len(s.gdma_end) < len(gdma) and gdma[len(s.gdma_end)].wait_bdc <= len(s.bdc_end):
            g = gdma[len(s.gdma_end)]
            start = max(free_g, s.bdc_end[g.wait_bdc - 1] if g.wait_bdc else 0)
            free_g = start + gdma_cycles(chip, g)
            s.gdma_start.append(start)
            s.gdma_end.append(free_g)
            moved = True
        while len(s.bdc_end) < len(bdc) and bdc[len(s.bdc_end)].wait_gdma <= len(s.gdma_end):
            i = len(s.bdc_end)
            b = bdc[i]
            start = max(free_b, s.gdma_end[b.wait_gdma - 1] if b.wait_gdma else 0)
            free_b = start + bdc_cycles(chip, b, bdc_params[i])
            s.bdc_start.append(start)
            s.bdc_end.append(free_b)
            moved = True
        if not moved:  # the reader rejects such files; a hand-built ModelFile may still get here
            from tpubuild.codegen.model_file import ModelFileError
            raise ModelFileError("deadlock: neither queue can proceed", section="gdma", command=len(s.gdma_end))
    return s


def profile(model: ModelFile, bdc_params: list, schedule: Schedule) -> dict:
    """The run's figures: cycles, time, DDR bytes, engine utilisation, and cycles per op type."""
    chip = model.header.chip
    total = schedule.total
    g_busy = sum(e - s for s, e in zip(schedule.gdma_start, schedule.gdma_end))
    b_busy = sum(e - s for s, e in zip(schedule.bdc_start, schedule.bdc_end))
    g_read = sum(g.ddr_bytes()[0] for g in model.gdma)
    g_write = sum(g.ddr_bytes()[1] for g in model.gdma)
    b_read = sum(b.ddr_bytes()[0] for b in model.bdc)
    b_write = sum(b.ddr_bytes()[1] for b in model.bdc)
    ops: dict[str, dict] = {}
    total_macs = 0
    for b, p, s, e in zip(model.bdc, bdc_params, schedule.bdc_start, schedule.bdc_end):
        row = ops.setdefault(b.op, {"commands": 0, "cycles": 0, "macs": 0, "global": 0})
        macs = bdc_macs(b, p)
        row["commands"] += 1
        row["cycles"] += e - s
        row["macs"] += macs
        row["global"] += int(b.is_global)
        total_macs += macs
    return {
        "model": model.header.model,
        "chip": chip.name,
        "clock_hz": chip.clock_hz,
        "total_cycles": total,
        "time_ms": total / chip.clock_hz * 1e3,
        "ddr_read_bytes": g_read + b_read,
        "ddr_write_bytes": g_write + b_write,
        "gdma": {"commands": len(model.gdma), "busy_cycles": g_busy,
                 "utilisation": g_busy / total if total else 0.0, "read_bytes": g_read, "write_bytes": g_write},
        "bdc": {"commands": len(model.bdc), "busy_cycles": b_busy,
                "utilisation": b_busy / total if total else 0.0, "macs": total_macs,
                "global_commands": sum(int(b.is_global) for b in model.bdc),
                "read_bytes": b_read, "write_bytes": b_write},
        "ops": dict(sorted(ops.items())),
    }
