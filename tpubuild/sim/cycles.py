"""The cycle model: both engines replayed with their sync waits, from the model file alone.

Each command's cycles come from tpubuild/codegen/cost.py, the formulas layer
group plans with, applied to what the command says (op, parameters, tile
shapes, element type) and the chip figures in the model header:

- GDMA: ``gdma_latency + bytes / (DDR bytes per cycle)`` at the bandwidth of
  its direction, bytes being what crosses the DDR interface (DDR2DDR pays its
  read and its write);
- BDC on local tiles: ``bdc_overhead`` + cube MAC cycles + vector cycles, with
  channels spread over lanes (``ceil(C / lanes)`` per lane);
- global BDC (DDR operands or results): its DDR tensors each cost one transfer,
  serialised with the compute (no overlap credited).

The replay starts each command when its engine is free and its wait is met,
so loads overlap compute exactly as far as the waits allow. Every command
takes at least one cycle, so a command always ends after the ones it waits
for start -- the simulator relies on that for its order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tpubuild.build.chips import Chip
from tpubuild.codegen import commands as cmd
from tpubuild.codegen import cost
from tpubuild.codegen.commands import Bdc, Gdma, Space
from tpubuild.codegen.model_file import ModelFile


def _shapes(tensors) -> list[tuple[int, ...]]:
    return [t.view if t.space != Space.NONE else () for t in tensors]


def _compute_dtype(b: Bdc) -> str:
    """What the op computes in: its first operand's type (as layer group's estimate takes it)."""
    return next((t.dtype for t in b.operands if t.space != Space.NONE), b.results[0].dtype)


def global_bytes(b: Bdc) -> tuple[list[int], list[int]]:
    """The bytes a Bdc reads of each DDR operand (cost.ddr_reads: of a Gather's table only the rows it takes) and
    writes of each DDR result: none for a local one."""
    sizes = [t.size() * cmd.itemsize(t.dtype) if t.space == Space.DDR else 0 for t in b.operands]
    reads = cost.ddr_reads(b.op, _shapes(b.operands), _shapes(b.results), sizes)
    return (
        [r for r, t in zip(reads, b.operands, strict=True) if t.space == Space.DDR],
        [t.size() * cmd.itemsize(t.dtype) for t in b.results if t.space == Space.DDR],
    )


def bdc_cycles(chip: Chip, b: Bdc, params) -> int:
    """``chip``: the header's figures as a Chip (``ChipParams.to_chip()``)."""
    ins, outs = _shapes(b.operands), _shapes(b.results)
    if b.is_global:
        reads, writes = global_bytes(b)
        cycles = cost.global_cycles(chip, b.op, params, ins, outs, _compute_dtype(b), reads, writes)
    else:
        cycles = cost.bdc_cycles(chip, b.op, params, ins, outs, _compute_dtype(b))
    return max(1, cycles)


def gdma_cycles(chip: Chip, g: Gdma) -> int:
    read, written = g.ddr_bytes()
    if g.direction == cmd.Direction.DDR2DDR:
        return max(1, cost.copy_cycles(chip, read))
    return max(1, cost.gdma_cycles(chip, read + written, store=g.direction == cmd.Direction.STORE))


def bdc_macs(b: Bdc, params) -> int:
    """The op's true multiply-accumulates (no lane or EU padding)."""
    return cost.true_macs(b.op, params, _shapes(b.operands), _shapes(b.results))


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
    chip = model.header.chip.to_chip()
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
    g_busy = sum(e - s for s, e in zip(schedule.gdma_start, schedule.gdma_end, strict=True))
    b_busy = sum(e - s for s, e in zip(schedule.bdc_start, schedule.bdc_end, strict=True))
    g_read = sum(g.ddr_bytes()[0] for g in model.gdma)
    g_write = sum(g.ddr_bytes()[1] for g in model.gdma)
    moved = [global_bytes(b) for b in model.bdc]
    b_read = sum(sum(reads) for reads, _ in moved)
    b_write = sum(sum(writes) for _, writes in moved)
    ops: dict[str, dict] = {}
    total_macs = 0
    for b, p, s, e in zip(model.bdc, bdc_params, schedule.bdc_start, schedule.bdc_end, strict=True):
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
        "gdma": {
            "commands": len(model.gdma),
            "busy_cycles": g_busy,
            "utilisation": g_busy / total if total else 0.0,
            "read_bytes": g_read,
            "write_bytes": g_write,
        },
        "bdc": {
            "commands": len(model.bdc),
            "busy_cycles": b_busy,
            "utilisation": b_busy / total if total else 0.0,
            "macs": total_macs,
            "global_commands": sum(int(b.is_global) for b in model.bdc),
            "read_bytes": b_read,
            "write_bytes": b_write,
        },
        "ops": dict(sorted(ops.items())),
    }


def copy_profile(profile: dict) -> dict:
    """A copy of ``profile()``'s dict whose nested dicts are its own (each run of a prepared program
    returns one: deepcopy took a seventh of a small model's run)."""
    out = dict(profile)
    out["gdma"], out["bdc"] = dict(profile["gdma"]), dict(profile["bdc"])
    out["ops"] = {op: dict(row) for op, row in profile["ops"].items()}
    return out
