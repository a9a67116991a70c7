"""Reference inference of a stage file: run each op's registered kernel in order.

Works for any module whose ops have kernels (TOP now, TPU once lowering adds
its kernels). Results are keyed by tensor name (the op location), so every
stage's dump can be compared with every other's and with onnxruntime's.
"""

from __future__ import annotations

import hashlib
import os
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from xdsl.dialects.builtin import ModuleOp, TensorType

from tpubuild.errors import TpuBuildError
from tpubuild.ir import mlir
from tpubuild.ir.base import TensorOp
from tpubuild.ir.top import InputOp, NoneOp, WeightOp
from tpubuild.ir.types import dtype_of, shape_of
from tpubuild.ir.weights import WeightStore
from tpubuild.kernels import KernelError, Operand, halfcast, prepare


def output_names(module: ModuleOp) -> list[str]:
    return mlir.output_names(module)


def input_names(module: ModuleOp) -> list[str]:
    return [op.loc_name for op in mlir.input_ops(module)]


# observer(op, args, results): called after each computed op (top.Input included, with no args)
Observer = Callable[[TensorOp, Sequence["np.ndarray | None"], tuple[np.ndarray, ...]], None]


def run(
    module: ModuleOp,
    weights: WeightStore,
    inputs: Mapping[str, np.ndarray],
    *,
    all_tensors: bool = True,
    observer: Observer | None = None,
) -> dict[str, np.ndarray]:
    """Run ``@main``; returns every tensor by name (or just the graph outputs).

    With ``all_tensors=False`` a tensor is dropped after its last use, so memory
    holds only the live tensors; an ``observer`` still sees every op's operands
    and results as they are computed (calibration streams its statistics so).
    To run one module on many inputs, make its ``Plan`` once and run that.
    """
    return Plan(module, weights).run(inputs, all_tensors=all_tensors, observer=observer)


class _Step(NamedTuple):
    op: TensorOp
    fn: Callable | None  # None: a graph input
    args: tuple[int, ...]  # operand slots
    outs: tuple[int, ...]  # result slots
    names: list[str]
    result_types: list[tuple[tuple[int, ...], np.dtype]]
    frees: tuple[int, ...]  # slots last used here (a live-tensors run drops them)


class Plan:
    """``@main`` resolved once for many inputs: each op's kernel bound to its parameters, every value a list slot.

    Calibration, the search's references and the benches run one module on many inputs; a small
    model's run was mostly finding kernels, decoding parameters and looking values up, not the
    kernels' work. Kernels registered as ``prepared`` are also made once for their operands' shapes
    and weights (the weights reshaped, the windows' index work done). A plan holds the module as it
    was when planned: plan a rewritten module again.
    """

    def __init__(self, module: ModuleOp, weights: WeightStore):
        slots: dict[int, int] = {}  # id(value) -> slot; an SSAValue's own __hash__ is a Python call
        self.constants: list = []  # slot -> a weight (None: absent, or computed by a step)
        operands: list[list[Operand]] = []
        ops = []
        for op in mlir.body_ops(module):
            if not isinstance(op, TensorOp):
                continue
            role = _role(type(op))
            if role is NoneOp or role is WeightOp:
                slots[id(op.results[0])] = len(self.constants)
                self.constants.append(weights[op.loc_name] if role is WeightOp else None)
                continue
            ops.append((op, role))
            operands.append([_operand(v, self.constants[slots[id(v)]]) for v in _used(op, role)])
            for value in op.results:
                slots[id(value)] = len(self.constants)
                self.constants.append(None)
        self.outputs = [(mlir.value_name(v), slots[id(v)]) for v in mlir.return_op(module).operands]
        last_use = {}
        for i, (op, role) in enumerate(ops):
            for v in (*_used(op, role), *op.results):
                last_use[slots[id(v)]] = i
        keep = {slot for _, slot in self.outputs} | {s for s, c in enumerate(self.constants) if c is not None}
        self.steps = []
        self._specs: list[list[Operand]] = []
        for i, ((op, role), spec) in enumerate(zip(ops, operands, strict=True)):
            params, result_types, names = _decoded(op, role)
            fn = None if role is InputOp else prepare(type(op), params, spec)
            self._specs.append(spec)
            frees = tuple(
                slots[id(v)]
                for v in (*_used(op, role), *op.results)
                if last_use[slots[id(v)]] == i and slots[id(v)] not in keep
            )
            self.steps.append(
                _Step(
                    op,
                    fn,
                    tuple(slots[id(v)] for v in _used(op, role)),
                    tuple(slots[id(v)] for v in op.results),
                    names,
                    result_types,
                    frees,
                )
            )

    def run(
        self, inputs: Mapping[str, np.ndarray], *, all_tensors: bool = True, observer: Observer | None = None
    ) -> dict[str, np.ndarray]:
        """As ``run()`` of the planned module."""
        values = list(self.constants)
        named: dict[str, np.ndarray] = {}
        # the step's fields unpacked by the loop: a small model's op costs about a microsecond of this loop
        for op, fn, slots, outs, names, result_types, frees in self.steps:
            if fn is None:
                args: list = []
                result = _feed(op, inputs)
            else:
                args = [values[i] for i in slots]
                result = _call(op, fn, args)
            if type(result) is np.ndarray and len(outs) == 1:
                # most ops: the result's check inline, ``_checked`` only when it fails
                expect, dtype = result_types[0]
                if not (result.shape == expect and result.dtype == dtype and result.flags.c_contiguous):
                    result = _checked(op, result, names[0], expect, dtype)
                values[outs[0]] = result
                arrays = (result,)
            else:
                arrays = _all_checked(op, result, names, result_types)
                for slot, array in zip(outs, arrays, strict=True):
                    values[slot] = array
            if all_tensors:
                named.update(zip(names, arrays, strict=True))
            if observer is not None:
                observer(op, args, arrays)
            if not all_tensors:
                for slot in frees:
                    values[slot] = None
        named.update((name, values[slot]) for name, slot in self.outputs)
        return named

    def run_together(self, inputs: Sequence[Mapping[str, np.ndarray]], revise: Reviser) -> None:
        """Every input through the module an op at a time (each op on all of them before the next). ``revise``
        sees the op and its results on each input, and may return new arrays for some of its weight operands (by
        operand index): the op's kernel is prepared for them and run again, and later ops read those results.
        Only live tensors are kept: a whole model's tensors times the inputs would not fit."""
        values = [list(self.constants) for _ in inputs]
        for i, (op, fn, slots, outs, names, result_types, frees) in enumerate(self.steps):
            results = []
            for k, vals in enumerate(values):
                result = _feed(op, inputs[k]) if fn is None else _call(op, fn, [vals[j] for j in slots])
                results.append(_all_checked(op, result, names, result_types))
            new = revise(op, results) if fn is not None else None
            if new:
                spec = self._specs[i]
                for index, array in new.items():
                    slot = slots[index]
                    self.constants[slot] = array
                    spec[index] = spec[index]._replace(const=array)
                    for vals in values:
                        vals[slot] = array
                fn = prepare(type(op), _decoded(op, _role(type(op)))[0], spec)
                self.steps[i] = self.steps[i]._replace(fn=fn)
                results = [
                    _all_checked(op, _call(op, fn, [vals[j] for j in slots]), names, result_types) for vals in values
                ]
            for vals, arrays in zip(values, results, strict=True):
                for slot, array in zip(outs, arrays, strict=True):
                    vals[slot] = array
                for slot in frees:
                    vals[slot] = None


# revise(op, its results on each input) -> new weight operands by operand index, or None (run_together)
Reviser = Callable[[TensorOp, list[tuple[np.ndarray, ...]]], "Mapping[int, np.ndarray] | None"]


def _used(op: TensorOp, role: type | None) -> Sequence:
    """The values an op reads: a graph input reads its data by name, not its operand (the function's argument)."""
    return () if role is InputOp else op.operands


def _operand(value, const) -> Operand:
    """What a prepared kernel knows of an operand before any run: its type, and its array when a weight."""
    t = value.type
    if not isinstance(t, TensorType):
        return Operand(None, None, None)
    return Operand(shape_of(t), dtype_of(t), const)


class Memo:
    """Tensors of earlier runs on the same inputs, reused by later runs of related modules.

    An op's results are determined by its kind, attributes, result types and operands, so
    each value gets a key from those (an operand by its own key, a weight by its bytes, a
    graph input by its name): a run that meets a key computed before on the same input
    takes its tensors instead of running the kernel. The mixed-precision search lowers one
    model dozens of times with a few ops changed each time; the ops before the first
    change, and those the change does not reach, are then computed once. Keeps at most
    ``budget`` bytes of tensors, least recently used dropped first.
    """

    def __init__(self, inputs: Sequence[Mapping[str, np.ndarray]], budget: int = 1 << 30):
        self.inputs = list(inputs)
        self.budget = budget
        self._keys: dict[tuple, int] = {}
        self._attrs: dict[object, int] = {}  # attribute -> number
        self._attr_ids: dict[int, tuple[object, int]] = {}  # id(attribute) -> (attribute, number)
        self._weights: dict[int, tuple[weakref.ref, tuple]] = {}  # id(weight array) -> (array, signature)
        self._results: OrderedDict[tuple[int, int], tuple[tuple, int]] = OrderedDict()  # (key, input) -> results
        self._fns: OrderedDict[int, Callable] = OrderedDict()  # kind (_plan_of) -> the op's kernel, prepared
        self._bytes = 0
        self._plan: tuple[ModuleOp, WeightStore, list, list] | None = None
        self.computed = self.reused = 0  # ops, over all runs

    def run(self, module: ModuleOp, weights: WeightStore, index: int) -> dict[str, np.ndarray]:
        """The graph outputs by name on input ``index`` (as ``run(..., all_tensors=False)`` gives them)."""
        plan, outputs = self._plan_of(module, weights)
        here: dict[int, tuple] = {}  # this run's values by key (an entry may leave the memo meanwhile)
        for op, role, key, operands, kind in plan:
            if role is WeightOp:
                here[key] = (weights[op.loc_name],)
            elif role is NoneOp:
                here[key] = (None,)
            elif key not in here:
                here[key] = self._results_of(op, role, key, kind, index, [here[k][i] for k, i in operands])
        return {name: here[key][i] for name, (key, i) in outputs}

    def keep(self, indices: Sequence[int]) -> None:
        """Drop the tensors of every input but these (they keep their numbers; the others may be run again)."""
        wanted = set(indices)
        kept = OrderedDict((k, entry) for k, entry in self._results.items() if k[1] in wanted)
        self._results, self._bytes = kept, sum(size for _, size in kept.values())

    def _plan_of(self, module: ModuleOp, weights: WeightStore) -> tuple[list, list]:
        """Each op's key and its operands' (key, result index), for the module of the last run or a new one."""
        if self._plan is not None and self._plan[0] is module and self._plan[1] is weights:
            return self._plan[2], self._plan[3]
        plan = []
        where: dict[int, tuple[int, int]] = {}  # id(value) -> (key, result index)
        typed: dict[tuple[int, int], int] = {}  # (key, result index) of a computed value -> its type's number
        for op in mlir.body_ops(module):
            if not isinstance(op, TensorOp):
                continue
            role = _role(type(op))
            signature: tuple[Any, ...]
            if role is WeightOp:
                signature = self._weight_signature(weights[op.loc_name])
            elif role is NoneOp:
                signature = ("none",)
            else:
                # a graph input reads its data by name; nothing else depends on names or locations
                signature = (
                    op.name,
                    op.loc_name if role is InputOp else None,
                    tuple((k, self._number(a)) for k, a in op.attributes.items()),
                    tuple((k, self._number(a)) for k, a in op.properties.items()),
                    tuple(self._number(r.type) for r in op.results),
                    tuple(where[id(v)] for v in op.operands if id(v) in where),
                )
            key = self._keys.setdefault(signature, len(self._keys))
            operands = [where[id(v)] for v in op.operands] if role is None else []
            # what its prepared kernel depends on: the op, its operands' types and its weights, not what computed
            # them (a table that changes an op upstream makes new keys downstream, not new kernels)
            kind = (
                None
                if role is not None
                else self._keys.setdefault((signature[:-1], tuple(typed.get(o, o) for o in operands)), len(self._keys))
            )
            plan.append((op, role, key, operands, kind))
            for i, value in enumerate(op.results):
                where[id(value)] = (key, i)
                if role is None:
                    typed[key, i] = signature[-2][i]  # a weight's key is its array's dtype, shape and bytes
        outputs = [(mlir.value_name(v), where[id(v)]) for v in mlir.return_op(module).operands]
        self._plan = (module, weights, plan, outputs)
        return plan, outputs

    def _weight_signature(self, array: np.ndarray) -> tuple:
        """A weight by dtype, shape and a digest of its bytes. The search's lowerings hand the same arrays
        back (converted and quantized weights are cached by the lowering): an array met before, still alive,
        is known by identity instead of hashing its bytes on every lowering."""
        key = id(array)
        hit = self._weights.get(key)
        if hit is not None and hit[0]() is array:
            return hit[1]
        # bytes, not the buffer: bfloat16 (ml_dtypes) does not export one
        signature = (
            "weight",
            array.dtype.str,
            array.shape,
            hashlib.blake2b(np.ascontiguousarray(array).view(np.uint8).data, digest_size=16).digest(),
        )
        # a weak reference: the memo must not keep every lowering's weights alive
        self._weights[key] = (weakref.ref(array, lambda ref: self._forget(key, ref)), signature)
        return signature

    def _forget(self, key: int, ref: weakref.ref) -> None:
        if key in self._weights and self._weights[key][0] is ref:
            del self._weights[key]

    def _number(self, attr) -> int:
        """A number per distinct attribute value. Hashing one walks all of it (a per-channel multiplier array,
        thousands of integers, on every lowering), so an attribute object met before is known by identity (it
        stays referenced here, so its id is not reused)."""
        hit = self._attr_ids.get(id(attr))
        if hit is not None and hit[0] is attr:
            return hit[1]
        number = self._attrs.setdefault(attr, len(self._attrs))
        self._attr_ids[id(attr)] = (attr, number)
        return number

    def _results_of(self, op: TensorOp, role, key: int, kind: int | None, index: int, args: list) -> tuple:
        hit = self._results.get((key, index))
        if hit is not None:
            self._results.move_to_end((key, index))
            self.reused += 1
            return hit[0]
        params, result_types, names = _decoded(op, role)
        if isinstance(op, InputOp):  # (its role)
            result = _feed(op, self.inputs[index])
        else:
            assert kind is not None, "a computed op (no role) has its kernel's kind"
            result = _call(op, self._prepared(op, kind, params, args), args)
        results = _all_checked(op, result, names, result_types)
        self.computed += 1
        size = sum(a.nbytes for a in results)
        self._results[(key, index)] = (results, size)
        self._bytes += size
        while self._bytes > self.budget and len(self._results) > 1:
            _, (_, dropped) = self._results.popitem(last=False)
            self._bytes -= dropped
        return results

    def _prepared(self, op: TensorOp, kind: int, params, args: list) -> Callable:
        """The op's kernel prepared as a Plan prepares it, made once per kind (plan_of): the search runs most
        ops of a table, on several inputs, with kernels the tables before it made."""
        fn = self._fns.get(kind)
        if fn is None:
            spec = [
                _operand(v, a if _role(type(v.owner)) is WeightOp else None)
                for v, a in zip(op.operands, args, strict=True)
            ]
            fn = self._fns[kind] = prepare(type(op), params, spec)
            if len(self._fns) > _MEMO_KERNELS:
                self._fns.popitem(last=False)
        return fn


# prepared kernels a Memo keeps (they hold copies of their weights in the forms they need)
_MEMO_KERNELS = 4096


def _call(op: TensorOp, fn: Callable, args: list) -> np.ndarray | tuple:
    """``fn`` (the op's kernel, bound to its parameters) on ``args``; a kernel's failure is the op's error."""
    try:
        return fn(*args)
    except (KernelError, ValueError, FloatingPointError) as e:
        raise TpuBuildError(f"{op.name} failed in reference inference: {e}", loc=op.loc_name) from None


def _all_checked(
    op: TensorOp, result: np.ndarray | tuple, names: list[str], result_types: list[tuple[tuple[int, ...], np.dtype]]
) -> tuple:
    """Each of a kernel's results ``_checked`` against its result type."""
    return tuple(
        _checked(op, np.asarray(a), name, expect, dtype)
        for a, name, (expect, dtype) in zip(
            result if isinstance(result, tuple) else (result,), names, result_types, strict=True
        )
    )


def _checked(op: TensorOp, array: np.ndarray, name: str, expect: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    if array.shape != expect:
        raise TpuBuildError(f"{op.name} produced shape {array.shape}, its type says {expect}", loc=name)
    if array.dtype == dtype and array.flags.c_contiguous:
        return array  # most results: what halfcast.astype would return, without its checks
    # C order, as the chip's tiles are: numpy's BLAS rounds differently on a transposed view
    return halfcast.astype(array, dtype, order="C")


# per op class, looked up once: the graph-source op it is (or None: computed by a kernel)
_ROLES: dict[type, type | None] = {}


def _role(cls: type) -> type | None:
    if cls not in _ROLES:
        _ROLES[cls] = next((base for base in (NoneOp, WeightOp, InputOp) if issubclass(cls, base)), None)
    return _ROLES[cls]


# per op: its decoded parameters, result (shape, dtype)s and tensor names, for later runs of the same
# module (calibration runs one module hundreds of times; decoding is most of a small op's time). Valid
# while the op keeps its attributes, result types and location: a rewritten op is decoded again.
_DECODED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _decoded(op: TensorOp, role: type | None) -> tuple[object, list[tuple[tuple[int, ...], np.dtype]], list[str]]:
    key = (tuple(op.attributes.items()), tuple(r.type for r in op.results), op.location)
    hit = _DECODED.get(op)
    if hit is not None and hit[0] == key:
        return hit[1]
    decoded = (None if role is InputOp else op.params, [(shape_of(t), dtype_of(t)) for t in key[1]], op.names)
    _DECODED[op] = (key, decoded)
    return decoded


def _feed(op: InputOp, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
    name = op.loc_name
    if name not in inputs:
        raise TpuBuildError(
            f"no data for graph input {name!r} (inputs given: {sorted(inputs)})",
            hint="the input npz must hold one array per graph input, named as the input",
        )
    array = np.asarray(inputs[name])
    expect = shape_of(op.results[0].type)
    if array.shape != expect:
        if array.size != int(np.prod(expect)):
            raise TpuBuildError(f"input {name!r} has shape {array.shape}, the model expects {expect}")
        array = array.reshape(expect)
    return array.astype(dtype_of(op.results[0].type), copy=False)


# Graph outputs of TOP inference kept for a later stage of this process, by (module key, input key): calibration
# runs every calibration sample through canonical.mlir and keeps the outputs under cali.mlir's key (its TOP
# inference is the same: calibration only adds types), and the mixed-precision search, which doit runs next in the
# same process (build/dispatch.py: a task goes to the process that made its inputs), scores its tables against the
# outputs of the same samples: PP-OCRv4 rec's 24, 1.4 s of inference. At most _OUTPUTS_KEEP bytes, newest kept.
_OUTPUTS: OrderedDict[tuple[bytes, bytes], list[np.ndarray]] = OrderedDict()
_OUTPUTS_KEEP = 256 << 20


def input_key(inputs: Mapping[str, np.ndarray]) -> bytes:
    """A digest of an input set: names, dtypes, shapes and bytes."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(inputs):
        array = np.ascontiguousarray(inputs[name])
        digest.update(f"{name}\0{array.dtype.str}\0{array.shape}\0".encode())
        digest.update(array.view(np.uint8).data)
    return digest.digest()


def keep_outputs(module_key: bytes, runs: Sequence[tuple[Mapping[str, np.ndarray], Sequence[np.ndarray]]]) -> None:
    """Keep each (inputs, graph outputs) of ``runs`` for kept_outputs."""
    for inputs, outputs in runs:
        _OUTPUTS[module_key, input_key(inputs)] = list(outputs)
    size = sum(a.nbytes for outputs in _OUTPUTS.values() for a in outputs)
    while size > _OUTPUTS_KEEP and _OUTPUTS:
        size -= sum(a.nbytes for a in _OUTPUTS.popitem(last=False)[1])


def kept_outputs(module_key: bytes, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray] | None:
    """The graph outputs keep_outputs kept for this module and input, or None."""
    return _OUTPUTS.get((module_key, input_key(inputs)))


def weights_for(module: ModuleOp, mlir_path: str | os.PathLike) -> WeightStore:
    """The weight store a module names, resolved next to its .mlir file."""
    weight_file = mlir.module_attr(module, "weight_file")
    if not weight_file:
        return WeightStore()
    return WeightStore.load(Path(mlir_path).parent / weight_file)


def infer_file(
    mlir_path: str | os.PathLike, inputs: Mapping[str, np.ndarray], *, all_tensors: bool = True
) -> dict[str, np.ndarray]:
    module = mlir.load_module(mlir_path)
    try:
        return run(module, weights_for(module, mlir_path), inputs, all_tensors=all_tensors)
    except TpuBuildError as e:
        raise e.with_context(file=str(mlir_path)) from None
