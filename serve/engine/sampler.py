"""Picks each sequence's next token from its logits, with its own settings and RNG.

The batch is scanned once on the device (every row's argmax, and whether the row can be
trusted at all); then each sequence is picked on its own, so a row that cannot be sampled
raises for that sequence alone and the engine ends only it.

Greedy rows (temperature below GREEDY_BELOW, 0 included) take the argmax. Sampled rows are
scaled by temperature after being shifted by their maximum (so no temperature the API
accepts can overflow them), cut by top-k and top-p (the nucleus always keeps the most likely
token), and drawn on the CPU with the request's generator when it has a seed, so a seeded
request gives the same tokens on any device and batch. The arithmetic is float64, where
every temperature and top_p the API accepts is representable. Logprobs are those of the
model's own distribution (before temperature and cuts), as the OpenAI API reports them.
"""

from __future__ import annotations

import torch

from flare.serve.engine.sequence import SamplingParams, Sequence, TokenLogprob

GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy (as vLLM's): the distribution is the argmax up to float
rounding anyway, and taking it breaks ties as greedy does, without drawing."""
LOGPROB_FLOOR = -9999.0
"""The logprob reported for a token of probability zero (a masked logit): JSON has no -inf,
and OpenAI reports this value for tokens that cannot come."""


class Sampler:
    def scan(self, logits: torch.Tensor) -> list[int | None]:
        """Every row's most likely token in one device sync, or None for a row the model
        broke (NaN or +inf anywhere, or nothing above -inf): no token of it can be trusted."""
        broken = (logits.isnan() | logits.isposinf()).any(dim=-1) | logits.isneginf().all(dim=-1)
        tops, bad = torch.stack([logits.argmax(dim=-1), broken.long()]).tolist()
        return [None if b else top for top, b in zip(tops, bad, strict=True)]

    def pick(
        self, logits: torch.Tensor, seq: Sequence, top: int | None
    ) -> tuple[int, TokenLogprob | None]:
        """One sequence's token from its float32 `logits` [vocab] (`top` is its `scan`
        result), and its logprobs if it asked; raises if this row cannot be sampled."""
        if top is None:
            raise ValueError("the model's logits for this request hold NaN or infinity")
        params = seq.params
        token = top if params.temperature < GREEDY_BELOW else _draw(logits, params, seq.generator)
        wanted = params.logprobs
        return token, None if wanted is None else _logprob(logits, token, wanted)


def _draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    probs = distribution(logits, params)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The float64 probabilities a sampled row is drawn from: logits shifted by their maximum
    (so dividing by a tiny temperature gives -inf, never inf - inf), scaled, then cut."""
    shifted = logits.double() - logits.max()
    return torch.softmax(_cut(shifted / params.temperature, params), dim=-1)


def _cut(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Keep the top_k most likely tokens (ties included; a top_k past the vocabulary keeps
    it all), then the smallest set whose mass reaches top_p, which always holds the first."""
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        ordered, order = torch.sort(logits, descending=True, stable=True)
        probs = torch.softmax(ordered, dim=-1)
        outside = probs.cumsum(dim=-1) - probs >= params.top_p
        outside[0] = False
        drop = torch.empty_like(outside)
        drop[order] = outside
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _logprob(logits: torch.Tensor, token: int, n: int) -> TokenLogprob:
    """The chosen token's logprob and the n most likely (at most the vocabulary), floored."""
    logprobs = torch.log_softmax(logits.double(), dim=-1).clamp(min=LOGPROB_FLOOR)
    top = torch.topk(logprobs, min(n, logprobs.numel()))
    alternatives = list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    return TokenLogprob(token, float(logprobs[token]), alternatives)
