"""Calibration samples: the manifest's ``calibration.data`` glob, one sample at a time.

- ``.npz``: one array per model input, keyed by input name (a one-input model
  may use any key). An array of shape ``(S, *input_shape)`` holds S samples.
- ``.npy``: one-input models only; the input's shape, or ``(S, *shape)`` for S
  samples (memory-mapped, so a large file is not read at once).
- images (``.png``, ``.jpg``, ``.jpeg``, ``.bmp``): one-input NCHW (or NHWC) models; each
  sample takes N images (the batch) and applies the input's ``preprocess``
  as TPU-MLIR does: resize to ``preprocess.resize`` (default: the input's H, W;
  bilinear) and center-crop to H, W if that is larger, convert to
  ``pixel_format`` (rgb, bgr or gray; default from C), then per channel
  ``(x - mean) * scale`` (defaults 0 and 1).

Files are taken in sorted order and at most ``count`` samples are produced.

``split_test_sample(samples)`` sets one sample aside: the last of those ``count`` lets through, which a model
without a ``test_input`` is verified on (docs/manifest.md, test_input); every reader of calibration
samples (calibrate, the mixed-precision search, a prepare step on data) then reads the others only.
"""

from __future__ import annotations

import itertools
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from tpubuild.calib.files import IMAGE_SUFFIXES, find_files
from tpubuild.errors import TpuBuildError

__all__ = [
    "HeldBack",
    "InputSpec",
    "Samples",
    "find_files",
    "split_test_sample",
    "preprocess_image",
    "sample_count",
    "samples_at",
]


@dataclass(frozen=True)
class InputSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    preprocess: Mapping[str, Any] | None = None

    @classmethod
    def of(cls, spec: Mapping[str, Any]) -> InputSpec:
        return cls(
            spec["name"], tuple(int(d) for d in spec["shape"]), spec.get("dtype", "float32"), spec.get("preprocess")
        )


@dataclass(frozen=True)
class Samples:
    """A re-iterable stream of samples ({input name: array}); each pass reads the files again."""

    files: tuple[Path, ...]
    inputs: tuple[InputSpec, ...]
    count: int | None = None

    @classmethod
    def of(cls, files: Sequence[str | Path], inputs: Sequence[Mapping[str, Any]], count: int | None = None) -> Samples:
        return cls(tuple(Path(f) for f in files), tuple(InputSpec.of(s) for s in inputs), count)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        for n, sample in enumerate(self._all()):
            if self.count is not None and n >= self.count:
                return
            yield sample

    def _all(self) -> Iterator[dict[str, np.ndarray]]:
        if not self.files:
            raise TpuBuildError(
                "no calibration data: the calibration.data glob matches no .npz, .npy or image file",
                hint="check calibration.data in the manifest (a glob relative to the manifest)",
            )
        pending: list[Path] = []  # images waiting to fill a batch
        for path in self.files:
            suffix = path.suffix.lower()
            if suffix in IMAGE_SUFFIXES:
                pending.append(path)
                if len(pending) == self._image_input().shape[0]:
                    yield self._image_sample(pending)
                    pending = []
            elif suffix == ".npz":
                yield from self._npz_samples(path)
            else:
                yield from self._npy_samples(path)

    # ---- where each sample is, without reading it ------------------------------

    def locations(self) -> Iterator[tuple[str, tuple[Path, ...], int]]:
        """(kind, files, index in the file) of every sample ``__iter__`` yields, in the same order and with the
        same ``count``, from the files' headers only: "npz"/"npy" with one file, "images" with a batch."""
        yield from itertools.islice(self._all_locations(), self.count)

    def _all_locations(self) -> Iterator[tuple[str, tuple[Path, ...], int]]:
        if not self.files:
            next(self._all())  # its error: no data
        pending: list[Path] = []
        for path in self.files:
            suffix = path.suffix.lower()
            if suffix in IMAGE_SUFFIXES:
                pending.append(path)
                if len(pending) == self._image_input().shape[0]:
                    yield ("images", tuple(pending), 0)
                    pending = []
            else:
                kind = "npz" if suffix == ".npz" else "npy"
                for i in range(_npz_count(path, self.inputs) if kind == "npz" else _npy_count(path, self.inputs)):
                    yield (kind, (path,), i)

    def read_at(self, location: tuple[str, tuple[Path, ...], int]) -> dict[str, np.ndarray]:
        """The sample at one of ``locations()``: the same arrays ``__iter__`` yields there."""
        kind, files, index = location
        if kind == "images":
            return self._image_sample(list(files))
        samples = self._npz_samples(files[0]) if kind == "npz" else self._npy_samples(files[0])
        for i, sample in enumerate(samples):
            if i == index:
                return sample
        raise TpuBuildError(f"calibration data has no sample {index}", file=str(files[0]))

    # ---- arrays ---------------------------------------------------------------

    def _npz_samples(self, path: Path) -> Iterator[dict[str, np.ndarray]]:
        try:
            with np.load(path, allow_pickle=False) as data:
                arrays = {k: data[k] for k in data.files}
        except (OSError, ValueError) as err:
            raise TpuBuildError(f"cannot read calibration data: {err}", file=str(path)) from None
        if len(self.inputs) == 1 and len(arrays) == 1 and self.inputs[0].name not in arrays:
            arrays = {self.inputs[0].name: next(iter(arrays.values()))}  # one input: the key doesn't matter
        missing = [s.name for s in self.inputs if s.name not in arrays]
        if missing:
            raise TpuBuildError(
                f"calibration data has no array for input(s) {missing} (it has {sorted(arrays)})",
                file=str(path),
                hint="key each array by its model input name",
            )
        stacks = {s.name: _stacked(arrays[s.name], s, path) for s in self.inputs}
        counts = {len(v) for v in stacks.values()}
        if len(counts) != 1:
            raise TpuBuildError(
                f"calibration data holds different sample counts per input: { {k: len(v) for k, v in stacks.items()} }",
                file=str(path),
            )
        for i in range(counts.pop()):
            yield {s.name: stacks[s.name][i].astype(s.dtype) for s in self.inputs}

    def _npy_samples(self, path: Path) -> Iterator[dict[str, np.ndarray]]:
        if len(self.inputs) != 1:
            raise TpuBuildError(
                f"an .npy file holds one input, but the model has {len(self.inputs)}",
                file=str(path),
                hint="use .npz files with one array per input name",
            )
        spec = self.inputs[0]
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as err:
            raise TpuBuildError(f"cannot read calibration data: {err}", file=str(path)) from None
        for sample in _stacked(array, spec, path):
            yield {spec.name: np.array(sample, dtype=spec.dtype)}

    # ---- images ---------------------------------------------------------------

    def _image_input(self) -> InputSpec:
        if len(self.inputs) != 1:
            raise TpuBuildError(
                f"image calibration data needs a one-input model; this one has {len(self.inputs)} "
                f"({', '.join(spec.name for spec in self.inputs)})",
                hint="give the inputs that are settings rather than data (a scale factor, a sample rate) a fixed "
                "`value` in the manifest's inputs, or use .npz files with one array per input name",
            )
        spec = self.inputs[0]
        image_layout(spec)  # (its checks)
        return spec

    def _image_sample(self, paths: list[Path]) -> dict[str, np.ndarray]:
        spec = self._image_input()
        batch = np.stack([preprocess_image(p, spec) for p in paths])
        return {spec.name: batch.astype(spec.dtype)}


def _stack_count(shape: Sequence[int], spec: InputSpec, path: Path) -> int:
    """How many samples an array of ``shape`` holds (as _stacked, from the shape alone)."""
    if tuple(shape) == spec.shape:
        return 1
    if tuple(shape[1:]) == spec.shape:
        return int(shape[0])
    raise _shape_error(shape, spec, path)


def _npy_count(path: Path, inputs: Sequence[InputSpec]) -> int:
    if len(inputs) != 1:
        return len(list(Samples((path,), tuple(inputs))._npy_samples(path)))  # its error
    try:
        shape = np.load(path, mmap_mode="r", allow_pickle=False).shape
    except (OSError, ValueError) as err:
        raise TpuBuildError(f"cannot read calibration data: {err}", file=str(path)) from None
    return _stack_count(shape, inputs[0], path)


def _npz_count(path: Path, inputs: Sequence[InputSpec]) -> int:
    """The samples an .npz holds, from its arrays' .npy headers (a compressed member is inflated only that far)."""
    try:
        with zipfile.ZipFile(path) as z:
            shapes = {}
            for member in z.namelist():
                if member.endswith(".npy"):
                    with z.open(member) as f:
                        major, _ = np.lib.format.read_magic(f)
                        read_header = (
                            np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
                        )
                        shapes[member[:-4]] = read_header(f)[0]
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise TpuBuildError(f"cannot read calibration data: {err}", file=str(path)) from None
    if len(inputs) == 1 and len(shapes) == 1 and inputs[0].name not in shapes:
        shapes = {inputs[0].name: next(iter(shapes.values()))}
    if any(s.name not in shapes for s in inputs):
        return len(list(Samples((path,), tuple(inputs))._npz_samples(path)))  # its error
    counts = {_stack_count(shapes[s.name], s, path) for s in inputs}
    if len(counts) != 1:
        return len(list(Samples((path,), tuple(inputs))._npz_samples(path)))  # its error
    return counts.pop()


@dataclass(frozen=True)
class HeldBack:
    """The calibration sample set aside for verification: where it is, and how to read it."""

    samples: Samples
    location: tuple[str, tuple[Path, ...], int]
    used: int  # how many samples calibration reads (those before this one)

    def read(self) -> dict[str, np.ndarray]:
        return self.samples.read_at(self.location)

    def describe(self) -> str:
        """E.g. "calibration sample tree_4.jpg (held back: calibration reads the 31 samples before it)"."""
        kind, files, index = self.location
        what = ", ".join(f.name for f in files) + (f" [sample {index}]" if kind != "images" else "")
        return f"calibration sample {what} (held back: calibration reads the {self.used} samples before it)"


def split_test_sample(samples: Samples) -> tuple[Samples, HeldBack | None]:
    """(the samples calibration reads, the one it holds back for verification's test input).

    The held-back sample is the last of ``samples`` (sorted file order, after ``count``); the others are
    ``samples`` with ``count`` one less, so a reader iterates them exactly as before, one sample short. With
    one sample or none, nothing is held back (calibration needs it): ``(samples, None)``.
    Locating the last sample reads the files' headers (and names), never the data of the others.
    """
    last, n = None, 0
    for loc in samples.locations():
        last, n = loc, n + 1
    if n < 2 or last is None:
        return samples, None
    return replace(samples, count=n - 1), HeldBack(samples, last, n - 1)


def sample_count(samples: Samples | Sequence[Mapping[str, np.ndarray]]) -> int:
    """How many samples there are: a Samples counted from its files' headers (no data read), a list by its length."""
    return sum(1 for _ in samples.locations()) if isinstance(samples, Samples) else len(samples)


def samples_at(
    samples: Samples | Sequence[Mapping[str, np.ndarray]], indices: set[int]
) -> list[Mapping[str, np.ndarray]]:
    """The samples at ``indices``, in order (those after the last index are never read)."""
    last = max(indices, default=-1)
    return [sample for i, sample in enumerate(itertools.islice(iter(samples), last + 1)) if i in indices]


def _stacked(array: np.ndarray, spec: InputSpec, path: Path) -> np.ndarray:
    """The array as a stack of samples: (1, *shape) for one sample, or as is for (S, *shape)."""
    if tuple(array.shape) == spec.shape:
        return array[None]
    if tuple(array.shape[1:]) == spec.shape:
        return array
    raise _shape_error(array.shape, spec, path)


def _shape_error(shape: Sequence[int], spec: InputSpec, path: Path) -> TpuBuildError:
    return TpuBuildError(
        f"calibration array for input {spec.name!r} has shape {list(shape)}; "
        f"expected {list(spec.shape)} or [S, {', '.join(map(str, spec.shape))}] for S samples",
        file=str(path),
    )


def _per_channel(values, channels: int, what: str, spec: InputSpec) -> np.ndarray:
    arr = np.asarray(values, np.float32).reshape(-1)
    if arr.size not in (1, channels):
        raise TpuBuildError(f"input {spec.name!r}: preprocess.{what} has {arr.size} values for {channels} channels")
    return np.broadcast_to(arr, (channels,)).reshape(channels, 1, 1)


def image_layout(spec: InputSpec) -> tuple[int, int, int, bool]:
    """(channels, height, width, channels last) of an image input: NCHW, or NHWC as models exported from
    TensorFlow take them; ``preprocess.channel_format`` says which where the shape leaves it open."""
    shape, pre = spec.shape, spec.preprocess or {}
    fits = {"nchw": len(shape) == 4 and shape[1] in (1, 3), "nhwc": len(shape) == 4 and shape[3] in (1, 3)}
    layout = pre.get("channel_format") or ("nchw" if fits["nchw"] else "nhwc")
    if not fits[layout]:
        wanted = f"an {layout.upper()} input" if "channel_format" in pre else "an NCHW or NHWC input"
        raise TpuBuildError(
            f"input {spec.name!r} has shape {list(shape)}: images need {wanted} with 1 or 3 channels",
            hint="give .npz or .npy data instead",
        )
    if layout == "nhwc":
        return shape[3], shape[1], shape[2], True
    return shape[1], shape[2], shape[3], False


def preprocess_image(path: str | Path, spec: InputSpec) -> np.ndarray:
    """One image -> a float32 array (C, H, W), or (H, W, C) for an NHWC input, per the input's preprocess."""
    from PIL import Image, UnidentifiedImageError

    channels, height, width, channels_last = image_layout(spec)
    pre = dict(spec.preprocess or {})
    fmt = pre.get("pixel_format", "gray" if channels == 1 else "rgb")
    if (fmt == "gray") != (channels == 1):
        raise TpuBuildError(f"input {spec.name!r} has {channels} channels but preprocess.pixel_format is {fmt}")
    try:
        with Image.open(path) as img:
            img = img.convert("L" if fmt == "gray" else "RGB")
            rh, rw = pre.get("resize", (height, width))
            if (img.height, img.width) != (rh, rw):
                img = img.resize((rw, rh), Image.Resampling.BILINEAR)
            pixels = np.asarray(img, np.float32)
    except (OSError, UnidentifiedImageError) as err:
        raise TpuBuildError(f"cannot read calibration image: {err}", file=str(path)) from None
    if rh < height or rw < width:
        raise TpuBuildError(
            f"input {spec.name!r}: preprocess.resize {[rh, rw]} is smaller than the input's {[height, width]}",
            hint="resize to at least the input size (larger is center-cropped)",
        )
    top, left = (rh - height) // 2, (rw - width) // 2
    pixels = pixels[top : top + height, left : left + width]
    chw = pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)
    if fmt == "bgr":
        chw = chw[::-1]
    mean = _per_channel(pre.get("mean", [0.0]), channels, "mean", spec)
    scale = _per_channel(pre.get("scale", [1.0]), channels, "scale", spec)
    out = ((chw - mean) * scale).astype(np.float32)
    return np.ascontiguousarray(out.transpose(1, 2, 0)) if channels_last else out
