"""RMSNorm, and the residual add before it in one kernel on CUDA.

A decoder layer adds its attention's output to the residual stream and normalizes the sum,
then does the same with its MLP's output. Written as torch operations, Inductor made three
kernels of each on the H200 (the add, the sum of squares, the scaling: docs/performance.md),
about 1.5 microseconds apiece with the seams between them, 48 kernels a step at 1B. On CUDA
`add_rms_norm` does it in one Triton kernel that reads both inputs once and writes the sum and
its norm, as vLLM's fused_add_rms_norm does, and a layer's first norm (no residual yet) in the
same kernel with its add compiled out. flare launches it itself, as a dependent of the kernel
ahead on GPUs that take it (serve/engine/dependent_launch.py), which a kernel that Inductor
generated for a compiled forward cannot: called directly, and inside a compile as the opaque
operator `flare::add_rms_norm` (serve/models/linear.py says why both). Its kernel comes from
Triton's cache, which a package's compile phase packs. Everywhere else, and where Triton is
missing, the same arithmetic runs as torch operations.

The arithmetic is transformers' (and the torch path's): the sum rounded to the model's dtype,
then in float32 x * rsqrt(mean(x^2) + eps), rounded, times the weight, rounded.
"""

from __future__ import annotations

import torch
from torch import nn

from flare.serve.engine.dependent_launch import chained

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU build of torch ships without Triton
    triton = None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The norm of x: on CUDA outside a compile, the kernel with no residual (torch's
        operations were seven kernels for a layer's first norm); inside one, the operations,
        which the compiler fuses."""
        if x.is_cuda and triton is not None and not torch.compiler.is_compiling():
            return norm_rows(x, None, self.weight, self.eps)[0]
        return rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the norm of x + residual, x + residual): the residual stream's next value and
        what the next block reads. Inside a compile on CUDA the kernel is the opaque
        `flare::add_rms_norm`; outside one it is called directly (serve/models/linear.py
        says why)."""
        if x.is_cuda and triton is not None:
            if torch.compiler.is_compiling():
                return torch.ops.flare.add_rms_norm(x, residual, self.weight, self.eps)
            return norm_rows(x, residual, self.weight, self.eps)
        summed = x + residual
        return rms_norm(summed, self.weight, self.eps), summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr, residual_ptr, weight_ptr, out_ptr, summed_ptr, cols, eps,
        BLOCK: tl.constexpr, DEPENDENT: tl.constexpr, ADD: tl.constexpr,
    ):  # fmt: skip
        """One program per row (rows `cols` apart): the row's sum (with `ADD`; else the row
        itself, nothing stored), its sum of squares, its scaled norm. On CUDA only:
        tests/test_rms_norm.py checks it there. Launched as a dependent, it reads the weight,
        waits for the kernel ahead, and lets the next launch."""
        at = tl.program_id(0).to(tl.int64) * cols + tl.arange(0, BLOCK)
        mask = tl.arange(0, BLOCK) < cols
        weight = tl.load(weight_ptr + tl.arange(0, BLOCK), mask=mask, other=0.0).to(tl.float32)
        if DEPENDENT:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        x = tl.load(x_ptr + at, mask=mask, other=0.0)
        if ADD:
            residual = tl.load(residual_ptr + at, mask=mask, other=0.0).to(tl.float32)
            summed = (x.to(tl.float32) + residual).to(summed_ptr.dtype.element_ty)
            tl.store(summed_ptr + at, summed, mask=mask)
            values = summed.to(tl.float32)
        else:
            values = x.to(tl.float32)
        scale = tl.rsqrt(tl.sum(values * values, axis=0) / cols + eps)
        normed = (values * scale).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + at, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)

    def norm_rows(
        x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the norm of x + residual, x + residual), both [rows, size]; without a residual,
        (the norm of x, x)."""
        rows, cols = x.shape
        x = x.contiguous()
        out = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
        summed = x if residual is None else torch.empty_like(out)
        block = triton.next_power_of_2(cols)
        warps = min(max(block // 512, 4), 16)
        dependent = chained(x.device)
        _add_rms_norm_kernel[(rows,)](
            x, x if residual is None else residual.contiguous(), weight, out, summed, cols, eps,
            BLOCK=block, DEPENDENT=dependent, ADD=residual is not None, num_warps=warps,
            launch_pdl=dependent,
        )  # fmt: skip
        return out, summed

    def _add_norm_rows(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`norm_rows` with a residual, the signature an operator takes."""
        return norm_rows(x, residual, weight, eps)

    add_rms_norm = torch.library.custom_op("flare::add_rms_norm", _add_norm_rows, mutates_args=())
    """`norm_rows` as an operator opaque to a compile."""

    @add_rms_norm.register_fake
    def _(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return x.new_empty(x.shape), x.new_empty(x.shape)
