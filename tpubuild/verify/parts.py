"""Parts of a graph output, judged one by one: what a user reads of an output is often several things at once.

A detector's output is often ``Concat(boxes, class scores)`` along one axis: box coordinates up to
hundreds of pixels next to sigmoid scores below 1. One cosine over the whole tensor is the boxes'
cosine: scores that INT8 destroyed (quantized with the boxes' scale, say) move it by less than 0.01.
So verification judges each part of such an output on its own, as well as the whole:

- automatic parts: an output produced by a ``top.Concat`` (possibly through ops that keep its shape,
  such as an activation or a cast, transposes, and reshapes that keep the Concat axis) has one part per
  Concat input, its slice along the Concat axis (where transposes and reshapes moved it);
  nested Concats on the same axis are flattened (their inputs are the parts);
- field parts: when every input of that Concat is itself made by a Concat on another axis, with the same
  sizes (a YOLOv5 or YOLOX head: per level, Concat(boxes, objectness, class scores), reshaped, then the
  levels concatenated), each field of the inner Concats is a part too, over every level: the class scores
  of all levels, whose cosine a level's boxes in pixels would otherwise hide;
- declared parts: the manifest's ``outputs: {<output>: {parts: {<part>: {axis, range: [start, stop]}}}}``
  (docs/manifest.md); an output with declared parts uses those and no automatic ones.

A part whose float values are tiny for its INT8 scale is judged by its largest absolute error, not its
cosine (``judge_part``): an image with nothing to detect has class scores near zero in float, and the
cosine between those and INT8's zeros and few steps is noise, not a verdict.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from tpubuild.errors import TpuBuildError
from tpubuild.verify.similarity import Similarity, Tolerance, cosine, similarity

# The tiny-part rule (docs/manifest.md, "Output parts"). A part's INT8 step is T / 127, T the largest
# calibration threshold of the tensors the part comes from. The part is tiny when its float (reference)
# values, rounded to that step, are at a cosine below TINY_PART_COS to themselves: then even an INT8 result
# exact up to its own rounding fails a cosine check (a YOLOv8 detector's 18 class scores on a photograph
# with nothing to detect, every one below 0.043: 0.961), and the cosine says nothing of how good it is.
# 0.995: rounding alone then costs more than half of the shortfall that INT8's goal, cos 0.99, allows.
# A tiny part passes when its largest absolute error is at most TINY_PART_MAX_STEPS steps (the error
# rounding to the nearest step and the layers before it can make, far below any decision threshold: 4
# steps of a sigmoid's [0, 1] range is 0.031).
INT8_STEPS = 127
TINY_PART_COS = 0.995
TINY_PART_MAX_STEPS = 4.0

_CONCAT = "top.Concat"
_PERMUTE = "top.Permute"
_RESHAPE = "top.Reshape"
# The ops an output is read through back to its Concat: element by element, so that a slice of their output
# is the same slice of their input (with one activation operand of the same shape; weights may broadcast).
# A whitelist: a Reshape or Permute may keep the shape and still move elements between the parts.
_ELEMENTWISE = frozenset(
    f"top.{n}"
    for n in [
        "Identity",
        "Cast",
        "Relu",
        "Sigmoid",
        "Tanh",
        "Clip",
        "LeakyRelu",
        "PRelu",
        "Elu",
        "Celu",
        "HardSigmoid",
        "HardSwish",
        "SiLU",
        "Swish",
        "GELU",
        "Mish",
        "Softplus",
        "Softsign",
        "Exp",
        "Log",
        "Sqrt",
        "Abs",
        "Reciprocal",
        "Round",
        "Floor",
        "Ceil",
        "Erf",
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Max",
        "Min",
        "Pow",
    ]
)


@dataclass(frozen=True)
class Part:
    """A slice ``[start, stop)`` along ``axis`` of one graph output, named; ``sources``: the TOP tensors it
    comes from (the Concat inputs it covers), whose calibration thresholds give its INT8 scale."""

    name: str
    axis: int
    start: int
    stop: int
    sources: tuple[str, ...] = ()
    declared: bool = False  # from the manifest (else found in the graph)

    def slice(self, array: np.ndarray) -> np.ndarray:
        index = [slice(None)] * np.ndim(array)
        index[self.axis] = slice(self.start, self.stop)
        return np.asarray(array)[tuple(index)]

    def to_dict(self) -> dict:
        return {
            "part": self.name,
            "axis": self.axis,
            "range": [self.start, self.stop],
            "sources": list(self.sources),
            "declared": self.declared,
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> Part:
        return cls(
            d["part"],
            int(d["axis"]),
            int(d["range"][0]),
            int(d["range"][1]),
            tuple(d.get("sources", ())),
            bool(d.get("declared", False)),
        )


def _producer_through_shape_keepers(value):
    """The op that makes ``value``, looking through ops with one non-weight operand of the same shape."""
    from tpubuild.ir.base import TensorOp, is_none, tensor_shape
    from tpubuild.ir.top import WeightOp

    seen = 0
    while seen < 64:  # a chain of activations and casts is short; a cycle cannot happen in SSA
        seen += 1
        op = value.owner
        if not isinstance(op, TensorOp) or op.name not in _ELEMENTWISE:
            return op
        acts = [v for v in op.operands if not is_none(v) and not isinstance(v.owner, WeightOp)]
        if len(op.results) != 1 or len(acts) != 1 or tensor_shape(acts[0]) != tensor_shape(value):
            return op
        value = acts[0]
    return value.owner


def _concat_inputs(op, axis: int) -> list:
    """The Concat's inputs along ``axis``, nested Concats on the same axis flattened."""
    from tpubuild.ir.base import tensor_shape

    out = []
    for v in op.operands:
        inner = v.owner
        if getattr(inner, "name", None) == _CONCAT:
            rank = len(tensor_shape(v))
            if inner.params.axis % rank == axis:
                out += _concat_inputs(inner, axis)
                continue
        out.append(v)
    return out


def _axis_after_reshape(before: Sequence[int], after: Sequence[int], axis: int) -> int | None:
    """Where a slice along ``axis`` of a tensor of shape ``before`` lies after a reshape to ``after``: the same
    slice along the axis returned when the reshape keeps every dimension up to that axis (it regroups only
    those after) or every one from it on (it regroups only those before); None otherwise."""
    before, after = tuple(before), tuple(after)
    if before[: axis + 1] == after[: axis + 1]:
        return axis
    kept = len(before) - axis
    if len(after) >= kept and before[axis:] == after[len(after) - kept :]:
        return len(after) - kept
    return None


def _traced_concat(value):
    """(the Concat that makes ``value``, the steps from its result to ``value``, first to last), looking through
    shape-keeping ops, reshapes and transposes; None when no Concat makes it so. A step maps an axis of its
    operand to the axis of its result that holds the same slices, or to None (_axis_through)."""
    from tpubuild.ir.base import TensorOp, tensor_shape

    steps = []
    for _ in range(16):  # a head reshapes and transposes a few times at most
        op = _producer_through_shape_keepers(value)
        if not isinstance(op, TensorOp):
            return None
        if op.name == _RESHAPE:
            steps.append(
                functools.partial(_axis_after_reshape, tensor_shape(op.operands[0]), tensor_shape(op.results[0]))
            )
        elif op.name == _PERMUTE:
            steps.append(list(op.params.order).index)
        else:
            break
        value = op.operands[0]
    if op.name != _CONCAT:
        return None
    return op, steps[::-1]


def _axis_through(steps, axis: int | None) -> int | None:
    """``axis`` after each of ``steps`` (_traced_concat); None once one moves the slices."""
    for step in steps:
        if axis is None:
            return None
        axis = step(axis)
    return axis


def _concat_axis(op) -> int:
    from tpubuild.ir.base import tensor_shape

    return op.params.axis % len(tensor_shape(op.results[0]))


def _slices(values, axis: int) -> list[tuple[str, int, int]]:
    """(name, start, stop) of each of ``values`` laid side by side along ``axis``."""
    from tpubuild.ir.base import tensor_shape
    from tpubuild.ir.mlir import value_name

    start, found = 0, []
    for v in values:
        size = tensor_shape(v)[axis]
        found.append((value_name(v), start, start + size))
        start += size
    return found


def _field_parts(inputs, axis: int, to_output) -> list[Part]:
    """The fields of the inner Concats that make every one of ``inputs`` (a Concat's, along ``axis``), on one
    other axis and with the same sizes: each field over every input, named after the first input's; none when
    the inputs are not all made so. ``to_output`` maps an axis of the outer Concat to the output's (or None)."""
    levels = []
    for v in inputs:
        traced = _traced_concat(v)
        if traced is None:
            return []
        inner, steps = traced
        inner_axis = _concat_axis(inner)
        levels.append((_axis_through(steps, inner_axis), _slices(_concat_inputs(inner, inner_axis), inner_axis)))
    field_axis, first = levels[0]
    bounds = [(start, stop) for _, start, stop in first]
    out_axis = to_output(field_axis)
    if field_axis in (None, axis) or out_axis is None or len(first) < 2:
        return []
    if any(a != field_axis or [(s, e) for _, s, e in f] != bounds for a, f in levels):
        return []
    return [
        Part(name, out_axis, start, stop, tuple(f[k][0] for _, f in levels))
        for k, (name, start, stop) in enumerate(first)
    ]


def concat_parts(module) -> dict[str, list[Part]]:
    """Each graph output made by a Concat (through shape-keeping ops, transposes and reshapes that keep its
    slices): one part per Concat input, and the field parts of inner Concats (_field_parts)."""
    from tpubuild.ir.mlir import return_op, value_name

    parts: dict[str, list[Part]] = {}
    for value in return_op(module).operands:
        traced = _traced_concat(value)  # a detection head's (1, 4 + classes, anchors) is often transposed
        if traced is None:
            continue
        op, steps = traced
        axis = _concat_axis(op)
        inputs = _concat_inputs(op, axis)
        out_axis = _axis_through(steps, axis)
        if len(inputs) < 2 or out_axis is None:
            continue
        found = [Part(name, out_axis, start, stop, (name,)) for name, start, stop in _slices(inputs, axis)]
        parts[value_name(value)] = found + _field_parts(inputs, axis, functools.partial(_axis_through, steps))
    return parts


def declared_parts(
    outputs: Mapping[str, Mapping] | None, shapes: Mapping[str, Sequence[int]], auto: Mapping[str, Sequence[Part]]
) -> dict[str, list[Part]]:
    """The manifest's ``outputs`` parts, checked against the outputs' shapes (``shapes``, by TOP output name).

    A declared part's sources are the automatic parts it overlaps (their Concat inputs), if any.
    """
    out: dict[str, list[Part]] = {}
    for output, spec in (outputs or {}).items():
        where = f"outputs.{output}"
        if output not in shapes:
            raise TpuBuildError(
                f"{where}: the model has no graph output {output!r} (its outputs: {sorted(shapes)})",
                hint="key `outputs` by the ONNX graph output names",
            )
        shape = list(shapes[output])
        found = []
        for name, p in (spec.get("parts") or {}).items():
            axis = int(p["axis"])
            rank = len(shape)
            if not -rank <= axis < rank:
                raise TpuBuildError(f"{where}.parts.{name}: axis {axis} is outside the output's {rank} dimensions")
            axis %= rank
            start, stop = (int(v) for v in p["range"])
            if not 0 <= start < stop <= shape[axis]:
                raise TpuBuildError(
                    f"{where}.parts.{name}: range [{start}, {stop}] is not within the output's axis {axis} "
                    f"of size {shape[axis]}",
                    hint="range is [start, stop) with 0 <= start < stop <= the axis size",
                )
            sources = tuple(
                s
                for a in auto.get(output, ())
                if a.axis == axis and a.start < stop and start < a.stop
                for s in a.sources
            )
            found.append(Part(name, axis, start, stop, sources, declared=True))
        out[output] = found
    return out


def output_parts(module, outputs: Mapping[str, Mapping] | None, shapes: Mapping[str, Sequence[int]]):
    """The parts of every graph output of the TOP ``module``: declared ones win over automatic ones."""
    auto = concat_parts(module)
    declared = declared_parts(outputs, shapes, auto)
    return {**{k: v for k, v in auto.items() if k not in declared}, **{k: v for k, v in declared.items() if v}}


@dataclass(frozen=True)
class PartJudgement:
    sim: Similarity
    passed: bool
    rule: str  # "similarity" or "tiny"
    step: float | None  # the part's INT8 step (calibrated threshold / 127), when known
    ref_max: float

    def to_dict(self) -> dict:
        d = self.sim.to_dict()
        d.update(passed=self.passed, rule=self.rule, step=self.step, ref_max_abs=self.ref_max)
        if self.rule == "tiny":
            d["label"] = "TINY OK" if self.passed else "TINY NOT OK"
        return d


def part_step(part: Part, thresholds: Mapping[str, float] | None) -> float | None:
    """One INT8 step of the part's calibrated scale: the largest threshold of its sources over 127."""
    return int8_step(part.sources, thresholds)


def int8_step(tensors: Sequence[str], thresholds: Mapping[str, float] | None) -> float | None:
    """One INT8 step of the largest usable calibrated threshold of ``tensors`` (None: none has one)."""
    known = [float(thresholds[s]) for s in tensors if thresholds and s in thresholds]
    known = [t for t in known if math.isfinite(t) and t > 0]
    return max(known) / INT8_STEPS if known else None


def rounding_cos(ref: np.ndarray, step: float) -> float:
    """The cosine of ``ref`` rounded to multiples of ``step`` against ``ref``: the best an INT8 result at that
    step can score (0 when every value rounds to zero)."""
    r = np.asarray(ref, dtype=np.float64)
    q = np.round(r / step) * step
    return cosine(q, r) if np.any(q) else 0.0


def is_tiny(ref: np.ndarray, step: float | None) -> bool:
    """The tiny-part rule's test: the part's float values ``ref`` are too small for an INT8 ``step`` of its
    calibrated scale for a cosine to judge it (rounding_cos below TINY_PART_COS; never without a step)."""
    return step is not None and rounding_cos(ref, step) < TINY_PART_COS


def tiny_bound(step: float) -> float:
    """The largest absolute error a tiny part may have at an INT8 ``step``: TINY_PART_MAX_STEPS steps."""
    return TINY_PART_MAX_STEPS * step


def judge_part(test: np.ndarray, ref: np.ndarray, tol: Tolerance, step: float | None) -> PartJudgement:
    """A part's metrics and verdict: cos/euc as any tensor, except a tiny part (is_tiny: its float values too
    small for one INT8 ``step`` of its calibrated scale), which passes when its max abs error is at most
    TINY_PART_MAX_STEPS steps. Without a known step (float targets, no calibration), cos/euc decide."""
    sim = similarity(test, ref, tol)
    ref_max = float(np.max(np.abs(ref))) if np.size(ref) else 0.0
    if step is not None and sim.label != "NOT MATCH" and is_tiny(ref, step):
        passed = sim.label in ("EQUAL", "CLOSE") or sim.max_abs <= tiny_bound(step)
        return PartJudgement(sim, passed, "tiny", step, ref_max)
    return PartJudgement(sim, sim.passed, "similarity", step, ref_max)
