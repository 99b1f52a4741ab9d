"""The ranks of a tensor-parallel server, once started: each step's batch goes from rank zero
to the others, and every rank runs its part of the forward.

Rank zero runs the scheduler and the API, as with one rank; its runner (`LeaderRunner`) sends
each step's batch (`StepInput`, as JSON: token ids, positions, KV slots, block tables) to the
other ranks with a broadcast over the group's gloo process group, then runs its own part of
the forward, whose collectives the other ranks meet in the same order (`follow`). Only rank
zero samples: every rank gets the whole logits, the others drop them.

A rank that waits longer than the group's timeout for the next message takes rank zero for
gone, so an idle rank zero sends a `tick` every quarter of the timeout; `stop` ends the
others with exit 0.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from flare.rendezvous import RankError, Rendezvous
from flare.serve.engine.attention import AttentionBackend
from flare.serve.engine.runner import CausalLM, FreshRows, ModelRunner, StepInput, StepLogits
from flare.serve.models.shard import Shard


@dataclass
class RankGroup:
    """This process's rank of a serving group: the rendezvous (store, heartbeats, gloo group
    for messages) and the model's `Shard` (whose collectives may run on NCCL instead)."""

    rendezvous: Rendezvous
    shard: Shard
    sent_seconds: float = field(default=0.0)
    """Time rank zero spent sending steps: with `shard.collective_seconds`, what the ranks
    cost per step on top of the forward."""

    @property
    def rank(self) -> int:
        return self.rendezvous.rank

    @property
    def world(self) -> int:
        return self.rendezvous.world

    def send(self, message: dict[str, Any]) -> None:
        """Rank zero: one message to every other rank (its length, then its bytes)."""
        started = time.perf_counter()
        data = json.dumps(message, separators=(",", ":")).encode()
        self._broadcast(torch.tensor([len(data)], dtype=torch.int64))
        self._broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.sent_seconds += time.perf_counter() - started

    def receive(self) -> dict[str, Any]:
        """Another rank: rank zero's next message."""
        length = torch.zeros(1, dtype=torch.int64)
        self._broadcast(length)
        data = torch.empty(int(length.item()), dtype=torch.uint8)
        self._broadcast(data)
        return json.loads(data.numpy().tobytes())

    def _broadcast(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.rendezvous.group.broadcast([tensor], options).wait()


class LeaderRunner(ModelRunner):
    """Rank zero's runner: each step goes to the other ranks before its forward runs here.

    A send or forward that fails (a rank died, or stopped answering past the timeout) is
    reported to `on_failure` before it fails the step's requests: the group cannot go on."""

    def __init__(
        self,
        model: CausalLM,
        attention: AttentionBackend,
        block_size: int,
        device: torch.device,
        group: RankGroup,
        on_failure: Callable[[BaseException], None],
    ) -> None:
        super().__init__(model, attention, block_size, device)
        self.group = group
        self.on_failure = on_failure
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._stopped = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="rank-tick", daemon=True)

    def start_ticking(self) -> None:
        """Once every rank waits in its loop (a tick sent earlier would wait for it)."""
        self._ticker.start()

    reads_fresh_tokens = False
    """The other ranks are sent each step's token ids: every one is read on the host first."""

    def run_step(self, step: StepInput, fresh: FreshRows | None = None) -> StepLogits:
        if fresh is not None:
            raise RuntimeError("tensor-parallel ranks are sent token ids, not device tokens")
        with self._lock:
            try:
                self.group.send({"op": "step", **step.to_json()})
                return super().run_step(step)
            except Exception as exc:  # a rank is lost: the group can run no more steps
                self.on_failure(exc)
                raise RankError(f"a step between the ranks failed: {first_line(exc)}") from exc
            finally:
                self._last = time.monotonic()

    def _tick(self) -> None:
        """While the engine idles, tell the other ranks rank zero is still here."""
        period = self.group.rendezvous.timeout / 4
        while not self._stopped.wait(min(period, 1.0)):
            with self._lock:
                if self._stopped.is_set() or time.monotonic() - self._last < period:
                    continue
                try:
                    self.group.send({"op": "tick"})
                except Exception as exc:
                    self.on_failure(exc)
                    return
                self._last = time.monotonic()

    def stop_ranks(self) -> None:
        """After the drain: every other rank leaves its loop and exits 0."""
        self._stopped.set()
        with self._lock:
            try:
                self.group.send({"op": "stop"})
            except Exception as exc:  # a rank was lost while the server drained
                raise RankError(f"could not stop the other ranks: {first_line(exc)}") from exc
        if self._ticker.is_alive():
            self._ticker.join()


def follow(group: RankGroup, runner: ModelRunner) -> None:
    """Another rank's loop: run each step rank zero sends, until it says stop. A failed
    receive or forward raises (rank zero or a peer is gone); the caller exits non-zero."""
    while True:
        message = group.receive()
        op = message.get("op")
        if op == "stop":
            return
        if op == "step":
            runner.run_step(StepInput.from_json(message))


def first_line(error: BaseException) -> str:
    """An error's first line (gloo's run on with advice that does not apply here)."""
    text = str(error).strip()
    return text.splitlines()[0].split(". ")[0] if text else type(error).__name__
