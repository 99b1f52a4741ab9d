"""Rank zero of a tensor-parallel server: it forms the group, starts the ranks of its own host,
and keeps watch over them while it serves.

On one host `flare serve` starts ranks 1..N-1 itself (`python -m flare join 127.0.0.1:PORT
--rank R`, each in a session of its own so that a terminal's Ctrl-C reaches rank zero alone,
which stops them in order). Across hosts they are started by hand with `flare join`.

A lost rank (exited, killed, silent past the timeout, or a failed collective) ends the server:
the runtime fails every request in flight with the rank named and /health answers 503; the
reason is printed once, every rank is told to stop (the abort key), and after a short grace
(for the failed responses to reach their clients) every process exits 13. A clean stop (SIGTERM
or Ctrl-C on rank zero) drains the requests, sends `stop` to the ranks, and exits 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

from flare.errors import FlareError
from flare.rendezvous import RankError, Rendezvous
from flare.serve.rank_group import RankGroup, first_line
from flare.serve.rank_start import (
    KV_KEY,
    PACKAGE_KEY,
    PackageNotice,
    child_environment,
    load_report,
    make_group,
    rank_device,
    wait_admitted,
    wait_ready,
)
from flare.serve.rank_watch import Watch, wait_children
from flare.serve.runtime import GenerateRuntime

Result = TypeVar("Result")

GRACE_S = 2.0
"""Between a lost rank and the exit: time for the failed responses to reach their clients."""
NAMING_S = 1.0
"""How long a failed step waits for the watch to name the lost rank."""
CHILD_EXIT_S = 10.0
"""How long rank processes of this host get to exit before they are killed."""


class RankLeader:
    """Rank zero's side of the group: the rendezvous, the ranks it started, the watch."""

    def __init__(self, rendezvous: Rendezvous, children: dict[int, subprocess.Popen[bytes]]):
        self.rendezvous = rendezvous
        self.children = children
        self.group: RankGroup | None = None
        self.runtime: GenerateRuntime | None = None
        self.watch = Watch(rendezvous, self._lost, children)
        self._abandoned = False

    @classmethod
    def start(cls, address: str | None, world: int, timeout: float) -> RankLeader:
        """Host the group at `address` and wait for its ranks (None: on loopback, starting
        ranks 1..world-1 here)."""
        children: dict[int, subprocess.Popen[bytes]] = {}

        def spawn(where: str) -> None:
            if address is None:
                children.update(_spawn_ranks(where, world, timeout))

        try:
            rendezvous = Rendezvous.host(
                address or "127.0.0.1:0", world, timeout, kind="serve", started=spawn
            )
        except BaseException:
            wait_children(children, 0)
            raise
        return cls(rendezvous, children)

    def offer(self, notice: PackageNotice) -> None:
        """Name the package to the other ranks and wait until each has it and admitted it."""
        self._stopping_all_on_failure(lambda: self._offer(notice))

    def _offer(self, notice: PackageNotice) -> None:
        self.rendezvous.post(PACKAGE_KEY, notice.__dict__)
        wait_admitted(self.rendezvous)
        device = rank_device(notice.device, 0, self.rendezvous.world, notice.shared_cache)
        self.group = make_group(self.rendezvous, device)

    def ready(self, runtime: GenerateRuntime, load_seconds: float) -> None:
        """Rank zero's part is loaded: size the others' KV caches as its own, wait until every
        rank has loaded, and start watching them."""
        self.runtime = runtime
        kv = runtime.kv_stats()
        layout = {"blocks": kv["blocks_total"], "block_size": kv["block_size"]}
        self.rendezvous.post(KV_KEY, layout | {"attention": runtime.attention})
        reports = self._stopping_all_on_failure(lambda: wait_ready(self.rendezvous))
        model = runtime.runner.model
        kv_bytes = model.attention_spec.bytes_per_token(runtime.dtype) * kv["blocks_total"]
        reports[0] = load_report(model, kv_bytes * kv["block_size"], load_seconds)
        runtime.rank_reports.update(reports)
        self.watch.start()

    def collective_failed(self, error: BaseException) -> None:
        """A step's send or collective failed: give the watch a moment to name the rank (a
        process of this host that died is seen at once), so that the requests in flight end
        with its name; a rank of another host is named by its heartbeat within the timeout,
        and the failure is reported then either way."""
        if self.watch.lost.wait(NAMING_S):
            return

        def name_it() -> None:
            threading.Event().wait(self.rendezvous.timeout)
            self.watch.report(f"a step between the ranks failed: {first_line(error)}")

        threading.Thread(target=name_it, name="rank-naming", daemon=True).start()

    def close(self) -> None:
        """After a clean stop (the runtime stopped the ranks): keep the store up until every
        rank has left (a rank that saw it close first would take rank zero for lost), wait
        for this host's, close the group."""
        self.watch.stop()
        left = [f"left/{rank}" for rank in range(1, self.rendezvous.world)]
        self.rendezvous.linger(left, CHILD_EXIT_S)
        wait_children(self.children, CHILD_EXIT_S)
        self.rendezvous.close()

    def abandon(self, reason: str) -> None:
        """Rank zero failed before serving: tell the ranks, so they stop with its reason
        (again is a no-op)."""
        if self._abandoned:
            return
        self._abandoned = True
        self.rendezvous.abort(reason)
        wait_children(self.children, CHILD_EXIT_S)
        self.rendezvous.close()

    def _stopping_all_on_failure(self, action: Callable[[], Result]) -> Result:
        try:
            return action()
        except FlareError as exc:
            self.abandon(exc.what)
            raise
        except BaseException as exc:
            self.abandon(f"rank 0 failed: {type(exc).__name__}: {exc}")
            raise

    def _lost(self, reason: str) -> None:
        """A rank is lost: fail what is in flight, tell everyone, exit 13."""
        error = RankError(f"the serving group lost a rank: {reason}", LOST_HINT)
        if self.runtime is not None:
            self.runtime.fail(error)
        sys.stderr.write(f"error: {error}\n")
        sys.stderr.flush()
        self.rendezvous.abort(reason)
        threading.Event().wait(GRACE_S)
        wait_children(self.children, CHILD_EXIT_S)
        os._exit(RankError.exit_code)


LOST_HINT = "see that rank's error (or its host), then start the server and its ranks again"


def _spawn_ranks(address: str, world: int, timeout: float) -> dict[int, subprocess.Popen[bytes]]:
    """Ranks 1..world-1 of this host, as `flare join` processes."""
    children = {}
    for rank in range(1, world):
        command = [sys.executable, "-m", "flare", "join", address, "--rank", str(rank)]
        command += ["--timeout", f"{timeout:g}"]
        children[rank] = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            env=child_environment(),
            start_new_session=True,
        )
    return children
