"""Watching the other ranks of a tensor-parallel server, so that nothing hangs.

Every rank beats a counter in rank zero's store (flare/rendezvous.py). A watch thread on each
rank looks, every `POLL_S`, for the group's abort (posted by a rank that failed, with its
reason), for a rank whose heartbeat has not moved for the group's timeout (stopped or
unreachable), and on rank zero for a rank process of its own that exited. The first it finds
is handed to `on_lost` once, with the rank named; the collectives themselves fail too when a
peer's connection closes or passes the timeout, and are handed over the same way.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable, Mapping

from flare.rendezvous import RankError, Rendezvous

POLL_S = 0.2


class Watch:
    """A daemon thread that reports the first lost rank to `on_lost(reason)`."""

    def __init__(
        self,
        rendezvous: Rendezvous,
        on_lost: Callable[[str], None],
        children: Mapping[int, subprocess.Popen[bytes]] | None = None,
    ) -> None:
        self.rendezvous = rendezvous
        self.on_lost = on_lost
        self.children = children or {}
        self._stop = threading.Event()
        self._reported = threading.Lock()
        self._done = False
        self.lost = threading.Event()
        """Set once a loss was reported."""
        self._thread = threading.Thread(target=self._run, name="rank-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """A clean stop: whatever happens to the ranks now is no failure."""
        self._stop.set()

    def report(self, reason: str) -> None:
        """Hand `reason` to on_lost, unless a loss was reported already or the stop began."""
        with self._reported:
            if self._done or self._stop.is_set():
                return
            self._done = True
        self.lost.set()
        self.on_lost(reason)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            reason = self._problem()
            if reason is not None:
                self.report(reason)
                return

    def _problem(self) -> str | None:
        """The first sign that a rank is lost, named; None while all are well."""
        for rank, child in self.children.items():
            code = child.poll()
            if code is not None:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
                return f"rank {rank} (process {child.pid}) {how}"
        try:
            if self.rendezvous.store.check(["abort"]):
                return self.rendezvous.store.get("abort").decode().strip('"')
            for rank in range(self.rendezvous.world):
                self.rendezvous.check_alive(rank, "while serving")
        except RankError as exc:
            return exc.what
        except (RuntimeError, OSError):
            return f"rank 0 at {self.rendezvous.address} is gone (its store closed)"
        return None


def wait_children(children: Mapping[int, subprocess.Popen[bytes]], seconds: float) -> None:
    """Give the rank processes `seconds` to exit on their own, then kill what is left (a
    rank stuck in a collective with a lost peer must not outlive the server)."""
    deadline = time.monotonic() + seconds
    for child in children.values():
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
