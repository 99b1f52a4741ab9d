"""Attention over the paged KV cache, behind a small interface a faster kernel can replace.

A step's batch is described by flat tensors (`AttentionMetadata`), as FlashInfer and
FlashAttention's varlen kernels take it: queries of all sequences concatenated, each
sequence's KV found through its block table. A backend is planned once per step and then
called once per layer; the torch reference here gathers each sequence's keys and values from
the cache and runs `scaled_dot_product_attention` on them. On CUDA, FlashInfer's kernels
(flashinfer_attention.py) do the same in one call per layer; attention_choice.py chooses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from flare.serve.engine.cache_store import rotate_and_store


@dataclass(frozen=True)
class AttentionSpec:
    """What a model needs of the KV cache: one K and one V tensor per layer of this shape (and
    its query heads, which a kernel plan needs)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's batch as flat tensors on the model's device.

    `query_start_loc[i]:query_start_loc[i+1]` are sequence i's new tokens (its last
    `query_lens[i]` positions); `context_lens[i]` counts all its tokens including them;
    `slot_mapping[t]` is where token t's KV goes (block * block_size + offset);
    `block_tables[i]` lists sequence i's blocks, padded with -1. The `_cpu` lists are the same
    values on the host (the tables unpadded), for planning without a device round trip.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    block_size: int
    query_lens_cpu: list[int]
    context_lens_cpu: list[int]
    block_tables_cpu: list[list[int]]


class PagedKVCache:
    """Every layer's keys and values in one tensor, [layers, slots, 2, kv_heads, head_dim],
    slot = block * block_size + offset: a step's new keys are rotated and stored with its
    values in one pass a layer, which also rotates its queries (cache_store.py), and each
    layer's K and V are strided views, [slots, kv_heads, head_dim], the layout both backends
    read (FlashInfer's "NHD" pages as a view; its kernels take the strides)."""

    def __init__(
        self, spec: AttentionSpec, num_slots: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (spec.num_layers, num_slots, 2, spec.num_kv_heads, spec.head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        """What the cache holds on its device, keys and values."""
        return self.kv.nbytes

    @property
    def device(self) -> torch.device:
        return self.kv.device

    def store(
        self,
        layer: torch.Tensor,
        slots: torch.Tensor,
        q: torch.Tensor,
        kv: torch.Tensor,
        rotary: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotate a step's queries and new keys, write its keys and values into `layer`'s
        slots (`q`, `kv` and `rotary` as `AttentionBackend.attend` takes them): the rotated
        queries, and the layer's whole K and V."""
        cache = self.kv[int(layer)]
        q = rotate_and_store(cache, slots, q, kv, rotary)
        return q, cache[:, 0], cache[:, 1]


class AttentionBackend(Protocol):
    """What model code calls; owns the KV cache."""

    cache: PagedKVCache
    workspace_bytes: int
    """Scratch the backend allocated at start beside the cache (the memory plan shows it)."""

    def plan(self, meta: AttentionMetadata) -> None:
        """Prepare for one step (index tensors, kernel plans); called before the forward."""

    def attend(
        self, layer: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, rotary: torch.Tensor
    ) -> torch.Tensor:
        """For the layer whose index `layer` holds (a 0-d int64 tensor on the CPU, as model
        code keeps it: a compiled layer's graph takes it as an input, so one graph serves
        every layer): rotate the queries (`q`: [tokens, heads, dim]) and the new keys by their
        positions' `rotary` rows ([tokens, 2 (cos, sin), dim]), store the keys and values
        (`kv`: [tokens, 2, kv_heads, dim], keys first) in the cache, and attend the queries
        over each sequence's cached context, causally; return [tokens, heads, dim],
        contiguous."""


class TorchPagedAttention:
    """The reference backend: plain torch on any device, one SDPA call per sequence."""

    workspace_bytes = 0
    """None at start: each step's gathers and masks are allocated as it runs."""

    def __init__(
        self, spec: AttentionSpec, num_slots: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.cache = PagedKVCache(spec, num_slots, dtype, device)
        self.scale = spec.scale
        self._meta: AttentionMetadata | None = None
        self._gathers: list[tuple[int, int, torch.Tensor, torch.Tensor | None]] = []

    def plan(self, meta: AttentionMetadata) -> None:
        """Per sequence: its query range, the cache slots of its context, its causal mask."""
        self._meta = meta
        self._gathers = []
        starts = meta.query_start_loc.tolist()
        for i, (q_len, ctx) in enumerate(
            zip(meta.query_lens_cpu, meta.context_lens_cpu, strict=True)
        ):
            slots = self._context_slots(meta, i, ctx)
            mask = _causal_mask(q_len, ctx, slots.device) if q_len > 1 else None
            self._gathers.append((starts[i], starts[i + 1], slots, mask))

    @staticmethod
    def _context_slots(meta: AttentionMetadata, i: int, ctx: int) -> torch.Tensor:
        blocks = meta.block_tables[i, : -(-ctx // meta.block_size)]
        offsets = torch.arange(meta.block_size, device=blocks.device)
        return (blocks[:, None] * meta.block_size + offsets).flatten()[:ctx]

    def attend(
        self, layer: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, rotary: torch.Tensor
    ) -> torch.Tensor:
        assert self._meta is not None, "plan() must run before attend()"
        q, k_cache, v_cache = self.cache.store(layer, self._meta.slot_mapping, q, kv, rotary)
        out = q.new_empty(q.shape)
        for start, end, slots, mask in self._gathers:
            out[start:end] = self._one(q[start:end], k_cache[slots], v_cache[slots], mask)
        return out

    def _one(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """[q_len, heads, dim] over [ctx, kv_heads, dim], grouped-query, causal by `mask`."""
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return out.transpose(0, 1)


def _causal_mask(q_len: int, ctx: int, device: torch.device) -> torch.Tensor:
    """Query j sits at position ctx - q_len + j and sees keys up to and including it."""
    rows = torch.arange(q_len, device=device)[:, None] + (ctx - q_len)
    return torch.arange(ctx, device=device)[None, :] <= rows
