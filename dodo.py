"""tpubuild's doit entry point: one task per (stage, model manifest).

    doit list                 the stages      doit compile            every model
    doit compile:demo_cnn     one model       doit -n 2 compile       in parallel
    doit clean                remove what was built

Manifests: configs/models/*.yaml, or TPUBUILD_MANIFESTS (os.pathsep-separated
files, folders or globs). Build tree: build/, or TPUBUILD_BUILD_DIR.
Kept thin and cheap: it runs on every doit invocation (see README, "Speed").
"""

import os
import sys
from pathlib import Path

from tpubuild.build.noop import try_fast_noop
from tpubuild.build.tasks import doit_config, find_manifests, install_sigterm_handler, zoo_tasks

ROOT = Path(__file__).resolve().parent
MANIFESTS = find_manifests(os.environ.get("TPUBUILD_MANIFESTS", str(ROOT / "configs/models")).split(os.pathsep))
BUILD_DIR = Path(os.environ.get("TPUBUILD_BUILD_DIR", ROOT / "build")).resolve()
DOIT_CONFIG = doit_config(BUILD_DIR)
TASKS = list(zoo_tasks(MANIFESTS, BUILD_DIR))

# `doit compile` with nothing changed since a no-op run: print its result, skip doit's checks (noop.py)
if try_fast_noop(sys.argv[1:], TASKS, BUILD_DIR, DOIT_CONFIG["dep_file"]):
    sys.exit(0)

install_sigterm_handler()


def task_tpubuild():
    """The stage tasks of every manifest (doit lists them by stage)."""
    yield from (dict(t) for t in TASKS)  # copies: doit edits the dicts it loads
