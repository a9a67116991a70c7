"""The quantize table: ``#`` comments, then ``op_name MODE`` lines pinning ops to a float mode.

An op is named by its tensor name (any of its results' for a multi-result op),
as in canonical.mlir's locations. MODE is F32, BF16 or F16: the op computes in
that mode whatever the target's, with casts around it (mixed precision).
"""

from __future__ import annotations

import os

from tpubuild.errors import TpuBuildError, read_user_text

FLOAT_MODES = ("F32", "BF16", "F16")


def parse_quantize_table(text: str, *, file: str = "<quantize table>") -> dict[str, str]:
    """op name -> float mode; a malformed line or an unknown mode is an error naming its line."""
    table: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) != 2 or fields[1].upper() not in FLOAT_MODES:
            raise TpuBuildError(
                f"line {number}: expected 'op_name MODE' with MODE one of {', '.join(FLOAT_MODES)}, got {line!r}",
                file=file,
                hint="a quantize table pins ops to a float mode; unpinned ops get the target's",
            )
        table[fields[0]] = fields[1].upper()
    return table


def read_quantize_table(path: str | os.PathLike) -> dict[str, str]:
    text = read_user_text(
        path, "quantize table", hint="check quantize_table in the manifest (a path relative to the manifest)"
    )
    return parse_quantize_table(text, file=str(path))
