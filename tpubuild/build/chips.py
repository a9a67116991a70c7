"""Chip models: configs/chips/<name>.yaml validated against configs/schema/chip.schema.json.

Cheap to import (yaml and jsonschema only): the task graph reads a chip's
modes to refuse an unsupported target before any work is done.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from tpubuild.errors import TpuBuildError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
CHIPS_DIR = CONFIGS / "chips"
SCHEMA_PATH = CONFIGS / "schema" / "chip.schema.json"

# Where an INT8 target computes what stays in float, best first: F16 keeps 3 more
# mantissa bits than BF16 where the chip has both.
FLOAT_PREFERENCE = ("F16", "BF16", "F32")


@dataclass(frozen=True)
class Chip:
    name: str
    modes: tuple[str, ...]
    file: Path | None = None
    # hardware figures (the backend stages and the cycle model; see configs/schema/chip.schema.json)
    clock_mhz: float = 1000.0
    lanes: int = 64
    eu_bytes: int = 64
    lmem_bytes: int = 256 * 1024  # per lane
    lmem_banks: int = 16
    macs: tuple[tuple[str, float], ...] = ()  # (mode, MACs per lane per cycle; a .model file may hold a fraction)
    ddr_bytes: int = 1 << 32
    ddr_gb_s: float = 64.0
    ddr_align: int = 64
    gdma_latency: int = 0  # cycles per GDMA transfer
    bdc_overhead: int = 0  # cycles per BDC command
    ddr_store_gb_s: float | None = None  # local -> DDR bandwidth where it differs from ddr_gb_s (DDR -> local)

    def macs_per_lane(self, mode: str) -> float:
        """Peak MACs per lane per cycle in ``mode`` (F32, BF16, F16, INT8)."""
        rates = dict(self.macs)
        if mode not in rates:
            raise TpuBuildError(
                f"chip {self.name} has no MAC rate for {mode}",
                file=str(self.file) if self.file else None,
                hint=f"add {mode} to macs_per_lane_per_cycle",
            )
        return rates[mode]

    @property
    def ddr_bytes_per_cycle(self) -> float:
        """DDR -> local (and DDR -> DDR read) bytes per cycle."""
        return self.ddr_gb_s * 1e9 / (self.clock_mhz * 1e6)

    @property
    def ddr_store_bytes_per_cycle(self) -> float:
        """local -> DDR bytes per cycle."""
        return (self.ddr_store_gb_s or self.ddr_gb_s) * 1e9 / (self.clock_mhz * 1e6)

    @property
    def lmem_bank_bytes(self) -> int:
        return self.lmem_bytes // self.lmem_banks

    @property
    def float_mode(self) -> str:
        """The float mode an INT8 target falls back to for ops that stay in float."""
        return next(m for m in FLOAT_PREFERENCE if m in self.modes)

    def check_mode(self, mode: str, *, what: str = "mode") -> None:
        if mode not in self.modes:
            raise TpuBuildError(
                f"chip {self.name} does not support {what} {mode}; it supports {', '.join(self.modes)}",
                file=str(self.file) if self.file else None,
                hint=f"pick one of {', '.join(self.modes)} for {self.name}",
            )


def known_chips() -> list[str]:
    return sorted(p.stem for p in CHIPS_DIR.glob("*.yaml"))


@functools.cache
def _validator():
    from jsonschema.validators import validator_for

    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    return validator_for(schema)(schema)


# Chip files (path -> mtime, ctime, size, inode) that passed validation: _TRUSTED in an earlier
# process (the task graph's ManifestCache hands them over: importing jsonschema and validating costs
# ~0.1 s on every doit run), _VALIDATED in this one.
_TRUSTED: dict[str, list[int]] = {}
_VALIDATED: dict[str, list[int]] = {}


def trust(stamps: dict[str, list[int]]) -> None:
    """Skip schema validation of chip files still in the state they were validated in."""
    _TRUSTED.update(stamps)


def validated() -> dict[str, list[int]]:
    """The chip files this process validated (or trusted), with their state then."""
    return dict(_VALIDATED)


@functools.cache
def load_chip(name: str) -> Chip:
    """The chip called ``name``; a TpuBuildError names the known chips or the bad fields."""
    from tpubuild.build.manifest import file_stamp, json_path, read_yaml

    path = CHIPS_DIR / f"{name}.yaml"
    if not path.is_file():
        raise TpuBuildError(
            f"unknown chip {name!r}; known chips: {', '.join(known_chips())}", hint=f"add {path} or use a known chip"
        )
    stamp = file_stamp(path)  # before reading: a change meanwhile shows as a new state next time
    data = read_yaml(path)
    trusted = _TRUSTED.get(str(path)) == stamp
    errors = [] if trusted else [f"{json_path(e.absolute_path)}: {e.message}" for e in _validator().iter_errors(data)]
    if not errors and data["name"] != name:
        errors.append(f"name: {data['name']!r} differs from the file name {name!r}")
    if errors:
        raise TpuBuildError(
            "invalid chip file:\n  " + "\n  ".join(errors), file=str(path), hint=f"the chip format is {SCHEMA_PATH}"
        )
    modes = tuple(data["modes"])
    if not any(m in modes for m in FLOAT_PREFERENCE):
        raise TpuBuildError("a chip needs at least one float mode (F16, BF16 or F32)", file=str(path))
    missing = [m for m in modes if m not in data["macs_per_lane_per_cycle"]]
    if missing:
        raise TpuBuildError(f"macs_per_lane_per_cycle has no rate for mode {', '.join(missing)}", file=str(path))
    lmem, ddr = data["local_memory"], data["ddr"]
    _VALIDATED[str(path)] = stamp
    return Chip(
        name=name,
        modes=modes,
        file=path,
        clock_mhz=float(data["clock_mhz"]),
        lanes=data["lanes"],
        eu_bytes=data["eu_bytes"],
        lmem_bytes=lmem["bytes_per_lane"],
        lmem_banks=lmem["banks"],
        macs=tuple(sorted(data["macs_per_lane_per_cycle"].items())),
        ddr_bytes=ddr["bytes"],
        ddr_gb_s=float(ddr["bandwidth_gb_s"]),
        ddr_align=ddr["align_bytes"],
        gdma_latency=data["gdma_latency_cycles"],
        bdc_overhead=data["bdc_overhead_cycles"],
        ddr_store_gb_s=ddr.get("store_bandwidth_gb_s"),
    )
