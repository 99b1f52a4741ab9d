"""Which part of a tensor-parallel model this process holds, and the collectives between parts.

A package built with `--ranks N` splits attention heads, MLP rows and (when N divides the
vocabulary) the embeddings and lm_head into N parts (build/recipes/llama.py's table). Rank R
loads part R; the model's forward then needs two collectives per layer and two at the ends:
an all-reduce after each row-parallel projection (o_proj, down_proj) and after the masked
embedding lookup, and an all-gather of the vocabulary-parallel logits. `Shard` carries the
rank, the world and a process group (gloo on CPU, NCCL on CUDA); one rank is the whole model
and every collective is the identity.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Shard:
    """Rank `rank` of `world`; `group` is a torch.distributed process group object (None
    with one rank). `collective_seconds` adds up the time spent in collectives, for
    /metrics and the bench."""

    rank: int = 0
    world: int = 1
    group: Any = None
    split_vocab: bool = False
    """The package splits embed_tokens (and lm_head) by vocabulary rows."""
    collective_seconds: float = field(default=0.0)

    def part(self, size: int, what: str) -> int:
        """This rank's share of `size` (heads, rows): the build split it evenly."""
        if size % self.world:
            raise ValueError(f"{what} ({size}) is not divisible by {self.world} ranks")
        return size // self.world

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place."""
        if self.world == 1:
            return tensor
        started = time.perf_counter()
        self.group.allreduce([tensor]).wait()
        self.collective_seconds += time.perf_counter() - started
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's part, concatenated along the last dimension in rank order."""
        if self.world == 1:
            return tensor
        started = time.perf_counter()
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world)]
        self.group.allgather([parts], [tensor]).wait()
        self.collective_seconds += time.perf_counter() - started
        return torch.cat(parts, dim=-1)
