"""A step's new keys and values into their KV-cache slots: one small kernel a layer on CUDA.

Written as `cache[slots] = kv`, the store is ATen's general index_put, 3.3-3.7 microseconds a
layer on an H200 in a 1B decode step (docs/performance.md), mostly its start and its
indexing for a copy of a few KB. `store_rows` is a Triton kernel of one program a token that
copies the token's row (keys and values side by side) to its slot. Elsewhere, the index_put.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU build of torch ships without Triton
    triton = None


def store_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """cache[slots[t]] = rows[t] for every token t: cache [slots, ...] contiguous, rows
    [tokens, ...] of the same trailing shape, each row contiguous (a view of a wider tensor's
    columns, as the model's keys and values are, is read where it lies)."""
    if triton is None or not cache.is_cuda or rows.shape[0] == 0:
        cache[slots] = rows
        return
    if not rows[0].is_contiguous():
        rows = rows.contiguous()
    width = rows[0].numel()
    _store_rows_kernel[(rows.shape[0],)](
        cache, slots, rows, width, rows.stride(0),
        BLOCK=triton.next_power_of_2(width), num_warps=4,
    )  # fmt: skip


if triton is not None:

    @triton.jit
    def _store_rows_kernel(cache_ptr, slots_ptr, rows_ptr, width, stride, BLOCK: tl.constexpr):
        """Program t copies row t (`width` elements, rows `stride` apart) to row slots[t] of
        the cache."""
        token = tl.program_id(0)
        slot = tl.load(slots_ptr + token).to(tl.int64)
        at = tl.arange(0, BLOCK)
        mask = at < width
        row = tl.load(rows_ptr + token.to(tl.int64) * stride + at, mask=mask)
        tl.store(cache_ptr + slot * width + at, row, mask=mask)
