"""canonical.mlir + calibration samples -> calibration table -> cali.mlir.

1. ``held_back``: a few calibration samples, spread over the set, are
   held back from the statistics (``validation_samples`` gives them): inputs the thresholds were not fitted
   to, among those the mixed-precision search may judge INT8 on (lower/search.py).
2. ``collect_stats``: TOP inference one sample at a time; an observer feeds
   every float activation tensor (graph inputs included) into its streaming
   statistics, and tensors are freed after their last use. With two
   processes (tpubuild.forked), a forked one takes every other sample and its
   statistics are merged: exactly those of one process.
3. ``compute_entries``: a threshold per tensor by the manifest's method
   (thresholds.py), by default ``auto`` (tune.py: per tensor, the candidate
   of every method that disturbs its consumers least), except for results of
   bounded ops (Sigmoid, HardSigmoid, Softmax, Tanh: ``BOUNDED``), whose
   threshold is the op's bound once the data comes near it, the observed max
   otherwise; min and max are the observed ones. Two more rules, whatever the
   method: a tensor of at most ``VECTOR_SIZE`` values per sample (pooled
   features, logits) takes its max, and a tensor read only by ops that
   saturate (HardSigmoid, Clip, Sigmoid, Tanh), directly or through ops that
   only move values (Reshape, Concat, ...: ``MOVES``), is clipped where their
   result stops changing.
4. A user table (the manifest's ``calibration.table``) wins: its entries
   replace computed ones, and when it covers every tensor no inference runs.
5. ``apply_table``: every calibrated tensor's type becomes
   ``!quant.calibrated<f32<lo:hi>>`` and ``module.state`` TOP_CALIBRATED.
   As TPU-MLIR's import-calibration-table (symmetric), [lo, hi] is [-T, T],
   or [0, T] for a tensor whose min is >= 0; the table keeps the observed
   min/max for asymmetric lowering.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
from xdsl.dialects.builtin import FunctionType, ModuleOp, TensorType
from xdsl.ir import SSAValue
from xdsl.rewriter import Rewriter

from tpubuild import forked
from tpubuild.calib import thresholds as th
from tpubuild.calib.qdq import qdq_entries
from tpubuild.calib.stats import BINS, TensorStats
from tpubuild.calib.table import Entry
from tpubuild.errors import TpuBuildError
from tpubuild.ir import mlir
from tpubuild.ir.base import TensorOp
from tpubuild.ir.quant import CalibratedType
from tpubuild.ir import top
from tpubuild.ir.top import ClipOp, ConcatOp, HardSigmoidOp, NoneOp, ReluOp, SigmoidOp, SoftmaxOp, TanhOp, WeightOp
from tpubuild.ir.types import numpy_dtype
from tpubuild.ir.weights import WeightStore

METHOD_NAMES = (*th.METHODS, "auto")
# held back from the statistics for validation: at most this many; a set of fewer than VALIDATION_EVERY
# samples holds none back (the search then judges on calibration samples, as TPU-MLIR's does)
VALIDATION_SAMPLES = 8
# every VALIDATION_EVERY-th sample is held back: spread over a set in sorted file order, which often groups
# one kind of input (pages, then lines), and decided by the index alone, so one pass reads the set
VALIDATION_EVERY = 5
# auto's candidates (the first of two closer than CANDIDATE_GAP is kept)
AUTO_CANDIDATES = ("kl", "mse", "percentile", "max")
CANDIDATE_GAP = 0.01
# ops whose results lie in a fixed interval: no outlier can stretch their range, and the values
# near its end are the signal (a probability near 1), so their threshold is the observed max
# whatever the method. KL put PP-OCRv4 det's sigmoid map (88% near 0, 12% near 1) at 0.25:
# every text pixel saturated below DB's 0.3 threshold and the INT8 map found no text at all.
BOUNDED = (SigmoidOp, HardSigmoidOp, SoftmaxOp, TanhOp)
# Their bound is 1 (|x| <= 1 for Tanh). A calibration set that reaches this share of it shows that the op
# saturates on this data, and values up to the bound are to be expected on other inputs: the bound is the
# threshold. A 4-way document classifier calibrated on pages of one orientation saw probabilities up to 0.926,
# and its INT8 output capped every surer image there. A set that stays far below (a 1000-class softmax, whose
# probabilities stay under 0.01 on photographs) keeps its observed max: the bound would waste its levels.
BOUND_REACHED = 0.5
# A tensor this small per sample is a vector of per-image features (a squeeze-excite block's pooled
# channels, a classifier's logits): every value is signal, and a few hundred values per sample are too
# few for a histogram method to tell an outlier from the feature that decides the output. KL clipped
# mini_mobilenet's pooled SE features at 1.35 where photographs reach 2.3, which moved the gates of
# every channel: output cosine 0.35 on a held-out photograph, 0.92 with the max.
VECTOR_SIZE = 1024


def held_back(index: int) -> bool:
    """Is calibration sample ``index`` (in the order read) held back from the statistics for validation?"""
    return index % VALIDATION_EVERY == VALIDATION_EVERY - 1 and index < VALIDATION_EVERY * VALIDATION_SAMPLES


def statistics_samples(samples: Iterable[Mapping[str, np.ndarray]]) -> Iterator[Mapping[str, np.ndarray]]:
    """The samples the statistics read: all but those ``held_back``."""
    return (sample for i, sample in enumerate(samples) if not held_back(i))


def validation_samples(samples: Iterable[Mapping[str, np.ndarray]]) -> list[Mapping[str, np.ndarray]]:
    """The samples ``held_back`` for validation, in order."""
    limit = VALIDATION_EVERY * VALIDATION_SAMPLES
    return [sample for i, sample in enumerate(itertools.islice(iter(samples), limit)) if held_back(i)]


# Sigmoid and Tanh only approach their ends: where they stop changing depends on the resolution of their
# result, taken as 16 bits over its range. An INT8 result (256 levels) would stop sooner, but a detector's
# score sigmoid stays float (after the last conv: lower/int8.output_tail), and there the 8-bit bound, -6.2,
# turned every background anchor's score from 0 into 0.002: over YOLOv8's 3549 anchors x classes, that
# outweighed the few real scores (cosine 0.73).
RESULT_LEVELS = 2**16 - 1


def _hardsigmoid_bound(op, out) -> float:
    a, b = op.params.alpha, op.params.beta  # 0 at -b/a, 1 at (1-b)/a
    return max(abs(b / a), abs((1 - b) / a))


def _clip_bound(op, out) -> float:
    return max(abs(op.params.min), abs(op.params.max))


def _relu_bound(op, out) -> float:
    return op.params.relu_limit if op.params.relu_limit > 0 else math.inf


def _sigmoid_bound(op, out) -> float:
    # past ln(2/s - 1) the result is within half a step s of 0 or 1 (s: RESULT_LEVELS steps over its range)
    step = out.threshold / RESULT_LEVELS
    return math.log(2 / step - 1) if 0 < step < 2 else math.inf


def _tanh_bound(op, out) -> float:
    step = out.threshold / (RESULT_LEVELS // 2)
    return math.atanh(1 - step / 2) if 0 < step < 2 else math.inf


# op -> (op, its result's entry) -> the |x| beyond which its result no longer changes. A tensor read only
# by such ops needs no threshold above the largest of their bounds: PP-OCRv4 det's squeeze-excite gates read
# convolutions calibrated to 95, which left 8 of the 256 input levels to HardSigmoid's whole (-3, 3) slope.
SATURATES = {
    HardSigmoidOp: _hardsigmoid_bound,
    ClipOp: _clip_bound,
    ReluOp: _relu_bound,
    SigmoidOp: _sigmoid_bound,
    TanhOp: _tanh_bound,
}

# A value read only through these (a Concat's every operand, the others' operand 0) saturates where their
# results' readers do.
MOVES = (*top.MOVE_OPS, top.PadOp, ConcatOp)


def activation_values(module: ModuleOp) -> dict[str, SSAValue]:
    """Every float activation tensor by name, in program order (weights and None excluded)."""
    found: dict[str, SSAValue] = {}
    for op in mlir.body_ops(module):
        if not isinstance(op, TensorOp) or isinstance(op, (WeightOp, NoneOp)):
            continue
        for value, name in zip(op.results, op.names, strict=True):
            if isinstance(value.type, TensorType) and numpy_dtype(value.type.element_type).kind == "f":
                found[name] = value
    return found


def collect_stats(
    module: ModuleOp,
    weights: WeightStore,
    samples: Iterable[Mapping[str, np.ndarray]],
    outputs: list | None = None,
    processes: int = 1,
    hold_back: bool = False,
) -> tuple[dict[str, TensorStats], int]:
    """Streaming statistics of every float activation tensor, and the number of samples they saw (with
    ``hold_back``, all but those ``held_back``); with ``outputs``, (sample, its graph outputs in order) appended
    there for each sample, held back ones included. With ``processes`` 2, a forked process
    runs the odd samples (both read the stream; the statistics merge exactly: the same as one process's)."""
    from tpubuild.top.inference import Plan

    tensors = list(activation_values(module))
    plan = Plan(module, weights)
    names = mlir.output_names(module)

    def part(first: int, step: int) -> tuple[dict[str, TensorStats], int, list]:
        return _stats_part(plan, tensors, names, samples, first, step, hold_back, outputs is not None)

    (stats, n, kept), *others = forked.every_other(part, processes, "calibration")
    for theirs, m, their_kept in others:
        for name, s in stats.items():
            s.merge(theirs[name])
        n, kept = n + m, sorted(kept + their_kept, key=lambda entry: entry[0])
    if outputs is not None:
        outputs.extend((sample, found) for _, sample, found in kept)
    return stats, n


def _stats_part(
    plan,
    tensors: list[str],
    names: list[str],
    samples: Iterable[Mapping[str, np.ndarray]],
    first: int,
    step: int,
    hold_back: bool,
    keep: bool,
) -> tuple[dict[str, TensorStats], int, list]:
    """collect_stats over samples first, first + step...: the statistics, how many samples they saw, and with
    ``keep``, each sample's (index, sample, graph outputs)."""
    stats = {name: TensorStats() for name in tensors}

    def observe(op, args, results) -> None:
        for name, array in zip(op.names, results, strict=True):
            if name in stats:
                try:
                    stats[name].update(array)
                except ValueError as err:
                    raise TpuBuildError(
                        f"cannot calibrate: {err}", loc=name, hint="check the calibration data and its preprocess"
                    ) from None

    n, kept = 0, []
    for i, sample in enumerate(samples):
        if i % step != first:
            continue
        # validation samples stay out of the statistics, and run only to keep their outputs for the search
        if hold_back and held_back(i):
            if not keep:
                continue
            found = plan.run(sample, all_tensors=False)
        else:
            found = plan.run(sample, all_tensors=False, observer=observe)
            n += 1
        if keep:
            kept.append((i, sample, [found[name] for name in names]))
    return stats, n, kept


def compute_entries(
    module: ModuleOp,
    weights: WeightStore,
    stats: Mapping[str, TensorStats],
    method: str,
    tune_samples: Iterable[Mapping[str, np.ndarray]] = (),
    grid: Mapping[str, Entry] | None = None,
    processes: int = 1,
) -> dict[str, Entry]:
    """A table entry per tensor: the method's threshold and the observed min and max; ``grid``'s entries (a
    QDQ model's own quantization, qdq.py) replace those of the tensors it names. With ``processes`` 2, auto's
    candidates and tuning share the work with a forked process (the same table)."""
    values = activation_values(module)
    grid = grid or {}
    fixed = {name: _fixed_threshold(values.get(name), s) for name, s in stats.items()}
    fixed.update((name, grid[name].threshold) for name in stats if name in grid)
    if method == "auto":
        from tpubuild.calib.tune import tune

        # a tensor whose threshold a rule fixes is not tuned: its candidates would be thrown away
        candidates = _all_candidates({name: s for name, s in stats.items() if fixed[name] is None}, processes)
        candidates = {name: candidates.get(name, [0.0]) for name in stats}
        levels = {name: th.levels_for(s) for name, s in stats.items()}
        chosen = tune(module, weights, tune_samples, candidates, levels, processes)
    elif method in th.METHODS:
        chosen = {name: th.threshold(s, method) for name, s in stats.items()}
    else:
        raise TpuBuildError(f"unknown calibration method {method!r}; expected one of {list(METHOD_NAMES)}")
    chosen = {name: value if (rule := fixed[name]) is None else rule for name, value in chosen.items()}
    entries = {name: Entry(chosen[name], *_min_max(s)) for name, s in stats.items()}
    bounds = _saturation_bounds(values, entries)
    for name, entry in entries.items():
        bound = bounds.get(name, math.inf)
        if bound < entry.threshold:
            entries[name] = Entry(bound, entry.min, entry.max)
    entries.update((name, grid[name]) for name in entries if name in grid)
    return entries


def _fixed_threshold(value: SSAValue | None, s: TensorStats) -> float | None:
    """The threshold a rule fixes whatever the method (a bounded op's result, a per-sample vector), or None."""
    if isinstance(getattr(value, "owner", None), BOUNDED):
        return 1.0 if s.absmax >= BOUND_REACHED else th.threshold(s, "max")
    if 0 < s.count <= VECTOR_SIZE * s.samples:
        return th.threshold(s, "max")
    return None


def _saturation_bounds(values: Mapping[str, SSAValue], entries: Mapping[str, Entry]) -> dict[str, float]:
    """Per value by name, the largest |x| that changes what any reader computes: inf if one reader is not a
    saturating op (or the value is a graph output: the return op reads it). Ops that only move values (``MOVES``)
    pass their results' bounds back: YOLOv8's class logits reach their sigmoid through Reshape and Concat."""
    bounds: dict[SSAValue, float] = {}

    def bound(value: SSAValue) -> float:
        if value not in bounds:
            found = []
            for use in value.uses:
                op = use.operation
                rule = SATURATES.get(type(op))
                out = entries.get(op.names[0]) if rule is not None and isinstance(op, TensorOp) else None
                if rule is not None and out is not None:
                    found.append(rule(op, out))
                elif isinstance(op, MOVES) and (use.index == 0 or isinstance(op, ConcatOp)):
                    found.append(max((bound(r) for r in op.results), default=math.inf))
                else:
                    found.append(math.inf)
            bounds[value] = max(found, default=math.inf)
        return bounds[value]

    return {name: bound(value) for name, value in values.items()}


def _all_candidates(stats: Mapping[str, TensorStats], processes: int) -> dict[str, list[float]]:
    """``_candidates`` of each tensor; with ``processes`` 2, a forked process takes every other tensor."""
    names = list(stats)

    def part(first: int, step: int) -> dict[str, list[float]]:
        return {name: _candidates(stats[name]) for name in names[first::step]}

    halves = forked.every_other(part, processes, "calibration's thresholds")
    return {name: found for half in halves for name, found in half.items()}


def _candidates(s: TensorStats) -> list[float]:
    """The thresholds of auto's candidate methods, in this order, each at least CANDIDATE_GAP from those
    before it (a closer one changes the step by less than rounding does, and costs a run of every consumer)."""
    found: list[float] = []
    for m in AUTO_CANDIDATES:
        value = th.threshold(s, m)
        if all(abs(value - f) > CANDIDATE_GAP * max(value, f) for f in found):
            found.append(value)
    return found


def _min_max(s: TensorStats) -> tuple[float, float]:
    return (s.min, s.max) if s.count else (0.0, 0.0)


def calibrate(
    module: ModuleOp,
    weights: WeightStore,
    samples,
    method: str,
    user: Mapping[str, Entry] | None = None,
    outputs: list | None = None,
    processes: int = 1,
) -> tuple[dict[str, Entry], list[str]]:
    """The calibration table of ``module`` (entries in program order) and its header lines.

    ``samples`` is re-iterable (auto reads the first few samples again); ``user``
    entries win over computed ones, and cover every tensor, nothing is run.
    ``outputs``, ``processes``: as collect_stats's.
    """
    names = list(activation_values(module))
    user = dict(user or {})
    unknown = [n for n in user if n not in names]
    if unknown:
        shown = ", ".join(repr(n) for n in unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise TpuBuildError(
            f"the calibration table names tensors the model does not have: {shown}",
            hint="table names are the tensor names of canonical.mlir; the computed table "
            "build/<model>/cali_table lists them all",
        )
    header = [f"method: {method}", f"histogram number: {BINS}"]
    if all(n in user for n in names):
        computed: dict[str, Entry] = {}
        header = [f"method: table ({len(user)} entries from the user table)"]
    else:
        from tpubuild.calib.tune import tune_count

        stats, count = collect_stats(module, weights, samples, outputs, processes, hold_back=True)
        if count == 0:
            raise TpuBuildError("no calibration sample was read", hint="check calibration.data and calibration.count")
        tuned = tune_count(sum(s.count for s in stats.values()) / count)
        tune_samples = itertools.islice(statistics_samples(samples), tuned) if method == "auto" else ()
        grid = qdq_entries(module, weights)
        computed = compute_entries(module, weights, stats, method, tune_samples, grid, processes)
        header += [f"sample number: {count}"]
        if grid:
            header += [f"from the model's QuantizeLinear scales: {len(grid)} tensors"]
        header += [
            f"held back for validation: every {VALIDATION_EVERY}th of the first {VALIDATION_EVERY * VALIDATION_SAMPLES}"
        ]
        if method == "auto":
            header += [f"tune number: {min(count, tuned)}"]
        if user:
            header += [f"user table: {len(user)} entries replace computed ones"]
    entries = {n: user[n] if n in user else computed[n] for n in names}
    return entries, header


def apply_table(module: ModuleOp, entries: Mapping[str, Entry]) -> ModuleOp:
    """A copy of ``module`` whose tensors in ``entries`` have calibrated types; state TOP_CALIBRATED."""
    cali = module.clone()
    values = activation_values(cali)
    for name, entry in entries.items():
        value = values.get(name)
        if value is None:
            continue
        old = value.type
        assert isinstance(old, TensorType), old
        lo, hi = entry.calibrated_range()
        new = TensorType(CalibratedType.get(old.element_type, lo, hi), old.get_shape())
        Rewriter.replace_value_with_new_type(value, new)
    main = mlir.main_func(cali)
    outs = [v.type for v in mlir.return_op(cali).operands]
    main.function_type = FunctionType.from_lists(list(main.function_type.inputs.data), outs)
    mlir.set_module_attrs(cali, state="TOP_CALIBRATED")
    return cali


def check_state(module: ModuleOp, file: str) -> None:
    mlir.require_state(
        module, "TOP_F32", "calibration reads a float TOP module", hint="calibrate canonical.mlir", file=file
    )
