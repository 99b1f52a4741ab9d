"""Attention by FlashInfer's paged kernels, on CUDA, over the same KV cache layout.

The cache is the reference backend's: per layer, [slots, kv_heads, head_dim] with slot =
block * block_size + offset, which is FlashInfer's "NHD" paged layout [pages, page_size,
kv_heads, head_dim] seen as a view, so new keys and values are written the same way. A step
is planned once (FlashInfer's `plan`: page tables and the kernels' work split) and each
layer's `run` then attends all sequences in one kernel. A step of single-token queries (a
decode step) uses the decode kernel; any other uses the prefill kernel, causal, whose queries
sit at the end of their sequence's context, which is what a prefill after a cached prefix is.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from flare.serve.engine.attention import AttentionMetadata, AttentionSpec, PagedKVCache

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
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace,
            "NHD",
            use_tensor_cores=tensor_cores
            if tensor_cores is not None
            else spec.num_heads // spec.num_kv_heads >= TENSOR_CORE_GROUP,
        )
        self._meta: AttentionMetadata | None = None
        self._wrapper: Any = None

    def plan(self, meta: AttentionMetadata) -> None:
        """The step's page table (each sequence's blocks up to its context), built from the
        host copies (FlashInfer plans on the host: device tensors would be copied back, a
        sync per step), then the kernel plan of the decode or the prefill wrapper."""
        self._meta = meta
        pages_per_seq = [-(-ctx // self.block_size) for ctx in meta.context_lens_cpu]
        tables = zip(meta.block_tables_cpu, pages_per_seq, strict=True)
        indices = [block for table, n in tables for block in table[:n]]
        last = [(ctx - 1) % self.block_size + 1 for ctx in meta.context_lens_cpu]
        kv = (_offsets(pages_per_seq), _int32(indices), _int32(last))
        spec = self.spec
        shape = (spec.num_heads, spec.num_kv_heads, spec.head_dim, self.block_size)
        kinds = {"q_data_type": self.dtype, "kv_data_type": self.dtype, "sm_scale": spec.scale}
        if all(n == 1 for n in meta.query_lens_cpu):
            self._wrapper = self._decode
            self._decode.plan(*kv, *shape, **kinds)
        else:
            self._wrapper = self._prefill
            qo_indptr = _offsets(meta.query_lens_cpu)
            self._prefill.plan(qo_indptr, *kv, *shape, causal=True, **kinds)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        assert self._meta is not None, "plan() must run before attend()"
        k_cache, v_cache = self.cache.store(layer, self._meta.slot_mapping, k, v)
        return self._wrapper.run(q, (k_cache.view(self.pages), v_cache.view(self.pages)))


def _offsets(counts: list[int]) -> torch.Tensor:
    """Where each of the counted runs starts, and the end: FlashInfer's indptr arrays."""
    return _int32([0, *itertools.accumulate(counts)])


def _int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)
