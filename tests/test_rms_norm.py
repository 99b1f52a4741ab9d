"""RMSNorm and the residual add before it: transformers' arithmetic on every device, and on
CUDA the one-kernel `add_rms_norm` giving what the torch operations give."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import transformers.models.llama.modeling_llama as hf_llama

from flare.serve.models.rms_norm import RMSNorm, rms_norm

CUDA = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def _norm(size: int, device: str, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(size, 1e-5).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(size, generator=torch.Generator().manual_seed(1)))
    return norm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_sum_and_its_norm_are_transformers(dtype: torch.dtype) -> None:
    """`add` is the residual stream's bf16 sum and transformers' LlamaRMSNorm of it, bitwise."""
    norm = _norm(256, "cpu", dtype)
    reference = hf_llama.LlamaRMSNorm(256, eps=1e-5).to(dtype)
    reference.weight.data.copy_(norm.weight.data)
    generator = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(9, 256, generator=generator).to(dtype) for _ in range(2))
    normed, summed = norm.add(x, residual)
    assert torch.equal(summed, residual + x)
    assert torch.equal(normed, reference(residual + x))
    assert torch.equal(norm(x), reference(x))


@pytest.mark.skipif(not CUDA, reason="needs CUDA and Triton")
@pytest.mark.parametrize("size", [2048, 4096, 8192, 100])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_the_cuda_kernel_gives_what_the_torch_operations_give(size: int, rows: int) -> None:
    """The one kernel against the torch operations on the same GPU, bf16, with the residual
    (`add`) and without (a layer's first norm): the sum bitwise; the norm within one bf16
    rounding step (the sum of squares is added in another order), and the same value on
    nearly every element."""
    norm = _norm(size, "cuda", torch.bfloat16)
    generator = torch.Generator(device="cuda").manual_seed(size + rows)
    x, residual = (
        torch.randn(rows, size, generator=generator, device="cuda").to(torch.bfloat16) * 3
        for _ in range(2)
    )
    normed, summed = norm.add(x, residual)
    want_sum = x + residual
    assert torch.equal(summed, want_sum)
    for got, of in ((normed, want_sum), (norm(x), x)):
        want = rms_norm(of, norm.weight, norm.eps)
        step = want.float().abs() * 2**-7
        assert ((got.float() - want.float()).abs() <= step + 1e-30).all()
        assert (got == want).float().mean() >= 0.99
