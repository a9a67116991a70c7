"""tpubuild.forked: half of a stage's work in a forked process, its errors, and TPUBUILD_PROCESSES."""

from __future__ import annotations

import os

import pytest

from tpubuild import forked
from tpubuild.errors import TpuBuildError


def test_both_values_and_the_child_runs_in_another_process():
    here, there = forked.alongside(lambda: ("here", os.getpid()), lambda: ("there", os.getpid()), "a test")
    assert here == ("here", os.getpid()) and there[0] == "there" and there[1] != os.getpid()


def test_an_error_there_is_raised_here():
    def broken():
        raise TpuBuildError("sample 3 broke", loc="conv_1")

    with pytest.raises(TpuBuildError, match="sample 3 broke") as err:
        forked.alongside(lambda: 1, broken, "a test")
    assert err.value.loc == "conv_1"


def test_a_child_that_stops_without_its_answer_is_a_clear_error():
    with pytest.raises(
        TpuBuildError, match=r"a test's second process stopped \(exit code 7\)(.|\n)*TPUBUILD_PROCESSES=1"
    ):
        forked.alongside(lambda: 1, lambda: os._exit(7), "a test")


@pytest.mark.parametrize("value, expect", [("1", 1), ("2", 2), (" 3 ", 3), ("", min(2, os.cpu_count() or 1))])
def test_processes_from_the_environment(monkeypatch, value, expect):
    monkeypatch.setenv("TPUBUILD_PROCESSES", value)
    assert forked.processes() == expect


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_process_count_is_refused(monkeypatch, value):
    monkeypatch.setenv("TPUBUILD_PROCESSES", value)
    with pytest.raises(TpuBuildError, match="TPUBUILD_PROCESSES=.* is not a positive number of processes"):
        forked.processes()
