"""Mixed-precision search: the fewest tensors to keep in float so that an INT8 model reaches a target cosine.

TPU-MLIR's version is search_qtable (run_qtable). The result is a quantize table
(tpubuild/lower/qtable.py), readable and editable like a hand-written one.

The unit moved to float is a *tensor*: its producer and every op that reads it
compute in the float mode, so the tensor is never quantized and neither is its
producer's arithmetic. (Pinning one op alone changes little: its output is still
quantized, at the same calibrated scale, for the INT8 ops that read it.) An op
that an INT8 table absorbs (a chain of hardswish, x * a + b...) brings its whole
chain along, or the rest of the chain would start from a new quantization.

The score of a quantize table: lower the calibrated module with it, run TPU
inference on a few calibration samples, and take the lowest cosine of any graph
output against TOP inference (float32), over outputs, their parts and samples
(part_cosines). The samples scored are the ``samples`` of a ``pool`` of
calibration samples (search_pool) where INT8 alone is furthest from float: a
table that just reaches the target on easy samples can miss it on the others by
far (MiniLM on cv183x: a table searched on the first 4 sentences scored 0.990
there, 0.964 on the 18th and 0.976 on the test sentence), and an input that
wrecks INT8 most shows the tensors that matter.

1. The quantized tensors, in program order, are cut into ``chunks`` contiguous
   groups; each group alone in float is scored.
2. Greedy: groups join the table, the most useful first, until the score reaches
   the target. (A single culprit shows up as one group's score; error that
   accumulates over many layers, as in PP-OCRv4 rec, only as several.)
3. Prune, by halves (delta debugging): each chosen group, least useful first,
   leaves the table if the target still holds without it; a group that must
   stay is split in two and each half tried in turn, down to a tenth of the
   tensors (PRUNE_PARTS; single tensors in a small model).
4. The table is scored on the whole pool. Where it misses the target, the
   ``samples`` worst of those samples join the ones scored, and steps 2 and 3
   go on from the table (the groups that join it are pruned), until it holds on
   the whole pool: the tensors that matter on the first samples are seldom all
   that matter (mini_mobilenet: 8 of its 32 below 0.99 with the table of its 4).

Every score is a real lowering and TPU inference; ``max_lowerings`` bounds the
cost, and a target not reached is reported in the table's header. The user's
quantize table is the starting point: its entries stay as written and an op it
names is never re-pinned.

With ``processes=2``, a forked process scores half of the samples of the pool
(INT8 inference of each, and TOP's unless calibration left it; a quarter of the
search on PP-OCRv4 rec) and of the chunks alone in float (step 1; it lowers each
chunk's table itself): the same scores, so the same result. The greedy and
pruning steps each ask about one table and most stop at their first sample, so
splitting samples leaves a second process little to share; instead it works
ahead (``_Ahead``), when a core is free for it (``spare_core``): while this
process evaluates a step's table, the forked one evaluates the table the next
step asks about if this one falls short (the next greedy table; the next pruning
candidate, as most candidates fail). The search takes a result from there only
for the very table, sample order and stop it would have evaluated itself, and
counts its lowering as its own: the same steps, the same result.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from xdsl.dialects.builtin import ModuleOp, TensorType
from xdsl.ir import SSAValue

from tpubuild import forked
from tpubuild.build.chips import Chip
from tpubuild.calib.data import Samples, sample_count, samples_at
from tpubuild.calib.table import Entry
from tpubuild.ir import mlir
from tpubuild.ir.base import TensorOp
from tpubuild.ir.top import InputOp, WeightOp
from tpubuild.ir.types import elem_of
from tpubuild.ir.weights import WeightStore
from tpubuild.lower.inference import dequantize
from tpubuild.lower.lowering import Lowering
from tpubuild.lower.quant import QType
from tpubuild.top.inference import Memo, Plan
from tpubuild.verify.parts import Part, concat_parts, int8_step, is_tiny, part_step, tiny_bound
from tpubuild.verify.similarity import cosine, max_abs_error


# what a table must hold where the target is out of reach
FLOOR_COS = 0.99
# the quantize table's header line with the score of every tensor in the float mode, when that is below the
# target too (stages.int8_failure_hint reads it)
ALL_FLOAT_LINE = "with every op in"
# The bound on lowerings where the manifest sets none: DEFAULT_LOWERINGS, and for a model of fewer
# multiply-accumulates than CHEAP_MACS as many more as it has fewer, up to MOST_LOWERINGS. A lowering and
# its inference then cost little (mini_mobilenet, 13 million: 60 in 4 s; PP-OCRv6 tiny rec, 184 million: 0.3 s
# each), and a search that reaches the bound may end before its table is checked on the whole pool. With
# pruning down to single tensors, 60 left mini_mobilenet's table at 0.978 on a held-out photograph (0.993
# after the 125 it took to hold on the pool) and PP-OCRv6 tiny rec's at 0.957 on a held-out line (0.993 with
# 120); with PRUNE_PARTS, both end well before 60.
DEFAULT_LOWERINGS = 60
CHEAP_MACS = 500_000_000
MOST_LOWERINGS = 240
# Pruning splits a segment that must stay down to a tenth of the tensors, not to single ones: a table pruned
# to the last tensor just reaches the target on the samples scored and has no margin on others, and its
# pruning spent the budget the check on the whole pool needed (step 4). Held-out lowest, single tensors ->
# tenths: PP-OCRv6 tiny rec 0.9935 -> 0.9980 (162 -> 52 lowerings), PP-OCRv5 mobile rec 0.9737 -> 0.9869,
# nudenet's class scores on faces 0.9872 -> 0.9926, each table holding on its whole pool.
PRUNE_PARTS = 10


@dataclass(frozen=True)
class SearchConfig:
    """The manifest's ``mixed_precision`` options."""

    # a margin over the 0.99 an INT8 model should hold on inputs the search never scores: a table that just
    # reached 0.99 on the calibration pool left held-out inputs at 0.976 (ppocrv6_det), 0.982
    # (mini_mobilenet) and 0.984 (retinaface_mnet); one searched to 0.995 at 0.987, 0.990 and 0.993
    target_cos: float = 0.995
    samples: int = 4  # calibration samples scored: those of the pool where INT8 alone is worst
    pool: int = 32  # calibration samples they are chosen from, spread over the set
    chunks: int = 8  # contiguous groups of tensors tried first
    mode: str | None = None  # the float mode; None: the chip's (F16 on bm1684x)
    max_lowerings: int | None = None  # a bound on the search's cost; None: default_lowerings of the model

    @classmethod
    def of(cls, options: Mapping | None) -> SearchConfig:
        keys = {"target_cos", "samples", "pool", "chunks", "mode", "max_lowerings"}
        return cls(**{k: v for k, v in (options or {}).items() if k in keys})


@dataclass
class Unit:
    """A tensor kept in float: the qtable names of its producer and consumers that were INT8."""

    tensor: str
    ops: tuple[str, ...]
    score: float = math.nan  # the outputs' score with its chunk alone in float


# how much further from float INT8 alone's worst sample of the pool may be with bias corrections than without, for
# them to be kept: they take out an error that a pool of inputs the model is sure of hardly shows (PP-OCR cls
# calibrated on 19 text lines: 0.99951 without, 0.99941 with, while an unsure line went from 0.978 to 0.99998),
# and the pool shows it when they are wrong (PP-OCRv4 rec: 0.868 -> 0.782)
BIAS_SLACK = 1.25


@dataclass(frozen=True)
class BiasChoice:
    """Bias corrections offered to the search (lower/bias.py) and INT8 alone's scores over the pool without and with
    them: (lowest, mean of 1 - cos). They are kept when INT8 alone reaches the target with them, its worst sample
    no more than BIAS_SLACK times further from float than without. A model that needs float tensors anyway is
    searched without them: a table changes the model they were measured on, and with them mini_mobilenet's table
    (0.995 on the pool, as without) held a held-out photograph at 0.9885, not 0.9947."""

    offered: int
    plain: tuple[float, float]
    corrected: tuple[float, float]
    target: float

    @property
    def kept(self) -> bool:
        return self.corrected[0] >= self.target and 1 - self.corrected[0] <= BIAS_SLACK * (1 - self.plain[0])

    def line(self) -> str:
        (low, err), (low_c, err_c) = self.plain, self.corrected
        why = f" (below the target {self.target})" if low_c < self.target else ""
        return (
            f"bias corrections: {self.offered} ops, {'kept' if self.kept else 'not kept'}: INT8 alone over the pool "
            f"{low:.6f} -> {low_c:.6f} at worst, mean 1 - cos {err:.2e} -> {err_c:.2e}{why}"
        )


def _summary(scores: Sequence[float]) -> tuple[float, float]:
    return min(scores), float(np.mean([1.0 - c for c in scores]))


@dataclass
class SearchResult:
    table: dict[str, str]  # op name -> mode: the user's entries, then the search's
    user: dict[str, str]
    chosen: list[Unit]
    mode: str
    int8_score: float  # with the user table alone
    score: float  # with ``table``
    target: float
    samples: int  # scored
    lowerings: int
    pool: int = 0  # the calibration samples they were chosen from
    scored: tuple[int, ...] = ()  # which of the pool (indices)
    pool_score: float | None = None  # the table's score on the whole pool, when it was scored there
    float_macs: float = 0.0  # the share of the model's multiply-accumulates the table's ops do
    all_float: float | None = None  # the score with every tensor in float, when the search scored that table
    bias: BiasChoice | None = None  # the bias corrections offered, if any, and whether they were kept
    bias_corrections: dict[str, np.ndarray] = field(default_factory=dict)  # those kept: the table's lowerings'

    @property
    def reached(self) -> bool:
        return self.score >= self.target


def _elem(value: SSAValue):
    return value.type.element_type if isinstance(value.type, TensorType) else None


def _is_quantized(value: SSAValue) -> bool:
    return QType.of(_elem(value)) is not None


def part_cosines(
    test: np.ndarray, ref: np.ndarray, parts: Sequence[Part], thresholds: Mapping[str, float], name: str = ""
) -> list:
    """The cosine of ``test`` against ``ref`` (the output ``name``) whole, or of each of its ``parts``. A tiny
    part (its float values too small for its INT8 step for a cosine to mean anything: tpubuild/verify/parts.py),
    which verification judges by its largest error in steps, scores what a cosine would at the same share of its
    bound: 1 - (1 - FLOOR_COS) * (error / bound)^2, the floor at the bound (a cosine's shortfall grows as the
    square of the error), below it beyond. A one-element output has no direction: its cosine is 1 whenever
    the sign holds (a wake-word detector's probability 0.13 for float's 0.11 scored 1.000000, and the search
    kept nothing in float). It scores what a cosine would at its relative error e, 1 - e^2 / 2, or as a tiny
    part where its value is below its INT8 step."""
    if not parts:
        return [_scored(test, ref, int8_step([name], thresholds) if test.size == 1 else None)]
    found = []
    for part in parts:
        r = part.slice(ref)
        if r.size:
            found.append(_scored(part.slice(test), r, part_step(part, thresholds)))
    return found


def _scored(t: np.ndarray, r: np.ndarray, step: float | None) -> float:
    if step is not None and is_tiny(r, step):
        return 1.0 - (1.0 - FLOOR_COS) * (max_abs_error(t, r) / tiny_bound(step)) ** 2
    if r.size == 1 and r.item() != 0:
        rel = abs(t.item() - r.item()) / abs(r.item())
        return 1.0 - rel**2 / 2
    return cosine(t, r)


class Evaluator:
    """Lowers the calibrated module with a quantize table and scores its outputs against TOP inference."""

    def __init__(
        self,
        module: ModuleOp,
        weights: WeightStore,
        *,
        chip: Chip,
        cali: Mapping[str, Entry],
        asymmetric: bool,
        samples: Sequence[Mapping[str, np.ndarray]],
        processes: int = 1,
        refs: Mapping[int, Sequence[np.ndarray]] | None = None,
    ):
        from tpubuild.lower import int8  # noqa: F401  (registers the INT8 rules)

        self.module, self.weights, self.chip, self.cali, self.asymmetric = module, weights, chip, cali, asymmetric
        self.bias_corrections: Mapping[str, np.ndarray] | None = None  # every lowering's (lower/bias.py)
        self.samples = list(samples)
        self.active = list(range(len(self.samples)))  # the samples scored (keep)
        self.processes = processes
        # TOP's graph outputs per sample: those given (calibration's), the others made when first scored
        self.refs: dict[int, list[np.ndarray]] = {i: list(r) for i, r in (refs or {}).items()}
        self._plan: Plan | None = None
        self.lowerings = 0
        self.memo = Memo(self.samples)
        by_output = concat_parts(module)
        self.parts = [by_output.get(name, []) for name in mlir.output_names(module)]
        self.thresholds = {name: entry.threshold for name, entry in cali.items()}

    def ref(self, i: int) -> list[np.ndarray]:
        if i not in self.refs:
            if self._plan is None:
                self._plan = Plan(self.module, self.weights)
            top = self._plan.run(self.samples[i], all_tensors=False)
            self.refs[i] = [top[n] for n in mlir.output_names(self.module)]
        return self.refs[i]

    def lower(self, qtable: Mapping[str, str], counted: bool = True) -> tuple[Lowering, ModuleOp, WeightStore]:
        lw = Lowering(
            self.module,
            self.weights,
            chip=self.chip,
            mode="INT8",
            asymmetric=self.asymmetric,
            cali=self.cali,
            qtable=qtable,
            bias_corrections=self.bias_corrections,
        )
        tpu_module, tpu_weights = lw.run("tpu_weights.npz")
        self.lowerings += counted
        return lw, tpu_module, tpu_weights

    def sample_score(self, tpu_module: ModuleOp, tpu_weights: WeightStore, i: int) -> float:
        """Sample i's lowest cosine of any output, or of any part of an output a Concat made (part_cosines)."""
        names = mlir.output_names(tpu_module)
        types = [elem_of(v.type) for v in mlir.return_op(tpu_module).operands]
        out = self.memo.run(tpu_module, tpu_weights, i)
        return min(
            (
                c
                for n, t, r, parts in zip(names, types, self.ref(i), self.parts, strict=True)
                for c in part_cosines(dequantize(out[n], t), r, parts, self.thresholds, n)
            ),
            default=1.0,  # every output a set of empty parts
        )

    def per_sample(
        self,
        tpu_module: ModuleOp,
        tpu_weights: WeightStore,
        order: Sequence[int] | None = None,
        stop_below: float | None = None,
    ) -> dict[int, float]:
        """Each scored sample's lowest cosine of any output, in ``order``; with ``stop_below``, none after the
        first sample below it (its score is then all that matters)."""
        found = {}
        for i in self.active if order is None else order:
            found[i] = self.sample_score(tpu_module, tpu_weights, i)
            if stop_below is not None and found[i] < stop_below:
                break
        return found

    def pool_scores(self, tpu_module: ModuleOp, tpu_weights: WeightStore) -> list[float]:
        """Every sample's score, scored or not (per_sample); with two processes the odd samples are scored in a
        forked one, which sends their scores and TOP outputs (their INT8 tensors stay there: the memo computes
        those of the samples kept when a step first needs them)."""
        every = range(len(self.samples))
        if not self._shared(every):
            return list(self.per_sample(tpu_module, tpu_weights, every).values())
        evens, odds = _alternate(every)
        found, theirs = forked.alongside(
            lambda: {i: self.sample_score(tpu_module, tpu_weights, i) for i in evens},
            lambda: {i: (self.sample_score(tpu_module, tpu_weights, i), self.ref(i)) for i in odds},
            _WHAT,
        )
        for i, (score, ref) in theirs.items():
            found[i] = score
            self.refs.setdefault(i, ref)
        return [found[i] for i in range(len(self.samples))]

    def score_tables(self, tables: Sequence[Mapping[str, str]]) -> list[dict[int, float]]:
        """score(table) of each table, each lowering counted; with two processes the odd samples are scored in
        a forked one, which lowers each table itself."""
        if not self._shared(self.active):
            return [self.score(t) for t in tables]
        evens, odds = _alternate(self.active)

        def scores(indices: list[int], counted: bool) -> list[dict[int, float]]:
            found = []
            for table in tables:
                _, tpu_module, tpu_weights = self.lower(table, counted)
                found.append({i: self.sample_score(tpu_module, tpu_weights, i) for i in indices})
            return found

        mine, theirs = forked.alongside(lambda: scores(evens, True), lambda: scores(odds, False), _WHAT)
        return [{i: {**a, **b}[i] for i in self.active} for a, b in zip(mine, theirs, strict=True)]

    def _shared(self, indices: Sequence[int]) -> bool:
        """Whether a forked process takes half of these samples."""
        return self.processes > 1 and len(indices) > 1

    def keep(self, indices: Sequence[int]) -> None:
        """Score only these samples from now on (their tensors of the runs so far stay in the memo, the others'
        go)."""
        self.active = list(indices)
        self.memo.keep(indices)

    def score(
        self,
        qtable: Mapping[str, str],
        order: Sequence[int] | None = None,
        stop_below: float | None = None,
        counted: bool = True,
    ) -> dict[int, float]:
        """Lower with ``qtable`` and score the samples (per_sample)."""
        _, tpu_module, tpu_weights = self.lower(qtable, counted)
        return self.per_sample(tpu_module, tpu_weights, order, stop_below)


# how the errors of its second process name the work
_WHAT = "the mixed-precision search"


def _alternate(indices: Sequence[int]) -> tuple[list[int], list[int]]:
    """Every other index from the first, and from the second: each process's half."""
    return list(indices[::2]), list(indices[1::2])


def int8_ops(lw: Lowering) -> set[TensorOp]:
    """The TOP ops a lowering computed in INT8: quantized results, or absorbed into an INT8 table."""
    found = {op for op in lw.absorbed if isinstance(op, TensorOp)}
    for op in lw.ops:
        if any(r in lw.lowered and _is_quantized(lw.lowered[r]) for r in op.results):
            found.add(op)
    return found


def quantized_tensors(lw: Lowering) -> list[SSAValue]:
    """TOP tensors the lowering quantizes somewhere (as an INT8 result or through a cast), in program order."""
    hit = {v for v, lv in lw.lowered.items() if _is_quantized(lv)}
    hit |= {v for (v, _), lv in lw.converted.items() if _is_quantized(lv)}
    order = [r for op in lw.ops for r in op.results]
    return [v for v in order if v in hit and not isinstance(v.owner, WeightOp)]


def search_pool(
    samples: Samples | Sequence[Mapping[str, np.ndarray]], config: SearchConfig
) -> tuple[list[Mapping[str, np.ndarray]], str]:
    """What the search chooses the samples it scores from, and a line saying which: ``config.pool`` calibration
    samples spread evenly over the set, and every one calibration held back from its statistics.

    Spread, as sorted file order often groups one kind of input: a YOLOv8 detector calibrated on 40
    photographs, then 8 of faces, had every face after the first 32 samples; a table searched on those left
    the class scores of held-out faces at cosine 0.983, one searched on a pool spread over the set at 0.987.

    Held-back samples alone are too few to find a hard input: PP-OCRv6 det's 4 (of 24 pages) scored INT8 at
    0.993 or better, while 3 pages the statistics read scored 0.949 to 0.970, and a test page 0.976. An input's
    INT8 error hardly depends on whether it was one of the many the thresholds were fitted to, so the search
    scores the worst of all of them."""
    from tpubuild.calib.calibrate import VALIDATION_EVERY, VALIDATION_SAMPLES, held_back

    n = sample_count(samples)
    picked = {k * n // config.pool for k in range(config.pool)} if n > config.pool else set(range(n))
    picked |= {i for i in range(min(n, VALIDATION_EVERY * VALIDATION_SAMPLES)) if held_back(i)}
    pool = samples_at(samples, picked)
    if n <= config.pool:
        return pool, f"all {len(pool)} calibration samples"
    return pool, (
        f"{len(pool)} of the {n} calibration samples ({config.pool} spread over them and those held back from "
        "the statistics)"
    )


def units_of(lw: Lowering, pinned: Iterable[str]) -> list[Unit]:
    """One unit per quantized tensor: its producer and consumers that are INT8 and not pinned already."""
    int8 = int8_ops(lw)
    pinned = set(pinned)
    # an op computed inside another's table brings the whole table along: alone in float it would
    # make the rest of the table start from a newly quantized tensor
    absorber = {member: end for end, members in lw.chains.items() for member in members}
    units = []
    for v in quantized_tensors(lw):
        owner = v.owner
        ops = [owner] if isinstance(owner, TensorOp) and not isinstance(owner, InputOp) else []
        ops += [use.operation for use in v.uses if isinstance(use.operation, TensorOp)]
        ends = [absorber.get(op, op) for op in ops]
        ops = [x for end in ends for x in (*lw.chains.get(end, []), end) if isinstance(x, TensorOp)]
        names = tuple(dict.fromkeys(op.names[0] for op in ops if op in int8 and op.names[0] not in pinned))
        if names:
            units.append(Unit(mlir.value_name(v), names))
    return units


def table_of(user: Mapping[str, str], chosen: Sequence[Unit], mode: str) -> dict[str, str]:
    table = dict(user)
    for unit in chosen:
        for name in unit.ops:
            table.setdefault(name, mode)
    return table


def search(
    module: ModuleOp,
    weights: WeightStore,
    *,
    chip: Chip,
    cali: Mapping[str, Entry],
    asymmetric: bool,
    samples: Sequence[Mapping[str, np.ndarray]],
    config: SearchConfig = SearchConfig(),
    user: Mapping[str, str] | None = None,
    log=None,
    processes: int = 1,
    refs: Mapping[int, Sequence[np.ndarray]] | None = None,
    bias_corrections: Mapping[str, np.ndarray] | None = None,
) -> SearchResult:
    """The quantize table (user entries plus the fewest float tensors found) reaching ``config.target_cos``;
    ``processes``: 2 scores the pool in two processes (the result is the same); ``refs``: TOP's graph outputs
    of samples known already, by index (calibration's); ``bias_corrections``: offered (lower/bias.py), and
    kept for every lowering where BiasChoice says so."""
    say = log or (lambda text: None)
    if config.max_lowerings is None:
        config = replace(config, max_lowerings=default_lowerings(module))
    mode = config.mode or chip.float_mode
    chip.check_mode(mode, what="mixed-precision mode")
    user = dict(user or {})
    ev = Evaluator(
        module, weights, chip=chip, cali=cali, asymmetric=asymmetric, samples=samples, processes=processes, refs=refs
    )
    lw, tpu_module, tpu_weights = ev.lower(user)
    int8 = ev.pool_scores(tpu_module, tpu_weights)
    bias, kept = None, {}
    if bias_corrections:
        ev.bias_corrections = bias_corrections
        corrected = ev.lower(user)
        corrected_scores = ev.pool_scores(corrected[1], corrected[2])
        bias = BiasChoice(len(bias_corrections), _summary(int8), _summary(corrected_scores), config.target_cos)
        say(bias.line())
        if bias.kept:
            (lw, tpu_module, tpu_weights), int8, kept = corrected, corrected_scores, dict(bias_corrections)
        else:
            ev.bias_corrections = None
    pool, target = len(int8), config.target_cos
    ev.keep(_worst(range(pool), int8, config.samples))
    int8_score = min(int8[i] for i in ev.active)
    if pool > len(ev.active):
        say(f"scoring samples {', '.join(map(str, ev.active))} of {pool} (INT8 alone furthest from float)")
    say(f"INT8{' with the user table' if user else ''}: cos {int8_score:.6f} (target {target})")
    units = units_of(lw, user)
    first = finder = _Search(ev, units, user, mode, config, say)
    chosen = finder.run({i: int8[i] for i in ev.active}) if int8_score < target else frozenset()
    pool_score = min(int8) if not chosen else None
    # a table found on a few samples can miss the target on others of the pool by far (the error moves to
    # inputs INT8 alone handled well): the pool is scored with it, and the worst samples it misses on join
    # those scored, the search going on from that table, until it holds on the whole pool
    while chosen and finder.scores[chosen] >= target and finder.budget_left():
        _, tpu_module, tpu_weights = ev.lower(finder.table(chosen))
        now = ev.pool_scores(tpu_module, tpu_weights)
        pool_score = min(now)
        missed = [i for i in range(pool) if i not in ev.active and now[i] < target]
        if not missed:
            break
        added = _worst(missed, now, config.samples)
        say(
            f"the table scores {len(missed)} more of the pool below {target} (cos {pool_score:.6f} on sample "
            f"{min(missed, key=lambda i: now[i])}): samples {', '.join(map(str, added))} scored too"
        )
        ev.keep(sorted([*ev.active, *added]))
        int8_score = min(int8[i] for i in ev.active)
        finder = _Search(ev, units, user, mode, config, say)
        chosen = finder.extend(chosen, {i: now[i] for i in ev.active}, first.order)
        pool_score = None
    score = finder.scores.get(chosen, int8_score)
    picked = [units[i] for i in sorted(chosen)]
    for i in sorted(chosen):
        units[i].score = first.alone.get(i, math.nan)
    table = table_of(user, picked, mode)
    return SearchResult(
        table,
        user,
        picked,
        mode,
        int8_score,
        score,
        target,
        len(ev.active),
        ev.lowerings,
        pool,
        tuple(ev.active),
        pool_score,
        macs_share(module, table),
        finder.all_float,
        bias,
        kept,
    )


def macs_share(module: ModuleOp, names: Iterable[str]) -> float:
    """The share of the module's multiply-accumulates that the ops named do: what a table costs in speed, as
    a float conv or matmul takes several times an INT8 one's time while the rest costs next to nothing."""
    from tpubuild.lower.int8 import macs

    names = set(names)
    ops = [op for op in module.walk() if isinstance(op, TensorOp)]
    total = sum(macs(op) for op in ops)
    return sum(macs(op) for op in ops if op.names[0] in names) / total if total else 0.0


def default_lowerings(module: ModuleOp) -> int:
    """The search's bound on lowerings when the manifest sets none (DEFAULT_LOWERINGS, more for a cheap model)."""
    from tpubuild.lower.int8 import macs

    total = sum(macs(op) for op in module.walk())
    if total >= CHEAP_MACS:
        return DEFAULT_LOWERINGS
    return min(MOST_LOWERINGS, DEFAULT_LOWERINGS * CHEAP_MACS // max(total, 1))


def _worst(indices: Iterable[int], scores: Sequence[float], count: int) -> list[int]:
    """The ``count`` of ``indices`` with the lowest scores, in their own order (the first ones on ties)."""
    return sorted(sorted(indices, key=lambda i: scores[i])[:count])


class _Ahead:
    """A forked process evaluating tables the search may ask about next (see the module docstring), one at a time:
    ``offer`` hands it a table when it is idle, ``take`` gives that table's evaluation if it is the one asked
    for (None: evaluate it here). Its memo of tensors is its own; the values are the same."""

    def __init__(self, ev: Evaluator):
        self.child, self.conn = forked.start(_work_ahead, ev, what=_WHAT)  # with the evaluator and memo as they are
        self.asked: tuple | None = None  # the key of the evaluation in progress there

    def offer(self, key: tuple, table: Mapping[str, str]) -> None:
        """Evaluate ``table`` there (key: (chosen, sample order, stop)) if that process has nothing to do and a
        core is free for it (spare_core)."""
        if self.asked == key:
            return
        if (self.asked is None or self._collect()) and spare_core():
            try:
                self.conn.send((table, key[1], key[2]))
            except OSError:  # it is gone (a broken pipe)
                raise forked.stopped(self.child, _WHAT) from None
            self.asked = key

    def take(self, key: tuple) -> dict[int, float] | None:
        if self.asked != key:
            return None
        kind, found = self._reply()
        self.asked = None
        if kind == "error":
            raise found
        return found

    def _collect(self) -> bool:
        """Drop a finished evaluation nobody asked for; whether that process is idle now."""
        if not self.conn.poll():
            return False
        self._reply()
        self.asked = None
        return True

    def _reply(self):
        try:
            return self.conn.recv()
        except EOFError:
            raise forked.stopped(self.child, _WHAT) from None

    def close(self) -> None:
        # it may be evaluating a table nobody will ask for. SIGKILL, not SIGTERM: a TERM that reaches the child
        # before it has run (the search done at once) is lost, as Python's fork clears caught signals, and join
        # then waits for ever
        self.child.kill()
        self.child.join()
        self.conn.close()


def spare_core() -> bool:
    """Whether a core is free for work that may be thrown away: fewer threads ready to run than cores, counting
    this one (Linux's /proc/loadavg, at this instant; elsewhere yes).

    Under `doit -n 2` the search shares the machine with other stages (PP-OCRv4 rec's F32 and BF16 targets):
    working ahead then takes CPU from them, not from idle cores. In rec's matrix it bought nothing (the search
    took 15.1-15.7 s with it, 15.0-15.9 s in one process, for 4 s more CPU); working ahead only on a spare core,
    the matrix took 0.85 s less than always working ahead (the mean of 7 interleaved pairs, on a machine whose
    speed drifts by more)."""
    try:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return True
    return running < (os.cpu_count() or 1)


def _work_ahead(ev: Evaluator, conn) -> None:
    """_Ahead's process: each (table, order, stop) received, its Evaluator.score (not counted)."""
    while True:
        try:
            table, order, stop = conn.recv()
        except EOFError:
            return
        conn.send(forked.outcome(functools.partial(ev.score, table, order, stop, counted=False)))


class _Search:
    """Greedy over contiguous chunks of the quantized tensors, then pruning by halves (delta debugging)."""

    def __init__(self, ev: Evaluator, units: list[Unit], user, mode: str, config: SearchConfig, say):
        self.ev, self.units, self.user, self.mode, self.config, self.say = ev, units, user, mode, config, say
        self.scores: dict[frozenset[int], float] = {}
        self.per_sample: dict[frozenset[int], dict[int, float]] = {}  # of the tables in ``scores``
        self.failed: set[frozenset[int]] = set()  # tables known below the target, not scored on every sample
        self.alone: dict[int, float] = {}  # a tensor's score when its segment alone was float
        self.order: list[tuple[float, frozenset[int]]] = []  # the chunks, the most useful alone first
        self.ahead: _Ahead | None = None  # the second process, during the greedy and pruning steps
        self.known: dict[tuple, dict[int, float]] = {}  # evaluations made here ahead of their step
        self.all_float: float | None = None  # the score with every tensor in float, once the greedy got there

    def table(self, chosen: frozenset[int]) -> dict[str, str]:
        return table_of(self.user, [self.units[i] for i in sorted(chosen)], self.mode)

    def score(self, chosen: frozenset[int]) -> float:
        if chosen not in self.scores:
            self.per_sample[chosen] = self._evaluate((chosen, None, None))
            self.scores[chosen] = min(self.per_sample[chosen].values())
        return self.scores[chosen]

    def _key(self, chosen: frozenset[int], like: frozenset[int]) -> tuple:
        """What passes(chosen, like) evaluates: the table, its samples hardest first (as they were for
        ``like``, a table scored on all of them), stopping below the target."""
        hardest = self.per_sample[like]
        return chosen, tuple(sorted(hardest, key=lambda i: (hardest[i], i))), self.config.target_cos

    def _evaluate(self, key: tuple) -> dict[int, float]:
        """Evaluator.score of key's table, order and stop: made ahead (here or there) or now, a lowering either
        way."""
        found = self.known.pop(key, None)
        if found is None and self.ahead is not None:
            found = self.ahead.take(key)
        if found is None:
            return self.ev.score(self.table(key[0]), key[1], key[2])
        self.ev.lowerings += 1
        return found

    def passes_ahead(self, chosen: frozenset[int], like: frozenset[int], nxt: frozenset[int] | None) -> bool:
        """passes(chosen, like), while the other process evaluates what the next step asks about if this one
        falls short (``nxt``, with the same ``like``): or, when that process is on this very table already,
        ``nxt`` is evaluated here first."""
        if self.ahead is not None and nxt and nxt not in self.scores and nxt not in self.failed:
            after = self._key(nxt, like)
            if self.ahead.asked == self._key(chosen, like):
                if after not in self.known:
                    self.known[after] = self.ev.score(self.table(nxt), after[1], after[2], counted=False)
            else:
                self.ahead.offer(after, self.table(nxt))
        return self.passes(chosen, like)

    def passes(self, chosen: frozenset[int], like: frozenset[int]) -> bool:
        """Whether ``chosen`` reaches the target: the same answer as score(chosen) >= target, but the
        samples are scored hardest first (as they were for ``like``, a table scored on all of them) and
        none after one below the target. A table that passes is scored on every sample."""
        target = self.config.target_cos
        if chosen in self.scores:
            return self.scores[chosen] >= target
        if chosen in self.failed:
            return False
        found = self._evaluate(self._key(chosen, like))
        if min(found.values()) < target:
            self.failed.add(chosen)
            return False
        self.per_sample[chosen], self.scores[chosen] = found, min(found.values())
        return True

    @property
    def bound(self) -> int:
        """The bound on lowerings (search() has set it when the manifest did not)."""
        assert self.config.max_lowerings is not None, "search() resolves the bound before a _Search starts"
        return self.config.max_lowerings

    def budget_left(self) -> bool:
        return self.ev.lowerings < self.bound

    def run(self, int8: Mapping[int, float]) -> frozenset[int]:
        """The table: chunks alone in float, then _greedy from none (``int8``: each sample's score then)."""
        n = len(self.units)
        k = min(self.config.chunks, n)
        chunks = [frozenset(range(i * n // k, (i + 1) * n // k)) for i in range(k)]
        alone = []
        # each alone in float, as many as the budget allows (independent tables: scored as one batch)
        count = max(0, min(len(chunks), self.bound - self.ev.lowerings))
        for c, found in zip(chunks, self.ev.score_tables([self.table(c) for c in chunks[:count]]), strict=False):
            self.per_sample[c], self.scores[c] = found, min(found.values())
            alone.append((self.scores[c], c))
            self.say(f"tensors {self._span(c)} in float: cos {alone[-1][0]:.6f}")
        alone.sort(key=lambda sc: -sc[0])  # stable: program order on ties
        for s, c in alone:
            for i in c:
                self.alone[i] = s
        self.order = alone
        return self.extend(frozenset(), int8, alone)

    def extend(
        self, start: frozenset[int], scores: Mapping[int, float], order: list[tuple[float, frozenset[int]]]
    ) -> frozenset[int]:
        """_greedy from ``start``, a table below the target whose per-sample ``scores`` are known, in the
        working-ahead process's company."""
        self.per_sample[start], self.scores[start] = dict(scores), min(scores.values())
        if self.ev.processes > 1:
            self.ahead = _Ahead(self.ev)
        try:
            return self._greedy(start, order)
        finally:
            if self.ahead is not None:
                self.ahead.close()
                self.ahead = None

    def _greedy(self, start: frozenset[int], order: list[tuple[float, frozenset[int]]]) -> frozenset[int]:
        """Chunks join ``start``, in ``order`` (the most useful first), until the table reaches the target;
        then _prune drops what it can of those that joined."""
        target = self.config.target_cos
        chosen, joined = start, []
        below = [start]  # the tables below the target, in order
        ahead = [c for _, c in order if not c <= start]
        for k, c in enumerate(ahead):
            if not self.budget_left():
                break
            chosen = chosen | c
            joined.append(c)
            nxt = chosen | ahead[k + 1] if k + 1 < len(ahead) else None
            if self.passes_ahead(chosen, start, nxt):
                self.say(f"+ tensors {self._span(c)}: cos {self.scores[chosen]:.6f}")
                return self._prune(chosen, joined[::-1])
            below.append(chosen)
            self.say(f"+ tensors {self._span(c)}: below {target}")
        if len(chosen) == len(self.units):
            self.all_float = self.full_score(chosen)
        # not reached: the first of them, each now scored on every sample (the greedy steps stopped at the
        # first sample below the target), that holds the floor the default target is a margin over, pruned
        # against that floor; else the best. A target above what the float mode itself reaches (BF16 on
        # cv183x: retinaface_mnet all in BF16 0.9947) would otherwise keep every op in float. (Each of them
        # scores below the target, so a target at or under the floor finds none here.)
        held = next((t for t in below if self.full_score(t) >= FLOOR_COS), None)
        if held is None:
            return max(below, key=self.full_score)
        if not self.budget_left():
            return held
        floor = replace(self.config, target_cos=FLOOR_COS)
        lower = _Search(self.ev, self.units, self.user, self.mode, floor, self.say)
        lower.per_sample[held], lower.scores[held] = self.per_sample[held], self.scores[held]
        self.say(f"the target is out of reach: pruning against {FLOOR_COS}")
        chosen = lower._prune(held, [c for c in joined[::-1] if c <= held])
        self.per_sample[chosen], self.scores[chosen] = lower.per_sample[chosen], lower.scores[chosen]
        return chosen

    def full_score(self, chosen: frozenset[int]) -> float:
        """score(chosen) for a table passes() found below the target: its lowering again (not counted:
        the same table) and every sample (the memo has those scored already)."""
        if chosen not in self.scores:
            self.per_sample[chosen] = self.ev.score(self.table(chosen), counted=False)
            self.scores[chosen] = min(self.per_sample[chosen].values())
            self.failed.discard(chosen)
        return self.scores[chosen]

    def _prune(self, chosen: frozenset[int], queue: list[frozenset[int]]) -> frozenset[int]:
        """Drop segments (least useful first, then halves of those that must stay) while the target holds."""
        while queue and self.budget_left():
            seg = queue.pop(0) & chosen
            if not seg:
                continue
            rest = chosen - seg
            halves = _halves(seg) if len(seg) > max(1, len(self.units) // PRUNE_PARTS) else []
            # the segment the next step drops if this one must stay: the queue's next, else this one's first half
            nxt = next((q & chosen for q in (*queue, *halves) if q & chosen), None)
            if rest and self.passes_ahead(rest, chosen, chosen - nxt if nxt else None):
                chosen = rest
                self.say(f"- tensors {self._span(seg)}: not needed, cos {self.scores[rest]:.6f}")
            else:
                queue += halves
        return chosen

    def _span(self, seg: frozenset[int]) -> str:
        lo, hi = min(seg), max(seg)
        first, last = self.units[lo].tensor, self.units[hi].tensor
        return f"{first}" if lo == hi else f"{first} .. {last} ({len(seg)})"


def _halves(seg: frozenset[int]) -> list[frozenset[int]]:
    """A segment's two halves in program order (the first the smaller on an odd count)."""
    ordered = sorted(seg)
    return [frozenset(ordered[: len(ordered) // 2]), frozenset(ordered[len(ordered) // 2 :])]


def format_result(result: SearchResult, header: Sequence[str] = ()) -> str:
    """The quantize table text: what was searched and found as comments, then ``op_name MODE`` lines."""
    lines = [f"# {h}" for h in header]
    chosen_from = (
        f" (of the {result.pool} in the pool: those where INT8 alone, then each table found, is furthest from float)"
        if result.pool > result.samples
        else ""
    )
    lines += [
        f"# mixed-precision search: every output's (and Concat-made part's) cosine to float >= {result.target} "
        f"on {result.samples} sample(s){chosen_from}, the lowest over outputs, parts and samples",
        f"# INT8{' with the user table' if result.user else ''}: {result.int8_score:.6f}; "
        f"with this table: {result.score:.6f} ({result.lowerings} lowerings)",
    ]
    if result.bias is not None:
        lines.append(f"# {result.bias.line()} (bias_correction.npz)")
    if result.pool_score is not None and result.pool > result.samples:
        lines.append(f"# on every sample of the pool: {result.pool_score:.6f}")
    if result.table:
        lines.append(
            f"# in float: {len(result.table)} ops, {result.float_macs:.1%} of the model's multiply-accumulates "
            "(convolutions and matmuls)"
        )
    if not result.reached:
        held = result.score >= FLOOR_COS
        kept = f"the fewest tensors found that hold {FLOOR_COS}" if held else "the best table found"
        lines.append(f"# TARGET NOT REACHED: {kept}, below {result.target}")
        if result.all_float is not None and result.all_float < result.target:
            lines.append(f"# {ALL_FLOAT_LINE} {result.mode}: {result.all_float:.6f}, below the target too")
    lines.append("# op_name MODE")
    if result.user:
        lines.append(f"# from the user's quantize table ({len(result.user)} entries, kept as written)")
        lines += [f"{name} {mode}" for name, mode in result.user.items()]
    written = set(result.user)
    for unit in result.chosen:
        lines.append(f"# tensor {unit.tensor} stays {result.mode}")
        lines += [f"{name} {result.mode}" for name in unit.ops if name not in written]
        written.update(unit.ops)
    return "\n".join(lines) + "\n"
