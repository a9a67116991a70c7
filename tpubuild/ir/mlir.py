"""Reading and writing .mlir files, and the module layout every stage shares.

A module is ``builtin.module`` with the state in attributes (``module.name``,
``module.weight_file``, ``module.state``, later ``module.chip``/``mode``/
``asymmetric``) holding one ``func.func @main``: ``top.Input`` per argument,
the ops, and ``func.return``. Files are printed in MLIR generic form with
locations, so upstream MLIR tools parse them.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator, Sequence
from functools import cache

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import Builtin, BoolAttr, IntegerAttr, ModuleOp, StringAttr, i1
from xdsl.ir import Attribute, Block, Operation, Region, SSAValue
from xdsl.parser import Parser
from xdsl.printer import Printer
from xdsl.utils.exceptions import ParseError, VerifyException

from tpubuild.build.files import write_text
from tpubuild.errors import TpuBuildError, read_user_text
from tpubuild.ir.base import TensorOp
from tpubuild.ir.quant import Quant
from tpubuild.ir.top import InputOp, NoneOp, Top, WeightOp

STATES = ("TOP_F32", "TOP_CALIBRATED", "TPU_LOWERED", "TPU_GROUPED", "TPU_ADDRESSED")


@cache
def _dialects() -> tuple:
    from tpubuild.ir.tpu import Tpu  # the TPU dialect imports TOP pieces; load lazily
    return (Builtin, func.Func, Top, Tpu, Quant)


def context() -> Context:
    ctx = Context()
    for d in _dialects():
        ctx.load_dialect(d)
    return ctx


def parse_module(text: str, *, file: str = "<string>") -> ModuleOp:
    try:
        module = Parser(context(), text, name=file).parse_module()
    except ParseError as e:
        first = str(e).strip().splitlines()
        raise TpuBuildError(f"not valid MLIR: {' / '.join(first[:3])}", file=file,
                            hint="the file is truncated or was not written by tpubuild; rebuild it") from None
    try:
        module.verify()
    except VerifyException as e:
        raise TpuBuildError(f"invalid IR: {e}", file=file, hint="rebuild the file from its source") from None
    return module


def load_module(path: str | os.PathLike) -> ModuleOp:
    return parse_module(read_user_text(path, "MLIR file"), file=str(path))


def print_module(module: ModuleOp) -> str:
    out = io.StringIO()
    Printer(stream=out, print_generic_format=True, print_debuginfo=True).print_op(module)
    return out.getvalue() + "\n"


def save_module(module: ModuleOp, path: str | os.PathLike) -> None:
    write_text(path, print_module(module))


# ---- module layout ----------------------------------------------------------

def module_attr(module: ModuleOp, key: str, default: str | None = None) -> str | None:
    attr = module.attributes.get(f"module.{key}")
    if attr is None:
        return default
    if isinstance(attr, StringAttr):
        return attr.data
    if isinstance(attr, IntegerAttr):  # (BoolAttr is a generic alias: isinstance cannot take it)
        return str(bool(attr.value.data)).lower() if attr.type == i1 else str(attr.value.data)
    return str(attr)


def set_module_attrs(module: ModuleOp, **attrs: str | bool) -> None:
    for key, value in attrs.items():
        module.attributes[f"module.{key}"] = (BoolAttr(value, i1) if isinstance(value, bool)
                                             else StringAttr(str(value)))


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
    if isinstance(owner, TensorOp):
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

    def finish(self, outputs: Sequence[SSAValue], *, name: str, weight_file: str,
               state: str = "TOP_F32") -> ModuleOp:
        self.block.add_op(func.ReturnOp(*outputs))
        ftype = ([a.type for a in self.block.args], [v.type for v in outputs])
        main = func.FuncOp("main", ftype, Region(self.block))
        module = ModuleOp([main])
        set_module_attrs(module, name=name, weight_file=weight_file, state=state)
        return module
