"""Verification: similarity metrics, tensor-dict comparison, the onnxruntime reference."""
