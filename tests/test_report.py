"""report.html per target and the zoo index: built through doit on a small CNN, read back, and shown in Chromium.

One build tree per module: model `cnn` (F32 and INT8 targets, both pass) and
model `strict` (an INT8 target whose Tpu tolerance no INT8 model meets, so it
stops at verify_tpu). The browser tests need Debian's chromium; without it they
skip, unless TPUBUILD_REQUIRE_BROWSER is set (CI), where a missing browser fails.
"""

from __future__ import annotations

import html

import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tpubuild.ir.types import shape_of
from tpubuild.verify import charts, report
from tpubuild.testing import run_doit

REPO = Path(__file__).resolve().parents[1]

MANIFEST = """\
name: {name}
source: cnn.onnx
inputs:
  - name: x
    shape: [1, 3, 16, 16]
    range: [-1, 1]
calibration:
  data: calib/*.npz
  method: max
targets:
{targets}
{tolerance}"""
STRICT = "tolerance:\n  tpu: {INT8: {cos: 0.9999999, euc: 0.9999}}\n"


def cnn_onnx(path: Path) -> None:
    """conv-relu, maxpool, conv + residual add, global pool, gemm, softmax."""
    rng = np.random.default_rng(3)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.3).astype(np.float32)

    inits = [
        numpy_helper.from_array(a, n)
        for n, a in (
            ("w1", w(8, 3, 3, 3)),
            ("b1", w(8)),
            ("w2", w(8, 8, 3, 3)),
            ("b2", w(8)),
            ("wf", w(5, 8)),
            ("bf", w(5)),
        )
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="c1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="r1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], name="p1", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], name="c2", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "p1"], ["res"], name="res"),
        helper.make_node("Relu", ["res"], ["r2"], name="r2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="flat"),
        helper.make_node("Gemm", ["flat", "wf", "bf"], ["logits"], name="logits", transB=1),
        helper.make_node("Softmax", ["logits"], ["y"], name="y", axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])],
        initializer=inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)


class Zoo:
    def __init__(self, root: Path):
        self.models = root / "models"
        self.build = root / "build"
        (self.models / "calib").mkdir(parents=True)
        cnn_onnx(self.models / "cnn.onnx")
        rng = np.random.default_rng(4)
        for i in range(3):
            np.savez(self.models / "calib" / f"s{i}.npz", x=rng.uniform(-1, 1, (1, 3, 16, 16)).astype(np.float32))

    def manifest(self, name: str, targets: list[str], tolerance: str = "") -> None:
        lines = "\n".join(f"  - {{chip: {t.split('-')[0]}, mode: {t.split('-')[1]}}}" for t in targets)
        (self.models / f"{name}.yaml").write_text(MANIFEST.format(name=name, targets=lines, tolerance=tolerance))

    def doit(self, *args: str) -> subprocess.CompletedProcess:
        return run_doit(*args, manifests=self.models, build=self.build, timeout=900)

    def target(self, model: str, target: str) -> Path:
        return self.build / model / target


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Zoo:
    z = Zoo(tmp_path_factory.mktemp("report"))
    z.manifest("cnn", ["bm1684x-F32", "bm1684x-INT8"])
    z.manifest("strict", ["bm1684x-INT8"], STRICT)
    run = z.doit("-n", "2", "compile")
    assert run.returncode != 0, "strict must fail at verify_tpu"
    out = run.stdout + run.stderr
    assert "TaskFailed - taskid:verify_tpu:strict/bm1684x-INT8" in out, out
    assert "zoo index:" in out, out
    return z


def _html(path: Path) -> str:
    assert path.is_file(), path
    return path.read_text(encoding="utf-8")


# ---- the target page ---------------------------------------------------------------------------------


def test_every_passing_target_has_a_report(zoo):
    for t in ("bm1684x-F32", "bm1684x-INT8"):
        page = _html(zoo.target("cnn", t) / "report.html")
        doc = json.loads((zoo.target("cnn", t) / "verify.json").read_text())
        # a chart and a tensor table per comparison (ONNX vs Top twice, Top vs Tpu, Tpu vs Chip)
        assert len(doc["comparisons"]) == 4
        assert page.count('<div class="chart similarity">') == 4
        assert page.count('<table class="tensors">') == 4
        for comp in doc["comparisons"]:
            assert f"{comp['test']} vs {comp['ref']}" in page
        assert 'class="chart timeline"' in page and '<table class="groups">' in page
        assert "Every tensor is within tolerance" in page


def test_report_is_self_contained(zoo):
    page = _html(zoo.target("cnn", "bm1684x-INT8") / "report.html")
    # nothing fetched: no script, stylesheet, image or font from anywhere; links only to anchors in the page
    assert not re.search(r"<(script|link|iframe|img)\b", page)
    assert all(u.startswith("#") for u in re.findall(r"url\(([^)]*)\)", page))  # SVG clip paths in the page
    ids = re.findall(r' id="([^"]+)"', page)
    assert len(ids) == len(set(ids)), "an id repeats on the page"
    refs = re.findall(r'(?:src|href)="([^"]*)"', page)
    assert refs and all(r.startswith(("#", "data:")) for r in refs), sorted(set(refs))[:5]


def test_report_names_the_layer_groups_of_lg_mlir(zoo):
    from tpubuild.codegen.layergroup import read_groups
    from tpubuild.ir.mlir import load_module

    t = zoo.target("cnn", "bm1684x-INT8")
    groups = read_groups(load_module(t / "lg.mlir"))
    page = _html(t / "report.html")
    table = page[page.index('<table class="groups">') :]
    table = table[: table.index("</table>")]
    assert table.count("<tr>") == len(groups) + 1  # header + one per group
    for g in groups:
        if g.kind == "local":
            assert f"{g.n_secs * g.h_secs} ({g.n_secs} × {g.h_secs})" in table


def test_an_int8_page_lists_the_ops_that_compute_in_float_as_the_parsed_module_has_them(zoo):
    from tpubuild.ir import mlir
    from tpubuild.ir.mlir import load_module
    from tpubuild.ir.quant import UniformType

    t = zoo.target("cnn", "bm1684x-INT8")
    module = load_module(t / "lg.mlir")
    compute = [
        op
        for op in mlir.body_ops(module)
        if op.name.startswith("tpu.") and op.name not in ("tpu.Cast", "tpu.Reshape") and op.results
    ]
    floats = [op for op in compute if not isinstance(op.results[0].type.element_type, UniformType)]
    precision = report.read_precision((t / "lg.mlir").read_text())
    assert precision.ops == len(compute) and [f[0] for f in precision.floats] == [op.loc_name for op in floats]
    assert floats, "the cnn's softmax at least computes in float"

    def work(op) -> int:  # a conv's result values times its filter's per output; a matmul's times its K
        out = math.prod(shape_of(op.results[0].type))
        if op.name == "tpu.Conv":
            return out * math.prod(shape_of(op.operands[1].type)[1:])
        return out * shape_of(op.operands[0].type)[-1] if op.name == "tpu.MatMul" else 0

    assert precision.macs == sum(map(work, compute)) > 0
    assert precision.float_macs == sum(map(work, floats))
    page = _html(t / "report.html")
    share = f"{precision.float_macs / precision.macs:.1%} of the multiply-accumulates"
    assert f"{len(floats)} of {len(compute)} ops compute in float, {share}" in page
    assert 'id="precision"' not in _html(zoo.target("cnn", "bm1684x-F32") / "report.html")
    # what the search decided of bias corrections, as its table's header says
    decided = next(x for x in (t / "qtable.txt").read_text().splitlines() if x.startswith("# bias corrections: "))
    assert html.escape(decided[2:]) in page


def test_groups_read_from_the_module_attribute_equal_those_of_the_parsed_module(zoo):
    """The page reads lg.groups alone (and each op's type from its line), not the whole module: the same rows."""
    for target in ("bm1684x-F32", "bm1684x-INT8"):
        lg = zoo.target("cnn", target) / "lg.mlir"
        assert report._module_attr(lg.read_text(), report._GROUPS_ATTR) is not None  # not the fallback
        rows = report.read_groups(lg)
        assert rows and rows == report._read_groups_parsed(lg)
        assert all(kind.startswith("tpu.") for row in rows for _, kind in row.ops)
    # brackets inside quoted names do not end the attribute
    text = 'x\n}) {module.name = "m", lg.groups = [{ops = ["a]b", "c\\"[d"], id = 0 : i64}], z = 1 : i64} : () -> ()'
    assert report._module_attr(text, report._GROUPS_ATTR) == '[{ops = ["a]b", "c\\"[d"], id = 0 : i64}]'


def test_timeline_replays_the_profile(zoo):
    from tpubuild.codegen.model_file import read_model

    t = zoo.target("cnn", "bm1684x-INT8")
    profile = json.loads((t / "profile.json").read_text())
    spans = report.command_spans(read_model(t / "cnn.model"))
    # the same cycle model as the run stage: every command once, busy cycles and the end as profiled
    for engine in ("gdma", "bdc"):
        mine = [s for s in spans if s.engine == engine]
        assert len(mine) == profile[engine]["commands"]
        assert sum(s.end - s.start for s in mine) == profile[engine]["busy_cycles"]
    assert max(s.end for s in spans) == profile["total_cycles"]
    page = _html(t / "report.html")
    assert f"{profile['total_cycles']:,} cycles" in page
    # the group lane: lg.mlir's groups account for every BDC of the queue, in order and without overlap
    groups = report.read_groups(t / "lg.mlir")
    lanes = report.group_spans(groups, spans)
    assert lanes and [g for g, _, _ in lanes] == [g.id for g in groups if g.kind in ("local", "global")]
    assert all(a < b <= c for (_, a, b), (_, c, _) in itertools.pairwise(lanes))
    assert "The group lane spans each layer group" in page


def test_report_is_byte_identical_across_runs_and_hash_seeds(zoo, tmp_path):
    t = zoo.target("cnn", "bm1684x-INT8")
    m = zoo.build / "cnn"
    args = [
        repr(a)
        for a in (
            "cnn",
            "bm1684x-INT8",
            str(t / "verify.json"),
            str(t / "profile.json"),
            str(t / "lg.mlir"),
            str(t / "cnn.model"),
            [str(m / "origin.mlir"), str(m / "canonical.mlir"), str(t / "tpu.mlir")],
        )
    ]
    outs = []
    qtable = str(t / "qtable.txt")
    for seed in ("1", "2"):
        out = tmp_path / f"r{seed}.html"
        code = (
            f"from tpubuild.verify.report import write_report; "
            f"write_report({', '.join(args)}, {str(out)!r}, {qtable!r})"
        )
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)
        outs.append(out.read_bytes())
    assert outs[0] == outs[1] == (t / "report.html").read_bytes()
    assert not re.search(rb"20\d\d-\d\d-\d\d", outs[0])  # no dates


def test_graph_order_and_lines_match_the_parsed_module(zoo):
    from tpubuild.ir.base import TensorOp
    from tpubuild.ir.mlir import body_ops, load_module
    from tpubuild.ir.top import NoneOp, WeightOp

    path = zoo.target("cnn", "bm1684x-INT8") / "tpu.mlir"
    info = report.graph_info(path, "tpu.mlir")
    expected = [
        (name, op.name)
        for op in body_ops(load_module(path))
        if isinstance(op, TensorOp) and not isinstance(op, (WeightOp, NoneOp))
        for name in op.names
    ]
    assert [(n, s.op) for n, s in sorted(info.sites.items(), key=lambda kv: kv[1].index)] == expected
    lines = path.read_text().splitlines()
    for name, site in info.sites.items():
        assert f'loc("{name}")' in lines[site.line - 1]


# ---- a failing target and the index ------------------------------------------------------------------


def test_failing_verify_keeps_its_comparison_and_gets_a_failure_page(zoo):
    from tpubuild.ir.mlir import body_ops, load_module

    t = zoo.target("strict", "bm1684x-INT8")
    assert not (t / "report.html").exists() and not (t / "verify_tpu.json").exists()
    kept = json.loads((t / "verify_tpu.failed.json").read_text())
    rows = {row["name"]: row for row in kept["comparisons"][0]["tensors"]}
    assert kept["passed"] is False and any(not r["passed"] for r in rows.values())
    # the first failing tensor in the order the TPU graph computes them (not by name)
    order = [name for op in body_ops(load_module(t / "tpu.mlir")) for name in getattr(op, "names", [])]
    first = next(n for n in order if n in rows and not rows[n]["passed"])
    op = next(op for op in body_ops(load_module(t / "tpu.mlir")) if first in getattr(op, "names", []))
    page = _html(t / "failed.html")
    callout = page[page.index('id="first-failure"') :]
    callout = callout[: callout.index("</div>")]
    assert "First tensor below tolerance" in callout
    assert f"<code>{first}</code>: op <code>{op.name}</code>" in callout
    assert "bm1684x-INT8/tpu.mlir:" in callout
    assert "Build stopped at verify_tpu" in page and "does not match TOP inference" in page
    assert '<tr class="first">' in page  # the row in the tensor table too


def _index_rows(page: str) -> dict[tuple[str, str], str]:
    rows = {}
    for tr in re.findall(r'<tr class="row-[^"]*">(.*?)</tr>', page, re.S):
        cells = re.findall(r"<td[^>]*>(.*?)</td>", tr, re.S)
        rows[(cells[0], cells[1])] = tr
    return rows


def test_index_lists_every_target_with_status_and_links(zoo):
    page = _html(zoo.build / "index.html")
    rows = _index_rows(page)
    assert set(rows) == {("cnn", "bm1684x-F32"), ("cnn", "bm1684x-INT8"), ("strict", "bm1684x-INT8")}
    for key in (("cnn", "bm1684x-F32"), ("cnn", "bm1684x-INT8")):
        assert "PASS" in rows[key] and f'href="{key[0]}/{key[1]}/report.html"' in rows[key]
        size = (zoo.target(*key) / "cnn.model").stat().st_size
        assert report.size(size) in rows[key]
    strict = rows[("strict", "bm1684x-INT8")]
    assert "FAIL" in strict and "verify_tpu" in strict and 'href="strict/bm1684x-INT8/failed.html"' in strict
    assert "3 targets: 2 passed, 1 failed" in page
    for href in re.findall(r'href="([^"#]+)"', page):
        assert (zoo.build / href).is_file(), href


# ---- the charts on their own -------------------------------------------------------------------------


def test_chart_marks_the_first_failure_and_is_deterministic():
    pts = [charts.Point(f"t{i}", c, 0.99, 30.0, c >= 0.99, False) for i, c in enumerate([1.0, 0.995, 0.9, 0.8])]
    a = charts.similarity_chart(pts, 0.99, 0.9, 2, True, salt="x")
    assert a == charts.similarity_chart(pts, 0.99, 0.9, 2, True, salt="x")
    assert a.startswith("<svg") and "first below tolerance: t2" in a and "tolerance 0.99" in a
    # another salt: other ids, so two charts can share a page; every id is one the chart refers to
    b = charts.similarity_chart(pts, 0.99, 0.9, 2, True, salt="y")
    ids = re.findall(r' id="([^"]+)"', a)
    assert ids and len(ids) == len(set(ids)) and not set(ids) & set(re.findall(r' id="([^"]+)"', b))
    assert set(ids) == set(re.findall(r'(?:href="|url\()#([^")]+)', a))


def test_timeline_of_many_commands_stays_small():
    """Commands closer than a tenth of a point merge into one bar: 40,000 commands, a few hundred kilobytes."""
    spans = [charts.Span("bdc", 10 * i, 10 * i + 7, ["conv", "add"][i % 2]) for i in range(20_000)]
    spans += [charts.Span("gdma", 10 * i, 10 * i + 9, "load") for i in range(20_000)]
    svg = charts.timeline_chart(spans, 200_000, 1e9, [(0, 0, 100_000), (1, 100_000, 200_000)])
    assert svg == charts.timeline_chart(spans, 200_000, 1e9, [(0, 0, 100_000), (1, 100_000, 200_000)])
    assert len(svg) < 300_000, len(svg)
    for kind in ("conv", "add", "load"):  # each kind's bars and its legend entry
        assert f">{kind}</text>" in svg
    assert svg.count('<path d="M') > 10 and "cycles (total 200,000" in svg
    # few commands: one bar each, edged apart
    few = charts.timeline_chart(spans[:3], 30, 1e9)
    assert few.count("Z") >= 3 and 'stroke="#ffffff"' in few


def _comp(level: str, passed: bool, rows: list[tuple[str, float]]) -> dict:
    tensors = [
        {
            "name": n,
            "shape": [1],
            "label": "SIMILAR" if c >= 0.9 else "NOT SIMILAR",
            "passed": c >= 0.9,
            "cos": c,
            "euc": c,
            "sqnr": 20.0,
            "max_abs": 0.1,
        }
        for n, c in rows
    ]
    return {
        "level": level,
        "test": "t.mlir",
        "ref": "r.npz",
        "tolerance": {"cos": 0.9, "euc": 0.8},
        "passed": passed,
        "decided_by": "graph outputs",
        "tensors": tensors,
    }


def test_callout_separates_deciding_failures_from_reported_ones():
    # Top vs Tpu passes on its outputs with an intermediate below tolerance; the chip level fails
    graph = report.GraphInfo("t.mlir", {"b": report.Site(0, "tpu.Conv", 7), "a": report.Site(1, "tpu.Add", 9)})
    levels = [
        report.order_level(_comp("tpu", True, [("a", 0.5), ("b", 0.95)]), graph),
        report.order_level(_comp("chip", False, [("y", 0.2)]), None),
    ]
    assert [r["name"] for r in levels[0].rows] == ["b", "a"]  # graph order, not by name
    text = report.first_failure(levels)
    first, second = text.split("\n")
    assert 'class="callout note" id="first-failure"' in first and "reported only" in first
    assert "<code>a</code>: op <code>tpu.Add</code>" in first and "t.mlir:9" in first
    assert 'class="callout"' in second and "<code>y</code>" in second and "reported only" not in second
    # a level decided by its outputs that fails: the first drop, and the outputs that fail it
    chip = _comp("tpu", False, [("a", 0.5), ("b", 0.95), ("y", 0.6)])
    chip["tensors"][2]["output"] = True
    text = report.first_failure([report.order_level(chip, None)])
    assert "<code>a</code>" in text and "fails on its graph outputs y" in text
    passing = [report.order_level(_comp("tpu", True, [("a", 0.97), ("b", 0.95)]), graph)]
    assert "Every tensor is within tolerance" in report.first_failure(passing)
    assert "Lowest cosine (Top vs Tpu): <code>b</code>" in report.first_failure(passing)


# ---- in a browser ------------------------------------------------------------------------------------

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]
# measured in the page itself: what the browser laid out, and every resource it fetched
PROBE = """<script>
(() => {
  const box = e => { const r = e.getBoundingClientRect(); return [Math.round(r.width), Math.round(r.height)]; };
  const out = {
    svgs: [...document.querySelectorAll('svg')].map(s => ({box: box(s),
                                                          shapes: s.querySelectorAll('path,use,rect,image').length,
                                                          chart: s.parentElement.className})),
    tables: [...document.querySelectorAll('table')].map(t => ({cls: t.className, rows: t.rows.length, box: box(t)})),
    resources: performance.getEntriesByType('resource').map(e => e.name),
    callout: (document.getElementById('first-failure') || {}).textContent || null,
    title: document.title,
  };
  const pre = document.createElement('pre'); pre.id = 'probe'; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
})();
</script>"""


@pytest.fixture(scope="module")
def chromium() -> str:
    exe = shutil.which("chromium")
    if exe is None:
        if os.environ.get("TPUBUILD_REQUIRE_BROWSER"):
            pytest.fail("chromium is not installed (make test installs it as root: make browser)")
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    return exe


def _browse(exe: str, page: Path, tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    profile = tmp / f"profile-{len(list(tmp.iterdir()))}"
    return subprocess.run(
        [exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *extra, page.as_uri()],
        capture_output=True,
        text=True,
        timeout=180,
    )


def _probe(exe: str, page: Path, tmp: Path) -> dict:
    probed = page.parent / f".probe-{page.name}"  # beside the page: same folder, same relative links
    probed.write_text(page.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"), encoding="utf-8")
    try:
        run = _browse(exe, probed, tmp, "--dump-dom")
    finally:
        probed.unlink()
    assert run.returncode == 0, run.stderr[-2000:]
    found = re.search(r'<pre id="probe">(.*?)</pre>', run.stdout, re.S)
    assert found, run.stdout[-2000:]
    import html

    return json.loads(html.unescape(found.group(1)))


def test_report_in_chromium_shows_tables_and_charts(zoo, chromium, tmp_path):
    page = zoo.target("cnn", "bm1684x-INT8") / "report.html"
    seen = _probe(chromium, page, tmp_path)
    assert seen["title"].startswith("cnn · bm1684x-INT8")
    assert seen["resources"] == []  # nothing loaded from outside the page
    charts_seen = [s for s in seen["svgs"] if s["chart"].startswith("chart")]
    kinds = {s["chart"] for s in charts_seen}
    assert kinds == {"chart similarity", "chart timeline", "chart ops"}
    for s in charts_seen:
        w, h = s["box"]
        assert w > 200 and h > 100 and s["shapes"] > 10, s
    tables = {t["cls"]: t for t in seen["tables"]}
    assert tables["levels"]["rows"] == 5 and tables["levels"]["box"][1] > 50  # header + 4 comparisons, visible
    assert tables["groups"]["rows"] >= 2 and tables["groups"]["box"][1] > 0
    assert "Every tensor is within tolerance" in seen["callout"]
    shot = tmp_path / "report.png"
    run = _browse(chromium, page, tmp_path, f"--screenshot={shot}", "--window-size=1280,2400")
    assert run.returncode == 0 and shot.is_file()
    from PIL import Image

    pixels = np.asarray(Image.open(shot).convert("L"), dtype=np.float64)
    # a drawn page: most of it white, yet thousands of dark pixels (text, axes, markers)
    assert pixels.shape == (2400, 1280) and (pixels < 128).sum() > 5000, (pixels < 128).sum()


def test_index_and_failure_page_in_chromium(zoo, chromium, tmp_path):
    seen = _probe(chromium, zoo.build / "index.html", tmp_path)
    assert seen["resources"] == []
    (zoo_table,) = [t for t in seen["tables"] if t["cls"] == "zoo"]
    assert zoo_table["rows"] == 4 and zoo_table["box"][1] > 60
    failed = zoo.target("strict", "bm1684x-INT8") / "failed.html"
    seen = _probe(chromium, failed, tmp_path)
    assert "First tensor below tolerance" in seen["callout"]
    assert any(s["chart"] == "chart similarity" and s["box"][0] > 200 for s in seen["svgs"])


# ---- last: it rebuilds a model ---------------------------------------------------------------------


def test_fixing_the_manifest_clears_the_failure(zoo):
    """Last in the module: it rebuilds `strict` with the default tolerance."""
    zoo.manifest("strict", ["bm1684x-INT8"])
    run = zoo.doit("compile:strict")
    assert run.returncode == 0, run.stdout + run.stderr
    t = zoo.target("strict", "bm1684x-INT8")
    assert (t / "report.html").is_file() and not (t / "verify_tpu.failed.json").exists()
    rows = _index_rows(_html(zoo.build / "index.html"))
    assert "PASS" in rows[("strict", "bm1684x-INT8")] and "PASS" in rows[("cnn", "bm1684x-INT8")]
    assert json.loads((zoo.build / ".status.json").read_text()) == {}
    assert not (t / "failed.html").exists()  # the index removes a failure page once the target passes
