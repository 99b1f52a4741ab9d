"""How a build process reports its phases: name, status, seconds and bytes of each.

Rank zero's pipeline (pipeline.py) and a peer rank (join.py) report the same way, through
one `PhaseLog`, to whoever shows progress (`Events`: the CLI's bars, a test's list), and
return the reports for the closing table.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class PhaseReport:
    """How one phase went: done, reused (all outputs from the journal or a cache) or resumed
    (some)."""

    name: str
    status: str
    seconds: float
    bytes: int


class Events(Protocol):
    """What a build tells whoever shows its progress."""

    def phase_started(self, name: str, total: int) -> None: ...
    def advance(self, nbytes: int) -> None: ...
    def phase_finished(self, report: PhaseReport) -> None: ...
    def note(self, message: str) -> None: ...


class PhaseLog:
    """The phases one process ran, in order, each told to `events` as it ends."""

    def __init__(self, events: Events) -> None:
        self.events = events
        self.reports: list[PhaseReport] = []

    def finish(self, name: str, started: float, nbytes: int, status: str = "done") -> None:
        """Record phase `name`, begun at `started` (time.perf_counter), as ended now."""
        report = PhaseReport(name, status, time.perf_counter() - started, nbytes)
        self.reports.append(report)
        self.events.phase_finished(report)
