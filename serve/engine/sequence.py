"""A request's state as the engine sees it: its tokens, sampling settings and KV blocks."""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

MAX_LOGPROBS = 20
"""The most top alternatives a request may ask for (the OpenAI API's limit)."""


@dataclass
class SamplingParams:
    """How to pick tokens: temperature 0 (or below the sampler's GREEDY_BELOW) is greedy;
    `seed` makes sampling reproducible.

    Checked when made and again when submitted (fields may be set in between)."""

    max_tokens: int | None = None
    """None: up to the context length."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1: no top-k cut."""
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None
    """None: no logprobs; N: the chosen token's logprob plus the N most likely tokens."""
    ignore_eos: bool = False
    """Keep generating past end-of-sequence tokens (benchmarks, reference comparisons)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first setting out of range."""
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be >= 1, or 0 or -1 for no cut; got {self.top_k}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability and the `top` most likely tokens with theirs."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()
PENDING = -1
"""The id a pending token holds until it is resolved: no model has it, so a step that took it
as input instead of the device's value would fail rather than compute with a wrong token."""


class BlockTable:
    """A sequence's KV blocks in order, kept twice: as a list of ids (what scheduling and a
    step's input lists read), and as the same ids at the front of an int32 array that grows
    with it, doubling, which a CUDA-graph decode step joins into its page table by numpy
    with no Python work a page (a 4K-token context is 256 pages a sequence: 64 of them cost
    a step 0.34 ms as lists, 21 µs as arrays, on this project's CPU;
    tests/bench/bench_page_table.py). It only grows, by `append` and `extend`."""

    def __init__(self, ids: Iterable[int] = ()) -> None:
        self.ids = list(ids)
        self._array = np.zeros(max(MIN_BLOCKS, 2 * len(self.ids)), dtype=np.int32)
        self._array[: len(self.ids)] = self.ids

    def append(self, block_id: int) -> None:
        """One id at the end (a decode step's new block: a scalar write, no list made)."""
        count = len(self.ids)
        self._reserve(count + 1)
        self._array[count] = block_id
        self.ids.append(block_id)

    def extend(self, block_ids: list[int]) -> None:
        """The ids at the end (a prompt's blocks come in one call: an 8K-token prompt's
        512)."""
        count = len(self.ids)
        self._reserve(count + len(block_ids))
        self._array[count : count + len(block_ids)] = block_ids
        self.ids.extend(block_ids)

    def _reserve(self, length: int) -> None:
        """Room for `length` ids in the array, doubled as often as that needs."""
        if length > len(self._array):
            grown = np.zeros(max(length, 2 * len(self._array)), dtype=np.int32)
            grown[: len(self.ids)] = self._array[: len(self.ids)]
            self._array = grown

    def pages(self, count: int) -> np.ndarray:
        """The first `count` ids as int32: a view, to be copied before the table grows."""
        if count > len(self.ids):
            raise ValueError(f"{count} pages asked of a block table of {len(self.ids)}")
        return self._array[:count]


MIN_BLOCKS = 8
"""A block table's first array length."""


def join_pages(tables: list[BlockTable], counts: list[int], out: np.ndarray) -> None:
    """Each table's first counts[i] ids, one table after another, into `out` (int32, exactly
    that long): a decode step's page indices, joined by numpy, nothing done a page."""
    np.concatenate([t.pages(n) for t, n in zip(tables, counts, strict=True)], out=out)


class Sequence:
    """One request: prompt and output tokens, the blocks holding their KV, its RNG."""

    def __init__(self, prompt: list[int], params: SamplingParams, max_tokens: int) -> None:
        self.id = next(_ids)
        self.token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.params = params
        self.max_tokens = max_tokens
        self.status = Status.WAITING
        self.kv_table = BlockTable()
        """Its KV blocks, which the block manager hands out (it grows them by `append`, and
        replaces them whole when it allocates or frees)."""
        self.num_cached_tokens = 0
        """Leading tokens whose KV was found in the prefix cache at admission."""
        self.generator = _generator(params.seed)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def block_table(self) -> list[int]:
        """Its KV blocks' ids, in order (read it; `kv_table` is what grows)."""
        return self.kv_table.ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def append(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    @property
    def pending(self) -> bool:
        """Whether the newest token is a placeholder: sampled by a step still on the device,
        whose value the next step reads there (the engine's overlap) and the host learns
        when that step lands (`resolve`)."""
        ids = self.token_ids
        return bool(ids) and ids[-1] == PENDING

    def append_pending(self) -> None:
        """Count the token a step in flight is sampling, before its value is known."""
        self.token_ids.append(PENDING)

    def resolve(self, token_id: int) -> None:
        """The pending token's value, now read from the device."""
        self.token_ids[-1] = token_id

    def block_tokens(self, index: int, block_size: int) -> list[int]:
        """The token ids that block `index` of this sequence holds."""
        return self.token_ids[index * block_size : (index + 1) * block_size]

    def num_blocks(self, block_size: int) -> int:
        return -(-len(self.token_ids) // block_size)


def _generator(seed: int | None) -> torch.Generator | None:
    """A CPU generator for seeded requests; unseeded ones draw from torch's global RNG."""
    if seed is None:
        return None
    return torch.Generator().manual_seed(seed)
