"""The model's inputs as every stage reads them: the manifest's ``inputs`` entries completed from the model.

A manifest may leave out what the model says itself, as TPU-MLIR's ``--input_shapes`` is optional: an
entry's ``shape`` (where the model fixes every dim but perhaps the batch, which is then 1), its ``dtype``
and its ``name`` (the entry then stands for the graph input at its position), or ``inputs`` as a whole.
The stages that read the source model (transform, a prepare step on data) complete them from the ONNX
graph, and those that read a TOP module (calibrate, search) from its ``top.Input`` ops: one graph, so the
same specs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from tpubuild.errors import TpuBuildError


class Declared(NamedTuple):
    """A graph input as the model declares it: dims are ints, or a name / None where not fixed (None: no
    declared rank)."""

    name: str
    dims: tuple[int | str | None, ...] | None
    dtype: str


def onnx_inputs(model) -> list[Declared]:
    """The graph inputs of an ONNX model (initializers listed as inputs are weights, not inputs)."""
    from onnx import helper

    weights = {t.name for t in model.graph.initializer}
    out = []
    for inp in model.graph.input:
        if inp.name in weights:
            continue
        tensor = inp.type.tensor_type
        dims = (
            tuple(
                d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else (d.dim_param or None)
                for d in tensor.shape.dim
            )
            if tensor.HasField("shape")
            else None
        )
        out.append(Declared(inp.name, dims, helper.tensor_dtype_to_np_dtype(tensor.elem_type).name))
    return out


def module_inputs(module) -> list[Declared]:
    """The graph inputs of a TOP module, in argument order."""
    from tpubuild.ir.mlir import input_ops
    from tpubuild.ir.types import dtype_of, shape_of

    return [
        Declared(op.loc_name, shape_of(op.results[0].type), dtype_of(op.results[0].type).name)
        for op in input_ops(module)
    ]


def complete(given: Sequence[Mapping[str, Any]], declared: Sequence[Declared], *, file: str) -> list[dict[str, Any]]:
    """One spec per graph input, in the model's order: {name, shape, dtype, range, preprocess} (and a fixed
    input's value), each from the manifest's entry where it gives one, else from the model. Raises naming the
    inputs the model lacks, an entry's dtype the model contradicts and a dynamic dim no entry fixes."""
    names = [d.name for d in declared]
    by_name: dict[str, Mapping[str, Any]] = {}
    for i, entry in enumerate(given):
        name = entry.get("name") or (names[i] if i < len(names) else None)
        if name not in names:
            what = repr(name) if name else f"inputs[{i}] (no name, and the model has {len(names)} inputs)"
            raise TpuBuildError(
                f"the manifest names an input the model does not have: {what} (model inputs: {names})",
                file=file,
                hint="use the model's input names under `inputs:` in the manifest",
            )
        by_name[name] = entry
    specs, problems = [], []
    for d in declared:
        spec = _spec(d, by_name.get(d.name, {}))
        (specs if isinstance(spec, dict) else problems).append(spec)
    if problems:
        raise TpuBuildError(
            "the manifest's inputs do not fit the model: " + "; ".join(problems),
            file=file,
            hint="give each dynamic input its full static shape in the manifest, e.g. "
            "`inputs: [{name: x, shape: [1, 3, 224, 224]}]`; leave out `dtype` to take the model's",
        )
    return specs


def _spec(d: Declared, entry: Mapping[str, Any]) -> dict[str, Any] | str:
    """The input's spec from its manifest entry and the model's declaration, or what does not fit."""
    shape = entry.get("shape")
    value = entry.get("value")
    if shape is None and value is not None and (d.dims is None or not all(isinstance(n, int) for n in d.dims)):
        shape = np.shape(value)  # a fixed value's own shape, where the model fixes none
    if shape is None:
        if d.dims is None:
            return f"input {d.name!r} has no shape in the model"
        if not all(isinstance(n, int) for n in d.dims[1:]):
            return f"input {d.name!r} has dynamic shape {[n or '?' for n in d.dims]}"
        shape = (1, *d.dims[1:]) if d.dims else ()  # a dynamic batch alone: one at a time, as deployed
    dtype = entry.get("dtype") or d.dtype
    if dtype != d.dtype:
        return f"input {d.name!r} is {d.dtype} in the model, the manifest says {dtype}"
    spec = {
        "name": d.name,
        "shape": [int(n) for n in shape],  # type: ignore[arg-type]  # (ints: checked above)
        "dtype": dtype,
        "range": entry.get("range"),
        "preprocess": entry.get("preprocess"),
    }
    if value is not None:
        try:
            spec["value"] = _fixed(value, spec["shape"], dtype)
        except ValueError as e:
            return f"input {d.name!r}: value {value!r} {e}"
    return spec


def _fixed(value: Any, shape: Sequence[int], dtype: str) -> Any:
    """A fixed value as the input's dtype, broadcast to its shape (nested lists, JSON as the manifest's)."""
    array = np.asarray(value)
    if array.dtype.kind not in "biuf":
        raise ValueError("is not numbers")
    cast = array.astype(dtype)
    if cast.dtype.kind in "iu" and not np.array_equal(cast, array):
        raise ValueError(f"does not fit {dtype}")
    try:
        return np.broadcast_to(cast, tuple(shape)).tolist()
    except ValueError:
        raise ValueError(f"does not fit the shape {list(shape)}") from None


def split_fixed(specs: Sequence[Mapping[str, Any]]) -> tuple[list[Mapping[str, Any]], dict[str, np.ndarray]]:
    """(the specs of the inputs the compiled model takes, {name: array} of those with a fixed value)."""
    free = [s for s in specs if "value" not in s]
    fixed = {s["name"]: np.asarray(s["value"], dtype=s["dtype"]) for s in specs if "value" in s}
    return free, fixed


def of_onnx(given: Sequence[Mapping[str, Any]], model, *, file: str):
    """split_fixed of the manifest's entries completed from the ONNX ``model``: (the specs of the inputs the
    compiled model takes, {name: array} of the fixed ones)."""
    return split_fixed(complete(given, onnx_inputs(model), file=file))


def freeze(model, fixed: Mapping[str, np.ndarray]) -> None:
    """Each fixed input of the ONNX ``model`` made an initializer of its value (in place): the frontend then
    folds what reads it, and takes an If on it at compile time."""
    from onnx import numpy_helper

    if not fixed:
        return
    if model.ir_version >= 4:  # before IR 4, an initializer is listed as an input too (a weight, to onnx_inputs)
        keep = [i for i in model.graph.input if i.name not in fixed]
        del model.graph.input[:]
        model.graph.input.extend(keep)
    model.graph.initializer.extend(numpy_helper.from_array(a, name) for name, a in fixed.items())


def of_module(given: Sequence[Mapping[str, Any]], module, *, file: str) -> list[dict[str, Any]]:
    """The specs of a TOP module's inputs: the manifest's entries without the fixed ones, which the module no
    longer has (freeze; every entry is named beside them, so none moves), completed from its top.Input ops."""
    return complete([e for e in given if e.get("value") is None], module_inputs(module), file=file)


def of_source(manifest, onnx_file, model=None) -> list[dict[str, Any]]:
    """The specs the stages complete for ``manifest`` (a build.manifest.Manifest) from its source model file
    ``onnx_file`` (build.tasks.source_file; ``model``: that file loaded already): for readers outside the task
    graph (bench/)."""
    import onnx

    if model is None:
        model = onnx.load(str(onnx_file), load_external_data=False)
    given = [spec.config() for spec in manifest.inputs]
    return complete(given, onnx_inputs(model), file=str(onnx_file))
