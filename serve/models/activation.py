"""The MLP's activation: silu(gate) * up, from the fused gate/up product's output.

`gate_up` is [rows, 2 * inter], the gate's columns then the up's (the recipe's build-time
layout, serve/models/llama.py). On CUDA one Triton kernel reads both halves once and writes the
product, launched by flare (called directly, and inside a compile as the opaque operator
`flare::silu_mul`, as the norm is) so that it launches as a dependent of the kernel ahead on
GPUs that take it (serve/engine/dependent_launch.py). Inductor's own kernel for these torch
operations took 632 µs a layer on an 8K-token prefill on the H200, about six times what
reading 268 MB and writing 134 MB costs, a quarter of that prefill's GPU time
(docs/performance.md). Everywhere else, and where Triton is missing, the torch operations run.

The arithmetic is transformers' eager bf16: silu in float32, rounded to the model's dtype,
then the product in float32, rounded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flare.serve.engine.dependent_launch import chained

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU build of torch ships without Triton
    triton = None

BLOCK = 1024
"""Columns a program writes: eight bf16 values a thread at four warps, 16-byte accesses."""


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, [rows, inter], for gate_up = [rows, 2 * inter] (gate, then up)."""
    if gate_up.is_cuda and triton is not None:
        if torch.compiler.is_compiling():  # opaque to the compile (see linear.py on why)
            return torch.ops.flare.silu_mul(gate_up)
        return silu_mul_rows(gate_up, chained(gate_up.device))
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul_rows(gate_up: torch.Tensor, dependent: bool = False) -> torch.Tensor:
    """`silu_mul` by the Triton kernel (on CUDA, or on a CPU under Triton's interpreter);
    `dependent`: launched as a dependent of the kernel ahead."""
    rows, width = gate_up.shape
    inter = width // 2
    out = gate_up.new_empty((rows, inter))
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(inter, BLOCK))](
            gate_up.contiguous(), out, inter,
            BLOCK=BLOCK, DEPENDENT=dependent, num_warps=4, launch_pdl=dependent,
        )  # fmt: skip
    return out


if triton is not None:

    @triton.jit
    def _silu_mul_kernel(gate_up_ptr, out_ptr, inter, BLOCK: tl.constexpr, DEPENDENT: tl.constexpr):
        """A program per row and BLOCK columns. Launched as a dependent, it waits for the
        kernel ahead before it reads, then lets the next launch."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        if DEPENDENT:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        at = gate_up_ptr + row * 2 * inter + cols
        gate = tl.load(at, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(at + inter, mask=mask, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(out_ptr + row * inter + cols, (silu * up).to(dtype), mask=mask)

    @torch.library.custom_op("flare::silu_mul", mutates_args=())
    def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul_rows(gate_up, chained(gate_up.device))

    @_silu_mul.register_fake
    def _(gate_up: torch.Tensor) -> torch.Tensor:
        return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))
