"""float32 <-> float16 conversion with numpy's exact bits, fast on large arrays.

numpy converts to and from float16 one element at a time (about 6 ns per element
here, float32 -> float16); TPU inference of an F16 model rounds every op's result
so, and the mixed-precision search runs such models dozens of times (PP-OCRv4
rec: 1.4 G conversions, a third of its search). onnxruntime's Cast uses the
CPU's conversion instructions (F16C: 0.13 ms per million) and rounds as numpy
does, to nearest even, with the same overflow to infinity and the same
subnormals; only NaN payloads may differ, so NaNs are converted by numpy.
Small arrays stay with numpy (a session call costs about 10 us).
"""

from __future__ import annotations

import functools
from typing import Literal

import numpy as np
import numpy.typing as npt

F16, F32 = np.dtype(np.float16), np.dtype(np.float32)
MIN_SIZE = 1 << 14  # elements: below, numpy's own loop is as fast as a session call


def astype(x: np.ndarray, dtype: npt.DTypeLike, order: Literal["K", "A", "C", "F"] = "K") -> np.ndarray:
    """``x.astype(dtype, order=order, copy=False)``, bit for bit (and layout: a C-order result unless
    ``order`` keeps another)."""
    dtype = np.dtype(dtype)
    if (
        x.size < MIN_SIZE
        or (x.dtype, dtype) not in ((F32, F16), (F16, F32))
        or not (order == "C" or x.flags.c_contiguous)
    ):
        return x.astype(dtype, order=order, copy=False)
    y = np.asarray(_cast(x.dtype, dtype).run(None, {"x": np.ascontiguousarray(x)})[0])
    wide = x if x.dtype == F32 else y
    if np.isnan(np.max(wide)):  # a NaN propagates through max: then take numpy's NaN bits for each
        nan = np.isnan(wide)
        y[nan] = x[nan].astype(dtype)
    return y


@functools.cache
def _cast(src: np.dtype, dst: np.dtype):
    """A one-node Cast session (one thread: the stages run side by side under doit -n)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    elem = {F32: TensorProto.FLOAT, F16: TensorProto.FLOAT16}
    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["y"], to=elem[dst])],
        "cast",
        [helper.make_tensor_value_info("x", elem[src], None)],
        [helper.make_tensor_value_info("y", elem[dst], None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
