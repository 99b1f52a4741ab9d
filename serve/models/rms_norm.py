"""RMSNorm, and on CUDA its two halves as row kernels: the residual add with the sums of
squares it leaves, and the scaling by them.

A decoder layer adds its attention's output to the residual stream and normalizes the sum,
then does the same with its MLP's output. On CUDA a decode step does both inside its matrix
products (linear.py: the product that adds to the stream leaves its rows' sums of squares in
parts, the product that reads it normalizes as it loads); beyond a decode's few rows the same
halves run as the row kernels here around cuBLAS's products: `add_squares` (the add and the
sums of squares, in the parts the fused product leaves) and `normalize`. They are
`triton_op`s, so a compiled forward calls them directly and Inductor's cache keeps them.
Elsewhere the whole norm runs as torch operations (`rms_norm`), transformers' LlamaRMSNorm.

The arithmetic is transformers': the sum rounded to the model's dtype, then in float32
x * rsqrt(mean(x^2) + eps), rounded, times the weight, rounded.
"""

from __future__ import annotations

import torch
from torch import nn

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton
except ImportError:  # a CPU build of torch ships without Triton
    triton = None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def row_squares(x: torch.Tensor) -> torch.Tensor:
    """Each row's sum of squares in float32, as one part ([1, rows]): the stream's first value
    (the embeddings), which no product adds."""
    return x.float().square().sum(-1)[None]


if triton is not None:

    @triton.jit
    def _add_squares_kernel(
        y_ptr, residual_ptr, summed_ptr, squares_ptr, rows, cols,
        WIDTH: tl.constexpr, PARTS: tl.constexpr,
    ):  # fmt: skip
        """One program per row: y + residual, rounded, and its sum of squares over each
        WIDTH columns, part p to squares[p, row]."""
        row = tl.program_id(0)
        at_p = tl.arange(0, PARTS)
        cols_at = at_p[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :]
        mask = cols_at < cols
        at = row.to(tl.int64) * cols + cols_at
        y = tl.load(y_ptr + at, mask=mask, other=0.0).to(tl.float32)
        residual = tl.load(residual_ptr + at, mask=mask, other=0.0).to(tl.float32)
        summed = (y + residual).to(summed_ptr.dtype.element_ty)
        tl.store(summed_ptr + at, summed, mask=mask)
        wide = summed.to(tl.float32)
        parts = tl.cdiv(cols, WIDTH)
        tl.store(squares_ptr + at_p * rows + row, tl.sum(wide * wide, axis=1), mask=at_p < parts)

    @triton_op("flare::add_squares", mutates_args={})
    def add_squares(
        y: torch.Tensor, residual: torch.Tensor, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(y + residual, its rows' sums of squares over each `width` columns: [parts, rows]
        float32), both [rows, cols]."""
        rows, cols = y.shape
        parts = triton.cdiv(cols, width)
        summed = torch.empty((rows, cols), dtype=y.dtype, device=y.device)
        squares = torch.empty((parts, rows), dtype=torch.float32, device=y.device)
        if rows:
            wrap_triton(_add_squares_kernel)[(rows,)](
                y.contiguous(), residual.contiguous(), summed, squares, rows, cols,
                WIDTH=width, PARTS=triton.next_power_of_2(parts), num_warps=_warps(cols),
            )  # fmt: skip
        return summed, squares

    @triton.jit
    def _normalize_kernel(
        x_ptr, squares_ptr, weight_ptr, out_ptr, rows, cols, parts, eps,
        BLOCK: tl.constexpr, PARTS: tl.constexpr,
    ):  # fmt: skip
        """One program per row: its norm from its sums of squares in parts, times the weight."""
        row = tl.program_id(0)
        at_p = tl.arange(0, PARTS)
        squares = tl.load(squares_ptr + at_p * rows + row, mask=at_p < parts, other=0.0)
        scale = tl.rsqrt(tl.sum(squares, axis=0) / cols + eps)
        mask = tl.arange(0, BLOCK) < cols
        at = row.to(tl.int64) * cols + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
        normed = (x * scale).to(out_ptr.dtype.element_ty).to(tl.float32)
        weight = tl.load(weight_ptr + tl.arange(0, BLOCK), mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + at, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)

    @triton_op("flare::normalize", mutates_args={})
    def normalize(
        x: torch.Tensor, squares: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """RMSNorm of x [rows, cols] from its rows' sums of squares in parts [parts, rows]."""
        rows, cols = x.shape
        out = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
        if rows:
            block = triton.next_power_of_2(cols)
            wrap_triton(_normalize_kernel)[(rows,)](
                x.contiguous(), squares.contiguous(), weight, out, rows, cols, squares.shape[0],
                eps, BLOCK=block, PARTS=triton.next_power_of_2(squares.shape[0]),
                num_warps=_warps(cols),
            )  # fmt: skip
        return out

    def _warps(cols: int) -> int:
        return min(max(triton.next_power_of_2(cols) // 512, 4), 16)
