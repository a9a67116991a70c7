"""TOP -> upstream MLIR (tosa, plus linalg/arith/math/tensor where TOSA has no op), as text.

One export rule per TOP op class, registered with ``@rule(top.XxxOp)`` in the family modules next to this one
(nn.py, elementwise.py, tensor.py): a rule gets the ``Emitter``, the op, its parsed parameters and its operands
(``Val``, or None for an absent optional one) and returns its result(s). The emitter writes every op in MLIR's
generic form (``"tosa.conv2d"(...) <{...}>``): IREE's parser takes it for every op, where the pretty forms of
some TOSA ops change between releases. Weights become ``dense_resource`` blobs (hex, as MLIR's own writer keeps
them) so a 100 MB model costs one hex pass, not a parse of every element. TOP is NCHW; TOSA's convolutions and
pools are NHWC, so their rules transpose around them (IREE folds the transposes that meet).

An op without a rule is refused with a TpuBuildError naming the op, its location and the model.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Sequence
from typing import Any
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from tpubuild.errors import TpuBuildError
from tpubuild.registry import Registry

_RULES = Registry("a TOSA export rule")

# numpy dtype -> MLIR element type (TOSA and linalg take signless integers)
_ELEMENT = {
    np.dtype(np.float32): "f32",
    np.dtype(np.float16): "f16",
    np.dtype(ml_dtypes.bfloat16): "bf16",
    # TOSA has no f64: computed in f32, as IREE's own f64 -> f32 demotion would
    np.dtype(np.float64): "f32",
    np.dtype(np.int64): "i64",
    np.dtype(np.int32): "i32",
    np.dtype(np.int16): "i16",
    np.dtype(np.int8): "i8",
    np.dtype(np.bool_): "i1",
    # unsigned integers are signless of the same width; the ops whose meaning depends on the sign (compare,
    # divide, max/min, casts) take unsigned arith ops (Emitter.binary, the cast rule), the others are the same bits
    np.dtype(np.uint8): "i8",
    np.dtype(np.uint16): "i16",
    np.dtype(np.uint32): "i32",
    np.dtype(np.uint64): "i64",
    # 8-bit floats: MLIR's own types, which IREE compiles and its runtime passes as ml_dtypes arrays
    np.dtype(ml_dtypes.float8_e4m3fn): "f8E4M3FN",
    np.dtype(ml_dtypes.float8_e5m2): "f8E5M2",
    np.dtype(ml_dtypes.float8_e4m3fnuz): "f8E4M3FNUZ",
    np.dtype(ml_dtypes.float8_e5m2fnuz): "f8E5M2FNUZ",
    np.dtype(ml_dtypes.float8_e8m0fnu): "f8E8M0FNU",
}

# types IREE cannot carry across a function's boundary (its runtime maps no i4, i2 or f4 buffer to numpy, and
# sub-byte tensors of odd sizes are no whole bytes): carried one per byte, in the low bits as ml_dtypes holds them
CARRIED = {
    np.dtype(ml_dtypes.int4): "i8",
    np.dtype(ml_dtypes.uint4): "i8",
    np.dtype(ml_dtypes.int2): "i8",
    np.dtype(ml_dtypes.uint2): "i8",
    np.dtype(ml_dtypes.float4_e2m1fn): "i8",
}
_ELEMENT.update(CARRIED)

# the types above no arithmetic rule reads (their bytes are not the values): only the rules of ops that move
# bytes, or convert them (Cast), take them; registered with ``rule(..., narrow=True)``
NARROW = frozenset(t for t, el in _ELEMENT.items() if el.startswith("f8")) | frozenset(CARRIED)
_NARROW_RULES: set[type] = set()

# TOSA binary ops on integers that TOSA's profile refuses (8/16-bit, unsigned), as arith ops in a linalg.generic:
# (op, unsigned variant, cmpi predicate or None)
_INT_BINARY = {
    "tosa.add": ("arith.addi", "arith.addi", None),
    "tosa.sub": ("arith.subi", "arith.subi", None),
    "tosa.mul": ("arith.muli", "arith.muli", None),
    "tosa.maximum": ("arith.maxsi", "arith.maxui", None),
    "tosa.minimum": ("arith.minsi", "arith.minui", None),
    "tosa.equal": ("arith.cmpi", "arith.cmpi", (0, 0)),
    "tosa.greater": ("arith.cmpi", "arith.cmpi", (4, 8)),
    "tosa.greater_equal": ("arith.cmpi", "arith.cmpi", (5, 9)),
}

# weight bytes hex-encoded per write
_CHUNK = 1 << 22

# constants of at most this many elements are written inline (dense<[...]>), larger ones as resources
_INLINE = 16


def rule(*op_classes: type, narrow: bool = False) -> Callable[[Callable], Callable]:
    """Register ``fn(e: Emitter, op, params, args: list[Val | None]) -> Val | tuple[Val, ...]`` for op classes;
    ``narrow``: the rule handles NARROW types (8-bit floats, 2/4-bit types), which other rules are never given."""
    if narrow:
        _NARROW_RULES.update(op_classes)
    return _RULES.register(*op_classes)


def carried(array: np.ndarray) -> np.ndarray:
    """An array as an exported function takes or returns it: a CARRIED type as its bytes (int8)."""
    a = np.asarray(array)
    return a.view(np.int8) if a.dtype in CARRIED else a


def get_rule(op_class: type) -> Callable | None:
    load_rules()
    return _RULES.get(op_class)


def load_rules() -> None:
    """Import the rule modules so their registrations run."""
    from tpubuild.export import elementwise, nn, tensor  # noqa: F401


def element(dtype: np.dtype) -> str:
    dt = np.dtype(dtype)
    if dt not in _ELEMENT:
        raise NotImplementedError(f"element type {dt} has no TOSA export")
    return _ELEMENT[dt]


def tensor_type(shape: Sequence[int], dtype) -> str:
    dims = "".join(f"{d}x" for d in shape)
    return f"tensor<{dims}{element(dtype)}>"


@dataclass(frozen=True)
class Val:
    """An SSA value of the export: its name (``%v12``), shape and numpy dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    # a weight's array: written as a tosa.const when an op first uses it, so rules can reorder it with numpy
    array: np.ndarray | None = field(default=None, compare=False, repr=False)

    @property
    def type(self) -> str:
        return tensor_type(self.shape, self.dtype)

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_float(self) -> bool:
        return self.dtype.kind == "f" or self.dtype == np.dtype(ml_dtypes.bfloat16)


def scalar_literal(value, dtype) -> str:
    """A scalar as MLIR writes it in an attribute of this element type: floats by their bits (exact, and inf and
    NaN have no decimal form), integers in decimal, i1 as true/false."""
    dt = np.dtype(dtype)
    if dt == np.float64:
        dt = np.dtype(np.float32)  # written as f32 (see _ELEMENT)
    if dt == np.bool_:
        return "true" if value else "false"
    if dt.kind in "iu":
        return str(int(value))
    bits = (
        np.asarray(value, dt).reshape(1).view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[dt.itemsize])[0]
    )
    return f"0x{int(bits):0{dt.itemsize * 2}X}"


class Body:
    """The scalar region of an elementwise ``linalg.generic``: arith/math ops on block arguments."""

    def __init__(self, emitter: Emitter):
        self.e = emitter
        self.lines: list[str] = []

    def op(self, name: str, *args: str, type: str, result: str | None = None, props: str = "") -> str:
        """``name`` on scalar values ``args`` of element type ``type``; the result is ``result`` typed (default
        ``type``)."""
        out = self.e.fresh()
        prop = f" <{{{props}}}>" if props else ""
        operand_types = ", ".join([type] * len(args))
        self.lines.append(f'{out} = "{name}"({", ".join(args)}){prop} : ({operand_types}) -> {result or type}')
        return out

    def typed(self, name: str, args: Sequence[tuple[str, str]], result: str, props: str = "") -> str:
        """An op whose operands have different types: ``args`` as (value, type)."""
        out = self.e.fresh()
        prop = f" <{{{props}}}>" if props else ""
        names, types = ", ".join(a for a, _ in args), ", ".join(t for _, t in args)
        self.lines.append(f'{out} = "{name}"({names}){prop} : ({types}) -> {result}')
        return out

    def const(self, value, dtype) -> str:
        out = self.e.fresh()
        el = element(dtype)
        self.lines.append(
            f'{out} = "arith.constant"() <{{value = {scalar_literal(value, dtype)} : {el}}}> : () -> {el}'
        )
        return out

    # the few float ops rules use, by name
    def f(self, name: str, *args: str, el: str = "f32") -> str:
        return self.op(name, *args, type=el)

    def cmpf(self, predicate: str, a: str, b: str, el: str = "f32") -> str:
        return self.op("arith.cmpf", a, b, type=el, result="i1", props=f"predicate = {_CMPF[predicate]} : i64")

    def select(self, cond: str, a: str, b: str, el: str) -> str:
        return self.typed("arith.select", [(cond, "i1"), (a, el), (b, el)], el)


_CMPF = {"oeq": 1, "ogt": 2, "oge": 3, "olt": 4, "ole": 5, "one": 6, "ord": 7, "ueq": 8, "une": 13, "uno": 14}


class Emitter:
    """Writes one function's ops as generic MLIR text; weights go to resources."""

    def __init__(self, model: str, resources: bool = True, key_prefix: str = ""):
        self.model = model
        self.key_prefix = key_prefix
        self.resources_on = resources
        self.lines: list[str] = []
        self.resources: list[tuple[str, np.ndarray]] = []
        self._count = 0
        self.loc = "unknown"
        self._weights: dict[int, Val] = {}
        self._weight_locs: dict[int, str] = {}

    def fresh(self) -> str:
        self._count += 1
        return f"%v{self._count}"

    # ---- ops ---------------------------------------------------------------------------------------------

    def op(
        self,
        name: str,
        operands: Sequence[Val],
        results: Sequence[tuple[Sequence[int], Any]],
        props: str = "",
        *,
        region: list[str] | None = None,
        operand_types: Sequence[str] | None = None,
    ) -> list[Val]:
        """One op in generic form, at the current location; ``results`` as (shape, dtype)."""
        operands = [self.use(v) for v in operands]
        outs = [Val(self.fresh(), tuple(int(d) for d in s), np.dtype(dt)) for s, dt in results]
        lhs = ""
        if len(outs) == 1:
            lhs = f"{outs[0].name} = "
        elif outs:
            base = self.fresh()
            lhs = f"{base}:{len(outs)} = "
            outs = [Val(f"{base}#{i}", o.shape, o.dtype) for i, o in enumerate(outs)]
        prop = f" <{{{props}}}>" if props else ""
        types = ", ".join(operand_types if operand_types is not None else [v.type for v in operands])
        result_types = ", ".join(o.type for o in outs)
        body = ""
        if region is not None:
            body = " ({\n" + "\n".join(f"  {line}" for line in region) + "\n})"
        self.lines.append(
            f'{lhs}"{name}"({", ".join(v.name for v in operands)}){prop}{body} : ({types}) -> ({result_types})'
            f" loc({json.dumps(self.loc)})"
        )
        return outs

    def use(self, v: Val) -> Val:
        """``v`` as an SSA value: a weight not written yet becomes its tosa.const here."""
        if v.name:
            return v
        key = id(v.array)
        if key not in self._weights:
            here, self.loc = self.loc, self._weight_locs.get(key, self.loc)
            self._weights[key] = self.const(v.array)
            self.loc = here
        return self._weights[key]

    def weight(self, array: np.ndarray, name: str) -> Val:
        """A weight, written where first used (located at its own name)."""
        a = np.asarray(array)
        element(a.dtype)
        self._weight_locs[id(a)] = name
        return Val("", a.shape, a.dtype, a)

    def op1(self, name: str, operands: Sequence[Val], shape: Sequence[int], dtype, props: str = "") -> Val:
        return self.op(name, operands, [(shape, dtype)], props)[0]

    # ---- constants ---------------------------------------------------------------------------------------

    def const(self, array, dtype=None) -> Val:
        """A tosa.const holding ``array`` (a splat or a small one inline, else a resource blob)."""
        a = np.asarray(array, dtype=dtype)
        typed = a.dtype  # float64 stays the value's type, written as float32 (see _ELEMENT)
        if a.dtype == np.float64:
            a = a.astype(np.float32)
        if a.size == 0:  # no values (TOSA refuses a zero-size tosa.const)
            return self.op1("tensor.empty", [], a.shape, typed)
        ttype = tensor_type(a.shape, a.dtype)
        flat = a.reshape(-1)
        if _splat(flat):
            text = f"dense<{scalar_literal(flat[0], a.dtype)}>"
        elif a.dtype == np.bool_ or (a.dtype.kind in "iu" and a.size <= _INLINE):
            text = f"dense<{json.dumps(_nested(a))}>"
        elif not self.resources_on:
            # inline hex: IREE's f32 -> f16 demotion rewrites dense attributes, not resource blobs
            text = f'dense<"0x{np.ascontiguousarray(a).view(np.uint8).tobytes().hex().upper()}">'
        else:
            key = f"{self.key_prefix}w{len(self.resources)}"
            self.resources.append((key, np.ascontiguousarray(a)))
            text = f"dense_resource<{key}>"
        return self.op1("tosa.const", [], a.shape, typed, f"values = {text} : {ttype}")

    def scalar(self, value, dtype, rank: int) -> Val:
        """A constant of one element broadcastable to ``rank`` dims (TOSA elementwise ops need equal ranks)."""
        return self.const(np.full((1,) * rank, value, dtype=dtype))

    def shape(self, values: Sequence[int]) -> Val:
        """A !tosa.shape constant (reshape, slice, pad, tile and resize take their sizes so)."""
        key = tuple(int(v) for v in values)
        n = len(key)
        out = Val(self.fresh(), key, np.dtype(np.int64))
        dense = f"dense<{json.dumps(list(key))}>" if n else "dense<>"
        self.lines.append(
            f'{out.name} = "tosa.const_shape"() <{{values = {dense} : tensor<{n}xindex>}}> : () -> !tosa.shape<{n}>'
            f" loc({json.dumps(self.loc)})"
        )
        return out

    def zero_point(self, dtype) -> Val:
        return self.const(np.zeros(1, dtype=dtype))

    # ---- shape and type plumbing -------------------------------------------------------------------------

    def reshape(self, v: Val, shape: Sequence[int]) -> Val:
        shape = tuple(int(d) for d in shape)
        if shape == v.shape:
            return v
        s = self.shape(shape)
        return self.op(
            "tosa.reshape", [v, s], [(shape, v.dtype)], operand_types=[v.type, f"!tosa.shape<{len(shape)}>"]
        )[0]

    def transpose(self, v: Val, perm: Sequence[int]) -> Val:
        perm = [int(p) for p in perm]
        if perm == list(range(v.rank)):
            return v
        shape = [v.shape[p] for p in perm]
        return self.op1("tosa.transpose", [v], shape, v.dtype, f"perms = array<i32: {', '.join(map(str, perm))}>")

    def ranked(self, v: Val, rank: int) -> Val:
        """``v`` reshaped to ``rank`` dims with leading ones (numpy broadcasting's alignment)."""
        return self.reshape(v, (1,) * (rank - v.rank) + v.shape) if v.rank < rank else v

    def cast(self, v: Val, dtype) -> Val:
        dt = np.dtype(dtype)
        if v.dtype == dt:
            return v
        return self.op1("tosa.cast", [v], v.shape, dt)

    def slice(self, v: Val, start: Sequence[int], size: Sequence[int]) -> Val:
        if tuple(size) == v.shape:
            return v
        if not math.prod(size):  # nothing to take (TOSA refuses zero-size tensors)
            return self.op1("tensor.empty", [], size, v.dtype)
        a, b = self.shape(start), self.shape(size)
        st = f"!tosa.shape<{v.rank}>"
        return self.op("tosa.slice", [v, a, b], [(size, v.dtype)], operand_types=[v.type, st, st])[0]

    def concat(self, vals: Sequence[Val], axis: int) -> Val:
        if len(vals) == 1:
            return vals[0]
        shape = list(vals[0].shape)
        shape[axis] = sum(v.shape[axis] for v in vals)
        return self.op1("tosa.concat", vals, shape, vals[0].dtype, f"axis = {axis} : i32")

    def tile(self, v: Val, multiples: Sequence[int]) -> Val:
        if all(m == 1 for m in multiples):
            return v
        m = self.shape(multiples)
        shape = [d * k for d, k in zip(v.shape, multiples, strict=False)]
        return self.op("tosa.tile", [v, m], [(shape, v.dtype)], operand_types=[v.type, f"!tosa.shape<{v.rank}>"])[0]

    def broadcast_to(self, v: Val, shape: Sequence[int]) -> Val:
        v = self.ranked(v, len(shape))
        return self.tile(v, [s if d == 1 else 1 for d, s in zip(v.shape, shape, strict=False)])

    def pad(self, v: Val, begins: Sequence[int], ends: Sequence[int], value: float = 0.0) -> Val:
        if not any(begins) and not any(ends):
            return v
        flat = [x for pair in zip(begins, ends, strict=False) for x in pair]
        p = self.shape(flat)
        c = self.const(np.full((1,), value, dtype=v.dtype))
        shape = [d + b + e for d, b, e in zip(v.shape, begins, ends, strict=False)]
        return self.op(
            "tosa.pad", [v, p, c], [(shape, v.dtype)], operand_types=[v.type, f"!tosa.shape<{2 * v.rank}>", c.type]
        )[0]

    # ---- elementwise through tosa and linalg ------------------------------------------------------------

    def binary(self, name: str, a: Val, b: Val, dtype=None) -> Val:
        """A broadcasting TOSA binary op (ranks aligned first); tosa.mul gets its zero shift. 8- and 16-bit and
        unsigned integers, which TOSA's integer profile refuses, as the arith op in a linalg.generic."""
        if a.dtype.kind in "iu" and (a.dtype.itemsize < 4 or a.dtype.kind == "u") and name in _INT_BINARY:
            signed, unsigned, predicates = _INT_BINARY[name]
            arith = unsigned if a.dtype.kind == "u" else signed
            el = element(a.dtype)
            if predicates is None:
                return self.map([a, b], lambda bd, x: bd.op(arith, *x, type=el))
            pred = predicates[a.dtype.kind == "u"]
            return self.map(
                [a, b],
                lambda bd, x: bd.op(arith, *x, type=el, result="i1", props=f"predicate = {pred} : i64"),
                dtype=np.bool_,
            )
        rank = max(a.rank, b.rank)
        a, b = self.ranked(a, rank), self.ranked(b, rank)
        shape = np.broadcast_shapes(a.shape, b.shape)
        out = np.dtype(dtype) if dtype is not None else a.dtype
        if name == "tosa.mul":
            shift = self.const(np.zeros(1, np.int8))
            return self.op1(name, [a, b, shift], shape, out)
        return self.op1(name, [a, b], shape, out)

    def unary(self, name: str, v: Val, props: str = "") -> Val:
        return self.op1(name, [v], v.shape, v.dtype, props)

    def clamp(self, v: Val, lo: float, hi: float) -> Val:
        """tosa.clamp; infinite bounds become the type's largest value (an integer type's range)."""
        if v.is_float:
            big = float(np.finfo(v.dtype).max) if v.dtype != np.dtype(ml_dtypes.bfloat16) else 3.3895314e38
            lo, hi = max(lo, -big), min(hi, big)
        else:
            info = np.iinfo(v.dtype)
            lo, hi = max(lo, info.min), min(hi, info.max)
            if v.dtype.kind == "u" or v.dtype.itemsize < 4:  # not in TOSA's integer profile: max then min
                a, b = self.scalar(lo, v.dtype, v.rank), self.scalar(hi, v.dtype, v.rank)
                up = self.binary("tosa.maximum", v, a)
                return self.binary("tosa.minimum", up, b)
        el = element(v.dtype)
        return self.unary(
            "tosa.clamp",
            v,
            f"max_val = {scalar_literal(hi, v.dtype)} : {el}, min_val = {scalar_literal(lo, v.dtype)} : {el}",
        )

    def relu(self, v: Val, limit: float = -1.0) -> Val:
        return self.clamp(v, 0.0, limit if limit >= 0 else math.inf)

    def generic(
        self, inputs: Sequence[Val], shape: Sequence[int], dtype, body: Callable[[Body, list[str]], str]
    ) -> Val:
        """An elementwise ``linalg.generic`` over ``shape`` (inputs broadcast numpy's way) computing ``body`` on
        the scalars: what TOSA has no op for (exact division, erf-based GELU, ...)."""
        rank = len(shape)
        out_dt = np.dtype(dtype)
        dims = [f"d{i}" for i in range(rank)]
        maps = []
        for v in inputs:
            exprs = [
                "0" if d == 1 and s != 1 else dims[rank - v.rank + i]
                for i, (d, s) in enumerate(zip(v.shape, shape[rank - v.rank :], strict=False))
            ]
            maps.append(f"affine_map<({', '.join(dims)}) -> ({', '.join(exprs)})>")
        maps.append(f"affine_map<({', '.join(dims)}) -> ({', '.join(dims)})>")
        init = self.op1("tensor.empty", [], shape, out_dt)
        b = Body(self)
        args = [self.fresh() for _ in inputs]
        out_arg = self.fresh()
        result = body(b, args)
        inputs = [self.use(v) for v in inputs]
        block = ", ".join(f"{a}: {element(v.dtype)}" for a, v in zip(args, inputs, strict=False))
        block = f"{block}, {out_arg}: {element(out_dt)}" if block else f"{out_arg}: {element(out_dt)}"
        region = [f"^bb0({block}):", *b.lines, f'"linalg.yield"({result}) : ({element(out_dt)}) -> ()']
        iterators = ", ".join(["#linalg.iterator_type<parallel>"] * rank)
        props = (
            f"indexing_maps = [{', '.join(maps)}], iterator_types = [{iterators}], "
            f"operandSegmentSizes = array<i32: {len(inputs)}, 1>"
        )
        return self.op("linalg.generic", [*inputs, init], [(shape, out_dt)], props, region=region)[0]

    def loops(
        self,
        inputs: Sequence[tuple[Val, Sequence[str]]],
        init: Val,
        out: Sequence[str],
        reductions: int,
        body: Callable[[Body, list[str], str], str],
    ) -> Val:
        """A ``linalg.generic`` over loops d0.. (the parallel ones, then ``reductions`` reduction loops): each
        input read at its index expressions (``"d0"``, ``"0"``), the result ``init``'s shape indexed by ``out``;
        ``body(b, input scalars, accumulator)`` gives the new accumulator."""
        n = len(out) + reductions
        dims = ", ".join(f"d{i}" for i in range(n))
        maps = [f"affine_map<({dims}) -> ({', '.join(ix)})>" for _, ix in [*inputs, (init, out)]]
        b = Body(self)
        args = [self.fresh() for _ in inputs]
        acc = self.fresh()
        result = body(b, args, acc)
        vals = [self.use(v) for v, _ in inputs]
        init = self.use(init)
        block = ", ".join(f"{a}: {element(v.dtype)}" for a, v in zip([*args, acc], [*vals, init], strict=True))
        region = [f"^bb0({block}):", *b.lines, f'"linalg.yield"({result}) : ({element(init.dtype)}) -> ()']
        iterators = ", ".join(
            ["#linalg.iterator_type<parallel>"] * len(out) + ["#linalg.iterator_type<reduction>"] * reductions
        )
        props = (
            f"indexing_maps = [{', '.join(maps)}], iterator_types = [{iterators}], "
            f"operandSegmentSizes = array<i32: {len(vals)}, 1>"
        )
        return self.op("linalg.generic", [*vals, init], [(init.shape, init.dtype)], props, region=region)[0]

    def map(self, inputs: Sequence[Val], body: Callable[[Body, list[str]], str], dtype=None) -> Val:
        """``generic`` over the inputs' broadcast shape, the result typed as the first input unless given."""
        shape = np.broadcast_shapes(*[v.shape for v in inputs])
        return self.generic(inputs, shape, dtype if dtype is not None else inputs[0].dtype, body)

    # ---- the module --------------------------------------------------------------------------------------

    def function_text(self, name: str, args: Sequence[Val], results: Sequence[Val], reflection: dict[str, str]) -> str:
        """``func.func @name`` over the ops written (IREE keeps ``iree.reflection`` for the runtime to read)."""
        params = ", ".join(f"{a.name}: {a.type}" for a in args)
        ret_types = ", ".join(r.type for r in results)
        refl = ", ".join(f"{k} = {json.dumps(v)}" for k, v in reflection.items())
        lines = [f"  func.func @{name}({params}) -> ({ret_types}) attributes {{iree.reflection = {{{refl}}}}} {{"]
        lines += [f"    {line}" for text in self.lines for line in text.split("\n")]
        lines.append(f"    return {', '.join(r.name for r in results)} : {ret_types}")
        lines.append("  }")
        return "\n".join(lines) + "\n"

    def refuse(self, problem: str, op=None) -> TpuBuildError:
        loc = op.loc_name if op is not None else self.loc
        return TpuBuildError(problem, model=self.model, loc=loc, stage="export")


def _splat(flat: np.ndarray) -> bool:
    """Are all elements equal (and not NaN)? Two looks first: most weights differ at their first elements."""
    if not flat.size or (flat.size > 1 and (flat[0] != flat[1] or flat[0] != flat[-1])):
        return False
    if flat.dtype.kind == "f" and np.isnan(flat[0]):
        return False
    return bool((flat == flat[0]).all())


def _nested(a: np.ndarray):
    if a.ndim == 0:
        return a.item()
    return a.tolist()


def export_module(module, weights, model: str, *, resources: bool = True) -> str:
    """A TOP module (origin or canonical) and its weight store -> the upstream MLIR text; ``resources``: large
    weights as dense_resource blobs (else inline dense hex)."""
    import io

    buf = io.BytesIO()
    write_module(buf, module, weights, model, resources=resources)
    return buf.getvalue().decode()


@dataclass
class Exported:
    """One TOP module translated: its emitter (ops and weight blobs), arguments, results and names."""

    emitter: Emitter
    args: list[Val]
    results: list[Val]
    reflection: dict[str, str]

    def function_text(self, name: str = "main") -> str:
        return self.emitter.function_text(name, self.args, self.results, self.reflection)


def write_module(fh, module, weights, model: str, *, resources: bool = True) -> None:
    """export_module, written to the binary file ``fh``."""
    write_functions(fh, [("main", translate(module, weights, model, resources=resources))], model)


def write_functions(fh, functions: Sequence[tuple[str, Exported]], model: str) -> None:
    """A module of the translated functions to the binary file ``fh``, then their weight blobs as hex, streamed a
    piece at a time (a 500 MB model is 1 GB of text, never held whole)."""
    fh.write(f"// exported by tpubuild from TOP: model {model}\nmodule {{\n".encode())
    for name, exported in functions:
        fh.write(exported.function_text(name).encode())
    fh.write(b"}\n")
    blobs = [blob for _, exported in functions for blob in exported.emitter.resources]
    if not blobs:
        return
    fh.write(b"{-#\n  dialect_resources: {\n    builtin: {\n")
    for i, (key, array) in enumerate(blobs):
        # a blob is its alignment (little-endian u32) then its bytes
        fh.write(f'      {key}: "0x{struct.pack("<I", max(array.dtype.itemsize, 4)).hex()}'.encode())
        # numpy arrays export the buffer protocol; its stubs do not declare __buffer__
        data = memoryview(array.reshape(-1).view(np.uint8))  # pyright: ignore[reportArgumentType]
        for at in range(0, len(data), _CHUNK):
            fh.write(data[at : at + _CHUNK].hex().encode())
        fh.write(b'",\n' if i + 1 < len(blobs) else b'"\n')
    fh.write(b"    }\n  }\n#-}\n")


def translate(module, weights, model: str, *, resources: bool = True, key_prefix: str = "") -> Exported:
    """A TOP module's ops through their export rules; refuses (TpuBuildError naming op, location and model) an
    op without a rule or one its rule cannot express."""
    from tpubuild.ir import mlir
    from tpubuild.ir.base import TensorOp, is_none
    from tpubuild.ir.top import InputOp, NoneOp, WeightOp
    from tpubuild.ir.types import dtype_of, shape_of

    load_rules()
    e = Emitter(model, resources, key_prefix)
    values: dict[int, Val | None] = {}
    missing = [
        (op.name, op.loc_name)
        for op in mlir.body_ops(module)
        if isinstance(op, TensorOp) and not isinstance(op, (InputOp, NoneOp, WeightOp)) and get_rule(type(op)) is None
    ]
    if missing:
        listed = ", ".join(f"{name} at {loc!r}" for name, loc in missing[:10])
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        raise TpuBuildError(
            f"no TOSA export rule for {listed}{more}",
            model=model,
            loc=missing[0][1],
            stage="export",
            hint="add a rule in tpubuild/export/ (docs/export.md)",
        )
    args: list[Val] = []
    names: list[str] = []
    for op in mlir.body_ops(module):
        if not isinstance(op, TensorOp):
            continue
        e.loc = op.loc_name
        if isinstance(op, InputOp):
            t = op.results[0].type
            v = Val(f"%arg{len(args)}", shape_of(t), dtype_of(t))
            element(v.dtype)  # refuse an input type TOSA has no counterpart for
            args.append(v)
            names.append(op.loc_name)
            values[id(op.results[0])] = v
            continue
        if isinstance(op, NoneOp):
            values[id(op.results[0])] = None
            continue
        if isinstance(op, WeightOp):
            values[id(op.results[0])] = e.weight(weights[op.loc_name], op.loc_name)
            continue
        operands = [None if is_none(v) else values[id(v)] for v in op.operands]
        rule_of = get_rule(type(op))
        if rule_of is None:  # every op was checked for a rule before the first was emitted; this names it anyway
            raise TpuBuildError(f"{op.name} has no export rule", model=model, loc=op.loc_name, stage="export")
        try:
            _refuse_narrow(op, operands)
            out = _without_values(e, op, operands) or rule_of(e, op, op.params, operands)
        except NotImplementedError as err:
            raise TpuBuildError(
                f"{op.name} cannot be exported to TOSA: {err}", model=model, loc=op.loc_name, stage="export"
            ) from None
        except TpuBuildError as err:
            raise err.with_context(model=model, loc=op.loc_name, stage="export") from None
        outs = out if isinstance(out, tuple) else (out,)
        for result, val in zip(op.results, outs, strict=False):
            expect = (shape_of(result.type), dtype_of(result.type))
            if val is not None and (val.shape, val.dtype) != expect:
                raise TpuBuildError(
                    f"export rule of {op.name} made {val.shape} {val.dtype}, its type says {expect[0]} {expect[1]}",
                    model=model,
                    loc=op.loc_name,
                    stage="export",
                )
            values[id(result)] = val
    returned = [e.use(_defined(values[id(v)])) for v in mlir.return_op(module).operands]
    e.loc = "return"
    reflection = {
        "tpubuild.model": model,
        "tpubuild.inputs": json.dumps(names),
        "tpubuild.outputs": json.dumps(mlir.output_names(module)),
    }
    return Exported(e, args, [r for r in returned if r is not None], reflection)


def export_file(in_mlir: str, out_mlir: str, model: str | None = None, *, resources: bool = True) -> None:
    """A TOP .mlir (origin or canonical, its weights beside it) -> an upstream .mlir."""
    from tpubuild.build.files import all_or_nothing
    from tpubuild.ir.mlir import load_module, module_attr
    from tpubuild.top.inference import weights_for

    module = load_module(in_mlir)
    name = model or module_attr(module, "name") or "model"
    state = module_attr(module, "state")
    if state not in (None, "TOP_F32", "TOP_CALIBRATED"):
        raise TpuBuildError(
            f"only TOP modules export to TOSA; this one is {state}",
            file=in_mlir,
            hint="export origin.mlir or canonical.mlir",
        )
    weights = weights_for(module, in_mlir)
    with all_or_nothing(out_mlir) as (tmp,), open(tmp, "wb") as fh:
        write_module(fh, module, weights, name, resources=resources)


def _without_values(e: Emitter, op, operands: Sequence[Val | None]) -> tuple[Val, ...] | None:
    """The results of an op that reads no value, or None: TOSA refuses tensors with a zero-size dim, but they hold
    nothing to compute. Empty results are tensor.empty; results of only empty operands (a sum over an empty
    axis) depend on shapes alone, and are the op's kernel's on such operands, as constants."""
    from tpubuild.ir.types import dtype_of, shape_of
    from tpubuild.kernels import get_kernel

    results = [(shape_of(r.type), dtype_of(r.type)) for r in op.results]
    if all(math.prod(shape) == 0 for shape, _ in results):
        return tuple(e.op1("tensor.empty", [], shape, dtype) for shape, dtype in results)
    present = [v for v in operands if v is not None]
    if not present or any(math.prod(v.shape) for v in present):
        return None
    arrays = [None if v is None else np.zeros(v.shape, v.dtype) for v in operands]
    with np.errstate(all="ignore"):
        out = get_kernel(type(op))(op.params, *arrays)
    return tuple(
        e.const(np.asarray(a, dtype))
        for a, (_, dtype) in zip(out if isinstance(out, tuple) else (out,), results, strict=True)
    )


def _refuse_narrow(op, operands: Sequence[Val | None]) -> None:
    """A rule that computes on values must not be given NARROW ones: their bytes are not values it can read."""
    from tpubuild.ir.types import dtype_of

    if type(op) in _NARROW_RULES:
        return
    types = [v.dtype for v in operands if v is not None] + [dtype_of(r.type) for r in op.results]
    narrow = sorted({t.name for t in types if t in NARROW})
    if narrow:
        raise NotImplementedError(f"{', '.join(narrow)} operands or results (only Cast and data movement take them)")


def _defined(v: Val | None) -> Val:
    """A graph output's value: an op's result, never the None operand placeholder."""
    if v is None:
        raise TpuBuildError("a graph output is a None operand", stage="export")
    return v
