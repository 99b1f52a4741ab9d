"""The decode step's products: `few_rows` is the float32 product rounded once, gives a row the
same bits in any batch, and replays right from a CUDA graph; `linear` is `F.linear` elsewhere.

The kernel's tests run on CUDA, or on a CPU through Triton's interpreter where Triton is
installed and TRITON_INTERPRET=1 is set (`TRITON_INTERPRET=1 pytest tests/test_linear.py`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_env import DEVICE, DTYPE, needs_cuda, needs_kernel

from flare.serve.models.linear import FEW_ROWS, MOST_ROWS, Tiling, few_rows, linear

CUTS = [
    None,  # linear.tiling's own
    Tiling(block_n=16, block_k=128, split=1, stages=3),
    Tiling(block_n=32, block_k=128, split=2, stages=3),
    Tiling(block_n=16, block_k=256, split=4, stages=3),
]


def _operands(rows: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=generator).to(DEVICE, DTYPE)
    weight = (torch.randn(n, k, generator=generator) * k**-0.5).to(DEVICE, DTYPE)
    return x, weight


def _within_one_rounding(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """got is the float32 product rounded once: within bf16's spacing of it (plus float32's
    error of a k-long sum, far below)."""
    want = x.float() @ weight.float().T
    slack = want.abs() * 2**-8 + 1e-3
    assert got.dtype == x.dtype and got.shape == want.shape
    assert ((got.float() - want).abs() <= slack).all()


@needs_kernel
@pytest.mark.parametrize("cut", CUTS, ids=lambda c: "picked" if c is None else f"s{c.split}")
@pytest.mark.parametrize(
    ("rows", "n", "k"),
    [(1, 2048, 2048), (3, 48, 384), (16, 3072, 2048), (17, 40, 1000), (MOST_ROWS, 96, 4096)],
)
def test_few_rows_is_the_float32_product_rounded_once(
    rows: int, n: int, k: int, cut: Tiling | None
) -> None:
    """Any row count up to MOST_ROWS, output widths that are not a whole number of tiles, a K
    that is not a whole number of steps, split into parts or not."""
    x, weight = _operands(rows, n, k, seed=rows + n + k)
    _within_one_rounding(few_rows(x, weight, cut), x, weight)


@needs_kernel
@pytest.mark.parametrize(("n", "k"), [(2048, 2048), (2048, 8192), (3072, 2048), (40, 1000)])
def test_a_row_gets_the_same_bits_in_a_batch_of_any_size(n: int, k: int) -> None:
    """What batch-invariant decoding needs of a product: a sequence's row, multiplied with 63
    others, 15 others or alone, comes out bit for bit the same."""
    x, weight = _operands(MOST_ROWS, n, k, seed=7)
    batched = few_rows(x, weight)
    assert torch.equal(few_rows(x[:16].contiguous(), weight), batched[:16])
    for row in (0, 5, MOST_ROWS - 1):
        assert torch.equal(few_rows(x[row : row + 1].contiguous(), weight)[0], batched[row])


@needs_cuda
def test_a_captured_split_product_replays_right_every_time() -> None:
    """A split product in a CUDA graph, replayed on new rows: each replay is right, so every
    tile's counter is back at zero after each (a counter left behind would skip a tile)."""
    cut = Tiling(block_n=16, block_k=128, split=4, stages=3)
    x, weight = _operands(8, 2048, 2048, seed=3)
    few_rows(x, weight, cut)  # compiled and loaded before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = few_rows(x, weight, cut)
    for seed in range(3):
        x.copy_(_operands(8, 2048, 2048, seed=10 + seed)[0])
        graph.replay()
        _within_one_rounding(out, x, weight)


@needs_cuda
def test_linear_on_cuda_is_cublas_beyond_few_rows_and_adds_the_bias() -> None:
    x, weight = _operands(FEW_ROWS + 1, 256, 512, seed=5)
    bias = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(linear(x, weight, bias), F.linear(x, weight) + bias)
    assert linear(x[:0], weight, None).shape == (0, 256)
    _within_one_rounding(linear(x[:4], weight, None), x[:4], weight)


@needs_cuda
def test_kept_invariant_a_row_gets_its_bits_alone_in_any_batch_up_to_most_rows() -> None:
    """`--batch-invariant`'s products: with the rows kept invariant, every product of up to
    MOST_ROWS rows is `few_rows`', so each row of a batch of 40 equals that row alone, bit for
    bit; past the limit again (off), 40 rows are cuBLAS's."""
    from flare.serve.models import linear as module

    x, weight = _operands(40, 2048, 2048, seed=11)
    module.keep_rows_invariant(True)
    try:
        together = linear(x, weight, None)
        alone = torch.cat([linear(x[i : i + 1], weight, None) for i in range(40)])
        assert torch.equal(together, alone)
    finally:
        module.keep_rows_invariant(False)
    assert torch.equal(linear(x, weight, None), F.linear(x, weight))


@needs_cuda
def test_a_compiled_forward_takes_any_row_count_through_one_graph() -> None:
    """The operator is opaque to torch.compile: one graph with an unbacked row count runs a
    decode's few rows through `few_rows` and a prefill's many through cuBLAS."""
    _, weight = _operands(1, 512, 1024, seed=9)
    compiled = torch.compile(lambda x: linear(x, weight, None), fullgraph=True)
    for rows in (1, 7, 300):
        x = _operands(rows, 512, 1024, seed=rows)[0]
        torch._dynamo.decorators.mark_unbacked(x, 0)
        _within_one_rounding(compiled(x), x, weight)


_CHAIN = [(3072, 1024), (1024, 1024), (8192, 1024), (1024, 4096)]
"""(n, k) of a layer's products in the dependent chain: q/k/v, o, gate/up, down (split)."""


@needs_cuda
def test_a_graph_of_kernels_launched_as_dependents_gives_the_serial_chains_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a GPU that takes programmatic dependent launch, a decode step's products and norms
    start before the kernel ahead ends (serve/engine/dependent_launch.py): replayed from a
    CUDA graph, a chain of them, each reading what the one before wrote (a split product
    among them), gives the bits of the same chain launched one kernel after another."""
    from flare.serve.engine.dependent_launch import chained
    from flare.serve.models import rms_norm

    if not chained(torch.device("cuda")):
        pytest.skip("this GPU launches no kernel as a dependent (compute capability below 9)")
    weights = [_operands(1, n, k, seed=20 + i)[1] for i, (n, k) in enumerate(_CHAIN * 4)]
    norm = torch.ones(1024, device="cuda", dtype=DTYPE)

    def chain(x: torch.Tensor, dependent: bool) -> torch.Tensor:
        residual = torch.zeros_like(x)
        for weight in weights:
            x = x[:, : weight.shape[1]].contiguous()
            if weight.shape[1] == norm.shape[0]:
                x, residual = rms_norm.add_rms_norm(x, residual, norm, 1e-5)
            x = few_rows(x, weight, pdl=dependent)
        return x

    x = torch.zeros(4, 1024, device="cuda", dtype=DTYPE)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(x, dependent=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(x, dependent=True)
    monkeypatch.setattr(rms_norm, "chained", lambda device: False)
    for seed in range(3):
        x.copy_(_operands(4, 8, 1024, seed=seed)[0])
        graph.replay()
        assert torch.equal(out, chain(x, dependent=False))


def test_linear_elsewhere_is_f_linear_bitwise() -> None:
    """On a CPU (or any tensor off CUDA) `linear` is `F.linear`, bias and all."""
    generator = torch.Generator().manual_seed(0)
    x, weight, bias = (torch.randn(*shape, generator=generator) for shape in ((3, 8), (5, 8), (5,)))
    assert torch.equal(linear(x, weight, bias), F.linear(x, weight, bias))
    assert torch.equal(linear(x, weight, None), F.linear(x, weight))
