"""The residual stream of a decoder: its value, and on CUDA its rows' sums of squares.

Each block of a layer normalizes the stream, multiplies it by a weight, and adds its last
product back. On CUDA the product that adds leaves the new stream's sums of squares (a part
a column tile), so the next product normalizes its input as it reads it: no norm kernel
between them (linear.py's `flare::linear_add` and `flare::norm_linear`). Where a product
cannot add in its kernel (a rank's partial product is all-reduced first, or a bias is added
after it) a row kernel adds and leaves the sums (rms_norm.py). Elsewhere (a CPU) the stream
carries no sums and every norm is transformers' RMSNorm of the stream, in torch operations.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from flare.serve.models.linear import kernels_on, linear, tiling
from flare.serve.models.rms_norm import RMSNorm, rms_norm, row_squares


class Stream(NamedTuple):
    value: torch.Tensor
    """[tokens, hidden], the model's dtype."""
    squares: torch.Tensor | None
    """[parts, tokens] float32: the value's rows' sums of squares in parts (added in part
    order), on CUDA; None elsewhere."""


def start(embeddings: torch.Tensor) -> Stream:
    """The stream's first value, the embeddings, and on CUDA their sums of squares."""
    if not kernels_on(embeddings):
        return Stream(embeddings, None)
    return Stream(embeddings, row_squares(embeddings))


def normed_product(stream: Stream, norm: RMSNorm, layer: nn.Linear) -> torch.Tensor:
    """layer(norm(stream)): on CUDA the norm done as the product reads the stream."""
    if stream.squares is None:
        return linear(rms_norm(stream.value, norm.weight, norm.eps), layer.weight, layer.bias)
    out = torch.ops.flare.norm_linear(
        stream.value, stream.squares, norm.weight, norm.eps, layer.weight
    )
    return out if layer.bias is None else out + layer.bias


def add_product(x: torch.Tensor, layer: nn.Module, stream: Stream, gated: bool = False) -> Stream:
    """The stream plus layer(x), a RowParallelLinear (x = [gate | up] and the layer's input
    SiLU(gate) * up where `gated`), with the new stream's sums of squares on CUDA: in the
    product's own kernel where the layer is whole and has no bias."""
    if stream.squares is not None and layer.shard.world == 1 and layer.bias is None:
        return Stream(*torch.ops.flare.linear_add(x, layer.weight, stream.value, gated))
    if gated:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    y = layer(x)
    if stream.squares is None:
        return Stream(y + stream.value, None)
    width = tiling(*layer.weight.shape).block_n
    return Stream(*torch.ops.flare.add_squares(y, stream.value, width))


def final_norm(stream: Stream, norm: RMSNorm) -> torch.Tensor:
    """The last norm, before the logits."""
    if stream.squares is None:
        return rms_norm(stream.value, norm.weight, norm.eps)
    return torch.ops.flare.normalize(stream.value, stream.squares, norm.weight, norm.eps)
