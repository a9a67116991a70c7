"""Run the doit task graph from Python (the `tpubuild compile` command), for manifests anywhere."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tpubuild.build.tasks import doit_config, find_manifests, install_sigterm_handler, zoo_tasks


def run_doit(manifests: Sequence[str], build_dir: str | Path, doit_args: Sequence[str]) -> int:
    """`doit <doit_args>` over the tasks of ``manifests``; returns doit's exit code.

    The same generators as dodo.py, so task ids, the DB and the build tree are shared
    with `doit` run from the repo.
    """
    from doit.cmd_base import ModuleTaskLoader
    from doit.doit_cmd import DoitMain

    build = Path(build_dir).resolve()
    files = find_manifests(manifests)

    def task_tpubuild():
        """The stage tasks of the given manifests."""
        yield from zoo_tasks(files, build)

    namespace = {"DOIT_CONFIG": doit_config(build), "task_tpubuild": task_tpubuild}
    install_sigterm_handler()
    return DoitMain(ModuleTaskLoader(namespace)).run(list(doit_args))
