"""Progress of long byte work (pull, copy, build, store put/get/verify) where no bar can be
drawn: stderr is a log file, a pipe, a CI job. A rich bar there is disabled and said nothing
until the end, so a 272 MB pull looked hung; as pip and docker do, such output gets a plain line
every few seconds instead:

    pull: 41.9 MB of 272.4 MB (15%), 8.4 MB/s, 27 s left

`FLARE_PROGRESS_INTERVAL` (seconds, default 5) sets how often.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from rich.filesize import decimal

from flare.errors import InvalidInputError

INTERVAL_ENV = "FLARE_PROGRESS_INTERVAL"
DEFAULT_INTERVAL_S = 5.0


def plain_interval() -> float:
    """Seconds between two plain progress lines: FLARE_PROGRESS_INTERVAL, else 5."""
    text = os.environ.get(INTERVAL_ENV, "").strip()
    if not text:
        return DEFAULT_INTERVAL_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise InvalidInputError(
            f"{INTERVAL_ENV}={text!r} is not a number of seconds above 0", "use e.g. 5 or 0.5"
        )
    return seconds


class PlainProgress:
    """Counts bytes as workers report them (from several threads at once) and writes a line
    when `interval` seconds have passed since the start or the last line."""

    def __init__(
        self,
        description: str,
        total: int | None,
        write: Callable[[str], None],
        interval: float | None = None,
    ) -> None:
        self.description, self.total, self.write = description, total, write
        self.interval = plain_interval() if interval is None else interval
        self.started = time.monotonic()
        self.next_line = self.started + self.interval
        self.done = 0
        self._lock = threading.Lock()

    def advance(self, nbytes: int) -> None:
        """The progress callback: add bytes; write a line if one is due."""
        with self._lock:
            self.done += nbytes
            now = time.monotonic()
            if now < self.next_line:
                return
            self.next_line = now + self.interval
            line = self.line(now - self.started)
        self.write(line)

    def line(self, elapsed: float) -> str:
        """`NAME: DONE of TOTAL (P%), RATE/s, N s left` (only what is known)."""
        rate = self.done / elapsed if elapsed > 0 else 0.0
        parts = [f"{self.description}: {decimal(self.done)}"]
        if self.total:
            parts[0] += f" of {decimal(self.total)} ({100 * self.done // self.total}%)"
        parts.append(f"{decimal(int(rate))}/s")
        if self.total and rate > 0:
            parts.append(f"{max(0, self.total - self.done) / rate:.0f} s left")
        return ", ".join(parts)
