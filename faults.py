"""Crash points for the kill tests: `FLARE_CRASH_AT=NAME[:N]` kills the process with SIGKILL
the N-th time (default first) it reaches the point NAME, exactly as a dead host would.
`FLARE_STOP_AT=NAME[:N],...` stops it there with SIGSTOP instead, at each point listed, as a
host that froze (a long pause, a suspended VM), until the test sends SIGCONT: what another
process does meanwhile then happens at that exact point, every time, not by timing luck.

A shared module (not build/'s) because builds, the registry's index DB and gc all have points
where a kill must leave a state the next command can use."""

from __future__ import annotations

import os
import signal
from collections import Counter

_reached: Counter[str] = Counter()
_SIGNALS = {"FLARE_CRASH_AT": signal.SIGKILL, "FLARE_STOP_AT": signal.SIGSTOP}


def crash_point(name: str) -> None:
    """Die or stop here if the environment asks for it; otherwise do nothing."""
    if not any(os.environ.get(variable) for variable in _SIGNALS):
        return
    _reached[name] += 1
    for variable, sent in _SIGNALS.items():
        if _wanted(os.environ.get(variable, ""), name, _reached[name]):
            os.kill(os.getpid(), sent)


def _wanted(points: str, name: str, reached: int) -> bool:
    """Whether the list `points` (NAME[:N], comma-separated) names this reach of a point."""
    for point in points.split(","):
        target, _, count = point.rpartition(":")
        if not count.isdigit():
            target, count = point, "1"
        if target == name and int(count) == reached:
            return True
    return False
