"""TPU inference: tpubuild.top.inference.run on a tpu.mlir, plus its tensors as real numbers.

``run`` gives each tensor in its stored type (int8/uint8 for INT8 ops, bf16,
f16): the bits the chip holds, which the simulator must reproduce exactly.
``dequantized`` turns them into float32 real values (scale * (q - zero point)
for quantized types), which compare by name with TOP inference.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
from xdsl.dialects.builtin import ModuleOp, TensorType

from tpubuild.ir import mlir
from tpubuild.ir.base import TensorOp
from tpubuild.ir.quant import UniformType
from tpubuild.kernels import halfcast
from tpubuild.kernels.tpu_arith import is_float
from tpubuild.top.inference import run, weights_for


def tensor_types(module: ModuleOp) -> dict[str, TensorType]:
    """tensor name -> its type, for every op result."""
    types: dict[str, TensorType] = {}
    for op in mlir.body_ops(module):
        if isinstance(op, TensorOp):
            for name, value in zip(op.names, op.results, strict=True):
                if isinstance(value.type, TensorType):
                    types[name] = value.type
    return types


def dequantize(array: np.ndarray, elem) -> np.ndarray:
    """Stored values -> real float32 values (float arrays just widen to float32)."""
    if isinstance(elem, UniformType):
        scales = np.asarray(elem.scale_list, np.float64)
        zps = np.asarray(elem.zero_point_list, np.float64)
        if elem.quant_axis >= 0:
            shape = [1] * array.ndim
            shape[elem.quant_axis] = -1
            scales, zps = scales.reshape(shape), zps.reshape(shape)
        return ((array.astype(np.float64) - zps) * scales).astype(np.float32)
    if is_float(array.dtype) and array.dtype != np.float32:
        return halfcast.astype(array, np.float32)
    return array


def dequantized(module: ModuleOp, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    types = tensor_types(module)
    return {
        name: dequantize(np.asarray(a), types[name].element_type) if name in types else a for name, a in tensors.items()
    }


def source_output_names(module: ModuleOp) -> dict[str, str]:
    """Graph output name -> its name in the source model, for the outputs lowering renamed: a float result
    goes back to f32 through a tpu.Cast named after its operand (``y_f32`` of ``y``, ``Lowering.convert``),
    and the source model called that output ``y``. Outputs a TOP module or an F32 target returns as they
    are keep their names (and are not in the map)."""
    from tpubuild.ir import tpu

    renamed = {}
    for v in mlir.return_op(module).operands:
        op = v.owner
        if isinstance(op, tpu.CastOp) and op.operands:
            name, source = mlir.value_name(v), mlir.value_name(op.operands[0])
            if name.startswith(source + "_"):
                renamed[name] = source
    return renamed


def real_float32(array: np.ndarray, scale: float = 1.0, zero_point: int = 0) -> np.ndarray:
    """A stored output as float32: scale * (q - zero point) for a quantized integer one, f16/bf16 widened."""
    a = np.asarray(array)
    if a.dtype.kind in "iu" and (scale != 1.0 or zero_point != 0):
        return (scale * (a.astype(np.float64) - zero_point)).astype(np.float32)
    return halfcast.astype(a, np.float32) if a.dtype != np.float32 else a


def infer_tpu(mlir_path: str | os.PathLike, inputs: Mapping[str, np.ndarray]) -> tuple[dict, dict]:
    """(stored tensors, real-valued tensors) of a tpu.mlir, every tensor by name."""
    module = mlir.load_module(mlir_path)
    raw = run(module, weights_for(module, mlir_path), inputs)
    return raw, dequantized(module, raw)


def main(argv: list[str] | None = None) -> int:
    """python -m tpubuild.lower.inference TPU.mlir IN.npz OUT.npz [--stored]: every tensor, real values
    by default (compare with TOP's by name: tpubuild compare OUT.npz top_outs.npz), or the stored bits."""
    import argparse

    from tpubuild.build.files import read_npz, write_npz
    from tpubuild.errors import TpuBuildError

    p = argparse.ArgumentParser(prog="python -m tpubuild.lower.inference", description=main.__doc__)
    p.add_argument("mlir")
    p.add_argument("input")
    p.add_argument("output")
    p.add_argument("--stored", action="store_true", help="write the stored values (int8, bf16...) instead")
    args = p.parse_args(argv)
    try:
        raw, real = infer_tpu(args.mlir, read_npz(args.input))
    except TpuBuildError as e:
        print(f"error: {e}")
        return 1
    write_npz(args.output, raw if args.stored else real)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
