"""``auto``: per tensor, the candidate threshold that disturbs its consumers least.

Each tensor has a few candidate thresholds (those of the other methods). On a
few samples the float model runs once; at every op, each float activation
operand in turn is fake-quantized at each of its candidates (the other
operands stay float), the op's kernel runs again, and the squared error of
its results against the float results is accumulated, relative to their
energy. A tensor's score for a candidate is the sum over its consumers (and,
for a graph output, over itself); the lowest wins, the first listed on a tie.

This is TPU-MLIR's tuning step (which tries 10 thresholds between KL's and
the max) with the candidates of every method instead, and streaming: memory
holds one sample's live tensors plus a few numbers per (tensor, consumer).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
from xdsl.dialects.builtin import ModuleOp

from tpubuild import forked
from tpubuild.ir.base import TensorOp
from tpubuild.ir.mlir import body_ops, return_op
from tpubuild.ir.weights import WeightStore
from tpubuild.kernels import get_kernel
from tpubuild.top.inference import Plan

TUNE_SAMPLES = 8
# ...fewer for a large model, down to TUNE_MIN: tuning runs each consumer once per candidate, several times a
# whole inference per sample, and a 416 x 416 detector's eight samples took minutes where two or three say the same
TUNE_ELEMENTS = 1 << 26
TUNE_MIN = 2


def tune_count(elements_per_sample: float) -> int:
    """How many samples tuning runs, for a model whose activations hold this many values per sample."""
    return int(min(TUNE_SAMPLES, max(TUNE_MIN, TUNE_ELEMENTS // max(elements_per_sample, 1))))


def fake_quant(x: np.ndarray, threshold: float, levels: int) -> np.ndarray:
    """Symmetric quantize-dequantize: int8 (levels 127, clamped to [-128, 127]) or uint8 (255, [0, 255])."""
    step = threshold / levels
    lo = 0 if levels == 255 else -levels - 1
    return (np.clip(np.round(x / step), lo, levels) * step).astype(x.dtype)


def _sq(a: np.ndarray) -> float:
    a = np.asarray(a, np.float64)
    return float(np.vdot(a, a))


def tune(
    module: ModuleOp,
    weights: WeightStore,
    samples: Iterable[Mapping[str, np.ndarray]],
    candidates: Mapping[str, Sequence[float]],
    levels: Mapping[str, int],
    processes: int = 1,
) -> dict[str, float]:
    """The chosen threshold per tensor of ``candidates`` (tensors with one candidate keep it). With ``processes``
    2, a forked process runs the odd samples; each sample's errors are summed apart and added in sample order,
    so the choice is the same for any count."""
    names = {
        value: name
        for op in body_ops(module)
        if isinstance(op, TensorOp)
        for value, name in zip(op.results, op.names, strict=True)
        if name in candidates
    }
    outputs = {v for v in return_op(module).operands if v in names}
    # one sample's: err[name][consumer], squared error per candidate; energy[consumer], squared float results
    err: dict[str, dict[str, np.ndarray]] = defaultdict(dict)
    energy: dict[str, float] = defaultdict(float)

    def errors(name: str, consumer: str) -> np.ndarray:
        return err[name].setdefault(consumer, np.zeros(len(candidates[name])))

    def observe(op, args, results) -> None:
        for value, x in zip(op.results, results, strict=True):
            if value in outputs and len(candidates[names[value]]) > 1:  # no consumer: judge the tensor itself
                name = names[value]
                key = f"{name} (graph output)"
                energy[key] += _sq(x)
                acc = errors(name, key)
                for c, th in enumerate(candidates[name]):
                    acc[c] += _sq(x - fake_quant(x, th, levels[name]))
        operands = list(op.operands)
        tuned = [v for v in dict.fromkeys(operands) if v in names and len(candidates[names[v]]) > 1]
        if not tuned:
            return
        key = op.loc_name
        energy[key] += sum(_sq(y) for y in results)
        kernel, params = get_kernel(type(op)), op.params
        for value in tuned:
            name = names[value]
            acc = errors(name, key)
            x = args[operands.index(value)]
            for c, th in enumerate(candidates[name]):
                q = fake_quant(x, th, levels[name])
                out = kernel(params, *[q if v is value else a for v, a in zip(operands, args, strict=True)])
                outs = out if isinstance(out, tuple) else (out,)
                acc[c] += sum(
                    _sq(np.asarray(y, np.float64) - np.asarray(o, np.float64))
                    for y, o in zip(results, outs, strict=True)
                )

    plan = Plan(module, weights)

    def part(first: int, step: int) -> list[tuple[int, dict, dict]]:
        found = []
        for i, sample in enumerate(samples):
            if i % step == first:
                err.clear()
                energy.clear()
                plan.run(sample, all_tensors=False, observer=observe)
                found.append((i, {name: dict(by) for name, by in err.items()}, dict(energy)))
        return found

    parts = forked.every_other(part, processes, "calibration's tuning")
    return _choose(sorted(itertools.chain(*parts), key=lambda found: found[0]), candidates)


def _choose(per_sample: list[tuple[int, dict, dict]], candidates: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """Each tensor's candidate of the lowest error summed over its consumers, each relative to the consumer's
    energy; the samples' errors and energies added in sample order."""
    total: dict[str, dict[str, np.ndarray]] = defaultdict(dict)
    total_energy: dict[str, float] = defaultdict(float)
    for _, sample_err, sample_energy in per_sample:
        for name, by in sample_err.items():
            for key, errs in by.items():
                total[name][key] = total[name].get(key, 0.0) + errs
        for key, value in sample_energy.items():
            total_energy[key] += value
    chosen = {}
    for name, cands in candidates.items():
        score = np.zeros(len(cands))
        for key, errs in total.get(name, {}).items():
            score += errs / max(total_energy[key], 1e-30)
        chosen[name] = float(cands[int(np.argmin(score))])
    return chosen
