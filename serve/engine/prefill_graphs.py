"""Prefill steps replayed from CUDA graphs: one graph per (sequences, tokens) bucket, captured
at start.

A prefill step runs the compiled forward kernel by kernel, and on the H200's host its launch
took 12-22 ms of host time for the 1B shape's 16 layers (about 160 launches, each through
Python: a Triton launch about 31 µs there, an operator's dispatch about 12 more), for well under
a millisecond of GPU work on short prompts. Every decode in flight waited that long, and 16
streams' median first token was 48-64 ms (docs/performance.md). A graph replays such a step
with one launch.

A graph replays fixed shapes, so a step is padded to a bucket: to S sequences and T tokens, the
smallest captured with S above its sequences and T at least its tokens and the padding's.
The padding is sequences of their own, in the pad block the decode graphs pad with (which the
block manager never hands out): one token each, the last taking the tokens left; their keys
and values go there, their attention reads only them, and their logits are dropped.
FlashInfer's prefill runs in its CUDA-graph mode, a wrapper per S whose work split is made
for the most rows it is planned with (the largest T, captured first), so every T of that S
replays the same grid. The step's token ids, positions, KV slots, each sequence's last row
and its pages go up in one copy from a pinned buffer, FlashInfer plans on the host, and the
graph moves the staged values into the forward's inputs (graph_step.take_inputs) and runs
the forward and the logits of each sequence's last row.

Only steps of at most about TOKENS[-1] tokens replay: a longer prefill's GPU time is as long as its
launch (8K tokens: about 35 ms of GPU time for 23 ms of launch on the 1B shape), so it runs
as before, kernel by kernel. Decode steps are the decode graphs' (cuda_graphs.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from flare.serve.engine.cuda_graphs import STAGED, GraphReport, captured, held_bytes
from flare.serve.engine.device_io import settle
from flare.serve.engine.flashinfer_attention import (
    FlashInferGraphPrefill,
    FlashInferPagedAttention,
    page_counts,
    pages_of,
)
from flare.serve.engine.graph_step import take_inputs
from flare.serve.engine.runner import Forward, FreshRows, StepInput, StepLogits
from flare.serve.engine.sequence import BlockTable, join_pages

TOKENS = (128, 256, 512, 1024, 2048)
"""Token budgets of the buckets: a step pads to at most twice its tokens (GPU work, cheap at
these sizes)."""
PAD_ROOM = 32
"""Rows a bucket holds past its budget, for the padding's tokens: a step of 16 prompts of 32
tokens (512) and its padding sequence fit the 544-row bucket, not the next."""
SEQUENCES = (5, 17, 33)
"""Sequence counts of the buckets below the largest (one more than the package's max
concurrency): a step of 4, 16 or 32 sequences, common widths, pads with one sequence, and
for a package of up to 64 no step pads with more than PAD_ROOM."""


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor
    """The graph's output, [sequences, vocab], overwritten by every replay."""


def buckets(max_sequences: int, max_tokens: int) -> list[tuple[int, int]]:
    """The (sequences, rows) shapes to capture, largest first: sequence counts up to one
    more than `max_sequences` (a step holds at least one padding sequence), rows for the
    TOKENS budgets up to `max_tokens` (the scheduler's prefill budget) and PAD_ROOM more."""
    top = max_sequences + 1
    sequences = [n for n in SEQUENCES if n < top] + [top]
    rows = [n + PAD_ROOM for n in TOKENS if n <= max_tokens]
    return sorted(((s, t) for s in sequences for t in rows if t >= s), reverse=True)


def bucket_of(shapes: list[tuple[int, int]], sequences: int, tokens: int) -> tuple[int, int] | None:
    """The smallest captured shape that holds a step of `sequences` and `tokens` with its
    padding: more sequences than the step (one at least pads), tokens for the step's and one
    a padding sequence; None if none does."""
    fitting = [(s, t) for s, t in shapes if s > sequences and t >= tokens + (s - sequences)]
    return min(fitting, key=lambda shape: (shape[1], shape[0]), default=None)


def padded_prefill(
    step: StepInput, sequences: int, tokens: int, pad_block: int, block_size: int
) -> StepInput:
    """The prefill step with sequences added up to `sequences` and tokens up to `tokens`: one
    token each, the last taking the tokens left. Each lies in the pad block alone (its pages
    are that block, named again for each of its pages; its positions are taken modulo the
    block, so no position passes a short model's context), so no sequence's blocks are
    touched and the real rows are unchanged."""
    pads = sequences - len(step.query_lens)
    left = tokens - len(step.ids) - (pads - 1)
    if pads < 1 or left < 1:
        raise ValueError(f"a step of {len(step.ids)} tokens does not pad to {(sequences, tokens)}")
    lengths = [1] * (pads - 1) + [left]
    ids, positions, slots, tables = list(step.ids), list(step.positions), list(step.slots), []
    base = pad_block * block_size
    for n in lengths:
        offsets = [j % block_size for j in range(n)]
        ids += [0] * n
        positions += offsets
        slots += [base + j for j in offsets]
        tables.append(BlockTable([pad_block] * -(-n // block_size)))
    return StepInput(
        ids=ids,
        positions=positions,
        slots=slots,
        query_lens=step.query_lens + lengths,
        context_lens=step.context_lens + lengths,
        tables=step.tables + tables,
    )


class PrefillGraphs:
    """Every captured prefill graph of one runner, and the buffers they replay from."""

    def __init__(
        self,
        forward: Forward,
        attention: FlashInferPagedAttention,
        max_sequences: int,
        max_tokens: int,
        max_pages: int,
        pad_block: int,
    ) -> None:
        """`max_sequences`: the most sequences a step schedules; `max_tokens`: the most
        tokens it prefills; `max_pages`: the most KV pages its sequences may name (prefix-shared
        blocks count once per sequence); `pad_block`: the KV block padding uses."""
        self.forward, self.attention = forward, attention
        self.block_size = attention.block_size
        self.pad_block = pad_block
        self.shapes = buckets(max_sequences, max_tokens)
        self.rows = max((t for _, t in self.shapes), default=0)
        self.sequences = max((s for s, _ in self.shapes), default=0)
        self.max_pages = max_pages
        pages = max_pages + self.rows // self.block_size + self.sequences  # and the padding's
        with torch.inference_mode():  # made as the forward's own inputs are: no guard differs
            self._allocate(pages)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._wrappers: dict[int, FlashInferGraphPrefill] = {}
        self._copied: torch.cuda.Event | None = None
        """Recorded after the last step's copies out of the pinned buffers."""

    def _allocate(self, pages: int) -> None:
        """The static buffers every graph reads, on the device, and their pinned host twins:
        the staged rows (token ids, positions, KV slots, and a source row take_inputs reads
        as "staged", -1), each sequence's last row, then the page indices."""
        rows, device = self.rows, self.attention.cache.device
        self._inputs = [torch.zeros(rows, dtype=torch.int64, device=device) for _ in range(3)]
        """Token ids, positions, KV slots: three tensors of their own, as the forward was traced
        with (a view at an offset would fail a compiled forward's guards, and compile again)."""
        self._last = torch.zeros(self.sequences, dtype=torch.int64, device=device)
        self._pages_at = STAGED * rows + self.sequences
        self._staged_host = torch.zeros(self._pages_at + pages, dtype=torch.int32, pin_memory=True)
        self._staged_host[3 * rows : STAGED * rows] = -1
        self._staged = torch.zeros(self._pages_at + pages, dtype=torch.int32, device=device)
        self._wrapper_indices = torch.zeros(pages, dtype=torch.int32, device=device)
        """The page indices every wrapper reads (its plan copies them there)."""
        self._table_host = torch.zeros((4, self.sequences + 1), dtype=torch.int32, pin_memory=True)
        """FlashInfer's query offsets and page offsets (sequences + 1 each), last page lengths
        and sequence lengths."""

    def fits(self, step: StepInput) -> bool:
        """Whether a graph can run this step: a prefill (some sequence computes more than one
        token; a step of one token each is a decode graph's) that a bucket holds."""
        if all(n == 1 for n in step.query_lens):
            return False
        pages = pages_of(step.context_lens, self.block_size)
        found = bucket_of(self.shapes, len(step.query_lens), len(step.ids))
        return found is not None and sum(pages) <= self.max_pages

    @torch.inference_mode()
    def capture(self, pool: tuple[int, int] | None = None) -> GraphReport:
        """Capture every shape, largest first, into `pool` (the decode graphs', so the two
        share their memory: one step runs at a time); the first shape's step is run once
        before its capture, the others' are not (`captured`). Each shape's FlashInfer
        wrapper is planned before its capture, its buffers made with it."""
        device = self._last.device
        started = time.perf_counter()
        held = held_bytes(device)
        for shape in self.shapes:
            self._graphs[shape] = self._capture(shape, pool, warm=not self._graphs)
            pool = self._graphs[shape].graph.pool()
        taken = held_bytes(device) - held
        tokens = sorted({t for _, t in self.shapes})
        return GraphReport(
            tokens,
            time.perf_counter() - started,
            max(0, taken),
            kind="prefill",
            sequences=sorted({s for s, _ in self.shapes}),
        )

    def _capture(self, shape: tuple[int, int], pool: tuple[int, int] | None, warm: bool) -> _Graph:
        attention = self._wrapper(shape[0])
        empty = StepInput.empty()
        self._fill(padded_prefill(empty, *shape, self.pad_block, self.block_size), attention)
        graph, logits = captured(lambda: self._step(shape), pool, warm)
        return _Graph(graph, logits)

    def _wrapper(self, sequences: int) -> FlashInferGraphPrefill:
        """The FlashInfer wrapper of `sequences`, made for the first (largest) token count
        it is planned with."""
        if sequences not in self._wrappers:
            self._wrappers[sequences] = FlashInferGraphPrefill(
                self.attention, sequences, self._inputs[2], self._wrapper_indices
            )
        return self._wrappers[sequences]

    def _step(self, shape: tuple[int, int]) -> torch.Tensor:
        """What a graph runs: the staged inputs into the forward's, the forward, the logits
        of each sequence's last row."""
        sequences, tokens = shape
        ids, positions, slots = (tensor[:tokens] for tensor in self._inputs)
        staged = self._staged[: STAGED * self.rows].view(STAGED, -1)
        take_inputs(staged, ids, ids, positions, slots)  # every source -1: no pending tokens
        last = self._last[:sequences]
        last.copy_(self._staged[STAGED * self.rows : STAGED * self.rows + sequences])
        return self.forward(ids, positions, last, self._wrappers[sequences])

    @torch.inference_mode()
    def run(self, step: StepInput, fresh: FreshRows | None = None) -> StepLogits:
        """The step's logits [sequences, vocab], from the smallest graph that holds it. The
        tensor is the graph's: the next replay overwrites it. A prefill has no pending
        tokens (`fresh`)."""
        if fresh is not None:
            raise RuntimeError("a prefill step was given pending tokens")
        sequences = len(step.query_lens)
        shape = bucket_of(self.shapes, sequences, len(step.ids))
        assert shape is not None, "run() of a step that fits() refused"
        graph = self._graphs[shape]
        padded = padded_prefill(step, *shape, self.pad_block, self.block_size)
        self._fill(padded, self._wrappers[shape[0]])
        graph.graph.replay()
        return StepLogits(graph.logits[:sequences])

    def _fill(self, step: StepInput, attention: FlashInferGraphPrefill) -> None:
        """Stage the padded step where its graph reads it: into the pinned buffers (once the
        last step's copies out of them have run), to the device in one copy without a sync,
        then FlashInfer's plan from the pinned tables."""
        settle(self._copied)
        rows, sequences, tokens = self.rows, len(step.query_lens), len(step.ids)
        staged = self._staged_host.numpy()
        grid = staged[: 3 * rows].reshape(3, rows)
        grid[0, :tokens], grid[1, :tokens], grid[2, :tokens] = step.ids, step.positions, step.slots
        ends = np.cumsum(step.query_lens)
        staged[STAGED * rows : STAGED * rows + sequences] = ends - 1
        pages, last = page_counts(step.context_lens, self.block_size)
        end = self._pages_at + sum(pages)
        join_pages(step.tables, pages, staged[self._pages_at : end])
        self._staged[:end].copy_(self._staged_host[:end], non_blocking=True)
        table = self._table_host.numpy()
        table[0, 0] = table[1, 0] = 0
        table[0, 1 : sequences + 1] = ends
        np.cumsum(pages, out=table[1, 1 : sequences + 1])
        table[2, :sequences], table[3, :sequences] = last, step.context_lens
        attention.plan_pages(
            self._table_host[0, : sequences + 1],
            self._table_host[1, : sequences + 1],
            self._staged[self._pages_at : end],
            self._table_host[2, :sequences],
            self._table_host[3, :sequences],
        )
        self._copied = torch.cuda.Event()
        self._copied.record()
