"""MLIR quant dialect element types, which xDSL does not ship.

Printed exactly as upstream MLIR spells them, so upstream tools parse our
files with their own quant dialect:

    !quant.calibrated<f32<-1.5:2.0>>
    !quant.uniform<i8:f32, 0.0125:-3>              per tensor
    !quant.uniform<i8:f32:1, {0.1:0,0.2:0}>        per axis (axis 1)

realValue = scale * (storedValue - zeroPoint).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from xdsl.dialects.builtin import ArrayAttr, FloatData, IntAttr, StringAttr
from xdsl.ir import Attribute, Dialect, ParametrizedAttribute, TypeAttribute
from xdsl.irdl import irdl_attr_definition, param_def
from xdsl.parser import AttrParser
from xdsl.printer import Printer

STORAGE = {"i8": (-128, 127), "u8": (0, 255), "i16": (-32768, 32767), "u16": (0, 65535), "i32": (-(2**31), 2**31 - 1)}


# print_parameters' per-axis list: scales as mlir_float writes them (always with a '.'), zero points
_FLOAT = r"-?\d+\.\d*(?:e[-+]?\d+)?"
_PER_AXIS = re.compile(rf"\{{((?:{_FLOAT}:-?\d+)(?:,{_FLOAT}:-?\d+)*)\}}")
_PAIR = re.compile(rf"({_FLOAT}):(-?\d+)")


def mlir_float(x: float) -> str:
    """A float literal MLIR's lexer accepts (it needs a '.'), exact on round trip."""
    s = repr(float(x))
    if "e" in s and "." not in s:
        s = s.replace("e", ".0e")
    return s


@irdl_attr_definition
class CalibratedType(ParametrizedAttribute, TypeAttribute):
    """A float tensor element with a calibrated range: !quant.calibrated<f32<min:max>>."""

    name = "quant.calibrated"
    expressed: Attribute = param_def()
    min: FloatData = param_def()
    max: FloatData = param_def()

    @staticmethod
    def get(expressed: Attribute, lo: float, hi: float) -> CalibratedType:
        return CalibratedType(expressed, FloatData(float(lo)), FloatData(float(hi)))

    @classmethod
    def parse_parameters(cls, parser: AttrParser) -> Sequence[Attribute]:
        parser.parse_punctuation("<")
        expressed = parser.parse_type()
        parser.parse_punctuation("<")
        lo = parser.parse_float()
        parser.parse_punctuation(":")
        hi = parser.parse_float()
        parser.parse_punctuation(">")
        parser.parse_punctuation(">")
        return (expressed, FloatData(lo), FloatData(hi))

    def print_parameters(self, printer: Printer) -> None:
        printer.print_string("<")
        printer.print_attribute(self.expressed)
        printer.print_string(f"<{mlir_float(self.min.data)}:{mlir_float(self.max.data)}>>")


@irdl_attr_definition
class UniformType(ParametrizedAttribute, TypeAttribute):
    """Uniform quantization, per tensor (axis = -1) or per axis."""

    name = "quant.uniform"
    storage: StringAttr = param_def()
    expressed: Attribute = param_def()
    axis: IntAttr = param_def()
    scales: ArrayAttr[FloatData] = param_def()
    zero_points: ArrayAttr[IntAttr] = param_def()

    @staticmethod
    def get(
        storage: str, expressed: Attribute, scales: Sequence[float], zero_points: Sequence[int], axis: int = -1
    ) -> UniformType:
        if storage not in STORAGE:
            raise ValueError(f"unknown quant storage type {storage!r}; expected one of {sorted(STORAGE)}")
        # keyed by the scales' exact bits (as floats, -0.0 == 0.0 would share an entry)
        return _uniform(
            storage, expressed, np.asarray(scales, np.float64).tobytes(), tuple(int(z) for z in zero_points), int(axis)
        )

    @property
    def storage_type(self) -> str:
        return self.storage.data

    @property
    def scale_list(self) -> list[float]:
        return [s.data for s in self.scales.data]

    @property
    def zero_point_list(self) -> list[int]:
        return [z.data for z in self.zero_points.data]

    @property
    def quant_axis(self) -> int:
        return self.axis.data

    @classmethod
    def parse_parameters(cls, parser: AttrParser) -> Sequence[Attribute]:
        parser.parse_punctuation("<")
        storage = parser.parse_identifier("quant storage type (i8, u8, ...)")
        parser.parse_punctuation(":")
        expressed = parser.parse_type()
        axis = -1
        if parser.parse_optional_punctuation(":"):
            axis = parser.parse_integer()
        parser.parse_punctuation(",")
        scales: list[float] = []
        zps: list[int] = []

        def one() -> None:
            scales.append(parser.parse_float())
            zps.append(parser.parse_integer() if parser.parse_optional_punctuation(":") else 0)

        if axis >= 0:
            # the whole {scale:zp,...} list at once when it is as the printer writes it (a per-channel
            # type names every channel: token by token it dominates parsing a lowered module)
            found = _PER_AXIS.match(parser.lexer.input.content, parser.pos)
            if found:
                for scale, zp in _PAIR.findall(found.group(1)):
                    scales.append(float(scale))
                    zps.append(int(zp))
                parser._resume_from(found.end())
            else:
                parser.parse_punctuation("{")
                one()
                while parser.parse_optional_punctuation(","):
                    one()
                parser.parse_punctuation("}")
        else:
            one()
        parser.parse_punctuation(">")
        return (
            StringAttr(storage),
            expressed,
            IntAttr(axis),
            ArrayAttr([FloatData(s) for s in scales]),
            ArrayAttr([IntAttr(z) for z in zps]),
        )

    def print_parameters(self, printer: Printer) -> None:
        printer.print_string(f"<{self.storage.data}:")
        printer.print_attribute(self.expressed)
        pairs = [f"{mlir_float(s)}:{z}" for s, z in zip(self.scale_list, self.zero_point_list, strict=True)]
        if self.axis.data >= 0:
            printer.print_string(f":{self.axis.data}, {{{','.join(pairs)}}}>")
        else:
            printer.print_string(f", {pairs[0]}>")


@lru_cache(maxsize=1024)
def _uniform(storage: str, expressed: Attribute, scales: bytes, zero_points: tuple[int, ...], axis: int) -> UniformType:
    # types are immutable, so one serves every op of that type: the mixed-precision search lowers a module
    # dozens of times, and a per-channel type holds an attribute per channel
    return UniformType(
        StringAttr(storage),
        expressed,
        IntAttr(axis),
        ArrayAttr([FloatData(s) for s in np.frombuffer(scales, np.float64).tolist()]),
        ArrayAttr([IntAttr(z) for z in zero_points]),
    )


Quant = Dialect("quant", [], [CalibratedType, UniformType])
