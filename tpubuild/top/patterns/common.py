"""What TOP rewrite patterns share: users of a value, weight arrays, rebuilding ops, renaming."""

from __future__ import annotations

import dataclasses
import types
from typing import TypeVar, overload
from collections.abc import Sequence

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import FusedLoc, NoneAttr
from xdsl.ir import OpResult, Operation, SSAValue
from xdsl.pattern_rewriter import PatternRewriter

from tpubuild.ir import top
from tpubuild.ir.base import TensorOp, name_loc
from tpubuild.ir.types import dtype_of, tensor_type
from tpubuild.ir.weights import WeightStore


def users(value: SSAValue) -> list[Operation]:
    return [use.operation for use in value.uses]


def single_user(value: SSAValue) -> Operation | None:
    """The one op using ``value`` (a graph output counts as a user: the return)."""
    ops = users(value)
    return ops[0] if len(ops) == 1 else None


def is_graph_output(value: SSAValue) -> bool:
    return any(isinstance(op, func.ReturnOp) for op in users(value))


_Op = TypeVar("_Op", bound=TensorOp)


@overload
def producer(value: SSAValue) -> TensorOp | None: ...
@overload
def producer(value: SSAValue, cls: type[_Op]) -> _Op | None: ...
@overload
def producer(value: SSAValue, cls: types.UnionType) -> TensorOp | None: ...
def producer(value: SSAValue, cls: type[TensorOp] | types.UnionType = TensorOp) -> TensorOp | None:
    """The op of class ``cls`` that produces ``value``, if it is one."""
    owner = value.owner
    return owner if isinstance(owner, TensorOp) and isinstance(owner, cls) else None


def weight_array(value: SSAValue, weights: WeightStore) -> np.ndarray | None:
    """The array behind a ``top.Weight`` value; None for anything computed at run time."""
    op = producer(value, top.WeightOp)
    return None if op is None else weights[op.loc_name]


def is_constant(value: SSAValue) -> bool:
    return isinstance(value.owner, top.WeightOp | top.NoneOp)


def add_weight(
    rewriter: PatternRewriter, weights: WeightStore, base: str, array: np.ndarray, dtype: np.dtype | None = None
) -> SSAValue:
    """Store ``array`` under a fresh name derived from ``base``; a ``top.Weight`` for it goes
    in front of the matched op. ``dtype`` keeps the element type of what it replaces."""
    array = np.asarray(array, dtype=dtype if dtype is not None else np.asarray(array).dtype)
    name = weights.add(base, array)
    op = top.WeightOp.make([], name=name, result_types=[tensor_type(array.shape, array.dtype)])
    rewriter.insert(op)
    return op.results[0]


def element_dtype(value: SSAValue) -> np.dtype:
    return dtype_of(value.type)


def rebuilt(
    op: TensorOp, *, params=None, operands: Sequence[SSAValue] | None = None, name: str | Sequence[str] | None = None
) -> TensorOp:
    """A copy of ``op`` with new params, operands or tensor name(s); result types are kept."""
    names = op.names if name is None else name
    if not isinstance(names, str) and len(names) == 1:
        names = names[0]
    return type(op).make(
        list(op.operands) if operands is None else list(operands),
        op.params if params is None else params,
        name=names,
        result_types=[r.type for r in op.results],
    )


def with_relu(p, do_relu: bool, relu_limit: float):
    """``p`` with a fused ReLU(-N) on top of whatever it already clamps to."""
    if not getattr(p, "do_relu", False):
        return dataclasses.replace(p, do_relu=do_relu, relu_limit=relu_limit) if do_relu else p
    return dataclasses.replace(p, relu_limit=tighter_limit(p.relu_limit, relu_limit if do_relu else -1.0))


def tighter_limit(a: float, b: float) -> float:
    """Upper bound of ReLU-a followed by ReLU-b (negative: unbounded)."""
    if a < 0:
        return b
    if b < 0:
        return a
    return min(a, b)


def carries_relu(op: Operation) -> bool:
    """Whether the op's params can hold a fused ReLU (``do_relu``/``relu_limit``)."""
    return isinstance(op, TensorOp) and any(f.name == "do_relu" for f in dataclasses.fields(op.PARAMS))


def erase_if_unused(op: Operation, rewriter: PatternRewriter) -> None:
    """Erase an op a rewrite left without users (so it stops counting as one for others)."""
    if all(not result.uses for result in op.results):
        rewriter.erase(op)


def rename_result(op: TensorOp, index: int, name: str) -> None:
    names = op.names
    names[index] = name
    op.location = name_loc(names[0]) if len(names) == 1 else FusedLoc(tuple(name_loc(n) for n in names), NoneAttr())


def forward(op: TensorOp, value: SSAValue, rewriter: PatternRewriter) -> bool:
    """Remove ``op``, whose single result is the same tensor as ``value``.

    A graph output keeps its name: when ``op``'s result is one, ``value``'s producer
    takes the name instead, which is only possible if nothing else sees ``value``
    under its own name (no other user, and not a graph input or a weight).
    Returns whether ``op`` was removed.
    """
    result = op.results[0]
    if is_graph_output(result):
        source = producer(value)
        if (
            source is None
            or not isinstance(value, OpResult)
            or isinstance(source, top.InputOp | top.WeightOp | top.NoneOp)
            or any(user is not op for user in users(value))
        ):
            return False
        rename_result(source, value.index, op.names[0])
        rewriter.notify_op_modified(source)
    rewriter.replace(op, [], [value])
    return True
