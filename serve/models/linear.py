"""Linear layers of a decode step: matrix products of few rows, in flare's own kernel.

A decode step multiplies a few rows (one a sequence) by each weight matrix, so a product's
time is the time to read its weight once, plus the kernel's start: about 6 µs for a 1B
layer's 8-13 MB products on an H200, whatever their tiling (docs/performance.md). `few_rows`
is a Triton kernel for such products: it cuts the output into narrow column tiles (every
multiprocessor busy) and, where K is long against the output (down_proj), splits the
reduction: each program sums its part of K into a float32 buffer, and the last of a tile's
programs to finish (a counter it takes) adds the parts in their order and writes the tile.
One kernel, no reduce kernel after it and no atomics on values.

Every output element is summed in the same order whatever the number of rows (the K loop and
the split depend on the weight's shape alone), so a sequence's row gets the same bits in a
batch of 1 or of 16: what batch-invariant decoding needs of its products.

The small kernels between a layer's products cost as much as a product's start (about 2 µs
each with its seam), so `few_rows` takes them in: the RMSNorm of its input as it reads it
(`Normed`: the rows' sums of squares, left in parts by the product before), SiLU(gate) * up
of a gate/up product's output (`gated`), and the residual add after it with the sums of
squares of the new residual stream (`Added`). The residual stream's flow is residual.py's.

`linear(x, weight, bias)` is the model's plain product: an opaque `flare::linear` operator on
CUDA (a compiled forward keeps one graph for every row count, and the operator decides per
call: `few_rows` up to FEW_ROWS rows, cuBLAS above), plain `F.linear` elsewhere;
`flare::norm_linear` and `flare::linear_add` are the fused ones, with cuBLAS and a row
kernel (rms_norm.py) beyond FEW_ROWS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from flare.serve.models import rms_norm

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU build of torch ships without Triton
    triton = None

FEW_ROWS = 16
"""The most rows the operators give `few_rows`: decode batches up to 16 and the shortest
prefills. A whole step's products took 0.97x cuBLAS's time at 1 and 16 rows, 1.04-1.09x at 64
(tests/bench/gpu_linear.py --chain, docs/performance.md); more rows are cuBLAS's."""
MOST_ROWS = 64
"""The most rows `few_rows` itself takes (a program holds them all)."""
SHARED_BYTES = 200 * 1024
"""Shared memory a program's pipeline may take (an H100's or H200's 227 KB, less Triton's own)."""
HALF = (torch.bfloat16, torch.float16)
"""The dtypes `few_rows` multiplies (float32 would round through TF32 in its tensor cores)."""
PLAIN, GATED, NORMED = 0, 1, 2
"""What `few_rows` reads as its input: the rows, SiLU(gate) * up of [gate | up] rows, or the
RMSNorm of the rows."""


def kernels_on(x: torch.Tensor) -> bool:
    """Whether flare's kernels run on x's device: CUDA, with Triton."""
    return triton is not None and x.is_cuda


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias for x [rows, k]: `flare::linear` on CUDA, else `F.linear`."""
    if not kernels_on(x):
        return F.linear(x, weight, bias)
    out = torch.ops.flare.linear(x, weight)
    return out if bias is None else out + bias


WARPS = 4
"""Warps a program: no tiling in the sweep was faster with 8."""


@dataclass(frozen=True)
class Tiling:
    """How `few_rows` cuts one product: output columns per program, K per loop step, the
    reduction's parts, and its pipeline's depth."""

    block_n: int
    block_k: int
    split: int
    stages: int


def tiling(n: int, k: int) -> Tiling:
    """The tiling for a product by an [n, k] weight, from its shape alone (so a row gets the
    same sums in any batch), after a sweep of 54 tilings on an H200 at 1, 16 and 64
    rows for the 1B and 8B Llama shapes (tests/bench/gpu_linear.py, docs/performance.md):
    narrow tiles where the output is narrow, so every multiprocessor has a tile; the K
    reduction in four parts where K is over 3x the output (down_proj); wide tiles and a
    shallow pipeline for wide outputs (gate/up, the logits)."""
    split = 4 if k >= 3 * n else 1
    block_n = 16 if n <= 2048 and split == 1 else 32 if n <= 4096 or split > 1 else 64
    block_k = 256 if split == 1 and n <= 4096 and k <= 4096 else 128
    stages = 3 if n >= 16384 else 5
    return Tiling(block_n=block_n, block_k=block_k, split=split, stages=stages)


def stages_within(cut: Tiling, rows: int) -> int:
    """The tiling's pipeline depth, or less where its stages would not fit in shared memory
    with this many rows (the depth changes no sum, only how far ahead loads are issued)."""
    per_stage = (block_rows(rows) + cut.block_n) * cut.block_k * 2
    return max(2, min(cut.stages, SHARED_BYTES // per_stage))


def block_rows(rows: int) -> int:
    """Rows a program holds: Triton's tensor-core product takes 16 at least."""
    return max(16, triton.next_power_of_2(rows))


class Normed(NamedTuple):
    """An input read through its RMSNorm: its rows' sums of squares in parts ([parts, rows]
    float32, added up in part order), the norm's weight, its epsilon."""

    squares: torch.Tensor
    weight: torch.Tensor
    eps: float


class Added(NamedTuple):
    """A product added to the residual stream: the stream ([rows, n]), and where the new
    stream's sums of squares go ([tiles, rows] float32, a part per column tile)."""

    residual: torch.Tensor
    squares: torch.Tensor


if triton is not None:

    @triton.jit
    def _row_scales(squares_ptr, parts, rows, k, eps, at_m, PARTS: tl.constexpr):
        """1 / RMS of each row from its sums of squares in parts ([parts, rows])."""
        at_p = tl.arange(0, PARTS)
        where = (at_p[:, None] < parts) & (at_m[None, :] < rows)
        squares = tl.load(squares_ptr + at_p[:, None] * rows + at_m[None, :], mask=where, other=0.0)
        return tl.rsqrt(tl.sum(squares, axis=0) / k + eps)

    @triton.jit
    def _read_input(x_at, norm_at, scale, k, mask, k_mask, INPUT: tl.constexpr):
        """A [rows, BLOCK_K] block of the product's input, as the model's dtype rounds it:
        the rows; SiLU(gate) then its product with up; or the rows' norm, then its product
        with the norm's weight (the arithmetic of torch's operations on a bf16 model)."""
        dtype = x_at.dtype.element_ty
        if INPUT == 1:
            gate = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(x_at + k, mask=mask, other=0.0).to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            x = (silu * up).to(dtype)
        elif INPUT == 2:
            value = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
            normed = (value * scale[:, None]).to(dtype).to(tl.float32)
            weight = tl.load(norm_at, mask=k_mask, other=0.0).to(tl.float32)
            x = (normed * weight[None, :]).to(dtype)
        else:
            x = tl.load(x_at, mask=mask, other=0.0)
        return x

    @triton.jit
    def _write_tile(
        total, out_ptr, residual_ptr, sums_ptr, tile, rows, n, at_m, at_n, mask,
        ADD: tl.constexpr,
    ):  # fmt: skip
        """The tile in the model's dtype; with ADD, added to the residual stream (rounded as
        torch adds two bf16 tensors) and its rows' sums of squares written as part `tile`."""
        at = at_m[:, None] * n + at_n[None, :]
        value = total.to(out_ptr.dtype.element_ty)
        if ADD:
            residual = tl.load(residual_ptr + at, mask=mask, other=0.0).to(tl.float32)
            value = (value.to(tl.float32) + residual).to(out_ptr.dtype.element_ty)
            wide = tl.where(mask, value.to(tl.float32), 0.0)
            tl.store(sums_ptr + tile * rows + at_m, tl.sum(wide * wide, axis=1), mask=at_m < rows)
        tl.store(out_ptr + at, value, mask=mask)

    @triton.jit(do_not_specialize=["rows"])
    def _few_rows_kernel(
        x_ptr, w_ptr, out_ptr, parts_ptr, counts_ptr, squares_ptr, norm_ptr, residual_ptr,
        sums_ptr, rows, n, k, square_parts, eps,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SPLIT: tl.constexpr, EVEN_K: tl.constexpr, INPUT: tl.constexpr, ADD: tl.constexpr,
        PARTS: tl.constexpr,
    ):  # fmt: skip
        """Program (tile, part): input[:, part's K] @ w[tile's columns, part's K]^T. With
        SPLIT parts, each writes float32 to parts[part] and takes the tile's counter; the last
        adds parts 0..SPLIT-1 in order, writes the tile and sets the counter back to 0."""
        tile = tl.program_id(0)
        part = tl.program_id(1)
        at_m = tl.arange(0, BLOCK_M)
        at_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        at_k = tl.arange(0, BLOCK_K)
        steps = tl.cdiv(k, BLOCK_K)
        per_part = tl.cdiv(steps, SPLIT)
        first = part * per_part
        last = tl.minimum(first + per_part, steps)
        row_ok = at_m[:, None] < rows
        col_ok = at_n[None, :] < n
        x_at = x_ptr + at_m[:, None] * (2 * k if INPUT == 1 else k) + at_k[None, :]
        w_at = w_ptr + at_n[None, :].to(tl.int64) * k + at_k[:, None]
        scale = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if INPUT == 2:
            scale = _row_scales(squares_ptr, square_parts, rows, k, eps, at_m, PARTS)
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(first, last):
            offset = step * BLOCK_K
            if EVEN_K:
                x_mask = row_ok
                w_mask = col_ok
            else:
                x_mask = row_ok & (at_k[None, :] + offset < k)
                w_mask = col_ok & (at_k[:, None] + offset < k)
            x = _read_input(
                x_at + offset, norm_ptr + offset + at_k, scale, k, x_mask,
                at_k + offset < k, INPUT,
            )  # fmt: skip
            w = tl.load(w_at + offset, mask=w_mask, other=0.0)
            total = tl.dot(x, w, total)
        mask = row_ok & col_ok
        if SPLIT == 1:
            _write_tile(
                total, out_ptr, residual_ptr, sums_ptr, tile, rows, n, at_m, at_n, mask, ADD
            )
        else:
            parts_at = parts_ptr + at_m[:, None] * n + at_n[None, :]
            tl.store(parts_at + part * rows * n, total, mask=mask)
            tl.debug_barrier()
            arrived = tl.atomic_add(counts_ptr + tile, 1, sem="acq_rel")
            if arrived == SPLIT - 1:
                summed = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for other in tl.static_range(SPLIT):
                    summed += tl.load(
                        parts_at + other * rows * n, mask=mask, other=0.0, cache_modifier=".cg"
                    )
                _write_tile(
                    summed, out_ptr, residual_ptr, sums_ptr, tile, rows, n, at_m, at_n, mask, ADD
                )
                tl.atomic_xchg(counts_ptr + tile, 0)

    def _few(x: torch.Tensor) -> bool:
        """Whether `few_rows` takes these rows (else cuBLAS does)."""
        return 0 < x.shape[0] <= FEW_ROWS and x.dtype in HALF

    @torch.library.custom_op("flare::linear", mutates_args=())
    def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight.T: `few_rows` for few half-precision rows, cuBLAS otherwise. Opaque to
        a compiled forward, which has one graph for every row count; a captured decode graph
        records the kernel its size chose."""
        if not _few(x):
            return F.linear(x, weight)
        return few_rows(x.contiguous(), weight)

    @_linear.register_fake
    def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]))

    @torch.library.custom_op("flare::norm_linear", mutates_args=())
    def _norm_linear(
        x: torch.Tensor, squares: torch.Tensor, norm: torch.Tensor, eps: float, weight: torch.Tensor
    ) -> torch.Tensor:
        """RMSNorm(x) @ weight.T, the norm from the rows' sums of squares in parts: done as
        `few_rows` reads its input, or by a row kernel before cuBLAS."""
        if not _few(x):
            return F.linear(rms_norm.normalize(x, squares, norm, eps), weight)
        return few_rows(x.contiguous(), weight, normed=Normed(squares.contiguous(), norm, eps))

    @_norm_linear.register_fake
    def _(
        x: torch.Tensor, squares: torch.Tensor, norm: torch.Tensor, eps: float, weight: torch.Tensor
    ) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]))

    @torch.library.custom_op("flare::linear_add", mutates_args=())
    def _linear_add(
        x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, gated: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + input @ weight.T, the sum's sums of squares in parts), the input x or,
        `gated`, SiLU(gate) * up of x = [gate | up]: in `few_rows`, or by cuBLAS and a row
        kernel; the parts are the same column ranges either way."""
        if not _few(x):
            if gated:
                gate, up = x.chunk(2, dim=-1)
                x = F.silu(gate) * up
            width = tiling(*weight.shape).block_n
            return rms_norm.add_squares(F.linear(x, weight), residual, width)
        squares = x.new_empty((square_parts(weight), x.shape[0]), dtype=torch.float32)
        added = Added(residual.contiguous(), squares)
        return few_rows(x.contiguous(), weight, gated=gated, added=added), squares

    @_linear_add.register_fake
    def _(
        x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, gated: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        squares = x.new_empty((square_parts(weight), x.shape[0]), dtype=torch.float32)
        return residual.new_empty(residual.shape), squares


def square_parts(weight: torch.Tensor) -> int:
    """Parts of a row's sum of squares that a product by `weight` adds to the stream leaves:
    one a column tile of its tiling."""
    n, k = weight.shape
    return -(-n // tiling(n, k).block_n)


_launches: set[tuple[int, int, torch.dtype, int, int, bool]] = set()
"""(n, k, dtype, input kind, square parts read, added) of each `few_rows` launch of this
process: what `build_kernels` compiles at every decode size."""


def build_kernels(rows: list[int], device: torch.device) -> None:
    """Launch `few_rows` as this process did (a warm-up runs every product) at each row count,
    so Triton compiles each kernel they need now, into its cache folder (which a package's
    compile phase packs), not at a server's start."""
    for n, k, dtype, kind, parts, add in sorted(_launches, key=str):
        weight = torch.zeros((n, k), dtype=dtype, device=device)
        tiles = square_parts(weight)
        for count in (count for count in rows if count <= FEW_ROWS):
            zeros = torch.zeros((count, 2 * k if kind == GATED else k), dtype=dtype, device=device)
            normed = None
            if kind == NORMED:
                squares = torch.ones((parts, count), dtype=torch.float32, device=device)
                normed = Normed(squares, torch.zeros(k, dtype=dtype, device=device), 1e-6)
            added = None
            if add:
                sums = torch.empty((tiles, count), dtype=torch.float32, device=device)
                added = Added(torch.zeros((count, n), dtype=dtype, device=device), sums)
            few_rows(zeros, weight, gated=kind == GATED, normed=normed, added=added)


_counts: dict[torch.device, torch.Tensor] = {}
"""Each device's tile counters: zero between launches (the last program of a tile resets its
own), so one buffer serves every product, and a captured graph replays with it as it is."""

COUNTERS = 1 << 16
"""Tiles a split product may have: 65,536 at 16 columns covers a 1M-wide output."""


def few_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    cut: Tiling | None = None,
    *,
    gated: bool = False,
    normed: Normed | None = None,
    added: Added | None = None,
) -> torch.Tensor:
    """input @ weight.T for x [rows ≤ MOST_ROWS, k] (or [rows, 2k] `gated`: the input is
    SiLU(gate) * up) and weight [n, k], all contiguous, one dtype; the input RMS-normed as
    `normed` says; the result added to `added.residual`, its sums of squares into
    `added.squares` (the tiling's column tiles: `cut` must then be the weight's own)."""
    rows = x.shape[0]
    n, k = weight.shape
    cut = cut or tiling(n, k)
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(n, cut.block_n)
    counts = _counters(x.device)
    parts = out
    if cut.split > 1:
        if tiles > COUNTERS:
            raise ValueError(f"a split product of {tiles} column tiles (at most {COUNTERS})")
        parts = torch.empty((cut.split, rows, n), dtype=torch.float32, device=x.device)
    kind = GATED if gated else NORMED if normed is not None else PLAIN
    squares, norm, eps = normed or (out, out, 0.0)
    residual, sums = added or (out, out)
    _launches.add((n, k, x.dtype, kind, squares.shape[0] if normed else 0, added is not None))
    _few_rows_kernel[(tiles, cut.split)](
        x, weight, out, parts, counts, squares, norm, residual, sums, rows, n, k,
        squares.shape[0], eps,
        BLOCK_M=block_rows(rows), BLOCK_N=cut.block_n, BLOCK_K=cut.block_k, SPLIT=cut.split,
        EVEN_K=k % cut.block_k == 0, INPUT=kind, ADD=added is not None,
        PARTS=triton.next_power_of_2(squares.shape[0]) if normed else 1,
        num_warps=WARPS, num_stages=stages_within(cut, rows),
    )  # fmt: skip
    return out


def _counters(device: torch.device) -> torch.Tensor:
    """The device's counters, made at its first product: before any capture, since every
    captured size is run once first (a buffer made inside a capture would be the graph's)."""
    if device not in _counts:
        _counts[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return _counts[device]
