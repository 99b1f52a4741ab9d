"""Picks each sequence's next token from its logits, with its own settings and RNG.

Greedy rows (temperature 0) take the argmax. Sampled rows are scaled by temperature, cut by
top-k and top-p, and drawn on the CPU with the request's generator when it has a seed, so a
seeded request gives the same tokens on any device and batch. Logprobs are those of the
model's own distribution (before temperature and cuts), as the OpenAI API reports them.
"""

from __future__ import annotations

import torch

from flare.serve.engine.sequence import SamplingParams, Sequence, TokenLogprob


class Sampler:
    def sample(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """One token per row of float32 `logits` [len(seqs), vocab], and its logprobs if asked."""
        chosen = logits.argmax(dim=-1).tolist()
        for row, seq in enumerate(seqs):
            if seq.params.temperature > 0:
                chosen[row] = _draw(logits[row], seq.params, seq.generator)
        return chosen, _logprobs(logits, seqs, chosen)


def _draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    probs = torch.softmax(_cut(logits / params.temperature, params), dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def _cut(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Keep the top_k most likely tokens, then the smallest set whose mass reaches top_p."""
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        ordered, order = torch.sort(logits, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = torch.zeros_like(logits, dtype=torch.bool)
        drop[order] = mass_before >= params.top_p
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _logprobs(
    logits: torch.Tensor, seqs: list[Sequence], chosen: list[int]
) -> list[TokenLogprob | None]:
    wanted = [row for row, seq in enumerate(seqs) if seq.params.logprobs is not None]
    result: list[TokenLogprob | None] = [None] * len(seqs)
    if not wanted:
        return result
    logprobs = torch.log_softmax(logits[wanted], dim=-1)
    for i, row in enumerate(wanted):
        n = seqs[row].params.logprobs or 0
        top = torch.topk(logprobs[i], n) if n else None
        alternatives = (
            list(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top else []
        )
        token = chosen[row]
        result[row] = TokenLogprob(token, float(logprobs[i, token]), alternatives)
    return result
