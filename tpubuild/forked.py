"""Half of a stage's work in a forked process: calibration's statistics, its threshold candidates and tuning, and
the mixed-precision search's scores run the same work on many samples (or tensors), and on a machine of two cores or
more a child forked with the stage's module, weights and samples as they are takes half of them (``alongside``,
``every_other``). The results are the same for any count of processes (``processes``: TPUBUILD_PROCESSES).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
from collections.abc import Callable
from typing import Any, TypeVar

from tpubuild.errors import TpuBuildError

T = TypeVar("T")
U = TypeVar("U")

VARIABLE = "TPUBUILD_PROCESSES"


def processes() -> int:
    """TPUBUILD_PROCESSES, else 2 on a machine with two cores or more. Not in any task's config: the results are
    the same for any count."""
    value = os.environ.get(VARIABLE, "").strip()
    if not value:
        return min(2, os.cpu_count() or 1)
    if not value.isdigit() or int(value) < 1:
        raise TpuBuildError(
            f"{VARIABLE}={value!r} is not a positive number of processes", hint="set it to 1 or 2, or unset it"
        )
    return int(value)


def alongside(here_work: Callable[[], T], there_work: Callable[[], U], what: str) -> tuple[T, U]:
    """``here_work()`` here while a forked process runs ``there_work()``: both values (its error raised here).
    ``what``: the work, as the error for a child that stops without its answer names it."""
    child, conn = start(_send_outcome, there_work, what=what)
    try:
        mine = here_work()
        try:
            kind, theirs = conn.recv()
        except EOFError:
            raise stopped(child, what) from None
    finally:
        conn.close()
        child.join()
    if kind == "error":
        raise theirs
    return mine, theirs


def every_other(part: Callable[[int, int], T], processes: int, what: str) -> list[T]:
    """``[part(0, 1)]`` with one process; with two, ``[part(0, 2), part(1, 2)]``, the second run by a forked
    process (``alongside``). ``part(first, step)`` does the items first, first + step, ..."""
    if processes < 2:
        return [part(0, 1)]
    return list(alongside(lambda: part(0, 2), lambda: part(1, 2), what))


def start(target: Callable, *args, what: str):
    """A forked process running ``target(*args, conn)``, and this end of ``conn``, their pipe."""
    ctx = multiprocessing.get_context("fork")  # the child takes the stage's module, weights and samples as they are
    here, there = ctx.Pipe()
    child = ctx.Process(target=target, args=(*args, there), name=f"tpubuild-{what.replace(' ', '-')}", daemon=True)
    child.start()
    there.close()
    return child, here


def stopped(child, what: str) -> TpuBuildError:
    """The error for a forked process that ended without its answer (killed, out of memory)."""
    child.join(timeout=1)
    return TpuBuildError(
        f"{what}'s second process stopped (exit code {child.exitcode})", hint=f"{VARIABLE}=1 runs it in one process"
    )


def _send_outcome(work, conn) -> None:
    conn.send(outcome(work))
    conn.close()


def outcome(work: Callable[[], Any]) -> tuple[str, object]:
    """("ok", work()) or ("error", what it raised), to send to the parent, which raises it."""
    try:
        return "ok", work()
    except Exception as err:  # noqa: BLE001  (raised in the parent)
        try:
            pickle.dumps(err)
        except Exception:  # noqa: BLE001  (an error that does not pickle goes as its text)
            err = TpuBuildError(f"{type(err).__name__}: {err}")
        return "error", err
