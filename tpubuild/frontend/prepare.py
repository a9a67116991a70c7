"""Model preparation before conversion: give weightless architecture files real weights.

The onnx wheel's ``light`` models are real architectures whose weights are
``ConstantOfShape`` fills (every weight 0.02). A network of constant weights
says little about a compiler: every channel is the same. ``fill_weights``
replaces each such fill with deterministic random values shaped by the
weight's use (He-scaled filters, batch-norm statistics near their usual
ranges), seeded by the tensor's name so the same model always gets the same
weights.

Steps are registered by name: a manifest's ``source.prepare`` lists them, and
the fetch stage applies them in order to the fetched model before it becomes
build/<model>/source.onnx. configs/schema/manifest.schema.json enumerates the
same names (tests/test_prepare.py keeps the two in step), and docs/manifest.md
describes each.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from tpubuild.errors import TpuBuildError

PrepareStep = Callable[[onnx.ModelProto], onnx.ModelProto]
PREPARE_STEPS: dict[str, PrepareStep] = {}


def prepare_step(name: str) -> Callable[[PrepareStep], PrepareStep]:
    """Register a model -> model function under ``name`` for manifests' ``source.prepare``."""
    def register(func: PrepareStep) -> PrepareStep:
        if name in PREPARE_STEPS:
            raise ValueError(f"prepare step {name!r} is registered twice")
        PREPARE_STEPS[name] = func
        return func
    return register


def prepare_model(model: onnx.ModelProto, steps: Sequence[str]) -> onnx.ModelProto:
    """``model`` after each named step in order."""
    unknown = [s for s in steps if s not in PREPARE_STEPS]
    if unknown:
        raise TpuBuildError(f"unknown prepare step(s) {unknown}; known: {sorted(PREPARE_STEPS)}",
                            hint="see `source.prepare` in docs/manifest.md")
    for step in steps:
        model = PREPARE_STEPS[step](model)
    return model


def _consumers(graph: onnx.GraphProto) -> dict[str, list[tuple[str, int]]]:
    uses: dict[str, list[tuple[str, int]]] = {}
    for node in graph.node:
        for i, name in enumerate(node.input):
            uses.setdefault(name, []).append((node.op_type, i))
    return uses


def _weights_for(name: str, shape: tuple[int, ...], uses: list[tuple[str, int]]) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    op, slot = uses[0] if uses else ("", 0)
    if op in ("Conv", "ConvTranspose", "Gemm", "MatMul") and slot == 1 and len(shape) >= 2:
        fan_in = math.prod(shape[1:]) if op != "Gemm" else max(shape)
        return rng.standard_normal(shape) * math.sqrt(2.0 / max(fan_in, 1))
    if op == "BatchNormalization":
        ranges = {1: (0.5, 1.5), 2: (-0.1, 0.1), 3: (-0.1, 0.1), 4: (0.5, 1.5)}  # scale, bias, mean, var
        lo, hi = ranges.get(slot, (-0.1, 0.1))
        return rng.uniform(lo, hi, shape)
    if op in ("Mul", "PRelu", "InstanceNormalization") and slot >= 1:
        return rng.uniform(0.5, 1.5, shape)
    return rng.uniform(-0.1, 0.1, shape)


@prepare_step("fill_weights")
def fill_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose constant-fill weights are deterministic random initializers."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    inits = {t.name: t for t in graph.initializer}
    uses = _consumers(graph)
    keep = []
    replaced: dict[str, onnx.TensorProto] = {}
    for node in graph.node:
        shape_name = node.input[0] if node.input else ""
        if node.op_type == "ConstantOfShape" and shape_name in inits:
            shape = tuple(int(d) for d in numpy_helper.to_array(inits[shape_name]))
            value = node.attribute[0].t if node.attribute else None
            dtype = numpy_helper.to_array(value).dtype if value is not None else np.float32
            if np.issubdtype(dtype, np.floating):
                out_name = node.output[0]
                array = _weights_for(out_name, shape, uses.get(out_name, [])).astype(dtype)
                replaced[out_name] = numpy_helper.from_array(array, out_name)
                continue
        keep.append(node)
    del graph.node[:]
    graph.node.extend(keep)
    used = {i for n in graph.node for i in n.input}
    kept_inits = [t for t in graph.initializer if t.name in used or t.name in replaced]
    del graph.initializer[:]
    graph.initializer.extend(kept_inits + [replaced[k] for k in sorted(replaced)])
    # old exporters also list weights as graph inputs; a filled weight is no longer an input
    inputs = [i for i in graph.input if i.name not in replaced and (i.name not in inits or i.name in used)]
    if out.ir_version < 4:
        # before IR 4 every initializer must also be a graph input (onnx.checker enforces it)
        inputs += [onnx.helper.make_tensor_value_info(k, replaced[k].data_type, replaced[k].dims)
                   for k in sorted(replaced)]
    del graph.input[:]
    graph.input.extend(inputs)
    return out
