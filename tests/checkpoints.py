"""Tiny real checkpoints for tests: seeded random weights in the Hugging Face layout, saved by
transformers, with a BPE tokenizer trained by `tokenizers` on a few KB of text."""

from __future__ import annotations

from pathlib import Path

TEXT = (
    "flare builds packages from checkpoints. a package is an index and its blobs. "
    "the registry keeps packages on a shared folder, and a server pulls and verifies them. "
    "every blob is named by the digest of its bytes; nothing is trusted by name. "
    "the quick brown fox jumps over the lazy dog while the build resumes where it stopped. "
) * 12

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_tokenizer(folder: Path, vocab_size: int = 256) -> int:
    """Train a byte-level BPE tokenizer, save it in the HF layout; return its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([TEXT], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return tokenizer.get_vocab_size()


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
    vocab = train_tokenizer(folder)
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


def make_synthetic_llama(
    folder: Path,
    target_bytes: int,
    layers: int = 4,
    heads: int = 8,
    kv_heads: int = 4,
    seed: int = 0,
) -> Path:
    """A Llama-shaped checkpoint of about `target_bytes` of seeded random bf16 weights.

    Written directly (no model is instantiated), so gigabyte checkpoints take seconds; the
    tokenizer is a trained one, so the folder is a complete checkpoint.
    """
    import json
    import math

    import numpy as np

    from flare.store.safetensors import encode_header

    folder.mkdir(parents=True, exist_ok=True)
    vocab = train_tokenizer(folder)
    vocab += -vocab % 8
    # bf16 bytes = 2 * (2 * vocab * h + 12 * layers * h^2) with kv = h/2 and intermediate = 3h
    a, b = 24 * layers, 4 * vocab
    hidden = max(64, int((-b + math.sqrt(b * b + 4 * a * target_bytes)) / (2 * a)) // 64 * 64)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    specs = _llama_specs(config)
    rng = np.random.default_rng(seed)
    with open(folder / "model.safetensors", "wb") as handle:
        handle.write(encode_header(specs, {"format": "pt"}))
        for spec in specs:
            handle.write(rng.bytes(spec.nbytes))
    return folder


def _llama_specs(config: dict) -> list:
    from flare.store.safetensors import TensorSpec

    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    shapes = {
        "model.embed_tokens.weight": (vocab, h),
        "lm_head.weight": (vocab, h),
        "model.norm.weight": (h,),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    return [TensorSpec(name, "BF16", shape) for name, shape in sorted(shapes.items())]
