"""Linear layers of a decode step: matrix products of few rows, in flare's own kernel.

A decode step multiplies a few rows (one a sequence) by each weight matrix, so a product's
time is the time to read its weight once, plus the kernel's start: about 6 µs for a 1B
layer's 8-13 MB products on an H200, whatever their tiling (docs/performance.md). `few_rows`
is a Triton kernel for such products: it cuts the output into narrow column tiles (every
multiprocessor busy) and, where K is long against the output (down_proj), splits the
reduction: each program sums its part of K into a float32 buffer, and the last of a tile's
programs to finish (a counter it takes) adds the parts in their order and writes the tile.
One kernel, no reduce kernel after it and no atomics on values. A whole step's products ran
in 0.97x cuBLAS's time at 1 and 16 rows, and 1.04-1.09x at 64.

Every output element is summed in the same order whatever the number of rows (the K loop and
the split depend on the weight's shape alone), so a sequence's row gets the same bits in a
batch of 1 or of 16: what batch-invariant decoding needs of its products.

`linear(x, weight, bias)` is the one entry the model uses. On CUDA it decides per call:
`few_rows` up to FEW_ROWS rows, or MOST_ROWS where the server keeps batches invariant
(`keep_rows_invariant`), cuBLAS above; inside a compile it is the opaque `flare::linear`
operator (a compiled forward keeps one graph for every row count and the operator decides
when it runs), and outside one the same function called directly: a custom operator's eager
call imports Dynamo and Inductor (torch's `_disable_dynamo`, 1-3 s of a start on the H200's
host) and costs tens of microseconds of dispatch. Elsewhere, plain `F.linear`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flare.serve.engine.dependent_launch import chained

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU build of torch ships without Triton
    triton = None

FEW_ROWS = 16
"""The most rows `flare::linear` gives `few_rows`: decode batches up to 16 and the shortest
prefills. A whole step's products took 0.97x cuBLAS's time at 1 and 16 rows, 1.04-1.09x at 64
(tests/bench/gpu_linear.py --chain, docs/performance.md); more rows are cuBLAS's."""
MOST_ROWS = 64
"""The most rows `few_rows` itself takes (a program holds them all)."""
_row_limit = FEW_ROWS
"""The most rows `flare::linear` gives `few_rows` in this process (`keep_rows_invariant`)."""
SHARED_BYTES = 200 * 1024
"""Shared memory a program's pipeline may take (an H100's or H200's 227 KB, less Triton's own)."""
HALF = (torch.bfloat16, torch.float16)
"""The dtypes `few_rows` multiplies (float32 would round through TF32 in its tensor cores)."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias for x [rows, k]: `products` on CUDA (inside a compile through the
    `flare::linear` operator), else `F.linear`."""
    if triton is None or not x.is_cuda:
        return F.linear(x, weight, bias)
    compiling = torch.compiler.is_compiling()
    out = torch.ops.flare.linear(x, weight) if compiling else products(x, weight)
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


if triton is not None:

    @triton.jit(do_not_specialize=["rows"])
    def _few_rows_kernel(
        x_ptr, w_ptr, out_ptr, parts_ptr, counts_ptr, rows, n, k,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SPLIT: tl.constexpr, EVEN_K: tl.constexpr, DEPENDENT: tl.constexpr,
    ):  # fmt: skip
        """Program (tile, part): x[:, part's K] @ w[tile's columns, part's K]^T. With SPLIT
        parts, each writes float32 to parts[part] and takes the tile's counter; the last adds
        parts 0..SPLIT-1 in order, writes the tile and sets the counter back to 0.

        Launched as a dependent (DEPENDENT), a program first waits for the kernel ahead to
        end, then lets the next launch."""
        tile = tl.program_id(0)
        part = tl.program_id(1)
        at_m = tl.arange(0, BLOCK_M)
        at_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        at_k = tl.arange(0, BLOCK_K)
        steps = tl.cdiv(k, BLOCK_K)
        per_part = tl.cdiv(steps, SPLIT)
        first = part * per_part
        last = tl.minimum(first + per_part, steps)
        if DEPENDENT:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        row_ok = at_m[:, None] < rows
        col_ok = at_n[None, :] < n
        x_at = x_ptr + at_m[:, None] * k + at_k[None, :]
        w_at = w_ptr + at_n[None, :].to(tl.int64) * k + at_k[:, None]
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(first, last):
            offset = step * BLOCK_K
            if EVEN_K:
                x = tl.load(x_at + offset, mask=row_ok, other=0.0)
                w = tl.load(w_at + offset, mask=col_ok, other=0.0)
            else:
                x = tl.load(x_at + offset, mask=row_ok & (at_k[None, :] + offset < k), other=0.0)
                w = tl.load(w_at + offset, mask=col_ok & (at_k[:, None] + offset < k), other=0.0)
            total = tl.dot(x, w, total)
        out_at = out_ptr + at_m[:, None] * n + at_n[None, :]
        if SPLIT == 1:
            tl.store(out_at, total.to(out_ptr.dtype.element_ty), mask=row_ok & col_ok)
        else:
            parts_at = parts_ptr + at_m[:, None] * n + at_n[None, :]
            tl.store(parts_at + part * rows * n, total, mask=row_ok & col_ok)
            tl.debug_barrier()
            arrived = tl.atomic_add(counts_ptr + tile, 1, sem="acq_rel")
            if arrived == SPLIT - 1:
                summed = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for other in tl.static_range(SPLIT):
                    summed += tl.load(
                        parts_at + other * rows * n, mask=row_ok & col_ok, other=0.0,
                        cache_modifier=".cg",
                    )  # fmt: skip
                tl.store(out_at, summed.to(out_ptr.dtype.element_ty), mask=row_ok & col_ok)
                tl.atomic_xchg(counts_ptr + tile, 0)

    def products(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight.T: `few_rows` for few half-precision rows, cuBLAS otherwise (a
        captured decode graph records the kernel its size chose)."""
        if x.shape[0] > _row_limit or x.dtype not in HALF or x.shape[0] == 0:
            return F.linear(x, weight)
        _products.add((weight.shape[0], weight.shape[1], weight.dtype))
        return few_rows(x.contiguous(), weight)

    _operator = torch.library.custom_op("flare::linear", products, mutates_args=())
    """`products` as an operator opaque to a compile: one graph for every row count."""

    @_operator.register_fake
    def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]))


def keep_rows_invariant(on: bool) -> None:
    """Give `few_rows` every product of up to MOST_ROWS rows (on), or of up to FEW_ROWS
    (off: the fastest). `few_rows` sums a row in the same order at any row count and cuBLAS
    does not, so with this on a decode batch of up to 64 sequences gives each the bits it
    gets alone; a step's products then take 1.04-1.09x cuBLAS's time at 64 rows. Process-wide,
    as a process serves one model: its runtime sets it either way as it loads."""
    global _row_limit
    _row_limit = MOST_ROWS if on else FEW_ROWS


_products: set[tuple[int, int, torch.dtype]] = set()
"""(n, k, dtype) of each weight `flare::linear` gave to `few_rows` in this process."""


def build_kernels(device: torch.device) -> None:
    """Launch `few_rows` for every product this process ran (a warm-up runs them all) at
    each block of rows it may hold (16, 32, 64: a batch-invariant server gives it up to
    MOST_ROWS, decodes and short prefills alike), so Triton compiles every kernel they need
    now, into its cache folder (which a package's compile phase packs), not at a start."""
    counts = sorted({block_rows(rows) for rows in range(1, MOST_ROWS + 1)})
    for n, k, dtype in sorted(_products, key=str):
        weight = torch.zeros((n, k), dtype=dtype, device=device)
        for count in counts:
            few_rows(torch.zeros((count, k), dtype=dtype, device=device), weight)


_counts: dict[torch.device, torch.Tensor] = {}
"""Each device's tile counters: zero between launches (the last program of a tile resets its
own), so one buffer serves every product, and a captured graph replays with it as it is."""

COUNTERS = 1 << 16
"""Tiles a split product may have: 65,536 at 16 columns covers a 1M-wide output."""


def few_rows(
    x: torch.Tensor, weight: torch.Tensor, cut: Tiling | None = None, pdl: bool | None = None
) -> torch.Tensor:
    """x @ weight.T for x [rows ≤ MOST_ROWS, k] and weight [n, k], both contiguous, one dtype;
    launched as a dependent where the device takes it (pdl None) or as pdl says."""
    rows, k = x.shape
    n = weight.shape[0]
    cut = cut or tiling(n, k)
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(n, cut.block_n)
    counts = _counters(x.device)
    dependent = chained(x.device) if pdl is None else pdl
    parts = out
    if cut.split > 1:
        if tiles > COUNTERS:
            raise ValueError(f"a split product of {tiles} column tiles (at most {COUNTERS})")
        parts = torch.empty((cut.split, rows, n), dtype=torch.float32, device=x.device)
    _few_rows_kernel[(tiles, cut.split)](
        x, weight, out, parts, counts, rows, n, k,
        BLOCK_M=block_rows(rows), BLOCK_N=cut.block_n, BLOCK_K=cut.block_k, SPLIT=cut.split,
        EVEN_K=k % cut.block_k == 0, DEPENDENT=dependent,
        num_warps=WARPS, num_stages=stages_within(cut, rows), launch_pdl=dependent,
    )  # fmt: skip
    return out


def _counters(device: torch.device) -> torch.Tensor:
    """The device's counters, made at its first product: before any capture, since every
    captured size is run once first (a buffer made inside a capture would be the graph's)."""
    if device not in _counts:
        _counts[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return _counts[device]
