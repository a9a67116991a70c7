"""Decomposed activations, means and LayerNorm recognised as the single TOP ops TPU-MLIR lowers whole.

Pointwise activations (SiLU / Swish, GELU, HardSwish, Mish) are recognised by their algebra rather
than by the shape of the graph. A candidate root (Mul, Div, Add, Sub) is read as a
polynomial in its input x and one nonlinear leaf T (Sigmoid, Erf, Tanh, Tanh(Softplus),
or a clamp: HardSigmoid, Clip(0, N), ReLU-N), where T's argument is itself a polynomial in x.
Every exporter's operand order and association gives the same polynomials:
x*0.5*(1+erf(x/sqrt2)), (x*(erf(x*0.7071)+1))*0.5 and x*(0.5*(1+erf(...))) are all
0.5x + 0.5xT with T = erf(0.7071x); x*x*x and Pow(x, 3) are both x^3. A recipe is
therefore the pair (argument of T, root) as polynomials, compared coefficient by
coefficient.

Only values private to the match are read through: an operand with any other user
(or that is a graph output) is a leaf, and every leaf must be the same x. So the
ops replaced are exactly those computing the activation, and they can go. The new
op takes the root's tensor name, the last one the match replaces.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np
from xdsl.ir import Operation, SSAValue
from xdsl.pattern_rewriter import PatternRewriter, RewritePattern

from tpubuild.ir import top
from tpubuild.ir.base import TensorOp
from tpubuild.ir.types import dtype_of, shape_of
from tpubuild.ir.weights import WeightStore
from tpubuild.top.patterns.common import add_weight, forward, producer, users, weight_array

# a polynomial in x and the leaf T: {(power of x, power of T): coefficient}
Poly = dict[tuple[int, int], float]

_MAX_OPS = 32  # a match reads at most this many ops (activations take under 12)
_MAX_DEGREE = 6
_RTOL = 1e-5  # coefficients as exported in float32 (1/sqrt(2) = 0.70710677) match the exact ones


class _NoMatch(Exception):
    """The expression read so far is not a recognisable activation."""


def _p_add(a: Poly, b: Poly, sign: float = 1.0) -> Poly:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0.0) + sign * v
    return out


def _p_mul(a: Poly, b: Poly) -> Poly:
    out: Poly = {}
    for (i, j), u in a.items():
        for (k, m), v in b.items():
            if i + k > _MAX_DEGREE or j + m > _MAX_DEGREE:
                raise _NoMatch
            out[i + k, j + m] = out.get((i + k, j + m), 0.0) + u * v
    return out


def _p_scale(a: Poly, s: float) -> Poly:
    return {k: v * s for k, v in a.items()}


def _constant(a: Poly) -> float | None:
    return a.get((0, 0), 0.0) if all(k == (0, 0) or v == 0.0 for k, v in a.items()) else None


def poly_close(got: Poly, want: Poly, rtol: float = _RTOL) -> bool:
    """Same polynomial up to ``rtol`` (relative to each wanted coefficient, or to the
    largest one for terms that should vanish)."""
    scale = max(abs(v) for v in want.values())
    for k in set(got) | set(want):
        g, w = got.get(k, 0.0), want.get(k, 0.0)
        if abs(g - w) > rtol * (abs(w) if w else scale):
            return False
    return True


def scalar(value: SSAValue, weights: WeightStore) -> float | None:
    """A float constant holding one value (any shape of size 1), else None."""
    a = weight_array(value, weights)
    if a is None or a.size != 1 or a.dtype.kind != "f":
        return None
    return float(a.reshape(()))


# ---- nonlinear leaves --------------------------------------------------------------


@dataclass(frozen=True)
class Leaf:
    """T = t_scale * f(arg_scale * a + arg_shift), a = T's operand: how a leaf op relates to
    the function ``kind`` a recipe is written in (clamps become clip(., 0, 1))."""

    kind: str
    arg_scale: float = 1.0
    arg_shift: float = 0.0
    t_scale: float = 1.0


def _clamp(lo: float, hi: float) -> Leaf | None:
    """clip(a, 0, hi) = hi * clip(a / hi, 0, 1)."""
    if lo != 0.0 or not 0.0 < hi < math.inf:
        return None
    return Leaf("unit_clamp", arg_scale=1.0 / hi, t_scale=hi)


# leaf op class -> its Leaf (None: this instance is not one)
LEAVES = {
    top.SigmoidOp: lambda p: Leaf("sigmoid"),
    top.ErfOp: lambda p: Leaf("erf"),
    top.TanhOp: lambda p: Leaf("tanh"),
    top.HardSigmoidOp: lambda p: Leaf("unit_clamp", arg_scale=p.alpha, arg_shift=p.beta),
    top.ClipOp: lambda p: _clamp(p.min, p.max),
    top.ReluOp: lambda p: _clamp(0.0, p.relu_limit) if p.relu_limit > 0 else None,
}


# (leaf kind, class of the private op feeding it) -> the kind of the two together
_COMPOSED: dict[tuple[str, type], str] = {("tanh", top.SoftplusOp): "tanh_softplus"}


# ---- reading an expression ------------------------------------------------------------


class _Reader:
    """Reads values as polynomials in x and one leaf, collecting the ops read through."""

    def __init__(self, weights: WeightStore, shape: tuple[int, ...]):
        self.weights = weights
        self.shape = shape
        self.x: SSAValue | None = None
        self.leaf_op: TensorOp | None = None
        self.leaf: Leaf | None = None
        self.arg: Poly = {}
        self.ops: list[TensorOp] = []

    def var(self, value: SSAValue) -> Poly:
        if self.x is None:
            if isinstance(value.owner, top.WeightOp | top.NoneOp):
                raise _NoMatch  # a constant that is no scalar: x must be computed at run time
            self.x = value
        elif self.x is not value:
            raise _NoMatch  # a second runtime input: not a function of x alone
        return {(1, 0): 1.0}

    def read(self, value: SSAValue, *, root: bool = False) -> Poly:
        c = scalar(value, self.weights)
        if c is not None:
            return {(0, 0): c}
        op = value.owner
        if not root and not value.has_one_use():
            return self.var(value)  # shared with ops outside the match (or a graph output)
        if not isinstance(op, TensorOp) or getattr(op.params, "do_relu", False):
            return self.var(value)
        if type(op) in _ARITH:
            result = _ARITH[type(op)](self, op)
        elif type(op) in LEAVES and self.leaf_op is None and (leaf := LEAVES[type(op)](op.params)) is not None:
            self.leaf_op, self.leaf = op, leaf
            arg_value = op.operands[0]
            inner = producer(arg_value)
            composed = _COMPOSED.get((leaf.kind, type(inner)))
            if composed is not None and inner is not None and arg_value.has_one_use():
                self.leaf = replace(leaf, kind=composed)
                self.ops.append(inner)
                arg_value = inner.operands[0]
            arg = self.read(arg_value)
            if any(j for (_, j) in arg):
                raise _NoMatch
            self.arg = _p_add(_p_scale(arg, leaf.arg_scale), {(0, 0): leaf.arg_shift})
            result = {(0, 1): leaf.t_scale}
        else:
            return self.var(value)
        if shape_of(value.type) != self.shape or dtype_of(value.type).kind != "f":
            raise _NoMatch  # a constant broadcast the tensor larger
        self.ops.append(op)
        if len(self.ops) > _MAX_OPS:
            raise _NoMatch
        return result


def _div(r: _Reader, op: TensorOp) -> Poly:
    d = _constant(r.read(op.operands[1]))
    if not d:
        raise _NoMatch  # only division by a nonzero constant stays a polynomial
    return _p_scale(r.read(op.operands[0]), 1.0 / d)


def _pow(r: _Reader, op: TensorOp) -> Poly:
    n = op.params.exponent
    if not (n.is_integer() and 0 <= n <= _MAX_DEGREE):
        raise _NoMatch
    base, out = r.read(op.operands[0]), {(0, 0): 1.0}
    for _ in range(int(n)):
        out = _p_mul(out, base)
    return out


_ARITH = {
    top.AddOp: lambda r, op: _p_add(r.read(op.operands[0]), r.read(op.operands[1])),
    top.SubOp: lambda r, op: _p_add(r.read(op.operands[0]), r.read(op.operands[1]), -1.0),
    top.MulOp: lambda r, op: _p_mul(r.read(op.operands[0]), r.read(op.operands[1])),
    top.DivOp: _div,
    top.PowOp: _pow,
}


# ---- recipes -----------------------------------------------------------------------------

_K = math.sqrt(2.0 / math.pi)
_HALF_X_ONE_PLUS_T = {(1, 0): 0.5, (1, 1): 0.5}


@dataclass(frozen=True)
class Recipe:
    """root = ``result`` (in x and T) with T = ``kind``(``arg`` (in x)) is ``op``(x, params).

    ``arg`` None: T's argument is beta * x for any beta, which goes into ``params`` (a BetaParams).
    """

    kind: str
    arg: Poly | None
    result: Poly
    op: type
    params: object = None

    def fit(self, arg: Poly, result: Poly) -> tuple[bool, object]:
        """(matches, the new op's params)."""
        if not poly_close(result, self.result):
            return False, None
        if self.arg is not None:
            return poly_close(arg, self.arg), self.params
        beta = arg.get((1, 0), 0.0)
        return beta != 0.0 and poly_close(arg, {(1, 0): beta}), top.BetaParams(beta)


RECIPES = (
    Recipe("sigmoid", {(1, 0): 1.0}, {(1, 1): 1.0}, top.SiLUOp),
    Recipe("sigmoid", None, {(1, 1): 1.0}, top.SwishOp),  # x * sigmoid(beta * x), beta not 1
    Recipe("erf", {(1, 0): 1 / math.sqrt(2.0)}, _HALF_X_ONE_PLUS_T, top.GELUOp, top.GeluParams("normal")),
    Recipe("tanh", {(1, 0): _K, (3, 0): _K * 0.044715}, _HALF_X_ONE_PLUS_T, top.GELUOp, top.GeluParams("tanh")),
    # x * clip(x/6 + 1/2, 0, 1): HardSigmoid(1/6, 1/2) * x, and x * Clip(x + 3, 0, 6) / 6
    Recipe("unit_clamp", {(1, 0): 1 / 6, (0, 0): 0.5}, {(1, 1): 1.0}, top.HardSwishOp),
    Recipe("tanh_softplus", {(1, 0): 1.0}, {(1, 1): 1.0}, top.MishOp),
)


def _erase_dead(ops: Sequence[Operation], rewriter: PatternRewriter) -> None:
    """Erase the ops of ``ops`` left without users, users before producers."""
    pending = list(ops)
    while True:
        dead = [op for op in pending if all(not r.uses for r in op.results)]
        if not dead:
            return
        for op in dead:
            rewriter.erase(op)
            pending.remove(op)


@dataclass
class RecognizeActivation(RewritePattern):
    """A Mul/Div/Add/Sub computing SiLU, Swish, GELU (erf or tanh form), HardSwish or Mish of one x
    -> that op on x (see the module docstring for how forms are matched)."""

    weights: WeightStore

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> None:
        if not isinstance(op, TensorOp) or type(op) not in _ARITH or isinstance(op, top.PowOp):
            return
        reader = _Reader(self.weights, shape_of(op.results[0].type))
        try:
            result = reader.read(op.results[0], root=True)
        except _NoMatch:
            return
        if reader.leaf is None or reader.x is None or shape_of(reader.x.type) != reader.shape:
            return
        for recipe in RECIPES:
            if recipe.kind != reader.leaf.kind:
                continue
            matches, params = recipe.fit(reader.arg, result)
            if matches:
                new = recipe.op.make([reader.x], params, name=op.names[0], result_types=[op.results[0].type])
                rewriter.replace(op, new)
                _erase_dead([o for o in reversed(reader.ops) if o is not op], rewriter)
                return


# ---- a logistic written out ----------------------------------------------------------------


@dataclass
class RecognizeSigmoid(RewritePattern):
    """1 / (1 + exp(z)), as Reciprocal or as Div of 1 -> Sigmoid(-z).

    TF exports write sigmoid so, and PaddleOCR's DB step function is 1 / (1 + exp(-k (p - t))) with k = 50:
    its exp reaches 4.5e19 on a table-edge map (rapid_table_det's edge_det), which INT8 cannot hold and
    float16 overflows (from z = 11.1), while the logistic is bounded, and calibration, INT8 and verification
    know a Sigmoid's range. -z: a scalar Mul private to the match takes the sign (the DB step's -k, Neg's
    -1), else a Mul by -1 is added; both are named after the Sigmoid (``<name>_arg``), a tensor ONNX has not.
    """

    weights: WeightStore

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> None:
        if isinstance(op, top.ReciprocalOp):
            denominator = op.operands[0]
        elif isinstance(op, top.DivOp) and scalar(op.operands[0], self.weights) == 1.0:
            denominator = op.operands[1]
        else:
            return
        add = producer(denominator, top.AddOp)
        if add is None or not denominator.has_one_use() or getattr(add.params, "do_relu", False):
            return
        shape = shape_of(op.results[0].type)
        for e, one in ((add.operands[0], add.operands[1]), (add.operands[1], add.operands[0])):
            exp = producer(e, top.ExpOp)
            if exp is not None and e.has_one_use() and scalar(one, self.weights) == 1.0:
                break
        else:
            return
        z = exp.operands[0]
        if shape_of(z.type) != shape or dtype_of(z.type).kind != "f":
            return  # the 1 broadcast z larger
        name, dtype = op.names[0], dtype_of(z.type)
        x, minus, dead = z, -1.0, [add, exp]
        scaled = producer(z, top.MulOp) if z.has_one_use() else None
        if scaled is not None and not getattr(scaled.params, "do_relu", False):
            factors = [scalar(v, self.weights) for v in scaled.operands]
            runtime = [v for v, f in zip(scaled.operands, factors, strict=True) if f is None]
            if len(runtime) == 1 and shape_of(runtime[0].type) == shape:
                x, minus, dead = runtime[0], -next(f for f in factors if f is not None), [add, exp, scaled]
        k = add_weight(rewriter, self.weights, f"{name}_arg_scale", np.full((1,), minus, dtype), dtype)
        arg = top.MulOp.make([x, k], name=f"{name}_arg", result_types=[z.type])
        sigmoid = top.SigmoidOp.make([arg.results[0]], name=name, result_types=[op.results[0].type])
        rewriter.replace(op, [arg, sigmoid])
        _erase_dead(dead, rewriter)


# ---- arithmetic no-ops -------------------------------------------------------------------

# op -> (operand orders reading "x op constant", the constant that makes it x)
_NEUTRAL = {
    top.MulOp: (((0, 1), (1, 0)), 1.0),
    top.DivOp: (((0, 1),), 1.0),
    top.AddOp: (((0, 1), (1, 0)), 0.0),
    top.SubOp: (((0, 1),), 0.0),
}


@dataclass
class RemoveNeutralArith(RewritePattern):
    """x * 1, x / 1, x + 0, x - 0 -> x (Paddle's exports write Swish as sigmoid(x * 1.0) * x),
    when the constant does not broadcast x larger or change its type."""

    weights: WeightStore

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> None:
        if not isinstance(op, TensorOp) or type(op) not in _NEUTRAL or getattr(op.params, "do_relu", False):
            return
        orders, neutral = _NEUTRAL[type(op)]
        for i, j in orders:
            x = op.operands[i]
            if scalar(op.operands[j], self.weights) == neutral and x.type == op.results[0].type:
                forward(op, x, rewriter)
                return


# ---- LayerNorm ------------------------------------------------------------------------------


_Op = TypeVar("_Op", bound=TensorOp)


def _private(value: SSAValue, cls: type[_Op]) -> _Op | None:
    """``value``'s producer if it is a ``cls`` and ``value`` has no other user."""
    op = producer(value, cls)
    return op if op is not None and value.has_one_use() else None


def _mean_axes(op: TensorOp | None) -> tuple[int, ...] | None:
    if op is None or op.params.mode != "ReduceMean" or not op.params.keepdims:
        return None
    return op.params.axes


@dataclass
class _Norm:
    """(x - mean) scaled by 1/sqrt(var + eps): the parts LayerNorm needs, and the ops read."""

    centered: SSAValue
    var: SSAValue
    eps: float
    ops: list[TensorOp]


def _plus_eps(value: SSAValue, weights: WeightStore) -> tuple[SSAValue, float, list[TensorOp]] | None:
    """value = var + eps (either order; eps 0 if there is no Add)."""
    add = _private(value, top.AddOp)
    if add is None or add.params.do_relu:
        return value, 0.0, []
    for i, j in ((0, 1), (1, 0)):
        eps = scalar(add.operands[j], weights)
        if eps is not None and eps >= 0:
            return add.operands[i], eps, [add]
    return None


def _std(value: SSAValue, weights: WeightStore, power: float) -> tuple[SSAValue, float, list[TensorOp]] | None:
    """value = (var + eps) ** power, power 0.5 (Sqrt or Pow) or -0.5 (Reciprocal(Sqrt) or Pow)."""
    pw = _private(value, top.PowOp)
    if pw is not None and pw.params.exponent == power:
        found = _plus_eps(pw.operands[0], weights)
        return None if found is None else (found[0], found[1], found[2] + [pw])
    if power < 0:
        rcp = _private(value, top.ReciprocalOp)
        if rcp is None or rcp.params.const_val != 1.0:
            return None
        found = _std(rcp.operands[0], weights, -power)
        return None if found is None else (found[0], found[1], found[2] + [rcp])
    sq = _private(value, top.SqrtOp)
    if sq is None:
        return None
    found = _plus_eps(sq.operands[0], weights)
    return None if found is None else (found[0], found[1], found[2] + [sq])


def _normalized(op: TensorOp, weights: WeightStore) -> _Norm | None:
    """``op`` as Div(d, std) or Mul(d, 1/std), either order for the Mul."""
    if isinstance(op, top.DivOp):
        found = _std(op.operands[1], weights, 0.5)
        return None if found is None else _Norm(op.operands[0], *found)
    if isinstance(op, top.MulOp) and not op.params.do_relu:
        for i, j in ((0, 1), (1, 0)):
            found = _std(op.operands[j], weights, -0.5)
            if found is not None:
                return _Norm(op.operands[i], *found)
    return None


@dataclass
class RecognizeLayerNorm(RewritePattern):
    """(x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps) over the last dims -> LayerNorm(x)
    without scale and bias (RecognizeLayerNormAffine takes those in next).

    The square may be Pow(d, 2) or Mul(d, d); the division Div by Sqrt (or Pow 0.5) or Mul by
    Reciprocal(Sqrt) (or Pow -0.5); a missing epsilon Add means eps 0.
    """

    weights: WeightStore

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> None:
        if not isinstance(op, top.DivOp | top.MulOp):
            return
        norm = _normalized(op, self.weights)
        if norm is None:
            return
        var = _private(norm.var, top.ReduceOp)
        sub = producer(norm.centered, top.SubOp)
        if var is None or sub is None:
            return
        square = _private(var.operands[0], top.PowOp)
        if square is not None and square.params.exponent != 2.0:
            return
        if square is None:
            square = _private(var.operands[0], top.MulOp)
            if square is None or square.params.do_relu or list(square.operands) != [norm.centered] * 2:
                return
        elif square.operands[0] != norm.centered:
            return
        if any(user is not square and user is not op for user in users(norm.centered)):
            return  # the centred tensor is needed elsewhere
        x = sub.operands[0]
        mean = _private(sub.operands[1], top.ReduceOp)
        if mean is None or mean.operands[0] != x:
            return
        shape = shape_of(x.type)
        axes = _mean_axes(mean)
        if axes is None or axes != _mean_axes(var) or axes != tuple(range(len(shape) - len(axes), len(shape))):
            return  # LayerNorm normalises trailing dims only
        if shape_of(op.results[0].type) != shape or dtype_of(x.type).kind != "f":
            return
        none = top.NoneOp.make([], name="None")
        rewriter.insert(none)
        ln = top.LayerNormOp.make(
            [x, none.results[0], none.results[0]],
            top.LayerNormParams(axes[0], norm.eps),
            name=op.names[0],
            result_types=[op.results[0].type],
        )
        rewriter.replace(op, ln)
        _erase_dead(norm.ops[::-1] + [var, square, sub, mean], rewriter)


# op -> operand orders reading "sum op constant"
_SUM_SCALES = {top.MulOp: ((0, 1), (1, 0)), top.DivOp: ((0, 1),)}


@dataclass
class RecognizeMean(RewritePattern):
    """ReduceSum(x) / n or ReduceSum(x) * (1/n), n the count of the values summed -> ReduceMean(x), as Flax
    and Keras exports write a mean. The mean then stays in range where the sum does not: magika's LayerNorm
    sums 512 squares to 2.1e5, beyond float16's 65504, and its F16 target's output was NaN. (LayerNorm's
    own recognition reads ReduceMean.)"""

    weights: WeightStore

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> None:
        if not isinstance(op, top.MulOp | top.DivOp) or getattr(op.params, "do_relu", False):
            return
        for i, j in _SUM_SCALES[type(op)]:
            total, c = _private(op.operands[i], top.ReduceOp), scalar(op.operands[j], self.weights)
            if total is None or c is None or total.params.mode != "ReduceSum" or c == 0.0:
                continue
            x = total.operands[0]
            count = math.prod(shape_of(x.type)[a] for a in total.params.axes)
            scale = c if isinstance(op, top.MulOp) else 1.0 / c
            if not math.isclose(scale * count, 1.0, rel_tol=_RTOL) or dtype_of(x.type).kind != "f":
                continue
            if op.results[0].type != total.results[0].type:
                continue  # the constant broadcasts the sum larger or changes its type
            mean = top.ReduceOp.make(
                [x], replace(total.params, mode="ReduceMean"), name=op.names[0], result_types=[op.results[0].type]
            )
            rewriter.replace(op, mean)
            rewriter.erase(total)
            return


# op -> operand orders reading "layernorm op constant"
_AFFINE = {
    top.MulOp: ((0, 1), (1, 0)),
    top.AddOp: ((0, 1), (1, 0)),
    top.SubOp: ((0, 1),),
}


def over_norm_dims(c: np.ndarray, shape: tuple[int, ...], axis: int) -> np.ndarray | None:
    """``c`` (float64) broadcast to ``shape[axis:]``, if it varies over those dims only."""
    if c.ndim > len(shape):
        return None
    lead = (1,) * (len(shape) - c.ndim) + c.shape
    if any(d != 1 for d in lead[:axis]):
        return None
    try:
        return np.broadcast_to(c.reshape(lead[axis:]).astype(np.float64), shape[axis:])
    except ValueError:
        return None


@dataclass
class RecognizeLayerNormAffine(RewritePattern):
    """LayerNorm(x) * s + b with s, b constant over the normalised dims -> LayerNorm's scale
    and bias (the exporters' Mul(scale) and Add(bias) after the decomposed norm)."""

    weights: WeightStore

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> None:
        if not isinstance(op, TensorOp) or type(op) not in _AFFINE or getattr(op.params, "do_relu", False):
            return
        for i, j in _AFFINE[type(op)]:
            ln = _private(op.operands[i], top.LayerNormOp)
            c = weight_array(op.operands[j], self.weights)
            if ln is None or c is None or getattr(ln.params, "stats", False) or len(ln.results) != 1:
                continue
            shape = shape_of(ln.results[0].type)
            axis = ln.params.axis % len(shape)
            if op.results[0].type != ln.results[0].type or c.dtype.kind != "f" or c.ndim > len(shape):
                continue
            c = over_norm_dims(c, shape, axis)
            if c is not None:
                self._fold(op, ln, c, rewriter)
                return

    def _fold(self, op: TensorOp, ln: top.LayerNormOp, c: np.ndarray, rewriter: PatternRewriter) -> None:
        name, dtype = op.names[0], dtype_of(ln.results[0].type)
        x, scale_v, bias_v = ln.operands
        shape = shape_of(x.type)
        present = []
        for v in (scale_v, bias_v):
            a = None if isinstance(v.owner, top.NoneOp) else weight_array(v, self.weights)
            if a is not None:
                a = over_norm_dims(a, shape, ln.params.axis % len(shape))
            if a is None and not isinstance(v.owner, top.NoneOp):
                return  # computed at run time, or not shaped as LayerNorm's
            present.append(a)
        scale, bias = present
        if isinstance(op, top.MulOp):
            scale_v = add_weight(rewriter, self.weights, f"{name}_scale", c if scale is None else scale * c, dtype)
            if bias is not None:
                bias_v = add_weight(rewriter, self.weights, f"{name}_bias", bias * c, dtype)
        else:
            c = -c if isinstance(op, top.SubOp) else c
            bias_v = add_weight(rewriter, self.weights, f"{name}_bias", c if bias is None else bias + c, dtype)
        rewriter.replace(
            op, top.LayerNormOp.make([x, scale_v, bias_v], ln.params, name=name, result_types=[op.results[0].type])
        )
        rewriter.erase(ln)
