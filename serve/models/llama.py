"""The Llama family forward (Llama, Mistral, Qwen2, Qwen3) over the paged KV cache.

Module and parameter names follow the Hugging Face checkpoints, so payload tensors load by
name, except two fused projections per layer, which a recipe-v2 package lays out as such:
`self_attn.qkv_proj` (q, k, v rows one after another: one matmul, then a split) and
`mlp.gate_up_proj` (gate, up rows: one matmul, then silu(gate) * up). A package built before
(recipe v1: q_proj, k_proj, v_proj, gate_proj, up_proj) loads into the same parameters, each
part into its rows (serve/models/fused.py). Family differences are config switches: Qwen2's
q/k/v biases, Qwen3's per-head q/k RMSNorm, Llama's `attention_bias`/`mlp_bias`, llama3 RoPE
scaling, tied embeddings. Matrix products go through `linear` (serve/models/linear.py): on
CUDA, a decode step's products of few rows run flare's own kernel.

Tensor parallel (serve/models/shard.py): with a `Shard` of N ranks, each rank holds whole
query and KV heads (heads / N, KV heads / N: the build refuses KV heads that N does not
divide), gate/up rows and down columns (intermediate / N), and where the package splits the
vocabulary, vocab / N rows of embed_tokens and lm_head. o_proj and down_proj are row-parallel
(a partial sum per rank, all-reduced, the bias added once after); the embedding is a masked
lookup all-reduced; the logits are all-gathered. Parameter shapes are the rank's part, so the
payload parts load by name as whole tensors do (a fused part is the rank's q, k, v parts in
turn: the same rows the split parts of a v1 package fill).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flare.errors import InvalidInputError
from flare.serve.engine.attention import AttentionBackend, AttentionSpec
from flare.serve.models.activation import silu_mul
from flare.serve.models.files import load_by_name
from flare.serve.models.fused import FusedRows, Parts
from flare.serve.models.linear import linear
from flare.serve.models.rms_norm import RMSNorm
from flare.serve.models.shard import Shard

MAX_CONTEXT = 131072
"""Cap on the advertised context when a config claims more."""


class Rotary(nn.Module):
    """Rotary position embedding (the half-split layout of Hugging Face checkpoints), looked
    up rather than computed per step: cos and sin of every position the model serves, made
    once where the model is materialized, in float32 as transformers makes them, and kept in
    the model's dtype, which transformers rounds them to before use. A step gathers its
    positions' rows, which each layer's attention applies as it stores the keys
    (serve/engine/cache_store.py; computed in the step, Inductor made four kernels a layer of
    them)."""

    def __init__(self, config: dict[str, Any], head_dim: int) -> None:
        super().__init__()
        rope = rope_parameters(config)
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        inv_freq = 1.0 / (rope.get("rope_theta", 10000.0) ** exponents)
        if rope.get("rope_type", "default") == "llama3":
            inv_freq = _llama3_frequencies(inv_freq, rope)
        elif rope.get("rope_type", "default") != "default":
            raise InvalidInputError(
                f"RoPE scaling {rope['rope_type']!r} is not supported", "supported: default, llama3"
            )
        self.inv_freq = inv_freq
        """A plain float32 attribute, not a buffer: models are built on the meta device, then
        materialized empty, which would leave a buffer's values undefined, and `.to(dtype)`
        would round a buffer to bfloat16."""
        self.length = context_length(config)
        self.table = torch.empty(0, device="cpu")
        """[length, 2 (cos, sin), head_dim]: made by `_apply`, where the frequencies go."""

    def _apply(self, fn: Any, recurse: bool = True) -> Rotary:
        """Follow the module's moves (`materialize`, `to_empty`, `.to(device)`,
        `.to(dtype)`): the float32 frequencies to the new device, and the table there in its
        new dtype, cast from a float32 table where there is one, else made from the
        frequencies (never widened from one already rounded), before anything is compiled, as
        a compiled forward's guards expect. A load (`materialize`) makes it in float32 once
        and casts it once."""
        probe = fn(torch.empty(0, dtype=self.table.dtype, device=self.table.device))
        self.inv_freq = self.inv_freq.to(probe.device)
        exact = self.table.numel() > 0 and self.table.dtype == torch.float32
        self.table = (self.table if exact else self._cos_sin()).to(probe.device, probe.dtype)
        return super()._apply(fn, recurse)

    def _cos_sin(self) -> torch.Tensor:
        positions = torch.arange(self.length, dtype=torch.float32, device=self.inv_freq.device)
        freqs = positions[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()  # each half of a row repeats the other
        return torch.stack((torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)), dim=1)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """[tokens, 2 (cos, sin), head_dim]: one tensor, so a compiled layer takes it as one
        input rather than two views of a base (which its compiler would treat as aliases)."""
        return self.table[positions]


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings from either config layout: transformers 5's `rope_parameters`, or the
    older top-level `rope_theta` with a `rope_scaling` dict (`type` in the oldest)."""
    merged = {"rope_theta": config.get("rope_theta", 10000.0)}
    merged |= config.get("rope_scaling") or {}
    merged |= config.get("rope_parameters") or {}
    merged.setdefault("rope_type", merged.get("type", "default"))
    return merged


def _llama3_frequencies(inv_freq: torch.Tensor, rope: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's scaling: long wavelengths divided by `factor`, short ones kept, a smooth
    blend in between."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= old_context / high) & (wavelength <= old_context / low)
    return torch.where(medium, blended, scaled)


class RowParallelLinear(nn.Module):
    """A linear layer whose input features are split across ranks: each rank's partial
    product is summed over ranks, then the (whole) bias is added once."""

    def __init__(self, inputs: int, outputs: int, bias: bool, shard: Shard) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(outputs, inputs))
        self.bias = nn.Parameter(torch.empty(outputs)) if bias else None
        self.shard = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.shard.all_reduce(linear(x, self.weight, None))
        return out if self.bias is None else out + self.bias


class Attention(nn.Module):
    def __init__(self, config: dict[str, Any], layer: int, shard: Shard) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        heads = config["num_attention_heads"]
        self.heads = shard.part(heads, "num_attention_heads")
        kv_heads = config.get("num_key_value_heads", heads)
        self.kv_heads = shard.part(kv_heads, "KV heads")
        self.head_dim = head_dim(config)
        self.layer = torch.tensor(layer, device="cpu")
        """The layer's index as a tensor (a plain attribute, which no move of the module
        takes off the CPU): a compiled layer's graph takes it as an input, where an int
        would be a constant it was traced for, so one graph serves every layer."""
        qkv_bias = bool(config.get("attention_bias")) or _is_qwen2(config)
        o_bias = bool(config.get("attention_bias")) and not _is_qwen2(config)
        kv = self.kv_heads * self.head_dim
        self.sizes = (self.heads * self.head_dim, kv, kv)
        self.qkv_proj = nn.Linear(hidden, sum(self.sizes), bias=qkv_bias)
        self.o_proj = RowParallelLinear(self.heads * self.head_dim, hidden, o_bias, shard)
        if _is_qwen3(config):
            self.q_norm = RMSNorm(self.head_dim, config["rms_norm_eps"])
            self.k_norm = RMSNorm(self.head_dim, config["rms_norm_eps"])

    def forward(
        self,
        x: torch.Tensor,
        rotary: torch.Tensor,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        """Attention takes the queries and the new keys and values unrotated, as the q/k/v
        product leaves them (the keys and values side by side, [tokens, 2, kv_heads, dim]),
        and rotates the queries and keys as it stores the keys and values: one kernel on
        CUDA (serve/engine/cache_store.py)."""
        heads, kv_heads = self.heads, self.kv_heads
        qkv = linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        qkv = qkv.view(-1, heads + 2 * kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k, v = qkv.split((heads, kv_heads, kv_heads), dim=1)
            qkv = torch.cat((self.q_norm(q), self.k_norm(k), v), dim=1)
        q, kv = qkv.split((heads, 2 * kv_heads), dim=1)
        out = attention.attend(self.layer, q, kv.unflatten(1, (2, kv_heads)), rotary)
        return self.o_proj(out.reshape(-1, heads * self.head_dim))

    def fused_rows(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """The fused projection's checkpoint parts and this rank's rows of each, in order."""
        return {"qkv_proj": tuple(zip(("q_proj", "k_proj", "v_proj"), self.sizes, strict=True))}


class MLP(nn.Module):
    def __init__(self, config: dict[str, Any], shard: Shard) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        inter = shard.part(config["intermediate_size"], "intermediate_size")
        bias = bool(config.get("mlp_bias"))
        self.inter = inter
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        self.down_proj = RowParallelLinear(inter, hidden, bias, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias)
        return self.down_proj(silu_mul(gate_up))

    def fused_rows(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """The fused projection's checkpoint parts and this rank's rows of each, in order."""
        return {"gate_up_proj": (("gate_proj", self.inter), ("up_proj", self.inter))}


class DecoderLayer(nn.Module):
    def __init__(self, config: dict[str, Any], layer: int, shard: Shard) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer, shard)
        self.mlp = MLP(config, shard)
        self.input_layernorm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: torch.Tensor,
        attention: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's output, the residual stream before it): the next layer adds the two as
        it normalizes (`RMSNorm.add`), so each add and norm is one kernel on CUDA. The first
        layer's `x` is the embeddings and its residual None."""
        if residual is None:
            hidden, residual = self.input_layernorm(x), x
        else:
            hidden, residual = self.input_layernorm.add(x, residual)
        x = self.self_attn(hidden, rotary, attention)
        hidden, residual = self.post_attention_layernorm.add(x, residual)
        return self.mlp(hidden), residual


LayerCall = Callable[
    [DecoderLayer, torch.Tensor, torch.Tensor | None, torch.Tensor, AttentionBackend],
    tuple[torch.Tensor, torch.Tensor],
]
"""Runs one decoder layer: (layer, x, residual, rotary rows, attention) → (x, residual)."""


class VocabParallelEmbedding(nn.Module):
    """Embeddings whose rows (the vocabulary) may be split across ranks: each rank looks up
    the ids in its own range, zeros the others, and the sum over ranks is the lookup."""

    def __init__(self, vocab: int, hidden: int, shard: Shard) -> None:
        super().__init__()
        rows = shard.part(vocab, "vocab_size") if shard.split_vocab else vocab
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.start = shard.rank * rows if shard.split_vocab else 0
        self.shard = shard

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.shard.split_vocab:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        found = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.shard.all_reduce(found.masked_fill(outside[:, None], 0))


class LlamaBody(nn.Module):
    """`model.*` of the checkpoint: embeddings, decoder layers, final norm."""

    def __init__(self, config: dict[str, Any], shard: Shard) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config["vocab_size"], config["hidden_size"], shard
        )
        layers = range(config["num_hidden_layers"])
        self.layers = nn.ModuleList(DecoderLayer(config, i, shard) for i in layers)
        self.norm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])
        self.rotary = Rotary(config, head_dim(config))


class LlamaForCausalLM(nn.Module):
    """A generating model for the engine's `CausalLM` interface; with a `Shard`, one rank's
    part of it (the logits it computes are still the whole vocabulary's)."""

    def __init__(self, config: dict[str, Any], shard: Shard | None = None) -> None:
        super().__init__()
        self.shard = shard = shard or Shard()
        self.model = LlamaBody(config, shard)
        self.tied = bool(config.get("tie_word_embeddings"))
        if not self.tied:
            rows = self.model.embed_tokens.weight.shape[0]
            self.lm_head = nn.Linear(config["hidden_size"], rows, bias=False)
        self.vocab_size = config["vocab_size"]
        heads = config["num_attention_heads"]
        self.attention_spec = AttentionSpec(
            num_layers=config["num_hidden_layers"],
            num_heads=shard.part(heads, "num_attention_heads"),
            num_kv_heads=shard.part(config.get("num_key_value_heads", heads), "KV heads"),
            head_dim=head_dim(config),
            scale=head_dim(config) ** -0.5,
        )
        self.context_length = context_length(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionBackend,
        run_layer: LayerCall = nn.Module.__call__,
    ) -> torch.Tensor:
        """Hidden states [tokens, hidden]; each decoder layer runs through `run_layer`
        (a compiled forward passes its compiled layer: one graph for every layer)."""
        rotary = self.model.rotary(positions)
        x, residual = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            x, residual = run_layer(layer, x, residual, rotary, attention)
        return self.model.norm.add(x, residual)[0] if residual is not None else self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        logits = linear(hidden, weight, None)
        return self.shard.all_gather(logits) if self.shard.split_vocab else logits

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy every payload tensor into the parameter of the same name, or a v1 package's
        q/k/v and gate/up parts into their rows of the fused one; all must be set."""
        rows = FusedRows(self, self.fused_parts())
        load_by_name(
            self, rows.place(tensors), ignore=lambda name: name.endswith("rotary_emb.inv_freq")
        )

    def fused_parts(self) -> Parts:
        """Each fused parameter (weight and bias) → its checkpoint parts and this rank's rows
        of each, in row order: what a v1 package gives in parts."""
        parts: Parts = {}
        for i, layer in enumerate(self.model.layers):
            for kind, module in (("self_attn", layer.self_attn), ("mlp", layer.mlp)):
                prefix = f"model.layers.{i}.{kind}."
                for fused, pieces in module.fused_rows().items():
                    for field in ("weight", "bias"):
                        if getattr(getattr(module, fused), field) is not None:
                            parts[f"{prefix}{fused}.{field}"] = tuple(
                                (f"{prefix}{part}.{field}", rows) for part, rows in pieces
                            )
        return parts


def head_dim(config: dict[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def context_length(config: dict[str, Any]) -> int:
    """Positions the model serves: its trained maximum, within a sliding window if it uses
    one (this runtime attends to the whole context, so it must not go past the window)."""
    length = min(config.get("max_position_embeddings", MAX_CONTEXT), MAX_CONTEXT)
    window = config.get("sliding_window")
    if window and config.get("use_sliding_window", True):
        length = min(length, window)
    return length


def _is_qwen2(config: dict[str, Any]) -> bool:
    return config.get("architectures", [None])[0] == "Qwen2ForCausalLM"


def _is_qwen3(config: dict[str, Any]) -> bool:
    return config.get("architectures", [None])[0] == "Qwen3ForCausalLM"
