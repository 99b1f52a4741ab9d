"""The Llama family (Llama, Mistral, Qwen2, Qwen3): layout and tensor-parallel splits.

Column-parallel: q/k/v, gate/up, embeddings and lm_head split on dim 0 (heads, intermediate
rows, vocab rows). Row-parallel: o_proj and down_proj split on dim 1. Norms (and the biases
added after a row-parallel sum) are replicated. GQA: key/value heads split like query heads,
so every rank keeps whole heads.

Version 2 lays the payloads out as the runtime computes: each layer's q, k, v as one
`self_attn.qkv_proj` and gate, up as one `mlp.gate_up_proj` (weights, and biases where the
checkpoint has them), so a step runs one matmul where it ran three and two. With ranks, rank
R's fused tensor is q_R, k_R, v_R one after another: its heads stay whole.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any

from flare.build.recipes.base import Expected, check_divides, default_artifact_kind
from flare.model_sizes import read_sizes
from flare.store.safetensors import FormatError

SUPPORTED_RANKS = (1, 2, 4, 8)
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
"""Each layer's fused projection → the checkpoint's projections it is made of, in row order."""
_LAYER = re.compile(r"^model\.layers\.\d+\.")


class LlamaRecipe:
    name = "llama"
    version = 2
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
                p + "self_attn.o_proj.bias": Expected((hidden,), optional=True),
                p + "mlp.gate_proj.weight": Expected((inter, hidden), 0),
                p + "mlp.up_proj.weight": Expected((inter, hidden), 0),
                p + "mlp.down_proj.weight": Expected((hidden, inter), 1),
                p + "mlp.gate_proj.bias": Expected((inter,), 0, optional=True),
                p + "mlp.up_proj.bias": Expected((inter,), 0, optional=True),
                p + "mlp.down_proj.bias": Expected((hidden,), optional=True),
            }
            if qwen3:
                tensors |= {
                    p + "self_attn.q_norm.weight": Expected((head_dim,)),
                    p + "self_attn.k_norm.weight": Expected((head_dim,)),
                }
        return tensors

    def ignores(self, tensor_name: str) -> bool:
        return tensor_name.endswith("rotary_emb.inv_freq")  # a buffer older exports saved

    def fused(self, tensor_names: Collection[str]) -> dict[str, tuple[str, ...]]:
        """Every layer's qkv_proj and gate_up_proj weight, and bias where the parts have one;
        parts that have a bias only in part cannot be one tensor, and are refused."""
        layers = sorted({m[0] for name in tensor_names if (m := _LAYER.match(name))})
        fused: dict[str, tuple[str, ...]] = {}
        for prefix in layers:
            for whole, parts in FUSED.items():
                for kind in ("weight", "bias"):
                    names = tuple(f"{prefix}{part}.{kind}" for part in parts)
                    held = [name in tensor_names for name in names]
                    if all(held):
                        fused[f"{prefix}{whole}.{kind}"] = names
                    elif any(held):
                        raise FormatError(
                            f"the checkpoint holds {names[held.index(True)]} but not "
                            f"{names[held.index(False)]}",
                            f"{', '.join(names)} go together: give all or none",
                        )
        return fused

    def artifact_kind(self, path: str) -> str | None:
        return default_artifact_kind(path)
