"""The test input every verification stage feeds: the manifest's ``test_input``, else a calibration sample that
calibration holds back (calib/data.py, split_test_sample), else made up deterministically (uniform noise)."""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tpubuild.calib.data import HeldBack
from tpubuild.calib.files import IMAGE_SUFFIXES
from tpubuild.errors import TpuBuildError

# Without a manifest `range`: floats in [0, 1), integers in [0, 10) (small enough
# to be valid indices for most embedding tables; set `range` for anything else).
_DEFAULT_FLOAT_RANGE = (0.0, 1.0)
_DEFAULT_INT_RANGE = (0, 10)


def _seed(model: str, input_name: str) -> int:
    # crc32, not hash(): Python salts str hashes per process, and the input must
    # be byte-identical across runs for doit's content checks to stop early.
    return zlib.crc32(f"{model}\0{input_name}".encode())


def default_input(model: str, spec: Mapping[str, Any]) -> np.ndarray:
    """One input tensor: uniform in the half-open spec['range'] (or the defaults)."""
    rng = np.random.default_rng(_seed(model, spec["name"]))
    shape = tuple(spec["shape"])
    dtype = np.dtype(spec.get("dtype", "float32"))
    lo_hi = spec.get("range")
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if dtype.kind in "iu":
        lo, hi = lo_hi if lo_hi else _DEFAULT_INT_RANGE
        return rng.integers(int(np.ceil(lo)), int(np.ceil(hi)), size=shape).astype(dtype)
    lo, hi = lo_hi if lo_hi else _DEFAULT_FLOAT_RANGE
    return rng.uniform(lo, hi, size=shape).astype(dtype)


def _from_file(path: Path, specs: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    from tpubuild.build.files import read_npz

    try:
        arrays = read_npz(path)
    except (OSError, ValueError) as err:
        raise TpuBuildError(
            f"cannot read test input: {err}", file=str(path), hint="test_input must be an .npz written by numpy.savez"
        ) from None
    if len(specs) == 1 and len(arrays) == 1 and specs[0]["name"] not in arrays:
        arrays = {specs[0]["name"]: next(iter(arrays.values()))}  # one input: the key doesn't matter
    out = {}
    for spec in specs:
        name, shape = spec["name"], tuple(spec["shape"])
        if name not in arrays:
            raise TpuBuildError(
                f"test input has no array named {name!r} (it has {sorted(arrays)})",
                file=str(path),
                hint="key each array by its model input name",
            )
        arr = arrays[name]
        if arr.shape != shape:
            raise TpuBuildError(
                f"test input {name!r} has shape {list(arr.shape)}; the model is compiled for {list(shape)}",
                file=str(path),
                hint="give an array of that shape, or set the input's `shape` in the manifest",
            )
        out[name] = arr.astype(spec.get("dtype", "float32"), copy=False)
    return out


def _from_image(path: Path, specs: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """An image, made into the model's one NCHW input by its `preprocess` (as calibration images are)."""
    from tpubuild.calib.data import InputSpec, preprocess_image

    if len(specs) != 1 or len(specs[0]["shape"]) != 4:
        raise TpuBuildError(
            "an image test_input needs a model with one NCHW or NHWC input",
            file=str(path),
            hint="give an .npz with one array per input instead",
        )
    spec = specs[0]
    chw = preprocess_image(path, InputSpec.of(spec))  # (or hwc)
    # every image of the batch is the same one
    return {spec["name"]: np.broadcast_to(chw, tuple(spec["shape"])).astype(spec.get("dtype", "float32"))}


def make_inputs(
    model: str, specs: Sequence[Mapping[str, Any]], test_input: str | None, held: HeldBack | None = None
) -> dict[str, np.ndarray]:
    """The test input by input name: read from ``test_input`` (.npz or image) if given, else the held-back
    calibration sample ``held`` if any, else generated."""
    if test_input:
        path = Path(test_input)
        if path.suffix.lower() in IMAGE_SUFFIXES:
            return _from_image(path, specs)
        return _from_file(path, specs)
    if held is not None:
        sample = held.read()
        return {spec["name"]: np.asarray(sample[spec["name"]]).astype(spec.get("dtype", "float32")) for spec in specs}
    return {spec["name"]: default_input(model, spec) for spec in specs}


def describe_source(test_input: str | None, held: HeldBack | None = None, left_out: bool = False) -> str:
    """Where the test input comes from, in words (verify.json, the summary and report.html show it);
    ``left_out``: the test_input is a calibration file that calibration does not read."""
    if test_input:
        return f"test_input {Path(test_input).name} (from the manifest" + (
            "; calibration leaves it out)" if left_out else ")"
        )
    if held is not None:
        return held.describe()
    return "generated: uniform noise in each input's range (no test_input, no calibration sample to hold back)"
