"""doit's console reporter, plus the verification summary of models that are already built.

A fully up-to-date `doit compile:<model>` runs no action, so without this the
user would see only "-- compile:<model>" and not whether the model verified.
"""

from __future__ import annotations

from pathlib import Path

from doit.reporter import ConsoleReporter


class SummaryReporter(ConsoleReporter):
    desc = "console output, and the saved verification summary of up-to-date models"
    show_summaries = True  # the progress reporter turns them off for a batch (its table covers them)

    def skip_uptodate(self, task):
        super().skip_uptodate(task)
        summary = (task.meta or {}).get("summary")
        if summary and self.show_summaries:
            try:
                self.write(Path(summary).read_text(encoding="utf-8"))
            except OSError:
                pass  # up to date yet missing would be doit's bug, not worth failing the run
