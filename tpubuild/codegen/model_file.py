"""The .model file: writer and reader (docs/model_format.md is the byte-level spec).

A model file is self-contained: a JSON header (chip parameters, I/O tensors,
DDR size), the weight blob, the GDMA and BDC command streams and the BDC
parameters, each section checked by sha256. ``read_model`` validates
everything a runtime would trust (bounds of every address a command can
touch, sync ids, op names and parameters) and raises ``ModelFileError`` --
one exception type, naming the file, the section and the command index --
for anything malformed, so the simulator never indexes outside its memories.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from tpubuild.codegen import commands as cmd
from tpubuild.codegen.commands import Bdc, Direction, Gdma, Space, Tensor
from tpubuild.errors import TpuBuildError

MAGIC = b"TPUMODEL"
FORMAT_VERSION = 1
FILE_HEAD = struct.Struct("<8sII")  # magic, format_version, section count
SECTION_ENTRY = struct.Struct("<16sQQ32s")  # name (ASCII, NUL-padded), offset, size, sha256
SECTION_ALIGN = 8
SECTIONS = ("header", "weights", "gdma", "bdc", "params")
COUNT = struct.Struct("<I")

# Sanity caps on what a header may ask a runtime to allocate.
MAX_DDR_BYTES = 1 << 36
MAX_LANES = 1024
MAX_LANE_BYTES = 1 << 26
MAX_SECTIONS = 64


class ModelFileError(TpuBuildError):
    """A malformed or inconsistent model file (or a command reaching outside its memory)."""

    def __init__(
        self,
        problem: str,
        *,
        file: str | None = None,
        section: str | None = None,
        command: int | None = None,
        hint: str | None = None,
    ):
        where = []
        if section is not None:
            where.append(f"section {section!r}")
        if command is not None:
            where.append(f"command {command}")
        super().__init__(
            (", ".join(where) + ": " if where else "") + problem,
            file=file,
            hint=hint or "rebuild the model with `doit codegen:<model>/<target>`",
        )
        self.section = section
        self.command = command


# ---- header ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChipParams:
    """What the runtime and the cycle model need to know about the chip (header["chip"])."""

    name: str
    lanes: int  # NPU lanes
    lane_bytes: int  # local memory per lane
    banks: int  # local memory banks per lane
    eu_bytes: int  # bytes an EU row processes per cycle; local planes align to it
    ddr_bandwidth: float  # bytes per second
    clock_hz: float  # BDC/GDMA clock
    macs_per_lane_per_cycle: Mapping[str, float]  # by mode: INT8, F16, BF16, F32 (as the chip YAML)
    gdma_latency_cycles: int = 0  # fixed cost of each GDMA command
    bdc_overhead_cycles: int = 0  # fixed cost of each BDC command
    ddr_store_bandwidth: float = 0.0  # local -> DDR bytes per second; 0: ddr_bandwidth both ways

    @classmethod
    def from_chip(cls, chip) -> ChipParams:
        """The header figures of a chip model (tpubuild.build.chips.Chip, from configs/chips/<name>.yaml)."""
        return cls(
            name=chip.name,
            lanes=chip.lanes,
            lane_bytes=chip.lmem_bytes,
            banks=chip.lmem_banks,
            eu_bytes=chip.eu_bytes,
            ddr_bandwidth=chip.ddr_gb_s * 1e9,
            clock_hz=chip.clock_mhz * 1e6,
            macs_per_lane_per_cycle=dict(chip.macs),
            gdma_latency_cycles=chip.gdma_latency,
            bdc_overhead_cycles=chip.bdc_overhead,
            ddr_store_bandwidth=(chip.ddr_store_gb_s or 0.0) * 1e9,
        )

    def to_chip(self):
        """A tpubuild.build.chips.Chip with these figures (what the cost formulas take)."""
        from tpubuild.build.chips import Chip

        return Chip(
            name=self.name,
            modes=tuple(sorted(self.macs_per_lane_per_cycle)),
            clock_mhz=self.clock_hz / 1e6,
            lanes=self.lanes,
            eu_bytes=self.eu_bytes,
            lmem_bytes=self.lane_bytes,
            lmem_banks=self.banks,
            macs=tuple(sorted(self.macs_per_lane_per_cycle.items())),
            ddr_gb_s=self.ddr_bandwidth / 1e9,
            gdma_latency=self.gdma_latency_cycles,
            bdc_overhead=self.bdc_overhead_cycles,
            ddr_store_gb_s=self.ddr_store_bandwidth / 1e9 or None,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "lanes": self.lanes,
            "lane_bytes": self.lane_bytes,
            "banks": self.banks,
            "eu_bytes": self.eu_bytes,
            "ddr_bandwidth": self.ddr_bandwidth,
            "clock_hz": self.clock_hz,
            "macs_per_lane_per_cycle": dict(sorted(self.macs_per_lane_per_cycle.items())),
            "gdma_latency_cycles": self.gdma_latency_cycles,
            "bdc_overhead_cycles": self.bdc_overhead_cycles,
            "ddr_store_bandwidth": self.ddr_store_bandwidth,
        }


@dataclass(frozen=True)
class IoTensor:
    """A graph input or output: row-major contiguous at ``ddr_addr``; real = scale * (stored - zero_point)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    ddr_addr: int
    scale: float = 1.0
    zero_point: int = 0
    source: str = ""  # an output's name in the source model where lowering renamed it ("y" of "y_f32")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * cmd.itemsize(self.dtype)

    @property
    def source_name(self) -> str:
        """The name the source model (ONNX) gives this tensor."""
        return self.source or self.name

    def to_json(self) -> dict[str, Any]:
        doc = {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "ddr_addr": self.ddr_addr,
            "scale": self.scale,
            "zero_point": self.zero_point,
        }
        return {**doc, "source": self.source} if self.source else doc


@dataclass(frozen=True)
class Header:
    model: str
    chip: ChipParams
    ddr_size: int  # bytes of DDR the runtime allocates (addresses 0 .. ddr_size-1)
    weight_base: int  # DDR address the weights section is copied to
    inputs: tuple[IoTensor, ...]
    outputs: tuple[IoTensor, ...]
    mode: str = ""  # informational: F32, BF16, F16, INT8
    extra: Mapping[str, Any] = field(default_factory=dict)  # informational, e.g. compiler version

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "mode": self.mode,
            "chip": self.chip.to_json(),
            "ddr_size": self.ddr_size,
            "weight_base": self.weight_base,
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs],
            "extra": dict(self.extra),
        }


@dataclass(frozen=True)
class ModelFile:
    header: Header
    weights: bytes
    gdma: tuple[Gdma, ...]
    bdc: tuple[Bdc, ...]


# ---- writer ------------------------------------------------------------------------------


def encode_model(model: ModelFile, *, validate: bool = True) -> bytes:
    """The file's bytes (deterministic), validated as the reader would (tests may skip that)."""
    params_section = bytearray()
    offsets: dict[bytes, int] = {}
    bdc_records = [COUNT.pack(len(model.bdc))]
    for b in model.bdc:
        blob = cmd.params_blob(b)
        if blob not in offsets:
            offsets[blob] = len(params_section)
            params_section += blob
        bdc_records.append(cmd.pack_bdc(b, offsets[blob], len(blob)))
    header = cmd.canonical_json(model.header.to_json()).encode("ascii")
    payloads = {
        "header": header,
        "weights": bytes(model.weights),
        "gdma": COUNT.pack(len(model.gdma)) + b"".join(cmd.pack_gdma(g) for g in model.gdma),
        "bdc": b"".join(bdc_records),
        "params": bytes(params_section),
    }
    offset = cmd.align_up(FILE_HEAD.size + len(payloads) * SECTION_ENTRY.size, SECTION_ALIGN)
    table, body = [], bytearray()
    for name, data in payloads.items():
        table.append(SECTION_ENTRY.pack(name.encode("ascii"), offset, len(data), hashlib.sha256(data).digest()))
        padded = data + b"\0" * (cmd.align_up(len(data), SECTION_ALIGN) - len(data))
        body += padded
        offset += len(padded)
    head = FILE_HEAD.pack(MAGIC, FORMAT_VERSION, len(payloads)) + b"".join(table)
    head += b"\0" * (cmd.align_up(len(head), SECTION_ALIGN) - len(head))
    data = head + bytes(body)
    if validate:
        decode_model(data, file="<being written>")  # never write a file the reader would refuse
    return data


def write_model(path: str | os.PathLike, model: ModelFile) -> None:
    from tpubuild.build.files import write_bytes

    write_bytes(path, encode_model(model))


# ---- reader ------------------------------------------------------------------------------


def read_model(path: str | os.PathLike) -> ModelFile:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ModelFileError(f"cannot read the model file: {e.strerror or e}", file=str(path)) from None
    return decode_model(data, file=str(path))


def decode_model(data: bytes, *, file: str = "<bytes>") -> ModelFile:
    """Parse and validate a model file; ModelFileError for anything malformed."""
    sections = _sections(data, file)
    header = _header(sections["header"], file)
    weights = sections["weights"]
    if header.weight_base + len(weights) > header.ddr_size:
        raise ModelFileError(
            f"weights [{header.weight_base}, {header.weight_base + len(weights)}) do not fit in "
            f"DDR of {header.ddr_size} bytes",
            file=file,
            section="weights",
        )
    gdma = _gdma(sections["gdma"], file)
    bdc = _bdc(sections["bdc"], sections["params"], file)
    model = ModelFile(header, weights, gdma, bdc)
    Validator(model, file).check()
    return model


def _sections(data: bytes, file: str) -> dict[str, bytes]:
    """Section name -> payload, each checked: in the file, past the table, checksummed, apart from the others."""
    count, table_end = _file_head(data, file)
    found: dict[str, bytes] = {}
    spans = []
    for i in range(count):
        name, offset, size = _section_entry(data, i, table_end, found, file)
        spans.append((offset, size, name))
        found[name] = data[offset : offset + size]
    _check_spans(sorted(spans), table_end, len(data), file)
    missing = [s for s in SECTIONS if s not in found]
    if missing:
        raise ModelFileError(f"missing section(s) {', '.join(missing)}", file=file)
    return found


def _file_head(data: bytes, file: str) -> tuple[int, int]:
    """The section count and where the section table ends, from the checked file header."""
    if len(data) < FILE_HEAD.size:
        raise ModelFileError(
            f"truncated: {len(data)} bytes, shorter than the {FILE_HEAD.size}-byte file header", file=file
        )
    magic, version, count = FILE_HEAD.unpack_from(data, 0)
    if magic != MAGIC:
        raise ModelFileError(
            f"not a tpubuild model file (magic {magic!r}, expected {MAGIC!r})",
            file=file,
            hint="pass the .model file codegen wrote",
        )
    if version != FORMAT_VERSION:
        raise ModelFileError(
            f"format version {version}; this runtime reads version {FORMAT_VERSION}",
            file=file,
            hint="rebuild the model with this tpubuild version",
        )
    if count > MAX_SECTIONS:
        raise ModelFileError(f"section count {count} > {MAX_SECTIONS}", file=file)
    table_end = FILE_HEAD.size + count * SECTION_ENTRY.size
    if table_end > len(data):
        raise ModelFileError(
            f"truncated: the section table needs {table_end} bytes, the file has {len(data)}", file=file
        )
    return count, table_end


def _section_entry(data: bytes, i: int, table_end: int, found: Mapping[str, bytes], file: str) -> tuple[str, int, int]:
    """Section table entry i's name, offset and size, checked (name, place in the file, checksum)."""
    raw_name, offset, size, digest = SECTION_ENTRY.unpack_from(data, FILE_HEAD.size + i * SECTION_ENTRY.size)
    try:
        name = raw_name.rstrip(b"\0").decode("ascii")
    except UnicodeDecodeError:
        raise ModelFileError(f"section table entry {i} has a non-ASCII name {raw_name!r}", file=file) from None
    if not name or "\0" in name:
        raise ModelFileError(f"section table entry {i} has a malformed name {raw_name!r}", file=file)
    if name in found:
        raise ModelFileError("section appears twice in the section table", file=file, section=name)
    if offset < table_end or offset + size > len(data):
        raise ModelFileError(
            f"truncated or misplaced: [{offset}, {offset + size}) is outside the file's "
            f"payload [{table_end}, {len(data)})",
            file=file,
            section=name,
        )
    if hashlib.sha256(data[offset : offset + size]).digest() != digest:
        raise ModelFileError("checksum mismatch (sha256): the file is corrupt", file=file, section=name)
    return name, offset, size


def _check_spans(spans: Sequence[tuple[int, int, str]], table_end: int, size: int, file: str) -> None:
    """Sections (sorted by offset) apart from each other, the last ending the file at its alignment."""
    for (o1, s1, n1), (o2, _, n2) in itertools.pairwise(spans):
        if o1 + s1 > o2:
            raise ModelFileError(f"overlaps section {n2!r}", file=file, section=n1)
    end = cmd.align_up(max((o + s for o, s, _ in spans), default=table_end), SECTION_ALIGN)
    if size != end:
        raise ModelFileError(
            f"truncated or padded: the sections end at {end} bytes (8-aligned), the file has {size}", file=file
        )


def _require(cond: bool, problem: str, file: str, section: str, command: int | None = None) -> None:
    if not cond:
        raise ModelFileError(problem, file=file, section=section, command=command)


def _int(value: Any, lo: int = 0, hi: int = 1 << 62) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"expected an integer in [{lo}, {hi}], got {value!r}")
    return value


def _num(value: Any, positive: bool = True) -> float:
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or (positive and value <= 0)
    ):
        raise ValueError(f"expected a {'positive ' if positive else ''}finite number, got {value!r}")
    return float(value)


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def _io(doc: Any) -> IoTensor:
    if not isinstance(doc, dict):
        raise ValueError(f"an I/O tensor is a JSON object, got {doc!r}")
    shape = doc.get("shape")
    if not isinstance(shape, list):
        raise ValueError(f"shape: expected a list, got {shape!r}")
    dtype = _str(doc.get("dtype"))
    cmd.dtype_code(dtype)
    return IoTensor(
        name=_str(doc.get("name")),
        shape=tuple(_int(d, 0, 1 << 31) for d in shape),
        dtype=dtype,
        ddr_addr=_int(doc.get("ddr_addr")),
        scale=_num(doc.get("scale", 1.0)),
        zero_point=_int(doc.get("zero_point", 0), -(1 << 31), 1 << 31),
        source=_str(doc["source"]) if "source" in doc else "",
    )


def _chip(doc: Any) -> ChipParams:
    if not isinstance(doc, dict):
        raise ValueError("chip: expected a JSON object")
    macs = doc.get("macs_per_lane_per_cycle")
    if not isinstance(macs, dict):
        raise ValueError("chip.macs_per_lane_per_cycle: expected a JSON object")
    return ChipParams(
        name=_str(doc.get("name")),
        lanes=_int(doc.get("lanes"), 1, MAX_LANES),
        lane_bytes=_int(doc.get("lane_bytes"), 1, MAX_LANE_BYTES),
        banks=_int(doc.get("banks"), 1, 1 << 10),
        eu_bytes=_int(doc.get("eu_bytes"), 1, 1 << 12),
        ddr_bandwidth=_num(doc.get("ddr_bandwidth")),
        clock_hz=_num(doc.get("clock_hz")),
        macs_per_lane_per_cycle={_str(k): _num(v) for k, v in macs.items()},
        gdma_latency_cycles=_int(doc.get("gdma_latency_cycles", 0)),
        bdc_overhead_cycles=_int(doc.get("bdc_overhead_cycles", 0)),
        ddr_store_bandwidth=_num(doc["ddr_store_bandwidth"]) if doc.get("ddr_store_bandwidth") else 0.0,
    )


def _header(payload: bytes, file: str) -> Header:
    try:
        doc = json.loads(payload.decode("utf-8"))
        if not isinstance(doc, dict):
            raise ValueError("the header is not a JSON object")
        extra = doc.get("extra", {})
        if not isinstance(extra, dict):
            raise ValueError("extra: expected a JSON object")
        inputs, outputs = doc.get("inputs"), doc.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list):
            raise ValueError("inputs and outputs must be lists")
        header = Header(
            model=_str(doc.get("model")),
            mode=_str(doc.get("mode", "")),
            chip=_chip(doc.get("chip")),
            ddr_size=_int(doc.get("ddr_size"), 1, MAX_DDR_BYTES),
            weight_base=_int(doc.get("weight_base")),
            inputs=tuple(_io(t) for t in inputs),
            outputs=tuple(_io(t) for t in outputs),
            extra=extra,
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ModelFileError(f"malformed header: {e}", file=file, section="header") from None
    for t in (*header.inputs, *header.outputs):
        _require(
            t.ddr_addr + t.nbytes <= header.ddr_size,
            f"I/O tensor {t.name!r} at [{t.ddr_addr}, {t.ddr_addr + t.nbytes}) is outside DDR [0, {header.ddr_size})",
            file,
            "header",
        )
    names = [t.name for t in header.inputs] + [t.name for t in header.outputs]
    _require(
        len(set(t.name for t in header.inputs)) == len(header.inputs)
        and len(set(t.name for t in header.outputs)) == len(header.outputs),
        f"duplicate I/O tensor names in {names}",
        file,
        "header",
    )
    return header


def _gdma(payload: bytes, file: str) -> tuple[Gdma, ...]:
    _require(len(payload) >= COUNT.size, "truncated: no command count", file, "gdma")
    (count,) = COUNT.unpack_from(payload, 0)
    expect = COUNT.size + count * cmd.GDMA_RECORD.size
    _require(
        len(payload) == expect, f"{count} commands need {expect} bytes, the section has {len(payload)}", file, "gdma"
    )
    out = []
    for i in range(count):
        try:
            out.append(cmd.unpack_gdma(payload, COUNT.size + i * cmd.GDMA_RECORD.size))
        except ValueError as e:
            raise ModelFileError(str(e), file=file, section="gdma", command=i) from None
    return tuple(out)


def _bdc(payload: bytes, params_section: bytes, file: str) -> tuple[Bdc, ...]:
    _require(len(payload) >= COUNT.size, "truncated: no command count", file, "bdc")
    (count,) = COUNT.unpack_from(payload, 0)
    out: list[Bdc] = []
    cache: dict = {}
    offset = COUNT.size
    for i in range(count):
        _require(
            offset + cmd.BDC_HEAD.size <= len(payload),
            f"truncated: {count} commands announced, the section ends after {i}",
            file,
            "bdc",
            i,
        )
        try:
            b, size = cmd.unpack_bdc(payload, offset, cache, params_section)
        except (ValueError, struct.error, RecursionError) as e:
            raise ModelFileError(str(e), file=file, section="bdc", command=i) from None
        out.append(b)
        offset += size
    _require(offset == len(payload), f"{len(payload) - offset} stray bytes after the last command", file, "bdc")
    return tuple(out)


# ---- validation: everything the simulator relies on ----------------------------------------


class Validator:
    """Static checks of a decoded model: sync ids, op names and parameters, every memory range."""

    def __init__(self, model: ModelFile, file: str):
        self.model = model
        self.file = file
        self.chip = model.header.chip

    def fail(self, section: str, index: int, problem: str) -> NoReturn:
        raise ModelFileError(problem, file=self.file, section=section, command=index)

    def check(self) -> None:
        n_gdma, n_bdc = len(self.model.gdma), len(self.model.bdc)
        for i, g in enumerate(self.model.gdma):
            if g.id != i + 1:
                self.fail("gdma", i, f"id {g.id}, expected {i + 1} (ids count from 1 in queue order)")
            if g.wait_bdc > n_bdc:
                self.fail("gdma", i, f"waits for BDC command {g.wait_bdc}, the queue has {n_bdc}")
            self.gdma_ranges(i, g)
        for i, b in enumerate(self.model.bdc):
            if b.id != i + 1:
                self.fail("bdc", i, f"id {b.id}, expected {i + 1} (ids count from 1 in queue order)")
            if b.wait_gdma > n_gdma:
                self.fail("bdc", i, f"waits for GDMA command {b.wait_gdma}, the queue has {n_gdma}")
            self.bdc_op(i, b)
            for j, t in enumerate(b.operands):
                self.tensor(i, j, t, is_result=False)
            for j, t in enumerate(b.results):
                self.tensor(i, j, t, is_result=True)
        self.deadlock_free()

    def ddr_range(self, section: str, index: int, addr: int, shape, strides, dtype: str, what: str) -> None:
        if any(s < 0 or s > self.model.header.ddr_size for s in strides):
            self.fail(section, index, f"{what}: a stride in {tuple(strides)} is negative or beyond DDR")
        if 0 in shape:
            return
        end = addr + (sum((d - 1) * s for d, s in zip(shape, strides, strict=True)) + 1) * cmd.itemsize(dtype)
        if end > self.model.header.ddr_size:
            self.fail(
                section, index, f"{what}: DDR range [{addr}, {end}) is outside DDR [0, {self.model.header.ddr_size})"
            )

    def local_range(
        self, section: str, index: int, addr: int, lane_start: int, shape, dtype: str, what: str, plane: int = 0
    ) -> None:
        if lane_start >= self.chip.lanes:
            self.fail(section, index, f"{what}: lane_start {lane_start} >= {self.chip.lanes} lanes")
        if plane and (plane < shape[2] * shape[3] * cmd.itemsize(dtype) or plane > self.chip.lane_bytes):
            self.fail(
                section,
                index,
                f"{what}: plane stride {plane} does not hold a {shape[2]} x {shape[3]} {dtype} plane inside a lane",
            )
        end = addr + cmd.local_bytes(shape, dtype, lane_start, self.chip.lanes, self.chip.eu_bytes, plane)
        if end > self.chip.lane_bytes:
            self.fail(
                section, index, f"{what}: local range [{addr}, {end}) is outside a lane's {self.chip.lane_bytes} bytes"
            )

    def gdma_ranges(self, i: int, g: Gdma) -> None:
        if g.direction == Direction.DDR2DDR:
            self.ddr_range("gdma", i, g.ddr_addr, g.shape, g.ddr_strides, g.dtype, "source")
            self.ddr_range("gdma", i, g.dst_addr, g.shape, g.dst_strides, g.dtype, "destination")
            return
        self.ddr_range("gdma", i, g.ddr_addr, g.shape, g.ddr_strides, g.dtype, "DDR side")
        if g.direction == Direction.STORE and 0 in g.ddr_strides and 0 not in g.shape:
            self.fail("gdma", i, "a STORE with a zero DDR stride writes one address several times")
        self.local_range("gdma", i, g.local_addr, g.lane_start, g.shape, g.dtype, "local side", g.local_plane)

    def bdc_op(self, i: int, b: Bdc) -> None:
        op_cls = tpu_op_class(b.op)
        if op_cls is None:
            self.fail("bdc", i, f"unknown op {b.op!r}")
        try:
            cmd.decode_params(op_cls.PARAMS, b.params)
        except (ValueError, RecursionError) as e:
            self.fail("bdc", i, f"{b.op}: {e}")
        if all(t.space == Space.NONE for t in b.results):
            self.fail("bdc", i, f"{b.op} keeps none of its results")

    def tensor(self, i: int, j: int, t: Tensor, is_result: bool) -> None:
        what = f"{'result' if is_result else 'operand'} {j}"
        if t.space == Space.NONE:
            return
        if math.prod(t.view) != t.size():
            self.fail("bdc", i, f"{what}: view {t.view} does not hold the {t.size()} elements of {t.shape}")
        if t.space == Space.DDR:
            self.ddr_range("bdc", i, t.addr, t.shape, t.strides, t.dtype, what)
        else:
            self.local_range("bdc", i, t.addr, t.lane_start, t.shape, t.dtype, what, t.plane)

    def deadlock_free(self) -> None:
        """Both queues can run to the end under their sync waits (no cycle of waits)."""
        gdma, bdc = self.model.gdma, self.model.bdc
        gi = bi = 0
        while gi < len(gdma) or bi < len(bdc):
            moved = False
            while gi < len(gdma) and gdma[gi].wait_bdc <= bi:
                gi += 1
                moved = True
            while bi < len(bdc) and bdc[bi].wait_gdma <= gi:
                bi += 1
                moved = True
            if not moved:
                self.fail(
                    "gdma",
                    gi,
                    f"deadlock: GDMA {gi + 1} waits for BDC {gdma[gi].wait_bdc} which waits "
                    f"for GDMA {bdc[bi].wait_gdma}",
                )


def tpu_op_class(name: str) -> type | None:
    from tpubuild.ir import tpu

    return _tpu_ops(tpu).get(name)


_OPS: dict[str, type] = {}


def _tpu_ops(tpu_module) -> dict[str, type]:
    if not _OPS:
        _OPS.update({cls.name: cls for cls in tpu_module.TPU_OPS})
    return _OPS


def chip_params(chip: Mapping[str, Any]) -> ChipParams:
    """ChipParams from a mapping with the header's keys (raises ValueError naming the bad field)."""
    return _chip(dict(chip))


def io_tensors(docs: Sequence[Mapping[str, Any]]) -> tuple[IoTensor, ...]:
    return tuple(_io(dict(d)) for d in docs)
