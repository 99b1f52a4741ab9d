"""flare's decode attention (`paged_decode`): each sequence's query against its own pages, as
softmax attention in float32 gives it, whatever the batch beside it or the grid.

The kernel's tests run on CUDA, or on a CPU through Triton's interpreter where Triton is
installed and TRITON_INTERPRET=1 is set
(`TRITON_INTERPRET=1 pytest tests/test_decode_attention.py`).
"""

from __future__ import annotations

import pytest
import torch
from kernel_env import DEVICE, DTYPE, needs_kernel

from flare.serve.engine.decode_attention import (
    CHUNK,
    MAX_SPLITS,
    DecodeWorkspace,
    paged_decode,
    programs,
)

PAGE = 16


def _batch(
    lengths: list[int], heads: int, kv_heads: int, dim: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, a cache whose pages are handed out shuffled (a sequence's pages are not
    adjacent, as a long-running server's are not), FlashInfer's page offsets and the pages."""
    generator = torch.Generator().manual_seed(seed)
    counts = [-(-n // PAGE) for n in lengths]
    total = sum(counts) + 3  # pages no sequence holds, whose contents must not matter
    order = torch.randperm(total, generator=generator)
    cache = torch.randn(total * PAGE, 2, kv_heads, dim, generator=generator)
    q = torch.randn(len(lengths), heads, dim, generator=generator)
    indptr = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    pages = order[: sum(counts)].to(torch.int32)
    return q, cache, indptr, pages, torch.tensor(lengths, dtype=torch.int32)


def _reference(
    q: torch.Tensor, cache: torch.Tensor, indptr: torch.Tensor, pages: torch.Tensor, lengths
) -> torch.Tensor:
    """Softmax attention in float32, a sequence at a time, its keys gathered page by page."""
    heads, kv_heads, dim = q.shape[1], cache.shape[2], q.shape[2]
    out = []
    for i, length in enumerate(lengths.tolist()):
        own = pages[int(indptr[i]) : int(indptr[i + 1])].long()
        slots = (own[:, None] * PAGE + torch.arange(PAGE)).flatten()[:length]
        k, v = (cache[slots, j].float().repeat_interleave(heads // kv_heads, 1) for j in (0, 1))
        scores = torch.einsum("hd,thd->ht", q[i].float(), k) * dim**-0.5
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v))
    return torch.stack(out)


def _run(q, cache, indptr, pages, lengths, grid_programs=None) -> torch.Tensor:
    batch, heads, dim = q.shape
    kv_heads = cache.shape[2]
    workspace = DecodeWorkspace(batch, kv_heads, heads // kv_heads, dim, torch.device(DEVICE))
    out = paged_decode(
        q.to(DEVICE, DTYPE),
        cache.to(DEVICE, DTYPE),
        indptr.to(DEVICE),
        pages.to(DEVICE),
        lengths.to(DEVICE),
        dim**-0.5,
        PAGE,
        workspace,
        grid_programs,
    )
    assert not workspace.counts.any(), "a merge left its counter set: the next launch breaks"
    return out.float().cpu()


def test_programs_fill_the_device_and_stop_at_the_splits() -> None:
    device = torch.device("cpu")
    assert programs(1, 8, device) <= MAX_SPLITS
    assert programs(64, 8, device) == 1
    counts = [programs(batch, 8, device) for batch in (1, 2, 4, 8, 16, 32, 64)]
    assert counts == sorted(counts, reverse=True)


@needs_kernel
@pytest.mark.parametrize(
    ("lengths", "heads", "kv_heads", "dim"),
    [
        ([1, 5, 17, 64], 4, 1, 64),  # one split each, a partial last page, one token
        ([300, 40, 1000], 8, 2, 64),  # several splits, merged; short beside long
        ([CHUNK * MAX_SPLITS + 50], 4, 2, 32),  # the longest splits' case
        ([33, 257], 6, 3, 128),  # GROUP of 2, padded to the product's 16 rows
    ],
)
def test_paged_decode_is_softmax_attention_over_each_sequences_pages(
    lengths: list[int], heads: int, kv_heads: int, dim: int
) -> None:
    q, cache, indptr, pages, lens = _batch(lengths, heads, kv_heads, dim, seed=len(lengths))
    got = _run(q, cache, indptr, pages, lens)
    want = _reference(q.to(DTYPE), cache.to(DTYPE), indptr, pages, lens)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 2e-2


@needs_kernel
def test_a_sequence_gets_the_same_bits_alone_in_any_batch_and_grid() -> None:
    """Batch-invariant decoding: a sequence's output does not depend on the sequences
    beside it nor on how many programs the grid gives each."""
    lengths = [700, 12, 260, 1500]
    q, cache, indptr, pages, lens = _batch(lengths, 8, 2, 64, seed=7)
    together = _run(q, cache, indptr, pages, lens)
    for grid in (1, 3, 8):
        assert torch.equal(_run(q, cache, indptr, pages, lens, grid), together)
    for i in range(len(lengths)):
        own = pages[int(indptr[i]) : int(indptr[i + 1])]
        alone_indptr = torch.tensor([0, len(own)], dtype=torch.int32)
        alone = _run(q[i : i + 1], cache, alone_indptr, own, lens[i : i + 1])
        assert torch.equal(alone[0], together[i])


@needs_kernel
def test_the_workspace_serves_launch_after_launch() -> None:
    """The counters a merge takes are back at zero: a second launch (the next layer, the
    next replay) on the same workspace merges right."""
    q, cache, indptr, pages, lens = _batch([900, 600], 4, 1, 64, seed=3)
    workspace = DecodeWorkspace(2, 1, 4, 64, torch.device(DEVICE))
    args = (cache.to(DEVICE, DTYPE), indptr.to(DEVICE), pages.to(DEVICE), lens.to(DEVICE))
    first = paged_decode(q.to(DEVICE, DTYPE), *args, 64**-0.5, PAGE, workspace)
    second = paged_decode(q.to(DEVICE, DTYPE), *args, 64**-0.5, PAGE, workspace)
    assert torch.equal(first, second)
    assert not workspace.counts.any()


def test_a_batch_larger_than_the_workspace_is_refused() -> None:
    workspace = DecodeWorkspace(1, 1, 1, 8, torch.device("cpu"))
    q = torch.zeros(2, 1, 8)
    with pytest.raises(ValueError, match="2 sequences in a workspace for 1"):
        paged_decode(q, torch.zeros(16, 2, 1, 8), *[torch.zeros(1)] * 3, 1.0, PAGE, workspace)
