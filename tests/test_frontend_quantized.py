"""Models onnxruntime's quantizer wrote (QDQ, QOperator with its QLinear contrib ops, dynamic quantization):
TOP inference against onnxruntime on them, output by output and every intermediate integer tensor."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

R = np.random.default_rng(7)


def _float_model() -> onnx.ModelProto:
    def w(name, *shape):
        return numpy_helper.from_array(
            (R.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32), name
        )

    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "r1"], ["res"]),
        helper.make_node("Sigmoid", ["res"], ["s"]),
        helper.make_node("Concat", ["s", "r1"], ["cat"], axis=1),
        helper.make_node("GlobalAveragePool", ["cat"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("MatMul", ["f", "fc"], ["y"]),
    ]
    inits = [w("w1", 8, 3, 3, 3), w("b1", 8), w("w2", 8, 8, 3, 3), w("b2", 8), w("fc", 16, 5)]
    graph = helper.make_graph(
        nodes,
        "f",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 12, 12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _samples(n: int) -> list[np.ndarray]:
    return [R.uniform(-1, 1, (1, 3, 12, 12)).astype(np.float32) for _ in range(n)]


def _with_every_output(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every node's result as a graph output, so that each intermediate (integer) tensor is compared too."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    names = {o.name for o in out.graph.output}
    out.graph.output.extend(
        onnx.ValueInfoProto(name=n) for node in out.graph.node for n in node.output if n not in names
    )
    return out


@pytest.mark.parametrize("fmt", ["QDQ", "QOperator"])
def test_static_quantized_models_match_onnxruntime(tmp_path, fmt, check_against_ort):
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.samples = iter([{"x": s} for s in _samples(8)])

        def get_next(self):
            return next(self.samples, None)

    onnx.save(_float_model(), str(tmp_path / "f.onnx"))
    quantize_static(
        str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), Reader(), quant_format=QuantFormat[fmt], per_channel=True
    )
    model = onnx.load(str(tmp_path / "q.onnx"))
    ops = {n.op_type for n in model.graph.node}
    qlinear = {"QLinearConv", "QLinearAdd", "QLinearConcat", "QLinearGlobalAveragePool", "QLinearMatMul"}
    assert ({"QuantizeLinear", "DequantizeLinear"} <= ops) if fmt == "QDQ" else (qlinear <= ops), ops
    check_against_ort(_with_every_output(model), {"x": _samples(1)[0]})


def test_dynamic_quantized_matmul_matches_onnxruntime(tmp_path, check_against_ort):
    from onnxruntime.quantization import quantize_dynamic

    weight = numpy_helper.from_array(R.standard_normal((16, 6)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "m",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 6])],
        [weight],
    )
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(tmp_path / "f.onnx")
    )
    quantize_dynamic(str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"))
    model = onnx.load(str(tmp_path / "q.onnx"))
    assert {"DynamicQuantizeLinear", "MatMulInteger"} <= {n.op_type for n in model.graph.node}
    check_against_ort(_with_every_output(model), {"x": R.standard_normal((3, 16)).astype(np.float32)})
