"""A step's queries and new keys rotated, and its keys and values stored in their KV-cache
slots: one small kernel a layer on CUDA.

Written in torch, rotary position embedding is a pointwise pass over the queries and keys
(which a compiled forward made one kernel: 1.1 to 1.7 microseconds a layer on an H200 in a 1B
decode step), and the store is a scatter of its own (ATen's general index_put took 3.3-3.7
microseconds, mostly its start and its indexing for a copy of a few KB; docs/performance.md).
`rotate_and_store_rows` is a Triton kernel of one program a token that does both: it reads the
token's queries, keys and values where the q/k/v product left them, writes the rotated
queries, and writes the rotated keys and the values side by side to the token's slot. Its
arithmetic rounds as torch's eager ops on the model's dtype do (each product rounded, then
their sum), so its rotary is transformers' bit for bit. Elsewhere, those torch ops and an
index_put.
"""

from __future__ import annotations

import torch

from flare.serve.engine.dependent_launch import chained

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU build of torch ships without Triton
    triton = None


def rotate_and_store(
    cache: torch.Tensor,
    slots: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    rotary: torch.Tensor,
) -> torch.Tensor:
    """The queries rotated ([tokens, heads, dim], contiguous), and cache[slots[t]] = (token
    t's keys rotated, its values) for every token t.

    q: [tokens, heads, dim]; kv: [tokens, 2, kv_heads, dim], keys first (each token's row of
    either contiguous; the rows may lie in a wider tensor, as the q/k/v product's columns do);
    rotary: [tokens, 2 (cos, sin), dim], the half-split layout of Hugging Face checkpoints;
    cache: [slots, 2, kv_heads, dim], contiguous."""
    if triton is None or not cache.is_cuda or q.shape[0] == 0:
        cache[slots] = torch.stack((apply_rotary(kv[:, 0], rotary), kv[:, 1]), dim=1)
        return apply_rotary(q, rotary).contiguous()
    return rotate_and_store_rows(cache, slots, q, kv, rotary)


def apply_rotary(x: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, dim]; rotary: [tokens, 2 (cos, sin), dim], in x's dtype as
    transformers casts them (a bf16 model keeps bf16 queries and keys)."""
    cos, sin = rotary[:, 0].to(x.dtype), rotary[:, 1].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rotate_and_store_rows(
    cache: torch.Tensor,
    slots: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    rotary: torch.Tensor,
) -> torch.Tensor:
    """`rotate_and_store` by the Triton kernel (on CUDA, or on a CPU under Triton's
    interpreter)."""
    tokens, heads, dim = q.shape
    kv_heads = kv.shape[2]
    if not q[0].is_contiguous():
        q = q.contiguous()
    if not kv[0].is_contiguous():
        kv = kv.contiguous()
    rotary = rotary.to(q.dtype).contiguous()
    out = q.new_empty(tokens, heads, dim)
    dependent = chained(q.device)
    _rotate_store_kernel[(tokens,)](
        out, cache, slots, q, kv, rotary, q.stride(0), kv.stride(0),
        HEADS=heads, KV_HEADS=kv_heads, DIM=dim,
        BLOCK_Q=triton.next_power_of_2(heads),
        BLOCK_KV=triton.next_power_of_2(kv_heads),
        BLOCK_D=triton.next_power_of_2(dim),
        DEPENDENT=dependent, num_warps=4, launch_pdl=dependent,
        enable_fp_fusion=False,  # each product rounded on its own, as torch's
    )  # fmt: skip
    return out


if triton is not None:

    @triton.jit
    def _rotated(
        row, cos, sin, d, partner, sign, HEADS: tl.constexpr, DIM: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        """HEADS heads of DIM from `row`, rotated: x cos + rotate_half(x) sin, each product
        rounded to the model's dtype, then their sum (torch's eager rounding); the heads as
        [BLOCK, BLOCK_D] and the mask of those that exist."""
        h = tl.arange(0, BLOCK)[:, None]
        there = (h < HEADS) & (d < DIM)[None, :]
        x = tl.load(row + h * DIM + d[None, :], mask=there)
        other = tl.load(row + h * DIM + partner[None, :], mask=there)
        straight = (x.to(tl.float32) * cos[None, :]).to(x.dtype)
        turned = (other.to(tl.float32) * sin[None, :]).to(x.dtype)
        rotated = straight.to(tl.float32) + sign[None, :] * turned.to(tl.float32)
        return rotated.to(x.dtype), h, there

    @triton.jit
    def _rotate_store_kernel(
        out_ptr, cache_ptr, slots_ptr, q_ptr, kv_ptr, rotary_ptr, q_stride, kv_stride,
        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr,
        DEPENDENT: tl.constexpr,
    ):  # fmt: skip
        """Program t: token t's queries rotated to row t of out; its keys rotated and its
        values copied to row slots[t] of the cache. Launched as a dependent, it waits for the
        kernel ahead, then lets the next kernel launch."""
        if DEPENDENT:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots_ptr + token).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        half = DIM // 2
        partner = tl.where(d < half, d + half, d - half)
        sign = tl.where(d < half, -1.0, 1.0)
        cos = tl.load(rotary_ptr + token * 2 * DIM + d, mask=d < DIM).to(tl.float32)
        sin = tl.load(rotary_ptr + token * 2 * DIM + DIM + d, mask=d < DIM).to(tl.float32)
        queries, h, there = _rotated(
            q_ptr + token * q_stride, cos, sin, d, partner, sign, HEADS, DIM, BLOCK_Q
        )
        tl.store(out_ptr + token * HEADS * DIM + h * DIM + d[None, :], queries, mask=there)
        row = kv_ptr + token * kv_stride
        entry = cache_ptr + slot * 2 * KV_HEADS * DIM
        keys, h, there = _rotated(row, cos, sin, d, partner, sign, KV_HEADS, DIM, BLOCK_KV)
        tl.store(entry + h * DIM + d[None, :], keys, mask=there)
        values = tl.load(row + (KV_HEADS + h) * DIM + d[None, :], mask=there)
        tl.store(entry + (KV_HEADS + h) * DIM + d[None, :], values, mask=there)
