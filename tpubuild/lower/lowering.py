"""TOP -> TPU: one pass over the ops for a target {chip, mode, asymmetric}.

Each TOP op gets a mode: the target's, or the quantize table's pin. Its rule
(registered per TOP op class, one table per kind of mode) emits TPU ops and
asks the pass for its operands in the form it needs: a float tensor of a given
mode (``float_value``) or a per-tensor quantized one (``quant_value``). The
pass remembers how each value was lowered and inserts the ``tpu.Cast`` that
converts it, once per value and form, named ``<tensor>_<type>``. So an INT8 op
after an op that stayed in F16 gets a quantizing cast, a graph output gets a
cast back to f32, and no rule has to know its neighbours.

Rules: ``FLOAT_RULES`` (float modes; every TOP op without one is mirrored by
``mirror``) and ``INT8_RULES`` (an INT8 rule may return None: that op then
stays in the chip's float mode, with casts around it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence

import ml_dtypes
import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, NoneType, TensorType, bf16, f16, f32
from xdsl.ir import Attribute, Block, Operation, Region, SSAValue

from tpubuild.build.chips import Chip
from tpubuild.errors import TpuBuildError
from tpubuild.ir import mlir, top, tpu
from tpubuild.ir.base import TensorOp
from tpubuild.ir.quant import CalibratedType, UniformType
from tpubuild.ir.types import elem_of, shape_of
from tpubuild.ir.weights import ByIdentity, WeightStore
from tpubuild.calib.qdq import model_grids
from tpubuild.calib.table import Entry
from tpubuild.lower.quant import QType, activation_qtype, grid_qtype
from tpubuild.lower.bias import corrected_bias
from tpubuild.registry import Registry

MODES = ("F32", "BF16", "F16", "INT8")
# A quantize-table entry raises an op's precision and never lowers it: a table
# shipped for INT8 targets leaves the model's F32 target in F32.
PRECISION = {"INT8": 0, "BF16": 1, "F16": 1, "F32": 2}
MODE_DTYPE = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16)}
MODE_ELEM = {"F32": f32, "BF16": bf16, "F16": f16}
SUFFIX = {"F32": "f32", "BF16": "bf16", "F16": "f16"}

FloatRule = Callable[["Lowering", TensorOp, str], Sequence[SSAValue]]
Int8Rule = Callable[["Lowering", TensorOp], "Sequence[SSAValue] | None"]

FLOAT_RULES = Registry("a float lowering rule")
INT8_RULES = Registry("an INT8 lowering rule")


def float_rule(*classes: type) -> Callable[[FloatRule], FloatRule]:
    return FLOAT_RULES.register(*classes)


def int8_rule(*classes: type) -> Callable[[Int8Rule], Int8Rule]:
    return INT8_RULES.register(*classes)


def plain_type(t: Attribute) -> Attribute:
    """A calibrated tensor type as the float type it annotates."""
    if isinstance(t, TensorType) and isinstance(t.element_type, CalibratedType):
        return TensorType(t.element_type.expressed, list(t.get_shape()))
    return t


def is_float_type(t: Attribute) -> bool:
    return isinstance(t, TensorType) and (
        t.element_type in (f32, f16, bf16) or isinstance(t.element_type, CalibratedType)
    )


def retyped(t: Attribute, elem: Attribute) -> TensorType:
    return _tensor_type(elem, shape_of(t))


@functools.lru_cache(maxsize=1 << 14)
def _tensor_type(elem: Attribute, shape: tuple[int, ...]) -> TensorType:
    # an immutable attribute serves every op of that type: made and verified once, not per op and lowering
    # (rec: 24 -> 19 ms a lowering)
    return TensorType(elem, list(shape))


def tpu_params(tpu_cls: type, p) -> object:
    """A TOP op's parameters as its TPU op's (extra fields at their defaults)."""
    return tpu_cls.PARAMS(**{f.name: getattr(p, f.name) for f in dataclasses.fields(p)})


class Lowering:
    """One TOP -> TPU lowering; rules call its ``float_value``/``quant_value``/``emit``/``weight`` methods."""

    def __init__(
        self,
        module: ModuleOp,
        weights: WeightStore,
        *,
        chip: Chip,
        mode: str,
        asymmetric: bool = False,
        cali: Mapping[str, Entry] | None = None,
        qtable: Mapping[str, str] | None = None,
        absmax: Mapping[str, float] | None = None,
        bias_corrections: Mapping[str, np.ndarray] | None = None,
    ):
        if mode not in MODES:
            raise TpuBuildError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
        chip.check_mode(mode)
        self.module, self.weights, self.chip, self.mode = module, weights, chip, mode
        self.asymmetric = asymmetric
        self.cali = dict(cali or {})
        self.qtable = dict(qtable or {})
        self.bias_corrections = dict(bias_corrections or {})  # convs' and matmuls': lower/bias.py
        self.fallback = chip.float_mode if mode == "INT8" else mode
        self.ops = [op for op in mlir.body_ops(module) if isinstance(op, TensorOp)]
        self._check_qtable()
        if mode == "INT8" and not self.cali:
            raise TpuBuildError(
                "an INT8 target needs a calibration table",
                hint="add a calibration section to the manifest (data: a glob of sample inputs)",
            )
        self.used: set[str] = {n for op in self.ops for n in op.names}
        self.lowered: dict[SSAValue, SSAValue] = {}
        self.converted: dict[tuple[SSAValue, str], SSAValue] = {}
        self.out_weights = WeightStore()
        self._weight_values: dict[tuple[str, str], SSAValue] = {}
        self._none: SSAValue | None = None
        args = mlir.main_func(module).body.block.args
        self.block = Block(arg_types=[plain_type(a.type) for a in args])
        self.float_forced: set[Operation] = set()  # INT8: ops that must stay float (int8.float_region)
        # INT8: the ops after the last conv or matmul (int8.output_tail) that compute in F32 where the chip has
        # it: they are a small share of the work, and they make the outputs (F16 rounds a box beyond 512 px to
        # half pixels). Not its weighted ops (a classifier's fully connected head), float in the chip's float
        # mode: their weights are read from DDR at every inference, and F32 doubles those bytes (AlexNet's last
        # layer: 16 MB, a fifth of its INT8 model's traffic; MTCNN O-Net's first one made its INT8 model slower
        # than its F16 one) for logits that F16 holds to 11 bits
        self.tail: set[Operation] = set()
        self.tail_mode = "F32" if "F32" in chip.modes else self.fallback
        self.absorbed: set[Operation] = set()  # ops a later op computes as part of its own (int8.lut_chains)
        # float16 ops that compute in F32 where the chip has it (guarded_poles, overflowing): their largest values
        # measured on the test input (float targets' ``absmax``) or over calibration (INT8's table)
        self.wide: set[Operation] = set()
        if "F32" in chip.modes:
            if absmax is None:
                absmax = {name: max(abs(e.min), abs(e.max)) for name, e in self.cali.items()}
            dtype = MODE_DTYPE[self.fallback]
            self.wide = guarded_poles(self.ops, weights, dtype) | overflowing(self.ops, absmax, dtype)
        self.chains: dict[Operation, list[TensorOp]] = {}  # op -> the ops it absorbs, first first
        # INT8: a QDQ model's tensors on grids with a zero point (calib/qdq.py), which no calibration entry can
        # say, are stored on their grids, with a zero point even in a symmetric target. A cast onto any grid of
        # the model's rounds half to even, as its QuantizeLinear does (an image normalised as (p - 127.5) / 128
        # is all ties on a grid of 1/128).
        self.grids: dict[str, QType] = {}
        self.on_grid: set[str] = set()
        if mode == "INT8":
            found = model_grids(module, weights)
            self.grids = {name: grid_qtype(grid) for name, grid in found.items() if grid.entry() is None}
            self.on_grid = set(found)

    # ---- the pass -------------------------------------------------------------------

    def run(self, weight_file: str) -> tuple[ModuleOp, WeightStore]:
        if self.mode == "INT8":
            from tpubuild.lower.int8 import MIXING, float_region, lut_chains, output_tail

            tail = output_tail(self)
            self.float_forced = float_region(self) | tail
            self.tail = {op for op in tail if not isinstance(op, MIXING)}
            self.chains = lut_chains(self)
            self.absorbed = {op for chain in self.chains.values() for op in chain}
        arg_index: dict[SSAValue, int] = {a: i for i, a in enumerate(mlir.main_func(self.module).body.block.args)}
        for op in self.ops:
            if isinstance(op, top.WeightOp) or op in self.absorbed:
                continue  # weights: emitted where first used, in the form the user needs
            if isinstance(op, top.NoneOp):
                self.lowered[op.results[0]] = self.none()
                continue
            if isinstance(op, top.InputOp):
                arg = self.block.args[arg_index[op.operands[0]]]
                new = self.emit(top.InputOp, [arg], None, op.loc_name, [plain_type(op.results[0].type)])
                self.lowered[op.results[0]] = new.results[0]
                continue
            try:
                results = self.lower_op(op)
            except TpuBuildError as e:
                raise e.with_context(loc=op.loc_name) from None
            for old, new in zip(op.results, results, strict=True):
                self.lowered[old] = new
        outputs = [self.output_value(v) for v in mlir.return_op(self.module).operands]
        self.block.add_op(func.ReturnOp(*outputs))
        ftype = ([a.type for a in self.block.args], [v.type for v in outputs])
        new_module = ModuleOp([func.FuncOp("main", ftype, Region(self.block))])
        mlir.set_module_attrs(
            new_module,
            name=mlir.module_attr(self.module, "name") or "model",
            weight_file=weight_file,
            state="TPU_LOWERED",
            chip=self.chip.name,
            mode=self.mode,
            asymmetric=self.asymmetric,
        )
        return new_module, self.out_weights

    def mode_of(self, op: TensorOp) -> str:
        for name in op.names:
            if name in self.qtable:
                pinned = self.qtable[name]
                return pinned if PRECISION[pinned] >= PRECISION[self.mode] else self.mode
        return self.mode

    def lower_op(self, op: TensorOp) -> Sequence[SSAValue]:
        mode = self.mode_of(op)
        if mode == "INT8":
            rule = INT8_RULES.get(type(op))
            forced = op in self.float_forced
            results = rule(self, op) if rule and not forced else None
            if results is not None:
                return results
            # float where INT8 has no rule; F32 (where the chip has it) for the output tail, and for an op INT8
            # cannot do whose result lies on a QDQ model's grid, which the model computes in float32 (a PReLU
            # between a DequantizeLinear and a QuantizeLinear: F16's rounding moves a share of its integers)
            on_grid = not forced and any(name in self.on_grid for name in op.names)
            mode = self.tail_mode if op in self.tail or on_grid else self.fallback
        if op in self.wide and PRECISION[mode] < PRECISION["F32"]:
            mode = "F32"
        if type(op) not in FLOAT_RULES and type(op) not in tpu.MIRROR:
            raise TpuBuildError(f"{op.name} has no TPU lowering", hint="this op cannot be compiled for a TPU yet")
        return FLOAT_RULES.get(type(op), mirror)(self, op, mode)

    def _check_qtable(self) -> None:
        names = {n for op in self.ops for n in op.names}
        unknown = sorted(set(self.qtable) - names)
        if unknown:
            raise TpuBuildError(
                f"quantize table names ops this model does not have: {', '.join(unknown[:5])}"
                + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""),
                hint="op names are tensor names, as in canonical.mlir's locations",
            )
        for mode in sorted(set(self.qtable.values())):
            self.chip.check_mode(mode, what="quantize table mode")

    # ---- building -------------------------------------------------------------------

    def fresh(self, base: str) -> str:
        name, i = base, 1
        while name in self.used:
            name = f"{base}_{i}"
            i += 1
        self.used.add(name)
        return name

    def emit(
        self,
        cls: type[TensorOp],
        operands: Sequence[SSAValue],
        params,
        name: str | Sequence[str],
        result_types: Sequence[Attribute],
    ) -> TensorOp:
        if not isinstance(name, str) and len(name) == 1:
            name = name[0]  # one result: a NameLoc, as every stage writes it
        op = cls.make(operands, params, name=name, result_types=result_types)
        self.block.add_op(op)
        return op

    def none(self) -> SSAValue:
        if self._none is None:
            self._none = self.emit(top.NoneOp, [], None, "None", [NoneType()]).results[0]
        return self._none

    def weight(self, base: str, form: str, array: np.ndarray, elem: Attribute | None = None) -> SSAValue:
        """A top.Weight for ``array`` (one per base name and form); the plain form keeps the base name."""
        key = (base, form)
        if key not in self._weight_values:
            name = base if form == "" else self.fresh(f"{base}_{form}")
            self.out_weights.set(name, array)
            elem = elem if elem is not None else _elem_of_dtype(array.dtype)
            op = self.emit(top.WeightOp, [], None, name, [TensorType(elem, list(array.shape))])
            self._weight_values[key] = op.results[0]
        return self._weight_values[key]

    # ---- operands in the form a rule needs --------------------------------------------

    def weight_array(self, v: SSAValue) -> np.ndarray | None:
        """The array of a TOP weight operand, else None."""
        return self.weights[v.owner.loc_name] if isinstance(v.owner, top.WeightOp) else None

    def bias_array(self, op: TensorOp, v: SSAValue) -> np.ndarray | None:
        """A constant bias operand's array, less the op's correction (lower/bias.py) where it has one. Corrections
        are measured on the model lowered with the user's quantize table, and the search keeps them only where it
        adds nothing to that table (search.BiasChoice): the model they are applied to is the one measured."""
        array = self.weight_array(v)
        delta = self.bias_corrections.get(op.loc_name)
        return array if array is None or delta is None else corrected_bias(array, delta)

    def raw_value(self, v: SSAValue) -> SSAValue:
        """An operand as it is (integer/bool tensors, absent operands)."""
        if isinstance(v.type, NoneType):
            return self.none()
        if isinstance(v.owner, top.WeightOp):
            return self.weight(v.owner.loc_name, "", self.weights[v.owner.loc_name], elem_of(plain_type(v.type)))
        return self.lowered[v]

    def float_value(self, v: SSAValue, mode: str) -> SSAValue:
        """A float operand in ``mode``'s float type (other operands as they are)."""
        if not is_float_type(v.type):
            return self.raw_value(v)
        dtype, elem = MODE_DTYPE[mode], MODE_ELEM[mode]
        if isinstance(v.owner, top.WeightOp):
            array = self.weights[v.owner.loc_name]
            form = "" if array.dtype == dtype else SUFFIX[mode]
            return self.weight(v.owner.loc_name, form, _as_dtype(array, dtype), elem)
        lv = self.lowered[v]
        have = elem_of(lv.type)
        if have == elem:
            return lv
        return self.convert(v, SUFFIX[mode], elem, _cast_params(have, mode))

    def quant_value(self, v: SSAValue) -> tuple[SSAValue, QType]:
        """A float operand quantized per tensor: weights symmetric i8, activations by calibration."""
        array = self.weight_array(v)
        if array is not None:
            amax = float(np.max(np.abs(array))) if array.size else 0.0
            qt = QType("i8", amax / 127 if amax > 0 else 1.0)
            return self.weight(mlir.value_name(v), "i8", qt.quantize(array), qt.element()), qt
        lv = self.lowered[v]
        have = QType.of(elem_of(lv.type))
        if have is not None:
            return lv, have
        name = mlir.value_name(v)
        qt = self.out_qtype(name)
        rounding = "HalfToEven" if name in self.on_grid else "HalfAwayFromZero"
        params = tpu.CastParams(to=qt.dtype.name, scale=qt.scale, zero_point=qt.zero_point, round_mode=rounding)
        return self.convert(v, qt.storage, qt.element(), params), qt

    def convert(self, v: SSAValue, form: str, elem: Attribute, params: tpu.CastParams) -> SSAValue:
        """``v`` cast to element type ``elem`` (once per value and form), named <tensor>_<form>."""
        key = (v, form)
        if key not in self.converted:
            lv = self.lowered[v]
            name = self.fresh(f"{mlir.value_name(v)}_{form}")
            self.converted[key] = self.emit(tpu.CastOp, [lv], params, name, [retyped(lv.type, elem)]).results[0]
        return self.converted[key]

    def output_value(self, v: SSAValue) -> SSAValue:
        """A graph output: float results go back to f32, as the source model's outputs are."""
        if isinstance(v.owner, (top.WeightOp, top.InputOp)) or not is_float_type(v.type):
            return self.raw_value(v) if isinstance(v.owner, top.WeightOp) else self.lowered[v]
        return self.float_value(v, "F32")

    def out_qtype(self, name: str) -> QType:
        """The quantization of an activation, from its calibration (or its QDQ model's grid)."""
        if name in self.grids:
            return self.grids[name]
        stats = self.cali.get(name)
        if stats is None:
            raise TpuBuildError(
                f"no calibration for tensor {name!r}",
                loc=name,
                hint="the calibration table does not match this model: rebuild it "
                "(doit calibrate:<model>) or add the tensor to the user table",
            )
        return activation_qtype(stats, self.asymmetric)


# A weight in a float mode's dtype, by the identity of the weight array (each entry keeps it, so its id stays
# its own): the mixed-precision search lowers one model dozens of times, converting the same weights of its
# float-pinned ops each time. The arrays are shared between lowerings, as int8.Weighted's are.
_AS_DTYPE: ByIdentity[np.ndarray] = ByIdentity(1024)


def _as_dtype(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    def make() -> np.ndarray:
        narrower = array.dtype.kind == "f" and array.dtype != dtype
        return (_in_range(array, dtype) if narrower else array).astype(dtype)

    return _AS_DTYPE.get((array,), (dtype.str,), make)


def _in_range(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A float constant held within ``dtype``'s finite range, and a nonzero scalar kept nonzero, as
    onnxconverter-common's float16 conversion clamps. Exporters write "very negative" as float32's
    lowest (an attention mask's ``(1 - mask) * -3.4e38``) and "tiny" as 1e-10 (``log(x + 1e-10)``): rounded,
    the one becomes -inf in float16 and bfloat16 (0 * -inf is NaN at every unmasked place) and the other
    0 in float16 (log(0)). A filter's tiny values round to 0 as they would (their error is smallest there).
    Infinities and NaNs the model wrote stay as they are."""
    info = ml_dtypes.finfo(dtype)
    big, tiny = float(info.max), float(info.smallest_subnormal)
    # the extremes first: two passes without temporaries decide for almost every weight (a NaN or an infinity
    # fails the test, and the finite values are then looked at alone)
    if (
        array.size == 0
        or -big <= float(array.min()) <= float(array.max()) <= big
        or (np.abs(array[np.isfinite(array)], dtype=np.float64) <= big).all()
    ):
        held = array
    else:
        held = np.where(np.isfinite(array), np.clip(array, -big, big), array)
    if held.size == 1 and 0 < abs(float(held.reshape(-1)[0])) < tiny:
        return np.full_like(held, math.copysign(tiny, float(held.reshape(-1)[0])))
    return held


def _elem_of_dtype(dtype: np.dtype) -> Attribute:
    from tpubuild.ir.types import element_type

    return element_type(dtype)


def _cast_params(have: Attribute, mode: str) -> tpu.CastParams:
    """A cast to ``mode``'s float type from a float or per-tensor quantized element type."""
    qt = QType.of(have)
    to = MODE_DTYPE[mode].name
    if qt is not None:
        return tpu.CastParams(to=to, scale=qt.scale, zero_point=qt.zero_point)
    if isinstance(have, UniformType):
        raise TpuBuildError(f"cannot convert {have} to {mode}")
    return tpu.CastParams(to=to)


def _pole_operand(op: Operation) -> int | None:
    """The operand at which ``op`` is infinite when it is 0."""
    if isinstance(op, top.LogOp | top.ReciprocalOp) or (isinstance(op, top.PowOp) and op.params.exponent < 0):
        return 0
    return 1 if isinstance(op, top.DivOp) else None


def _guard_constant(op: Operation, weights: WeightStore) -> np.ndarray | None:
    """The constant by which ``op`` keeps a value off 0: Add(x, eps), Max(x, eps), Clip(x, min=eps)."""
    if isinstance(op, top.ClipOp):
        return np.array([op.params.min])
    if isinstance(op, top.AddOp | top.MaxOp):
        for v in op.operands:
            if isinstance(v.owner, top.WeightOp):
                return weights[v.owner.loc_name]
    return None


def guarded_poles(ops: Sequence[Operation], weights: WeightStore, dtype: np.dtype) -> set[Operation]:
    """Log(x + eps), 1 / max(x, eps), y / sqrt(x + eps) and the like, where eps is below ``dtype``'s smallest
    normal number: the guard, the op it guards and a Sqrt or ops that move values between them (F.normalize's
    x / Expand(Clip(norm, 1e-12)), which gives 0 / 0 where float gives 0 / 1e-12). In float16 eps is at best held at
    6e-8 (1e-10 would round to 0) and x loses its small values (a power spectrum's quiet bins square to 0),
    so the log reads a floor far above the one the model set, or 0; in F32 it reads eps, as the model does.
    (basic-pitch's log-CQT, min-max normalised over the clip: with 1e-10 rounded to 0 every value was NaN,
    held at 6e-8 every quiet bin moved, output cosine 0.9915; these ops in F32: 0.9996.)"""
    if np.dtype(dtype).itemsize >= 4:
        return set()
    smallest = float(ml_dtypes.finfo(dtype).tiny)
    wide: set[Operation] = set()
    for op in ops:
        i = _pole_operand(op)
        if i is None:
            continue
        chain = [op]
        guard = op.operands[i].owner
        while isinstance(guard, (top.SqrtOp, *top.MOVE_OPS)):
            chain.append(guard)
            guard = guard.operands[0].owner
        eps = _guard_constant(guard, weights) if isinstance(guard, Operation) else None
        if isinstance(guard, Operation) and eps is not None and ((eps > 0) & (eps < smallest)).any():
            wide.update(chain)
            wide.add(guard)
    return wide


# a value within this factor of float16's largest on the inputs measured overflows on a louder or brighter one
F16_HEADROOM = 4.0


def overflowing(ops: Sequence[Operation], absmax: Mapping[str, float], dtype: np.dtype) -> set[Operation]:
    """The ops that read or write a value float16 cannot hold (``absmax``: the largest magnitude measured per
    tensor, beyond 65504 / F16_HEADROOM). A model fed raw samples overflows there: openWakeWord's melspectrogram
    takes int16-scaled audio, its STFT conv gives 5e5 and the power spectrum 4e11, and in float16 those are inf,
    then NaN after the mel filterbank's zeros. In F32 they are exact, and the Log after them is float16 again."""
    if np.dtype(dtype) != np.float16:
        return set()
    limit = float(ml_dtypes.finfo(np.float16).max) / F16_HEADROOM
    big = {name for name, m in absmax.items() if m > limit}
    if not big:
        return set()
    wide: set[Operation] = set()
    for op in ops:
        if not isinstance(op, TensorOp) or isinstance(op, top.InputOp | top.WeightOp):
            continue
        read = [mlir.value_name(v) for v in op.operands if isinstance(v.owner, TensorOp)]
        if big.intersection(op.names) or big.intersection(read):
            wide.add(op)
    return wide


def float_operand(lw: Lowering, v: SSAValue, mode: str) -> SSAValue:
    return lw.float_value(v, mode) if not isinstance(v.type, NoneType) else lw.none()


def mirror(lw: Lowering, op: TensorOp, mode: str) -> Sequence[SSAValue]:
    """The float lowering of most ops: the TPU twin, float operands and results in ``mode``'s type."""
    tpu_cls = tpu.MIRROR[type(op)]
    # a constant bias stays f32: it joins the f32 accumulator, and rounding it first only adds error
    operands = [
        _float_bias(lw, op, v) if name == "bias" and isinstance(v.owner, top.WeightOp) else float_operand(lw, v, mode)
        for v, name in zip(op.operands, _operand_names(op), strict=True)
    ]
    types = [retyped(t, MODE_ELEM[mode]) if is_float_type(t) else t for t in op.result_types]
    return lw.emit(tpu_cls, operands, tpu_params(tpu_cls, op.params), op.names, types).results


def _float_bias(lw: Lowering, op: TensorOp, v: SSAValue) -> SSAValue:
    """A constant bias in F32, less its correction for the INT8 ops before it (lower/bias.py) where it has one."""
    array = lw.bias_array(op, v)
    if array is None or array is lw.weight_array(v):
        return lw.float_value(v, "F32")
    return lw.weight(mlir.value_name(v), "corrected", array, f32)


def _operand_names(op: TensorOp) -> list[str]:
    """The OPERANDS name of each operand (a trailing variadic name repeats)."""
    names = [n.rstrip("*") for n in op.OPERANDS]
    return [names[min(i, len(names) - 1)] for i in range(len(op.operands))] if names else []


@float_rule(top.CastOp)
def _(lw: Lowering, op: TensorOp, mode: str) -> Sequence[SSAValue]:
    """ONNX Cast: tpu.Cast rounding towards zero; a float32 result becomes the mode's float type."""
    p = op.params
    to = MODE_DTYPE[mode].name if p.to == "float32" else p.to
    round_mode = p.round_mode if p.to == "float8_e8m0fnu" else "TowardsZero"
    params = tpu.CastParams(to=to, round_mode=round_mode, saturate=p.saturate)
    (t,) = op.result_types
    result = retyped(t, MODE_ELEM[mode]) if is_float_type(t) else t
    return lw.emit(tpu.CastOp, [float_operand(lw, op.operands[0], mode)], params, op.names, [result]).results


def lower_module(
    module: ModuleOp,
    weights: WeightStore,
    *,
    chip: Chip,
    mode: str,
    asymmetric: bool = False,
    cali: Mapping[str, Entry] | None = None,
    qtable: Mapping[str, str] | None = None,
    weight_file: str = "tpu_weights.npz",
    absmax: Mapping[str, float] | None = None,
    bias_corrections: Mapping[str, np.ndarray] | None = None,
) -> tuple[ModuleOp, WeightStore]:
    """TOP (canonical or calibrated) module -> TPU module and its weights; ``absmax``: each tensor's largest
    magnitude on the test input, for a float target (an INT8 one reads its calibration table's);
    ``bias_corrections``: what INT8 takes from convs' and matmuls' biases (lower/bias.py)."""
    from tpubuild.lower import int8  # noqa: F401  (registers the INT8 rules)

    lowering = Lowering(
        module,
        weights,
        chip=chip,
        mode=mode,
        asymmetric=asymmetric,
        cali=cali,
        qtable=qtable,
        absmax=absmax,
        bias_corrections=bias_corrections,
    )
    return lowering.run(weight_file)
