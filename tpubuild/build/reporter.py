"""doit's console reporter, plus the verification summary of models that are already built.

A fully up-to-date `doit compile:<model>` runs no action, so without this the
user would see only "-- compile:<model>" and not whether the model verified.
It also records each stage task's outcome and, when the run ends, writes the
zoo index (build/index.html, tpubuild/verify/index.py): the one place that sees
every task finish or fail, in parallel runs too.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from doit.reporter import ConsoleReporter


class SummaryReporter(ConsoleReporter):
    desc = "console output, and the saved verification summary of up-to-date models"

    index = None  # IndexRecorder, from initialize()
    show_summaries = True  # the progress reporter turns them off for a batch (its table covers them)

    def initialize(self, tasks, selected_tasks):
        from tpubuild.verify.index import IndexRecorder

        super().initialize(tasks, selected_tasks)
        self.index = IndexRecorder(tasks.values())

    def add_success(self, task):
        super().add_success(task)
        if self.index:
            self.index.ok(task)

    def add_failure(self, task, fail):
        super().add_failure(task, fail)
        if self.index:
            self.index.failed(task, fail)

    def skip_uptodate(self, task):
        super().skip_uptodate(task)
        if self.index:
            self.index.ok(task)
        summary = (task.meta or {}).get("summary")
        if summary and self.show_summaries:
            # up to date yet missing would be doit's bug, not worth failing the run
            with contextlib.suppress(OSError):
                self.write(Path(summary).read_text(encoding="utf-8"))

    def complete_run(self):
        from tpubuild.errors import TpuBuildError

        super().complete_run()
        if self.index:
            try:
                index = self.index.finish()
            except (OSError, ValueError, KeyError, TpuBuildError) as err:
                # a build file the pages read is unreadable: the build itself stands, say why there is no index
                self.write(f"zoo index not written: {type(err).__name__}: {err}\n")
                return
            if index:
                self.write(f"zoo index: {index}\n")
