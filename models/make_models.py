"""Generate the small ONNX models that ship with the repo, deterministically.

    python models/make_models.py [OUT_DIR]

demo_cnn.onnx: a ResNet-style CNN (Conv+BN+ReLU, residual Add, MaxPool, Clip,
GlobalAveragePool, a shape subgraph feeding Reshape, Dropout, Gemm, Softmax).
tiny_transformer.onnx: one pre-LN encoder block (LayerNorm, multi-head
attention through MatMul/Reshape/Transpose/Softmax, ReLU MLP, residual Adds).
mini_mobilenet.onnx: MobileNetV2/V3-style (depthwise-separable and inverted
residual blocks, ReLU6 and HardSwish, squeeze-excite with HardSigmoid).
mini_yolo.onnx: YOLOv8-style detector (C2f blocks with SiLU, SPPF, an FPN/PAN
neck with Resize + Concat, a decoupled head with DFL box decoding; its output
concatenates boxes in pixels with sigmoid class scores).
mini_vit.onnx: ViT-style encoder (patch-embedding conv, class token, position
embedding, two pre-LN blocks with GELU, LayerNorm and a linear head).
Weights are seeded random values at scales that keep every activation near unit
size (trained-like batch-norm statistics, fan-in scaled filters), so they say
nothing about accuracy. Same script, same bytes: a test regenerates every model
and compares.
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

    def nodes_out(self, op: str, inputs, outputs: list[str], **attrs) -> list[str]:
        """A node with several outputs (Split)."""
        self.nodes.append(helper.make_node(op, list(inputs), outputs, name=outputs[0], **attrs))
        return outputs

    def const(self, name: str, array) -> str:
        """An initializer shared by every node that names it (created on first use)."""
        if name not in {t.name for t in self.inits}:
            self.init(name, array)
        return name

    def model(self, name: str, inputs, outputs) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.inits)
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="tpubuild-models", producer_version="1"
        )
        onnx.checker.check_model(model, full_check=True)
        return model


def conv_bn_relu(g: Graph, x: str, cin: int, cout: int, name: str, stride: int = 1, relu: bool = True) -> str:
    w = g.rand(f"{name}.weight", (cout, cin, 3, 3), np.sqrt(2.0 / (cin * 9)))
    y = g.node("Conv", [x, w], f"{name}.conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[stride, stride])
    bn = [
        g.init(f"{name}.bn.{k}", g.rng.uniform(lo, hi, cout).astype(np.float32))
        for k, lo, hi in (("scale", 0.5, 1.5), ("bias", -0.2, 0.2), ("mean", -0.2, 0.2), ("var", 0.5, 1.5))
    ]
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
    return g.model(
        "demo_cnn",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 32, 32])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["N", 10])],
    )


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
    return g.model(
        "tiny_transformer",
        [helper.make_tensor_value_info("tokens", TensorProto.FLOAT, [1, seq, dim])],
        [helper.make_tensor_value_info("encoded", TensorProto.FLOAT, [1, seq, dim])],
    )


PHOTOS = Path(__file__).resolve().parent / "calib" / "photos"
# one crop of each of the ten photographs: statistics over every kind of image the zoo is fed
PROBE_PHOTOS = (
    "astronaut_0",
    "brick_0",
    "camera_0",
    "chelsea_0",
    "coffee_0",
    "coins_0",
    "gravel_0",
    "hubble_deep_field_0",
    "retina_0",
    "rocket_0",
)
IMAGENET = {"mean": [123.675, 116.28, 103.53], "scale": [0.0171, 0.0175, 0.0174], "pixel_format": "rgb"}


def _significant(a: np.ndarray, digits: int = 3) -> np.ndarray:
    """Rounded to 3 significant digits: last-bit differences between CPUs' kernels rarely survive it."""
    a = np.asarray(a, np.float64)
    exponent = np.floor(np.log10(np.where(a == 0, 1.0, np.abs(a)))) - (digits - 1)
    return np.round(a / 10.0**exponent) * 10.0**exponent


def fit_batchnorm(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every BatchNormalization's running statistics set to those of its input on a few shipped photos.

    In graph order, so each layer sees the statistics its predecessors produce: the
    batch-norm outputs then have the scale a trained network's have (random filters
    next to made-up statistics make activations shrink or grow with depth). One crop
    of each photograph in models/calib/photos, preprocessed with the ImageNet mean
    and scale the manifests use; statistics rounded to 3 significant digits.
    """
    import onnxruntime as ort

    from tpubuild.calib.data import InputSpec, preprocess_image

    graph_input = model.graph.input[0]
    dims = [d.dim_value or 1 for d in graph_input.type.tensor_type.shape.dim]
    spec = InputSpec.of({"name": graph_input.name, "shape": dims, "preprocess": {**IMAGENET, "resize": dims[2:]}})
    images = [preprocess_image(PHOTOS / f"{n}.jpg", spec)[None].astype(np.float32) for n in PROBE_PHOTOS]
    inits = {t.name: t for t in model.graph.initializer}
    norms = [n for n in model.graph.node if n.op_type == "BatchNormalization"]
    stats = {name: numpy_helper.to_array(inits[name]) for n in norms for name in n.input[3:5]}
    # the statistics become graph inputs of a working copy, so one session serves every layer
    work = onnx.ModelProto()
    work.CopyFrom(model)
    kept = [t for t in work.graph.initializer if t.name not in stats]
    del work.graph.initializer[:]
    work.graph.initializer.extend(kept)
    work.graph.input.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, v.shape) for n, v in stats.items())
    work.graph.output.extend(onnx.ValueInfoProto(name=n.input[0]) for n in norms)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.intra_op_num_threads = 1
    session = ort.InferenceSession(work.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    for node in norms:
        x = np.concatenate(
            [session.run([node.input[0]], {graph_input.name: image, **stats})[0] for image in images]
        ).astype(np.float64)
        stats[node.input[3]] = _significant(x.mean(axis=(0, 2, 3))).astype(np.float32)
        stats[node.input[4]] = _significant(x.var(axis=(0, 2, 3))).astype(np.float32)
    for name, value in stats.items():
        inits[name].CopyFrom(numpy_helper.from_array(value, name))
    return model


def batchnorm(g: Graph, x: str, c: int, name: str) -> str:
    """Trained-like statistics: a unit-ish scale and a small shift around the conv output's own scale."""
    bn = [
        g.init(f"{name}.bn.{k}", g.rng.uniform(lo, hi, c).astype(np.float32))
        for k, lo, hi in (("scale", 0.7, 1.3), ("bias", -0.1, 0.1), ("mean", -0.1, 0.1), ("var", 0.7, 1.3))
    ]
    return g.node("BatchNormalization", [x, *bn], f"{name}.bn", epsilon=1e-5)


def activation(g: Graph, x: str, kind: str | None, name: str) -> str:
    """Each activation as exporters write it at opset 17."""
    if kind == "relu":
        return g.node("Relu", [x], f"{name}.relu")
    if kind == "relu6":
        lo, hi = g.const("relu6.min", np.float32(0)), g.const("relu6.max", np.float32(6))
        return g.node("Clip", [x, lo, hi], f"{name}.relu6")
    if kind == "hardswish":
        return g.node("HardSwish", [x], f"{name}.hswish")
    if kind == "silu":  # torch's SiLU: x * sigmoid(x)
        return g.node("Mul", [x, g.node("Sigmoid", [x], f"{name}.sigmoid")], f"{name}.silu")
    return x


def conv(
    g: Graph,
    x: str,
    cin: int,
    cout: int,
    name: str,
    k: int = 3,
    stride: int = 1,
    groups: int = 1,
    act: str | None = None,
    bn: bool = True,
    gain: float = 2.0,
) -> str:
    """Conv (+ BatchNormalization) (+ activation); a conv without BN has a bias."""
    fan_in = cin // groups * k * k
    w = g.rand(f"{name}.weight", (cout, cin // groups, k, k), np.sqrt(gain / fan_in))
    inputs = [x, w] if bn else [x, w, g.rand(f"{name}.bias", (cout,), 0.05)]
    y = g.node(
        "Conv", inputs, f"{name}.conv", kernel_shape=[k, k], pads=[k // 2] * 4, strides=[stride] * 2, group=groups
    )
    if bn:
        y = batchnorm(g, y, cout, name)
    return activation(g, y, act, name)


def squeeze_excite(g: Graph, x: str, c: int, name: str) -> str:
    # pooled features are small (about 0.2): large gains spread the gates over (0, 1) as a trained SE's are
    s = g.node("GlobalAveragePool", [x], f"{name}.pool")
    s = conv(g, s, c, c // 4, f"{name}.reduce", k=1, act="relu", bn=False, gain=20.0)
    s = conv(g, s, c // 4, c, f"{name}.expand", k=1, bn=False, gain=4.0)
    s = g.node("HardSigmoid", [s], f"{name}.gate", alpha=1.0 / 6, beta=0.5)
    return g.node("Mul", [x, s], f"{name}.scale")


def inverted_residual(
    g: Graph,
    x: str,
    cin: int,
    wide: int,
    cout: int,
    name: str,
    k: int = 3,
    stride: int = 1,
    act: str = "relu6",
    se: bool = False,
) -> str:
    """MobileNetV2/V3 block: 1x1 expand, depthwise kxk, (squeeze-excite), 1x1 project, residual if shapes allow."""
    y = conv(g, x, cin, wide, f"{name}.expand", k=1, act=act)
    y = conv(g, y, wide, wide, f"{name}.dw", k=k, stride=stride, groups=wide, act=act)
    if se:
        y = squeeze_excite(g, y, wide, f"{name}.se")
    y = conv(g, y, wide, cout, f"{name}.project", k=1, gain=1.0)
    return g.node("Add", [x, y], f"{name}.add") if stride == 1 and cin == cout else y


def mini_mobilenet(size: int = 96, classes: int = 100) -> onnx.ModelProto:
    g = Graph(seed=11)
    x = conv(g, "input", 3, 16, "stem", stride=2, act="hardswish")  # 48 x 48
    y = conv(g, x, 16, 16, "b1.dw", groups=16, act="relu6")  # depthwise-separable
    y = conv(g, y, 16, 16, "b1.pw", k=1, gain=1.0)
    x = g.node("Add", [x, y], "b1.add")
    x = inverted_residual(g, x, 16, 64, 24, "b2", stride=2)  # 24 x 24
    x = inverted_residual(g, x, 24, 72, 24, "b3")
    x = inverted_residual(g, x, 24, 72, 40, "b4", k=5, stride=2, act="hardswish", se=True)  # 12 x 12
    x = inverted_residual(g, x, 40, 120, 40, "b5", k=5, act="hardswish", se=True)
    x = inverted_residual(g, x, 40, 160, 48, "b6", stride=2, act="hardswish", se=True)  # 6 x 6
    x = conv(g, x, 48, 192, "head.conv", k=1, act="hardswish")
    x = g.node("GlobalAveragePool", [x], "head.pool")
    x = g.node("Flatten", [x], "head.flat", axis=1)
    # pooled features are small: gains that give the logits the spread of a confident classifier's
    x = g.node(
        "Gemm",
        [x, g.rand("head.fc1.weight", (256, 192), 4.0 / np.sqrt(192)), g.rand("head.fc1.bias", (256,), 0.05)],
        "head.fc1",
        transB=1,
    )
    x = g.node("HardSwish", [x], "head.fc1.hswish")
    x = g.node(
        "Gemm",
        [x, g.rand("head.fc2.weight", (classes, 256), 2.5 / np.sqrt(256)), g.rand("head.fc2.bias", (classes,), 0.05)],
        "logits",
        transB=1,
    )
    x = g.node("Softmax", [x], "probs", axis=-1)
    return fit_batchnorm(
        g.model(
            "mini_mobilenet",
            [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, size, size])],
            [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["N", classes])],
        )
    )


def mini_yolo(size: int = 128, classes: int = 20, reg_max: int = 16) -> onnx.ModelProto:
    """YOLOv8's graph at a small width: output [1, 4 + classes, anchors] = (cx, cy, w, h in pixels, class scores)."""
    g = Graph(seed=13)

    def cbs(x: str, cin: int, cout: int, name: str, k: int = 3, stride: int = 1) -> str:
        return conv(g, x, cin, cout, name, k=k, stride=stride, act="silu")

    def c2f(x: str, cin: int, cout: int, name: str, n: int = 1, shortcut: bool = True) -> str:
        """CSP bottleneck with two convolutions: split, n bottlenecks on one half, concat every stage, fuse."""
        c = cout // 2
        y = cbs(x, cin, 2 * c, f"{name}.cv1", k=1)
        parts = g.nodes_out(
            "Split",
            [y, g.const(f"split.{c}", np.array([c, c], np.int64))],
            [f"{name}.split.0", f"{name}.split.1"],
            axis=1,
        )
        for i in range(n):
            b = cbs(cbs(parts[-1], c, c, f"{name}.m{i}.cv1"), c, c, f"{name}.m{i}.cv2")
            parts.append(g.node("Add", [parts[-1], b], f"{name}.m{i}.add") if shortcut else b)
        return cbs(g.node("Concat", parts, f"{name}.cat", axis=1), (2 + n) * c, cout, f"{name}.cv2", k=1)

    def sppf(x: str, c: int, name: str) -> str:
        y = [cbs(x, c, c // 2, f"{name}.cv1", k=1)]
        for i in range(3):
            y.append(g.node("MaxPool", [y[-1]], f"{name}.pool{i}", kernel_shape=[5, 5], pads=[2, 2, 2, 2]))
        return cbs(g.node("Concat", y, f"{name}.cat", axis=1), 2 * c, c, f"{name}.cv2", k=1)

    x = cbs("images", 3, 16, "stem", stride=2)  # 64 x 64
    x = c2f(cbs(x, 16, 24, "down1", stride=2), 24, 24, "c2f1")  # 32 x 32
    p3 = c2f(cbs(x, 24, 32, "down2", stride=2), 32, 32, "c2f2")  # 16 x 16, stride 8
    p4 = c2f(cbs(p3, 32, 48, "down3", stride=2), 48, 48, "c2f3")  # 8 x 8, stride 16
    p5 = sppf(c2f(cbs(p4, 48, 64, "down4", stride=2), 64, 64, "c2f4"), 64, "sppf")  # 4 x 4, stride 32
    # FPN top-down: nearest 2x upsampling, by scales and by sizes (both forms exporters write)
    up = g.node(
        "Resize", [p5, "", g.const("fpn.scales", np.array([1, 1, 2, 2], np.float32))], "fpn.up5", mode="nearest"
    )
    n4 = c2f(g.node("Concat", [up, p4], "fpn.cat4", axis=1), 112, 48, "fpn4", shortcut=False)
    up = g.node(
        "Resize", [n4, "", "", g.const("fpn.sizes", np.array([1, 48, 16, 16], np.int64))], "fpn.up4", mode="nearest"
    )
    n3 = c2f(g.node("Concat", [up, p3], "fpn.cat3", axis=1), 80, 32, "fpn3", shortcut=False)
    # PAN bottom-up
    down = cbs(n3, 32, 32, "pan.down3", stride=2)
    n4 = c2f(g.node("Concat", [down, n4], "pan.cat4", axis=1), 80, 48, "pan4", shortcut=False)
    down = cbs(n4, 48, 48, "pan.down4", stride=2)
    n5 = c2f(g.node("Concat", [down, p5], "pan.cat5", axis=1), 112, 64, "pan5", shortcut=False)

    # decoupled head per level: box distances (reg_max bins per side) and class logits
    boxes, scores, anchors, strides = [], [], [], []
    for feat, c, stride in ((n3, 32, 8), (n4, 48, 16), (n5, 64, 32)):
        hw = (size // stride) ** 2
        name = f"head.p{stride}"
        b = cbs(cbs(feat, c, 24, f"{name}.box.cv1"), 24, 24, f"{name}.box.cv2")
        # a prior for short distances: boxes a few cells wide, as a trained head predicts
        w = g.rand(f"{name}.box.pred.weight", (4 * reg_max, 24, 1, 1), 2.0 / np.sqrt(24))
        bias = g.init(f"{name}.box.pred.bias", np.tile(-0.4 * np.arange(reg_max, dtype=np.float32), 4))
        b = g.node("Conv", [b, w, bias], f"{name}.box.pred", kernel_shape=[1, 1])
        boxes.append(
            g.node(
                "Reshape",
                [b, g.const(f"head.shape{4 * reg_max}.{hw}", np.array([1, 4 * reg_max, hw], np.int64))],
                f"{name}.box.flat",
            )
        )
        s = cbs(cbs(feat, c, 24, f"{name}.cls.cv1"), 24, 24, f"{name}.cls.cv2")
        w = g.rand(f"{name}.cls.pred.weight", (classes, 24, 1, 1), 3.0 / np.sqrt(24))
        # a prior of 1% per class (YOLOv8 starts from less): most scores come out between 1e-4 and 0.1, while
        # boxes reach the input size, the spread that makes one shared INT8 scale for both erase the scores
        bias = g.init(f"{name}.cls.pred.bias", np.full(classes, np.log(0.01 / 0.99), np.float32))
        s = g.node("Conv", [s, w, bias], f"{name}.cls.pred", kernel_shape=[1, 1])
        scores.append(
            g.node(
                "Reshape",
                [s, g.const(f"head.shape{classes}.{hw}", np.array([1, classes, hw], np.int64))],
                f"{name}.cls.flat",
            )
        )
        side = size // stride
        ys, xs = np.meshgrid(np.arange(side) + 0.5, np.arange(side) + 0.5, indexing="ij")
        anchors.append(np.stack([xs.ravel(), ys.ravel()]))
        strides.append(np.full(hw, stride))
    box = g.node("Concat", boxes, "head.box", axis=2)  # [1, 4 * reg_max, A]
    cls = g.node("Concat", scores, "head.cls", axis=2)  # [1, classes, A]
    count = sum(a.shape[1] for a in anchors)
    # DFL: softmax over each side's bins, expectation by a fixed 1x1 conv with weights 0..reg_max-1
    d = g.node("Reshape", [box, g.init("dfl.shape", np.array([1, 4, reg_max, count], np.int64))], "dfl.split")
    d = g.node("Transpose", [d], "dfl.bins", perm=[0, 2, 1, 3])
    d = g.node("Softmax", [d], "dfl.softmax", axis=1)
    proj = g.init("dfl.conv.weight", np.arange(reg_max, dtype=np.float32).reshape(1, reg_max, 1, 1))
    d = g.node("Conv", [d, proj], "dfl.conv", kernel_shape=[1, 1])
    d = g.node("Reshape", [d, g.init("dfl.out_shape", np.array([1, 4, count], np.int64))], "dfl.dist")
    lt, rb = g.nodes_out("Split", [d, g.const("split.2", np.array([2, 2], np.int64))], ["dist.lt", "dist.rb"], axis=1)
    grid = g.init("anchors", np.concatenate(anchors, axis=1)[None].astype(np.float32))  # [1, 2, A]
    x1y1 = g.node("Sub", [grid, lt], "box.x1y1")
    x2y2 = g.node("Add", [grid, rb], "box.x2y2")
    cxy = g.node("Div", [g.node("Add", [x1y1, x2y2], "box.sum"), g.init("two", np.float32(2))], "box.cxy")
    wh = g.node("Sub", [x2y2, x1y1], "box.wh")
    xywh = g.node("Concat", [cxy, wh], "box.xywh", axis=1)
    pixels = g.node("Mul", [xywh, g.init("strides", np.concatenate(strides)[None].astype(np.float32))], "box.pixels")
    g.node("Concat", [pixels, g.node("Sigmoid", [cls], "cls.scores")], "output0", axis=1)
    return fit_batchnorm(
        g.model(
            "mini_yolo",
            [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, size, size])],
            [helper.make_tensor_value_info("output0", TensorProto.FLOAT, [1, 4 + classes, count])],
        )
    )


def mini_vit(
    size: int = 64, patch: int = 8, dim: int = 96, heads: int = 3, depth: int = 2, mlp: int = 192, classes: int = 10
) -> onnx.ModelProto:
    g = Graph(seed=17)
    n = (size // patch) ** 2
    tokens, hd = n + 1, dim // heads

    def linear(x: str, din: int, dout: int, name: str) -> str:
        w = g.rand(f"{name}.weight", (din, dout), np.sqrt(1.0 / din))
        return g.node(
            "Add", [g.node("MatMul", [x, w], f"{name}.matmul"), g.rand(f"{name}.bias", (dout,), 0.02)], f"{name}.out"
        )

    def layernorm(x: str, name: str) -> str:
        scale = g.init(f"{name}.weight", g.rng.uniform(0.8, 1.2, dim).astype(np.float32))
        bias = g.init(f"{name}.bias", g.rng.uniform(-0.1, 0.1, dim).astype(np.float32))
        return g.node("LayerNormalization", [x, scale, bias], f"{name}.out", axis=-1, epsilon=1e-6)

    def gelu(x: str, name: str) -> str:
        """torch's exact GELU as exported before opset 20: x * 0.5 * (1 + erf(x / sqrt(2)))."""
        e = g.node(
            "Erf", [g.node("Div", [x, g.const("gelu.sqrt2", np.float32(np.sqrt(2)))], f"{name}.div")], f"{name}.erf"
        )
        e = g.node("Add", [e, g.const("gelu.one", np.float32(1))], f"{name}.add")
        return g.node(
            "Mul", [g.node("Mul", [x, e], f"{name}.mul"), g.const("gelu.half", np.float32(0.5))], f"{name}.gelu"
        )

    w = g.rand("patch_embed.weight", (dim, 3, patch, patch), np.sqrt(1.0 / (3 * patch * patch)))
    x = g.node(
        "Conv",
        ["input", w, g.rand("patch_embed.bias", (dim,), 0.02)],
        "patch_embed.conv",
        kernel_shape=[patch, patch],
        strides=[patch, patch],
    )
    x = g.node("Reshape", [x, g.init("patch_embed.shape", np.array([1, dim, n], np.int64))], "patch_embed.flat")
    x = g.node("Transpose", [x], "patch_embed.tokens", perm=[0, 2, 1])
    x = g.node("Concat", [g.rand("cls_token", (1, 1, dim), 0.02), x], "tokens", axis=1)
    x = g.node("Add", [x, g.rand("pos_embed", (1, tokens, dim), 0.02)], "tokens.pos")
    for i in range(depth):
        name = f"blocks.{i}"
        h = layernorm(x, f"{name}.norm1")
        qkv = linear(h, dim, 3 * dim, f"{name}.attn.qkv")
        qkv = g.node(
            "Reshape",
            [qkv, g.const("qkv.shape", np.array([1, tokens, 3, heads, hd], np.int64))],
            f"{name}.attn.qkv.split",
        )
        qkv = g.node("Transpose", [qkv], f"{name}.attn.qkv.heads", perm=[2, 0, 3, 1, 4])  # [3, 1, heads, T, hd]
        q, k, v = (
            g.node("Gather", [qkv, g.const(f"index.{j}", np.array(j, np.int64))], f"{name}.attn.{part}", axis=0)
            for j, part in enumerate("qkv")
        )
        s = g.node(
            "MatMul", [q, g.node("Transpose", [k], f"{name}.attn.k.t", perm=[0, 1, 3, 2])], f"{name}.attn.scores"
        )
        s = g.node("Mul", [s, g.const("attn.scale", np.float32(hd**-0.5))], f"{name}.attn.scaled")
        p = g.node("Softmax", [s], f"{name}.attn.probs", axis=-1)
        o = g.node(
            "Transpose", [g.node("MatMul", [p, v], f"{name}.attn.context")], f"{name}.attn.merge", perm=[0, 2, 1, 3]
        )
        o = g.node("Reshape", [o, g.const("merged.shape", np.array([1, tokens, dim], np.int64))], f"{name}.attn.merged")
        x = g.node("Add", [x, linear(o, dim, dim, f"{name}.attn.proj")], f"{name}.res1")
        h = gelu(linear(layernorm(x, f"{name}.norm2"), dim, mlp, f"{name}.mlp.fc1"), f"{name}.mlp.act")
        x = g.node("Add", [x, linear(h, mlp, dim, f"{name}.mlp.fc2")], f"{name}.res2")
    x = layernorm(x, "norm")
    x = g.node("Gather", [x, g.const("index.0", np.array(0, np.int64))], "cls", axis=1)  # [1, dim]
    x = g.node(
        "Gemm",
        [x, g.rand("head.weight", (classes, dim), np.sqrt(1.0 / dim)), g.rand("head.bias", (classes,), 0.02)],
        "logits",
        transB=1,
    )
    return g.model(
        "mini_vit",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, classes])],
    )


MODELS = {
    "demo_cnn": demo_cnn,
    "tiny_transformer": tiny_transformer,
    "mini_mobilenet": mini_mobilenet,
    "mini_yolo": mini_yolo,
    "mini_vit": mini_vit,
}


def main(out_dir: str | None = None) -> None:
    out = Path(out_dir) if out_dir else Path(__file__).parent
    out.mkdir(parents=True, exist_ok=True)
    for name, make in MODELS.items():
        path = out / f"{name}.onnx"
        path.write_bytes(make().SerializeToString())
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tpubuild, when run as a script
    main(*sys.argv[1:])
