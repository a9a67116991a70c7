"""Empirical bias correction: the mean error INT8 leaves in each output channel of a conv or matmul, measured on
calibration samples against TOP inference and taken out of the op's bias.

INT8's rounding and clipping errors are not all zero-mean: a ReLU rectifies them, a pooled vector keeps their mean
and loses their spread, and a squeeze-excite gate multiplies a whole feature map by the result. PP-OCR's
MobileNetV3 text-direction classifier came out of INT8 with its logits shrunk (slope 0.96 early, 0.86 at the
pooled features), which moved an input the model was unsure about from 0.916/0.084 to cosine 0.978. The
correction (Nagel et al., "Data-Free Quantization Through Weight Equalization and Bias Correction", ICCV 2019,
in its empirical form) runs the INT8 model on the samples an op at a time in program order, so each op is
corrected for the errors of the corrected ops before it: one run, not one per op.

Each channel's mean is shrunk towards zero by how uncertain it is (James-Stein: times 1 - se^2 / mean^2, at least
0): a squeeze-excite vector has one value per sample, and its mean over 16 samples is half noise. On that
classifier, at 16 samples: plain means 0.9987 on the unsure input, shrunk ones 0.99998.

A correction is kept in float units, by the TOP op's name, and lowering takes it from its op's bias
(``Lowering.bias_array``). The search keeps the corrections only where they bring INT8 alone to its target and do
better (``search.BiasChoice``), so they are applied to the model they were measured on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from xdsl.dialects.builtin import ModuleOp, f32

from tpubuild.build.chips import Chip
from tpubuild.calib.data import Samples, sample_count, samples_at
from tpubuild.calib.table import Entry
from tpubuild.ir import mlir, tpu
from tpubuild.ir.base import TensorOp
from tpubuild.ir.quant import UniformType
from tpubuild.ir.top import WeightOp
from tpubuild.ir.types import elem_of, shape_of
from tpubuild.ir.weights import ByIdentity, WeightStore
from tpubuild.lower.inference import dequantize
from tpubuild.top.inference import Plan

_INT32 = (-(2**31), 2**31 - 1)
# samples the corrections are measured on: each op runs on all of them before the next, so their live tensors are
# all in memory at once
SAMPLES = 32


def correction_samples(samples: Samples | Sequence[Mapping[str, np.ndarray]]) -> list[Mapping[str, np.ndarray]]:
    """Up to ``SAMPLES`` of the samples calibration's statistics read (not those it holds back for validation, on
    which the search then judges the corrected model), spread evenly over them; only those are read."""
    from tpubuild.calib.calibrate import held_back

    stats = [i for i in range(sample_count(samples)) if not held_back(i)]
    picked = stats if len(stats) <= SAMPLES else [stats[k * len(stats) // SAMPLES] for k in range(SAMPLES)]
    return samples_at(samples, set(picked))


def channel_axis(op: TensorOp) -> int:
    """Where a conv's (1) or matmul's (last) output channels are: its bias's axis."""
    rank = len(shape_of(op.results[0].type))
    return 1 if isinstance(op, tpu.ConvOp) else rank - 1


def channel_means(array: np.ndarray, axis: int) -> np.ndarray:
    """Per-channel mean over every other axis, in float64."""
    a = np.moveaxis(np.asarray(array, np.float64), axis, -1)
    return a.reshape(-1, a.shape[-1]).mean(axis=0)


def _correctable(op: TensorOp) -> np.ndarray | None:
    """A conv's or matmul's step per bias channel: its int32 bias's accumulator scales in INT8, 0 for a float
    bias (corrected as measured); None for an op without a constant bias."""
    if not isinstance(op, tpu.ConvOp | tpu.MatMulOp) or len(op.operands) < 3:
        return None
    bias = op.operands[2]
    if not isinstance(bias.owner, WeightOp):
        return None
    out, elem = elem_of(op.results[0].type), elem_of(bias.type)
    if isinstance(out, UniformType):
        if isinstance(elem, UniformType) and elem.storage_type == "i32":
            return np.asarray(elem.scale_list, np.float64)
        return None
    return np.zeros(1) if elem == f32 else None


def bias_corrections(
    module: ModuleOp,
    weights: WeightStore,
    *,
    chip: Chip,
    cali: Mapping[str, Entry],
    asymmetric: bool,
    samples: Sequence[Mapping[str, np.ndarray]],
    qtable: Mapping[str, str] | None = None,
) -> dict[str, np.ndarray]:
    """TOP op name -> what to take from its bias (float32, the bias's shape), for every conv and matmul with a
    constant bias whose mean error on ``samples`` is at least half an accumulator step (INT8) or any (a float op
    after INT8 ones: the squeeze-excite vectors and the classifier head, which INT8 leaves in float)."""
    from tpubuild.lower.lowering import lower_module

    if not samples:
        return {}
    tpu_module, tpu_weights = lower_module(
        module, weights, chip=chip, mode="INT8", asymmetric=asymmetric, cali=cali, qtable=qtable
    )
    plan = Plan(tpu_module, tpu_weights)
    steps = {step.op.loc_name: s for step in plan.steps if (s := _correctable(step.op)) is not None}
    axes = {step.op.loc_name: channel_axis(step.op) for step in plan.steps if step.op.loc_name in steps}
    reference = _float_means(module, weights, samples, axes)
    found: dict[str, np.ndarray] = {}

    def revise(op: TensorOp, results: list[tuple[np.ndarray, ...]]) -> dict[int, np.ndarray] | None:
        name = op.loc_name
        if name not in steps:
            return None
        out = elem_of(op.results[0].type)
        per = np.array([channel_means(dequantize(r[0], out), axes[name]) for r in results]) - reference[name]
        error = shrunk_mean(per)
        bias, scales = tpu_weights[mlir.value_name(op.operands[2])], steps[name]
        if bias.size != error.size:  # a bias over more than the output channels
            return None
        if not scales.any():  # a float bias
            if not error.any():
                return None
            found[name] = error.reshape(bias.shape).astype(np.float32)
            return {2: (bias - found[name]).astype(bias.dtype)}
        k = np.rint(error / scales).reshape(bias.shape)
        if not k.any():
            return None
        new = np.clip(bias.astype(np.int64) - k, *_INT32)
        found[name] = ((bias.astype(np.float64) - new) * scales.reshape(bias.shape)).astype(np.float32)
        return {2: new.astype(np.int32)}

    plan.run_together(list(samples), revise)
    return found


def shrunk_mean(per_sample: np.ndarray) -> np.ndarray:
    """The mean over samples (axis 0), each channel's times max(0, 1 - its squared standard error / its square)."""
    mean = per_sample.mean(axis=0)
    if len(per_sample) < 2:
        return mean
    se2 = per_sample.var(axis=0, ddof=1) / len(per_sample)
    return mean * np.clip(1 - se2 / np.maximum(mean**2, 1e-300), 0, 1)


def _float_means(
    module: ModuleOp, weights: WeightStore, samples: Sequence[Mapping[str, np.ndarray]], axes: Mapping[str, int]
) -> dict[str, np.ndarray]:
    """TOP inference's per-channel means at the named tensors, per sample (samples x channels)."""
    means: dict[str, list[np.ndarray]] = {name: [] for name in axes}

    def observe(op: TensorOp, args, results) -> None:
        if op.loc_name in axes:
            means[op.loc_name].append(channel_means(results[0], axes[op.loc_name]))

    plan = Plan(module, weights)
    for sample in samples:
        plan.run(sample, all_tensors=False, observer=observe)
    return {name: np.array(m) for name, m in means.items() if m}


_CORRECTED: ByIdentity[np.ndarray] = ByIdentity(4096)


def corrected_bias(bias: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """``bias - delta`` in float32: the same array for the same two (the INT8 rules' requantization cache is by
    identity)."""
    return _CORRECTED.get(
        (bias, delta), (), lambda: (bias.astype(np.float64) - delta.reshape(bias.shape)).astype(np.float32)
    )
