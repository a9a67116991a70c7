"""The report's charts: matplotlib figures rendered to inline SVG, byte-identical for the same data.

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
    """Cosine, euclidean and SQNR per tensor (x: graph order), tolerances dashed, one tensor marked."""
    n = len(points)
    width = min(14.0, max(6.5, 0.16 * n + 2.5))
    with matplotlib.rc_context(_rc(salt)):
        fig = _figure(width, 4.6 if n <= MAX_LABELS else 4.0)
        axes = fig.subplots(3, 1, sharex=True)
        # the tensor names label the bottom axes only: ticks on the two above would cost as much again (a tick is
        # a dozen artists) for marks without labels
        for ax in axes[:-1]:
            ax.tick_params(axis="x", which="both", bottom=False, labelbottom=False)
        x = list(range(n))
        metrics = [
            ("cosine", [p.cos for p in points], cos_tol),
            ("euclidean", [p.euc for p in points], euc_tol),
            ("SQNR (dB)", [p.sqnr for p in points], None),
        ]
        for ax, (title, values, tol) in zip(axes, metrics, strict=True):
            _metric_axis(ax, x, values, points, tol, title)
        if highlight is not None:
            color = FAIL_COLOR if highlight_failed else WORST_COLOR
            for ax in axes:
                ax.axvline(highlight, color=color, lw=1.2, alpha=0.6, zorder=1)
            what = "first below tolerance" if highlight_failed else "lowest cosine"
            axes[0].set_title(f"{what}: {points[highlight].name}", loc="left", color=color, fontsize=9)
        step = max(1, math.ceil(n / MAX_LABELS))
        axes[-1].set_xticks(x[::step], [points[i].name for i in x[::step]], rotation=90, fontsize=7)
        axes[-1].set_xlim(-0.6, n - 0.4)
        axes[-1].set_xlabel(f"tensor in graph order ({n})" + (f", 1 in {step} named" if step > 1 else ""))
        handles = [
            Patch(color=EXACT_COLOR, label="EQUAL / CLOSE"),
            Patch(color=PASS_COLOR, label="within tolerance"),
            Patch(color=FAIL_COLOR, label="below tolerance"),
        ]
        legend = fig.legend(handles=handles, loc="upper right", fontsize=7, ncols=3, frameon=False, borderaxespad=0)
        _fit(fig, axes, legend)
        return to_svg(fig)


def _finite(values: Sequence[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def _metric_axis(ax, x, values, points: Sequence[Point], tol: float | None, title: str) -> None:
    finite = _finite(values)
    if title.startswith("SQNR"):
        top = (max(finite) if finite else 100.0) + 10.0
        bottom = min(finite + [0.0]) - 5.0
    else:
        lo = min(finite + ([tol] if tol is not None else []) + [1.0])
        top = 1.0 + max(0.02 * (1.0 - lo), 1e-4)
        bottom = lo - max(0.08 * (1.0 - lo), 1e-3)
    ax.set_ylim(bottom, top)
    plotted = [min(max(v, bottom), top) if not math.isnan(v) else bottom for v in values]
    ax.plot(x, plotted, color="#bbbbbb", lw=0.8, zorder=2)
    colors = [EXACT_COLOR if p.exact else PASS_COLOR if p.passed else FAIL_COLOR for p in points]
    clipped = [not math.isfinite(v) or v > top or v < bottom for v in values]
    markers = [(i, y, c) for i, y, c, k in zip(x, plotted, colors, clipped, strict=True) if not k]
    if markers:
        ax.scatter([m[0] for m in markers], [m[1] for m in markers], c=[m[2] for m in markers], s=14, zorder=3)
    off = [(i, y, c) for i, y, c, k in zip(x, plotted, colors, clipped, strict=True) if k]
    if off:  # inf SQNR (no noise) at the top, NaN (nothing comparable) at the bottom
        ax.scatter([m[0] for m in off], [m[1] for m in off], c=[m[2] for m in off], s=22, marker="^", zorder=3)
    if tol is not None:
        ax.axhline(tol, color=FAIL_COLOR, ls="--", lw=0.9, zorder=1)
        ax.annotate(
            f"tolerance {tol:g}",
            xy=(1.0, tol),
            xycoords=("axes fraction", "data"),
            xytext=(-2, 2),
            textcoords="offset points",
            ha="right",
            va="bottom",
            color=FAIL_COLOR,
            fontsize=7,
        )
    ax.set_ylabel(title)
    ax.grid(axis="y", color="#eeeeee", lw=0.6)
    ax.ticklabel_format(axis="y", useOffset=False)


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
