"""The zoo index (build/index.html): every model and target, its status and headline numbers, linking the reports.

A target's status needs what doit does not keep: which task failed, and why.
The console reporter records every stage task's outcome as the run goes
(``Outcomes``) into build/.status.json, and at the end of the run this module
writes the index from that record and the build tree:

- PASS: no recorded failure for the model or the target, and report.html exists;
- FAIL at <stage>: the earliest stage whose last run failed, with its message
  and a failure page (failed.html) showing the levels verified before it and,
  when a verify stage failed, its comparison with the first tensor below
  tolerance (the stage keeps it as <verify>.failed.json);
- not built: neither.

Figures after the failing stage are left out: their files are from an older build.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tpubuild.build.paths import ModelPaths, failed_json, zoo_index, zoo_status
from tpubuild.verify import report as page

# stages in graph order (the first failing one is the one to fix); unknown ones sort last
STAGE_ORDER = (
    "fetch",
    "transform",
    "reference",
    "canonicalize",
    "calibrate",
    "verify_top",
    "search",
    "lower",
    "verify_tpu",
    "layergroup",
    "assign",
    "codegen",
    "run",
    "verify_chip",
    "export",
    "iree_compile",
    "iree_run",
    "verify_iree",
    "report",
    "compile",
)
LEVEL_STAGES = (("top", "verify_top"), ("tpu", "verify_tpu"), ("chip", "verify_chip"))


def _rank(stage: str) -> int:
    return STAGE_ORDER.index(stage) if stage in STAGE_ORDER else len(STAGE_ORDER)


def split_task(name: str) -> tuple[str, str, str | None]:
    """'verify_tpu:m/bm1684x-INT8' -> ('verify_tpu', 'm', 'bm1684x-INT8'); model-level tasks have no target."""
    stage, _, rest = name.partition(":")
    model, _, target = rest.partition("/")
    return stage, model, target or None


# ---- the record of outcomes ---------------------------------------------------------------------


class Outcomes:
    """The stage tasks whose last run failed, with the failure's text (a success clears the task)."""

    def __init__(self, build_dir: str | Path):
        self.file = zoo_status(build_dir)
        try:
            last = json.loads(self.file.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # none yet, or cut short by a crash: start again
            last = {}
        self.last: dict[str, str] = (
            {k: v for k, v in last.items() if isinstance(v, str)} if isinstance(last, dict) else {}
        )
        self.failed_now: set[str] = set()

    def ok(self, task: str) -> None:
        self.last.pop(task, None)

    def failed(self, task: str, message: str) -> None:
        self.last[task] = message
        self.failed_now.add(task)

    def save(self, known: Iterable[str]) -> None:
        """Keep the tasks that still exist (removed manifests and targets drop out)."""
        from tpubuild.build.files import write_text

        keep = set(known)
        self.last = {k: v for k, v in self.last.items() if k in keep}
        write_text(self.file, json.dumps(dict(sorted(self.last.items())), indent=1) + "\n")

    def failure(self, model: str, target: str | None) -> tuple[str, str] | None:
        """(stage, message) of the earliest failed task of the model (or of the target, if given)."""
        task = self.failed_task(model, target)
        return (split_task(task)[0], self.last[task]) if task else None

    def failed_task(self, model: str, target: str | None) -> str | None:
        found = []
        for task in self.last:
            stage, m, t = split_task(task)
            if m == model and (t is None or t == target):
                found.append((_rank(stage), task))
        return min(found)[1] if found else None


# ---- one row per target ---------------------------------------------------------------------------


@dataclass
class Row:
    model: str
    target: str | None  # None: a model whose manifest defines no usable target
    status: str  # PASS, FAIL, not built
    stage: str | None = None
    message: str | None = None
    min_cos: dict[str, float] = field(default_factory=dict)  # level -> min cos
    level_passed: dict[str, bool] = field(default_factory=dict)
    time_ms: float | None = None
    ddr_bytes: int | None = None
    model_bytes: int | None = None
    link: str | None = None  # relative to the index


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def level_docs(p: ModelPaths, target: str | None, failure: tuple[str, str] | None) -> list[dict]:
    """The verify documents a row may show: levels before the failing stage, the failing one's kept comparison."""
    tp = p.target(target) if target else None
    if failure and failure[0] == "verify_iree":  # a cpu target's verify.json: read where the chip's is
        failure = ("verify_chip", failure[1])
    files = {
        "verify_top": p.verify_top,
        "verify_tpu": tp.verify_tpu if tp else None,
        "verify_chip": tp.verify if tp else None,
    }
    docs = []
    for level, stage in LEVEL_STAGES:
        path = files[stage]
        if path is None:
            continue
        if failure and stage == failure[0]:
            doc = _read(failed_json(path))
        elif failure and _rank(stage) > _rank(failure[0]):
            doc = None
        else:
            doc = _read(path)
        if doc:
            # a cpu target's Top vs IREE shows in the chip column (its last level, from its verify.json)
            wanted = (level, "iree") if level == "chip" else (level,)
            docs.append({**doc, "comparisons": [c for c in doc["comparisons"] if c["level"] in wanted]})
    return docs


def make_row(build_dir: Path, model: str, target: str | None, outcomes: Outcomes) -> Row:
    p = ModelPaths.of(build_dir, model)
    failure = outcomes.failure(model, target)
    tp = p.target(target) if target else None
    if failure:
        row = Row(model, target, "FAIL", *failure)
    elif tp and tp.report.is_file():
        row = Row(model, target, "PASS")
    else:
        row = Row(model, target, "not built")
    for doc in level_docs(p, target, failure):
        for comp in doc["comparisons"]:
            cos = float(comp.get("decided_cos", comp["min_cos"]))  # what decided, as the summary table
            level = "chip" if comp["level"] == "iree" else comp["level"]
            row.min_cos[level] = min(cos, row.min_cos.get(level, cos))
            row.level_passed[level] = row.level_passed.get(level, True) and bool(comp["passed"])
    if row.status == "PASS" and tp is not None:
        profile = _read(tp.profile) or {}
        row.time_ms = profile.get("time_ms")
        if profile:
            row.ddr_bytes = profile["ddr_read_bytes"] + profile["ddr_write_bytes"]
        built = tp.model_file if tp.model_file.is_file() else tp.vmfb  # a cpu target's module is its .vmfb
        row.model_bytes = built.stat().st_size if built.is_file() else None
        row.link = _href(build_dir, tp.report)
    elif row.status == "FAIL" and failure:
        page_path = failure_page_path(p, target, failure[0])
        if page_path.is_file():
            row.link = _href(build_dir, page_path)
    return row


def _target_stage(stage: str) -> bool:
    return _rank(stage) >= _rank("search") and stage != "compile"


def failure_page_path(p: ModelPaths, target: str | None, stage: str) -> Path:
    """A target stage's failure has the target's page; a model-level one, the model's (shared by its targets)."""
    return p.target(target).failed_page if target and _target_stage(stage) else p.failed_page


def _href(build_dir: Path, path: Path) -> str:
    return urllib.parse.quote(path.relative_to(build_dir).as_posix())


# ---- failure pages -------------------------------------------------------------------------------


def write_failure_page(build_dir: Path, model: str, target: str | None, failure: tuple[str, str]) -> Path:
    """failed.html: the failing stage's message and every level known, first tensor below tolerance marked."""
    from tpubuild.build.files import write_text

    p = ModelPaths.of(build_dir, model)
    tp = p.target(target) if target and _target_stage(failure[0]) else None
    out = failure_page_path(p, target, failure[0])
    graphs = [g for g in (p.origin_mlir, p.canonical_mlir, tp.tpu_mlir if tp else None) if g and g.is_file()]
    infos = page.graph_infos([str(g) for g in graphs], p.root)
    docs = level_docs(p, tp.root.name if tp else None, failure)
    comparisons = [c for doc in docs for c in doc["comparisons"]]
    data = page.PageData(
        model=model,
        target=tp.root.name if tp else "all targets",
        passed=False,
        levels=page.levels_of(comparisons, infos),
        failure=failure,
        test_input=next((doc["test_input"] for doc in docs if "test_input" in doc), None),
    )
    write_text(out, page.render(data))
    return out


# ---- the index page ------------------------------------------------------------------------------


def _cos_cell(row: Row, level: str) -> str:
    if level not in row.min_cos:
        return "<td class=num>–</td>"
    cls = "" if row.level_passed.get(level, True) else ' style="color:#c62828;font-weight:bold"'
    return f"<td class=num{cls}>{page.fmt(row.min_cos[level])}</td>"


def render_index(rows: Sequence[Row]) -> str:
    e = page.e
    counts = {s: sum(r.status == s for r in rows) for s in ("PASS", "FAIL", "not built")}
    models = len({r.model for r in rows})
    head = (
        "<tr><th>model</th><th>target</th><th>status</th><th>ONNX vs Top<br>min cos</th>"
        "<th>Top vs Tpu<br>min cos</th><th>Tpu vs Chip<br>(cpu: Top vs IREE)<br>min cos</th>"
        "<th>est. time</th><th>DDR traffic</th>"
        "<th>model size</th><th>page</th></tr>"
    )
    body = []
    for r in rows:
        badge = page.badge({"PASS": True, "FAIL": False}.get(r.status), r.status)
        status = badge
        if r.status == "FAIL":
            first = (r.message or "").strip().splitlines()[0] if r.message else ""
            status += f' at <b>{e(r.stage)}</b><div class=msg title="{e(r.message or "")}">{e(first[:160])}</div>'
        link = f'<a href="{e(r.link)}">{"report" if r.status == "PASS" else "failure"}</a>' if r.link else "–"
        time = f"{r.time_ms:.4g} ms" if r.time_ms is not None else "–"
        body.append(
            f'<tr class="row-{r.status.replace(" ", "-").lower()}"><td>{e(r.model)}</td>'
            f"<td>{e(r.target or '–')}</td><td class=status>{status}</td>"
            f"{_cos_cell(r, 'top')}{_cos_cell(r, 'tpu')}{_cos_cell(r, 'chip')}"
            f"<td class=num>{time}</td><td class=num>{page.size(r.ddr_bytes)}</td>"
            f"<td class=num>{page.size(r.model_bytes)}</td><td>{link}</td></tr>"
        )
    css = page.CSS + (
        ".msg{font-size:11px;color:#8a1c1c;max-width:420px;white-space:normal}"
        "tr.row-fail td{background:#fdf3f2} table.zoo td{white-space:nowrap}"
    )
    return (
        "\n".join(
            [
                "<!DOCTYPE html>",
                '<html lang="en"><head><meta charset="utf-8"><title>tpubuild zoo</title>',
                f"<style>{css}</style></head><body>",
                "<h1>tpubuild zoo</h1>",
                f'<p class="sub">{models} models, {len(rows)} targets: '
                f"{counts['PASS']} passed, {counts['FAIL']} failed, "
                f"{counts['not built']} not built. Similarities are the lowest cosine of what decides each level "
                "(ONNX vs Top: every tensor; Top vs Tpu and Tpu vs Chip: the graph outputs and their parts); "
                "time and DDR traffic are the cycle model's estimates.</p>",
                f'<table class="zoo">{head}{"".join(body)}</table>',
                "</body></html>",
            ]
        )
        + "\n"
    )


def write_index(build_dir: str | Path, zoo: Mapping[str, Sequence[str]], outcomes: Outcomes) -> Path:
    """index.html for ``zoo`` (model -> target ids in manifest order).

    A failing target gets its failure page when its failure is new in this run or the page is missing.
    """
    from tpubuild.build.files import write_text

    build_dir = Path(build_dir)
    pages: dict[Path, tuple[str, str | None, str]] = {}  # failure page -> (model, target, failed task)
    for model in sorted(zoo):
        for target in zoo[model] or [None]:
            task = outcomes.failed_task(model, target)
            if task:
                path = failure_page_path(ModelPaths.of(build_dir, model), target, split_task(task)[0])
                pages.setdefault(path, (model, target, task))
    for path, (model, target, task) in pages.items():
        if task in outcomes.failed_now or not path.is_file():
            write_failure_page(build_dir, model, target, (split_task(task)[0], outcomes.last[task]))
    for model in zoo:  # pages of failures fixed since
        p = ModelPaths.of(build_dir, model)
        for stale in [p.failed_page] + [p.target(t).failed_page for t in zoo[model]]:
            if stale not in pages:
                stale.unlink(missing_ok=True)
    rows = [make_row(build_dir, model, target, outcomes) for model in sorted(zoo) for target in (zoo[model] or [None])]
    out = zoo_index(build_dir)
    write_text(out, render_index(rows))
    return out


# ---- fed by the console reporter ---------------------------------------------------------------------


def describe(fail) -> str:
    """A doit failure as text: the stage's own message, or for a crash the exception line first."""
    message = (fail.message or "").strip()
    trace = "".join(fail.traceback or []).strip()
    return f"{trace.splitlines()[-1]}\n{message}".strip() if trace else message


class IndexRecorder:
    """The zoo (from the compile tasks' meta) and each task's outcome during one doit run; writes the index."""

    def __init__(self, tasks: Iterable):
        self.known: set[str] = set()
        self.zoo: dict[str, list[str]] = {}
        self.build_dir: Path | None = None
        for task in tasks:
            self.known.add(task.name)
            stage, model, _ = split_task(task.name)
            if stage == "compile" and model:
                info = (task.meta or {}).get("zoo")
                self.zoo[model] = list(info["targets"]) if info else []
                if info:
                    self.build_dir = Path(info["build_dir"])
        self.outcomes = Outcomes(self.build_dir) if self.build_dir else None

    def ok(self, task) -> None:
        if self.outcomes and ":" in task.name:
            self.outcomes.ok(task.name)

    def failed(self, task, fail) -> None:
        from doit.exceptions import UnmetDependency

        # a task skipped because an earlier one failed: the earlier one is the cause to show
        if self.outcomes and ":" in task.name and not isinstance(fail, UnmetDependency):
            self.outcomes.failed(task.name, describe(fail))

    def finish(self) -> Path | None:
        if not self.outcomes or self.build_dir is None:
            return None
        self.outcomes.save(self.known)
        return write_index(self.build_dir, self.zoo, self.outcomes)
