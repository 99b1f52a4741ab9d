"""The Llama family (Llama, Mistral, Qwen2, Qwen3): layout and tensor-parallel splits.

Column-parallel: q/k/v, gate/up, embeddings and lm_head split on dim 0 (heads, intermediate
rows, vocab rows). Row-parallel: o_proj and down_proj split on dim 1. Norms are replicated.
GQA: key/value heads split like query heads, so every rank keeps whole heads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flare.build.recipes.base import Expected, check_divides, default_artifact_kind
from flare.model_sizes import read_sizes

SUPPORTED_RANKS = (1, 2, 4, 8)


class LlamaRecipe:
    name = "llama"
    version = 1
    architectures = (
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    )
    compiled_forward = True

    def check_ranks(self, config: Mapping[str, Any], ranks: int) -> None:
        sizes = read_sizes(self.name, config)
        keys = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
        check_divides({key: sizes[key] for key in keys}, ranks, SUPPORTED_RANKS)

    def expected(self, config: Mapping[str, Any], ranks: int) -> dict[str, Expected]:
        sizes = read_sizes(self.name, config)
        hidden, heads, kv_heads = (
            sizes["hidden_size"],
            sizes["num_attention_heads"],
            sizes["num_key_value_heads"],
        )
        head_dim, inter, vocab = sizes["head_dim"], sizes["intermediate_size"], sizes["vocab_size"]
        vocab_dim = 0 if vocab % ranks == 0 else None
        qwen3 = config.get("architectures", [None])[0] == "Qwen3ForCausalLM"
        tensors = {
            "model.embed_tokens.weight": Expected((vocab, hidden), vocab_dim),
            "model.norm.weight": Expected((hidden,)),
            "lm_head.weight": Expected(
                (vocab, hidden), vocab_dim, optional=bool(config.get("tie_word_embeddings"))
            ),
        }
        for i in range(sizes["num_hidden_layers"]):
            p = f"model.layers.{i}."
            q, kv = heads * head_dim, kv_heads * head_dim
            tensors |= {
                p + "input_layernorm.weight": Expected((hidden,)),
                p + "post_attention_layernorm.weight": Expected((hidden,)),
                p + "self_attn.q_proj.weight": Expected((q, hidden), 0),
                p + "self_attn.k_proj.weight": Expected((kv, hidden), 0),
                p + "self_attn.v_proj.weight": Expected((kv, hidden), 0),
                p + "self_attn.q_proj.bias": Expected((q,), 0, optional=True),
                p + "self_attn.k_proj.bias": Expected((kv,), 0, optional=True),
                p + "self_attn.v_proj.bias": Expected((kv,), 0, optional=True),
                p + "self_attn.o_proj.weight": Expected((hidden, q), 1),
                p + "mlp.gate_proj.weight": Expected((inter, hidden), 0),
                p + "mlp.up_proj.weight": Expected((inter, hidden), 0),
                p + "mlp.down_proj.weight": Expected((hidden, inter), 1),
            }
            if qwen3:
                tensors |= {
                    p + "self_attn.q_norm.weight": Expected((head_dim,)),
                    p + "self_attn.k_norm.weight": Expected((head_dim,)),
                }
        return tensors

    def ignores(self, tensor_name: str) -> bool:
        return tensor_name.endswith("rotary_emb.inv_freq")  # a buffer older exports saved

    def artifact_kind(self, path: str) -> str | None:
        return default_artifact_kind(path)
