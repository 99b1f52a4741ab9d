"""The KV store: `rotate_and_store` rotates a step's queries and keys as transformers does and
puts each token's keys and values in its slot, touching no other slot (its own kernel on CUDA,
torch's ops and an index_put elsewhere).

The kernel's tests run on CUDA, or on a CPU through Triton's interpreter where Triton is
installed and TRITON_INTERPRET=1 is set (`TRITON_INTERPRET=1 pytest tests/test_cache_store.py`).
"""

from __future__ import annotations

import pytest
import torch
from kernel_env import DEVICE, DTYPE, needs_kernel

from flare.serve.engine.cache_store import apply_rotary, rotate_and_store, rotate_and_store_rows


def _step(
    tokens: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A cache of 64 random slots, and a step's q/k/v product output seen as the model hands
    it over (queries, and keys beside values, as column ranges of one tensor), with rotary
    rows of real positions."""
    generator = torch.Generator().manual_seed(seed)
    cache = torch.randn(64, 2, kv_heads, dim, generator=generator).to(DEVICE, dtype)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=generator).to(DEVICE, dtype)
    q, kv = qkv.split((heads, 2 * kv_heads), dim=1)
    angles = torch.randint(0, 4096, (tokens, 1), generator=generator) * 1e-4 ** (
        torch.arange(dim // 2) / (dim // 2)
    )
    angles = torch.cat((angles, angles), dim=-1)
    rotary = torch.stack((angles.cos(), angles.sin()), dim=1).to(DEVICE, dtype)
    return cache, q, kv.unflatten(1, (2, kv_heads)), rotary


def _want(
    cache: torch.Tensor,
    slots: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    rotary: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What transformers' rotary and `cache[slots] = rows` make, op by op."""
    want = cache.clone()
    want[slots, 0] = apply_rotary(kv[:, 0], rotary)
    want[slots, 1] = kv[:, 1]
    return apply_rotary(q, rotary), want


def test_rotary_is_transformers_rotate_half_in_the_model_dtype() -> None:
    """x cos + rotate_half(x) sin, with rotate_half(x) = (-x2, x1): a quarter turn of each
    pair (i, i + dim/2) at angle 0 leaves x, at a right angle gives rotate_half(x)."""
    x = torch.arange(1.0, 9.0).reshape(1, 1, 8)
    straight = torch.stack((torch.ones(8), torch.zeros(8)))[None]
    turned = torch.stack((torch.zeros(8), torch.ones(8)))[None]
    assert torch.equal(apply_rotary(x, straight), x)
    assert apply_rotary(x, turned).flatten().tolist() == [-5, -6, -7, -8, 1, 2, 3, 4]


def test_each_token_lands_rotated_in_its_slot_and_nothing_else_changes() -> None:
    cache, q, kv, rotary = _step(5, 8, 2, 64, torch.float32, seed=0)
    slots = torch.tensor([7, 0, 63, 20, 21], device=DEVICE)
    want_q, want = _want(cache, slots, q, kv, rotary)
    got_q = rotate_and_store(cache, slots, q, kv, rotary)
    assert torch.equal(got_q, want_q) and got_q.is_contiguous()
    assert torch.equal(cache, want)
    empty = rotate_and_store(cache, slots[:0], q[:0], kv[:0], rotary[:0])
    assert empty.shape == (0, 8, 64) and torch.equal(cache, want)  # an empty step stores nothing


@needs_kernel
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "dim"),
    [(1, 32, 8, 64), (3, 32, 8, 128), (17, 12, 2, 64), (2, 6, 6, 32), (4, 14, 2, 80)],
    ids=["1b-decode", "8b", "qwen-like", "no-grouping", "dim-80"],
)
@pytest.mark.parametrize("dtype", [DTYPE, torch.float32], ids=str)
def test_the_kernel_rounds_as_torch_eager_ops_do_bit_for_bit(
    tokens: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype
) -> None:
    """The kernel's queries, keys and values equal transformers' op-by-op rotary and the
    index_put, bit for bit, in the model's dtype (no product fused into a sum: in float32
    that would round once where torch rounds twice); slots not stepped keep their bits."""
    cache, q, kv, rotary = _step(tokens, heads, kv_heads, dim, dtype, seed=tokens)
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(dim))[:tokens].to(DEVICE)
    want_q, want = _want(cache, slots, q, kv, rotary)
    got_q = rotate_and_store_rows(cache, slots, q, kv, rotary)
    assert got_q.dtype == dtype and got_q.shape == (tokens, heads, dim)
    assert torch.equal(got_q, want_q)
    assert torch.equal(cache, want)
