"""Turns a scheduled batch into flat tensors, runs the model, returns last-position logits."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch

from flare.serve.engine.attention import AttentionBackend, AttentionMetadata, AttentionSpec
from flare.serve.engine.device_io import upload
from flare.serve.engine.sampler import RowMaxima
from flare.serve.engine.sequence import BlockTable, Sequence


class CausalLM(Protocol):
    """What the engine needs of a text-generating model (see flare.serve.models)."""

    attention_spec: AttentionSpec
    vocab_size: int

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionBackend
    ) -> torch.Tensor:
        """Hidden states [tokens, hidden] for flat token ids and their positions."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] for the given hidden states."""


class Forward(Protocol):
    """A step's forward: flat token ids and positions, the rows whose logits are wanted, the
    planned attention backend → logits [rows, vocab] in the model's dtype (the sampler widens
    what it samples from; a greedy row needs only its maximum, found in that dtype). Eager
    (`EagerForward`) or compiled (serve/compiled.py)."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        last: torch.Tensor,
        attention: AttentionBackend,
    ) -> torch.Tensor: ...


class EagerForward:
    """The model's forward as written, op by op."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        last: torch.Tensor,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        hidden = self.model.forward(input_ids, positions, attention)
        return self.model.compute_logits(hidden[last])


@dataclass(frozen=True)
class FreshTokens:
    """The tokens the step before sampled, still on the device: the engine launches a step
    before the one before it lands, so a sequence's newest token may be pending on the host
    (`Sequence.pending`) and is read here instead."""

    tokens: torch.Tensor
    """long [rows of the step before], on the model's device."""
    rows: dict[int, int]
    """Sequence id → its row in `tokens`."""


@dataclass(frozen=True)
class FreshRows:
    """Where a decode step's pending input tokens come from: row `rows[i]` of the step's
    input ids is row `sources[i]` of `tokens`."""

    tokens: torch.Tensor
    rows: list[int]
    sources: list[int]

    @classmethod
    def of(cls, seqs: list[Sequence], fresh: FreshTokens | None) -> FreshRows | None:
        """The step's pending rows, None if it has none (a prefill never has)."""
        rows = [row for row, seq in enumerate(seqs) if seq.pending]
        if not rows:
            return None
        if fresh is None:
            raise RuntimeError("a pending token was scheduled without the step that samples it")
        sources = [fresh.rows[seqs[row].id] for row in rows]
        return cls(fresh.tokens, rows, sources)

    def write(self, input_ids: torch.Tensor) -> None:
        """Put the tokens into `input_ids` on the device, without waiting for it: one copy
        where the rows are the leading rows of both, in order (a batch decoding as before)."""
        n = len(self.rows)
        if self.rows == self.sources == list(range(n)):
            input_ids[:n].copy_(self.tokens[:n])
            return
        device = input_ids.device
        rows, sources = (upload(values, torch.long, device) for values in (self.rows, self.sources))
        input_ids.index_copy_(0, rows, self.tokens.index_select(0, sources))


@dataclass(frozen=True)
class StepLogits:
    """A step's logits [rows, vocab] at each sequence's last position, and, where
    the step computed them with its forward (a CUDA-graph decode step), each row's maximum
    and its index, which greedy sampling takes as they are."""

    logits: torch.Tensor
    maxima: RowMaxima | None = None


class StepReplay(Protocol):
    """Steps replayed from captured CUDA graphs: decode steps (cuda_graphs.py), prefill
    steps (prefill_graphs.py)."""

    def fits(self, step: StepInput) -> bool:
        """Whether a captured graph can run this step."""

    def run(self, step: StepInput, fresh: FreshRows | None) -> StepLogits:
        """The step's logits, with their rows' maxima."""


@dataclass(frozen=True)
class StepInput:
    """One step's batch as lists: what rank zero sends the other tensor-parallel ranks (as
    JSON), each of which makes the same tensors from it and runs its part of the forward.
    `tables` are the sequences' block tables as they are (lists of ids in JSON; padded only
    where a tensor needs a rectangle: a CUDA-graph decode step joins their arrays as they
    are)."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    context_lens: list[int]
    tables: list[BlockTable]

    @classmethod
    def empty(cls) -> StepInput:
        """A step of no sequences: what a graph's capture pads up to its shape."""
        return cls([], [], [], [], [], [])

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        return data | {"tables": [table.ids for table in self.tables]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepInput:
        step = {f.name: data[f.name] for f in fields(cls)}
        return cls(**step | {"tables": [BlockTable(ids) for ids in data["tables"]]})


class ModelRunner:
    """Owns the model and its attention backend; one `run` per engine step."""

    reads_fresh_tokens = True
    """Whether a step may take pending tokens from the step before on the device (one
    process does; tensor-parallel ranks are sent their token ids)."""

    def __init__(
        self,
        model: CausalLM,
        attention: AttentionBackend,
        block_size: int,
        device: torch.device,
        forward: Forward | None = None,
    ) -> None:
        self.model = model
        self.attention = attention
        self.block_size = block_size
        self.device = device
        self.forward = forward or EagerForward(model)
        self.graphs: StepReplay | None = None
        """Set once decode graphs are captured; the steps they fit replay them."""
        self.prefills: StepReplay | None = None
        """Likewise, prefill graphs."""

    def run(
        self, seqs: list[Sequence], prefill: bool, fresh: FreshTokens | None = None
    ) -> StepLogits:
        """The logits [len(seqs), vocab] at each sequence's last position; a pending newest
        token is read from `fresh`."""
        return self.run_step(self.step_input(seqs, prefill), FreshRows.of(seqs, fresh))

    @torch.inference_mode()
    def run_step(self, step: StepInput, fresh: FreshRows | None = None) -> StepLogits:
        """The forward of one step's batch, however it was scheduled."""
        for replay in (self.graphs, self.prefills):
            if replay is not None and replay.fits(step):
                return replay.run(step, fresh)
        input_ids, positions, meta = self.tensors(step)
        if fresh is not None:
            fresh.write(input_ids)
        self.attention.plan(meta)
        last = meta.query_start_loc[1:] - 1
        return StepLogits(self.forward(input_ids, positions, last, self.attention))

    def prepare(
        self, seqs: list[Sequence], prefill: bool
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat token ids, positions and attention metadata for the tokens to compute."""
        return self.tensors(self.step_input(seqs, prefill))

    def step_input(self, seqs: list[Sequence], prefill: bool) -> StepInput:
        """The batch's tokens to compute: a prefill computes everything after the cached
        prefix, a decode the newest token. The tables are the sequences' own lists, read
        before the step ends (the scheduler changes them only between steps)."""
        if not prefill:
            return self._decode_input(seqs)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        for seq in seqs:
            start = seq.num_cached_tokens
            ids += seq.token_ids[start:]
            positions += range(start, len(seq))
            slots += self._slots(seq, start, len(seq))
            query_lens.append(len(seq) - start)
        tables = [seq.kv_table for seq in seqs]
        context_lens = [len(seq) for seq in seqs]
        return StepInput(ids, positions, slots, query_lens, context_lens, tables)

    def _decode_input(self, seqs: list[Sequence]) -> StepInput:
        """A decode step's input, one token a sequence: made list by list, as the host loop
        makes it for every sequence at every step."""
        lengths = [len(seq.token_ids) for seq in seqs]
        positions = [n - 1 for n in lengths]
        slots = [self._slot(seq, p) for seq, p in zip(seqs, positions, strict=True)]
        return StepInput(
            ids=[seq.token_ids[-1] for seq in seqs],
            positions=positions,
            slots=slots,
            query_lens=[1] * len(seqs),
            context_lens=lengths,
            tables=[seq.kv_table for seq in seqs],
        )

    def _slot(self, seq: Sequence, position: int) -> int:
        block = seq.block_table[position // self.block_size]
        return block * self.block_size + position % self.block_size

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """The KV slots of positions start..end-1, a run of slots a block (a prompt's slots a
        position at a time took 1.5 ms of an 8K-token prefill's host time)."""
        size, slots = self.block_size, []
        for index in range(start // size, -(-end // size)):
            first = index * size
            base = seq.block_table[index] * size - first
            slots += range(base + max(start, first), base + min(end, first + size))
        return slots

    def tensors(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat token ids, positions and attention metadata on the model's device."""
        starts = [0]
        for n in step.query_lens:
            starts.append(starts[-1] + n)
        tables = [table.ids for table in step.tables]
        width = max(map(len, tables))
        padded = [ids + [-1] * (width - len(ids)) for ids in tables]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(step.slots),
            query_start_loc=self._tensor(starts),
            context_lens=self._tensor(step.context_lens),
            block_tables=self._tensor(padded),
            block_size=self.block_size,
            query_lens_cpu=step.query_lens,
            context_lens_cpu=step.context_lens,
            block_tables_cpu=tables,
        )
        return self._tensor(step.ids), self._tensor(step.positions), meta

    def _tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        """Up from pinned memory without waiting: a copy from pageable memory waits for the
        device's stream to drain, so a prefill launched while the decode step ahead still ran
        would wait for that step's end."""
        return upload(values, torch.int64, self.device)
