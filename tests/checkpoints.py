"""Tiny real checkpoints for tests: seeded random weights in the Hugging Face layout, saved by
transformers itself, with the BPE tokenizer flare's tiny model trains on a few KB of text; and
large synthetic ones (random bytes, Llama-shaped) for the multi-rank tests and the benchmarks."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from flare.build.tiny import llama_config, write_llama, write_tokenizer


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


def make_synthetic_llama(folder: Path, target_bytes: int, layers: int = 4, seed: int = 0) -> Path:
    """A Llama-shaped checkpoint of about `target_bytes` of random bytes: the build's work
    without a model's (nothing here needs the weights to compute).

    bf16 bytes = 2 * (2 * vocab * h + 12 * layers * h^2), with kv = h/2 and intermediate = 3h.
    """
    vocab = write_tokenizer(folder)
    vocab += -vocab % 8
    a, b = 24 * layers, 4 * vocab
    hidden = max(64, int((-b + math.sqrt(b * b + 4 * a * target_bytes)) / (2 * a)) // 64 * 64)
    rng = np.random.default_rng(seed)
    config = llama_config(vocab, hidden, layers, 8, 4)
    return write_llama(folder, config, lambda spec: rng.bytes(spec.nbytes))
