"""ONNX external data: tensors a model file keeps in other files (``model.onnx.data`` beside ``model.onnx``).

torch's dynamo exporter and ``onnx.save(..., save_as_external_data=True)`` write
a model this way: the .onnx file holds the graph and, for each such tensor, a
location (a path relative to the model's folder), an offset and a length. A
model used in place is read with its files (onnx.load resolves them), which are
then inputs of the stages that read it (``files_beside``). A model that fetch
publishes (a wheel member, a prepared file) has them read into it
(``inline``), so that build/<model>/source.onnx is one file like any other.
"""

from __future__ import annotations

import mmap
import os
import posixpath
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from tpubuild.errors import TpuBuildError


if TYPE_CHECKING:
    import onnx


# how an external tensor's "location" key is serialized (StringStringEntryProto field 1, 8 bytes): a file
# without these bytes has no external data, which spares parsing a model of inline weights to find out
_LOCATION_KEY = b"\n\x08location"
# protobuf's limit on one message: a model over it must keep its weights outside
_PROTOBUF_LIMIT = (1 << 31) - 1


def _tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _tensors(attr.g)
            for sub in attr.graphs:
                yield from _tensors(sub)


def _checked_location(location: str, tensor: str, origin: str) -> str:
    """``location`` as a relative POSIX path that stays in the model's folder (as onnx.load requires)."""
    path = posixpath.normpath(location.replace("\\", "/"))
    if not location or posixpath.isabs(path) or path == ".." or path.startswith("../"):
        raise TpuBuildError(
            f"tensor {tensor!r} names external data at {location!r}, outside the model's folder",
            file=origin,
            hint="ONNX external data is a path relative to the model file's folder",
        )
    return path


def _external(
    data: bytes, origin: str
) -> tuple[onnx.ModelProto, list[tuple[onnx.TensorProto, dict[str, str], str]]] | None:
    """The serialized model ``data`` parsed, and its external tensors (tensor, its entries, its checked
    location); None for a model without any."""
    if _LOCATION_KEY not in data:
        return None
    import onnx

    model = onnx.load_model_from_string(data)
    found = []
    for tensor in _tensors(model.graph):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            entries = {e.key: e.value for e in tensor.external_data}
            found.append((tensor, entries, _checked_location(entries.get("location", ""), tensor.name, origin)))
    return (model, found) if found else None


def locations(data: bytes, origin: str) -> list[str]:
    """The external data files (relative to the model's folder) a serialized model names, in first use order."""
    found = _external(data, origin)
    return [] if found is None else list(dict.fromkeys(location for _, _, location in found[1]))


def files_beside(path: Path) -> list[Path]:
    """The external data files of the model file at ``path`` (none for an unreadable file: reading it is
    the stage's error to report). Cheap for a model without them: task creation calls it (onnx not imported)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            if view.find(_LOCATION_KEY) < 0:
                return []
            data = bytes(view)
    except (OSError, ValueError):  # ValueError: mmap of an empty file
        return []
    from google.protobuf.message import DecodeError

    try:
        return [path.parent / name for name in locations(data, str(path))]
    except (DecodeError, TpuBuildError):  # not a model, or a location outside its folder: the stage says so
        return []


def check_beside(path: Path) -> None:
    """A clear error for a model used in place whose external data files are missing."""
    missing = [f for f in files_beside(path) if not f.is_file()]
    if missing:
        raise TpuBuildError(
            f"the model keeps tensors in external data files that are not beside it: "
            f"{', '.join(str(f) for f in missing)}",
            file=str(path),
            hint="copy the model's .data file(s) next to the .onnx file, or save it with its weights inline "
            "(onnx.save(model, path, save_as_external_data=False))",
        )


def inline(data: bytes, read: Callable[[str], bytes], origin: str) -> bytes:
    """The serialized model ``data`` with its external tensors read in (``read``: a location's bytes); the
    same bytes when it has none."""
    found = _external(data, origin)
    if found is None:
        return data
    import onnx

    model, tensors = found
    files: dict[str, bytes] = {}
    for tensor, entries, location in tensors:
        if location not in files:
            files[location] = read(location)
        blob, offset = files[location], int(entries.get("offset", 0))
        end = offset + int(entries["length"]) if "length" in entries else len(blob)
        if end > len(blob):
            raise TpuBuildError(
                f"tensor {tensor.name!r} reads bytes {offset}..{end} of {location}, which has {len(blob)}",
                file=origin,
                hint="the external data file does not belong to this model file: take both from the same export",
            )
        tensor.raw_data = blob[offset:end]
        tensor.data_location = onnx.TensorProto.DEFAULT
        del tensor.external_data[:]
    if model.ByteSize() > _PROTOBUF_LIMIT:
        raise TpuBuildError(
            "the model's weights are over protobuf's 2 GB limit, so they cannot be read into one source.onnx",
            file=origin,
            hint="use the model in place (a path source), with its external data files beside it",
        )
    return model.SerializeToString()


def reader(folder: str | os.PathLike, origin: str) -> Callable[[str], bytes]:
    """``read`` for ``inline``: a location's bytes from ``folder`` on disk."""

    def read(location: str) -> bytes:
        try:
            return (Path(folder) / location).read_bytes()
        except OSError as err:
            raise TpuBuildError(
                f"cannot read the external data file {location} ({err.strerror})",
                file=origin,
                hint="ONNX external data must be beside the model file",
            ) from None

    return read
