"""Work begun on a thread of its own: its value, or what it raised, reaches whoever asks, on
their thread; the start does not wait for it (serve/background.py)."""

from __future__ import annotations

import threading

import pytest

from flare.errors import IntegrityError
from flare.serve.background import in_background


def test_the_value_comes_from_a_thread_of_the_given_name() -> None:
    seen: list[str] = []

    def work(a: int, b: int) -> int:
        seen.append(threading.current_thread().name)
        return a + b

    assert in_background("flare-test-work", work, 2, 3).result(timeout=10) == 5
    assert seen == ["flare-test-work"]


def test_what_the_work_raised_is_raised_where_it_is_asked_for() -> None:
    def work() -> None:
        raise IntegrityError("blob 1234 does not hash to its digest")

    with pytest.raises(IntegrityError, match="does not hash"):
        in_background("flare-test-fail", work).result(timeout=10)


def test_the_caller_goes_on_while_the_work_runs() -> None:
    release = threading.Event()
    future = in_background("flare-test-wait", lambda: release.wait(10))
    assert not future.done()  # begun, not waited for
    release.set()
    assert future.result(timeout=10) is True
