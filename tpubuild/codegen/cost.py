"""The chip's cost model: cycles of one GDMA transfer and of one BDC command, from the chip YAML.

One set of formulas serves the compiler (layer group's search estimates a
group from the commands it would emit) and the simulator's cycle model (which
replays the emitted commands), so a plan and its replay agree by construction.
Everything here works on plain data (op names, parameter dataclasses, shapes,
numpy dtypes) because the simulator sees only the model file.

- GDMA: ``gdma_latency + bytes / (DDR bytes per cycle)`` at the bandwidth of
  the transfer's direction (DDR -> local, or local -> DDR where the chip gives
  a store bandwidth); DDR -> DDR pays both.
- BDC on local tiles: ``bdc_overhead + MAC cycles + vector cycles + serial
  cycles``. Channels spread over lanes, so a tile with C channels keeps
  ``ceil(C / lanes)`` channels per lane and every per-lane count uses that. MAC
  cycles run on the cube at ``macs_per_lane_per_cycle[mode]``, reducing input
  channels in chunks of one EU (``eu_bytes / element size``); vector cycles
  process ``eu_bytes`` per lane per cycle, times a per-op factor (an exp costs
  more than an add); serial cycles are one element per lane per cycle.

Where the rates below are not the headline figures of the chip YAML they
follow TPU-MLIR's own cost model for bm1684x: the per-command cycles that
``model_deploy --debug`` writes to compiler_profile_0.txt (tpu-mlir 1.30.2,
PP-OCR cls, PP-OCRv4 rec and det in F32, BF16 and INT8; docs/backend.md,
"The cycle model against TPU-MLIR's"), joined per command to the tile shapes
in the bmodel's net_0.profile:

- table lookups (INT8 activations) and nearest resize run on the
  scatter-gather path, one element per lane per cycle whatever the dtype
  (Lut and Upsample SG commands: cycles = output elements per lane);
- a transposed conv runs as a conv over the zero-inserted input, so the cube
  works on the output grid with the whole kernel (Deconv CONV commands:
  cycles = output positions x kernel x EU-padded input channels / MAC rate,
  in INT8 and BF16 alike);
- integer convs accumulate in int32: a depthwise conv's taps and INT8
  average pooling run at int32 width (depthwise PorD: 16 taps per lane per
  cycle in INT8 as in F32; global average pool PorD: one input element per
  lane per cycle), and requantising the int32 result costs 3 vector passes
  over it for a conv (AR bias at 8 and RQDQ at 16 elements per cycle), 1 for
  a depthwise conv or a transposed conv (RQDQ only).
- pools with a window (not over the whole plane) run their taps at the EU's
  width in every dtype, each channel's output plane in whole EUs, three times
  over when strided (PorD: channels x k x ceil(plane / EU), x3); an average
  over windows of several sizes (padding not counted) rescales in two more
  passes (INT8: two AR commands at int32 width; F32/BF16 divide in about as
  many).
- A global op (one that reads and writes DDR directly) is charged one GDMA
  transfer per DDR operand and result and its compute, one after the other: no
  double buffering is credited to it, so the layer-group search prefers local
  groups whenever they fit.

Work per op is registered by op name without its dialect (``Conv`` serves
``top.Conv`` and ``tpu.Conv``); an unregistered op costs one vector pass over
its output.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpubuild.build.chips import Chip
from tpubuild.registry import Registry

Shape = Sequence[int]


@dataclass(frozen=True)
class Work:
    """What one command computes, per lane: cube MACs (already padded to the EU) and vector element-ops."""

    macs: float = 0.0
    vector: float = 0.0  # element-operations of `esize` bytes each
    serial: float = 0.0  # element-operations at one per lane per cycle (scatter-gather: lookups, gathers)


@dataclass(frozen=True)
class OpShape:
    """An op's shapes and element size as a cost formula sees them."""

    params: Any  # the op's PARAMS dataclass (its class depends on the op)
    ins: tuple[tuple[int, ...], ...]
    outs: tuple[tuple[int, ...], ...]
    esize: int  # bytes per element of the computation
    lanes: int
    eu_elems: int  # elements per EU
    integer: bool = False  # an integer computation (INT8 mode): accumulates and requantises in int32

    @property
    def acc_ratio(self) -> int:
        """Element-operations of ``esize`` bytes that one operation on the accumulator costs (int8 -> int32: 4)."""
        return max(4 // self.esize, 1) if self.integer else 1

    def per_lane(self, shape: Shape) -> int:
        """Elements of ``shape`` one lane holds (its ``nchw`` channel dim spread over lanes)."""
        n, c, h, w = nchw(shape)
        return n * math.ceil(c / self.lanes) * h * w

    def pad_eu(self, k: int) -> int:
        return math.ceil(k / self.eu_elems) * self.eu_elems


def nchw(shape: Shape, rank: int | None = None) -> tuple[int, int, int, int]:
    """The (n, c, h, w) view the chip lays a tensor out in, left-padded with 1s to ``rank`` first.

    [w] -> (1, 1, 1, w), [c, w] -> (1, c, 1, w), [n, c, w] -> (n, c, 1, w); rank > 4 folds the
    middle dims into h. Channel c lives in lane c % lanes.
    """
    s = tuple(int(d) for d in shape)
    if rank is not None and len(s) < rank:
        s = (1,) * (rank - len(s)) + s
    if len(s) == 0:
        return (1, 1, 1, 1)
    if len(s) == 1:
        return (1, 1, 1, s[0])
    if len(s) == 2:
        return (1, s[0], 1, s[1])
    if len(s) == 3:
        return (s[0], s[1], 1, s[2])
    return (s[0], s[1], int(np.prod(s[2:-1], dtype=np.int64)), s[-1])


WorkFn = Callable[[OpShape], Work]
_WORK = Registry("a cost formula")

# vector passes per output element: transcendental functions run as short polynomial/LUT sequences
VECTOR_FACTOR = {
    **dict.fromkeys(
        (
            "Exp",
            "Log",
            "Sigmoid",
            "Tanh",
            "Erf",
            "GELU",
            "SiLU",
            "Swish",
            "Softplus",
            "Mish",
            "Elu",
            "Celu",
            "Pow",
            "Sin",
            "Cos",
            "Tan",
            "Asin",
            "Acos",
            "Atan",
            "Sinh",
            "Cosh",
            "Asinh",
            "Acosh",
            "Atanh",
            "Softsign",
        ),
        8,
    ),
    **dict.fromkeys(("Div", "Reciprocal", "Sqrt", "HardSwish", "HardSigmoid", "Mod"), 4),
}


def work(*names: str) -> Callable[[WorkFn], WorkFn]:
    return _WORK.register(*names)


def bare_name(op: str) -> str:
    return op.split(".", 1)[-1]


@work("Conv")
def _conv(s: OpShape) -> Work:
    x, w = s.ins[0], s.ins[1]
    out = s.outs[0]
    group = getattr(s.params, "group", 1)
    k = int(np.prod(w[2:], dtype=np.int64))
    ic_per_group = x[1] // group
    positions = s.per_lane(out)
    if ic_per_group == 1:
        # depthwise: no input-channel reduction for the cube; the vector unit multiplies-accumulates (in int32
        # for an integer conv), and an integer result is requantised in one pass
        return Work(vector=positions * k * s.acc_ratio + _requant(s, positions, 1))
    return Work(macs=positions * k * s.pad_eu(ic_per_group), vector=_requant(s, positions, 3))


def _requant(s: OpShape, positions: int, passes: int) -> float:
    """Vector element-operations (of ``esize``) that requantise an integer conv's int32 result."""
    return positions * passes * s.acc_ratio if s.integer else 0.0


@work("Deconv")
def _deconv(s: OpShape) -> Work:
    x, w = s.ins[0], s.ins[1]
    group = getattr(s.params, "group", 1)
    k = int(np.prod(w[2:], dtype=np.int64))
    # a conv over the input with stride - 1 zeros inserted: the cube sweeps the whole kernel at every output
    # position, zeros included (TPU-MLIR's cost model charges the same)
    positions = s.per_lane(s.outs[0])
    return Work(macs=positions * k * s.pad_eu(max(x[1] // group, 1)), vector=_requant(s, positions, 1))


@work("MatMul")
def _matmul(s: OpShape) -> Work:
    out = s.outs[0]
    if len(out) < 2:
        return Work(vector=s.per_lane(out))
    k = s.ins[0][-1]
    m, n = out[-2], out[-1]
    batch = int(np.prod(out[:-2], dtype=np.int64))
    # the compiler puts whichever of rows or columns fills the lanes better on lanes
    per_lane = min(math.ceil(m / s.lanes) * n, math.ceil(n / s.lanes) * m)
    return Work(macs=batch * per_lane * s.pad_eu(k))


@work("MaxPool", "MaxPoolWithMask")
def _pool(s: OpShape) -> Work:
    k = int(np.prod(s.params.kernel_shape, dtype=np.int64))
    if _is_global(s):
        return Work(vector=s.per_lane(s.outs[0]) * k)
    return Work(vector=_plane_eus(s) * k * (3 if any(st > 1 for st in s.params.strides) else 1))


def _sizes_vary(p) -> bool:
    """Whether an average pool's windows hold different numbers of elements (padding not counted): an INT8 one
    lists the sizes it has a multiplier for."""
    counts = getattr(p, "counts", ())
    return len(counts) > 1 if counts else any(p.pads) and not getattr(p, "count_include_pad", False)


def _is_global(s: OpShape) -> bool:
    return math.prod(s.outs[0][2:]) == 1


def _plane_eus(s: OpShape) -> int:
    """Element-operations of one vector pass over the output, each channel's plane in whole EUs (a pool's)."""
    n, c, h, w = nchw(s.outs[0])
    return n * math.ceil(c / s.lanes) * s.pad_eu(h * w)


@work("AvgPool")
def _avgpool(s: OpShape) -> Work:
    if not _is_global(s):
        # the taps as a max pool's; windows of several sizes (padding not counted) rescale their sums by their
        # own multipliers (INT8) or divisors in two more passes over the output (int32 wide for INT8)
        taps = _pool(s).vector
        return Work(vector=taps + 2 * _plane_eus(s) * s.acc_ratio if _sizes_vary(s.params) else taps)
    if not s.integer:
        return _pool(s)
    # a global pool, summed in int32 and rescaled: TPU-MLIR's cost model takes one input element per lane per cycle
    return Work(serial=s.per_lane(s.outs[0]) * int(np.prod(s.params.kernel_shape, dtype=np.int64)))


@work("Lut")
def _lut(s: OpShape) -> Work:
    # a table lookup per element on the scatter-gather path
    return Work(serial=s.per_lane(s.outs[0]))


@work("Softmax", "LogSoftmax")
def _softmax(s: OpShape) -> Work:
    # max, subtract+exp, sum, divide
    return Work(vector=s.per_lane(s.outs[0]) * (1 + VECTOR_FACTOR["Exp"] + 1 + VECTOR_FACTOR["Div"]))


@work("LayerNorm", "RMSNorm", "InstanceNorm", "GroupNorm")
def _norm(s: OpShape) -> Work:
    # mean, variance, rsqrt, scale and shift
    return Work(vector=s.per_lane(s.outs[0]) * 6)


@work("BatchNorm")
def _batchnorm(s: OpShape) -> Work:
    return Work(vector=s.per_lane(s.outs[0]) * 2)


@work("Reshape", "Identity")
def _free(s: OpShape) -> Work:
    return Work()


@work("Reduce")
def _reduce(s: OpShape) -> Work:
    return Work(vector=s.per_lane(s.ins[0]))


@work("Interp")
def _interp(s: OpShape) -> Work:
    if getattr(s.params, "mode", "nearest") == "nearest":
        # a gather of one source element per output element on the scatter-gather path
        return Work(serial=s.per_lane(s.outs[0]))
    # (bi)linear: four taps per output element
    return Work(vector=s.per_lane(s.outs[0]) * 4)


@work("GridSample")
def _grid_sample(s: OpShape) -> Work:
    # each output element gathers its taps from anywhere in the input: the scatter-gather path, tap by tap
    per_axis = {"nearest": 1, "linear": 2, "cubic": 4}[getattr(s.params, "mode", "linear")]
    return Work(serial=s.per_lane(s.outs[0]) * per_axis ** (len(s.outs[0]) - 2))


def _elementwise(name: str, s: OpShape) -> Work:
    passes = max(len(s.ins) - 1, 1) * VECTOR_FACTOR.get(name, 1)
    return Work(vector=s.per_lane(s.outs[0]) * passes)


MODE_OF_DTYPE = {"int8": "INT8", "uint8": "INT8", "float16": "F16", "bfloat16": "BF16", "float32": "F32"}


def compute_mode(chip: Chip, dtype: np.dtype | str) -> str:
    """The MAC rate a computation on ``dtype`` runs at (int32 and wider run at the slowest float rate)."""
    mode = MODE_OF_DTYPE.get(np.dtype(dtype).name if not isinstance(dtype, str) else dtype)
    rates = dict(chip.macs)
    if mode in rates:
        return mode
    return min(rates, key=lambda m: rates[m])


def op_shape(
    chip: Chip, params, in_shapes: Sequence[Shape], out_shapes: Sequence[Shape], dtype: np.dtype | str
) -> OpShape:
    dt = _dtype(dtype)
    return OpShape(
        params=params,
        ins=tuple(tuple(int(d) for d in s) for s in in_shapes),
        outs=tuple(tuple(int(d) for d in s) for s in out_shapes),
        esize=dt.itemsize,
        lanes=chip.lanes,
        eu_elems=max(chip.eu_bytes // dt.itemsize, 1),
        integer=dt.kind in "iu",
    )


def _dtype(dtype: np.dtype | str) -> np.dtype:
    if isinstance(dtype, str):
        from tpubuild.ir.types import dtype_from_name

        return np.dtype(dtype_from_name(dtype))
    return np.dtype(dtype)


def op_work(op: str, s: OpShape) -> Work:
    name = bare_name(op)
    fn = _WORK.get(name)
    return fn(s) if fn else _elementwise(name, s)


def compute_cycles(
    chip: Chip, op: str, params, in_shapes: Sequence[Shape], out_shapes: Sequence[Shape], dtype: np.dtype | str
) -> float:
    """Cycles of the op's arithmetic alone (no command overhead)."""
    s = op_shape(chip, params, in_shapes, out_shapes, dtype)
    w = op_work(op, s)
    mac_cycles = w.macs / chip.macs_per_lane(compute_mode(chip, dtype))
    vector_cycles = w.vector * s.esize / chip.eu_bytes
    return mac_cycles + vector_cycles + w.serial


def bdc_cycles(
    chip: Chip, op: str, params, in_shapes: Sequence[Shape], out_shapes: Sequence[Shape], dtype: np.dtype | str
) -> int:
    """One BDC command on local tiles of these shapes."""
    return chip.bdc_overhead + math.ceil(compute_cycles(chip, op, params, in_shapes, out_shapes, dtype))


def gdma_cycles(chip: Chip, nbytes: int, store: bool = False) -> int:
    """One GDMA transfer of ``nbytes`` DDR -> local (``store``: local -> DDR)."""
    bw = chip.ddr_store_bytes_per_cycle if store else chip.ddr_bytes_per_cycle
    return chip.gdma_latency + math.ceil(nbytes / bw)


def copy_cycles(chip: Chip, nbytes: int) -> int:
    """One DDR -> DDR transfer of ``nbytes``: it reads and writes each byte."""
    return chip.gdma_latency + math.ceil(nbytes / chip.ddr_bytes_per_cycle + nbytes / chip.ddr_store_bytes_per_cycle)


def ddr_reads(op: str, in_shapes: Sequence[Shape], out_shapes: Sequence[Shape], nbytes: Sequence[int]) -> list[int]:
    """Bytes a global op reads of each DDR operand (``nbytes``: the operands' sizes): all of them, but a Gather
    reads of its table only the rows it takes (the indexed rows' DMA, as TPU-MLIR's gather does: an embedding
    lookup reads 32 rows of a 30522-row table, not the table)."""
    reads = list(nbytes)
    if bare_name(op) == "Gather" and reads and in_shapes and out_shapes and math.prod(in_shapes[0]):
        itemsize = reads[0] // math.prod(in_shapes[0])
        reads[0] = min(reads[0], math.prod(out_shapes[0]) * itemsize)
    return reads


def global_cycles(
    chip: Chip,
    op: str,
    params,
    in_shapes: Sequence[Shape],
    out_shapes: Sequence[Shape],
    dtype: np.dtype | str,
    reads: Sequence[int],
    writes: Sequence[int] = (),
) -> int:
    """An op that streams its operands from DDR and its results back (a global BDC command); ``reads``,
    ``writes``: the bytes read of each DDR operand (``ddr_reads``) and written of each result, each one GDMA
    transfer."""
    compute = compute_cycles(chip, op, params, in_shapes, out_shapes, dtype)
    return (
        chip.bdc_overhead
        + sum(gdma_cycles(chip, b) for b in reads)
        + sum(gdma_cycles(chip, b, store=True) for b in writes)
        + math.ceil(compute)
    )


def true_macs(op: str, params, in_shapes: Sequence[Shape], out_shapes: Sequence[Shape]) -> int:
    """The op's multiply-accumulates as arithmetic counts them (no lane or EU padding): the roofline's numerator."""
    name = bare_name(op)
    if name == "Conv":
        x, w, out = in_shapes[0], in_shapes[1], out_shapes[0]
        group = getattr(params, "group", 1)
        return int(np.prod(out, dtype=np.int64)) * int(np.prod(w[2:], dtype=np.int64)) * (x[1] // group)
    if name == "Deconv":
        x, w = in_shapes[0], in_shapes[1]
        return int(np.prod(x, dtype=np.int64)) * int(np.prod(w[1:], dtype=np.int64))
    if name == "MatMul" and len(out_shapes[0]) >= 2:
        return int(np.prod(out_shapes[0], dtype=np.int64)) * int(in_shapes[0][-1])
    return 0


def attainable_cycles(
    chip: Chip, op: str, params, in_shapes: Sequence[Shape], out_shapes: Sequence[Shape], dtype: np.dtype | str
) -> float:
    """The fewest BDC cycles the op can take on this chip: one command's overhead plus its work on the
    unit that runs it (cube MACs at the dtype's rate, vector element-ops at one EU per cycle), spread
    evenly over every lane with no EU padding. The chip roofline's per-op term (bench/backend.py)."""
    dt = _dtype(dtype)
    s = OpShape(
        params=params,
        ins=tuple(tuple(int(d) for d in x) for x in in_shapes),
        outs=tuple(tuple(int(d) for d in x) for x in out_shapes),
        esize=dt.itemsize,
        lanes=1,
        eu_elems=1,
        integer=dt.kind in "iu",
    )
    w = op_work(op, s)
    mac = w.macs / (chip.lanes * chip.macs_per_lane(compute_mode(chip, dtype)))
    return chip.bdc_overhead + mac + w.vector * dt.itemsize / (chip.eu_bytes * chip.lanes) + w.serial / chip.lanes


def cycles_to_ms(chip: Chip, cycles: float) -> float:
    return cycles / (chip.clock_mhz * 1e3)
