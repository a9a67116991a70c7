"""The report's charts, inline SVG, byte-identical for the same data: the similarity chart written directly
(``similarity_chart``), the others matplotlib figures rendered to SVG.

Determinism: matplotlib's own defaults (not the user's matplotlibrc), the Agg
backend, text kept as SVG text (no font files read for glyph paths), no date or
creator in the metadata, and a per-figure ``svg.hashsalt`` so the ids matplotlib
generates are fixed and distinct between the figures of one page.

Layout: ``_fit`` measures each chart's labels once and sizes the figure around
them. matplotlib's constrained layout measures them several times and
``bbox_inches="tight"`` draws the whole figure an extra time to crop it: together
about two thirds of a chart's time, for pages drawn by every target of the zoo.
"""

from __future__ import annotations

import io
import math
import re
from html import escape
from collections.abc import Sequence
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")

# Figures are made and printed without pyplot: it would load a GUI-less backend and its figure
# manager for nothing (a third of matplotlib's import time); savefig prints through the SVG canvas
# either way, so the bytes are the same.
from matplotlib.backends.backend_svg import FigureCanvasSVG  # noqa: E402  (after matplotlib.use: the backend is chosen first)
from matplotlib.figure import Figure  # noqa: E402  (after matplotlib.use: the backend is chosen first)
from matplotlib.patches import Patch  # noqa: E402  (after matplotlib.use: the backend is chosen first)

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


def _rc(salt: str) -> dict:
    rc = dict(matplotlib.rcParamsDefault)
    rc.pop("backend", None)
    rc.update(
        {
            "svg.hashsalt": f"tpubuild-{salt}",
            "svg.fonttype": "none",
            "font.family": "DejaVu Sans",
            "font.size": 9,
            "axes.titlesize": 10,
            "axes.spines.top": False,
            "axes.spines.right": False,
        }
    )
    return rc


def to_svg(fig) -> str:
    """The figure, laid out by ``_fit``, as an <svg> element for inlining (no XML prolog). Call inside ``_rc``'s
    context."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    text = buf.getvalue()
    return _drop_unused_ids(text[text.index("<svg") :])


_ID = re.compile(r' id="([^"]+)"')
_REF = re.compile(r'(?:href="|url\()#([^")]+)')


def _drop_unused_ids(svg: str) -> str:
    """Keep only the ids something refers to: matplotlib names every group ("axes_1", ...) alike in every
    figure, which would repeat ids across a page; the referenced ones are salted per figure."""
    used = set(_REF.findall(svg))
    return _ID.sub(lambda m: m.group(0) if m.group(1) in used else "", svg)


def _figure(width: float, height: float) -> Figure:
    """A figure of about this size: ``_fit`` gives its axes what the labels leave."""
    fig = Figure(figsize=(width, height))
    FigureCanvasSVG(fig)
    return fig


PAD, GAP = 0.05, 0.1  # inches: around the figure's content (as pad_inches was), between stacked axes


def _fit(fig: Figure, column: Sequence, legend=None) -> None:
    """Lay out ``column`` (axes stacked top to bottom, of equal height) in the figure's size: each side's margin
    is what its labels need (tick labels, axis labels, titles, axes legends), measured once at the first
    positions; the figure legend ``legend`` goes above the top axes, right-aligned. The figure's width stays;
    its height becomes the axes' heights the size asked for, plus the room above and below them."""
    # the SVG renderer the page is printed with: its text metrics (matplotlib has no public getter for it)
    renderer = fig._get_renderer()  # pyright: ignore[reportAttributeAccessIssue]
    dpi = fig.dpi
    width, height = fig.get_size_inches()
    over = []  # per axes: how far its labels reach past it (left, bottom, right, top), inches
    for ax in column:
        box, tight = ax.get_window_extent(renderer), ax.get_tightbbox(renderer)
        over.append(
            (
                max(box.x0 - tight.x0, 0) / dpi,
                max(box.y0 - tight.y0, 0) / dpi,
                max(tight.x1 - box.x1, 0) / dpi,
                max(tight.y1 - box.y1, 0) / dpi,
            )
        )
    left = max(o[0] for o in over) + PAD
    right = max(o[2] for o in over) + PAD
    top = over[0][3] + PAD
    if legend is not None:
        top += legend.get_window_extent(renderer).height / dpi
    bottom = over[-1][1] + PAD
    gaps = [over[i][1] + over[i + 1][3] + GAP for i in range(len(column) - 1)]
    # the height the chart asked for is the axes' own (as constrained layout kept the figure and shrank them)
    inner = max(height - top - bottom - sum(gaps), 0.6 * len(column))
    each = inner / len(column)
    total = top + inner + sum(gaps) + bottom
    fig.set_size_inches(width, total)
    y = total - top
    for i, ax in enumerate(column):
        y -= each
        ax.set_position([left / width, y / total, (width - left - right) / width, each / total])
        if i < len(gaps):
            y -= gaps[i]
    if legend is not None:
        legend.set_bbox_to_anchor((1 - PAD / width, 1 - PAD / total), transform=fig.transFigure)


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
    """Cosine, euclidean and SQNR per tensor (x: graph order), tolerances dashed, one tensor marked.

    Written as SVG directly, not drawn by matplotlib: every target's page has four of these, and matplotlib
    took most of a page's time (0.2 s a chart, a tick per tensor name); this is the same chart in a
    few milliseconds."""
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
    left = 14 + 5.0 * max(len(label) for t in ticks for _, label in t) + 10
    right = 12
    top = 30 + (16 if highlight is not None else 0)
    bottom = 6 + 4.3 * max((len(name) for name in names), default=1) + 20
    gap = 10
    height = top + 3 * panel + 2 * gap + bottom
    x0, x1 = left, width - right

    def x_of(i: float) -> float:
        return x0 + (i + 0.6) / max(n, 1) * (x1 - x0)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink" '
        f'width="{width:.1f}pt" height="{height:.1f}pt" viewBox="0 0 {width:.1f} {height:.1f}" '
        'font-family="DejaVu Sans, sans-serif" font-size="9">',
        "",  # the markers drawn: their shapes, once each (ids only for what the chart uses)
        f'<rect width="{width:.1f}" height="{height:.1f}" fill="#ffffff"/>',
    ]
    used: set[str] = set()
    for k, ((title, values, tol), (lo, hi), marks) in enumerate(zip(metrics, ranges, ticks, strict=True)):
        y0 = top + k * (panel + gap)
        y1 = y0 + panel

        def y_of(v: float, lo=lo, hi=hi, y0=y0, y1=y1) -> float:
            return y1 - (v - lo) / (hi - lo) * (y1 - y0)

        for value, label in marks:  # grid and tick labels
            y = y_of(value)
            out.append(f'<path d="M{x0:.1f} {y:.1f}H{x1:.1f}" stroke="#eeeeee" stroke-width="0.6"/>')
            out.append(f'<path d="M{x0 - 3.5:.1f} {y:.1f}H{x0:.1f}" stroke="#000000" stroke-width="0.8"/>')
            out.append(f'<text x="{x0 - 5:.1f}" y="{y + 3:.1f}" text-anchor="end" font-size="8">{label}</text>')
        out.append(
            f'<text transform="translate({x0 - left + 10:.1f} {(y0 + y1) / 2:.1f}) rotate(-90)" '
            f'text-anchor="middle">{escape(title)}</text>'
        )
        if tol is not None:
            y = y_of(tol)
            out.append(
                f'<path d="M{x0:.1f} {y:.1f}H{x1:.1f}" stroke="{FAIL_COLOR}" stroke-width="0.9" '
                'stroke-dasharray="3.3 1.4"/>'
            )
            out.append(
                f'<text x="{x1 - 2:.1f}" y="{y - 2:.1f}" text-anchor="end" font-size="7" '
                f'fill="{FAIL_COLOR}">tolerance {tol:g}</text>'
            )
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
        out.append(f'<path d="M{x0:.1f} {y0:.1f}V{y1:.1f}H{x1:.1f}" fill="none" stroke="#000000" stroke-width="0.8"/>')
    y1 = top + 3 * panel + 2 * gap
    for i, name in zip(named, names, strict=True):
        x = x_of(i)
        out.append(f'<path d="M{x:.1f} {y1:.1f}V{y1 + 3.5:.1f}" stroke="#000000" stroke-width="0.8"/>')
        out.append(
            f'<text transform="translate({x + 2.5:.1f} {y1 + 6:.1f}) rotate(-90)" text-anchor="end" '
            f'font-size="7">{escape(name)}</text>'
        )
    axis = f"tensor in graph order ({n})" + (f", 1 in {step} named" if step > 1 else "")
    out.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{height - 6:.1f}" text-anchor="middle">{escape(axis)}</text>')
    if highlight is not None and 0 <= highlight < n:
        color = FAIL_COLOR if highlight_failed else WORST_COLOR
        what = "first below tolerance" if highlight_failed else "lowest cosine"
        out.append(
            f'<text x="{x0:.1f}" y="{top - 6:.1f}" fill="{color}">{escape(f"{what}: {points[highlight].name}")}</text>'
        )
    x = width - 6
    for color, label in reversed(LEGEND):  # right-aligned, as matplotlib's figure legend was
        x -= 4.1 * len(label)
        out.append(f'<text x="{x:.1f}" y="14" font-size="7">{label}</text>')
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
    raw = (hi - lo) / 4
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if (hi - lo) / (m * mag) <= 5.5)
    decimals = max(0, -math.floor(math.log10(step) + 1e-9) + (1 if round(step / mag, 6) == 2.5 else 0))
    first, last = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
    return [(k * step, f"{k * step:.{decimals}f}") for k in range(first, last + 1)]


@dataclass(frozen=True)
class Span:
    engine: str  # "gdma" or "bdc"
    start: int
    end: int
    kind: str  # GDMA direction or BDC op type


def timeline_chart(
    spans: Sequence[Span], total: int, clock_hz: float, salt: str, groups: Sequence[tuple[int, int, int]] | None = None
) -> str:
    """Both engines' commands on one time axis (cycles), BDC coloured by op type, GDMA by direction;
    ``groups``: (id, start, end) of each layer group's computes, drawn as a lane above."""
    kinds = sorted({s.kind for s in spans if s.engine == "bdc"})
    colors = {k: OP_PALETTE[i % len(OP_PALETTE)] for i, k in enumerate(kinds)}
    colors.update(GDMA_COLORS)
    lanes = {"gdma": 1, "bdc": 0}
    with matplotlib.rc_context(_rc(salt)):
        fig = _figure(12.0, 3.0 if groups else 2.6)
        ax = fig.subplots()
        if groups:
            for k, (gid, start, end) in enumerate(groups):
                ax.broken_barh(
                    [(start, max(end - start, 1))],
                    (1.7, 0.6),
                    facecolors=GROUP_COLORS[k % 2],
                    edgecolor="white",
                    linewidth=0.5,
                )
                if end - start > 0.025 * max(total, 1):
                    ax.text((start + end) / 2, 2.0, f"{gid}", ha="center", va="center", fontsize=7)
        many = len(spans) > 2000  # thousands of rectangles: one raster image inside the SVG, not a path each
        for engine, lane in lanes.items():
            for kind in sorted({s.kind for s in spans if s.engine == engine}):
                bars = [(s.start, max(s.end - s.start, 1)) for s in spans if s.engine == engine and s.kind == kind]
                ax.broken_barh(
                    bars,
                    (lane - 0.38, 0.76),
                    facecolors=colors[kind],
                    edgecolor="white",
                    linewidth=0.3 if not many else 0,
                    rasterized=many,
                )
        ax.set_yticks([0, 1, 2] if groups else [0, 1], ["BDC", "GDMA", "group"] if groups else ["BDC", "GDMA"])
        ax.set_ylim(-0.6, 2.45 if groups else 1.6)
        ax.set_xlim(0, max(total, 1))
        ax.set_xlabel(f"cycles (total {total:,} = {total / clock_hz * 1e3:.4g} ms at {clock_hz / 1e6:g} MHz)")
        used = [k for k in GDMA_COLORS if any(s.kind == k and s.engine == "gdma" for s in spans)] + kinds
        ax.legend(
            handles=[Patch(color=colors[k], label=k) for k in used],
            loc="upper left",
            bbox_to_anchor=(1.005, 1.0),
            fontsize=7,
            frameon=False,
        )
        ax.grid(axis="x", color="#eeeeee", lw=0.6)
        _fit(fig, [ax])
        return to_svg(fig)


def ops_chart(ops: dict[str, dict], salt: str) -> str:
    """BDC cycles per op type (the cycle model's breakdown), largest first."""
    rows = sorted(ops.items(), key=lambda kv: (-kv[1]["cycles"], kv[0]))
    with matplotlib.rc_context(_rc(salt)):
        fig = _figure(6.5, 0.28 * len(rows) + 0.9)
        ax = fig.subplots()
        names = [name for name, _ in rows][::-1]
        cycles = [row["cycles"] for _, row in rows][::-1]
        ax.barh(names, cycles, color=PASS_COLOR)
        for y, c in enumerate(cycles):
            ax.annotate(f"{c:,}", xy=(c, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=7)
        ax.set_xlabel("BDC cycles")
        ax.set_xlim(0, max(cycles + [1]) * 1.15)
        _fit(fig, [ax])
        return to_svg(fig)
