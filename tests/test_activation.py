"""The MLP's activation: silu(gate) * up from the fused gate/up output, as transformers'
LlamaMLP computes it, by torch's operations on the CPU and by the Triton kernel on CUDA (or on
a CPU through Triton's interpreter: `TRITON_INTERPRET=1 pytest tests/test_activation.py`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_env import DEVICE, DTYPE, needs_cuda, needs_kernel
from transformers.activations import ACT2FN

from flare.serve.models.activation import BLOCK, silu_mul, silu_mul_rows


def _gate_up(rows: int, inter: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A product's output of the size a model's gives: values around a few units, where
    silu bends, with both signs."""
    generator = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(rows, 2 * inter, generator=generator)).to(DEVICE, dtype)


def _want(gate_up: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaMLP: act_fn(gate_proj(x)) * up_proj(x), op by op in the dtype."""
    inter = gate_up.shape[1] // 2
    return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]


def test_the_torch_path_is_transformers_bitwise() -> None:
    """Off CUDA, the activation is transformers' own (its `hidden_act` "silu") times up."""
    gate_up = _gate_up(5, 96, torch.bfloat16).cpu()
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(silu_mul(gate_up), ACT2FN["silu"](gate) * up)


def _ulps_apart(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """How many units in the last place of the dtype each value is from the wanted one."""
    wanted = want.float()
    exponent = torch.floor(torch.log2(wanted.abs().clamp_min(torch.finfo(want.dtype).tiny)))
    return (got.float() - wanted).abs() / (torch.finfo(want.dtype).eps * torch.exp2(exponent))


@needs_kernel
@pytest.mark.parametrize(
    ("rows", "inter"),
    [(1, 8192), (3, 100), (17, BLOCK + 1), (64, 14336), (4099, 256)],
)
def test_the_kernel_gives_what_the_torch_operations_give(rows: int, inter: int) -> None:
    """Every row and column written from its own gate and up (a wrong half, row or column
    would be far off), and nearly all equal to the torch operations' value. The rest differ
    where silu's exponential rounded its last float32 bit otherwise and so silu rounded to the
    other neighbour: one unit of silu, which the product carries as at most two of its own."""
    gate_up = _gate_up(rows, inter, DTYPE, seed=rows)
    got, want = silu_mul_rows(gate_up), _want(gate_up)
    assert got.shape == want.shape == (rows, inter)
    assert float(_ulps_apart(got, want).max()) <= 2
    assert (got == want).float().mean() > 0.999


@needs_kernel
def test_the_kernel_reads_the_halves_of_a_wider_products_rows() -> None:
    """Gate and up are the first and second half of each row: swapping them, or reading a
    row's neighbour, changes the answer."""
    gate = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    up = torch.tensor([[3.0, 5.0], [-1.0, 2.0]])
    gate_up = torch.cat((gate, up), dim=1).to(DEVICE, DTYPE)
    want = (F.silu(gate.to(DTYPE)) * up.to(DTYPE)).to(DEVICE)
    assert torch.equal(silu_mul_rows(gate_up), want)


@needs_kernel
def test_no_rows_make_an_empty_output() -> None:
    assert silu_mul_rows(_gate_up(0, 64, DTYPE)).shape == (0, 64)


@needs_cuda
def test_the_operator_launched_as_a_dependent_gives_the_same() -> None:
    """On CUDA the model calls the opaque operator, launched as a dependent on Hopper."""
    gate_up = _gate_up(33, 8192, DTYPE, seed=7)
    assert torch.equal(silu_mul(gate_up), silu_mul_rows(gate_up))
