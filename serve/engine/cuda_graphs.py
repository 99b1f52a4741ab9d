"""Decode steps replayed from CUDA graphs: one graph per batch size, captured at start.

A decode step of a small model is mostly launch overhead: the eager 1B Llama launched about
750 kernels a step, 16 ms of host time for 2 ms of GPU work. A CUDA graph records a step's
kernels once and replays them with one launch. A graph replays fixed addresses and shapes, so
each captured batch size reads its page table from fixed buffers (its attention is flare's
decode kernel, decode_attention.py, which needs no plan), and all sizes share static inputs,
the attention's workspace and one memory pool (captured largest first, as PyTorch
advises). The sizes are the decode batch sizes the package plans for
(model_sizes.decode_batch_sizes: powers of two, then its max concurrency); a step of n
sequences replays the graph of the smallest of at least n. At decode sizes a step reads every
weight once whatever its batch, so padding costs little; the rows past n read and write a KV
block kept aside for them (the pad block, which the block manager never hands out), and their
logits are dropped.

On a GPU host every call into the CUDA driver costs the engine thread tens of microseconds
(about 40 on the H200 host measured, docs/performance.md), so a step makes few of them:

- before the replay, the host writes the step's token ids, positions, KV slots, where each
  pending token comes from, and its page table (each sequence's first page and length, and
  the pages joined from the sequences' block tables' int32 arrays: no Python work a page)
  into one pinned buffer, copied to the device in one copy without waiting;
- the graph itself moves the staged values into the forward's inputs (a pending token read
  where the step before sampled it, on the device), runs the forward, and finds each row's
  maximum and its index (greedy sampling's answer, and each row's trust) beside the logits,
  writing them side by side for one copy to the host (a kernel each side of the forward:
  graph_step.py);
- so a greedy step is: one copy in, one replay, one copy out.

The engine launches a step while the step before still runs, so the pinned buffers are
written again only once the copies out of them for the step before have run (an event after
them), and the tokens are read back through two pinned buffers in turn (a step's tokens are
read before the step after the next is launched). Prefill steps have graphs of their own
(prefill_graphs.py); decode batches larger than the largest graph run the forward as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch

from flare.model_sizes import decode_batch_sizes
from flare.serve.engine.decode_attention import DecodeWorkspace, GraphDecodeAttention
from flare.serve.engine.device_io import settle
from flare.serve.engine.flashinfer_attention import FlashInferPagedAttention, pages_of
from flare.serve.engine.graph_step import pick_rows, pick_scratch, take_inputs
from flare.serve.engine.runner import Forward, FreshRows, StepInput, StepLogits
from flare.serve.engine.sampler import RowMaxima
from flare.serve.engine.sequence import BlockTable, join_pages


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor
    """The graph's output, [batch, vocab] in the model's dtype, overwritten by every replay
    (bf16 on a GPU: 64 rows of float32 logits cost a 40 µs cast a step, now the sampler's to
    make for the rows it draws)."""
    maxima: torch.Tensor
    """Each row's maximum, [batch] in the logits' dtype, beside them (its index is in the
    tokens)."""


@dataclass(frozen=True)
class GraphReport:
    """What capture made, for the ready line and the memory plan."""

    sizes: list[int]
    """Decode batch sizes; for prefill graphs, their token counts."""
    seconds: float
    bytes: int
    """Device memory the capture took: the graphs' pool, their wrappers' buffers."""
    kind: str = "decode"
    sequences: list[int] = field(default_factory=list)
    """Prefill graphs' sequence counts (each holds one sequence of padding at least)."""

    def describe(self) -> str:
        """What was captured, for the ready line."""
        if self.kind == "decode":
            return f"{len(self.sizes)} decode batch sizes, 1 to {self.sizes[-1]}"
        return f"up to {self.sequences[-1] - 1} sequences and {self.sizes[-1]} tokens"


STAGED = 4
"""Rows of the staging buffer ahead of the page table: token ids, positions, KV slots, and
for each row the row of the step before's tokens its pending token is (-1: its id is staged)."""
ALIGN = 16
"""The page table's parts start at multiples of 16 int32 in the staging buffer: Triton keys a
kernel by whether each pointer is 16-byte aligned, and the build compiled it for aligned ones."""


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
        self._workspace: DecodeWorkspace | None = None
        """The graphs' attention workspace, made as they are captured (their memory)."""
        self._copied: torch.cuda.Event | None = None
        """Recorded after the last step's copies out of the pinned buffers."""
        self._replays = 0
        self.pool: tuple[int, int] | None = None
        """The graphs' memory pool, once captured (the prefill graphs share it)."""

    def _allocate(self, max_pages: int) -> None:
        """The static buffers every graph reads, on the device, and their pinned host twins."""
        top, device = self.sizes[-1], self.attention.cache.device
        self._inputs = [torch.zeros(top, dtype=torch.int64, device=device) for _ in range(3)]
        """Token ids, positions, KV slots: three tensors of their own, as the forward was traced
        with (a view at an offset would fail a compiled forward's guards, and compile again)."""
        self._last = torch.arange(top, dtype=torch.int64, device=device)
        self._lengths_at = STAGED * top + _aligned(top + 1)
        self._pages_at = self._lengths_at + _aligned(top)
        """Where the page table's parts start in the staging buffer: after the rows, each
        sequence's first page (top + 1: FlashInfer's indptr), their lengths, their pages."""
        size = self._pages_at + max_pages
        self._staged_host = torch.zeros(size, dtype=torch.int32, pin_memory=True)
        self._staged = torch.zeros(size, dtype=torch.int32, device=device)
        self._tokens = torch.zeros(top, dtype=torch.int64, device=device)
        """Each replay's greedy tokens, where the next replay reads its pending ones."""
        self._packed = torch.zeros((top, 2), dtype=torch.float64, device=device)
        self._scratch: torch.Tensor | None = None
        """`pick_rows`' room, made once the vocabulary is known (the first step's logits)."""
        self._packed_host = [
            torch.zeros((top, 2), dtype=torch.float64, pin_memory=True) for _ in range(2)
        ]

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def fits(self, step: StepInput) -> bool:
        """Whether a graph can run this step: a decode step (one new token per sequence) of
        no more sequences than the largest graph."""
        return len(step.query_lens) <= self.max_batch and all(n == 1 for n in step.query_lens)

    @torch.inference_mode()
    def capture(self) -> GraphReport:
        """Capture every size, largest first, into one memory pool; the first size's step
        is run once before its capture, the others' are not (`captured`)."""
        device = self._last.device
        started = time.perf_counter()
        held = held_bytes(device)
        spec = self.attention.spec
        group = spec.num_heads // spec.num_kv_heads
        self._workspace = DecodeWorkspace(
            self.max_batch, spec.num_kv_heads, group, spec.head_dim, device
        )
        for size in reversed(self.sizes):
            self._graphs[size] = self._capture(size, self.pool, warm=not self._graphs)
            self.pool = self._graphs[size].graph.pool()
        taken = held_bytes(device) - held
        return GraphReport(self.sizes, time.perf_counter() - started, max(0, taken))

    def _capture(self, size: int, pool: tuple[int, int] | None, warm: bool) -> _Graph:
        staged, top = self._staged, self.max_batch
        table = (
            staged[STAGED * top : STAGED * top + size + 1],
            staged[self._pages_at :],
            staged[self._lengths_at : self._lengths_at + size],
        )
        slots = self._inputs[2][:size]
        attention = GraphDecodeAttention(self.attention, slots, table, self._workspace)
        empty = StepInput.empty()
        self._fill(padded_to(empty, size, self.pad_block, self.block_size), size)
        graph, (logits, maxima) = captured(lambda: self._step(size, attention), pool, warm)
        return _Graph(graph, logits, maxima)

    def _step(
        self, size: int, attention: GraphDecodeAttention
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What a graph runs: the staged inputs into the forward's, the forward, each row's
        maximum and its index (into `_tokens`, and beside it into `_packed`)."""
        ids, positions, slots = (tensor[:size] for tensor in self._inputs)
        staged = self._staged[: STAGED * self.max_batch].view(STAGED, -1)
        take_inputs(staged, self._tokens, ids, positions, slots)
        logits = self.forward(ids, positions, self._last[:size], attention)
        if self._scratch is None:  # the first step runs before any capture
            self._scratch = pick_scratch(self.max_batch, logits.shape[-1], logits.device)
        maxima = logits.new_empty(size)
        pick_rows(logits, self._tokens[:size], maxima, self._packed[:size], self._scratch)
        return logits, maxima

    @torch.inference_mode()
    def run(self, step: StepInput, fresh: FreshRows | None = None) -> StepLogits:
        """The step's logits [sequences, vocab] and their rows' maxima, from the smallest
        graph that holds it; pending input tokens are read from `fresh`. The tensors are the
        graph's: the next replay overwrites them."""
        rows = len(step.ids)
        size = next(n for n in self.sizes if n >= rows)
        graph = self._graphs[size]
        self._fill(padded_to(step, size, self.pad_block, self.block_size), size, fresh)
        graph.graph.replay()
        host = self._packed_host[self._replays % 2]
        self._replays += 1
        maxima = RowMaxima(graph.maxima[:rows], self._tokens[:rows], self._packed[:rows], host)
        return StepLogits(graph.logits[:rows], maxima)

    def _fill(self, step: StepInput, size: int, fresh: FreshRows | None = None) -> None:
        """Stage the step's inputs and page table where the graph of `size` reads them: into
        the pinned buffer (once the last step's copies out of it have run), then to the
        device in one copy without a sync; pending tokens are taken from where the step
        before sampled them (copied next to the graphs' own tokens first, where that step
        was not a replay)."""
        settle(self._copied)
        top = self.max_batch
        staged = self._staged_host.numpy()
        grid = staged[: STAGED * top].reshape(STAGED, top)
        grid[0, :size], grid[1, :size], grid[2, :size] = step.ids, step.positions, step.slots
        grid[3, :size] = -1
        if fresh is not None:
            grid[3, fresh.rows] = fresh.sources
            self._keep_tokens(fresh.tokens)
        pages = pages_of(step.context_lens, self.block_size)
        starts = STAGED * top
        staged[starts] = 0
        np.cumsum(pages, out=staged[starts + 1 : starts + size + 1])
        staged[self._lengths_at : self._lengths_at + size] = step.context_lens
        end = self._pages_at + int(staged[starts + size])
        join_pages(step.tables, pages, staged[self._pages_at : end])
        self._staged[:end].copy_(self._staged_host[:end], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def _keep_tokens(self, tokens: torch.Tensor) -> None:
        """Make the step before's sampled tokens the ones the graphs read (a replay's are
        already there; a prefill's are copied, on the device)."""
        if tokens.data_ptr() == self._tokens.data_ptr():
            return
        if len(tokens) > len(self._tokens):
            raise RuntimeError(
                f"{len(tokens)} pending tokens, more than the graphs' {len(self._tokens)} rows"
            )
        self._tokens[: len(tokens)].copy_(tokens)


def held_bytes(device: torch.device) -> int:
    """Device memory the caching allocator holds for work queued from this thread (its
    current stream's live blocks) and in every CUDA graph's pool: taken before and after a
    set of captures, the difference is what the graphs and their buffers hold, whatever the
    weights' read, which the captures run beside on a stream of its own, allocates and frees
    meanwhile (the device's free memory would count the read's buffers in flight)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(index).cuda_stream
    held = 0
    for segment in torch.cuda.memory_snapshot(include_traces=False):
        if segment["device"] != index:
            continue
        if tuple(segment["segment_pool_id"]) != (0, 0):
            held += segment["total_size"]
        elif segment["stream"] == stream:
            held += segment["allocated_size"]
    return held


def release_unused(device: torch.device) -> None:
    """Let the device's queued work finish and the caching allocators give back what they
    hold unused (the weights' read buffers, the warm-up's temporaries; the pinned host
    buffers the read staged through, as `torch.cuda.graph` frees them), so that the memory
    plan, made next, sees the device as the server will run on it."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch._C._host_emptyCache()


T = TypeVar("T")


def captured(
    step: Callable[[], T], pool: tuple[int, int] | None, warm: bool
) -> tuple[torch.cuda.CUDAGraph, T]:
    """A graph of `step`'s work (its memory from `pool`) and what `step` returned as it was
    captured; with `warm`, `step` is run once first and the device's work awaited.

    A start captures a set of graphs (decode sizes, prefill shapes) after the forward's
    warm-up: the first of a set is run before its capture, for what a new size may do once
    (cuBLAS loads the kernels of a larger product, the capture stream's workspace is made);
    the rest are captured without a run, as vLLM captures (no warm-up run a size by default),
    which halves the forward's calls in the capture and leaves out the GPU work of each
    prefill shape's run. A capture without a run that fails is made again after one, in a
    pool of its own, which the set's next graphs share (the callers take each graph's pool for
    the next): torch 2.11 leaves a failed capture's pool recording, where no later capture
    may begin (`_stop_allocating_to`)."""
    if warm:
        step()
        torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with recording(graph, pool):
            return graph, step()
    except RuntimeError:
        if warm:
            raise
    return captured(step, None, warm=True)


@contextmanager
def recording(graph: torch.cuda.CUDAGraph, pool: tuple[int, int] | None) -> Iterator[None]:
    """Capture the work the block queues into `graph`, its memory from `pool` (None: a pool
    of its own), on the device's one capture stream (graphs that share a pool must share it),
    the device's queued work done first (the caller waits for it). As `torch.cuda.graph`,
    less the caching allocators' emptying before each capture: a start captures a graph
    per decode size and prefill shape in a row, each run once just before, and emptied, every
    run's temporaries came from the driver again (vLLM skips it after its first graph for the
    same reason); the runtime empties it once, after the captures (`release_unused`).

    Captured in CUDA's thread-local mode: the weights' read goes on beside the captures, on
    threads and a stream of their own (it copies, allocates and waits for its copies, which
    the default, global mode forbids every thread while a capture is under way); what a
    graph records is this thread's work on the capture stream alone, and it replays only
    once the read is done."""
    device = torch.cuda.current_device()
    stream = _CAPTURE_STREAMS.get(device)
    if stream is None:
        stream = _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()  # named, to end it
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            yield
        except BaseException:
            try:
                graph.capture_end()
            except RuntimeError:  # the capture the error broke: the error says why
                _stop_allocating_to(device, pool)
            raise
        graph.capture_end()


def _stop_allocating_to(device: int, pool: tuple[int, int]) -> None:
    """End the device caching allocator's recording into `pool` after a capture whose end
    failed (one that its step broke: `capture_end` raises before it ends the recording): while
    a recording is open, every allocation on the device asks it whether the stream is its
    capture's (a driver call), for the life of the process. Nothing to end where the failed
    end had ended it. It does not free the pool for another capture: in torch 2.11 the next
    capture into it still fails with "already recording to mempool_id" (a probe on the H100,
    twenty-sixth session: something else keeps recording), so a retry captures into a pool of
    its own (`captured`)."""
    with suppress(RuntimeError):
        torch._C._cuda_endAllocateToPool(device, pool)


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}
"""The stream each device's graphs are captured on."""


def _aligned(count: int) -> int:
    return -(-count // ALIGN) * ALIGN


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
        tables=step.tables + [BlockTable([pad_block])] * rows,
    )
