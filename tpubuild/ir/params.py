"""Op parameters: a frozen dataclass per op, stored as plain MLIR attributes.

An op class names its parameter dataclass in ``PARAMS``; the field annotations
say how each value is stored (int -> i64, float -> f64, bool -> i1, str ->
string, tuple[int, ...] -> array of i64, tuple[float, ...] -> array of f64).
Parsing happens once per op and is shared by shape rules, kernels and passes.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterable
from functools import cache, lru_cache

from xdsl.dialects.builtin import (
    ArrayAttr,
    BoolAttr,
    FloatAttr,
    IntAttr,
    IntegerAttr,
    IntegerType,
    StringAttr,
    f64,
    i1,
    i64,
)
from xdsl.ir import Attribute
from xdsl.utils.exceptions import VerifyException


@dataclasses.dataclass(frozen=True)
class NoParams:
    """For ops without parameters."""


@cache
def _field_kinds(cls: type) -> dict[str, tuple[str, object]]:
    """Field name -> (kind, default) where kind is one of int/float/bool/str/ints/floats."""
    hints = typing.get_type_hints(cls)
    kinds: dict[str, tuple[str, object]] = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        origin = typing.get_origin(hint)
        if origin is tuple:
            elem = typing.get_args(hint)[0]
            kind = {int: "ints", float: "floats", str: "strs"}[elem]
        elif typing.get_origin(hint) is typing.Union or origin is types.UnionType:
            # Optional[x]: x | None
            args = [a for a in typing.get_args(hint) if a is not type(None)]
            kind = {int: "int", float: "float", bool: "bool", str: "str"}[args[0]]
        else:
            kind = {int: "int", float: "float", bool: "bool", str: "str"}[hint]
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        kinds[f.name] = (kind, default)
    return kinds


_I64_RANGE = range(-(1 << 63), 1 << 63)


def int_attr(value: int) -> IntegerAttr:
    """IntegerAttr(value, i64). In i64's signed range (what the printer writes, so what parsing reads) it is built
    without IRDL's construction and checks, a tenth of their cost: a lowered module holds tens of thousands of
    them (per-channel multipliers and shifts, slices, addresses), and every stage that reads one parses them."""
    value = int(value)
    attr = _INT_ATTRS.get(value)
    if attr is not None:
        return attr
    if value not in _I64_RANGE:
        return IntegerAttr(value, i64)
    data = object.__new__(IntAttr)
    object.__setattr__(data, "data", value)
    attr = object.__new__(IntegerAttr)
    object.__setattr__(attr, "value", data)
    object.__setattr__(attr, "type", i64)
    if len(_INT_ATTRS) >= 1 << 16:
        _INT_ATTRS.clear()
    _INT_ATTRS[value] = attr  # attributes are immutable: one object serves every use of a value
    return attr


_INT_ATTRS: dict[int, IntegerAttr] = {}


def read_int(attr: Attribute) -> int:
    """The value of an integer attribute; VerifyException for another attribute."""
    if not isinstance(attr, IntegerAttr):
        raise VerifyException(f"expected an integer attribute, got {attr}")
    return attr.value.data


def read_ints(attr: Attribute) -> list[int]:
    """The values of an array of integer attributes; VerifyException for another attribute."""
    if not isinstance(attr, ArrayAttr):
        raise VerifyException(f"expected an array of integers, got {attr}")
    return [read_int(a) for a in attr.data]


def int_array(values: Iterable[int]) -> ArrayAttr:
    """An array of i64 (int_attr)."""
    return ArrayAttr([int_attr(v) for v in values])


def _to_attr(kind: str, value: typing.Any) -> Attribute:
    """``value`` (a dataclass field's, of the type ``kind`` names) as its attribute."""
    if kind == "int":
        return int_attr(value)
    if kind == "float":
        return FloatAttr(float(value), f64)
    if kind == "bool":
        return BoolAttr(int(bool(value)), i1)  # an int, as parsing gives
    if kind == "str":
        return StringAttr(str(value))
    if kind == "ints":
        return _int_array(tuple(int(v) for v in value))
    if kind == "floats":
        return ArrayAttr([FloatAttr(float(v), f64) for v in value])
    if kind == "strs":
        return ArrayAttr([StringAttr(str(v)) for v in value])
    raise AssertionError(kind)


@lru_cache(maxsize=4096)
def _int_array(values: tuple[int, ...]) -> ArrayAttr:
    # attributes are immutable, so one can serve every op with the same values: the mixed-precision search
    # lowers one module dozens of times, and an INT8 op's per-channel multipliers (6625 of them in PP-OCRv4
    # rec's classifier) were most of each lowering as fresh IntegerAttrs
    attr = int_array(values)
    if len(_INT_ARRAY_VALUES) >= 8192:
        _INT_ARRAY_VALUES.clear()
    _INT_ARRAY_VALUES[id(attr)] = (attr, values)
    return attr


# the values of the arrays _int_array made, by identity (the entry keeps its array, so the id stays its own):
# decoding each op of each lowering would otherwise read them back one IntegerAttr at a time
_INT_ARRAY_VALUES: dict[int, tuple[ArrayAttr, tuple[int, ...]]] = {}


def _from_attr(kind: str, attr: Attribute) -> object:
    if kind in ("int", "bool"):
        if not isinstance(attr, IntegerAttr):
            raise VerifyException(f"expected an integer attribute, got {attr}")
        value = attr.value.data
        if kind == "bool":
            if not (isinstance(attr.type, IntegerType) and attr.type.width.data == 1):
                raise VerifyException(f"expected a boolean attribute, got {attr}")
            return bool(value)
        return int(value)
    if kind == "float":
        if not isinstance(attr, FloatAttr):
            raise VerifyException(f"expected a float attribute, got {attr}")
        return float(attr.value.data)
    if kind == "str":
        if not isinstance(attr, StringAttr):
            raise VerifyException(f"expected a string attribute, got {attr}")
        return attr.data
    if not isinstance(attr, ArrayAttr):
        raise VerifyException(f"expected an array attribute, got {attr}")
    known = _INT_ARRAY_VALUES.get(id(attr)) if kind == "ints" else None
    if known is not None and known[0] is attr:
        return known[1]
    elem = {"ints": "int", "floats": "float", "strs": "str"}[kind]
    return tuple(_from_attr(elem, a) for a in attr.data)


def encode(params: object) -> dict[str, Attribute]:
    """Dataclass instance -> attribute dict; fields equal to their default are left out."""
    kinds = _field_kinds(type(params))
    out: dict[str, Attribute] = {}
    for name, (kind, default) in kinds.items():
        value = getattr(params, name)
        if value is None or (default is not dataclasses.MISSING and value == default):
            continue
        out[name] = _to_attr(kind, value)
    return out


def decode(cls: type, attributes: typing.Mapping[str, Attribute]) -> object:
    """Attribute dict -> dataclass instance; raises VerifyException naming the field at fault."""
    kinds = _field_kinds(cls)
    values: dict[str, object] = {}
    for name, (kind, default) in kinds.items():
        if name in attributes:
            try:
                values[name] = _from_attr(kind, attributes[name])
            except VerifyException as e:
                raise VerifyException(f"attribute {name}: {e}") from None
        elif default is dataclasses.MISSING:
            raise VerifyException(f"missing required attribute {name!r}")
    return cls(**values)
