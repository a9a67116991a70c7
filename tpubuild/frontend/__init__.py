"""ONNX -> TOP: one converter function per ONNX op, registered by op type and opset."""

from tpubuild.frontend.onnx_graph import convert_onnx, load_onnx  # noqa: F401  (the package API)
