"""The calibration table: TPU-MLIR's text format, one tensor per line.

    # tpubuild calibration table
    # model: demo_cnn
    ...
    # op_name threshold min max
    input 2.64 -2.11 2.64
    stem.relu 3.1875 0.0 4.52

``#`` lines are comments (the header); every other non-blank line is
``name threshold min max``, separated by whitespace. Numbers are written so
they read back exactly (Python's shortest round-trip form, with no ``+`` in
exponents so TPU-MLIR's own parser accepts them too). Reading stops at a
``#int4_th`` or ``#weight_scale`` line: what TPU-MLIR writes after those are
other tables. docs/calibration_table.md describes the format for users.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tpubuild.errors import TpuBuildError, read_user_text

_STOP_SECTIONS = ("#int4_th", "#weight_scale")
COLUMNS = "# op_name threshold min max"


@dataclass(frozen=True)
class Entry:
    threshold: float
    min: float
    max: float

    @property
    def signed(self) -> bool:
        return self.min < 0

    def calibrated_range(self) -> tuple[float, float]:
        """The symmetric range cali.mlir records: [-T, T], or [0, T] for a non-negative tensor (as TPU-MLIR)."""
        return (-self.threshold if self.signed else 0.0, self.threshold)


def number(x: float) -> str:
    return repr(float(x)).replace("e+", "e")


def format_table(entries: Mapping[str, Entry], header: Sequence[str] = ()) -> str:
    """The table text: header comment lines, the column line, then the entries in the given order."""
    lines = [h if h.startswith("#") else f"# {h}" for h in header] + [COLUMNS]
    for name, e in entries.items():
        if not name or any(ch.isspace() for ch in name):
            raise TpuBuildError(
                f"tensor name {name!r} contains whitespace, which the calibration table format cannot hold",
                loc=name,
                hint="rename the tensor in the source model",
            )
        lines.append(f"{name} {number(e.threshold)} {number(e.min)} {number(e.max)}")
    return "\n".join(lines) + "\n"


def parse_table(text: str, *, file: str = "<table>") -> tuple[list[str], dict[str, Entry]]:
    """(header lines, entries by name) of a table; a malformed line is an error naming its line number."""
    header: list[str] = []
    entries: dict[str, Entry] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            if line.startswith(_STOP_SECTIONS):
                break
            header.append(line)
            continue
        fields = line.split()
        problem = _check_line(fields)
        if problem:
            raise TpuBuildError(
                f"line {lineno}: {problem}: {raw.strip()!r}",
                file=file,
                hint="each line is `name threshold min max`, with threshold > 0 and min <= max; "
                "see docs/calibration_table.md",
            )
        name = fields[0]
        if name in entries:
            raise TpuBuildError(f"line {lineno}: tensor {name!r} is listed twice", file=file)
        entries[name] = Entry(*(float(f) for f in fields[1:]))
    return header, entries


def _check_line(fields: list[str]) -> str | None:
    if len(fields) != 4:
        return f"expected 4 fields, found {len(fields)}"
    try:
        th, lo, hi = (float(f) for f in fields[1:])
    except ValueError:
        return "threshold, min and max must be numbers"
    if not all(math.isfinite(v) for v in (th, lo, hi)):
        return "threshold, min and max must be finite"
    if th <= 0:
        return "the threshold must be > 0"
    if lo > hi:
        return "min is greater than max"
    return None


def read_table(path: str | os.PathLike) -> tuple[list[str], dict[str, Entry]]:
    text = read_user_text(
        path, "calibration table", hint="check calibration.table in the manifest (a path relative to the manifest)"
    )
    return parse_table(text, file=str(path))
