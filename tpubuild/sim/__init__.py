"""The chip simulator: runs a .model file (never the .mlir) and estimates its cycles."""
