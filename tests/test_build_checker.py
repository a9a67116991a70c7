"""doit's file checker (tpubuild/build/checker.py): doit's MD5Checker states, each file hashed once per state."""

from __future__ import annotations

import os

from doit.dependency import MD5Checker, get_file_md5

from tpubuild.build import checker
from tpubuild.build.checker import SharedMD5Checker


def test_a_file_several_tasks_name_is_hashed_once_per_state(tmp_path, monkeypatch):
    f = tmp_path / "canonical_weights.npz"
    f.write_bytes(b"x" * 1000)
    hashed = []
    monkeypatch.setattr(checker, "get_file_md5", lambda p: hashed.append(p) or get_file_md5(p))
    first, second = SharedMD5Checker(), SharedMD5Checker()  # doit makes one per run; the hashes are the process's
    state = first.get_state(str(f), None)
    assert state == MD5Checker().get_state(str(f), None)  # what doit records
    assert second.get_state(str(f), None) == state
    assert first.get_state(str(f), state) is None  # doit's own shortcut: the same timestamp is the same file
    assert len(hashed) == 1

    # rewritten with other bytes of the same size, a second later: a new state, hashed, and seen as changed
    mtime = os.stat(f).st_mtime_ns
    f.write_bytes(b"y" * 1000)
    os.utime(f, ns=(mtime + 10**9, mtime + 10**9))
    assert first.check_modified(str(f), os.stat(f), state) is True
    assert len(hashed) == 2
    # touched only: same bytes, a new time: not modified, as MD5Checker decides
    new_state = second.get_state(str(f), state)
    os.utime(f, ns=(mtime + 2 * 10**9, mtime + 2 * 10**9))
    assert first.check_modified(str(f), os.stat(f), new_state) is False
    assert MD5Checker().check_modified(str(f), os.stat(f), new_state) is False
    assert len(hashed) == 3
