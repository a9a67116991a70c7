"""numpy dtypes <-> MLIR element types, and tensor types."""

from __future__ import annotations

from collections.abc import Iterable

import ml_dtypes
import numpy as np
import numpy.typing as npt
from xdsl.dialects.builtin import (
    Float4E2M1FNType,
    Float8E4M3FNType,
    Float8E4M3FNUZType,
    Float8E5M2FNUZType,
    Float8E5M2Type,
    Float8E8M0FNUType,
    NoneType,
    TensorType,
    bf16,
    f16,
    f32,
    f64,
    IntegerType,
    Signedness,
    i1,
    i8,
    i32,
    i64,
)
from xdsl.ir import Attribute

from tpubuild.ir.quant import CalibratedType, UniformType

u8 = IntegerType(8, Signedness.UNSIGNED)
i16 = IntegerType(16)

_TO_MLIR = {
    np.dtype(np.float32): f32,
    np.dtype(np.float16): f16,
    np.dtype(ml_dtypes.bfloat16): bf16,
    np.dtype(np.float64): f64,
    np.dtype(np.int64): i64,
    np.dtype(np.int32): i32,
    np.dtype(np.int16): i16,
    np.dtype(np.int8): i8,
    np.dtype(np.uint8): u8,
    np.dtype(np.bool_): i1,
    # 8-bit floats (ONNX types from opset 19; TPU-MLIR's F8 modes)
    np.dtype(ml_dtypes.float8_e4m3fn): Float8E4M3FNType(),
    np.dtype(ml_dtypes.float8_e5m2): Float8E5M2Type(),
    np.dtype(ml_dtypes.float8_e4m3fnuz): Float8E4M3FNUZType(),
    np.dtype(ml_dtypes.float8_e5m2fnuz): Float8E5M2FNUZType(),
    np.dtype(ml_dtypes.float8_e8m0fnu): Float8E8M0FNUType(),
    # sub-byte types (ONNX 4- and 2-bit tensors), one element per byte in numpy as in ml_dtypes
    np.dtype(ml_dtypes.int4): IntegerType(4),
    np.dtype(ml_dtypes.uint4): IntegerType(4, Signedness.UNSIGNED),
    np.dtype(ml_dtypes.int2): IntegerType(2),
    np.dtype(ml_dtypes.uint2): IntegerType(2, Signedness.UNSIGNED),
    np.dtype(ml_dtypes.float4_e2m1fn): Float4E2M1FNType(),
    # wider unsigned types occur in index/shape arithmetic of real graphs
    np.dtype(np.uint16): IntegerType(16, Signedness.UNSIGNED),
    np.dtype(np.uint32): IntegerType(32, Signedness.UNSIGNED),
    np.dtype(np.uint64): IntegerType(64, Signedness.UNSIGNED),
}
_FROM_MLIR = {v: k for k, v in _TO_MLIR.items()}
_STORAGE = {
    "i8": np.dtype(np.int8),
    "u8": np.dtype(np.uint8),
    "i16": np.dtype(np.int16),
    "u16": np.dtype(np.uint16),
    "i32": np.dtype(np.int32),
}


def element_type(dtype: npt.DTypeLike) -> Attribute:
    dt = np.dtype(dtype)
    if dt not in _TO_MLIR:
        raise NotImplementedError(f"tensor element type {dt} has no MLIR counterpart here")
    return _TO_MLIR[dt]


def numpy_dtype(elem: Attribute) -> np.dtype:
    """The dtype a tensor of this element type holds at run time (quantized: its storage)."""
    if isinstance(elem, CalibratedType):
        return numpy_dtype(elem.expressed)
    if isinstance(elem, UniformType):
        return _STORAGE[elem.storage_type]
    return _FROM_MLIR[elem]


def tensor_type(shape: Iterable[int], dtype: npt.DTypeLike = np.float32) -> TensorType:
    return TensorType(element_type(dtype), [int(d) for d in shape])


def elem_of(t: Attribute) -> Attribute:
    """A tensor type's element type."""
    assert isinstance(t, TensorType), t
    return t.element_type


def shape_of(t: Attribute) -> tuple[int, ...]:
    if isinstance(t, NoneType):
        return ()
    assert isinstance(t, TensorType), t
    return tuple(t.get_shape())


def dtype_of(t: Attribute) -> np.dtype:
    assert isinstance(t, TensorType), t
    return numpy_dtype(t.element_type)


def dtype_from_name(name: str) -> np.dtype:
    """A numpy dtype from its name, ml_dtypes' included (``bfloat16`` is not a name numpy knows)."""
    extra = getattr(ml_dtypes, name, None)
    return np.dtype(extra) if isinstance(extra, type) else np.dtype(name)
