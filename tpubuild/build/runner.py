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

    from tpubuild.build.noop import try_fast_noop

    build = Path(build_dir).resolve()
    config = doit_config(build)
    tasks = list(zoo_tasks(find_manifests(manifests), build))
    if try_fast_noop(doit_args, tasks, build, config["dep_file"]):
        return 0

    def task_tpubuild():
        """The stage tasks of the given manifests."""
        yield from (dict(t) for t in tasks)  # copies: doit edits the dicts it loads

    namespace = {"DOIT_CONFIG": config, "task_tpubuild": task_tpubuild}
    install_sigterm_handler()
    return DoitMain(ModuleTaskLoader(namespace)).run(list(doit_args))
