"""The attention backends: which one a runtime gets, and FlashInfer's against the reference."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from flare.errors import InvalidInputError
from flare.serve.engine.attention import AttentionMetadata, AttentionSpec, TorchPagedAttention
from flare.serve.engine.attention_choice import ATTENTION_KINDS, flashinfer_unfit, make_attention

SPEC = AttentionSpec(num_layers=2, num_heads=8, num_kv_heads=2, head_dim=128, scale=128**-0.5)
BLOCK = 16
CPU = torch.device("cpu")
GPU = torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None


def test_auto_takes_the_torch_reference_where_flashinfer_cannot_run() -> None:
    name, backend = make_attention("auto", SPEC, 64, BLOCK, torch.float32, CPU)
    assert name == "torch" and isinstance(backend, TorchPagedAttention)


def test_flashinfer_where_it_cannot_run_is_refused_with_the_reason() -> None:
    with pytest.raises(InvalidInputError, match="cannot run here: the device is cpu, not cuda"):
        make_attention("flashinfer", SPEC, 64, BLOCK, torch.bfloat16, CPU)


@pytest.mark.parametrize(
    ("dtype", "head_dim", "reason"),
    [
        (torch.float32, 128, "the model runs in torch.float32, not float16 or bfloat16"),
        (torch.bfloat16, 16, "head size 16 is not one of (64, 128, 256)"),
    ],
)
def test_flashinfer_names_what_does_not_fit_on_a_cuda_device(
    dtype: torch.dtype, head_dim: int, reason: str
) -> None:
    spec = AttentionSpec(2, 8, 2, head_dim, head_dim**-0.5)
    assert flashinfer_unfit(spec, dtype, torch.device("cuda")) == reason


@pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is not None, reason="flashinfer is installed here"
)
def test_flashinfer_missing_is_named() -> None:
    unfit = flashinfer_unfit(SPEC, torch.bfloat16, torch.device("cuda"))
    assert unfit == "the flashinfer-python package is not installed"


def test_an_unknown_backend_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="unknown attention backend 'flash'"):
        make_attention("flash", SPEC, 64, BLOCK, torch.float32, CPU)


def _step(
    tables: list[list[int]], contexts: list[int], queries: list[int], device: torch.device
) -> AttentionMetadata:
    """A step whose sequence i computes its last queries[i] of contexts[i] positions."""
    slots, starts = [], [0]
    for table, ctx, q in zip(tables, contexts, queries, strict=True):
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx - q, ctx)]
        starts.append(starts[-1] + q)
    width = max(map(len, tables))
    padded = [t + [-1] * (width - len(t)) for t in tables]

    def tensor(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return AttentionMetadata(
        slot_mapping=tensor(slots),
        query_start_loc=tensor(starts),
        context_lens=tensor(contexts),
        block_tables=tensor(padded),
        block_size=BLOCK,
        query_lens_cpu=queries,
        context_lens_cpu=contexts,
        block_tables_cpu=padded,
    )


@pytest.mark.skipif(not GPU, reason="needs CUDA and the flashinfer-python package")
def test_flashinfer_attends_as_the_reference_does_over_steps() -> None:
    """A prefix prefill, a prefill after a cached prefix beside fresh prompts (one longer than
    a block, one shorter), then decode steps: every layer's output matches the reference."""
    cuda, dtype = torch.device("cuda"), torch.bfloat16
    slots = 64 * BLOCK
    name, fast = make_attention("flashinfer", SPEC, slots, BLOCK, dtype, cuda)
    reference = TorchPagedAttention(SPEC, slots, dtype, cuda)
    tables = [[3, 9, 4], [10, 11, 12, 13, 14], [20]]
    steps = [([tables[0]], [20], [20])]  # the prefix of sequence 0
    steps.append((tables, [37, 70, 5], [17, 70, 5]))  # 0 resumes after its cached prefix
    steps += [(tables, [38 + i, 71 + i, 6 + i], [1, 1, 1]) for i in range(3)]
    generator = torch.Generator(device=cuda).manual_seed(0)
    for step_tables, contexts, queries in steps:
        meta = _step(step_tables, contexts, queries, cuda)
        fast.plan(meta)
        reference.plan(meta)
        tokens = sum(queries)
        for layer in range(SPEC.num_layers):
            q, kv, rotary = (
                torch.randn(shape, generator=generator, device=cuda).to(dtype)
                for shape in (
                    (tokens, SPEC.num_heads, SPEC.head_dim),
                    (tokens, 2, SPEC.num_kv_heads, SPEC.head_dim),
                    (tokens, 2, SPEC.head_dim),
                )
            )
            index = torch.tensor(layer)
            got = fast.attend(index, q, kv, rotary)
            want = reference.attend(index, q, kv, rotary)
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert name == "flashinfer"


def test_the_cli_offers_exactly_the_backends_the_engine_knows() -> None:
    from flare.serve.commands import Attention

    assert sorted(a.value for a in Attention) == sorted(ATTENTION_KINDS)
