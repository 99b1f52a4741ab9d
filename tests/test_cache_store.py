"""The KV store: `store_rows` puts each token's keys and values in its slot and touches no
other slot, as `cache[slots] = rows` does (its own kernel on CUDA, the index_put elsewhere)."""

from __future__ import annotations

import torch

from flare.serve.engine.cache_store import store_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_each_row_lands_in_its_slot_and_nothing_else_changes() -> None:
    generator = torch.Generator().manual_seed(0)
    cache = torch.randn(64, 2, 8, 64, generator=generator).to(DEVICE, torch.float16)
    rows = torch.randn(5, 2, 8, 64, generator=generator).to(DEVICE, torch.float16)
    slots = torch.tensor([7, 0, 63, 20, 21], device=DEVICE)
    want = cache.clone()
    want[slots] = rows
    store_rows(cache, slots, rows)
    assert torch.equal(cache, want)
    store_rows(cache, slots[:0], rows[:0])  # an empty step stores nothing
    assert torch.equal(cache, want)


def test_rows_read_where_they_lie_in_a_wider_tensor() -> None:
    """The model's keys and values are a column range of one wider tensor (q, k, v side by
    side): each token's row is contiguous, the rows are not."""
    generator = torch.Generator().manual_seed(1)
    cache = torch.zeros(32, 2, 4, 16, dtype=torch.float16, device=DEVICE)
    qkv = torch.randn(3, 12, 16, generator=generator).to(DEVICE, torch.float16)
    rows = qkv[:, 4:].unflatten(1, (2, 4))
    slots = torch.tensor([31, 2, 9], device=DEVICE)
    want = cache.clone()
    want[slots] = rows
    store_rows(cache, slots, rows)
    assert torch.equal(cache, want)
