"""A tpu.mlir as the backend sees it: compute ops in order and the tensors between them.

Layer group, memory assign and codegen all walk the same view: every compute op
(everything but ``top.Input``/``top.Weight``/``top.None``) with the names of its
operand and result tensors, and every tensor with its shape, dtype, producer,
users and whether it is a weight, a graph input or a graph output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from xdsl.dialects.builtin import ModuleOp, TensorType

from tpubuild.errors import TpuBuildError
from tpubuild.ir import mlir
from tpubuild.ir.base import TensorOp
from tpubuild.ir.top import InputOp, NoneOp, WeightOp
from tpubuild.ir.types import dtype_of, shape_of


@dataclass
class Tensor:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    producer: int | None = None  # index into Graph.ops; None for weights and graph inputs
    users: list[int] = field(default_factory=list)  # op indices, each once, in order
    weight: bool = False
    graph_input: bool = False
    graph_output: bool = False

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclass
class Node:
    """One compute op: its IR op and the tensor names it reads (None: absent operand) and writes."""

    index: int
    op: TensorOp
    inputs: list[str | None]
    outputs: list[str]

    @property
    def name(self) -> str:
        return self.outputs[0]

    def input(self, i: int) -> str:
        """Operand i's tensor, one the op always has; ValueError when it is absent."""
        name = self.inputs[i]
        if name is None:
            raise ValueError(f"{self.kind} {self.name!r}: operand {i} is absent")
        return name

    @property
    def kind(self) -> str:
        return self.op.name


@dataclass
class Graph:
    ops: list[Node]
    tensors: dict[str, Tensor]
    inputs: list[str]
    outputs: list[str]

    def data_inputs(self, node: Node) -> list[str]:
        """The node's activation operands (not weights, not absent), in operand order, repeats kept."""
        return [t for t in node.inputs if t is not None and not self.tensors[t].weight]

    def weights_of(self, node: Node) -> list[str]:
        return [t for t in node.inputs if t is not None and self.tensors[t].weight]


def build_graph(module: ModuleOp) -> Graph:
    tensors: dict[str, Tensor] = {}
    ops: list[Node] = []
    inputs: list[str] = []
    names: dict[object, str | None] = {}
    for op in mlir.body_ops(module):
        if not isinstance(op, TensorOp):
            continue
        if isinstance(op, NoneOp):
            names[op.results[0]] = None
            continue
        if isinstance(op, (InputOp, WeightOp)):
            name = op.loc_name
            names[op.results[0]] = name
            t = op.results[0].type
            tensors[name] = Tensor(
                name, shape_of(t), dtype_of(t), weight=isinstance(op, WeightOp), graph_input=isinstance(op, InputOp)
            )
            if isinstance(op, InputOp):
                inputs.append(name)
            continue
        node = Node(len(ops), op, [names[v] for v in op.operands], list(op.names))
        for value, name in zip(op.results, node.outputs, strict=True):
            names[value] = name
            t = value.type
            if isinstance(t, TensorType):
                tensors[name] = Tensor(name, shape_of(t), dtype_of(t), producer=node.index)
        for name in node.inputs:
            if name is not None and node.index not in tensors[name].users:
                tensors[name].users.append(node.index)
        ops.append(node)
    outputs = []
    for v in mlir.return_op(module).operands:
        name = names[v]
        if name is None:
            raise TpuBuildError("a graph output is an absent value (top.None)")
        tensors[name].graph_output = True
        outputs.append(name)
    return Graph(ops, tensors, inputs, outputs)
