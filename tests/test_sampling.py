"""The sampler against float64 references, for every value the API accepts: temperatures down
to the smallest subnormal, top_p as small, top_k past the vocabulary, masked (-inf) and
all-equal logits. Whatever a request asks for, it gets a token from its own distribution and
finite, correct logprobs; a row the model broke fails that row only."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flare.serve.engine.sampler import LOGPROB_FLOOR, Sampler, distribution
from flare.serve.engine.sequence import SamplingParams, Sequence, TokenLogprob

VOCAB = 48
TINY = (5e-324, 1e-323, 1e-300, 1e-45, 1e-38, 1e-8, 9.99e-6)
"""Temperatures the API accepts that are greedy in effect (below 1e-5)."""


def logits_row(seed: int, vocab: int = VOCAB, masked: int = 0) -> torch.Tensor:
    """Seeded float32 logits with a clear order; the last `masked` ones -inf, as masks do."""
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 4
    row[vocab - masked :] = float("-inf")
    return row


def pick(row: torch.Tensor, **settings: object) -> tuple[int, TokenLogprob | None]:
    sampler = Sampler()
    seq = Sequence([1], SamplingParams(**settings), max_tokens=1)  # type: ignore[arg-type]
    return sampler.pick(row, seq, sampler.scan(row[None])[0])


def reference(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The textbook distribution, in float64 and by the definitions: softmax(logits / T),
    the k largest logits, then the fewest most likely tokens whose mass reaches top_p."""
    probs = torch.softmax(row.double() / params.temperature, dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if 0 < params.top_k < len(row):
        keep &= row >= row.sort(descending=True).values[params.top_k - 1]
    probs = torch.where(keep, probs, 0.0)
    probs /= probs.sum()
    if params.top_p < 1:
        mass, nucleus = 0.0, torch.zeros_like(keep)
        for token in probs.argsort(descending=True, stable=True).tolist():
            nucleus[token] = True
            mass += probs[token].item()
            if mass >= params.top_p:
                break
        probs = torch.where(nucleus, probs, 0.0)
    return probs / probs.sum()


# -- greedy in effect ---------------------------------------------------------------------


@pytest.mark.parametrize("temperature", TINY)
@pytest.mark.parametrize("seed", range(5))
def test_a_tiny_temperature_is_greedy(temperature: float, seed: int) -> None:
    row = logits_row(seed, masked=seed)
    assert pick(row, temperature=temperature)[0] == int(row.argmax())


@pytest.mark.parametrize("top_p", (5e-324, 1e-300, 1e-45, 1e-8))
@pytest.mark.parametrize("temperature", (1e-5, 0.7, 1.0, 2.0))
def test_a_tiny_top_p_keeps_the_most_likely_token(top_p: float, temperature: float) -> None:
    for seed in range(5):
        row = logits_row(seed, masked=3)
        params = SamplingParams(temperature=temperature, top_p=top_p)
        expected = torch.zeros(VOCAB, dtype=torch.float64)
        expected[row.argmax()] = 1.0
        assert torch.equal(distribution(row, params), expected)
        assert pick(row, temperature=temperature, top_p=top_p, seed=seed)[0] == row.argmax()


def test_top_k_one_is_greedy_and_top_k_past_the_vocabulary_is_the_vocabulary() -> None:
    row = logits_row(0)
    for seed in range(10):
        assert pick(row, temperature=2.0, top_k=1, seed=seed)[0] == int(row.argmax())
    for top_k in (VOCAB, VOCAB + 1, 10**9, 0, -1):
        params = SamplingParams(temperature=1.5, top_k=top_k)
        assert torch.allclose(distribution(row, params), reference(row, params), atol=1e-12)


# -- the distribution, against the reference ----------------------------------------------


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(
    seed=st.integers(0, 10**6),
    masked=st.integers(0, VOCAB - 1),
    temperature=st.one_of(st.sampled_from((1e-5, 0.01, 2.0)), st.floats(1e-5, 2.0)),
    top_p=st.one_of(st.sampled_from((5e-324, 1e-300, 0.5, 1.0)), st.floats(0.0, 1.0)),
    top_k=st.one_of(st.sampled_from((-1, 0, 1, VOCAB - 1, VOCAB, 10**12)), st.integers(-1, 99)),
)
def test_the_distribution_is_the_references(
    seed: int, masked: int, temperature: float, top_p: float, top_k: int
) -> None:
    """Finite, summing to one, zero on masked tokens, never zero on the most likely token,
    and equal to the reference's."""
    row = logits_row(seed, masked=masked)
    params = SamplingParams(temperature=temperature, top_p=max(top_p, 5e-324), top_k=top_k)
    probs = distribution(row, params)
    assert torch.isfinite(probs).all() and math.isclose(probs.sum().item(), 1.0, abs_tol=1e-9)
    assert (probs[VOCAB - masked :] == 0).all() and probs[row.argmax()] > 0
    assert torch.allclose(probs, reference(row, params), atol=1e-9)


def test_all_equal_logits_are_uniform_and_greedy_takes_the_first() -> None:
    row = torch.full((VOCAB,), 3.25)
    assert pick(row, temperature=0)[0] == 0
    assert pick(row, temperature=1e-300)[0] == 0
    uniform = distribution(row, SamplingParams(temperature=0.5))
    assert torch.allclose(uniform, torch.full((VOCAB,), 1 / VOCAB, dtype=torch.float64))
    assert pick(row, temperature=1.0, top_p=5e-324, seed=3)[0] == 0  # the nucleus's one token
    _, logprob = pick(row, temperature=1.0, logprobs=2, seed=1)
    assert logprob is not None and math.isclose(logprob.logprob, -math.log(VOCAB))


def test_draws_follow_the_distribution() -> None:
    """Frequencies of 10,000 seeded draws match the probabilities (a fixed seed: no flake)."""
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, float("-inf")])
    params = SamplingParams(temperature=0.8, seed=11)
    seq = Sequence([1], params, max_tokens=1)
    sampler = Sampler()
    counts = torch.zeros(5)
    for _ in range(10_000):
        counts[sampler.pick(row, seq, 0)[0]] += 1
    expected = reference(row, params).float() * 10_000
    assert counts[4] == 0
    assert ((counts - expected).abs() <= 4 * expected.sqrt() + 1).all(), (counts, expected)


# -- logprobs -----------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", (0.0, 1e-300, 5e-324, 1.0, 2.0))
@pytest.mark.parametrize("masked", (0, 5, VOCAB - 1))
def test_logprobs_are_the_models_float64_log_softmax(temperature: float, masked: int) -> None:
    row = logits_row(7, masked=masked)
    token, logprob = pick(row, temperature=temperature, logprobs=20, seed=2)
    expected = torch.log_softmax(row.double(), dim=-1)
    assert logprob is not None and logprob.token_id == token
    assert math.isclose(logprob.logprob, expected[token].item(), abs_tol=1e-12)
    values = [value for _, value in logprob.top]
    assert values == expected.clamp(min=LOGPROB_FLOOR).topk(20).values.tolist()
    for t, value in logprob.top:  # in any order among equals
        assert math.isfinite(value) and value == max(expected[t].item(), LOGPROB_FLOOR)


def test_more_logprobs_than_the_vocabulary_lists_the_vocabulary() -> None:
    row = torch.tensor([0.5, 2.0, float("-inf"), 1.0])
    _, logprob = pick(row, temperature=0, logprobs=20)
    assert logprob is not None and [t for t, _ in logprob.top] == [1, 3, 0, 2]
    assert logprob.top[-1][1] == LOGPROB_FLOOR


# -- broken rows fail alone ---------------------------------------------------------------


@pytest.mark.parametrize("poison", ("nan", "+inf", "all -inf"))
def test_a_broken_row_fails_alone(poison: str) -> None:
    logits = torch.stack([logits_row(1), logits_row(2), logits_row(3)])
    if poison == "all -inf":
        logits[1] = float("-inf")
    else:
        logits[1, 4] = float(poison.lstrip("+"))
    sampler = Sampler()
    tops = sampler.scan(logits)
    assert tops == [int(logits[0].argmax()), None, int(logits[2].argmax())]
    seqs = [Sequence([1], SamplingParams(temperature=t), 1) for t in (0.0, 1.0, 0.9)]
    with pytest.raises(ValueError, match="logits for this request hold NaN or infinity"):
        sampler.pick(logits[1], seqs[1], tops[1])
    assert sampler.pick(logits[0], seqs[0], tops[0])[0] == tops[0]
    assert 0 <= sampler.pick(logits[2], seqs[2], tops[2])[0] < VOCAB
