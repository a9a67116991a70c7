"""What TOP and TPU ops share: variadic operands/results, parameters, names, shapes."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any, ClassVar, TypeVar

from xdsl.dialects.builtin import ArrayAttr, FusedLoc, NameLoc, NoneAttr, NoneType, StringAttr, TensorType
from xdsl.ir import Attribute, SSAValue
from xdsl.irdl import IRDLOperation, irdl_op_definition, var_operand_def, var_result_def
from xdsl.utils.exceptions import VerifyException

from tpubuild.ir import params as _params
from tpubuild.ir.params import NoParams
from tpubuild.ir.types import shape_of


# An attribute is immutable, so one location serves every op at that name: the mixed-precision search lowers a
# model dozens of times, and making (and verifying) each op's NameLoc again was a fifth of a lowering.
@lru_cache(maxsize=1 << 16)
def name_loc(name: str) -> NameLoc:
    return NameLoc(StringAttr(name), NoneAttr())


def loc_names(loc: Attribute) -> list[str]:
    """Tensor names carried by a location: one for a NameLoc, one per result for a FusedLoc."""
    if isinstance(loc, NameLoc):
        return [loc.desc.data]
    if isinstance(loc, FusedLoc) and isinstance(loc.locations, ArrayAttr):
        return [n for sub in loc.locations.data for n in loc_names(sub)]
    return []


class TensorOp(IRDLOperation):
    """Base of every TOP/TPU op.

    Operands and results are variadic so one base fits all; an op class states
    its parameters (``PARAMS``, a frozen dataclass stored as attributes), its
    operand names (``OPERANDS``; a trailing ``*`` name takes the rest) and its
    shape rule (``infer``). Absent optional operands are the result of ``top.None``.
    """

    ins = var_operand_def()
    outs = var_result_def()

    PARAMS: ClassVar[type] = NoParams
    OPERANDS: ClassVar[tuple[str, ...]] = ("input",)
    NUM_RESULTS: ClassVar[int] = 1

    @property
    def params(self) -> Any:
        """The op's ``PARAMS`` dataclass, decoded from its attributes. Typed Any: its class is the op class's
        ``PARAMS`` (a class variable, which a static checker cannot follow into a subclass's property)."""
        return _params.decode(self.PARAMS, self.attributes)

    @property
    def names(self) -> list[str]:
        """The tensor name of each result (from the op's location)."""
        names = loc_names(self.location)
        if len(names) != len(self.results):
            raise VerifyException(
                f"{self.name}: location {self.location} names {len(names)} tensors for {len(self.results)} results"
            )
        return names

    @property
    def loc_name(self) -> str:
        names = loc_names(self.location)
        return names[0] if names else "?"

    def verify_(self) -> None:
        try:
            _ = self.params  # parsed for its checks
        except VerifyException as e:
            raise VerifyException(f"{self.name} at {self.loc_name!r}: {e}") from None
        fixed = [n for n in self.OPERANDS if not n.endswith("*")]
        variadic = len(fixed) != len(self.OPERANDS)
        n = len(self.operands)
        if (n < len(fixed)) or (not variadic and n != len(fixed)):
            raise VerifyException(f"{self.name} at {self.loc_name!r}: expected operands {self.OPERANDS}, got {n}")

    @classmethod
    def infer(cls, p, in_types: Sequence[Attribute]) -> list[Attribute]:
        """Result types from operand types; the default keeps the first operand's type."""
        return [in_types[0]]

    @classmethod
    def make(
        cls,
        operands: Sequence[SSAValue],
        params=None,
        *,
        name: str | Sequence[str],
        result_types: Sequence[Attribute] | None = None,
    ) -> TensorOp:
        """Build an op, inferring its result types unless given, located at its tensor name(s)."""
        p = params if params is not None else cls.PARAMS()
        if result_types is None:
            result_types = cls.infer(p, [v.type for v in operands])
        loc = name_loc(name) if isinstance(name, str) else FusedLoc(tuple(name_loc(n) for n in name), NoneAttr())
        # create, not build: with one variadic operand and one variadic result list there is nothing for IRDL's
        # argument matching to do, and it was half of each op's making (the search lowers a model 60 times)
        return cls.create(
            operands=list(operands), result_types=list(result_types), attributes=_params.encode(p), location=loc
        )


_Op = TypeVar("_Op", bound=type)


def op_definition(cls: _Op) -> _Op:
    """``irdl_op_definition`` that accepts our upper-case class constants without annotations.

    xDSL wants constants declared as ``ClassVar`` in the class that sets them;
    annotating them here keeps every op class down to its name and what differs.
    """
    for klass in cls.__mro__:
        if klass is TensorOp or not (isinstance(klass, type) and issubclass(klass, TensorOp)):
            continue
        annotations = klass.__dict__.get("__annotations__")
        if annotations is None:
            annotations = {}
            klass.__annotations__ = annotations
        for key in klass.__dict__:
            if key.isupper() and key not in annotations:
                annotations[key] = ClassVar
    return irdl_op_definition(cls)


def is_none(value: SSAValue) -> bool:
    return isinstance(value.type, NoneType)


def tensor_shape(value: SSAValue) -> tuple[int, ...]:
    return shape_of(value.type)


def with_shape(t: Attribute, shape: Sequence[int]) -> TensorType:
    assert isinstance(t, TensorType), t
    return TensorType(t.element_type, [int(d) for d in shape])
