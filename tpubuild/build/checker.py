"""doit's file checker: its MD5Checker, each file's md5 taken once per state of the file.

doit records a task's file_dep states (mtime, size, md5) when the task succeeds, and hashes each file anew for
every task that names it. A stage's output is a file_dep of several tasks (a model's canonical weights of every
float target's lowering, a target's tpu_weights.npz of its layer group, codegen and report), and the hashing
runs in doit's own process, between dispatches: building light_zfnet512 spent 12 s of its 111 s there. Here a
file's md5 is kept for its (mtime, size), the state by which doit itself already takes a file as unchanged, so
the states recorded, and what doit decides from them, are the ones MD5Checker gives.
"""

from __future__ import annotations

import os

from doit.dependency import MD5Checker, get_file_md5

# (path, mtime in ns, size) -> md5, for this process
_KNOWN: dict[tuple[str, int, int], str] = {}


def md5_of(path: str, stat: os.stat_result) -> str:
    """The md5 of ``path`` whose stat is ``stat``: computed once per (mtime, size)."""
    key = (path, stat.st_mtime_ns, stat.st_size)
    found = _KNOWN.get(key)
    if found is None:
        found = _KNOWN[key] = get_file_md5(path)
    return found


class SharedMD5Checker(MD5Checker):
    """MD5Checker whose hashes are shared by every task of the run (md5_of)."""

    def check_modified(self, file_path, file_stat, state):
        timestamp, size, file_md5 = state
        if file_stat.st_mtime == timestamp:
            return False
        if file_stat.st_size != size:
            return True
        return file_md5 != md5_of(file_path, file_stat)

    def get_state(self, dep, current_state):
        stat = os.stat(dep)
        if current_state and current_state[0] == stat.st_mtime:
            return None
        return stat.st_mtime, stat.st_size, md5_of(dep, stat)
