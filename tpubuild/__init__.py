"""tpubuild: an ONNX -> TPU compiler whose stages are cached doit targets."""

__version__ = "0.1.0"
