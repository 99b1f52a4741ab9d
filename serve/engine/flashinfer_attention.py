"""Attention by FlashInfer's paged kernels, on CUDA, over the same KV cache layout.

The cache is the reference backend's: per layer, K and V are [slots, kv_heads, head_dim] with
slot = block * block_size + offset (strided views of one tensor that holds a slot's key and
value side by side), which is FlashInfer's "NHD" paged layout [pages, page_size, kv_heads,
head_dim] seen as a view (its kernels take a cache's strides), so new keys and values are
written the same way. A step is planned once (FlashInfer's `plan`: page tables and the
kernels' work split) and each layer's `run` then attends all sequences in one kernel. A step
of single-token queries (a decode step) uses the decode kernel; any other uses the prefill
kernel, causal, whose queries sit at the end of their sequence's context, which is what a
prefill after a cached prefix is.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from flare.serve.engine.attention import AttentionMetadata, AttentionSpec, PagedKVCache
from flare.serve.engine.device_io import settle

WORKSPACE_BYTES = 128 << 20
"""FlashInfer's scratch space for split-KV partial results; its documented recommendation."""
TENSOR_CORE_GROUP = 4
"""Query heads per KV head from which the decode kernel runs on tensor cores (as FlashInfer
advises for grouped-query attention)."""


class FlashInferPagedAttention:
    """The CUDA backend: FlashInfer batch prefill and decode over the paged cache."""

    workspace_bytes = WORKSPACE_BYTES
    """One buffer, shared by the prefill and decode wrappers."""

    def __init__(
        self,
        spec: AttentionSpec,
        num_slots: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        tensor_cores: bool | None = None,
    ) -> None:
        """`tensor_cores`: run the decode kernel on tensor cores (tuning measures which is
        faster); None takes FlashInfer's advice, from TENSOR_CORE_GROUP query heads per KV
        head."""
        import flashinfer

        self.cache = PagedKVCache(spec, num_slots, dtype, device)
        self.pages = (num_slots // block_size, block_size, spec.num_kv_heads, spec.head_dim)
        self.spec, self.dtype, self.block_size = spec, dtype, block_size
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.tensor_cores = (
            tensor_cores
            if tensor_cores is not None
            else spec.num_heads // spec.num_kv_heads >= TENSOR_CORE_GROUP
        )
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.tensor_cores
        )
        self._meta: AttentionMetadata | None = None
        self._wrapper: Any = None
        self._planned: torch.cuda.Event | None = None
        """Recorded after the last plan's copies to the device."""

    def plan(self, meta: AttentionMetadata) -> None:
        """The step's page table (each sequence's blocks up to its context), built from the
        host copies (FlashInfer plans on the host: device tensors would be copied back, a
        sync per step), then the kernel plan of the decode or the prefill wrapper.

        A plan writes the wrapper's pinned buffer and copies it to the device without
        waiting; the engine plans a step while the step before may not have started, so a
        plan first waits for the last plan's copies to have run."""
        settle(self._planned)
        self._meta = meta
        pages, indices, last = page_table(
            meta.context_lens_cpu, meta.block_tables_cpu, self.block_size
        )
        kv = (_offsets(pages), _int32(indices), _int32(last))
        if all(n == 1 for n in meta.query_lens_cpu):
            self._wrapper = self._decode
            self._decode.plan(*kv, *self.plan_shape(), **self.plan_kinds())
        else:
            self._wrapper = self._prefill
            qo_indptr = _offsets(meta.query_lens_cpu)
            self._prefill.plan(qo_indptr, *kv, *self.plan_shape(), causal=True, **self.plan_kinds())
        self._planned = torch.cuda.Event()
        self._planned.record()

    def plan_shape(self) -> tuple[int, int, int, int]:
        """Query heads, KV heads, head size, page size: what every plan takes."""
        spec = self.spec
        return spec.num_heads, spec.num_kv_heads, spec.head_dim, self.block_size

    def plan_kinds(self) -> dict[str, Any]:
        return {"q_data_type": self.dtype, "kv_data_type": self.dtype, "sm_scale": self.spec.scale}

    def attend(
        self, layer: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, rotary: torch.Tensor
    ) -> torch.Tensor:
        assert self._meta is not None, "plan() must run before attend()"
        q, k_cache, v_cache = self.cache.store(layer, self._meta.slot_mapping, q, kv, rotary)
        pages = (k_cache.view(self.pages), v_cache.view(self.pages))
        if self._wrapper is self._prefill:  # unasked, its output is zero-filled first
            return self._prefill.run(q, pages, out=q.new_empty(q.shape))
        return self._wrapper.run(q, pages)


class FlashInferGraphPrefill:
    """Prefill steps of a fixed number of sequences, as a CUDA graph captures them
    (prefill_graphs.py): FlashInfer's prefill wrapper in its CUDA-graph mode, whose page table
    lives in buffers of fixed size and address that `plan` refills on the host before each
    replay, and whose work split is made for the most query rows it is first planned with (a
    fixed grid; the rows a step has are read from the buffers), and new keys and values stored
    through a fixed slot buffer the caller fills. Shares the cache and the workspace of
    `base` (one step runs at a time)."""

    workspace_bytes = 0

    def __init__(
        self,
        base: FlashInferPagedAttention,
        sequences: int,
        slots: torch.Tensor,
        indices: torch.Tensor,
    ) -> None:
        """`slots` ([rows] int64, its first rows a step's) and `indices` (int32, room for
        every page a step may name) are on the device."""
        import flashinfer

        self.base, self.cache, self.slots = base, base.cache, slots
        device = slots.device

        def table(length: int) -> torch.Tensor:
            return torch.zeros(length, dtype=torch.int32, device=device)

        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            base.workspace,
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=table(sequences + 1),
            paged_kv_indptr_buf=table(sequences + 1),
            paged_kv_indices_buf=indices,
            paged_kv_last_page_len_buf=table(sequences),
        )

    def plan_pages(
        self,
        qo_indptr: torch.Tensor,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last: torch.Tensor,
        lengths: torch.Tensor,
    ) -> None:
        """The step's query offsets and page table: all on the host (pinned) but `indices`,
        already on the device, so nothing here waits for the GPU."""
        base = self.base
        self._prefill.plan(
            qo_indptr,
            indptr,
            indices,
            last,
            *base.plan_shape(),
            causal=True,
            **base.plan_kinds(),
            seq_lens=lengths,
        )

    def attend(
        self, layer: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, rotary: torch.Tensor
    ) -> torch.Tensor:
        slots = self.slots[: len(q)]
        q, k_cache, v_cache = self.cache.store(layer, slots, q, kv, rotary)
        pages = (k_cache.view(self.base.pages), v_cache.view(self.base.pages))
        return self._prefill.run(q, pages, out=q.new_empty(q.shape))


def page_table(
    context_lens: list[int], tables: list[list[int]], block_size: int
) -> tuple[list[int], list[int], list[int]]:
    """FlashInfer's view of a batch's KV: pages per sequence (its blocks up to its context),
    those pages one after another, and how full each sequence's last page is."""
    pages, last = page_counts(context_lens, block_size)
    indices = [block for table, n in zip(tables, pages, strict=True) for block in table[:n]]
    return pages, indices, last


def page_counts(context_lens: list[int], block_size: int) -> tuple[list[int], list[int]]:
    """Each sequence's pages (its blocks up to its context) and how full its last one is."""
    last = [(ctx - 1) % block_size + 1 for ctx in context_lens]
    return pages_of(context_lens, block_size), last


def pages_of(context_lens: list[int], block_size: int) -> list[int]:
    """Each sequence's pages: its blocks up to its context (what a step that needs no last
    page lengths asks, once a step)."""
    return [-(-ctx // block_size) for ctx in context_lens]


def _offsets(counts: list[int]) -> torch.Tensor:
    """Where each of the counted runs starts, and the end: FlashInfer's indptr arrays."""
    return _int32([0, *itertools.accumulate(counts)])


def _int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)
