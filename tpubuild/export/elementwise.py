"""Export rules of elementwise ops: arithmetic, activations, comparisons, casts, reductions.

TOSA ops where TOSA has the op with the same meaning (add, sub, mul, clamp, sigmoid, tanh, exp, log, erf...);
an elementwise ``linalg.generic`` of arith/math ops otherwise (exact division, sqrt, GELU, the composite
activations), written from the same formula as the op's reference kernel.
"""

from __future__ import annotations

import functools
import itertools
import math

import ml_dtypes
import numpy as np

from tpubuild.export.tosa import CARRIED, NARROW, Body, Emitter, Val, element, rule, scalar_literal
from tpubuild.ir import top
from tpubuild.ir.types import dtype_from_name


def _fused(e: Emitter, v: Val, p) -> Val:
    return e.relu(v, p.relu_limit) if getattr(p, "do_relu", False) else v


def _float(v: Val, op) -> str:
    if not v.is_float:
        raise NotImplementedError(f"{op.name} on {v.dtype} tensors")
    return element(v.dtype)


@rule(top.AddOp)
def _(e: Emitter, op, p, args):
    return _fused(e, e.binary("tosa.add", *args), p)


@rule(top.SubOp)
def _(e: Emitter, op, p, args):
    return e.binary("tosa.sub", *args)


@rule(top.MulOp)
def _(e: Emitter, op, p, args):
    return _fused(e, e.binary("tosa.mul", *args), p)


@rule(top.DivOp)
def _(e: Emitter, op, p, args):
    a, b = args
    el = element(a.dtype)
    if a.is_float:
        return e.map(args, lambda bd, x: bd.f("arith.divf", *x, el=el))
    div = "arith.divui" if a.dtype.kind == "u" else "arith.divsi"  # ONNX integer Div truncates
    return e.map(args, lambda bd, x: bd.op(div, *x, type=el))


@rule(top.MaxOp, top.MinOp)
def _(e: Emitter, op, p, args):
    name = "tosa.maximum" if isinstance(op, top.MaxOp) else "tosa.minimum"
    return functools.reduce(lambda a, b: e.binary(name, a, b), args)


@rule(top.Pow3Op)
def _(e: Emitter, op, p, args):
    a, b = args
    if a.dtype == np.bool_ or b.dtype == np.bool_:
        raise NotImplementedError(f"Pow of {a.dtype} by {b.dtype}")
    if not a.is_float and not b.is_float:  # integer power (the exponent in the base's type), as numpy's
        return e.map([a, _cast(e, b, a.dtype)], lambda bd, x: _ipow(bd, x[0], x[1], element(a.dtype), a.dtype))
    # in float (the base's float type, or float32 for an integer base) and cast back, as the kernel's float64
    # power cast to the base's type (an integer result truncated)
    f = a.dtype if a.is_float else np.dtype(np.float32)
    el = element(f)
    y = e.map([_cast(e, a, f), _cast(e, b, f)], lambda bd, x: _powf(bd, x[0], x[1], el))
    return _cast(e, y, a.dtype)


def _powf(bd: Body, a: str, b: str, el: str) -> str:
    """a ** b as numpy's: powf of |a|, negative for a negative base and an odd integer exponent, NaN for a negative
    base and a fractional one (IREE's powf is NaN for every negative base)."""
    m = bd.f("math.powf", bd.f("math.absf", a, el=el), b, el=el)
    integral = bd.cmpf("oeq", b, bd.f("math.trunc", b, el=el), el)
    odd = bd.cmpf("one", bd.f("arith.remf", b, _c(bd, 2.0, el), el=el), _c(bd, 0.0, el), el)
    signed = bd.select(odd, bd.f("arith.negf", m, el=el), m, el)
    negative = bd.select(integral, signed, _c(bd, math.nan, el), el)
    return bd.select(bd.cmpf("olt", a, _c(bd, 0.0, el), el), negative, m, el)


def _ipow(bd: Body, base: str, exponent: str, el: str, dtype) -> str:
    """base ** exponent by squaring over the exponent's bits (IREE has no lowering of math.ipowi); wraps on
    overflow as numpy's integer power."""
    result = bd.const(1, dtype)
    one = bd.const(1, dtype)
    for bit in range(np.dtype(dtype).itemsize * 8 - 1):
        shifted = bd.op("arith.shrui", exponent, bd.const(bit, dtype), type=el)
        odd = bd.op(
            "arith.cmpi",
            bd.op("arith.andi", shifted, one, type=el),
            one,
            type=el,
            result="i1",
            props="predicate = 0 : i64",
        )
        result = bd.select(odd, bd.op("arith.muli", result, base, type=el), result, el)
        base = bd.op("arith.muli", base, base, type=el)
    return result


@rule(top.ModOp)
def _(e: Emitter, op, p: top.ModParams, args):
    a, b = args
    el = element(a.dtype)

    def body(bd: Body, x):
        if a.is_float:
            r = bd.f("arith.remf", *x, el=el)  # C fmod: the dividend's sign
            if p.fmod:
                return r
            # Python's %: add the divisor when the remainder is non-zero and the signs differ
            zero = bd.const(0.0, a.dtype)
            fix = bd.op(
                "arith.andi",
                bd.cmpf("une", r, zero, el),
                bd.op("arith.xori", bd.cmpf("olt", r, zero, el), bd.cmpf("olt", x[1], zero, el), type="i1"),
                type="i1",
            )
            return bd.select(fix, bd.f("arith.addf", r, x[1], el=el), r, el)
        return bd.op("arith.remsi", *x, type=el)  # integer fmod: the dividend's sign

    if a.dtype.kind == "u":  # no signs: both modes are the remainder
        return e.map(args, lambda bd, x: bd.op("arith.remui", *x, type=el))
    if not a.is_float and not p.fmod:
        # floor modulo of integers: remsi, then the divisor added where the signs differ
        def ibody(bd: Body, x):
            r = bd.op("arith.remsi", *x, type=el)
            zero = bd.const(0, a.dtype)
            ne = bd.op("arith.cmpi", r, zero, type=el, result="i1", props="predicate = 1 : i64")
            rneg = bd.op("arith.cmpi", r, zero, type=el, result="i1", props="predicate = 2 : i64")
            bneg = bd.op("arith.cmpi", x[1], zero, type=el, result="i1", props="predicate = 2 : i64")
            fix = bd.op("arith.andi", ne, bd.op("arith.xori", rneg, bneg, type="i1"), type="i1")
            return bd.select(fix, bd.op("arith.addi", r, x[1], type=el), r, el)

        return e.map(args, ibody)
    return e.map(args, body)


@rule(top.ReluOp)
def _(e: Emitter, op, p, args):
    return e.relu(args[0], p.relu_limit)


@rule(top.ClipOp)
def _(e: Emitter, op, p, args):
    (x,) = args
    if p.min > p.max:  # numpy's clip: the max bound applied last, everything is max (tosa.clamp refuses)
        lo, hi = e.scalar(p.min, x.dtype, x.rank), e.scalar(p.max, x.dtype, x.rank)
        return e.binary("tosa.minimum", e.binary("tosa.maximum", x, lo), hi)
    return e.clamp(x, p.min, p.max)


_TOSA_UNARY = {
    top.SigmoidOp: "tosa.sigmoid",
    top.TanhOp: "tosa.tanh",
    top.ExpOp: "tosa.exp",
    top.LogOp: "tosa.log",
    top.AbsOp: "tosa.abs",
    top.FloorOp: "tosa.floor",
    top.CeilOp: "tosa.ceil",
    top.ErfOp: "tosa.erf",
    top.SinOp: "tosa.sin",
    top.CosOp: "tosa.cos",
}


@rule(*_TOSA_UNARY)
def _(e: Emitter, op, p, args):
    if type(op) not in (top.AbsOp,):
        _float(args[0], op)
    return e.unary(_TOSA_UNARY[type(op)], args[0])


def _math(name: str):
    """A rule applying one math-dialect op elementwise (TOSA has no sqrt, roundeven or sign)."""

    def fn(e: Emitter, op, p, args):
        el = _float(args[0], op)
        return e.map(args, lambda bd, x: bd.f(name, x[0], el=el))

    return fn


rule(top.SqrtOp)(_math("math.sqrt"))
rule(top.RoundOp)(_math("math.roundeven"))
for _cls, _name in {
    top.TanOp: "math.tan",
    top.AsinOp: "math.asin",
    top.AcosOp: "math.acos",
    top.AtanOp: "math.atan",
    top.SinhOp: "math.sinh",
    top.CoshOp: "math.cosh",
    top.AsinhOp: "math.asinh",
    top.AcoshOp: "math.acosh",
    top.AtanhOp: "math.atanh",
}.items():
    rule(_cls)(_math(_name))


def _activation(formula, wide: bool = False):
    """A rule computing ``formula(body, x, el, p)`` on each element of a float tensor; ``wide``: 16-bit floats
    computed in float32 and rounded once (the kernels that compute in float64 so)."""

    def fn(e: Emitter, op, p, args):
        el = _float(args[0], op)
        if wide and el != "f32":
            return e.map(args, lambda bd, x: _rounded(bd, formula(bd, [_widened(bd, v, el) for v in x], "f32", p), el))
        return e.map(args, lambda bd, x: formula(bd, x, el, p))

    return fn


def _widened(bd: Body, x: str, el: str) -> str:
    return bd.typed("arith.extf", [(x, el)], "f32")


def _rounded(bd: Body, x: str, el: str) -> str:
    return bd.typed("arith.truncf", [(x, "f32")], el)


_FLOAT_OF = {"f16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16), "f32": np.dtype(np.float32)}


def _c(bd: Body, value: float, el: str) -> str:
    return bd.const(value, _FLOAT_OF[el])


def _sigmoid(bd: Body, x: str, el: str) -> str:
    """1 / (1 + exp(-x))."""
    one = _c(bd, 1.0, el)
    return bd.f(
        "arith.divf", one, bd.f("arith.addf", one, bd.f("math.exp", bd.f("arith.negf", x, el=el), el=el), el=el), el=el
    )


def _softplus(bd: Body, x: str, el: str) -> str:
    """log(1 + exp(x)) as max(x, 0) + log1p(exp(-|x|)): no overflow, as numpy's logaddexp."""
    zero = _c(bd, 0.0, el)
    tail = bd.f("math.log1p", bd.f("math.exp", bd.f("arith.negf", bd.f("math.absf", x, el=el), el=el), el=el), el=el)
    return bd.f("arith.addf", bd.f("arith.maximumf", x, zero, el=el), tail, el=el)


def _sign(bd, x, el, p):
    zero, one = _c(bd, 0.0, el), _c(bd, 1.0, el)
    s = bd.f("math.copysign", one, x, el=el)
    return bd.select(bd.cmpf("oeq", x, zero, el), zero, s, el)


def _hardsigmoid_of(bd, x, el, alpha, beta):
    y = bd.f("arith.addf", bd.f("arith.mulf", x, _c(bd, alpha, el), el=el), _c(bd, beta, el), el=el)
    return bd.f("arith.minimumf", bd.f("arith.maximumf", y, _c(bd, 0.0, el), el=el), _c(bd, 1.0, el), el=el)


def _gelu(bd, x, el, p):
    half, one = _c(bd, 0.5, el), _c(bd, 1.0, el)
    if p.approx_mode == "tanh":
        cube = bd.f("arith.mulf", bd.f("arith.mulf", x, x, el=el), x, el=el)
        inner = bd.f("arith.addf", x, bd.f("arith.mulf", _c(bd, 0.044715, el), cube, el=el), el=el)
        t = bd.f("math.tanh", bd.f("arith.mulf", _c(bd, math.sqrt(2.0 / math.pi), el), inner, el=el), el=el)
    else:
        t = bd.f("math.erf", bd.f("arith.mulf", x, _c(bd, 1.0 / math.sqrt(2.0), el), el=el), el=el)
    return bd.f("arith.mulf", bd.f("arith.mulf", half, x, el=el), bd.f("arith.addf", one, t, el=el), el=el)


def _elu(bd, x, el, alpha):
    zero = _c(bd, 0.0, el)
    neg = bd.f(
        "arith.mulf", _c(bd, alpha, el), bd.f("math.expm1", bd.f("arith.minimumf", x, zero, el=el), el=el), el=el
    )
    return bd.select(bd.cmpf("ogt", x, zero, el), x, neg, el)


_FORMULAS = {
    top.SiLUOp: lambda bd, x, el, p: bd.f("arith.mulf", x[0], _sigmoid(bd, x[0], el), el=el),
    top.SwishOp: lambda bd, x, el, p: bd.f(
        "arith.mulf", x[0], _sigmoid(bd, bd.f("arith.mulf", x[0], _c(bd, p.beta, el), el=el), el), el=el
    ),
    top.HardSigmoidOp: lambda bd, x, el, p: _hardsigmoid_of(bd, x[0], el, p.alpha, p.beta),
    top.HardSwishOp: lambda bd, x, el, p: bd.f("arith.mulf", x[0], _hardsigmoid_of(bd, x[0], el, 1 / 6, 0.5), el=el),
    top.SoftplusOp: lambda bd, x, el, p: _softplus(bd, x[0], el),
    top.MishOp: lambda bd, x, el, p: bd.f("arith.mulf", x[0], bd.f("math.tanh", _softplus(bd, x[0], el), el=el), el=el),
    top.GELUOp: lambda bd, x, el, p: _gelu(bd, x[0], el, p),
    top.LeakyReluOp: lambda bd, x, el, p: bd.select(
        bd.cmpf("oge", x[0], _c(bd, 0.0, el), el), x[0], bd.f("arith.mulf", x[0], _c(bd, p.alpha, el), el=el), el
    ),
    top.EluOp: lambda bd, x, el, p: _elu(bd, x[0], el, p.alpha),
    top.CeluOp: lambda bd, x, el, p: bd.f(
        "arith.addf",
        bd.f("arith.maximumf", x[0], _c(bd, 0.0, el), el=el),
        bd.f(
            "arith.minimumf",
            _c(bd, 0.0, el),
            bd.f(
                "arith.mulf",
                _c(bd, p.alpha, el),
                bd.f("math.expm1", bd.f("arith.divf", x[0], _c(bd, p.alpha, el), el=el), el=el),
                el=el,
            ),
            el=el,
        ),
        el=el,
    ),
    top.ThresholdedReluOp: lambda bd, x, el, p: bd.select(
        bd.cmpf("ogt", x[0], _c(bd, p.alpha, el), el), x[0], _c(bd, 0.0, el), el
    ),
    top.ShrinkOp: lambda bd, x, el, p: bd.select(
        bd.cmpf("olt", x[0], _c(bd, -p.lambd, el), el),
        bd.f("arith.addf", x[0], _c(bd, p.bias, el), el=el),
        bd.select(
            bd.cmpf("ogt", x[0], _c(bd, p.lambd, el), el),
            bd.f("arith.subf", x[0], _c(bd, p.bias, el), el=el),
            _c(bd, 0.0, el),
            el,
        ),
        el,
    ),
    top.SoftsignOp: lambda bd, x, el, p: bd.f(
        "arith.divf", x[0], bd.f("arith.addf", _c(bd, 1.0, el), bd.f("math.absf", x[0], el=el), el=el), el=el
    ),
    top.ReciprocalOp: lambda bd, x, el, p: bd.f("arith.divf", _c(bd, p.const_val, el), x[0], el=el),
    top.SignOp: lambda bd, x, el, p: _sign(bd, x[0], el, p),
    top.PowOp: lambda bd, x, el, p: _pow(bd, x[0], el, p.exponent),
    top.PReluOp: lambda bd, x, el, p: bd.select(
        bd.cmpf("oge", x[0], _c(bd, 0.0, el), el), x[0], bd.f("arith.mulf", x[0], x[1], el=el), el
    ),
}

# ONNX RNN activations by (lower-case) name: fn(body, x, el, alpha, beta), as the kernel's (kernels/rnn.py)
RNN_ACTIVATIONS = {
    "sigmoid": lambda bd, x, el, a, b: _sigmoid(bd, x, el),
    "tanh": lambda bd, x, el, a, b: bd.f("math.tanh", x, el=el),
    "relu": lambda bd, x, el, a, b: bd.f("arith.maximumf", x, _c(bd, 0.0, el), el=el),
    "affine": lambda bd, x, el, a, b: bd.f(
        "arith.addf", bd.f("arith.mulf", _c(bd, a, el), x, el=el), _c(bd, b, el), el=el
    ),
    "leakyrelu": lambda bd, x, el, a, b: bd.select(
        bd.cmpf("oge", x, _c(bd, 0.0, el), el), x, bd.f("arith.mulf", x, _c(bd, a, el), el=el), el
    ),
    "thresholdedrelu": lambda bd, x, el, a, b: bd.select(bd.cmpf("ogt", x, _c(bd, a, el), el), x, _c(bd, 0.0, el), el),
    "scaledtanh": lambda bd, x, el, a, b: bd.f(
        "arith.mulf", _c(bd, a, el), bd.f("math.tanh", bd.f("arith.mulf", _c(bd, b, el), x, el=el), el=el), el=el
    ),
    "hardsigmoid": lambda bd, x, el, a, b: _hardsigmoid_of(bd, x, el, a, b),
    "elu": lambda bd, x, el, a, b: _elu(bd, x, el, a),
    "softsign": lambda bd, x, el, a, b: bd.f(
        "arith.divf", x, bd.f("arith.addf", _c(bd, 1.0, el), bd.f("math.absf", x, el=el), el=el), el=el
    ),
    "softplus": lambda bd, x, el, a, b: _softplus(bd, x, el),
}

# kernels computing in float64 (rounded once to a 16-bit float)
_WIDE = (top.SwishOp, top.CeluOp)

for _cls, _formula in _FORMULAS.items():
    rule(_cls)(_activation(lambda bd, x, el, p, _f=_formula: _f(bd, x, el, p), wide=_cls in _WIDE))


def _pow(bd: Body, x: str, el: str, exponent: float) -> str:
    """x ** exponent: a product for small integer exponents (exact, as numpy's), sqrt for 1/2, powf otherwise."""
    if exponent == 2.0:
        return bd.f("arith.mulf", x, x, el=el)
    if exponent == 1.0:
        return x
    if exponent == 0.5:
        return bd.f("math.sqrt", x, el=el)
    return bd.f("math.powf", x, _c(bd, exponent, el), el=el)


@rule(top.IsNaNOp)
def _(e: Emitter, op, p, args):
    el = _float(args[0], op)
    return e.map(args, lambda bd, x: bd.cmpf("uno", x[0], x[0], el), dtype=np.bool_)


@rule(top.IsInfOp)
def _(e: Emitter, op, p: top.IsInfParams, args):
    el = _float(args[0], op)

    def body(bd: Body, x):
        inf = bd.const(np.inf, args[0].dtype)
        pos = bd.cmpf("oeq", x[0], inf, el)
        neg = bd.cmpf("oeq", x[0], bd.f("arith.negf", inf, el=el), el)
        false = bd.typed("arith.constant", [], "i1", "value = false")
        return bd.op("arith.ori", pos if p.detect_positive else false, neg if p.detect_negative else false, type="i1")

    return e.map(args, body, dtype=np.bool_)


_COMPARE = {
    "Equal": "tosa.equal",
    "Greater": "tosa.greater",
    "GreaterOrEqual": "tosa.greater_equal",
    "And": "tosa.logical_and",
    "Or": "tosa.logical_or",
    "Xor": "tosa.logical_xor",
}


@rule(top.CompareOp)
def _(e: Emitter, op, p: top.CompareParams, args):
    if p.mode == "Not":
        return e.unary("tosa.logical_not", args[0])
    a, b = args
    if p.mode in ("And", "Or", "Xor"):
        return e.binary(_COMPARE[p.mode], e.cast(a, np.bool_), e.cast(b, np.bool_), np.bool_)
    if p.mode in _COMPARE:
        return e.binary(_COMPARE[p.mode], a, b, np.bool_)
    if p.mode == "Less":
        return e.binary("tosa.greater", b, a, np.bool_)
    if p.mode == "LessOrEqual":
        return e.binary("tosa.greater_equal", b, a, np.bool_)
    return e.unary("tosa.logical_not", e.binary("tosa.equal", a, b, np.bool_))  # NotEqual


@rule(top.WhereOp)
def _(e: Emitter, op, p, args):
    cond, a, b = args
    rank = max(v.rank for v in args)
    cond, a, b = (e.ranked(v, rank) for v in (e.cast(cond, np.bool_), a, b))
    shape = np.broadcast_shapes(cond.shape, a.shape, b.shape)
    return e.op1("tosa.select", [cond, a, b], shape, a.dtype)


@rule(top.CastOp, narrow=True)
def _(e: Emitter, op, p: top.CastParams, args):
    (x,) = args
    to = dtype_from_name(p.to)
    element(to)
    if x.dtype == to:
        return x
    if x.dtype in NARROW:
        x = _decode(e, x)
    if to in NARROW:
        return _encode(e, x, to, p)
    return _cast(e, x, to)


def _cast(e: Emitter, x: Val, to: np.dtype) -> Val:
    """A cast between the types TOSA and arith have."""
    if "u" in (x.dtype.kind, to.kind) and to != np.bool_ and x.dtype != np.bool_:
        return _arith_cast(e, x, to)
    if np.dtype(np.int64) in (x.dtype, to) and (x.is_float or to.kind == "f"):  # TOSA casts no i64 to float
        return _arith_cast(e, x, to)
    if x.is_float and to.kind in "iu":
        # float -> int truncates toward zero, as C casts (tosa.cast rounds to nearest)
        el = element(x.dtype)
        x = e.map([x], lambda bd, v: bd.f("math.trunc", v[0], el=el))
    if to == np.bool_ and x.dtype != np.bool_:
        return e.unary("tosa.logical_not", e.binary("tosa.equal", x, e.scalar(0, x.dtype, x.rank), np.bool_))
    return e.cast(x, to)


def _arith_cast(e: Emitter, x: Val, to: np.dtype) -> Val:
    """A cast TOSA has not (from or to an unsigned type, between int64 and floats): the arith op, reading (or
    writing) the bits unsigned where the type is; float to integer truncates toward zero."""
    src, dst = element(x.dtype), element(to)
    if x.is_float:
        op = "arith.fptoui" if to.kind == "u" else "arith.fptosi"
        return e.map([x], lambda bd, v: bd.typed(op, [(v[0], src)], dst), dtype=to)
    if to.kind == "f" or to == np.dtype(ml_dtypes.bfloat16):
        op = "arith.uitofp" if x.dtype.kind == "u" else "arith.sitofp"
        return e.map([x], lambda bd, v: bd.typed(op, [(v[0], src)], dst), dtype=to)
    if x.dtype.itemsize == to.itemsize:
        return Val(x.name, x.shape, to, x.array)  # the same bits, signless
    if x.dtype.itemsize > to.itemsize:
        return e.map([x], lambda bd, v: bd.typed("arith.trunci", [(v[0], src)], dst), dtype=to)
    op = "arith.extui" if x.dtype.kind == "u" else "arith.extsi"
    return e.map([x], lambda bd, v: bd.typed(op, [(v[0], src)], dst), dtype=to)


# ---- 8-bit floats and 2/4-bit types (ONNX Cast) ---------------------------------------------------------
# Computed on float32 and integer bits, as ml_dtypes (TOP's kernel) and onnx's to_float8e8m0 define them: a
# float is rounded to nearest even on the type's grid in float32 (exact), clamped where ONNX saturates, and only
# then truncf'd to the 8-bit type (IREE's truncf rounds values below the smallest normal wrongly); codes are
# read back through a table of the type's values. float8_e8m0fnu, float4_e2m1fn and the 2/4-bit integers are
# bit arithmetic on bytes.

_F4 = np.dtype(ml_dtypes.float4_e2m1fn)
_E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
# float4_e2m1fn's magnitudes by code, and the rounding thresholds between neighbours: a tie goes to the even code,
# so the step up from an even code needs more than the midpoint, from an odd one the midpoint itself
_F4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_F4_STEPS = tuple(
    ((a + b) / 2, "ogt" if k % 2 == 0 else "oge") for k, (a, b) in enumerate(itertools.pairwise(_F4_VALUES))
)


def _bits(dtype: np.dtype) -> int:
    """The width of a 2/4-bit integer type."""
    return 2 if "2" in dtype.name else 4


def _i(bd: Body, name: str, *args: str, el: str = "i32") -> str:
    return bd.op(name, *args, type=el)


def _icmp(bd: Body, predicate: int, a: str, b: str, el: str = "i32") -> str:
    return bd.op("arith.cmpi", a, b, type=el, result="i1", props=f"predicate = {predicate} : i64")


def _decode(e: Emitter, x: Val) -> Val:
    """A NARROW tensor as one TOSA computes on: 2/4-bit integers as int8/uint8, floats as float32."""
    el = element(x.dtype)
    if x.dtype in CARRIED and x.dtype != _F4:
        n, signed = _bits(x.dtype), ml_dtypes.iinfo(x.dtype).min < 0

        def integer(bd: Body, v):
            if signed:  # sign-extended from n bits: shifted to the top and back
                up = bd.const(8 - n, np.int8)
                return _i(bd, "arith.shrsi", _i(bd, "arith.shli", v[0], up, el="i8"), up, el="i8")
            return _i(bd, "arith.andi", v[0], bd.const((1 << n) - 1, np.int8), el="i8")

        return e.map([x], integer, dtype=np.int8 if signed else np.uint8)

    # floats: a table of the type's 256 (or 16) values, read at the code (IREE's extf reads float8_e4m3fn's
    # negative NaN as -480)
    codes = 16 if x.dtype == _F4 else 256
    table = e.use(e.const(np.arange(codes, dtype=np.uint8).view(x.dtype).astype(np.float32)))

    def body(bd: Body, v):
        byte = v[0] if el == "i8" else bd.typed("arith.bitcast", [(v[0], el)], "i8")
        if codes == 16:  # the low 4 bits only: never read past the table
            byte = _i(bd, "arith.andi", byte, bd.const(15, np.int8), el="i8")
        at = bd.typed("arith.index_cast", [(bd.typed("arith.extui", [(byte, "i8")], "i32"), "i32")], "index")
        return bd.typed("tensor.extract", [(table.name, table.type), (at, "index")], "f32")

    return e.map([x], body, dtype=np.float32)


def _encode(e: Emitter, x: Val, to: np.dtype, p: top.CastParams) -> Val:
    """A tensor of a TOSA type cast to a NARROW type (ONNX Cast: round to nearest even, saturating as asked)."""
    if x.dtype == np.bool_:
        raise NotImplementedError(f"cast of bool to {to.name}")
    dst = element(to)
    if to in CARRIED and to != _F4:
        # the low n bits of the integer (float truncated toward zero), as ml_dtypes wraps
        if x.is_float:
            x = _cast(e, x, np.dtype(np.int32))
        src = element(x.dtype)
        mask = (1 << _bits(to)) - 1

        def wrap(bd: Body, v):
            byte = v[0] if src == "i8" else bd.typed("arith.trunci", [(v[0], src)], "i8")
            return _i(bd, "arith.andi", byte, bd.const(mask, np.int8), el="i8")

        return e.map([x], wrap, dtype=to)
    if not x.is_float and to == _E8M0:
        raise NotImplementedError(f"cast of {x.dtype} to {to.name}")  # float32 would round the large ones first
    x = _cast(e, x, np.dtype(np.float32))

    def body(bd: Body, v):
        if to == _F4:
            return _to_f4(bd, v[0])
        if to == _E8M0:
            return _to_e8m0(bd, v[0], p)
        f = _to_grid(bd, v[0], ml_dtypes.finfo(to))
        if p.saturate and x.is_float:
            big = bd.const(float(ml_dtypes.finfo(to).max), np.float32)
            f = bd.f("arith.minimumf", bd.f("arith.maximumf", f, bd.f("arith.negf", big)), big)
        return bd.typed("arith.truncf", [(f, "f32")], dst)

    return e.map([x], body, dtype=to)


def _to_grid(bd: Body, f: str, info) -> str:
    """``f`` rounded (to nearest even) to the float32 value of an 8-bit float type, or past its largest one: the
    quantum 2 ** (max(exponent, the smallest normal one) - mantissa bits) from the float32's exponent field, the
    quotient rounded (all exact). IREE's truncf rounds values just below the smallest normal to zero; given a
    value of the type it has nothing to round."""
    bits = bd.typed("arith.bitcast", [(f, "f32")], "i32")
    c = lambda v: bd.const(v, np.int32)  # noqa: E731
    exp = _i(bd, "arith.andi", _i(bd, "arith.shrui", bits, c(23)), c(0xFF))
    exp = _i(bd, "arith.maxsi", exp, c(info.minexp + 127))
    quantum = bd.typed(
        "arith.bitcast", [(_i(bd, "arith.shli", _i(bd, "arith.subi", exp, c(info.nmant)), c(23)), "i32")], "f32"
    )
    steps = bd.f("math.roundeven", bd.f("arith.divf", bd.f("math.absf", f), quantum))
    return bd.f("math.copysign", bd.f("arith.mulf", steps, quantum), f)


def _to_f4(bd: Body, f: str) -> str:
    """float4_e2m1fn's code (saturating; NaN as ml_dtypes writes it: the sign bit flipped, magnitude 0)."""
    a = bd.f("math.absf", f)
    code = bd.const(0, np.int8)
    for threshold, predicate in _F4_STEPS:
        up = bd.typed("arith.extui", [(bd.cmpf(predicate, a, bd.const(threshold, np.float32)), "i1")], "i8")
        code = _i(bd, "arith.addi", code, up, el="i8")
    negative = _icmp(bd, 2, bd.typed("arith.bitcast", [(f, "f32")], "i32"), bd.const(0, np.int32))
    negative = _i(bd, "arith.xori", negative, bd.cmpf("uno", f, f), el="i1")
    return bd.select(negative, _i(bd, "arith.ori", code, bd.const(8, np.int8), el="i8"), code, "i8")


def _to_e8m0(bd: Body, f: str, p: top.CastParams) -> str:
    """onnx's to_float8e8m0 on float32 bits: the exponent field, rounded up, down or to nearest by the fraction;
    inf and NaN are 255; saturating, the largest exponent does not round up into 255."""
    bits = bd.typed("arith.bitcast", [(f, "f32")], "i32")
    c = lambda v: bd.const(v, np.int32)  # noqa: E731
    exp = _i(bd, "arith.andi", _i(bd, "arith.shrui", bits, c(23)), c(0xFF))
    nonzero = lambda mask: _icmp(bd, 1, _i(bd, "arith.andi", bits, c(mask)), c(0))  # noqa: E731
    if p.round_mode == "nearest":
        guard, rest = nonzero(0x400000), _i(bd, "arith.ori", nonzero(0x200000), nonzero(0x1FFFFF), el="i1")
        odd = _icmp(bd, 8, exp, c(0))  # onnx's "lsb": any exponent above 0
        up = _i(bd, "arith.andi", guard, _i(bd, "arith.ori", rest, odd, el="i1"), el="i1")
    elif p.round_mode == "up":
        up = nonzero(0x7FFFFF)
    elif p.round_mode == "down":
        up = bd.typed("arith.constant", [], "i1", "value = false")
    else:
        raise NotImplementedError(f"float8_e8m0fnu round mode {p.round_mode}")
    if p.saturate:
        up = _i(bd, "arith.andi", up, _icmp(bd, 1, exp, c(0xFE)), el="i1")
    rounded = _i(bd, "arith.addi", exp, bd.typed("arith.extui", [(up, "i1")], "i32"))
    out = bd.select(_icmp(bd, 0, exp, c(0xFF)), c(0xFF), rounded, "i32")
    return bd.typed("arith.bitcast", [(bd.typed("arith.trunci", [(out, "i32")], "i8"), "i8")], "f8E8M0FNU")


# ---- reductions -----------------------------------------------------------------------------------------


# IREE lowers tosa.reduce_max/min of floats from -/+FLT_MAX, not -/+inf: a row of -inf had the maximum -3.4e38
_EXTREME = {"tosa.reduce_max": ("arith.maximumf", -math.inf), "tosa.reduce_min": ("arith.minimumf", math.inf)}


def _reduce_axes(e: Emitter, name: str, v: Val, axes) -> Val:
    keep = [1 if d in axes else n for d, n in enumerate(v.shape)]
    if name in _EXTREME and v.is_float:  # a fold from the infinity (maximumf/minimumf propagate NaN, as numpy)
        fold, start = _EXTREME[name]
        el = element(v.dtype)
        at = [f"d{v.rank + list(axes).index(d)}" if d in axes else f"d{d}" for d in range(v.rank)]
        init = e.const(np.full(keep, start, v.dtype))
        loops = [f"d{d}" for d in range(v.rank)]  # a reduced axis: a parallel loop of one
        return e.loops([(v, at)], init, loops, len(axes), lambda bd, x, acc: bd.f(fold, acc, x[0], el=el))
    # adjacent axes merged into one first: one reduction a run of them, where IREE would dispatch one an axis
    merged: list[int] = []
    runs: list[int] = []
    for d, n in enumerate(v.shape):
        if d in axes and d - 1 in axes:
            merged[-1] *= n
            continue
        if d in axes:
            runs.append(len(merged))
        merged.append(n)
    v = e.reshape(v, merged)
    for axis in runs:
        shape = list(v.shape)
        shape[axis] = 1
        v = e.op1(name, [v], shape, v.dtype, f"axis = {axis} : i32")
    return e.reshape(v, keep)


def reduce_max(e: Emitter, v: Val, axes) -> Val:
    return _reduce_axes(e, "tosa.reduce_max", v, axes)


def reduce_sum(e: Emitter, v: Val, axes) -> Val:
    """A sum over ``axes``; float16's in float32, rounded once, as numpy sums float16; bfloat16's in order, as
    ml_dtypes sums it."""
    if v.dtype == np.float16:
        return e.cast(_reduce_axes(e, "tosa.reduce_sum", e.cast(v, np.float32), axes), v.dtype)
    if v.dtype == np.dtype(ml_dtypes.bfloat16):
        return _sequential_bf16_sum(e, v, axes)
    return _reduce_axes(e, "tosa.reduce_sum", v, axes)


def _sequential_bf16_sum(e: Emitter, v: Val, axes) -> Val:
    """ml_dtypes' bfloat16 sum: one element at a time, each partial sum rounded to bfloat16. A fold whose
    accumulator is the sum's bits (i16), so IREE cannot keep it in float32 between steps."""
    keep = [1 if d in axes else n for d, n in enumerate(v.shape)]
    at = [f"d{v.rank + list(axes).index(d)}" if d in axes else f"d{d}" for d in range(v.rank)]

    def body(bd: Body, x, acc):
        total = bd.f(
            "arith.addf",
            _widened(bd, bd.typed("arith.bitcast", [(acc, "i16")], "bf16"), "bf16"),
            _widened(bd, x[0], "bf16"),
        )
        return bd.typed("arith.bitcast", [(_rounded(bd, total, "bf16"), "bf16")], "i16")

    bits = e.loops([(v, at)], e.const(np.zeros(keep, np.int16)), [f"d{d}" for d in range(v.rank)], len(axes), body)
    return e.map([bits], lambda bd, x: bd.typed("arith.bitcast", [(x[0], "i16")], "bf16"), dtype=v.dtype)


def reduce_mean(e: Emitter, v: Val, axes) -> Val:
    count = math.prod(v.shape[a] for a in axes)
    s = reduce_sum(e, v, axes)
    return e.map([s, e.scalar(count, v.dtype, v.rank)], lambda bd, x: bd.f("arith.divf", *x, el=element(v.dtype)))


@rule(top.ReduceOp)
def _(e: Emitter, op, p: top.ReduceParams, args):
    (x,) = args
    if x.dtype.kind == "u" and p.mode in ("ReduceMax", "ReduceMin"):
        raise NotImplementedError(f"{p.mode} of unsigned integers (TOSA's compare signed)")
    if x.dtype == np.bool_ and p.mode in ("ReduceMax", "ReduceMin"):
        # any / all: TOSA's max and min take no i1, the same on 0/1 bytes
        return e.cast(_reduce(e, op, p, e.cast(x, np.int8)), np.bool_)
    return _reduce(e, op, p, x)


def _reduce(e: Emitter, op, p: top.ReduceParams, x: Val) -> Val:
    el = element(x.dtype)
    mode = p.mode
    if mode in ("ReduceMax", "ReduceMin", "ReduceSum", "ReduceProd") or (mode == "ReduceMean" and x.is_float):
        names = {
            "ReduceMax": "tosa.reduce_max",
            "ReduceMin": "tosa.reduce_min",
            "ReduceSum": "tosa.reduce_sum",
            "ReduceProd": "tosa.reduce_product",
        }
        if mode in ("ReduceMean", "ReduceSum"):
            y = (reduce_mean if mode == "ReduceMean" else reduce_sum)(e, x, p.axes)
        else:
            y = _reduce_axes(e, names[mode], x, p.axes)
    else:
        _float(x, op)
        pre = {
            "ReduceL1": lambda bd, v: bd.f("math.absf", v[0], el=el),
            "ReduceL2": lambda bd, v: bd.f("arith.mulf", v[0], v[0], el=el),
            "ReduceSumSquare": lambda bd, v: bd.f("arith.mulf", v[0], v[0], el=el),
            "ReduceLogSum": None,
            "ReduceLogSumExp": None,
        }
        if mode not in pre:
            raise NotImplementedError(f"reduce mode {mode}")
        if mode == "ReduceLogSumExp":
            m = _reduce_axes(e, "tosa.reduce_max", x, p.axes)
            ex = e.map([x, m], lambda bd, v: bd.f("math.exp", bd.f("arith.subf", *v, el=el), el=el))
            s = reduce_sum(e, ex, p.axes)
            y = e.map([s, m], lambda bd, v: bd.f("arith.addf", bd.f("math.log", v[0], el=el), v[1], el=el))
        else:
            t = x if pre[mode] is None else e.map([x], pre[mode])
            y = reduce_sum(e, t, p.axes)
            if mode == "ReduceL2":
                y = e.map([y], lambda bd, v: bd.f("math.sqrt", v[0], el=el))
            elif mode == "ReduceLogSum":
                y = e.unary("tosa.log", y)
    if not p.keepdims:
        y = e.reshape(y, [d for i, d in enumerate(y.shape) if i not in p.axes])
    return y


@rule(top.ArgOp)
def _(e: Emitter, op, p: top.ArgParams, args):
    (x,) = args
    if x.dtype.kind == "u":
        raise NotImplementedError("arg max/min of unsigned integers (TOSA's compare signed)")
    if p.select_last_index:
        x = e.unary("tosa.reverse", x, f"axis = {p.axis} : i32")
    if p.mode == "ArgMin":
        el = element(x.dtype)
        if x.is_float:
            x = e.map([x], lambda bd, v: bd.f("arith.negf", v[0], el=el))
        else:
            x = e.binary("tosa.sub", e.scalar(0, x.dtype, x.rank), x)
    shape = [d for i, d in enumerate(x.shape) if i != p.axis]
    idx = e.op1("tosa.argmax", [x], shape, np.int32, f"axis = {p.axis} : i32")
    if p.select_last_index:
        n = x.shape[p.axis]
        idx = e.binary("tosa.sub", e.scalar(n - 1, np.int32, idx.rank), idx)
    idx = e.cast(idx, np.int64)
    if p.keepdims:
        keep = list(x.shape)
        keep[p.axis] = 1
        idx = e.reshape(idx, keep)
    return idx


__all__ = ["RNN_ACTIVATIONS", "reduce_max", "reduce_mean", "reduce_sum", "scalar_literal"]
