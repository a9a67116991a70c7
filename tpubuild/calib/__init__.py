"""Calibration: activation statistics, threshold methods, the calibration table and cali.mlir."""
