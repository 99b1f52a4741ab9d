"""A decode step's attention over the paged KV cache, in flare's own kernel: split by the
sequence's length alone, merged by the last of its programs.

A decode graph used to run FlashInfer's decode kernel in its CUDA-graph mode, whose work split
is fixed when the graph is captured and then always splits the KV and merges after. On an
H200 (tests/bench/gpu_decode_attention.py, docs/performance.md) that took 12-17 µs a layer for
16 sequences of 256-512 tokens (1B heads) and 41 µs for 64 of 512, where their keys and values
take 3-11 µs to read, and its plan cost the host 60-100 µs a step (the tensor-core variant,
FA3 on Hopper, was slower still). `paged_decode` is one kernel with no plan:

- a program attends one sequence's query heads that share a KV head (GROUP of them, padded
  to ROWS for the tensor cores' product) over one *split* of its context at a time, a
  `Tiling`'s tokens a loop step, each token's key and value read through the page table;
- a sequence of `length` tokens has cdiv(length, chunk) splits of `chunk` tokens, the
  fewest whole CHUNKs that make at most MAX_SPLITS of them: more for longer contexts, so a
  long one at batch 1 is read by 256 programs at once and a short one by one program, with no merge;
- the grid gives each (sequence, KV head) `programs` programs, from the batch size (about
  two programs a multiprocessor in all), which take the splits in turn; each split's
  float32 output, row maximum and sum go to a workspace, and the last of the sequence's
  programs to finish (a counter it takes, then sets back to 0) merges them, in one fixed
  order.

A split's bounds depend on the sequence's length alone, and the merge's order is fixed, so a
sequence's output has the same bits whatever the batch beside it or the grid: what
batch-invariant decoding needs of its attention. The indices come as FlashInfer takes them
(page offsets `indptr`, pages one after another, and each sequence's length), so a decode
graph stages them in the one copy that stages its inputs, with no plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from flare.serve.engine.dependent_launch import chained

if TYPE_CHECKING:
    from flare.serve.engine.attention import AttentionSpec
    from flare.serve.engine.flashinfer_attention import FlashInferPagedAttention

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU build of torch ships without Triton
    triton = None

CHUNK = 256
"""Tokens of the shortest split: a context of up to CHUNK tokens is one program's, merged by
nobody; a longer one has more splits."""
MAX_SPLITS = 32
"""The most splits a sequence has: an 8K context is 32 splits of 256 (with 8 KV heads, 256
programs at batch 1); longer ones have longer splits."""


@dataclass(frozen=True)
class Tiling:
    """How a program reads its split: tokens a loop step, the loop's pipeline depth, warps.
    The default was the fastest of seven on an H200 in 17 of 26 cases (1B and 8B heads,
    batch 1-64, contexts 64-8,192: tests/bench/gpu_decode_attention.py) and within 1.5 µs of
    the fastest in the others but those of 64-token contexts, where 64 tokens a step was
    0.6-2.7 µs faster (and slower from 512 tokens on)."""

    block_n: int = 128
    stages: int = 3
    warps: int = 4


TILING = Tiling()


def programs(batch: int, kv_heads: int, device: torch.device) -> int:
    """Programs a (sequence, KV head) gets at this batch size: about two a multiprocessor in
    all, a power of two, at most MAX_SPLITS (a split is one program's)."""
    wanted = -(-2 * _multiprocessors(device) // (batch * kv_heads))
    return min(MAX_SPLITS, 1 << (wanted - 1).bit_length())


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # Triton's interpreter: any grid runs
    return torch.cuda.get_device_properties(device).multi_processor_count


class DecodeWorkspace:
    """What `paged_decode` keeps between launches for up to `batch` sequences: the splits'
    outputs and their row maxima and sums (float32), and a counter a (sequence, KV head),
    zero between launches (the merging program resets its own), so the workspace serves
    every layer and every step, and a captured graph replays with it as it is."""

    def __init__(
        self, batch: int, kv_heads: int, group: int, head_dim: int, device: torch.device
    ) -> None:
        shape = (batch, kv_heads, MAX_SPLITS, group)
        self.parts = torch.empty((*shape, head_dim), dtype=torch.float32, device=device)
        self.stats = torch.empty((*shape, 2), dtype=torch.float32, device=device)
        self.counts = torch.zeros(batch * kv_heads, dtype=torch.int32, device=device)
        self.batch = batch


class GraphDecodeAttention:
    """A decode graph's attention (cuda_graphs.py): a step's new keys and values stored
    through a fixed slot buffer, then `paged_decode` over a page table in fixed buffers,
    which the graph's staging fills before each replay (no plan). Shares the cache of `base`
    (the runner's backend, whose eager steps it does not change)."""

    def __init__(
        self,
        base: FlashInferPagedAttention,
        slots: torch.Tensor,
        table: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        workspace: DecodeWorkspace,
    ) -> None:
        """`slots` ([batch] int64) and `table` (`paged_decode`'s indptr, indices, lengths:
        int32) are on the device, at addresses a graph keeps."""
        self.base, self.cache, self.slots = base, base.cache, slots
        self.table, self.workspace = table, workspace

    def attend(
        self, layer: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, rotary: torch.Tensor
    ) -> torch.Tensor:
        q, _, _ = self.cache.store(layer, self.slots, q, kv, rotary)
        base = self.base
        return paged_decode(
            q,
            self.cache.kv[int(layer)],
            *self.table,
            base.spec.scale,
            base.block_size,
            self.workspace,
        )


def paged_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    indptr: torch.Tensor,
    indices: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    page: int,
    workspace: DecodeWorkspace,
    grid_programs: int | None = None,
    tiling: Tiling = TILING,
) -> torch.Tensor:
    """Attention of each sequence's one query token over its context: q [batch, heads, dim]
    (contiguous), `cache` a layer's [slots, 2 (K, V), kv_heads, dim] (contiguous; slot = page
    * `page` + offset), sequence i's pages `indices[indptr[i]:indptr[i + 1]]` holding its
    `lengths[i]` tokens (int32, on the device). Returns [batch, heads, dim] in q's dtype.
    `grid_programs` overrides `programs` (tests: the grid must not change the output), and
    `tiling` the loop's (benches)."""
    batch, heads, dim = q.shape
    kv_heads = cache.shape[2]
    group = heads // kv_heads
    if batch > workspace.batch:
        raise ValueError(f"a decode of {batch} sequences in a workspace for {workspace.batch}")
    out = torch.empty_like(q)
    count = grid_programs or programs(batch, kv_heads, q.device)
    dependent = chained(q.device)
    _paged_decode_kernel[(batch, kv_heads, count)](
        q, cache, indptr, indices, lengths, out,
        workspace.parts, workspace.stats, workspace.counts, scale * math.log2(math.e),
        KV_HEADS=kv_heads, GROUP=group, ROWS=max(16, triton.next_power_of_2(group)),
        GROUP_ROWS=triton.next_power_of_2(group), DIM=dim, PAGE=page, BLOCK_N=tiling.block_n,
        CHUNK=CHUNK, MAX_SPLITS=MAX_SPLITS, DEPENDENT=dependent,
        num_warps=tiling.warps, num_stages=tiling.stages, launch_pdl=dependent,
    )  # fmt: skip
    return out


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, cache_ptr, indptr_ptr, indices_ptr, lengths_ptr, out_ptr,
        parts_ptr, stats_ptr, counts_ptr, scale_log2,
        KV_HEADS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr,
        GROUP_ROWS: tl.constexpr, DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
        CHUNK: tl.constexpr, MAX_SPLITS: tl.constexpr, DEPENDENT: tl.constexpr,
    ):  # fmt: skip
        """Program (sequence, KV head, p): the sequence's splits p, p + programs, ... for
        the GROUP query heads of that KV head; the last of its programs to finish merges
        the splits (when there are more than one). Scores in base 2 (scale_log2 folds
        log2(e) in), float32 throughout but the product with the values (bf16 weights, as
        FlashInfer's)."""
        seq = tl.program_id(0)
        head = tl.program_id(1)
        first = tl.program_id(2)
        step = tl.num_programs(2)
        if DEPENDENT:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        length = tl.load(lengths_ptr + seq)
        pages_at = indices_ptr + tl.load(indptr_ptr + seq)
        chunk = CHUNK * tl.cdiv(tl.cdiv(length, CHUNK), MAX_SPLITS)
        count = tl.cdiv(length, chunk)
        rows = tl.arange(0, ROWS)
        dims = tl.arange(0, DIM)
        row_ok = rows < GROUP
        heads_at = (seq * KV_HEADS * GROUP + head * GROUP + rows)[:, None] * DIM + dims[None, :]
        q = tl.load(q_ptr + heads_at, mask=row_ok[:, None], other=0.0)
        kept = ((seq * KV_HEADS + head) * MAX_SPLITS * GROUP + rows)[:, None]
        for split in range(first, count, step):
            low = split * chunk
            high = tl.minimum(low + chunk, length)
            top = tl.full((ROWS,), float("-inf"), tl.float32)
            total = tl.zeros((ROWS,), tl.float32)
            acc = tl.zeros((ROWS, DIM), tl.float32)
            for start in range(low, high, BLOCK_N):
                tokens = start + tl.arange(0, BLOCK_N)
                ok = tokens < high
                pages = tl.load(pages_at + tokens // PAGE, mask=ok, other=0).to(tl.int64)
                slots = pages * PAGE + tokens % PAGE
                k_at = cache_ptr + slots[:, None] * (2 * KV_HEADS * DIM) + head * DIM
                keys = tl.load(k_at + dims[None, :], mask=ok[:, None], other=0.0)
                values = tl.load(k_at + KV_HEADS * DIM + dims[None, :], mask=ok[:, None], other=0.0)
                scores = tl.dot(q, tl.trans(keys)) * scale_log2
                scores = tl.where(ok[None, :], scores, float("-inf"))
                new_top = tl.maximum(top, tl.max(scores, 1))
                weights = tl.exp2(scores - new_top[:, None])
                shrink = tl.exp2(top - new_top)
                total = total * shrink + tl.sum(weights, 1)
                acc = acc * shrink[:, None] + tl.dot(weights.to(values.dtype), values)
                top = new_top
            if count == 1:
                done = acc / total[:, None]
                tl.store(
                    out_ptr + heads_at, done.to(out_ptr.dtype.element_ty), mask=row_ok[:, None]
                )
            else:
                at = kept + split * GROUP
                tl.store(parts_ptr + at * DIM + dims[None, :], acc, mask=row_ok[:, None])
                tl.store(stats_ptr + at * 2, top[:, None], mask=row_ok[:, None])
                tl.store(stats_ptr + at * 2 + 1, total[:, None], mask=row_ok[:, None])
        if (count > 1) & (first < count):
            tl.debug_barrier()
            counter = counts_ptr + seq * KV_HEADS + head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == tl.minimum(step, count) - 1:
                base = (seq * KV_HEADS + head) * MAX_SPLITS * GROUP
                _merge(out_ptr + (seq * KV_HEADS + head) * GROUP * DIM, parts_ptr + base * DIM,
                       stats_ptr + base * 2, count, GROUP, GROUP_ROWS, DIM, MAX_SPLITS)  # fmt: skip
                tl.atomic_xchg(counter, 0)

    @triton.jit
    def _merge(
        out_ptr, parts_ptr, stats_ptr, count,
        GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr, DIM: tl.constexpr,
        MAX_SPLITS: tl.constexpr,
    ):  # fmt: skip
        """The splits' outputs weighted by exp2(their maximum - the greatest), over their
        sums so weighted: the softmax over the whole context. Every split is read at once
        (one load each of the maxima, the sums and the outputs, [MAX_SPLITS, GROUP, DIM]),
        the splits past `count` as zeros, and summed in one fixed order."""
        splits = tl.arange(0, MAX_SPLITS)[:, None]
        rows = tl.arange(0, GROUP_ROWS)[None, :]
        there = (splits < count) & (rows < GROUP)
        at = splits * GROUP + rows
        tops = tl.load(stats_ptr + at * 2, mask=there, other=float("-inf"), cache_modifier=".cg")
        sums = tl.load(stats_ptr + at * 2 + 1, mask=there, other=0.0, cache_modifier=".cg")
        top = tl.max(tops, 0)
        weights = tl.where(there, tl.exp2(tops - top[None, :]), 0.0)
        total = tl.sum(sums * weights, 0)
        dims = tl.arange(0, DIM)[None, None, :]
        parts = tl.load(
            parts_ptr + at[:, :, None] * DIM + dims, mask=there[:, :, None], other=0.0,
            cache_modifier=".cg",
        )  # fmt: skip
        merged = tl.sum(parts * weights[:, :, None], 0) / total[:, None]
        out_at = out_ptr + tl.arange(0, GROUP_ROWS)[:, None] * DIM + tl.arange(0, DIM)[None, :]
        row_ok = tl.arange(0, GROUP_ROWS)[:, None] < GROUP
        tl.store(out_at, merged.to(out_ptr.dtype.element_ty), mask=row_ok)


def build_kernels(spec: AttentionSpec, page: int, dtype: torch.dtype, device: torch.device) -> None:
    """Launch `paged_decode` once as a decode graph does, so Triton compiles it now, into its
    cache folder (which a package's compile phase packs), not at a start."""
    heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    cache = torch.zeros((2 * page, 2, kv_heads, dim), dtype=dtype, device=device)
    q = torch.zeros((1, heads, dim), dtype=dtype, device=device)
    workspace = DecodeWorkspace(1, kv_heads, heads // kv_heads, dim, device)
    indptr, pages, lengths = (
        torch.tensor(values, dtype=torch.int32, device=device)
        for values in ([0, 2], [0, 1], [page + 1])
    )  # each its own allocation: aligned, as a graph's are, which Triton's key records
    paged_decode(q, cache, indptr, pages, lengths, 1.0, page, workspace)
