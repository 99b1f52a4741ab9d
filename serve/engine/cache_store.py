"""A step's new keys and values into their KV-cache slots: one small kernel a layer on CUDA.

Written as `cache[slots] = kv`, the store is ATen's general index_put, 3.3-3.7 microseconds a
layer on an H200 in a 1B decode step (docs/performance.md), mostly its start and its
indexing for a copy of a few KB. `store_rows` is a Triton kernel of one program a token that
copies the token's row (keys and values side by side) to its slot, launched as a programmatic
dependent where the GPU has it: it lets the attention after it start at once (FlashInfer
waits for it to finish before it reads the cache). Elsewhere, the index_put.
"""

from __future__ import annotations

import torch

from flare.serve.engine.dependent_launch import dependent_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU build of torch ships without Triton
    triton = None


def store_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """cache[slots[t]] = rows[t] for every token t; cache [slots, ...] with rows [tokens, ...]
    of the same trailing shape, both contiguous."""
    if triton is None or not cache.is_cuda or rows.shape[0] == 0:
        cache[slots] = rows
        return
    width = rows[0].numel()
    pdl = dependent_launch(cache.device)
    _store_rows_kernel[(rows.shape[0],)](
        cache, slots, rows.contiguous(), width,
        BLOCK=triton.next_power_of_2(width), PDL=pdl, num_warps=4,
        **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip


if triton is not None:

    @triton.jit
    def _store_rows_kernel(
        cache_ptr, slots_ptr, rows_ptr, width, BLOCK: tl.constexpr, PDL: tl.constexpr
    ):
        """Program t copies row t (`width` elements) to row slots[t] of the cache."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        token = tl.program_id(0)
        slot = tl.load(slots_ptr + token).to(tl.int64)
        at = tl.arange(0, BLOCK)
        mask = at < width
        row = tl.load(rows_ptr + token.to(tl.int64) * width + at, mask=mask)
        tl.store(cache_ptr + slot * width + at, row, mask=mask)
