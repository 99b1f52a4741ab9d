"""Decode steps replayed from CUDA graphs: one graph per batch size, captured at start.

A decode step of a small model is mostly launch overhead: the eager 1B Llama launched about
750 kernels a step, 16 ms of host time for 2 ms of GPU work. A CUDA graph records a step's
kernels once and replays them with one launch. A graph replays fixed addresses and shapes, so
each captured batch size has its own FlashInfer decode wrapper in CUDA-graph mode (its page
table in fixed buffers), and all sizes share static inputs (token ids, positions, KV slots)
and one memory pool (captured largest first, as PyTorch advises). The sizes are the decode
batch sizes the package plans for (model_sizes.decode_batch_sizes: powers of two, then its
max concurrency); a step of n sequences replays the graph of the smallest of at least n. At
decode sizes a step reads every weight once whatever its batch, so padding costs little; the
rows past n read and write a KV block kept aside for them (the pad block, which the block
manager never hands out), and their logits are dropped.

Before each replay the host writes the step's inputs and page table into pinned buffers and
copies them to the device without waiting, then plans FlashInfer's kernels (a host-side
computation whose results FlashInfer copies into its own buffers, also without waiting), and
token ids still pending on the host are copied from where the step before sampled them. The
engine launches a step while the step before still runs, so the pinned buffers are written
again only once the copies out of them for the step before have run (an event after them).
Prefill steps, and decode batches larger than the largest graph, run the forward as before.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from flare.model_sizes import decode_batch_sizes
from flare.serve.engine.device_io import settle
from flare.serve.engine.flashinfer_attention import (
    FlashInferGraphDecode,
    FlashInferPagedAttention,
    page_table,
)
from flare.serve.engine.runner import Forward, FreshRows, StepInput


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    attention: FlashInferGraphDecode
    logits: torch.Tensor
    """The graph's output, [batch, vocab] float32, overwritten by every replay."""


@dataclass(frozen=True)
class GraphReport:
    """What capture made, for the ready line and the memory plan."""

    sizes: list[int]
    seconds: float
    bytes: int
    """Device memory the capture took: the graphs' pool, their wrappers' buffers."""


class DecodeGraphs:
    """Every captured decode graph of one runner, and the buffers they replay from."""

    def __init__(
        self,
        forward: Forward,
        attention: FlashInferPagedAttention,
        max_batch: int,
        max_pages: int,
        pad_block: int,
    ) -> None:
        """`max_pages`: the most KV pages one step may name (prefix-shared blocks count once
        per sequence); `pad_block`: the KV block padding rows use."""
        self.forward, self.attention = forward, attention
        self.block_size = attention.block_size
        self.pad_block = pad_block
        self.sizes = decode_batch_sizes(max_batch)
        with torch.inference_mode():  # made as the forward's own inputs are: no guard differs
            self._allocate(max_pages)
        self._graphs: dict[int, _Graph] = {}
        self._copied: torch.cuda.Event | None = None
        """Recorded after the last step's copies out of the pinned buffers."""

    def _allocate(self, max_pages: int) -> None:
        """The static buffers every graph reads, on the device, and their pinned host twins."""
        top, device = self.sizes[-1], self.attention.cache.device
        self._inputs = [torch.zeros(top, dtype=torch.int64, device=device) for _ in range(3)]
        """Token ids, positions, KV slots: three tensors of their own, as the forward was traced
        with (a view at an offset would fail a compiled forward's guards, and compile again)."""
        self._inputs_host = torch.zeros((3, top), dtype=torch.int64, pin_memory=True)
        self._last = torch.arange(top, dtype=torch.int64, device=device)
        self._indices = torch.zeros(max_pages, dtype=torch.int32, device=device)
        self._wrapper_indices = torch.zeros(max_pages, dtype=torch.int32, device=device)
        """The page indices every size's wrapper reads (its plan copies `_indices` there)."""
        self._indices_host = torch.zeros(max_pages, dtype=torch.int32, pin_memory=True)
        self._table_host = torch.zeros((2, top + 1), dtype=torch.int32, pin_memory=True)
        """FlashInfer's indptr (top + 1) and last page lengths (top), on the host."""

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def fits(self, step: StepInput) -> bool:
        """Whether a graph can run this step: a decode step (one new token per sequence) of
        no more sequences than the largest graph."""
        return len(step.query_lens) <= self.max_batch and all(n == 1 for n in step.query_lens)

    @torch.inference_mode()
    def capture(self) -> GraphReport:
        """Capture every size, largest first, into one memory pool; each size's forward is
        run once before its capture (kernels loaded, cuBLAS's workspace made)."""
        device = self._last.device
        torch.cuda.synchronize(device)
        free, _ = torch.cuda.mem_get_info(device)
        started = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):
            self._graphs[size] = self._capture(size, pool)
            pool = self._graphs[size].graph.pool()
        torch.cuda.synchronize(device)
        taken = free - torch.cuda.mem_get_info(device)[0]
        return GraphReport(self.sizes, time.perf_counter() - started, max(0, taken))

    def _capture(self, size: int, pool: tuple[int, int] | None) -> _Graph:
        ids, positions, slots = (tensor[:size] for tensor in self._inputs)
        attention = FlashInferGraphDecode(self.attention, slots, self._wrapper_indices)
        self._fill(padded_to(_empty_step(), size, self.pad_block, self.block_size), attention, size)
        args = (ids, positions, self._last[:size])
        self.forward(*args, attention)
        torch.cuda.synchronize(self._last.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self.forward(*args, attention)
        return _Graph(graph, attention, logits)

    @torch.inference_mode()
    def run(self, step: StepInput, fresh: FreshRows | None = None) -> torch.Tensor:
        """The step's float32 logits [sequences, vocab], from the smallest graph that holds
        it; pending input tokens are read from `fresh`. The tensor is the graph's output:
        the next replay of this size overwrites it."""
        rows = len(step.ids)
        size = next(n for n in self.sizes if n >= rows)
        graph = self._graphs[size]
        self._fill(padded_to(step, size, self.pad_block, self.block_size), graph.attention, size)
        if fresh is not None:
            fresh.write(self._inputs[0])
        graph.graph.replay()
        return graph.logits[:rows]

    def _fill(self, step: StepInput, attention: FlashInferGraphDecode, size: int) -> None:
        """Write the step's inputs and page table where the graph of `size` reads them: into
        the pinned buffers (once the last step's copies out of them have run), then to the
        device without a sync, then FlashInfer's plan."""
        settle(self._copied)
        host = self._inputs_host.numpy()
        host[0, :size], host[1, :size], host[2, :size] = step.ids, step.positions, step.slots
        for tensor, values in zip(self._inputs, self._inputs_host, strict=True):
            tensor[:size].copy_(values[:size], non_blocking=True)
        pages, indices, last = page_table(step.context_lens, step.tables, self.block_size)
        self._indices_host.numpy()[: len(indices)] = indices
        self._indices[: len(indices)].copy_(self._indices_host[: len(indices)], non_blocking=True)
        table = self._table_host.numpy()
        table[0, 0] = 0
        np.cumsum(pages, out=table[0, 1 : size + 1])
        table[1, :size] = last
        attention.plan_pages(
            self._table_host[0, : size + 1],
            self._indices[: len(indices)],
            self._table_host[1, :size],
        )
        self._copied = torch.cuda.Event()
        self._copied.record()


def padded_to(step: StepInput, size: int, pad_block: int, block_size: int) -> StepInput:
    """The decode step with rows added up to `size`: each a one-token sequence at position 0
    of the pad block, whose KV it writes and reads (no sequence's blocks are touched)."""
    rows = size - len(step.ids)
    slot = pad_block * block_size
    return StepInput(
        ids=step.ids + [0] * rows,
        positions=step.positions + [0] * rows,
        slots=step.slots + [slot] * rows,
        query_lens=step.query_lens + [1] * rows,
        context_lens=step.context_lens + [1] * rows,
        tables=step.tables + [[pad_block]] * rows,
    )


def _empty_step() -> StepInput:
    return StepInput([], [], [], [], [], [])
