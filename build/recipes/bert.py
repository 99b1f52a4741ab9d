"""BERT encoders in the sentence-transformers layout (modules.json, a pooling config)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from flare.build.recipes.base import ARTIFACT_KINDS, Expected
from flare.errors import InvalidInputError
from flare.model_sizes import read_sizes

SENTENCE_TRANSFORMERS_FILES = (
    "modules.json",
    "config_sentence_transformers.json",
    "sentence_bert_config.json",
)


class BertRecipe:
    name = "bert"
    version = 1
    architectures = ("BertModel",)
    compiled_forward = False

    def check_ranks(self, config: Mapping[str, Any], ranks: int) -> None:
        if ranks != 1:
            raise InvalidInputError(
                f"the bert recipe builds for one rank, not {ranks}", "use --ranks 1"
            )

    def expected(self, config: Mapping[str, Any], ranks: int) -> dict[str, Expected]:
        sizes = read_sizes(self.name, config)
        hidden, inter = sizes["hidden_size"], sizes["intermediate_size"]
        positions = sizes["max_position_embeddings"]
        tensors = {
            "embeddings.word_embeddings.weight": Expected((sizes["vocab_size"], hidden)),
            "embeddings.position_embeddings.weight": Expected((positions, hidden)),
            "embeddings.token_type_embeddings.weight": Expected((sizes["type_vocab_size"], hidden)),
            "embeddings.LayerNorm.weight": Expected((hidden,)),
            "embeddings.LayerNorm.bias": Expected((hidden,)),
            "embeddings.position_ids": Expected((1, positions), optional=True),
            "pooler.dense.weight": Expected((hidden, hidden), optional=True),
            "pooler.dense.bias": Expected((hidden,), optional=True),
        }
        for i in range(sizes["num_hidden_layers"]):
            p = f"encoder.layer.{i}."
            for part in ("query", "key", "value"):
                tensors[f"{p}attention.self.{part}.weight"] = Expected((hidden, hidden))
                tensors[f"{p}attention.self.{part}.bias"] = Expected((hidden,))
            tensors |= {
                p + "attention.output.dense.weight": Expected((hidden, hidden)),
                p + "attention.output.dense.bias": Expected((hidden,)),
                p + "attention.output.LayerNorm.weight": Expected((hidden,)),
                p + "attention.output.LayerNorm.bias": Expected((hidden,)),
                p + "intermediate.dense.weight": Expected((inter, hidden)),
                p + "intermediate.dense.bias": Expected((inter,)),
                p + "output.dense.weight": Expected((hidden, inter)),
                p + "output.dense.bias": Expected((hidden,)),
                p + "output.LayerNorm.weight": Expected((hidden,)),
                p + "output.LayerNorm.bias": Expected((hidden,)),
            }
        return tensors

    def ignores(self, tensor_name: str) -> bool:
        return False

    def fused(self, tensor_names: Collection[str]) -> dict[str, tuple[str, ...]]:
        return {}

    def artifact_kind(self, path: str) -> str | None:
        if path in SENTENCE_TRANSFORMERS_FILES or path.endswith("_Pooling/config.json"):
            return "sentence_transformers"
        return ARTIFACT_KINDS.get(path)
