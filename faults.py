"""Crash points for the kill tests: `FLARE_CRASH_AT=NAME[:N]` kills the process with SIGKILL
the N-th time (default first) it reaches the point NAME, exactly as a dead host would.

A shared module (not build/'s) because builds, the registry's index DB and gc all have points
where a kill must leave a state the next command can use."""

from __future__ import annotations

import os
import signal
from collections import Counter

_reached: Counter[str] = Counter()


def crash_point(name: str) -> None:
    """Die here if the environment asks for it; otherwise do nothing."""
    wanted = os.environ.get("FLARE_CRASH_AT")
    if not wanted:
        return
    target, _, count = wanted.rpartition(":")
    if not count.isdigit():
        target, count = wanted, "1"
    if target != name:
        return
    _reached[name] += 1
    if _reached[name] == int(count):
        os.kill(os.getpid(), signal.SIGKILL)
