"""RMSNorm: transformers' arithmetic on every device, and on CUDA its two halves as row
kernels (the residual add leaving the sums of squares in parts, the scaling by them) giving
what the torch operations give. The kernels' tests run on CUDA, or on a CPU through Triton's
interpreter (TRITON_INTERPRET=1, half precision: its NumPy has no bf16)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import transformers.models.llama.modeling_llama as hf_llama

from flare.serve.models.rms_norm import RMSNorm, rms_norm

TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available() and TRITON
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float16
needs_kernel = pytest.mark.skipif(
    not (CUDA or (TRITON and os.environ.get("TRITON_INTERPRET") == "1")),
    reason="needs CUDA and Triton (or its interpreter)",
)


def _norm(size: int, device: str, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(size, 1e-5).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(size, generator=torch.Generator().manual_seed(1)))
    return norm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_norm_is_transformers(dtype: torch.dtype) -> None:
    """RMSNorm is transformers' LlamaRMSNorm, bitwise."""
    norm = _norm(256, "cpu", dtype)
    reference = hf_llama.LlamaRMSNorm(256, eps=1e-5).to(dtype)
    reference.weight.data.copy_(norm.weight.data)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert torch.equal(norm(x), reference(x))


def _stream(rows: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(size + rows)
    return tuple(  # type: ignore[return-value]
        (torch.randn(rows, size, generator=generator) * 3).to(DEVICE, DTYPE) for _ in range(2)
    )


@needs_kernel
@pytest.mark.parametrize("size", [2048, 4096, 100])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_the_add_leaves_the_sum_and_its_squares_in_parts(size: int, rows: int) -> None:
    """`add_squares`: the sum bitwise torch's; each part the sum of squares of its columns."""
    from flare.serve.models.rms_norm import add_squares

    y, residual = _stream(rows, size)
    summed, squares = add_squares(y, residual, 32)
    assert torch.equal(summed, y + residual)
    wide = summed.float()
    want = torch.stack([(part * part).sum(-1) for part in wide.split(32, dim=-1)])
    assert squares.shape == want.shape
    assert torch.allclose(squares, want, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("size", [2048, 8192, 100])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_the_scaling_by_the_squares_is_the_norm(size: int, rows: int) -> None:
    """`normalize` from the sums of squares in parts against the torch norm: within one
    rounding step (the squares are added in another order), the same value nearly always."""
    from flare.serve.models.rms_norm import normalize

    norm = _norm(size, DEVICE, DTYPE)
    x = _stream(rows, size)[0]
    parts = torch.stack([(part.float() ** 2).sum(-1) for part in x.split(16, dim=-1)])
    got = normalize(x, parts, norm.weight, norm.eps)
    want = rms_norm(x, norm.weight, norm.eps)
    bits = 7 if CUDA else 10  # bf16's mantissa, or half's
    step = want.float().abs() * 2**-bits
    assert ((got.float() - want.float()).abs() <= step + 1e-30).all()
    assert (got == want).float().mean() >= 0.99
