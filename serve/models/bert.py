"""BERT encoders with sentence-transformers pooling: sentence embeddings, no KV cache.

Parameter names follow the checkpoint (`embeddings.*`, `encoder.layer.N.*`). Pooling and
normalization come from the package's modules.json and `*_Pooling/config.json`, as
sentence-transformers applies them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flare.errors import InvalidInputError
from flare.serve.models.files import load_by_name


@dataclass(frozen=True)
class Pooling:
    """How token states become one vector: "mean" (over real tokens) or "cls"; then L2?"""

    mode: str = "mean"
    normalize: bool = False

    @classmethod
    def from_files(cls, modules: list[dict[str, Any]], pooling: dict[str, Any] | None) -> Pooling:
        kinds = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
        settings = pooling or {}
        modes = [mode for key, mode in _POOLING_MODES.items() if settings.get(key)]
        if len(modes) > 1 or any(settings.get(k) for k in _UNSUPPORTED_POOLING):
            raise InvalidInputError(
                "this runtime pools by the mean or the cls token only, one of them",
                "check the package's pooling config",
            )
        return cls(modes[0] if modes else "mean", "Normalize" in kinds)


_POOLING_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean"}
_UNSUPPORTED_POOLING = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
    "pooling_mode_lasttoken",
)


class Embeddings(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.word_embeddings = nn.Embedding(config["vocab_size"], hidden)
        self.position_embeddings = nn.Embedding(config["max_position_embeddings"], hidden)
        self.token_type_embeddings = nn.Embedding(config.get("type_vocab_size", 2), hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=config["layer_norm_eps"])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)[None]
        return self.LayerNorm(x + self.token_type_embeddings.weight[0])


class Dense(nn.Module):
    """`dense` then, where it has one, a residual `LayerNorm` (BERT's output blocks)."""

    def __init__(self, inputs: int, outputs: int, eps: float | None) -> None:
        super().__init__()
        self.dense = nn.Linear(inputs, outputs)
        if eps is not None:
            self.LayerNorm = nn.LayerNorm(outputs, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        x = self.dense(x)
        return x if residual is None else self.LayerNorm(x + residual)


class SelfAttention(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.heads = config["num_attention_heads"]
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.heads, -1).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(batch, length, hidden)


class AttentionBlock(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.self = SelfAttention(config)
        hidden = config["hidden_size"]
        self.output = Dense(hidden, hidden, config["layer_norm_eps"])

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, mask), x)


class EncoderLayer(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        if config.get("hidden_act", "gelu") != "gelu":
            raise InvalidInputError(f"BERT activation {config['hidden_act']!r} is not supported")
        hidden, inter = config["hidden_size"], config["intermediate_size"]
        self.attention = AttentionBlock(config)
        self.intermediate = Dense(hidden, inter, None)
        self.output = Dense(inter, hidden, config["layer_norm_eps"])

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, mask)
        return self.output(F.gelu(self.intermediate(x)), x)


class Encoder(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.layer = nn.ModuleList(EncoderLayer(config) for _ in range(config["num_hidden_layers"]))


class BertEmbedder(nn.Module):
    """Token ids of a padded batch → one pooled (and maybe normalized) vector per row."""

    def __init__(self, config: dict[str, Any], pooling: Pooling) -> None:
        super().__init__()
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)
        self.pooling = pooling
        self.context_length = config["max_position_embeddings"]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """input_ids, attention_mask: [batch, length]; the mask is 1 on real tokens."""
        keys = attention_mask.bool()[:, None, None, :]
        x = self.embeddings(input_ids)
        for layer in self.encoder.layer:
            x = layer(x, keys)
        pooled = self._pool(x, attention_mask)
        return F.normalize(pooled, p=2, dim=-1) if self.pooling.normalize else pooled

    def _pool(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if self.pooling.mode == "cls":
            return x[:, 0]
        weights = attention_mask.to(x.dtype)[:, :, None]
        return (x * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's pooler and position ids are not used by sentence embeddings."""
        load_by_name(self, tensors, ignore=_unused)


def _unused(name: str) -> bool:
    return name.startswith("pooler.") or name.endswith("position_ids")
