"""Reading and writing .mlir files, and the module layout every stage shares.

A module is ``builtin.module`` with the state in attributes (``module.name``,
``module.weight_file``, ``module.state``, later ``module.chip``/``mode``/
``asymmetric``) holding one ``func.func @main``: ``top.Input`` per argument,
the ops, and ``func.return``. Files are printed in MLIR generic form with
locations, so upstream MLIR tools parse them.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import typing
from collections import OrderedDict
from collections.abc import Iterator, Sequence

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import (
    ArrayAttr,
    Builtin,
    BoolAttr,
    DictionaryAttr,
    IntegerAttr,
    ModuleOp,
    StringAttr,
    i1,
    i64,
)
from xdsl.ir import Attribute, Block, Dialect, OpResult, Operation, Region, SSAValue
from xdsl.parser import Parser
from xdsl.printer import Printer
from xdsl.utils.exceptions import ParseError, VerifyException
from xdsl.utils.mlir_lexer import MLIRTokenKind

from tpubuild.build.files import write_text
from tpubuild.errors import TpuBuildError, read_user_text
from tpubuild.ir.base import TensorOp
from tpubuild.ir.params import int_array, int_attr
from tpubuild.ir.quant import Quant
from tpubuild.ir.top import InputOp, NoneOp, Top, WeightOp

STATES = ("TOP_F32", "TOP_CALIBRATED", "TPU_LOWERED", "TPU_GROUPED", "TPU_ADDRESSED")


def _tpu() -> Dialect:
    from tpubuild.ir.tpu import Tpu

    return Tpu


def context() -> Context:
    ctx = Context()
    for d in (Builtin, func.Func, Top, Quant):
        ctx.load_dialect(d)
    # xDSL loads a registered dialect when the parser first meets one of its names: a TOP-only process (export,
    # TOP inference, the front stages) never imports the TPU dialect's hundred op classes
    ctx.register_dialect("tpu", _tpu)
    return ctx


# Modules parsed in this process, by the sha256 of their text (most recent last). doit runs every stage of a
# build in one process, and most files are read by several stages (canonical.mlir by TOP verification,
# calibration, lowering and TPU verification; tpu.mlir by TPU verification and layer group): the xDSL parser
# costs about a millisecond per op, a clone of the parsed module a thousandth of that, and prints the same text.
_PARSED: OrderedDict[bytes, ModuleOp] = OrderedDict()
_PARSED_KEEP = 8


def parse_module(text: str, *, file: str = "<string>") -> ModuleOp:
    """The module ``text`` holds, verified; a fresh copy the caller may change, also when the same text was
    parsed before."""
    key = _text_key(text)
    known = _PARSED.get(key)
    if known is not None:
        _PARSED.move_to_end(key)
        return known.clone()
    module = _parse(text, file)
    _keep_parsed(key, module.clone())
    return module


def _text_key(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


def _keep_parsed(key: bytes, module: ModuleOp) -> None:
    _PARSED[key] = module
    _PARSED.move_to_end(key)
    while len(_PARSED) > _PARSED_KEEP:
        _PARSED.popitem(last=False)


# What the printer writes for an array of i64 (per-channel multipliers and shifts, slices, addresses):
# the generic parser spends a few tokens and calls per element, this reads the array at once.
_I64_ARRAY = re.compile(r"\[(-?\d+) : i64((?:, -?\d+ : i64)*)\]")
_I64_ITEM = re.compile(r", (-?\d+) : i64")
_I64 = re.compile(r"-?\d+ : i64\b")


_ANGLE = re.compile(r"[<>]")
# tensor types by their text: an op's function type repeats its operands' types, and a per-channel
# quant type is long; types are immutable, so every value of one type can share the object
_TENSOR_TYPES: dict[str, Attribute] = {}
_TENSOR_TYPES_KEEP = 100_000


def _type_end(text: str, start: int) -> int | None:
    """The end of the `tensor<...>` starting at ``start`` (angle brackets balanced, on its line), or None."""
    line_end = text.find("\n", start)
    depth = 0
    for m in _ANGLE.finditer(text, start, len(text) if line_end < 0 else line_end):
        depth += 1 if m.group() == "<" else -1
        if depth == 0:
            return m.end()
    return None


class _Parser(Parser):
    """xDSL's parser with fast paths: the i64 integers and arrays of them that dominate lowered modules, read
    at once (the same attributes as the generic path: IntegerAttr(value, i64), in an ArrayAttr), and tensor types
    parsed once per text."""

    def parse_optional_type(self) -> Attribute | None:
        token = self._current_token
        if token.kind != MLIRTokenKind.BARE_IDENT or token.text != "tensor":
            return super().parse_optional_type()
        text, start = self.lexer.input.content, self.pos
        end = _type_end(text, start)
        if end is None:
            return super().parse_optional_type()
        key = text[start:end]
        known = _TENSOR_TYPES.get(key)
        if known is not None:
            self._resume_from(end)
            return known
        found = super().parse_optional_type()
        if found is not None and self.pos >= end and not text[end : self.pos].strip():  # it read exactly that text
            if len(_TENSOR_TYPES) >= _TENSOR_TYPES_KEEP:
                _TENSOR_TYPES.clear()
            _TENSOR_TYPES[key] = found
        return found

    def parse_optional_builtin_int_or_float_attr(self) -> Attribute | None:
        if self._current_token.kind in (MLIRTokenKind.INTEGER_LIT, MLIRTokenKind.MINUS):
            found = _I64.match(self.lexer.input.content, self.pos)
            if found:
                self._resume_from(found.end())
                return int_attr(int(found.group().partition(" ")[0]))
        return super().parse_optional_builtin_int_or_float_attr()

    def _parse_optional_array_attr(self) -> ArrayAttr | None:
        if self._current_token.kind == MLIRTokenKind.L_SQUARE:
            found = _I64_ARRAY.match(self.lexer.input.content, self.pos)
            if found:
                values = [int(found.group(1))] + [int(v) for v in _I64_ITEM.findall(found.group(2))]
                self._resume_from(found.end())
                return int_array(values)
        return super()._parse_optional_array_attr()


def _parse(text: str, file: str) -> ModuleOp:
    try:
        module = _Parser(context(), text, name=file).parse_module()
    except ParseError as e:
        first = str(e).strip().splitlines()
        raise TpuBuildError(
            f"not valid MLIR: {' / '.join(first[:3])}",
            file=file,
            hint="the file is truncated or was not written by tpubuild; rebuild it",
        ) from None
    try:
        module.verify()
    except VerifyException as e:
        raise TpuBuildError(f"invalid IR: {e}", file=file, hint="rebuild the file from its source") from None
    return module


def file_key(path: str | os.PathLike) -> bytes:
    """The digest of a .mlir file's text, as the parse cache keys it."""
    return _text_key(read_user_text(path, "MLIR file"))


def load_module(path: str | os.PathLike) -> ModuleOp:
    return parse_module(read_user_text(path, "MLIR file"), file=str(path))


class _Printer(Printer):
    """xDSL's printer with the parser's fast path mirrored: i64 integers and arrays of them written at once, as
    the generic path writes them ("7 : i64", "[1 : i64, -2 : i64]"); a lowered module holds tens of thousands."""

    def print_attribute(self, attribute: Attribute) -> None:
        if type(attribute) is IntegerAttr and attribute.type == i64:
            self.print_string(f"{attribute.value.data:d} : i64")
        elif (
            type(attribute) is ArrayAttr
            and attribute.data
            and all(type(a) is IntegerAttr and a.type == i64 for a in attribute.data)
        ):
            ints = typing.cast(tuple[IntegerAttr, ...], attribute.data)
            self.print_string("[" + ", ".join(f"{a.value.data:d} : i64" for a in ints) + "]")
        else:
            super().print_attribute(attribute)


def print_module(module: ModuleOp) -> str:
    out = io.StringIO()
    _Printer(stream=out, print_generic_format=True, print_debuginfo=True).print_op(module)
    return out.getvalue() + "\n"


def save_module(module: ModuleOp, path: str | os.PathLike) -> None:
    text = print_module(module)
    write_text(path, text)
    # the stage that reads this file next usually runs in the same process (doit runs every stage in one):
    # it gets a copy of this module, which is what parsing the text gives (the printer writes every value
    # exactly), without parsing it, a third of a small stage's time; a module that does not verify is left
    # to parsing, which reports it
    try:
        module.verify()
    except VerifyException:
        return
    _keep_parsed(_text_key(text), module.clone())


# ---- module layout ----------------------------------------------------------


def require_state(module: ModuleOp, state: str, reader: str, hint: str, file: str | None = None) -> None:
    """Refuse a module a stage cannot read: ``reader`` says which stage reads what ("codegen reads an
    addressed module"), ``hint`` which stage makes it."""
    found = module_attr(module, "state")
    if found != state:
        raise TpuBuildError(f"{reader} (state {state}), this one is {found}", file=file, hint=hint)


def module_attr(module: ModuleOp, key: str, default: str | None = None) -> str | None:
    attr = module.attributes.get(f"module.{key}")
    if attr is None:
        return default
    if isinstance(attr, StringAttr):
        return attr.data
    if isinstance(attr, IntegerAttr):  # (BoolAttr is a generic alias: isinstance cannot take it)
        return str(bool(attr.value.data)).lower() if attr.type == i1 else str(attr.value.data)
    return str(attr)


def plain_value(attr: Attribute) -> typing.Any:
    """An attribute of integers, strings, arrays and dictionaries (lg.groups, ginfo) as plain Python values."""
    if isinstance(attr, IntegerAttr):
        return attr.value.data
    if isinstance(attr, StringAttr):
        return attr.data
    if isinstance(attr, ArrayAttr):
        return [plain_value(a) for a in attr.data]
    if isinstance(attr, DictionaryAttr):
        return {k: plain_value(v) for k, v in attr.data.items()}
    raise TpuBuildError(f"unexpected attribute {attr}: expected integers, strings, arrays and dictionaries")


def set_module_attrs(module: ModuleOp, **attrs: str | bool) -> None:
    for key, value in attrs.items():
        # (an int, as parsing "true" gives: a module read back from its saved copy is then the parsed one)
        module.attributes[f"module.{key}"] = (
            BoolAttr(int(value), i1) if isinstance(value, bool) else StringAttr(str(value))
        )


def main_func(module: ModuleOp) -> func.FuncOp:
    for op in module.body.block.ops:
        if isinstance(op, func.FuncOp) and op.sym_name.data == "main":
            return op
    raise TpuBuildError("module has no func.func @main", hint="the file was not written by tpubuild")


def body_ops(module: ModuleOp) -> Iterator[Operation]:
    return iter(main_func(module).body.block.ops)


def return_op(module: ModuleOp) -> func.ReturnOp:
    last = main_func(module).body.block.last_op
    assert isinstance(last, func.ReturnOp)
    return last


def value_name(value: SSAValue) -> str:
    """The tensor name of an SSA value: its producer's location (per result)."""
    owner = value.owner
    if isinstance(owner, TensorOp) and isinstance(value, OpResult):
        return owner.names[value.index]
    raise TpuBuildError(f"value {value} has no tensor name")


def input_ops(module: ModuleOp) -> list[InputOp]:
    return [op for op in body_ops(module) if isinstance(op, InputOp)]


def output_names(module: ModuleOp) -> list[str]:
    return [value_name(v) for v in return_op(module).operands]


def weight_names(module: ModuleOp) -> list[str]:
    return [op.loc_name for op in body_ops(module) if isinstance(op, WeightOp)]


class GraphBuilder:
    """Collects ops for ``@main`` in order; shares one ``top.None`` and one op per weight."""

    def __init__(self, input_types: Sequence[Attribute]):
        self.block = Block(arg_types=list(input_types))
        self._none: SSAValue | None = None
        self._weights: dict[str, SSAValue] = {}

    @property
    def args(self) -> Sequence[SSAValue]:
        return self.block.args

    def add(self, op: Operation) -> Operation:
        self.block.add_op(op)
        return op

    def weight(self, name: str, tensor_type: Attribute) -> SSAValue:
        if name not in self._weights:
            op = WeightOp.make([], name=name, result_types=[tensor_type])
            self._weights[name] = self.add(op).results[0]
        return self._weights[name]

    def none(self) -> SSAValue:
        if self._none is None:
            self._none = self.add(NoneOp.make([], name="None")).results[0]
        return self._none

    def finish(self, outputs: Sequence[SSAValue], *, name: str, weight_file: str, state: str = "TOP_F32") -> ModuleOp:
        self.block.add_op(func.ReturnOp(*outputs))
        ftype = ([a.type for a in self.block.args], [v.type for v in outputs])
        main = func.FuncOp("main", ftype, Region(self.block))
        module = ModuleOp([main])
        set_module_attrs(module, name=name, weight_file=weight_file, state=state)
        return module
