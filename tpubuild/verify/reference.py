"""The reference: onnxruntime running the source model with every tensor exposed."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from tpubuild.errors import TpuBuildError


def output_names(onnx_path: str | Path) -> list[str]:
    """The graph outputs, in order."""
    from tpubuild.frontend.onnx_graph import load_onnx

    return [out.name for out in load_onnx(onnx_path).graph.output]


def _expose_all(model) -> list[str]:
    """Make every node output of the main graph a graph output; returns the added names."""
    import onnx

    existing = {out.name for out in model.graph.output}
    added = []
    for node in model.graph.node:
        for name in node.output:
            if name and name not in existing:
                # no type: onnxruntime infers it, and a wrong guess here would reject the model
                model.graph.output.append(onnx.ValueInfoProto(name=name))
                existing.add(name)
                added.append(name)
    return added


def onnx_tensors(onnx_path: str | Path, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every tensor of the main graph (graph outputs and all intermediates) by name."""
    import onnxruntime as ort

    from tpubuild.frontend.onnx_graph import load_onnx, set_input_shapes

    model = load_onnx(onnx_path)
    set_input_shapes(model, {name: np.shape(value) for name, value in inputs.items()})  # the manifest's, as TOP's
    _expose_all(model)
    opts = ort.SessionOptions()
    # Optimizations would fuse nodes and change the float rounding of what we compare
    # against; one thread keeps the reference bytes the same on every machine.
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    try:
        session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    except Exception as err:  # onnxruntime's exceptions have no stable public base class
        raise TpuBuildError(f"onnxruntime cannot load the model: {err}", file=str(onnx_path)) from None
    feeds = {}
    for arg in session.get_inputs():
        if arg.name not in inputs:
            raise TpuBuildError(
                f"no test input for graph input {arg.name!r} (have {sorted(inputs)})",
                file=str(onnx_path),
                hint="list every graph input under `inputs` in the manifest",
            )
        feeds[arg.name] = np.asarray(inputs[arg.name]).astype(_numpy_type(arg.type), copy=False)
    names = [out.name for out in session.get_outputs()]
    try:
        values = session.run(names, feeds)
    except Exception as err:
        raise TpuBuildError(f"onnxruntime failed to run the model: {err}", file=str(onnx_path)) from None
    return {name: np.asarray(value) for name, value in zip(names, values, strict=True)}


_ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int16)": np.int16,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}


def _numpy_type(ort_type: str):
    if ort_type not in _ORT_TYPES:
        raise TpuBuildError(f"graph input type {ort_type} is not supported")
    return _ORT_TYPES[ort_type]
