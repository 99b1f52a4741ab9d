"""Crash points for the kill tests: `FLARE_CRASH_AT=NAME[:N]` kills the process with SIGKILL
the N-th time (default first) it reaches the point NAME, exactly as a dead host would;
`FLARE_STOP_AT=NAME[:N]` stops it there with SIGSTOP instead, as a host that froze (a long
pause, a suspended VM), until the test sends SIGCONT: what another process does meanwhile then
happens at that exact point, every time, not by timing luck.

A shared module (not build/'s) because builds, the registry's index DB and gc all have points
where a kill must leave a state the next command can use."""

from __future__ import annotations

import os
import signal
from collections import Counter

_reached: Counter[tuple[str, str]] = Counter()
_SIGNALS = {"FLARE_CRASH_AT": signal.SIGKILL, "FLARE_STOP_AT": signal.SIGSTOP}


def crash_point(name: str) -> None:
    """Die or stop here if the environment asks for it; otherwise do nothing."""
    for variable, sent in _SIGNALS.items():
        wanted = os.environ.get(variable)
        if not wanted:
            continue
        target, _, count = wanted.rpartition(":")
        if not count.isdigit():
            target, count = wanted, "1"
        if target != name:
            continue
        _reached[variable, name] += 1
        if _reached[variable, name] == int(count):
            os.kill(os.getpid(), sent)
