"""The chip's command set: GDMA moves and BDC computations, and their binary records.

Shared contract between codegen (which emits commands) and the simulator
(which runs them); docs/model_format.md is the byte-level description.

Two queues run concurrently. A ``Gdma`` moves a strided 4-D block (n, c, h, w)
between DDR and local memory (or DDR to DDR); a ``Bdc`` runs one TPU op's
reference kernel (tpubuild.kernels, the same kernel TPU inference runs) on
tensors gathered from local memory (or, for a *global* Bdc, from DDR) and
scatters its results back. Sync: command ``id``s are 1, 2, 3... in queue order;
``Gdma.wait_bdc = k`` means "start only after BDC command k has finished"
(0: no wait), ``Bdc.wait_gdma`` likewise. The queues are in-order, so waiting
for command k waits for every command before it too.

Local layout (TPU convention): a local tensor of shape (n, c, h, w) starting
at lane ``lane_start`` puts channel c in lane ``(lane_start + c) % lanes`` as
that lane's channel slot ``(lane_start + c) // lanes``; each lane holds
``n x cslots x h x w`` elements with ``cslots = ceil((lane_start + c) / lanes)``,
the h x w plane of each (n, slot) starting on an ``eu_bytes`` boundary:
element (n, c, h, w) is at byte ``addr + (n * cslots + slot) * plane + (h * W + w) * itemsize``
of its lane, ``plane = align_up(H * W * itemsize, eu_bytes)``. Every lane
reserves the same byte range, so a tensor's footprint per lane is
``n * cslots * plane`` (``local_bytes``). A block may name another plane
stride (``Tensor.plane``, ``Gdma.local_plane``; 0: its own): a view of rows
h0..h1 of a taller tile is the tile's address plus ``h0 * W * itemsize`` with
the tile's plane, which is how an H slice reads fewer rows than a tile holds.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Element types, by their code in the binary records (numpy / ml_dtypes names).
DTYPES: tuple[str, ...] = (
    "float32",
    "float16",
    "bfloat16",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "bool",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
)
DTYPE_CODES = {name: code for code, name in enumerate(DTYPES)}
MAX_VIEW_RANK = 8


def dtype_code(name: str) -> int:
    try:
        return DTYPE_CODES[name]
    except KeyError:
        raise ValueError(f"element type {name!r} has no model-file code (known: {', '.join(DTYPES)})") from None


def dtype_name(code: int) -> str:
    if not 0 <= code < len(DTYPES):
        raise ValueError(f"unknown element type code {code}")
    return DTYPES[code]


def itemsize(dtype: str) -> int:
    from tpubuild.ir.types import dtype_from_name

    return dtype_from_name(dtype).itemsize


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides in elements."""
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return tuple(reversed(strides))


def lane_slots(lane_start: int, c: int, lanes: int) -> int:
    """How many channel slots each lane reserves for a tensor of c channels starting at lane_start."""
    return -(-(lane_start + c) // lanes) if c else 0


def plane_bytes(h: int, w: int, dtype: str, eu_bytes: int) -> int:
    return align_up(h * w * itemsize(dtype), eu_bytes)


def local_bytes(shape: Sequence[int], dtype: str, lane_start: int, lanes: int, eu_bytes: int, plane: int = 0) -> int:
    """Bytes a local tensor spans in each lane from its ``addr``: whole planes for a block with its own
    plane; for a view with another plane stride (``plane``, e.g. rows of a taller tile), up to the end
    of its last row, since the rest of the last plane belongs to the tile, not to the view."""
    n, c, h, w = shape
    planes = n * lane_slots(lane_start, c, lanes)
    if not plane:
        return planes * plane_bytes(h, w, dtype, eu_bytes)
    return (planes - 1) * plane + h * w * itemsize(dtype) if planes and h * w else 0


class Direction(enum.IntEnum):
    LOAD = 0  # DDR -> local
    STORE = 1  # local -> DDR
    DDR2DDR = 2  # DDR -> DDR (ddr_addr/ddr_strides -> dst_addr/dst_strides)


class Space(enum.IntEnum):
    NONE = 0  # an absent optional operand (top.None)
    LOCAL = 1  # local memory: addr is a byte offset within each lane, lane_start the first channel's lane
    DDR = 2  # DDR: addr is a byte address, strides in elements (a global Bdc)


Shape4 = tuple[int, int, int, int]


@dataclass(frozen=True)
class Gdma:
    """Move an (n, c, h, w) block. DDR side: ``ddr_addr`` (bytes) + ``ddr_strides`` (elements,
    0 broadcasts); local side: ``local_addr`` + ``lane_start`` in the local layout. DDR2DDR
    copies from the ddr_* block to the dst_* block (local fields unused)."""

    id: int
    wait_bdc: int
    direction: Direction
    dtype: str
    ddr_addr: int
    ddr_strides: Shape4
    local_addr: int
    lane_start: int
    shape: Shape4
    dst_addr: int = 0
    dst_strides: Shape4 = (0, 0, 0, 0)

    @property
    def local_plane(self) -> int:
        """LOAD/STORE: the local side's plane stride in bytes (kept in ``dst_strides[0]``; 0: its own)."""
        return self.dst_strides[0] if self.direction != Direction.DDR2DDR else 0

    def ddr_bytes(self) -> tuple[int, int]:
        """(bytes read from DDR, bytes written to DDR)."""
        size = math.prod(self.shape) * itemsize(self.dtype)
        return {Direction.LOAD: (size, 0), Direction.STORE: (0, size), Direction.DDR2DDR: (size, size)}[self.direction]


@dataclass(frozen=True)
class Tensor:
    """A Bdc operand or result.

    ``shape`` is the (n, c, h, w) block as laid out in memory; ``view`` the shape
    the kernel sees (the same elements, row-major), any rank up to 8.
    """

    space: Space
    dtype: str = "float32"
    addr: int = 0
    lane_start: int = 0
    shape: Shape4 = (0, 0, 0, 0)
    strides: Shape4 = (0, 0, 0, 0)  # DDR: element strides; LOCAL: (plane stride in bytes or 0, 0, 0, 0)
    view: tuple[int, ...] = ()

    @classmethod
    def local(
        cls,
        addr: int,
        lane_start: int,
        shape: Sequence[int],
        dtype: str,
        view: Sequence[int] | None = None,
        plane: int = 0,
    ) -> Tensor:
        dims = shape4(shape)
        return cls(
            Space.LOCAL,
            dtype,
            addr,
            lane_start,
            dims,
            (int(plane), 0, 0, 0),
            tuple(int(d) for d in (view if view is not None else dims)),
        )

    @property
    def plane(self) -> int:
        """LOCAL: the plane stride in bytes (0: the block's own)."""
        return self.strides[0] if self.space == Space.LOCAL else 0

    @classmethod
    def ddr(
        cls,
        addr: int,
        shape: Sequence[int],
        dtype: str,
        strides: Sequence[int] | None = None,
        view: Sequence[int] | None = None,
    ) -> Tensor:
        dims = shape4(shape)
        strides4 = shape4(strides if strides is not None else contiguous_strides(dims))
        return cls(
            Space.DDR, dtype, addr, 0, dims, strides4, tuple(int(d) for d in (view if view is not None else dims))
        )

    @classmethod
    def none(cls) -> Tensor:
        return cls(Space.NONE)

    def size(self) -> int:
        return math.prod(self.shape)


def shape4(shape: Sequence[int]) -> Shape4:
    if len(shape) != 4:
        raise ValueError(f"a memory block is (n, c, h, w), got {tuple(shape)}")
    n, c, h, w = (int(d) for d in shape)
    return n, c, h, w


@dataclass(frozen=True)
class Bdc:
    """Run TPU op ``op`` (e.g. "tpu.Conv") with ``params`` (canonical JSON of its PARAMS
    dataclass, as executed: an H slice's trimmed pads are already in it) on ``operands``,
    writing ``results`` (each cast to its descriptor's dtype, as TPU inference stores it).
    A Bdc with any DDR operand or result is a *global* Bdc: it reads/writes DDR directly."""

    id: int
    wait_gdma: int
    op: str
    params: str
    operands: tuple[Tensor, ...]
    results: tuple[Tensor, ...]

    @classmethod
    def make(
        cls, id: int, wait_gdma: int, op: str, params: Any, operands: Sequence[Tensor], results: Sequence[Tensor]
    ) -> Bdc:
        """``params``: the op's PARAMS dataclass instance (or an already-encoded JSON string)."""
        text = params if isinstance(params, str) else encode_params(params)
        return cls(id, wait_gdma, op, text, tuple(operands), tuple(results))

    @property
    def is_global(self) -> bool:
        return any(t.space == Space.DDR for t in (*self.operands, *self.results))


# ---- op parameters -------------------------------------------------------------------------


def encode_params(params: Any) -> str:
    """A PARAMS dataclass -> canonical JSON (every field, sorted keys, no spaces)."""
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    return canonical_json(fields)


def canonical_json(value: Any) -> str:
    # Python's repr floats round-trip exactly; Infinity/NaN are written as Python's json does
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def decode_params(params_cls: type, text: str) -> Any:
    """Canonical JSON -> the PARAMS dataclass (lists back to tuples); ValueError on a mismatch."""
    from tpubuild.ir.params import _field_kinds

    values = json.loads(text)
    if not isinstance(values, dict):
        raise ValueError("op parameters are not a JSON object")
    kinds = _field_kinds(params_cls)
    unknown = sorted(set(values) - set(kinds))
    if unknown:
        raise ValueError(f"unknown parameters {unknown} for {params_cls.__name__}")
    out = {}
    for name, value in values.items():
        kind = kinds[name][0]
        out[name] = _check_kind(name, kind, value)
    try:
        return params_cls(**out)
    except TypeError as e:
        raise ValueError(f"bad parameters for {params_cls.__name__}: {e}") from None


_SCALAR_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}


def _check_kind(name: str, kind: str, value: Any) -> Any:
    if kind in ("ints", "floats", "strs"):
        if not isinstance(value, list):
            raise ValueError(f"parameter {name}: expected a list, got {value!r}")
        return tuple(_check_kind(name, kind[:-1], v) for v in value)
    if value is None:
        return None
    ok = isinstance(value, _SCALAR_TYPES[kind]) and not (kind in ("int", "float") and isinstance(value, bool))
    if not ok:
        raise ValueError(f"parameter {name}: expected {kind}, got {value!r}")
    return float(value) if kind == "float" else value


# ---- binary records (little-endian; docs/model_format.md) ------------------------------------

GDMA_RECORD = struct.Struct("<IIBBHIQ4qIIIIQ4q")
TENSOR_RECORD = struct.Struct("<BBHB3xQ4I4q8q")
BDC_HEAD = struct.Struct("<IIIIIHH")


def pack_gdma(g: Gdma) -> bytes:
    return GDMA_RECORD.pack(
        g.id,
        g.wait_bdc,
        int(g.direction),
        dtype_code(g.dtype),
        g.lane_start,
        g.local_addr,
        g.ddr_addr,
        *g.ddr_strides,
        *g.shape,
        g.dst_addr,
        *g.dst_strides,
    )


def unpack_gdma(data: bytes, offset: int) -> Gdma:
    f = GDMA_RECORD.unpack_from(data, offset)
    id_, wait, direction, dtype, lane_start, local_addr, ddr_addr = f[:7]
    return Gdma(
        id=id_,
        wait_bdc=wait,
        direction=Direction(direction),
        dtype=dtype_name(dtype),
        ddr_addr=ddr_addr,
        ddr_strides=tuple(f[7:11]),
        local_addr=local_addr,
        lane_start=lane_start,
        shape=tuple(f[11:15]),
        dst_addr=f[15],
        dst_strides=tuple(f[16:20]),
    )


def pack_tensor(t: Tensor) -> bytes:
    if len(t.view) > MAX_VIEW_RANK:
        raise ValueError(f"a kernel view has at most {MAX_VIEW_RANK} dims, got {t.view}")
    view = tuple(t.view) + (0,) * (MAX_VIEW_RANK - len(t.view))
    return TENSOR_RECORD.pack(
        int(t.space), dtype_code(t.dtype), t.lane_start, len(t.view), t.addr, *t.shape, *t.strides, *view
    )


def unpack_tensor(data: bytes, offset: int) -> Tensor:
    f = TENSOR_RECORD.unpack_from(data, offset)
    space, dtype, lane_start, rank, addr = f[:5]
    if rank > MAX_VIEW_RANK:
        raise ValueError(f"view rank {rank} > {MAX_VIEW_RANK}")
    return Tensor(
        space=Space(space),
        dtype=dtype_name(dtype),
        addr=addr,
        lane_start=lane_start,
        shape=tuple(f[5:9]),
        strides=tuple(f[9:13]),
        view=tuple(f[13 : 13 + rank]),
    )


def bdc_record_size(n_tensors: int) -> int:
    return BDC_HEAD.size + n_tensors * TENSOR_RECORD.size


def pack_bdc(b: Bdc, params_offset: int, params_size: int) -> bytes:
    tensors = (*b.operands, *b.results)
    head = BDC_HEAD.pack(
        bdc_record_size(len(tensors)), b.id, b.wait_gdma, params_offset, params_size, len(b.operands), len(b.results)
    )
    return head + b"".join(pack_tensor(t) for t in tensors)


def params_blob(b: Bdc) -> bytes:
    """The params-section entry of a Bdc: its op name and parameters, canonical JSON."""
    return canonical_json({"op": b.op, "params": json.loads(b.params)}).encode("ascii")


def unpack_bdc(
    data: bytes, offset: int, params: Mapping[tuple[int, int], tuple[str, str]] | None, params_section: bytes
) -> tuple[Bdc, int]:
    """(the Bdc at ``offset``, its record size); ValueError for anything malformed."""
    size, id_, wait, p_off, p_size, n_in, n_out = BDC_HEAD.unpack_from(data, offset)
    if size != bdc_record_size(n_in + n_out):
        raise ValueError(f"record size {size} does not match {n_in} operands + {n_out} results")
    if offset + size > len(data):
        raise ValueError(f"record of {size} bytes runs past the section end")
    tensors = [unpack_tensor(data, offset + BDC_HEAD.size + i * TENSOR_RECORD.size) for i in range(n_in + n_out)]
    key = (p_off, p_size)
    if params is not None and key in params:
        op, text = params[key]
    else:
        if p_off + p_size > len(params_section):
            raise ValueError(
                f"params [{p_off}, {p_off + p_size}) outside the params section ({len(params_section)} bytes)"
            )
        blob = json.loads(params_section[p_off : p_off + p_size].decode("ascii"))
        if not (isinstance(blob, dict) and isinstance(blob.get("op"), str) and isinstance(blob.get("params"), dict)):
            raise ValueError('params entry is not {"op": name, "params": {...}}')
        op, text = blob["op"], canonical_json(blob["params"])
        if params is not None:
            params[key] = (op, text)  # type: ignore[index]
    return Bdc(id_, wait, op, text, tuple(tensors[:n_in]), tuple(tensors[n_in:])), size
