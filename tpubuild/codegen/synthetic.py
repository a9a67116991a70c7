"""Generated TPU modules of any size, for layer-group tests and benchmarks (no ONNX, no weights needed).

``residual_net(ops)`` builds a ResNet-like F32 tpu.mlir: a stem conv, then
blocks of conv 3x3 + relu, conv 3x3, add (the block input), relu, with a
stride-2 conv and a max pool every few blocks, until it has ``ops`` compute
ops. Deterministic: same arguments, same module.
"""

from __future__ import annotations

import numpy as np
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import SSAValue

from tpubuild.ir import mlir, tpu
from tpubuild.ir.top import InputOp
from tpubuild.ir.types import tensor_type
from tpubuild.ir.weights import WeightStore


def residual_net(
    ops: int = 500, *, n: int = 1, channels: int = 32, size: int = 64, seed: int = 0, with_weights: bool = False
) -> tuple[ModuleOp, WeightStore]:
    rng = np.random.default_rng(seed)
    builder = mlir.GraphBuilder([tensor_type((n, 3, size, size))])
    x = builder.add(InputOp.make([builder.args[0]], name="input")).results[0]
    weights = WeightStore()
    count = 0
    c, h = 3, size

    def weight(name: str, shape: tuple[int, ...]) -> SSAValue:
        if with_weights:
            weights.add(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))
        return builder.weight(name, tensor_type(shape))

    def conv(v, oc: int, stride: int = 1, relu: bool = False):
        nonlocal count, c, h
        name = f"conv{count}"
        w = weight(f"{name}.w", (oc, c, 3, 3))
        b = weight(f"{name}.b", (oc,))
        p = tpu.ConvOp.PARAMS(
            kernel_shape=(3, 3), strides=(stride, stride), pads=(1, 1, 1, 1), dilations=(1, 1), do_relu=relu
        )
        count += 1
        c, h = oc, (h - 1) // stride + 1
        return builder.add(tpu.ConvOp.make([v, w, b], p, name=name)).results[0]

    def unary(op_cls, v, params=None):
        nonlocal count
        count += 1
        return builder.add(op_cls.make([v], params, name=f"{op_cls.name.split('.')[1].lower()}{count}")).results[0]

    x = conv(x, channels, relu=True)
    block = 0
    while count < ops - 4:
        if block % 4 == 3 and h >= 8 and count + 2 < ops - 4:
            x = conv(x, min(c * 2, 256), stride=2, relu=True)
            x = unary(tpu.MaxPoolOp, x, tpu.MaxPoolOp.PARAMS(kernel_shape=(3, 3), strides=(1, 1), pads=(1, 1, 1, 1)))
        skip = x
        y = conv(x, c, relu=True)
        y = conv(y, c)
        count += 1
        y = builder.add(tpu.AddOp.make([skip, y], tpu.AddOp.PARAMS(do_relu=True), name=f"add{count}")).results[0]
        x = y
        block += 1
    while count < ops:
        x = unary(tpu.ReluOp, x)
    module = builder.finish([x], name=f"synthetic{ops}", weight_file="synthetic_weights.npz", state="TPU_LOWERED")
    mlir.set_module_attrs(module, chip="bm1684x", mode="F32", asymmetric=False)
    return module, weights
