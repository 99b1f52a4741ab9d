"""The rotary table: transformers' cos and sin, made once, in the model's dtype."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.llama import modeling_llama as hf_llama

from flare.serve.models.llama import Rotary

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _config(scaling: dict | None) -> dict:
    return {
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rope_theta": 500000.0,
        "rope_scaling": scaling,
    }


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["default", "llama3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_table_is_transformers_cos_and_sin_in_the_models_dtype(
    scaling: dict | None, dtype: torch.dtype
) -> None:
    """Built on the meta device and materialized as a served model is: every position's cos
    and sin equal transformers' rotary embedding cast to the model's dtype, bitwise."""
    config = _config(scaling)
    with torch.device("meta"):
        rotary = Rotary(config, 64)
    rotary = rotary.to_empty(device="cpu").to(dtype)
    positions = torch.tensor([0, 1, 7, 63, 64, 300, 511])
    cos, sin = rotary(positions).unbind(1)
    reference = hf_llama.LlamaRotaryEmbedding(transformers.LlamaConfig(**config))
    want_cos, want_sin = reference(torch.zeros(1, dtype=dtype), positions[None, :])
    assert cos.dtype == sin.dtype == dtype
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])


def test_a_move_remakes_the_table_from_the_float32_frequencies() -> None:
    """A model rounded to bf16 then moved back to float32 has float32's table, not bf16's
    values widened; a move of device alone keeps the table's dtype."""
    rotary = Rotary(_config(None), 64).to(torch.bfloat16)
    assert rotary.table.dtype == torch.bfloat16
    assert rotary.to("cpu").table.dtype == torch.bfloat16
    exact = Rotary(_config(None), 64).to(torch.float32).table
    assert exact.dtype == torch.float32
    assert torch.equal(rotary.to(torch.float32).table, exact)
    assert not torch.equal(exact.to(torch.bfloat16).float(), exact)  # the rounding it avoided
