"""Generate the small ONNX models that ship with the repo, deterministically.

    python models/make_models.py [OUT_DIR]

demo_cnn.onnx: a ResNet-style CNN (Conv+BN+ReLU, residual Add, MaxPool, Clip,
GlobalAveragePool, a shape subgraph feeding Reshape, Dropout, Gemm, Softmax).
tiny_transformer.onnx: one pre-LN encoder block (LayerNorm, multi-head
attention through MatMul/Reshape/Transpose/Softmax, ReLU MLP, residual Adds).
Same script, same bytes: a test regenerates both and compares.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


class Graph:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def init(self, name: str, array: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def rand(self, name: str, shape, scale: float) -> str:
        return self.init(name, (self.rng.standard_normal(shape) * scale).astype(np.float32))

    def node(self, op: str, inputs, output: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op, list(inputs), [output], name=output, **attrs))
        return output

    def model(self, name: str, inputs, outputs) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="tpubuild-models", producer_version="1")
        onnx.checker.check_model(model, full_check=True)
        return model


def conv_bn_relu(g: Graph, x: str, cin: int, cout: int, name: str, stride: int = 1, relu: bool = True) -> str:
    w = g.rand(f"{name}.weight", (cout, cin, 3, 3), np.sqrt(2.0 / (cin * 9)))
    y = g.node("Conv", [x, w], f"{name}.conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[stride, stride])
    bn = [g.init(f"{name}.bn.{k}", g.rng.uniform(lo, hi, cout).astype(np.float32))
          for k, lo, hi in (("scale", 0.5, 1.5), ("bias", -0.2, 0.2), ("mean", -0.2, 0.2), ("var", 0.5, 1.5))]
    y = g.node("BatchNormalization", [y, *bn], f"{name}.bn", epsilon=1e-5)
    return g.node("Relu", [y], f"{name}.relu") if relu else y


def demo_cnn() -> onnx.ModelProto:
    g = Graph(seed=2024)
    x = conv_bn_relu(g, "input", 3, 16, "stem")
    x = g.node("MaxPool", [x], "stem.pool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    y = conv_bn_relu(g, x, 16, 16, "block1.a")
    y = conv_bn_relu(g, y, 16, 16, "block1.b", relu=False)
    x = g.node("Add", [x, y], "block1.add")
    x = g.node("Relu", [x], "block1.relu")
    x = conv_bn_relu(g, x, 16, 32, "block2.a", stride=2)
    x = g.node("Clip", [x, g.init("clip.min", np.float32(0)), g.init("clip.max", np.float32(6))], "block2.relu6")
    x = g.node("AveragePool", [x], "block2.pool", kernel_shape=[2, 2], strides=[2, 2])
    x = g.node("GlobalAveragePool", [x], "gap")
    # a shape-only subgraph, as exporters write it: Reshape(x, [dim0, -1])
    s = g.node("Shape", [x], "head.shape")
    n = g.node("Gather", [s, g.init("head.zero", np.array(0, np.int64))], "head.batch", axis=0)
    n = g.node("Unsqueeze", [n, g.init("head.axes", np.array([0], np.int64))], "head.batch1")
    target = g.node("Concat", [n, g.init("head.minus1", np.array([-1], np.int64))], "head.target", axis=0)
    x = g.node("Reshape", [x, target], "head.flat")
    x = g.node("Dropout", [x], "head.dropout")
    w = g.rand("fc.weight", (10, 32), np.sqrt(1.0 / 32))
    b = g.rand("fc.bias", (10,), 0.1)
    x = g.node("Gemm", [x, w, b], "logits", transB=1)
    x = g.node("Softmax", [x], "probs", axis=-1)
    return g.model("demo_cnn", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 32, 32])],
                   [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["N", 10])])


def tiny_transformer(seq: int = 16, dim: int = 64, heads: int = 4, ffn: int = 128) -> onnx.ModelProto:
    g = Graph(seed=7)
    hd = dim // heads

    def linear(x: str, din: int, dout: int, name: str) -> str:
        w = g.rand(f"{name}.weight", (din, dout), np.sqrt(1.0 / din))
        b = g.rand(f"{name}.bias", (dout,), 0.02)
        return g.node("Add", [g.node("MatMul", [x, w], f"{name}.matmul"), b], f"{name}.out")

    def layernorm(x: str, name: str) -> str:
        scale = g.init(f"{name}.scale", g.rng.uniform(0.8, 1.2, dim).astype(np.float32))
        bias = g.init(f"{name}.bias", g.rng.uniform(-0.1, 0.1, dim).astype(np.float32))
        return g.node("LayerNormalization", [x, scale, bias], f"{name}.out", axis=-1, epsilon=1e-5)

    def heads_first(x: str, name: str) -> str:
        x = g.node("Reshape", [x, g.init(f"{name}.shape", np.array([1, seq, heads, hd], np.int64))], f"{name}.split")
        return g.node("Transpose", [x], f"{name}.heads", perm=[0, 2, 1, 3])

    h = layernorm("tokens", "ln1")
    q = heads_first(linear(h, dim, dim, "attn.q"), "q")
    k = heads_first(linear(h, dim, dim, "attn.k"), "k")
    v = heads_first(linear(h, dim, dim, "attn.v"), "v")
    kt = g.node("Transpose", [k], "k.t", perm=[0, 1, 3, 2])
    s = g.node("MatMul", [q, kt], "attn.scores")
    s = g.node("Div", [s, g.init("attn.sqrt_d", np.array(np.sqrt(hd), np.float32))], "attn.scaled")
    p = g.node("Softmax", [s], "attn.probs", axis=-1)
    o = g.node("MatMul", [p, v], "attn.context")
    o = g.node("Transpose", [o], "attn.merge", perm=[0, 2, 1, 3])
    o = g.node("Reshape", [o, g.init("attn.merged_shape", np.array([1, seq, dim], np.int64))], "attn.merged")
    x = g.node("Add", ["tokens", linear(o, dim, dim, "attn.proj")], "res1")
    h = layernorm(x, "ln2")
    h = g.node("Relu", [linear(h, dim, ffn, "mlp.fc1")], "mlp.act")
    x = g.node("Add", [x, linear(h, ffn, dim, "mlp.fc2")], "encoded")
    return g.model("tiny_transformer",
                   [helper.make_tensor_value_info("tokens", TensorProto.FLOAT, [1, seq, dim])],
                   [helper.make_tensor_value_info("encoded", TensorProto.FLOAT, [1, seq, dim])])


MODELS = {"demo_cnn": demo_cnn, "tiny_transformer": tiny_transformer}


def main(out_dir: str | None = None) -> None:
    out = Path(out_dir) if out_dir else Path(__file__).parent
    out.mkdir(parents=True, exist_ok=True)
    for name, make in MODELS.items():
        path = out / f"{name}.onnx"
        path.write_bytes(make().SerializeToString())
        print(f"wrote {path}")


if __name__ == "__main__":
    main(*sys.argv[1:])
