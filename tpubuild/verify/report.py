"""report.html: one target's verification and performance on one self-contained page.

What it shows, from the files the build already wrote:

- summary numbers: the cycle model's estimated time and cycles, DDR traffic,
  model file and weight sizes, engine utilisation (profile.json, the .model);
- where the test input came from (verify.json's test_input);
- per level the figures of what decided it (graph outputs and their parts for
  Top vs Tpu) next to the intermediate minimum over every tensor, and the
  output parts judged one by one;
- per level (ONNX vs Top, Top vs Tpu, Tpu vs Chip) the per-tensor cosine,
  euclidean similarity and SQNR as charts in graph order, with the first
  tensor below tolerance (or, when all pass, the lowest one) named with its
  op, its location and the line of the .mlir that defines it (verify JSONs);
- the layer groups: ops, slices, local memory, estimated cycles (lg.mlir);
- a GDMA/BDC timeline: every command of the .model replayed by the cycle model.

The page has no external resource (charts are inline SVG, styles inline) and no
date, so the same inputs give the same bytes.
"""

from __future__ import annotations

import html
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from tpubuild.verify import charts

LEVEL_TITLES = {"top": "ONNX vs Top", "tpu": "Top vs Tpu", "chip": "Tpu vs Chip", "iree": "Top vs IREE (cpu)"}
EXACT = ("EQUAL", "CLOSE")


# ---- where each tensor comes from --------------------------------------------------------------

_OP_LINE = re.compile(r'=\s*"([\w.]+)"')
_LOC = re.compile(r"loc\((.*)\)\s*$")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Site:
    """Where a tensor is defined: its op, graph position and line in the .mlir."""

    index: int
    op: str
    line: int


@dataclass
class GraphInfo:
    file: str  # shown to the user: the path relative to the model's build folder
    sites: dict[str, Site] = field(default_factory=dict)

    def site(self, name: str) -> Site | None:
        return self.sites.get(name)


def graph_info(path: str | Path, shown_as: str) -> GraphInfo:
    """Each result's op and line from the .mlir text (generic form, one op per line, located by name).

    A text scan, not a parse: the page needs positions and line numbers only, and
    reading a large model's IR back through xDSL would cost more than the page.
    """
    with open(path, encoding="utf-8") as f:
        return graph_info_text(f.read(), shown_as)


def graph_info_text(text: str, shown_as: str = "") -> GraphInfo:
    """graph_info of a .mlir file's text."""
    info = GraphInfo(shown_as)
    for line_no, line in enumerate(text.split("\n"), 1):
        op = _OP_LINE.search(line)
        loc = _LOC.search(line)
        if not op or not loc or op.group(1) in ("top.Weight", "top.None"):
            continue
        for name in _QUOTED.findall(loc.group(1)):
            info.sites.setdefault(name, Site(len(info.sites), op.group(1), line_no))
    return info


# ---- one comparison, ordered and judged ---------------------------------------------------------


def _f(value) -> float:
    """verify JSON numbers: non-finite ones are strings ('inf', 'nan')."""
    return float(value)


@dataclass
class Level:
    comp: dict
    graph: GraphInfo | None
    rows: list[dict]  # in graph order (tensors the graph does not define last, by name)
    first_failed: int | None
    worst: int | None

    @property
    def title(self) -> str:
        level: str = self.comp["level"]
        return LEVEL_TITLES.get(level, level)

    def site(self, row: dict) -> Site | None:
        return self.graph.site(row["name"]) if self.graph else None


def order_level(comp: dict, graph: GraphInfo | None) -> Level:
    def key(row):
        site = graph.site(row["name"]) if graph else None
        return (0, site.index, "") if site else (1, 0, row["name"])

    rows = sorted(comp["tensors"], key=key)
    failed = [i for i, row in enumerate(rows) if not row["passed"]]
    # NaN (nothing comparable) is the worst of all
    cosines = [(-math.inf if math.isnan(_f(r["cos"])) else _f(r["cos"]), i) for i, r in enumerate(rows)]
    return Level(comp, graph, rows, failed[0] if failed else None, min(cosines)[1] if cosines else None)


# ---- everything one page shows --------------------------------------------------------------------


@dataclass
class GroupRow:
    id: int
    kind: str
    ops: list[tuple[str, str]]  # (tensor name, op type)
    n_secs: int
    h_secs: int
    lmem_bytes: int
    cycles: int
    ddr_bytes: int


@dataclass
class PageData:
    model: str
    target: str
    passed: bool
    levels: list[Level]
    profile: dict | None = None
    groups: list[GroupRow] | None = None
    lane_bytes: int | None = None  # local memory per lane
    spans: list[charts.Span] | None = None
    model_bytes: int | None = None
    weight_bytes: int | None = None
    failure: tuple[str, str] | None = None  # (stage, message) of a build that stopped
    test_input: str | None = None  # where the test input came from (verify.json's test_input)
    precision: Precision | None = None  # INT8 targets: which ops compute in float


@dataclass(frozen=True)
class Precision:
    """An INT8 target's compute ops (casts aside) and those of them whose result is float."""

    ops: int
    floats: tuple[tuple[str, str, str], ...]  # (tensor, op, element type)
    macs: int = 0  # the convolutions' and matmuls' multiply-accumulates
    float_macs: int = 0  # those of the float ones
    bias: str | None = None  # what the search decided of bias corrections (its quantize table's header line)


_RESULT = re.compile(r"->\s*(?:\()?tensor<(?:[^<>]|<[^<>]*>)*?x?(!quant\.uniform|bf16|f16|f32)")
_NOT_COMPUTED = ("tpu.Cast", "top.Input", "tpu.Reshape")
_DIMS = re.compile(r"tensor<((?:\d+x)*)")


def _line_macs(op: str, line: str) -> int:
    """A tpu.Conv's or tpu.MatMul's multiply-accumulates from the types its line ends with (operands, result)."""
    if op not in ("tpu.Conv", "tpu.MatMul"):
        return 0
    shapes = [[int(d) for d in dims.split("x") if d] for dims in _DIMS.findall(line[line.rfind(" : (") :])]
    per_value = math.prod(shapes[1][1:]) if op == "tpu.Conv" else shapes[0][-1]
    return math.prod(shapes[-1]) * per_value


def read_precision(text: str) -> Precision:
    """Each compute op's result element type from a tpu.mlir or lg.mlir text (one op per line, as written)."""
    ops, floats, macs, float_macs = 0, [], 0, 0
    for line in text.split("\n"):
        op, loc, result = _OP_LINE.search(line), _LOC.search(line), _RESULT.search(line)
        if not op or not loc or not result or not op.group(1).startswith("tpu.") or op.group(1) in _NOT_COMPUTED:
            continue
        ops += 1
        work = _line_macs(op.group(1), line)
        macs += work
        if result.group(1) != "!quant.uniform":
            floats.append((_QUOTED.findall(loc.group(1))[0], op.group(1), result.group(1)))
            float_macs += work
    return Precision(ops, tuple(floats), macs, float_macs)


_GROUPS_ATTR = "lg.groups = "


def read_groups(lg_mlir: str | Path, text: str | None = None) -> list[GroupRow]:
    """The layer groups lg.mlir records: its ``lg.groups`` module attribute, each op's type from its line.

    The attribute alone goes through the MLIR parser, not the module: the page needs none of the ops'
    attributes, and parsing a whole lg.mlir is most of a page's time (cls: 0.45 s of a warm page's 0.7).
    A file without the attribute where it is printed is parsed whole, as layer group reads it. ``text``: the
    file's, when the caller has read it already.
    """
    path = Path(lg_mlir)
    text = path.read_text(encoding="utf-8") if text is None else text
    attr = _module_attr(text, _GROUPS_ATTR)
    if attr is None:
        return _read_groups_parsed(path)
    from xdsl.parser import Parser

    from tpubuild.ir.mlir import context, plain_value

    groups = plain_value(Parser(context(), attr, str(path)).parse_attribute())
    kinds = {name: site.op for name, site in graph_info_text(text).sites.items()}
    return [
        GroupRow(
            g["id"],
            g["kind"],
            [(name, kinds.get(name, "?")) for name in g["ops"]],
            g["n_secs"],
            g["h_secs"],
            g.get("lmem_bytes", 0),
            g["cycles"],
            g["ddr_bytes"],
        )
        for g in groups
    ]


def _module_attr(text: str, key: str) -> str | None:
    """The text of one attribute of the module's attribute dictionary (printed after its region, on the line
    that closes it), up to its closing bracket outside quoted strings; None if it is not there."""
    tail = text.rfind("\n})")
    start = text.find(key, tail) if tail >= 0 else -1
    if start < 0:
        return None
    start += len(key)
    depth, i, quoted = 0, start, False
    while i < len(text):
        c = text[i]
        if quoted:
            i += 2 if c == "\\" else 1
            quoted = c != '"'
            continue
        if c == '"':
            quoted = True
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
        i += 1
    return None


def _read_groups_parsed(lg_mlir: Path) -> list[GroupRow]:
    from tpubuild.codegen.graph import build_graph
    from tpubuild.codegen.layergroup import read_groups as lg_groups
    from tpubuild.ir.mlir import load_module

    module = load_module(lg_mlir)
    graph = build_graph(module)
    return [
        GroupRow(
            g.id,
            g.kind,
            [(graph.ops[p].name, graph.ops[p].kind) for p in g.ops],
            g.n_secs,
            g.h_secs,
            g.lmem_bytes,
            g.cycles,
            g.ddr_bytes,
        )
        for g in lg_groups(module, graph)
    ]


def command_spans(model) -> list[charts.Span]:
    """Every command's start and end as the cycle model replays them (the simulator's order and estimate)."""
    from tpubuild.sim.chip import decoded_params
    from tpubuild.sim.cycles import replay

    s = replay(model, decoded_params(model))
    spans = [
        charts.Span("gdma", a, b, g.direction.name.lower())
        for g, a, b in zip(model.gdma, s.gdma_start, s.gdma_end, strict=True)
    ]
    spans += [
        charts.Span("bdc", a, b, c.op.removeprefix("tpu."))
        for c, a, b in zip(model.bdc, s.bdc_start, s.bdc_end, strict=True)
    ]
    return spans


def group_spans(groups: Sequence[GroupRow], spans: Sequence[charts.Span]) -> list[tuple[int, int, int]] | None:
    """(group id, first compute's start, last compute's end) per group, from the BDC queue in order.

    Codegen emits one BDC per op and slice of a local group, one per global op and none for an alias
    or a copy; when the counts do not add up to the queue (a codegen this does not know), None.
    """
    bdc = [s for s in spans if s.engine == "bdc"]
    counts = [g.n_secs * g.h_secs * len(g.ops) if g.kind == "local" else int(g.kind == "global") for g in groups]
    if sum(counts) != len(bdc):
        return None
    out, i = [], 0
    for g, n in zip(groups, counts, strict=True):
        if n:
            out.append((g.id, bdc[i].start, bdc[i + n - 1].end))
            i += n
    return out


def levels_of(comparisons: Sequence[dict], graphs: Mapping[str, GraphInfo]) -> list[Level]:
    """Each comparison ordered by the graph it tested (``graphs`` by file name; the chip by tpu.mlir's)."""
    out = []
    for comp in comparisons:
        test = Path(comp["test"]).name
        # the chip ran tpu.mlir's ops; IREE's outputs are canonical.mlir's graph outputs
        graph = graphs.get({"chip": "tpu.mlir", "iree": "canonical.mlir"}.get(comp["level"], test))
        out.append(order_level(comp, graph))
    return out


def target_page(
    model: str,
    target: str,
    verify_json: str,
    profile_json: str,
    lg_mlir: str,
    model_file: str,
    graphs: Sequence[str],
    qtable: str | None = None,
) -> PageData:
    """Everything a passing target's page shows, read from its build artifacts."""
    from tpubuild.codegen.model_file import read_model

    doc = json.loads(Path(verify_json).read_text(encoding="utf-8"))
    infos = graph_infos(graphs, Path(verify_json).parent.parent)
    mf = read_model(model_file)
    lg_text = Path(lg_mlir).read_text(encoding="utf-8")
    return PageData(
        model=model,
        target=target,
        passed=bool(doc["passed"]),
        levels=levels_of(doc["comparisons"], infos),
        test_input=doc.get("test_input"),
        profile=json.loads(Path(profile_json).read_text(encoding="utf-8")),
        groups=read_groups(lg_mlir, lg_text),
        lane_bytes=mf.header.chip.lane_bytes,
        spans=command_spans(mf),
        model_bytes=Path(model_file).stat().st_size,
        weight_bytes=len(mf.weights),
        precision=(
            replace(read_precision(lg_text), bias=bias_line(Path(qtable)) if qtable else None)
            if target.endswith("INT8")
            else None
        ),
    )


def bias_line(qtable: Path) -> str | None:
    """The search's line on bias corrections in a quantize table it wrote (lower/search.py, BiasChoice), if any."""
    prefix = "# bias corrections: "
    line = next((x for x in qtable.read_text(encoding="utf-8").splitlines() if x.startswith(prefix)), None)
    return None if line is None else line[2:]


def graph_infos(graphs: Sequence[str], model_dir: Path) -> dict[str, GraphInfo]:
    infos = {}
    for g in graphs:
        path = Path(g)
        try:
            shown = str(path.resolve().relative_to(model_dir.resolve()))
        except ValueError:
            shown = path.name
        infos[path.name] = graph_info(path, shown)
    return infos


# ---- HTML -------------------------------------------------------------------------------------------

CSS = """
body{font-family:"DejaVu Sans",Helvetica,Arial,sans-serif;margin:24px auto;max-width:1180px;padding:0 16px;color:#222}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
h3{font-size:14px;margin:18px 0 6px} .sub{color:#666;margin:0 0 16px}
.badge{display:inline-block;padding:2px 10px;border-radius:10px;color:#fff;font-weight:bold;font-size:13px}
.pass{background:#2e8b57} .fail{background:#c62828} .none{background:#888}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:12px 0}
.card{border:1px solid #ddd;border-radius:6px;padding:8px 12px;min-width:130px}
.card .v{font-size:18px;font-weight:bold} .card .k{font-size:11px;color:#666}
table{border-collapse:collapse;font-size:12px;margin:6px 0} th,td{border:1px solid #ddd;padding:3px 7px;text-align:left}
th{background:#f4f4f4} td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.bad td{background:#fdecea} tr.first td{background:#f8c9c4;font-weight:bold}
.callout{border-left:4px solid #c62828;background:#fdecea;padding:8px 12px;margin:8px 0}
.callout.ok{border-color:#2e8b57;background:#eef7f1} .callout.note{border-color:#e08a00;background:#fff6e6}
.chart{overflow-x:auto;margin:6px 0} .chart svg{max-width:100%;height:auto}
code{background:#f4f4f4;padding:0 3px} details{margin:4px 0} summary{cursor:pointer;color:#1f5fa8}
pre{background:#f7f7f7;padding:8px;white-space:pre-wrap;font-size:12px}
"""


def e(text) -> str:
    return html.escape(str(text), quote=True)


def fmt(value, digits: int = 6) -> str:
    v = _f(value)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:.{digits}f}"


def size(n: int | None) -> str:
    if n is None:
        return "–"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def badge(passed: bool | None, text: str | None = None) -> str:
    cls = "none" if passed is None else "pass" if passed else "fail"
    return f'<span class="badge {cls}">{e(text or ("PASS" if passed else "FAIL"))}</span>'


def _card(value: str, key: str) -> str:
    return f'<div class="card"><div class="v">{e(value)}</div><div class="k">{e(key)}</div></div>'


def summary_cards(d: PageData) -> str:
    cards = []
    p = d.profile
    if p:
        cards += [
            _card(f"{p['time_ms']:.4g} ms", f"estimated time ({p['total_cycles']:,} cycles)"),
            _card(size(p["ddr_read_bytes"]), "DDR read"),
            _card(size(p["ddr_write_bytes"]), "DDR written"),
        ]
    if d.model_bytes is not None:
        cards.append(_card(size(d.model_bytes), "model file"))
    if d.weight_bytes is not None:
        cards.append(_card(size(d.weight_bytes), "weights"))
    if p:
        cards += [
            _card(f"{p['gdma']['commands']:,} / {p['bdc']['commands']:,}", "GDMA / BDC commands"),
            _card(f"{p['gdma']['utilisation']:.0%} / {p['bdc']['utilisation']:.0%}", "GDMA / BDC busy"),
            _card(f"{p['bdc']['macs']:,}", "MACs"),
        ]
    if d.groups is not None:
        local = sum(g.kind == "local" for g in d.groups)
        cards.append(_card(f"{len(d.groups)} ({local} local)", "layer groups"))
    return f'<div class="cards">{"".join(cards)}</div>' if cards else ""


def levels_table(levels: Sequence[Level]) -> str:
    """One row per level: the figures of what decided it (the summary's), and the intermediate minimum (every
    tensor compared, deciding or not), which is where to look for a cause."""
    head = (
        "<tr><th>level</th><th>compared</th><th>tensors</th><th>decided by</th><th>tolerance cos / euc</th>"
        "<th>cos</th><th>euc</th><th>SQNR</th><th>intermediate minimum cos</th><th>below tolerance</th>"
        "<th>result</th></tr>"
    )
    rows = []
    for lv in levels:
        c = lv.comp
        tol = c["tolerance"]
        decided = e(c.get("decided_by", "every tensor"))
        if c.get("parts"):
            decided += f" and {len(c['parts'])} output parts"
        rows.append(
            f'<tr class="{"" if c["passed"] else "bad"}"><td>{e(lv.title)}</td>'
            f"<td>{e(c['test'])} vs {e(c['ref'])}</td><td class=num>{c['compared']}</td><td>{decided}</td>"
            f"<td class=num>{tol['cos']:g} / {tol['euc']:g}</td>"
            f"<td class=num>{fmt(c.get('decided_cos', c['min_cos']))}</td>"
            f"<td class=num>{fmt(c.get('decided_euc', c['min_euc']))}</td>"
            f"<td class=num>{fmt(c.get('decided_sqnr', c['min_sqnr']), 1)} dB</td>"
            f"<td class=num>{fmt(c['min_cos'])}</td>"
            f"<td class=num>{c['failed']}</td><td>{badge(bool(c['passed']))}</td></tr>"
        )
    note = (
        "<p>cos, euc and SQNR are the lowest of what decides each level (the verdict); the intermediate "
        "minimum is over every tensor compared, where a cause of a low figure shows first.</p>"
    )
    return f'<table class="levels">{head}{"".join(rows)}</table>{note}'


def parts_table(lv: Level) -> str:
    """The output parts a level judged one by one: slice, rule, figures and verdict."""
    parts = lv.comp.get("parts") or []
    if not parts:
        return ""
    head = (
        "<tr><th>output part</th><th>axis</th><th>range</th><th>from</th><th>rule</th><th>label</th><th>cos</th>"
        "<th>euc</th><th>SQNR dB</th><th>max abs err</th><th>float max |x|</th><th>INT8 step</th><th>result</th></tr>"
    )
    rows = []
    for row in parts:
        step = row.get("step")
        sources = row.get("sources") or []
        # several sources: a field of per-level Concats (parts._field_parts), one tensor per level
        origin = (
            "manifest"
            if row.get("declared")
            else f"Concat input{'s' if len(sources) > 1 else ''} " + ", ".join(sources)
        )
        rows.append(
            f'<tr class="{"" if row["passed"] else "bad"}"><td>{e(row["name"])}</td><td class=num>{row["axis"]}</td>'
            f"<td class=num>{row['range'][0]}:{row['range'][1]}</td><td>{e(origin)}</td>"
            f"<td>{e(row.get('rule', 'similarity'))}</td><td>{e(row['label'])}</td>"
            f"<td class=num>{fmt(row['cos'])}</td><td class=num>{fmt(row['euc'])}</td>"
            f"<td class=num>{fmt(row['sqnr'], 1)}</td><td class=num>{_f(row['max_abs']):.3g}</td>"
            f"<td class=num>{_f(row.get('ref_max_abs', math.nan)):.3g}</td>"
            f"<td class=num>{'' if step is None else f'{_f(step):.3g}'}</td><td>{badge(bool(row['passed']))}</td></tr>"
        )
    return (
        f"<p>Output parts, each judged on its own ({len(parts)}): a tiny part (float values too small for one INT8 "
        "step of its calibrated scale for a cosine to judge them) by its max abs error, every other by cos and euc.</p>"
        f'<table class="parts">{head}{"".join(rows)}</table>'
    )


def _where(lv: Level, row: dict) -> str:
    site = lv.site(row)
    if not site or lv.graph is None:
        return f"<code>{e(row['name'])}</code> (not a result of the tested graph)"
    return (
        f"<code>{e(row['name'])}</code>: op <code>{e(site.op)}</code> at "
        f"<code>loc(&quot;{e(row['name'])}&quot;)</code>, <code>{e(lv.graph.file)}:{site.line}</code> "
        f"(tensor {site.index + 1} of the graph)"
    )


def _metrics(row: dict) -> str:
    return (
        f"{e(row['label'])}, cos {fmt(row['cos'])}, euc {fmt(row['euc'])}, SQNR {fmt(row['sqnr'], 1)} dB, "
        f"max abs err {_f(row['max_abs']):.3g}"
    )


def first_failure(levels: Sequence[Level]) -> str:
    """The callout at the top: the first tensor where similarity drops below tolerance.

    The first such tensor of the flow comes first. A level decided by its graph outputs
    (Top vs Tpu) may pass with intermediate tensors below tolerance: those are named too,
    as reported only. With no tensor below tolerance anywhere, the lowest cosine is named.
    """
    notes = []
    for i, lv in enumerate(levels):
        bad_parts = [r for r in lv.comp.get("parts", ()) if not r["passed"]]
        if bad_parts:  # a part decides on its own: a whole output within tolerance does not excuse it
            ident = "" if notes else ' id="first-failure"'
            items = "".join(f"<li>{e(format_part(r))}</li>" for r in bad_parts)
            notes.append(
                f'<div class="callout"{ident}><b>Output parts below tolerance</b> '
                f'(<a href="#level-{i}">{e(lv.title)}, {e(lv.comp["test"])} vs {e(lv.comp["ref"])}</a>; '
                f"tolerance cos {lv.comp['tolerance']['cos']:g}, euc {lv.comp['tolerance']['euc']:g}):"
                f"<ul>{items}</ul></div>"
            )
        if lv.first_failed is None:
            continue
        row = lv.rows[lv.first_failed]
        deciding = not lv.comp["passed"]
        why = (
            ""
            if deciding
            else (
                f" (reported only: this level is decided by its "
                f"{e(lv.comp.get('decided_by', 'graph outputs'))}, which pass)"
            )
        )
        failed_outputs = [r["name"] for r in lv.rows if r.get("output") and not r["passed"]]
        failed_outputs += [r["name"] for r in lv.comp.get("parts", ()) if not r["passed"]]
        if deciding and failed_outputs and lv.comp.get("decided_by") == "graph outputs":
            why = f" (the level fails on its graph outputs {', '.join(map(e, failed_outputs))})"
        ident = "" if notes else ' id="first-failure"'
        notes.append(
            f'<div class="callout{"" if deciding else " note"}"{ident}><b>First tensor below tolerance</b> '
            f'(<a href="#level-{i}">{e(lv.title)}, {e(lv.comp["test"])} vs {e(lv.comp["ref"])}</a>)'
            f"{why}: {_where(lv, row)}<br>{_metrics(row)}; tolerance cos {lv.comp['tolerance']['cos']:g}, "
            f"euc {lv.comp['tolerance']['euc']:g}</div>"
        )
    if notes:
        return "\n".join(notes)
    lowest = [(_f(lv.rows[lv.worst]["cos"]), i, lv.worst) for i, lv in enumerate(levels) if lv.worst is not None]
    if not lowest:
        return '<div class="callout">No tensor was compared.</div>'
    _, i, worst = min(lowest)
    lv = levels[i]
    row = lv.rows[worst]
    return (
        f'<div class="callout ok" id="first-failure"><b>Every tensor is within tolerance</b> at every level. '
        f"Lowest cosine ({e(lv.title)}): {_where(lv, row)}; {_metrics(row)}</div>"
    )


def format_part(row: dict) -> str:
    from tpubuild.verify.compare import format_part as text

    return text(row)


def tensor_table(lv: Level) -> str:
    head = (
        "<tr><th>#</th><th>tensor</th><th>op</th><th>line</th><th>shape</th><th>label</th><th>cos</th>"
        "<th>euc</th><th>SQNR dB</th><th>max abs err</th></tr>"
    )
    rows = []
    for i, row in enumerate(lv.rows):
        site = lv.site(row)
        cls = "first" if i == lv.first_failed else "" if row["passed"] else "bad"
        name = row["name"] + (f" ↔ {row['ref_name']}" if "ref_name" in row else "")
        name += " (graph output)" if row.get("output") else ""
        rows.append(
            f'<tr class="{cls}"><td class=num>{i + 1}</td><td>{e(name)}</td>'
            f"<td>{e(site.op) if site else ''}</td><td class=num>{site.line if site else ''}</td>"
            f"<td>{e('x'.join(map(str, row['shape'])))}</td><td>{e(row['label'])}</td>"
            f"<td class=num>{fmt(row['cos'])}</td><td class=num>{fmt(row['euc'])}</td>"
            f"<td class=num>{fmt(row['sqnr'], 1)}</td><td class=num>{_f(row['max_abs']):.3g}</td></tr>"
        )
    return f'<table class="tensors">{head}{"".join(rows)}</table>'


def level_section(lv: Level, index: int, fold: bool = False) -> str:
    """A level's heading, chart and tensor table; ``fold``: the chart collapsed (a page about another level)."""
    c = lv.comp
    points = [
        charts.Point(r["name"], _f(r["cos"]), _f(r["euc"]), _f(r["sqnr"]), bool(r["passed"]), r["label"] in EXACT)
        for r in lv.rows
    ]
    highlight = lv.first_failed if lv.first_failed is not None else lv.worst
    parts = [f'<h3 id="level-{index}">{e(lv.title)}: {e(c["test"])} vs {e(c["ref"])} {badge(bool(c["passed"]))}</h3>']
    if points:
        svg = charts.similarity_chart(
            points,
            float(c["tolerance"]["cos"]),
            float(c["tolerance"]["euc"]),
            highlight,
            lv.first_failed is not None,
            salt=f"level{index}",
        )
        chart = f'<div class="chart similarity">{svg}</div>'
        parts.append(f"<details><summary>chart</summary>{chart}</details>" if fold else chart)
    else:
        parts.append("<p>No tensor in common: nothing was compared.</p>")
    parts.append(parts_table(lv))
    for key, what in (("only_in_test", "only in the tested graph"), ("only_in_ref", "only in the reference")):
        if c.get(key):
            count = len(c[key])
            parts.append(f"<p>{count} tensor{'' if count == 1 else 's'} {what} (not compared).</p>")
    parts.append(
        f"<details{' open' if lv.first_failed is not None else ''}><summary>every tensor "
        f"({len(lv.rows)})</summary>{tensor_table(lv)}</details>"
    )
    return "\n".join(parts)


def groups_section(d: PageData) -> str:
    if d.groups is None:
        return ""
    head = (
        "<tr><th>group</th><th>kind</th><th>ops</th><th>slices (N × H)</th><th>local memory / lane</th>"
        "<th>est. cycles</th><th>DDR bytes</th></tr>"
    )
    rows = []
    for g in d.groups:
        ops = [f"{e(name)} <small>({e(kind.removeprefix('tpu.'))})</small>" for name, kind in g.ops]
        shown = ", ".join(ops[:6]) + (
            f"<details><summary>{len(ops) - 6} more</summary>{', '.join(ops[6:])}</details>" if len(ops) > 6 else ""
        )
        if g.kind == "local":
            share = f" ({g.lmem_bytes / d.lane_bytes:.0%})" if d.lane_bytes else ""
            lmem = f"{size(g.lmem_bytes)}{share}"
            slices = f"{g.n_secs * g.h_secs} ({g.n_secs} × {g.h_secs})"
        else:
            lmem, slices = "–", "–"
        rows.append(
            f"<tr><td class=num>{g.id}</td><td>{e(g.kind)}</td><td>{shown}</td><td class=num>{slices}</td>"
            f"<td class=num>{lmem}</td><td class=num>{g.cycles:,}</td><td class=num>{g.ddr_bytes:,}</td></tr>"
        )
    cap = f" of {size(d.lane_bytes)} per lane" if d.lane_bytes else ""
    return (
        f'<h2 id="groups">Layer groups</h2><p>{len(d.groups)} groups; local memory is the peak per lane{cap}; '
        f"cycles and DDR bytes are layer group's estimates.</p>"
        f'<table class="groups">{head}{"".join(rows)}</table>'
    )


def precision_section(d: PageData) -> str:
    if d.precision is None:
        return ""
    p = d.precision
    floats = p.floats
    names = [f"{e(name)} <small>({e(op.removeprefix('tpu.'))}, {e(elem)})</small>" for name, op, elem in floats]
    listed = f"<details><summary>the {len(floats)} float ops</summary>{', '.join(names)}</details>" if names else ""
    share = f", {p.float_macs / p.macs:.1%} of the multiply-accumulates (convolutions and matmuls)" if p.macs else ""
    return (
        f'<h2 id="precision">Precision</h2><p class="precision">{len(floats)} of {p.ops} ops compute '
        f"in float{share}: those the mixed-precision search kept (its table is qtable.txt beside this page), "
        "per-sample vectors and Concats of unlike ranges (docs/lowering.md), and ops INT8 has no rule for (Softmax, "
        "LayerNorm, ...); the rest compute in INT8.</p>"
        + (f'<p class="bias">{e(p.bias)} (docs/lowering.md#bias-correction)</p>' if p.bias else "")
        + listed
    )


def timeline_section(d: PageData) -> str:
    if d.spans is None or d.profile is None:
        return ""
    p = d.profile
    lanes = group_spans(d.groups, d.spans) if d.groups is not None else None
    timeline = charts.timeline_chart(d.spans, p["total_cycles"], p["clock_hz"], lanes)
    parts = [
        '<h2 id="timeline">GDMA / BDC timeline</h2>',
        f"<p>Every command as the cycle model replays the .model: {p['gdma']['commands']:,} GDMA "
        f"({p['gdma']['utilisation']:.0%} busy) and {p['bdc']['commands']:,} BDC "
        f"({p['bdc']['utilisation']:.0%} busy); a command starts when its engine is free and its wait is met."
        + (" The group lane spans each layer group's computes, labelled with its id." if lanes else "")
        + "</p>",
        f'<div class="chart timeline">{timeline}</div>',
    ]
    if p.get("ops"):
        parts += ["<h3>BDC cycles by op type</h3>", f'<div class="chart ops">{charts.ops_chart(p["ops"])}</div>']
    return "\n".join(parts)


def render(d: PageData) -> str:
    status = badge(d.passed)
    chip_line = ""
    if d.profile:
        chip_line = f" · chip {e(d.profile['chip'])} at {d.profile['clock_hz'] / 1e6:g} MHz"
    failure = ""
    if d.failure:
        stage, message = d.failure
        failure = f'<h2>Build stopped at {e(stage)}</h2><pre class="failure">{e(message)}</pre>'
    sections = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{e(d.model)} · {e(d.target)} · tpubuild report</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>{e(d.model)} · {e(d.target)} {status}</h1>",
        f'<p class="sub">tpubuild verification and performance report{chip_line}</p>',
        f'<p class="test-input">Test input: {e(d.test_input)}</p>' if d.test_input else "",
        summary_cards(d),
        failure,
        '<h2 id="similarity">Similarity</h2>',
        first_failure(d.levels),
        levels_table(d.levels),
        # on a page about a failure, the levels that passed keep their charts folded
        *(level_section(lv, i, fold=not d.passed and bool(lv.comp["passed"])) for i, lv in enumerate(d.levels)),
        precision_section(d),
        groups_section(d),
        timeline_section(d),
        "</body></html>",
    ]
    return "\n".join(s for s in sections if s) + "\n"


# ---- the stage --------------------------------------------------------------------------------------


def write_report(
    model: str,
    target: str,
    verify_json: str,
    profile_json: str,
    lg_mlir: str,
    model_file: str,
    graphs: Sequence[str],
    out_html: str,
    qtable: str | None = None,
) -> None:
    """verify.json + profile.json + lg.mlir + the .model (+ the graphs, for tensor order; the searched quantize
    table, for its line on bias corrections) -> report.html."""
    from tpubuild.build.files import write_text

    page = target_page(model, target, verify_json, profile_json, lg_mlir, model_file, graphs, qtable)
    write_text(out_html, render(page))


def write_cpu_report(
    model: str, target: str, verify_json: str, vmfb: str, graphs: Sequence[str], out_html: str
) -> None:
    """A cpu (IREE) target's report.html: its levels (ONNX vs Top, Top vs IREE) and the .vmfb's size."""
    from tpubuild.build.files import write_text

    doc = json.loads(Path(verify_json).read_text(encoding="utf-8"))
    infos = graph_infos(graphs, Path(verify_json).parent.parent)
    data = PageData(
        model=model,
        target=target,
        passed=bool(doc["passed"]),
        levels=levels_of(doc["comparisons"], infos),
        model_bytes=Path(vmfb).stat().st_size,
    )
    write_text(out_html, render(data))
