"""A tiny seeded Llama checkpoint in the Hugging Face layout, for the demo, tests and benchmarks.

Weights are drawn from a seeded normal distribution (bf16), the tokenizer is a byte-level BPE
trained on a few KB of text, and a chat template ships with it, so the folder is a complete
checkpoint that transformers can load too. Nothing is downloaded.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from flare.store.safetensors import TensorSpec, encode_header

CORPUS = (
    "flare builds packages from checkpoints. a package is an index and its blobs. "
    "the registry keeps packages on a shared folder, and a server pulls and verifies them. "
    "every blob is named by the digest of its bytes; nothing is trusted by name. "
    "the quick brown fox jumps over the lazy dog while the build resumes where it stopped. "
) * 12
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>"]


def write_tokenizer(folder: Path, vocab_size: int = 256) -> int:
    """Train a byte-level BPE tokenizer and save it in the HF layout; return its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([CORPUS], trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return tokenizer.get_vocab_size()


def llama_config(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int) -> dict:
    """A complete config.json for a Llama of these sizes."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "bos_token_id": 0,
        "eos_token_id": 0,
    }


def llama_specs(config: dict) -> list[TensorSpec]:
    """Every tensor of a Llama checkpoint with this config, as bf16 (no lm_head where the
    config ties it to the embeddings)."""
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * (h // config["num_attention_heads"])
    shapes = {
        "model.embed_tokens.weight": (vocab, h),
        "lm_head.weight": (vocab, h),
        "model.norm.weight": (h,),
    }
    if config.get("tie_word_embeddings"):
        del shapes["lm_head.weight"]  # the logits are read through the embeddings
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


def _bf16(values: np.ndarray) -> bytes:
    """float32 → bf16 bytes, rounding to nearest even."""
    bits = values.astype(np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).astype(np.uint16).tobytes()


def write_llama(folder: Path, config: dict, tensor_bytes: Callable[[TensorSpec], bytes]) -> Path:
    """config.json and one model.safetensors whose tensors' bytes `tensor_bytes` makes."""
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    specs = llama_specs(config)
    with open(folder / "model.safetensors", "wb") as handle:
        handle.write(encode_header(specs, {"format": "pt"}))
        for spec in specs:
            handle.write(tensor_bytes(spec))
    return folder


def make_tiny_llama(folder: Path, seed: int = 0, hidden: int = 64, layers: int = 2) -> Path:
    """A small model with sane weights (normal, std 0.02; norms at one): it can be served."""
    vocab = write_tokenizer(folder)
    vocab += -vocab % 8
    rng = np.random.default_rng(seed)

    def weights(spec: TensorSpec) -> bytes:
        if len(spec.shape) == 1:
            return _bf16(np.ones(spec.shape))
        return _bf16(rng.normal(0.0, 0.02, spec.shape))

    return write_llama(folder, llama_config(vocab, hidden, layers, 8, 4), weights)
