"""Work begun on a thread of its own, its result (or what it raised) a `Future`: a start reads
and hashes beside its main thread's work, and whoever needs the result waits for it there."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


def in_background(name: str, work: Callable[..., T], *args: Any) -> Future[T]:
    """`work(*args)` begun now on a daemon thread called `name`; its `Future` gives the value,
    or raises what `work` raised, on the thread that asks."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(work(*args))
        except BaseException as exc:  # handed to whoever waits for the result
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
