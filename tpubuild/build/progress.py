"""Progress a person can follow during a batch build, and one summary table at the end.

The doit reporter of every build (DOIT_CONFIG). doit calls it in the main
process, also with `-n N` (the workers send their events back), so it sees the
whole run: tasks done of the total, what each model is running, the elapsed
time and the failures so far. On a terminal that is one status line redrawn
in place; otherwise (a log, CI) a line every TPUBUILD_PROGRESS seconds
(default 10; "off": none) and one at each failure.

When the run ends it prints one row per model and target: the status (PASS,
or the first stage that failed), the minimum cosine at each level (Top: TOP
inference vs onnxruntime; Tpu: TPU inference vs TOP; Chip: the simulated chip
vs TPU inference), the chip time estimated by the run stage's cycle model
(profile.json, copied into verify.json) and the size of the .model file.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from doit.exceptions import UnmetDependency

from tpubuild.build import noop
from tpubuild.build.paths import failed_json
from tpubuild.build.reporter import SummaryReporter

_TABLE_CACHE = ".zoo_table.json"
# a failed verify stage -> the level it compares and the JSON it would have written
_FAILED_LEVEL = {
    "verify_top": ("top", "verify_top.json"),
    "verify_tpu": ("tpu", "verify_tpu.json"),
    "verify_chip": ("chip", "verify.json"),
    "verify_iree": ("iree", "verify.json"),
}


def split_task(name: str) -> tuple[str, str, str | None]:
    """'lower:demo_cnn/bm1684x-INT8' -> ('lower', 'demo_cnn', 'bm1684x-INT8'); model-level tasks have no target."""
    stage, _, rest = name.partition(":")
    model, _, target = rest.partition("/")
    return stage, model, target or None


def _elapsed(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _interval() -> float | None:
    value = os.environ.get("TPUBUILD_PROGRESS", "10").strip().lower()
    if value == "off":
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return 10.0


class ProgressReporter(SummaryReporter):
    desc = "console output with a progress line, and a summary table of every model and target at the end"

    def __init__(self, outstream, options):
        super().__init__(outstream, options)
        self.start = time.monotonic()
        self.tty = bool(getattr(outstream, "isatty", lambda: False)())
        self.interval = _interval()
        self.total = 0
        self.plan: dict[str, Any] = {}  # task name -> Task, the selection and what it depends on
        self.outcome: dict[str, str] = {}  # task name -> ok | failed | blocked | ignored
        self.errors: dict[str, str] = {}  # failed task -> first line of its error
        self.running: dict[str, float] = {}
        self.ran = self.cached = self.uptodate = 0
        self._status_shown = False
        self._quiet = False
        self._noop: dict[str, Any] | None = None  # the graph, when this run may stamp a no-op (noop.py)
        self._noop_files: str | None = None
        self._record: list[str] = []
        # a terminal shows the line at once; a log gets its first line after one interval
        self._last_line = 0.0 if self.tty else self.start

    # -- doit events -------------------------------------------------------------------------

    def initialize(self, tasks, selected_tasks):
        super().initialize(tasks, selected_tasks)
        todo = list(selected_tasks)
        while todo:
            name = todo.pop()
            if name in self.plan or name not in tasks:
                continue
            task = tasks[name]
            self.plan[name] = task
            todo.extend(task.task_dep)
            todo.extend(task.setup_tasks)
        self.total = sum(1 for t in self.plan.values() if t.actions)
        graph = noop.current()
        if graph and list(selected_tasks) == ["compile"] and graph["tasks"] == self.total:
            noop.forget(graph["build_dir"])  # this run's outcome decides anew
            self._noop, self._noop_files = graph, noop.file_states(graph["files"])
        # one compile task: its own summary says it all; several: the table replaces theirs
        self.show_summaries = sum(1 for n in self.plan if n.startswith("compile:")) <= 1

    def execute_task(self, task):
        super().execute_task(task)
        if task.actions:
            self.running[task.name] = time.monotonic()
            self._tick()

    def add_success(self, task):
        super().add_success(task)
        self._finish(task, "ok")
        if task.actions:
            self.ran += 1
            self.cached += (task.values or {}).get("cache") == "hit"
        self._tick()

    def add_failure(self, task, fail):
        if isinstance(fail, UnmetDependency):
            # the failure it waits for was reported already, and the table names it: recorded, not printed
            self._quiet = True
            try:
                super().add_failure(task, fail)
            finally:
                self._quiet = False
            self._finish(task, "blocked")
        else:
            super().add_failure(task, fail)
            self._finish(task, "failed")
            message = fail.get_msg().strip().splitlines()
            self.errors[task.name] = message[0] if message else type(fail).__name__
        self._tick(force=not self.tty)

    def skip_uptodate(self, task):
        self._quiet = not task.actions  # a group task (`compile`) is no news
        try:
            super().skip_uptodate(task)
        finally:
            self._quiet = False
        self._finish(task, "ok")
        self.uptodate += bool(task.actions)
        self._tick()

    def skip_ignore(self, task):
        super().skip_ignore(task)
        self._finish(task, "ignored")
        self._tick()

    def complete_run(self):
        self._clear_status()
        super().complete_run()
        lines = zoo_table(self.plan, self.outcome)
        if lines:
            self.write("\n".join(lines) + "\n")
        self._stamp_noop()
        self.write(self.final_line() + "\n")

    def _stamp_noop(self) -> None:
        """After a run that found everything up to date, let the next one skip doit's checks (noop.py)."""
        if (
            not self._noop
            or self._noop_files is None
            or self.uptodate != self.total
            or self.ran
            or any(o != "ok" for o in self.outcome.values())
        ):
            return
        if noop.file_states(self._noop["files"], settled=True) == self._noop_files:  # unchanged meanwhile
            noop.save(self._noop, self._noop_files, "".join(self._record))

    # -- output -------------------------------------------------------------------------------

    def write(self, text):
        if self._quiet:
            return
        self._clear_status()
        super().write(text)
        if self._noop:
            self._record.append(text)

    def _finish(self, task, outcome: str) -> None:
        self.outcome[task.name] = outcome
        self.running.pop(task.name, None)

    def counts(self) -> dict[str, int]:
        # tasks with actions only: a group task (`compile`) is no work of its own
        mine = [o for n, o in self.outcome.items() if n in self.plan and self.plan[n].actions]
        return {
            "done": len(mine),
            "total": self.total,
            "failed": mine.count("failed"),
            "blocked": mine.count("blocked"),
        }

    def status_line(self) -> str:
        c = self.counts()
        pct = f" {100 * c['done'] // c['total']:3d}%" if c["total"] else ""
        parts = [
            f"[{_elapsed(time.monotonic() - self.start)}] {c['done']}/{c['total']} tasks{pct}",
            f"{self.ran} ran ({self.cached} from cache)",
            f"{self.uptodate} up to date",
        ]
        if c["failed"] or c["blocked"]:
            failed_models = sorted({split_task(n)[1] for n, o in self.outcome.items() if o == "failed"})
            parts.append(f"{c['failed']} failed ({', '.join(failed_models)})")
        if c["blocked"]:
            parts.append(f"{c['blocked']} skipped")
        line = ", ".join(parts)
        if self.running:
            doing = []
            for name in sorted(self.running, key=lambda n: self.running[n]):
                stage, model, target = split_task(name)
                doing.append(f"{model} {stage}" + (f" {target}" if target else ""))
            line += " | running: " + ", ".join(doing)
        return line

    def final_line(self) -> str:
        c = self.counts()
        text = (
            f"{c['done']}/{c['total']} tasks in {_elapsed(time.monotonic() - self.start)}: {self.ran} ran "
            f"({self.cached} restored from the artifact cache), {self.uptodate} up to date, {c['failed']} failed"
        )
        if c["blocked"]:
            text += f", {c['blocked']} not run (a dependency failed)"
        return text

    def _tick(self, force: bool = False) -> None:
        if self.interval is None:
            return
        now = time.monotonic()
        if self.tty:
            if force or now - self._last_line >= 0.1:
                width = shutil.get_terminal_size((120, 24)).columns
                self.outstream.write("\r\x1b[K" + self.status_line()[: width - 1])
                self.outstream.flush()
                self._status_shown = True
                self._last_line = now
        elif force or now - self._last_line >= self.interval:
            super().write("progress " + self.status_line() + "\n")
            self._last_line = now

    def _clear_status(self) -> None:
        if self._status_shown:
            self.outstream.write("\r\x1b[K")
            self._status_shown = False


# -- the summary table ------------------------------------------------------------------------------


def _first_failure(plan: Mapping[str, Any], outcome: Mapping[str, str], roots: Iterable[str]) -> str | None:
    """The earliest (in stage order) task that failed among ``roots`` and what they depend on."""
    seen: set[str] = set()
    todo = [r for r in roots if r in plan]
    failed = []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if outcome.get(name) == "failed":
            failed.append(name)
        todo.extend(d for d in plan[name].task_dep if d in plan)
    if not failed:
        return None
    from tpubuild.build.tasks import STAGE_DOCS  # graph order (tasks imports this module: not at the top)

    order = {s: i for i, s in enumerate(STAGE_DOCS)}
    return min(failed, key=lambda n: (order.get(split_task(n)[0], len(order)), n))


class _RowCache:
    """What the table shows of each verify JSON, kept by (mtime, size) in <build>/.zoo_table.json,
    so a no-op rebuild of a large zoo does not parse every report again."""

    def __init__(self, build_dir: Path | None):
        self.file = build_dir / _TABLE_CACHE if build_dir else None
        self.data: dict[str, Any] = {}
        self.dirty = False
        if self.file:
            try:
                self.data = json.loads(self.file.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                self.data = {}

    def get(self, path: Path, extract) -> dict[str, Any] | None:
        try:
            st = path.stat()
        except OSError:
            return None
        stamp = [st.st_mtime_ns, st.st_size]
        hit = self.data.get(str(path))
        if hit and hit[0] == stamp:
            return hit[1]
        try:
            value = extract(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        self.data[str(path)] = [stamp, value]
        self.dirty = True
        return value

    def save(self) -> None:
        if self.file and self.dirty:
            from tpubuild.build.files import write_text

            with contextlib.suppress(OSError):  # only a speed-up
                write_text(self.file, json.dumps(self.data, sort_keys=True))


def _min_cos(comparisons: Iterable[Mapping[str, Any]], level: str) -> float | str | None:
    """The level's cosine as the table shows it: the lowest of what decided (the graph outputs and their parts
    for Tpu; compare.shown_cos), not of every intermediate tensor, which report.html shows."""
    values = [c.get("decided_cos", c.get("min_cos")) for c in comparisons if c.get("level") == level]
    numbers = [v for v in values if isinstance(v, (int, float))]
    if numbers:
        return min(numbers)
    return values[0] if values else None


def _from_verify(doc: Mapping[str, Any]) -> dict[str, Any]:
    comps = doc.get("comparisons", [])
    chip = doc.get("chip") or {}
    return {
        "top": _min_cos(comps, "top"),
        "tpu": _min_cos(comps, "tpu"),
        "chip": _min_cos(comps, "chip"),
        "iree": _min_cos(comps, "iree"),
        "time_ms": chip.get("time_ms"),
    }


def _cos(value) -> str:
    if value is None:
        return "-"
    return f"{value:.6f}" if isinstance(value, (int, float)) else str(value)


def _size(path: Path) -> str:
    from tpubuild.build.cache import format_bytes

    try:
        return format_bytes(path.stat().st_size)
    except OSError:
        return "-"


def zoo_table(plan: Mapping[str, Any], outcome: Mapping[str, str]) -> list[str]:
    """The end-of-run table: one row per (model, target) whose compile task was in the run."""
    compiles = sorted(n for n in plan if n.startswith("compile:"))
    if not compiles:
        return []
    targets = _verified_targets(plan)
    roots = [Path(plan[c].meta["summary"]).parent for c in compiles if (plan[c].meta or {}).get("summary")]
    cache = _RowCache(roots[0].parent if roots else None)
    rows = []
    for compile_name in compiles:
        model = split_task(compile_name)[1]
        meta = plan[compile_name].meta or {}
        if "summary" not in meta:  # a broken manifest: its compile task is all there is
            status = "FAIL manifest" if outcome.get(compile_name) == "failed" else "not run"
            rows.append([model, "-", status, "-", "-", "-", "-", "-", "-"])
            continue
        root = Path(meta["summary"]).parent
        top = None
        if outcome.get(f"verify_top:{model}") == "ok":
            top = cache.get(root / "verify_top.json", lambda d: {"top": _min_cos(d["comparisons"], "top")})
        for target in sorted(targets.get(model, [])) or [None]:
            rows.append(_target_row(plan, outcome, cache, compile_name, root, target, top))
    cache.save()
    return _table_lines(rows)


def _verified_targets(plan: Mapping[str, Any]) -> dict[str, list[str]]:
    """Model -> the targets whose last verification (chip, or IREE for a cpu target) is in the plan."""
    targets: dict[str, list[str]] = {}
    for name in plan:
        stage, model, target = split_task(name)
        if stage in ("verify_chip", "verify_iree") and target:
            targets.setdefault(model, []).append(target)
    return targets


def _target_row(
    plan: Mapping[str, Any],
    outcome: Mapping[str, str],
    cache: _RowCache,
    compile_name: str,
    root: Path,
    target: str | None,
    top: dict | None,
) -> list[str]:
    """One row of the end-of-run table: a target's status, lowest cosines, chip time and .model size."""
    model = split_task(compile_name)[1]
    # a cpu target (IREE) ends at verify_iree, a chip target at verify_chip
    last = "verify_iree" if target and target.startswith("cpu-") else "verify_chip"
    task = f"{last}:{model}/{target}" if target else compile_name
    failed = _first_failure(plan, outcome, [task, f"report:{model}/{target}"] if target else [task])
    if failed:
        status = f"FAIL {split_task(failed)[0]}"
    elif outcome.get(task) == "ok":
        status = "PASS"
    else:
        status = "not run"
    cells = {"top": (top or {}).get("top")}
    if target and outcome.get(task) == "ok":
        cells = cache.get(root / target / "verify.json", _from_verify) or cells
    elif target and outcome.get(f"verify_tpu:{model}/{target}") == "ok":
        cells.update(
            cache.get(root / target / "verify_tpu.json", lambda d: {"tpu": _min_cos(d["comparisons"], "tpu")}) or {}
        )
    if failed and split_task(failed)[0] in _FAILED_LEVEL:
        # the comparison that failed, kept by the verify stage for the reports: how far off it is
        level, where = _FAILED_LEVEL[split_task(failed)[0]]
        doc = cache.get(
            failed_json(root / (target or "") / where if level != "top" else root / where),
            lambda d, lv=level: {"cos": _min_cos(d["comparisons"], lv)},
        )
        if doc and doc.get("cos") is not None:
            cells[level] = f"{_cos(doc['cos'])}!"
    time_ms = cells.get("time_ms")
    size = "-"
    if target and outcome.get(f"codegen:{model}/{target}") == "ok":
        size = _size(root / target / f"{model}.model")
    elif target and outcome.get(f"iree_compile:{model}/{target}") == "ok":
        size = _size(root / target / f"{model}.vmfb")
    return [
        model,
        target or "-",
        status,
        _cos(cells.get("top")),
        _cos(cells.get("tpu")),
        _cos(cells.get("chip")),
        _cos(cells.get("iree")),
        f"{time_ms:.4g}" if isinstance(time_ms, (int, float)) else "-",
        size,
    ]


def _table_lines(rows: list[list[str]]) -> list[str]:
    """The rows as an aligned text table under its title, with the failed comparisons' footnote."""
    header = ["model", "target", "status", "Top cos", "Tpu cos", "Chip cos", "IREE cos", "chip ms", ".model"]
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    right = {3, 4, 5, 6, 7, 8}

    def fmt(row):
        return "  ".join(
            str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )

    passed = sum(r[2] == "PASS" for r in rows)
    title = (
        f"summary: {passed} of {len(rows)} model targets PASS (per level the lowest cosine of what decided it: "
        "Tpu and Chip the graph outputs and their parts; chip time from the cycle model)"
    )
    lines = [title, fmt(header), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows]
    if any(str(c).endswith("!") for r in rows for c in r):
        lines.append("! the comparison that failed (below the manifest's tolerance)")
    return lines
