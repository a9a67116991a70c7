"""Export rules of elementwise ops: arithmetic, activations, comparisons, casts, reductions.

TOSA ops where TOSA has the op with the same meaning (add, sub, mul, clamp, sigmoid, tanh, exp, log, erf...);
an elementwise ``linalg.generic`` of arith/math ops otherwise (exact division, sqrt, GELU, the composite
activations), written from the same formula as the op's reference kernel.
"""

from __future__ import annotations

import functools
import math

import ml_dtypes
import numpy as np

from tpubuild.export.tosa import Body, Emitter, Val, element, rule, scalar_literal
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
    if a.is_float and b.dtype == a.dtype:
        return e.binary("tosa.pow", a, b)
    raise NotImplementedError(f"Pow of {a.dtype} by {b.dtype}")


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
    return e.clamp(args[0], p.min, p.max)


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


def _activation(formula):
    """A rule computing ``formula(body, x, el, p)`` on each element of a float tensor."""

    def fn(e: Emitter, op, p, args):
        el = _float(args[0], op)
        return e.map(args, lambda bd, x: formula(bd, x, el, p))

    return fn


def _c(bd: Body, value: float, el: str) -> str:
    return bd.const(value, np.float16 if el == "f16" else np.float32)


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

for _cls, _formula in _FORMULAS.items():
    rule(_cls)(_activation(lambda bd, x, el, p, _f=_formula: _f(bd, x, el, p)))


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


@rule(top.CastOp)
def _(e: Emitter, op, p: top.CastParams, args):
    (x,) = args
    to = dtype_from_name(p.to)
    element(to)
    if "u" in (x.dtype.kind, to.kind) and to != np.bool_ and x.dtype != np.bool_:
        return _unsigned_cast(e, x, to)
    if x.is_float and to.kind in "iu":
        # float -> int truncates toward zero, as C casts (tosa.cast rounds to nearest)
        el = element(x.dtype)
        x = e.map([x], lambda bd, v: bd.f("math.trunc", v[0], el=el))
    if to == np.bool_ and x.dtype != np.bool_:
        return e.unary("tosa.logical_not", e.binary("tosa.equal", x, e.scalar(0, x.dtype, x.rank), np.bool_))
    return e.cast(x, to)


def _unsigned_cast(e: Emitter, x: Val, to: np.dtype) -> Val:
    """A cast from or to an unsigned type: the arith op that reads (or writes) the bits unsigned."""
    src, dst = element(x.dtype), element(to)
    if x.is_float:
        return e.map([x], lambda bd, v: bd.typed("arith.fptoui", [(v[0], src)], dst), dtype=to)
    if to.kind == "f" or to == np.dtype(ml_dtypes.bfloat16):
        op = "arith.uitofp" if x.dtype.kind == "u" else "arith.sitofp"
        return e.map([x], lambda bd, v: bd.typed(op, [(v[0], src)], dst), dtype=to)
    if x.dtype.itemsize == to.itemsize:
        return Val(x.name, x.shape, to, x.array)  # the same bits, signless
    if x.dtype.itemsize > to.itemsize:
        return e.map([x], lambda bd, v: bd.typed("arith.trunci", [(v[0], src)], dst), dtype=to)
    op = "arith.extui" if x.dtype.kind == "u" else "arith.extsi"
    return e.map([x], lambda bd, v: bd.typed(op, [(v[0], src)], dst), dtype=to)


# ---- reductions -----------------------------------------------------------------------------------------


def _reduce_axes(e: Emitter, name: str, v: Val, axes) -> Val:
    for axis in axes:
        shape = list(v.shape)
        shape[axis] = 1
        v = e.op1(name, [v], shape, v.dtype, f"axis = {axis} : i32")
    return v


def reduce_sum(e: Emitter, v: Val, axes) -> Val:
    return _reduce_axes(e, "tosa.reduce_sum", v, axes)


def reduce_mean(e: Emitter, v: Val, axes) -> Val:
    count = math.prod(v.shape[a] for a in axes)
    s = reduce_sum(e, v, axes)
    return e.map([s, e.scalar(count, v.dtype, v.rank)], lambda bd, x: bd.f("arith.divf", *x, el=element(v.dtype)))


@rule(top.ReduceOp)
def _(e: Emitter, op, p: top.ReduceParams, args):
    (x,) = args
    el = element(x.dtype)
    mode = p.mode
    if x.dtype.kind == "u" and mode in ("ReduceMax", "ReduceMin"):
        raise NotImplementedError(f"{mode} of unsigned integers (TOSA's compare signed)")
    if mode in ("ReduceMax", "ReduceMin", "ReduceSum", "ReduceProd") or (mode == "ReduceMean" and x.is_float):
        names = {
            "ReduceMax": "tosa.reduce_max",
            "ReduceMin": "tosa.reduce_min",
            "ReduceSum": "tosa.reduce_sum",
            "ReduceProd": "tosa.reduce_product",
        }
        y = reduce_mean(e, x, p.axes) if mode == "ReduceMean" else _reduce_axes(e, names[mode], x, p.axes)
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


__all__ = ["reduce_mean", "reduce_sum", "scalar_literal"]
