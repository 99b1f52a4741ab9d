"""Turns a scheduled batch into flat tensors, runs the model, returns last-position logits."""

from __future__ import annotations

from typing import Protocol

import torch

from flare.serve.engine.attention import AttentionBackend, AttentionMetadata, AttentionSpec
from flare.serve.engine.sequence import Sequence


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
    planned attention backend → float32 logits [rows, vocab]. Eager (`EagerForward`) or
    compiled (serve/compiled.py)."""

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
        return self.model.compute_logits(hidden[last]).float()


class ModelRunner:
    """Owns the model and its attention backend; one `run` per engine step."""

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

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], prefill: bool) -> torch.Tensor:
        """Float32 logits [len(seqs), vocab] at each sequence's last position."""
        input_ids, positions, meta = self.prepare(seqs, prefill)
        self.attention.plan(meta)
        last = meta.query_start_loc[1:] - 1
        return self.forward(input_ids, positions, last, self.attention)

    def prepare(
        self, seqs: list[Sequence], prefill: bool
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat token ids, positions and attention metadata for the tokens to compute:
        a prefill computes everything after the cached prefix, a decode the newest token."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        for seq in seqs:
            start = seq.num_cached_tokens if prefill else len(seq) - 1
            ids += seq.token_ids[start:]
            positions += range(start, len(seq))
            slots += (self._slot(seq, p) for p in range(start, len(seq)))
            query_lens.append(len(seq) - start)
        meta = self._metadata(seqs, slots, query_lens)
        return self._tensor(ids), self._tensor(positions), meta

    def _slot(self, seq: Sequence, position: int) -> int:
        block = seq.block_table[position // self.block_size]
        return block * self.block_size + position % self.block_size

    def _metadata(
        self, seqs: list[Sequence], slots: list[int], query_lens: list[int]
    ) -> AttentionMetadata:
        width = max(len(seq.block_table) for seq in seqs)
        tables = [seq.block_table + [-1] * (width - len(seq.block_table)) for seq in seqs]
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        context_lens = [len(seq) for seq in seqs]
        return AttentionMetadata(
            slot_mapping=self._tensor(slots),
            query_start_loc=self._tensor(starts),
            context_lens=self._tensor(context_lens),
            block_tables=self._tensor(tables),
            block_size=self.block_size,
            query_lens_cpu=query_lens,
            context_lens_cpu=context_lens,
            block_tables_cpu=tables,
        )

    def _tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)
