"""The IR: TOP and TPU dialects on xDSL, quant types, .mlir files and weight files."""
