"""Attention as one opaque operator, so a compiled forward is one graph for every batch.

A compiled forward must not see inside attention: the torch backend loops over the step's
sequences in Python and FlashInfer plans on the host, so tracing either would specialize the
graph on the batch and compile again for the next one. `flare::paged_attention` is a custom
operator the compiler keeps as a call; it runs the backend bound to the calling thread (each
engine steps on its own thread), as vLLM's attention operator reads its forward context. The
KV cache is the backend's, so the operator's only visible effect is its output.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from flare.serve.engine.attention import AttentionBackend

_bound = threading.local()


@torch.library.custom_op("flare::paged_attention", mutates_args=())
def paged_attention(
    q: torch.Tensor, kv: torch.Tensor, rotary: torch.Tensor, layer: torch.Tensor
) -> torch.Tensor:
    """The bound backend's `attend` for one layer (q [tokens, heads, dim] out, contiguous)."""
    backend: AttentionBackend | None = getattr(_bound, "backend", None)
    if backend is None:
        raise RuntimeError("flare::paged_attention ran outside bound_attention()")
    return backend.attend(layer, q, kv, rotary)


@paged_attention.register_fake
def _shape(
    q: torch.Tensor, kv: torch.Tensor, rotary: torch.Tensor, layer: torch.Tensor
) -> torch.Tensor:
    return q.new_empty(q.shape)


class OperatorAttention:
    """What a compiled forward passes to the model as its attention: every call goes through
    the operator, whichever backend is bound when the graph runs (the runner plans that
    backend before the step, as it does for an eager forward)."""

    def attend(
        self, layer: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, rotary: torch.Tensor
    ) -> torch.Tensor:
        return torch.ops.flare.paged_attention(q, kv, rotary, layer)


@contextmanager
def bound_attention(backend: AttentionBackend) -> Iterator[None]:
    """Run the operator on `backend` in this thread for the length of the block."""
    previous = getattr(_bound, "backend", None)
    _bound.backend = backend
    try:
        yield
    finally:
        _bound.backend = previous
