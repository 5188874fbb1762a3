"""runtime/passing.py: work on a thread that ends, its result or its error on the caller's."""

from __future__ import annotations

import threading

import pytest

from promptlang.runtime.passing import on_passing_thread


def test_the_work_runs_on_another_thread_that_has_ended():
    seen = []
    assert on_passing_thread(lambda: seen.append(threading.current_thread()) or 7) == 7
    assert seen[0] is not threading.current_thread()
    assert not seen[0].is_alive()


def test_what_the_work_raised_is_raised_on_the_caller_s_thread():
    def fail():
        raise KeyError("x")

    with pytest.raises(KeyError):
        on_passing_thread(fail)
