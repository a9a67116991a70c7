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
from tpubuild.registry import Registry

PrepareStep = Callable[[onnx.ModelProto], onnx.ModelProto]
PREPARE_STEPS = Registry("a prepare step")


def prepare_step(name: str) -> Callable[[PrepareStep], PrepareStep]:
    """Register a model -> model function under ``name`` for manifests' ``source.prepare``."""
    return PREPARE_STEPS.register(name)


def prepare_model(model: onnx.ModelProto, steps: Sequence[str]) -> onnx.ModelProto:
    """``model`` after each named step in order."""
    unknown = [s for s in steps if s not in PREPARE_STEPS]
    if unknown:
        raise TpuBuildError(f"unknown prepare step(s) {unknown}; known: {sorted(PREPARE_STEPS)}",
                            hint="see `source.prepare` in docs/manifest.md")
    for step in steps:
        model = PREPARE_STEPS[step](model)
    return model


# ops that only reshape a weight: its role is decided by the op after them
_SHAPE_ONLY = ("Unsqueeze", "Squeeze", "Reshape", "Flatten", "Identity", "Cast")


def _consumers(graph: onnx.GraphProto) -> dict[str, list[tuple[str, int]]]:
    """Each tensor's uses as (op type, input slot), seen through shape-only ops on their data input.

    Caffe2 exports (DenseNet-121, Inception-v2) give a BatchNorm's Scale layer its gamma and beta
    through Unsqueeze: taken at face value they were "Unsqueeze" inputs and got the fallback
    uniform(-0.1, 0.1), a gamma of either sign around 0 that shrinks channels by 10 to 1000 and
    flips half of them, unlike any trained Scale layer. Seen as the Mul's scale, gamma comes from
    (0.5, 1.5) like any Mul scale; beta, the Add's, stays in (-0.1, 0.1). Inception-v1's
    classifier weight (through Reshape) gets its Gemm's He scale.
    """
    direct: dict[str, list[tuple[str, int, onnx.NodeProto]]] = {}
    for node in graph.node:
        for i, name in enumerate(node.input):
            direct.setdefault(name, []).append((node.op_type, i, node))

    def resolve(name: str, depth: int = 0) -> list[tuple[str, int]]:
        found = []
        for op, slot, node in direct.get(name, []):
            if op in _SHAPE_ONLY and slot == 0 and depth < 8:
                found += resolve(node.output[0], depth + 1) or [(op, slot)]
            else:
                found.append((op, slot))
        return found

    return {name: resolve(name) for name in direct}


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


# normalize_activations: what it rescales, and the input slots of the parameters involved
_SCALED = {"Conv": (1, 2), "ConvTranspose": (1, 2), "Gemm": (1, 2)}  # weight, bias: output scales with them
_STATS = {"BatchNormalization": (3, 4)}  # running mean, running variance
_SIGNIFICANT_DIGITS = 3


def _round_significant(a: np.ndarray) -> np.ndarray:
    """``a`` rounded to 3 significant digits: last-bit differences between CPUs' kernels rarely survive it."""
    a = np.asarray(a, np.float64)
    exponent = np.floor(np.log10(np.where(a == 0, 1.0, np.abs(a)))) - (_SIGNIFICANT_DIGITS - 1)
    return np.round(a / 10.0 ** exponent) * 10.0 ** exponent


def _probe_input(value: onnx.ValueInfoProto) -> np.ndarray:
    tensor = value.type.tensor_type
    dims = [d.dim_value for d in tensor.shape.dim]
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
    if not dims or min(dims) <= 0 or not np.issubdtype(dtype, np.floating):
        raise TpuBuildError(f"normalize_activations needs float graph inputs of static shape; input "
                            f"{value.name!r} is {onnx.helper.printable_type(value.type)}",
                            hint="drop the step from `source.prepare`, or fix the input's shape in the model")
    rng = np.random.default_rng(zlib.crc32(f"normalize_activations\0{value.name}".encode()))
    return rng.uniform(-1.0, 1.0, dims).astype(dtype)


@prepare_step("normalize_activations")
def normalize_activations(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` rescaled layer by layer so that activations keep a unit scale.

    Random weights next to the trained batch-norm statistics and scale layers a
    weightless file keeps make activations explode or vanish with depth (ResNet-50's
    logits reach 1e5, a one-hot softmax). In graph order, on a fixed random input
    (uniform in [-1, 1), seeded from each input's name): each Conv, ConvTranspose and
    Gemm has its weight and bias divided by its output's standard deviation, and each
    BatchNormalization gets its input's per-channel mean and variance as running
    statistics (LSUV-style data-dependent initialisation). Factors and statistics are
    rounded to 3 significant digits. Parameters shared by several nodes are left alone.
    """
    import onnxruntime as ort

    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    inits = {t.name: t for t in graph.initializer}
    uses: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1

    def params(node: onnx.NodeProto, slots: tuple[int, ...]) -> list[str]:
        names = [node.input[i] for i in slots if i < len(node.input) and node.input[i]]
        return names if all(n in inits and uses[n] == 1 for n in names) else []

    steps = [(node, names) for node in graph.node
             for names in [params(node, _SCALED.get(node.op_type) or _STATS.get(node.op_type) or ())] if names]
    if not steps:
        return out
    values = {n: numpy_helper.to_array(inits[n]).astype(np.float64) for _, names in steps for n in names}

    # the parameters become graph inputs of a working copy, so one session serves every step
    work = onnx.ModelProto()
    work.CopyFrom(out)
    kept = [t for t in work.graph.initializer if t.name not in values]
    del work.graph.initializer[:]
    work.graph.initializer.extend(kept)
    data = [v for v in work.graph.input if v.name not in inits]
    del work.graph.input[:]
    work.graph.input.extend(data)
    work.graph.input.extend(onnx.helper.make_tensor_value_info(n, inits[n].data_type, inits[n].dims) for n in values)
    probes = {node.output[0] if node.op_type in _SCALED else node.input[0] for node, _ in steps}
    work.graph.output.extend(onnx.ValueInfoProto(name=n) for n in sorted(probes))
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    session = ort.InferenceSession(work.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    feeds = {v.name: _probe_input(v) for v in data}

    def probe(name: str) -> np.ndarray:
        current = {n: v.astype(np.float32) for n, v in values.items()}
        return session.run([name], {**feeds, **current})[0].astype(np.float64)

    for node, names in steps:
        if node.op_type in _SCALED:
            std = float(probe(node.output[0]).std())
            if std > 0 and math.isfinite(std):
                factor = _round_significant(np.array(1.0 / std))
                for n in names:
                    values[n] = values[n] * factor
        else:
            x = probe(node.input[0])
            axes = tuple(i for i in range(x.ndim) if i != 1)
            values[names[0]] = _round_significant(x.mean(axis=axes))
            values[names[1]] = _round_significant(x.var(axis=axes))
    for name, value in values.items():
        dtype = onnx.helper.tensor_dtype_to_np_dtype(inits[name].data_type)
        inits[name].CopyFrom(numpy_helper.from_array(value.astype(dtype), name))
    return out
