"""Model preparation before conversion: give weightless architecture files real weights.

The onnx wheel's ``light`` models are real architectures whose weights are
``ConstantOfShape`` fills (every weight 0.02). A network of constant weights
says little about a compiler: every channel is the same. ``fill_weights``
replaces each such fill with deterministic random values shaped by the
weight's use (He-scaled filters, batch-norm statistics near their usual
ranges), seeded by the tensor's name so the same model always gets the same
weights. ``normalize_activations`` then conditions them as training would:
on the manifest's first calibration samples, every channel at unit scale and
batch-norm statistics fitted to the data, so that INT8 and BF16 targets see
the ranges of a trained network rather than those of random filters.

Steps are registered by name: a manifest's ``source.prepare`` lists them, and
the fetch stage applies them in order to the fetched model before it becomes
build/<model>/source.onnx. configs/schema/manifest.schema.json enumerates the
same names (tests/test_prepare.py keeps the two in step), and docs/manifest.md
describes each.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from tpubuild.errors import TpuBuildError
from tpubuild.registry import Registry

# a step takes the model and the samples it may look at (the manifest's first calibration samples, or none)
PrepareStep = Callable[[onnx.ModelProto, Sequence[Mapping[str, np.ndarray]]], onnx.ModelProto]
PREPARE_STEPS = Registry("a prepare step")


def prepare_step(name: str) -> Callable[[PrepareStep], PrepareStep]:
    """Register a model -> model function under ``name`` for manifests' ``source.prepare``."""
    return PREPARE_STEPS.register(name)


def prepare_model(
    model: onnx.ModelProto, steps: Sequence[str], samples: Sequence[Mapping[str, np.ndarray]] = ()
) -> onnx.ModelProto:
    """``model`` after each named step in order; ``samples`` ({input name: array}) are data the steps may run."""
    unknown = [s for s in steps if s not in PREPARE_STEPS]
    if unknown:
        raise TpuBuildError(
            f"unknown prepare step(s) {unknown}; known: {sorted(PREPARE_STEPS)}",
            hint="see `source.prepare` in docs/manifest.md",
        )
    for step in steps:
        model = PREPARE_STEPS[step](model, samples)
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


def _weights_for(name: str, shape: tuple[int, ...], uses: list[tuple[str, int]], flat_blind: bool) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    op, slot = uses[0] if uses else ("", 0)
    if op in ("Conv", "ConvTranspose", "Gemm", "MatMul") and slot == 1 and len(shape) >= 2:
        fan_in = math.prod(shape[1:]) if op != "Gemm" else max(shape)
        w = rng.standard_normal(shape) * math.sqrt(2.0 / max(fan_in, 1))
        if flat_blind and len(shape) > 2 and math.prod(shape[2:]) > 1:
            w -= w.mean(axis=tuple(range(2, len(shape))), keepdims=True)
        return w
    if op == "BatchNormalization":
        ranges = {1: (0.5, 1.5), 2: (-0.1, 0.1), 3: (-0.1, 0.1), 4: (0.5, 1.5)}  # scale, bias, mean, var
        lo, hi = ranges.get(slot, (-0.1, 0.1))
        return rng.uniform(lo, hi, shape)
    if op in ("Mul", "PRelu", "InstanceNormalization") and slot >= 1:
        return rng.uniform(0.5, 1.5, shape)
    return rng.uniform(-0.1, 0.1, shape)


@prepare_step("fill_weights")
def fill_weights(model: onnx.ModelProto, samples: Sequence[Mapping[str, np.ndarray]] = ()) -> onnx.ModelProto:
    """A copy of ``model`` whose constant-fill weights are deterministic random initializers.

    The spatial filters of a Conv without bias (one a batch norm follows) sum to 0 over each kernel,
    as a trained network's edge and texture filters do: with a DC part, each channel mostly measures
    brightness, its batch-norm statistics over many photos are those of brightness differences, and
    on any one photo the channels hardly vary, so INT8 rounding swamps what they carry. A Conv with a
    bias keeps random filters (without a batch norm, their sparse edge responses lose more to INT8).
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    inits = {t.name: t for t in graph.initializer}
    uses = _consumers(graph)
    unbiased = {
        n.input[1]
        for n in graph.node
        if n.op_type == "Conv" and len(n.input) > 1 and (len(n.input) < 3 or not n.input[2])
    }
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
                array = _weights_for(out_name, shape, uses.get(out_name, []), out_name in unbiased).astype(dtype)
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
        inputs += [
            onnx.helper.make_tensor_value_info(k, replaced[k].data_type, replaced[k].dims) for k in sorted(replaced)
        ]
    del graph.input[:]
    graph.input.extend(inputs)
    return out


# normalize_activations: the parameters it rewrites, by input slot
_SCALED = {"Conv": (1, 2), "ConvTranspose": (1, 2), "Gemm": (1, 2)}  # weight, bias: output scales with them
_STATS = {"BatchNormalization": (3, 4)}  # running mean, running variance
_SIGNIFICANT_DIGITS = 3
# a channel's own factor needs this many values to estimate its spread from (else the tensor's factor)
_MIN_POSITIONS = 64
# a channel's factor stays within this ratio of its tensor's: an almost constant channel is not blown up
_CHANNEL_SPREAD = 10.0
# a batch norm's running variance is at least this fraction of its channels' median: a channel that is
# (almost) constant on the data would otherwise get a gain of 1/sqrt(eps), ~300
_VAR_FLOOR = 0.01


def _round_significant(a: np.ndarray) -> np.ndarray:
    """``a`` rounded to 3 significant digits: last-bit differences between CPUs' kernels rarely survive it."""
    a = np.asarray(a, np.float64)
    exponent = np.floor(np.log10(np.where(a == 0, 1.0, np.abs(a)))) - (_SIGNIFICANT_DIGITS - 1)
    return np.round(a / 10.0**exponent) * 10.0**exponent


def _probe_input(value: onnx.ValueInfoProto) -> np.ndarray:
    tensor = value.type.tensor_type
    dims = [d.dim_value for d in tensor.shape.dim]
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
    if not dims or min(dims) <= 0 or not np.issubdtype(dtype, np.floating):
        raise TpuBuildError(
            f"normalize_activations needs float graph inputs of static shape; input "
            f"{value.name!r} is {onnx.helper.printable_type(value.type)}",
            hint="drop the step from `source.prepare`, or fix the input's shape in the model",
        )
    rng = np.random.default_rng(zlib.crc32(f"normalize_activations\0{value.name}".encode()))
    return rng.uniform(-1.0, 1.0, dims).astype(dtype)


class _Stepper:
    """Runs a graph one node at a time on a few samples (onnxruntime, one single-node session per node),
    so a node's parameters can be refitted from its actual input before the nodes after it run."""

    def __init__(self, model: onnx.ModelProto):
        import onnxruntime as ort

        self.ort = ort
        self.opsets = list(model.opset_import)
        self.options = ort.SessionOptions()
        self.options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        self.options.intra_op_num_threads = 1
        self.options.log_severity_level = 3
        # the node's session for the last input types and shapes: every sample of a node reuses it (parameters
        # are fed as inputs, so refitting them does not change the session)
        self._last: tuple[onnx.NodeProto, tuple, Any] | None = None  # (node, signature, onnxruntime session)

    def run(self, node: onnx.NodeProto, args: list[np.ndarray | None]) -> list[np.ndarray]:
        feeds = {name: a for name, a in zip(node.input, args, strict=True) if name and a is not None}
        signature = tuple((name, a.dtype.str, a.shape) for name, a in feeds.items())
        session: Any
        if self._last is not None and self._last[0] is node and self._last[1] == signature:
            session = self._last[2]
        else:
            inputs = [
                onnx.helper.make_tensor_value_info(name, onnx.helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
                for name, a in feeds.items()
            ]
            graph = onnx.helper.make_graph(
                [node], "step", inputs, [onnx.ValueInfoProto(name=o) for o in node.output if o]
            )
            model = onnx.helper.make_model(graph, opset_imports=self.opsets)
            session = self.ort.InferenceSession(
                model.SerializeToString(), self.options, providers=["CPUExecutionProvider"]
            )
            self._last = (node, signature, session)
        return session.run([o for o in node.output if o], feeds)


def _per_channel(y: list[np.ndarray]) -> np.ndarray:
    """Samples of one tensor as [channel (axis 1), every value of that channel], in float64."""
    return np.concatenate([np.moveaxis(np.asarray(a, np.float64), 1, 0).reshape(a.shape[1], -1) for a in y], axis=1)


def _channel_factors(flat: np.ndarray, per_channel: bool) -> np.ndarray | None:
    """1/std of each channel of ``flat``, bounded around the tensor's 1/std, or the tensor's alone;
    None if the tensor has no spread."""
    whole = float(flat.std())
    if not (whole > 0 and math.isfinite(whole)):
        return None
    if not per_channel or flat.shape[1] < _MIN_POSITIONS:
        return np.array(1.0 / whole)
    return 1.0 / np.clip(flat.std(axis=1), whole / _CHANNEL_SPREAD, whole * _CHANNEL_SPREAD)


def _output_axis(node: onnx.NodeProto, weight: np.ndarray, bias: np.ndarray | None) -> int | None:
    """The weight axis of ``node``'s output channels when each can take its own factor, else None."""
    if node.op_type == "Conv":
        return 0
    if node.op_type == "Gemm":
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        if bias is None or bias.ndim == 1 or (bias.ndim == 2 and bias.shape[0] == 1):
            return 0 if trans_b else 1
    return None  # ConvTranspose (grouped layouts), a Gemm bias per row: one factor for the tensor


def _broadcast(factor: np.ndarray, ndim: int, axis: int) -> np.ndarray:
    shape = [1] * ndim
    shape[axis] = -1
    return factor.reshape(shape) if factor.ndim else factor


def _rescale(
    node: onnx.NodeProto,
    names: list[str],
    consts: dict[str, np.ndarray],
    changed: dict[str, np.ndarray],
    results: list[list[np.ndarray]],
) -> list[list[np.ndarray]]:
    """Divide a Conv/Gemm's weight and bias by its output channels' std; its results after that."""
    weight = consts[names[0]]
    bias = consts[names[1]] if len(names) > 1 else None
    axis = _output_axis(node, weight, bias)
    y = [r[0] for r in results]
    flat = _per_channel(y) if y[0].ndim >= 2 else np.concatenate([np.reshape(a, (1, -1)) for a in y], axis=1)
    factor = _channel_factors(flat, axis is not None)
    if factor is None:
        return results
    factor = _round_significant(factor)
    consts[names[0]] = changed[names[0]] = (weight * _broadcast(factor, weight.ndim, axis or 0)).astype(weight.dtype)
    if bias is not None:
        consts[names[1]] = changed[names[1]] = (bias * _broadcast(factor, bias.ndim, bias.ndim - 1)).astype(bias.dtype)
    scale = _broadcast(factor, y[0].ndim, 1)
    return [[(r[0] * scale).astype(r[0].dtype), *r[1:]] for r in results]


@prepare_step("normalize_activations")
def normalize_activations(model: onnx.ModelProto, samples: Sequence[Mapping[str, np.ndarray]] = ()) -> onnx.ModelProto:
    """A copy of ``model`` rescaled layer by layer so that every channel keeps a unit scale on real data.

    LSUV-style data-dependent initialisation, in one pass over the graph in topological
    order on ``samples`` (the manifest's first calibration samples; without any, one fixed
    random input, uniform in [-1, 1) and seeded from each input's name): each Conv and
    Gemm has each output channel's weights and bias divided by that channel's standard
    deviation (within 10x of the tensor's, so an almost constant channel is not blown
    up; one factor per tensor for ConvTranspose and where too few values are seen), and
    each BatchNormalization gets its input's per-channel mean and variance as running
    statistics (a variance at least 1% of the channels' median). Factors and statistics
    are rounded to 3 significant digits. Parameters shared by several nodes are left alone
    (a bias of zeros, shared or not, stays zeros while its node is rescaled).
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    inits = {t.name: t for t in graph.initializer}
    uses = _use_counts(graph)
    steps = _owned_params(graph, inits, uses)
    if not steps:
        return out
    values = _sample_values(graph, inits, samples)
    consts = {n: numpy_helper.to_array(t) for n, t in inits.items()}
    changed: dict[str, np.ndarray] = {}
    stepper = _Stepper(out)

    def args(sample: dict[str, np.ndarray], node: onnx.NodeProto) -> list[np.ndarray | None]:
        return [sample.get(n, consts.get(n)) if n else None for n in node.input]

    for i, node in enumerate(graph.node):
        names = steps.get(i, [])
        if names and node.op_type in _STATS:
            _set_statistics(names, [s[node.input[0]] for s in values], consts, changed)
        constant = all(not n or n in consts for n in node.input)
        results = (
            [stepper.run(node, args({}, node))] if constant else [stepper.run(node, args(s, node)) for s in values]
        )
        if names and node.op_type in _SCALED:
            results = _rescale(node, names, consts, changed, results)
        for sample, result in zip([consts] if constant else values, results, strict=True):
            for name, value in zip([o for o in node.output if o], result, strict=True):
                sample[name] = value
        _free_unread(node, uses, inits, values)
    for name, value in changed.items():
        inits[name].CopyFrom(numpy_helper.from_array(value, name))
    return out


def _use_counts(graph: onnx.GraphProto) -> dict[str, int]:
    """How many times each tensor is read: by a node's input, or as a graph output."""
    uses: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    for value in graph.output:
        uses[value.name] = uses.get(value.name, 0) + 1
    return uses


def _owned_params(
    graph: onnx.GraphProto, inits: Mapping[str, onnx.TensorProto], uses: Mapping[str, int]
) -> dict[int, list[str]]:
    """Node index -> the parameters normalize_activations may change: initializers only that node reads.

    A Conv's or Gemm's bias of zeros is not among them, wherever it comes from: scaled, it stays zeros. The
    TorchScript exporter gives the convs of a batch norm folded with fresh statistics one shared zero bias,
    read through Identity nodes; requiring the bias to be owned skipped every such conv (a random-weight
    EfficientNet's activations then fell to 1e-11 and back)."""
    aliases = {node.output[0]: node.input[0] for node in graph.node if node.op_type == "Identity" and node.input}

    def zeros(name: str) -> bool:
        while name in aliases and name not in inits:
            name = aliases[name]
        return name in inits and not np.any(numpy_helper.to_array(inits[name]))

    def params(node: onnx.NodeProto) -> list[str]:
        slots = _SCALED.get(node.op_type) or _STATS.get(node.op_type) or ()
        names = [node.input[i] for i in slots if i < len(node.input) and node.input[i]]
        if node.op_type in _SCALED and len(names) == 2 and zeros(names[1]):
            names = names[:1]
        return names if all(n in inits and uses[n] == 1 for n in names) else []

    return {i: names for i, node in enumerate(graph.node) for names in [params(node)] if names}


def _sample_values(
    graph: onnx.GraphProto, inits: Mapping[str, onnx.TensorProto], samples: Sequence[Mapping[str, np.ndarray]]
) -> list[dict[str, np.ndarray]]:
    """The graph inputs' values per sample (one probe input without samples); an input without data raises."""
    data = [v for v in graph.input if v.name not in inits]
    feeds = [dict(s) for s in samples] or [{v.name: _probe_input(v) for v in data}]
    missing = [v.name for v in data if v.name not in feeds[0]]
    if missing:
        raise TpuBuildError(
            f"normalize_activations has no data for graph input(s) {missing}",
            hint="key the calibration data by the model's input names",
        )
    return [{k: np.asarray(v) for k, v in f.items()} for f in feeds]


def _set_statistics(
    names: Sequence[str], inputs: list[np.ndarray], consts: dict[str, np.ndarray], changed: dict[str, np.ndarray]
) -> None:
    """A BatchNormalization's running mean and variance (``names``) from its input's per-channel statistics."""
    flat = _per_channel(inputs)
    var = flat.var(axis=1)
    for name, stat in zip(names, (flat.mean(axis=1), np.maximum(var, _VAR_FLOOR * np.median(var))), strict=True):
        consts[name] = changed[name] = _round_significant(stat).astype(consts[name].dtype)


def _free_unread(
    node: onnx.NodeProto, uses: dict[str, int], inits: Mapping[str, onnx.TensorProto], values: list[dict]
) -> None:
    """Counts ``node``'s reads off ``uses`` and drops from ``values`` what no later node reads."""
    for name in node.input:
        uses[name] -= 1
        if uses[name] == 0 and name not in inits:
            for sample in values:
                sample.pop(name, None)
