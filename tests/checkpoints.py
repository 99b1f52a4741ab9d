"""Tiny real checkpoints for tests: seeded random weights in the Hugging Face layout, saved by
transformers itself, with the BPE tokenizer flare's tiny model trains on a few KB of text."""

from __future__ import annotations

from pathlib import Path

from flare.build.tiny import write_tokenizer


def make_llama(
    folder: Path,
    architecture: str = "LlamaForCausalLM",
    layers: int = 2,
    hidden: int = 64,
    heads: int = 8,
    kv_heads: int = 4,
    intermediate: int = 128,
    seed: int = 0,
    shard_size: str | None = None,
) -> Path:
    """A seeded random Llama-family checkpoint; sharded when shard_size is given."""
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(folder)
    vocab += -vocab % 8  # divisible by every rank count the tests use
    config_class = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "MistralForCausalLM": transformers.MistralConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
    }[architecture]
    config = config_class(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        architectures=[architecture],
    )
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).eval()
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return folder
