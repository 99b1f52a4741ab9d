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
