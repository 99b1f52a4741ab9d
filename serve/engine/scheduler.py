"""Continuous batching: which sequences run in the next step.

Each step either prefills newly admitted requests (as many as free blocks and the token
budget allow; one, where the server keeps batches invariant: a prefill's products round by
how many tokens they hold, so a prompt prefilled beside others could differ from itself
alone) or decodes one token for every running one. When decoding runs out of blocks,
the newest running sequence is preempted: its blocks are freed and it goes back to the front
of the queue to be recomputed later (its full blocks usually survive in the prefix cache).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from flare.serve.engine.block_manager import BlockManager
from flare.serve.engine.sequence import Sequence, Status


@dataclass(frozen=True)
class ScheduledBatch:
    seqs: list[Sequence]
    prefill: bool


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int,
        max_batched_tokens: int,
        prefill_alone: bool = False,
    ) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.prefill_alone = prefill_alone
        """Prefill one sequence a step (batch-invariant serving)."""
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch: prefill admitted requests if any, else decode the running."""
        admitted = self._admit()
        if admitted:
            return ScheduledBatch(admitted, prefill=True)
        decoding = self._decode_batch()
        return ScheduledBatch(decoding, prefill=False) if decoding else None

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        tokens = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            full = self.prefill_alone or tokens + len(seq) > self.max_batched_tokens
            if (admitted and full) or not self.blocks.try_allocate(seq):
                break
            tokens += len(seq) - seq.num_cached_tokens
            seq.status = Status.RUNNING
            self.running.append(self.waiting.popleft())
            admitted.append(seq)
        return admitted

    def _decode_batch(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        while self.running:
            seq = self.running.popleft()
            if not self._room_for(seq):
                self._preempt(seq)
                break
            self.blocks.append_slot(seq)
            scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled

    def _room_for(self, seq: Sequence) -> bool:
        """Whether the sequence's newest token has a slot, the newest running sequences
        preempted until it has or none is left (one check a sequence when there is room,
        as nearly always: this runs for every sequence of every decode step)."""
        while not self.blocks.can_append(seq):
            if not self.running:
                return False
            self._preempt(self.running.pop())
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks and queue it first, to recompute its tokens later."""
        self.blocks.free_sequence(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def set_aside(self, seq: Sequence) -> None:
        """Schedule the sequence no more, keeping its blocks: its last token is in flight and
        ends it (max_tokens); `finish` frees them once that token has landed."""
        if seq in self.running:
            self.running.remove(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished, cancelled or failed sequence wherever it is and free its blocks.
        It may be in neither queue when a step failed half-way (a decode batch is out of
        `running` while it is assembled); it is finished all the same."""
        if seq.status is Status.RUNNING:
            self.blocks.free_sequence(seq)
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
        seq.status = Status.FINISHED
