"""The report's charts, as inline SVG written directly: byte-identical for the same data, text kept as text
(the page's font), each chart drawn in milliseconds. Not matplotlib: laying out its tick labels took most of
a second per page, every target of the zoo drawing one.

Sizes are in points (1/72 inch), as the page lays them out; a text's width is estimated from its length
(``CHAR``), which is all the layout needs: margins sized for the longest label.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

PASS_COLOR, FAIL_COLOR, EXACT_COLOR, WORST_COLOR = "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e"
GROUP_COLORS = ("#d9d9d9", "#b0b0b0")  # alternate, so neighbouring groups stay apart
GDMA_COLORS = {"load": "#4c72b0", "store": "#55a868", "ddr2ddr": "#8172b2"}
# op types of the BDC lane, in a fixed order of colours
OP_PALETTE = [
    "#dd8452",
    "#c44e52",
    "#937860",
    "#da8bc3",
    "#8c8c8c",
    "#ccb974",
    "#64b5cd",
    "#a1c9f4",
    "#ffb482",
    "#8de5a1",
    "#ff9f9b",
    "#d0bbff",
    "#debb9b",
    "#fab0e4",
    "#cfcfcf",
    "#fffea3",
]
MAX_LABELS = 60  # more tensors than this: label every k-th so the names stay legible
CHAR = 0.6  # a character's width in DejaVu Sans, about, as a share of the font size
AXIS = 'stroke="#000000" stroke-width="0.8"'
GRID = 'stroke="#eeeeee" stroke-width="0.6"'


def _svg(width: float, height: float) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink" '
        f'width="{width:.1f}pt" height="{height:.1f}pt" viewBox="0 0 {width:.1f} {height:.1f}" '
        'font-family="DejaVu Sans, sans-serif" font-size="9">'
        f'<rect width="{width:.1f}" height="{height:.1f}" fill="#ffffff"/>'
    )


def _text(
    x: float, y: float, text: str, size: float = 9, anchor: str = "start", fill: str = "", turn: bool = False
) -> str:
    """A text at (x, y) (its baseline), or with ``turn`` rotated to read upwards, its end (anchor "end") at (x, y)."""
    color = f' fill="{fill}"' if fill else ""
    where = f'transform="translate({x:.1f} {y:.1f}) rotate(-90)"' if turn else f'x="{x:.1f}" y="{y:.1f}"'
    return f'<text {where} text-anchor="{anchor}" font-size="{size:g}"{color}>{escape(text)}</text>'


def _width(text: str, size: float) -> float:
    return CHAR * size * len(text)


@dataclass(frozen=True)
class Point:
    """One tensor of a comparison, in graph order."""

    name: str
    cos: float
    euc: float
    sqnr: float
    passed: bool
    exact: bool  # EQUAL or CLOSE


def similarity_chart(
    points: Sequence[Point], cos_tol: float, euc_tol: float, highlight: int | None, highlight_failed: bool, salt: str
) -> str:
    """Cosine, euclidean and SQNR per tensor (x: graph order), tolerances dashed, one tensor marked."""
    n = len(points)
    step = max(1, math.ceil(n / MAX_LABELS))
    named = list(range(0, n, step))
    names = [_short(points[i].name) for i in named]
    width = 72 * min(14.0, max(6.5, 0.16 * n + 2.5))
    panel = 72 * (4.6 if n <= MAX_LABELS else 4.0) / 4
    metrics = [
        ("cosine", [p.cos for p in points], cos_tol),
        ("euclidean", [p.euc for p in points], euc_tol),
        ("SQNR (dB)", [p.sqnr for p in points], None),
    ]
    ranges = [_metric_range(title, values, tol) for title, values, tol in metrics]
    ticks = [_ticks(lo, hi) for lo, hi in ranges]
    left = 14 + max(_width(label, 8) for t in ticks for _, label in t) + 10
    right = 12
    top = 30 + (16 if highlight is not None else 0)
    bottom = 6 + max((_width(name, 7) for name in names), default=4) + 20
    gap = 10
    height = top + 3 * panel + 2 * gap + bottom
    x0, x1 = left, width - right

    def x_of(i: float) -> float:
        return x0 + (i + 0.6) / max(n, 1) * (x1 - x0)

    out = [_svg(width, height), ""]  # then the markers drawn: their shapes, once each (ids only for those used)
    used: set[str] = set()
    for k, ((title, values, tol), (lo, hi), marks) in enumerate(zip(metrics, ranges, ticks, strict=True)):
        y0 = top + k * (panel + gap)
        y1 = y0 + panel

        def y_of(v: float, lo=lo, hi=hi, y0=y0, y1=y1) -> float:
            return y1 - (v - lo) / (hi - lo) * (y1 - y0)

        for value, label in marks:  # grid and tick labels
            y = y_of(value)
            out.append(f'<path d="M{x0:.1f} {y:.1f}H{x1:.1f}" {GRID}/>')
            out.append(f'<path d="M{x0 - 3.5:.1f} {y:.1f}H{x0:.1f}" {AXIS}/>')
            out.append(_text(x0 - 5, y + 3, label, 8, "end"))
        out.append(_text(x0 - left + 10, (y0 + y1) / 2, title, 9, "middle", turn=True))
        if tol is not None:
            y = y_of(tol)
            out.append(
                f'<path d="M{x0:.1f} {y:.1f}H{x1:.1f}" stroke="{FAIL_COLOR}" stroke-width="0.9" '
                'stroke-dasharray="3.3 1.4"/>'
            )
            out.append(_text(x1 - 2, y - 2, f"tolerance {tol:g}", 7, "end", FAIL_COLOR))
        if highlight is not None:
            color = FAIL_COLOR if highlight_failed else WORST_COLOR
            x = x_of(highlight)
            out.append(
                f'<path d="M{x:.1f} {y0:.1f}V{y1:.1f}" stroke="{color}" stroke-width="1.2" stroke-opacity="0.6"/>'
            )
        plotted = [min(max(v, lo), hi) if not math.isnan(v) else lo for v in values]
        if n:
            line = " ".join(f"{x_of(i):.1f} {y_of(v):.1f}" for i, v in enumerate(plotted))
            out.append(f'<path d="M{line}" fill="none" stroke="#bbbbbb" stroke-width="0.8"/>')
        for i, (v, y, p) in enumerate(zip(values, plotted, points, strict=True)):
            color = EXACT_COLOR if p.exact else PASS_COLOR if p.passed else FAIL_COLOR
            # inf SQNR (no noise) at the top, NaN (nothing comparable) at the bottom, as triangles
            mark = "dot" if math.isfinite(v) and lo <= v <= hi else "tri"
            used.add(mark)
            out.append(f'<use xlink:href="#{salt}-{mark}" x="{x_of(i):.1f}" y="{y_of(y):.1f}" fill="{color}"/>')
        out.append(f'<path d="M{x0:.1f} {y0:.1f}V{y1:.1f}H{x1:.1f}" fill="none" {AXIS}/>')
    y1 = top + 3 * panel + 2 * gap
    for i, name in zip(named, names, strict=True):
        x = x_of(i)
        out.append(f'<path d="M{x:.1f} {y1:.1f}V{y1 + 3.5:.1f}" {AXIS}/>')
        out.append(_text(x + 2.5, y1 + 6, name, 7, "end", turn=True))
    axis = f"tensor in graph order ({n})" + (f", 1 in {step} named" if step > 1 else "")
    out.append(_text((x0 + x1) / 2, height - 6, axis, 9, "middle"))
    if highlight is not None and 0 <= highlight < n:
        color = FAIL_COLOR if highlight_failed else WORST_COLOR
        what = "first below tolerance" if highlight_failed else "lowest cosine"
        out.append(_text(x0, top - 6, f"{what}: {points[highlight].name}", 9, fill=color))
    x = width - 6
    for color, label in reversed(LEGEND):  # right-aligned
        x -= _width(label, 7)
        out.append(_text(x, 14, label, 7))
        x -= 14
        out.append(f'<rect x="{x:.1f}" y="7" width="10" height="7" fill="{color}"/>')
        x -= 14
    out[1] = "<defs>" + "".join(f'<path id="{salt}-{m}" d="{MARKERS[m]}"/>' for m in sorted(used)) + "</defs>"
    out.append("</svg>")
    return "".join(out)


MARKERS = {"dot": "M0 -2.1A2.1 2.1 0 1 0 0 2.1A2.1 2.1 0 1 0 0 -2.1Z", "tri": "M0 -3.2L2.8 1.6L-2.8 1.6Z"}
LEGEND = ((EXACT_COLOR, "EQUAL / CLOSE"), (PASS_COLOR, "within tolerance"), (FAIL_COLOR, "below tolerance"))
MAX_NAME = 48  # longer tensor names are cut in the middle: the labels would take the chart's height


def _short(name: str) -> str:
    if len(name) <= MAX_NAME:
        return name
    half = (MAX_NAME - 1) // 2
    return name[:half] + "\u2026" + name[-half:]


def _finite(values: Sequence[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def _metric_range(title: str, values: Sequence[float], tol: float | None) -> tuple[float, float]:
    """The y range of a metric's axes: SQNR from below its lowest to above its highest; cosine and euclidean
    up to just above 1, down to below the lowest value or tolerance."""
    finite = _finite(values)
    if title.startswith("SQNR"):
        return min(finite + [0.0]) - 5.0, (max(finite) if finite else 100.0) + 10.0
    lo = min(finite + ([tol] if tol is not None else []) + [1.0])
    return lo - max(0.08 * (1.0 - lo), 1e-3), 1.0 + max(0.02 * (1.0 - lo), 1e-4)


def _ticks(lo: float, hi: float) -> list[tuple[float, str]]:
    """Round values in [lo, hi], three to six of them, with their labels (as many decimals as the step has)."""
    hi = max(hi, lo + 1e-12)
    raw = (hi - lo) / 4
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if (hi - lo) / (m * mag) <= 5.5)
    decimals = max(0, -math.floor(math.log10(step) + 1e-9) + (1 if round(step / mag, 6) == 2.5 else 0))
    first, last = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
    return [(k * step, f"{k * step:,.{decimals}f}") for k in range(first, last + 1)]


@dataclass(frozen=True)
class Span:
    engine: str  # "gdma" or "bdc"
    start: int
    end: int
    kind: str  # GDMA direction or BDC op type


def timeline_chart(
    spans: Sequence[Span], total: int, clock_hz: float, groups: Sequence[tuple[int, int, int]] | None = None
) -> str:
    """Both engines' commands on one time axis (cycles), BDC coloured by op type, GDMA by direction;
    ``groups``: (id, start, end) of each layer group's computes, drawn as a lane above. A kind's commands are
    one path; commands closer than a tenth of a point merge into one bar (a model of thousands of commands
    stays a page of a few hundred kilobytes)."""
    kinds = sorted({s.kind for s in spans if s.engine == "bdc"})
    colors = {k: OP_PALETTE[i % len(OP_PALETTE)] for i, k in enumerate(kinds)}
    colors.update(GDMA_COLORS)
    used = [k for k in GDMA_COLORS if any(s.kind == k and s.engine == "gdma" for s in spans)] + kinds
    lanes = ["BDC", "GDMA"] + (["group"] if groups else [])
    lane_h, top = 30.0, 8.0
    x0 = 10 + max(_width(name, 9) for name in lanes) + 8
    y1 = top + lane_h * len(lanes)
    per_column = int((y1 - top) // 12)  # the legend beside the lanes, in as many columns as that takes
    column_w = 22 + max((_width(k, 7) for k in used), default=0)
    x1 = 864 - column_w * math.ceil(len(used) / per_column) - 10
    height = y1 + 40
    span = max(total, 1)

    def x_of(cycles: float) -> float:
        return x0 + cycles / span * (x1 - x0)

    def y_of(lane: int) -> float:  # the lane's middle
        return y1 - lane_h * (lane + 0.5)

    out = [_svg(864, height), *_x_ticks(_ticks(0, span), x_of, y1, grid_top=top)]
    for lane, name in enumerate(lanes):
        out.append(f'<path d="M{x0 - 3.5:.1f} {y_of(lane):.1f}H{x0:.1f}" {AXIS}/>')
        out.append(_text(x0 - 5, y_of(lane) + 3, name, 9, "end"))
    many = len(spans) > 2000
    edge = "" if many else ' stroke="#ffffff" stroke-width="0.3"'
    for lane, engine in ((0, "bdc"), (1, "gdma")):
        for kind in sorted({s.kind for s in spans if s.engine == engine}):
            bars = [
                (x_of(s.start), x_of(s.start + max(s.end - s.start, 1)))
                for s in spans
                if s.engine == engine and s.kind == kind
            ]
            out.append(_bars(bars, y_of(lane) - 0.38 * lane_h, 0.76 * lane_h, colors[kind], edge))
    if groups:
        for k, (gid, start, end) in enumerate(groups):
            bar = [(x_of(start), x_of(start + max(end - start, 1)))]
            out.append(
                _bars(
                    bar,
                    y_of(2) - 0.3 * lane_h,
                    0.6 * lane_h,
                    GROUP_COLORS[k % 2],
                    ' stroke="#ffffff" stroke-width="0.5"',
                )
            )
            if end - start > 0.025 * span:
                out.append(_text(x_of((start + end) / 2), y_of(2) + 2.5, str(gid), 7, "middle"))
    label = f"cycles (total {total:,} = {total / clock_hz * 1e3:.4g} ms at {clock_hz / 1e6:g} MHz)"
    out += _frame(x0, x1, top, y1, label)
    for i, kind in enumerate(used):
        x, y = x1 + 12 + column_w * (i // per_column), top + 12 * (i % per_column)
        out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="10" height="7" fill="{colors[kind]}"/>')
        out.append(_text(x + 14, y + 6.5, kind, 7))
    out.append("</svg>")
    return "".join(out)


def _x_ticks(ticks, x_of, y1: float, grid_top: float | None = None) -> list[str]:
    """Ticks below the x axis at y1 with their labels, and with ``grid_top`` grid lines from there down to it."""
    out = []
    for value, label in ticks:
        x = x_of(value)
        if grid_top is not None:
            out.append(f'<path d="M{x:.1f} {grid_top:.1f}V{y1:.1f}" {GRID}/>')
        out.append(f'<path d="M{x:.1f} {y1:.1f}V{y1 + 3.5:.1f}" {AXIS}/>')
        out.append(_text(x, y1 + 13, label, 8, "middle"))
    return out


def _frame(x0: float, x1: float, top: float, y1: float, label: str) -> list[str]:
    """The left and bottom axes of the plot (x0..x1, top..y1), the x axis labelled below its tick labels."""
    return [
        f'<path d="M{x0:.1f} {top:.1f}V{y1:.1f}H{x1:.1f}" fill="none" {AXIS}/>',
        _text((x0 + x1) / 2, y1 + 30, label, 9, "middle"),
    ]


def _bars(bars: Sequence[tuple[float, float]], y: float, h: float, color: str, edge: str) -> str:
    """One path of bars (x from, x to) at height y..y+h, those closer than 0.1 pt merged."""
    merged: list[list[float]] = []
    for a, b in sorted(bars):
        if merged and a <= merged[-1][1] + 0.1:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    d = "".join(f"M{a:.1f} {y:.1f}h{max(b - a, 0.1):.1f}v{h:.1f}h{-max(b - a, 0.1):.1f}Z" for a, b in merged)
    return f'<path d="{d}" fill="{color}"{edge}/>'


def ops_chart(ops: dict[str, dict]) -> str:
    """BDC cycles per op type (the cycle model's breakdown), largest first."""
    rows = sorted(ops.items(), key=lambda kv: (-kv[1]["cycles"], kv[0]))
    row_h, top = 20.0, 8.0
    x0 = 10 + max((_width(name, 9) for name, _ in rows), default=0) + 8
    x1 = 468 - 60
    y1 = top + row_h * len(rows)
    most = max([row["cycles"] for _, row in rows] + [1]) * 1.15
    out = [_svg(468, y1 + 40), *_x_ticks(_ticks(0, most), lambda value: x0 + value / most * (x1 - x0), y1)]
    for i, (name, row) in enumerate(rows):
        y = top + row_h * i
        w = row["cycles"] / most * (x1 - x0)
        out.append(_bars([(x0, x0 + w)], y + 0.1 * row_h, 0.8 * row_h, PASS_COLOR, ""))
        out.append(_text(x0 - 5, y + 0.5 * row_h + 3, name, 9, "end"))
        out.append(_text(x0 + w + 3, y + 0.5 * row_h + 2.5, f"{row['cycles']:,}", 7))
    out += _frame(x0, x1, top, y1, "BDC cycles")
    out.append("</svg>")
    return "".join(out)
