"""The sampler against float64 references, for every value the API accepts: temperatures down
to the smallest subnormal, top_p as small, top_k past the vocabulary, masked (-inf) and
all-equal logits. Whatever a request asks for, it gets a token from its own distribution and
finite, correct logprobs; a row the model broke fails that row only. Unseeded rows are drawn
together in float32 (their distribution matches the float64 one within tolerance, and so do
their draws' frequencies); seeded rows keep their own float64 draw, the same alone and in any
batch; a step reads the device once."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from flare.serve.engine.sampler import (
    LOGPROB_FLOOR,
    Picked,
    RowMaxima,
    Sampler,
    Settings,
    cut_logits,
    distribution,
    draw,
    row_max,
)
from flare.serve.engine.sequence import SamplingParams, Sequence, TokenLogprob

VOCAB = 48
TINY = (5e-324, 1e-323, 1e-300, 1e-45, 1e-38, 1e-8, 9.99e-6)
"""Temperatures the API accepts that are greedy in effect (below 1e-5)."""


def logits_row(seed: int, vocab: int = VOCAB, masked: int = 0) -> torch.Tensor:
    """Seeded float32 logits with a clear order; the last `masked` ones -inf, as masks do."""
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 4
    row[vocab - masked :] = float("-inf")
    return row


def picked(result: Picked | Exception) -> Picked:
    """A row's result, raising its exception as the engine's caller would see it fail."""
    if isinstance(result, Exception):
        raise result
    return result


def pick(row: torch.Tensor, **settings: object) -> tuple[int, TokenLogprob | None]:
    """One row sampled alone, as a batch of one."""
    seq = Sequence([1], SamplingParams(**settings), max_tokens=1)  # type: ignore[arg-type]
    return picked(Sampler().sample(row[None], [seq])[0])


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


@pytest.mark.parametrize("vocab", [128 * 1002, 64 * 7, 4099])
def test_row_max_is_torchs_max_with_the_first_index_of_ties(vocab: int) -> None:
    """Split into parts (128K, a vocabulary of 64 parts) or whole (a prime): the same values
    and indices as max(dim=-1), ties to the first index, NaN greatest, all -inf kept."""
    generator = torch.Generator().manual_seed(vocab)
    rows = torch.randint(-4, 4, (7, vocab), generator=generator).float()  # many ties at the top
    rows[1, vocab // 2] = 9.0
    rows[1, vocab - 1] = 9.0  # the later of two equal maxima, in another part
    rows[2, 5] = float("nan")
    rows[2, 3] = float("inf")
    rows[3] = float("-inf")
    rows[4, vocab - 1] = float("nan")
    rows[5, :] = 2.5
    values, indices = row_max(rows)
    want = rows.max(dim=-1)
    assert torch.equal(values.isnan(), want.values.isnan())
    assert torch.equal(values.nan_to_num(), want.values.nan_to_num())
    assert indices.tolist() == want.indices.tolist()
    assert indices[1] == vocab // 2 and indices[2] == 5 and indices[5] == 0


def test_draws_follow_the_distribution() -> None:
    """Frequencies of 10,000 seeded draws match the probabilities (a fixed seed: no flake)."""
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, float("-inf")])
    params = SamplingParams(temperature=0.8, seed=11)
    seq = Sequence([1], params, max_tokens=1)
    sampler = Sampler()
    counts = torch.zeros(5)
    for _ in range(10_000):
        counts[picked(sampler.sample(row[None], [seq])[0])[0]] += 1
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
@pytest.mark.parametrize("temperature", (0.0, 1.0))
@pytest.mark.parametrize("seed", (None, 5))
def test_a_broken_row_fails_alone(poison: str, temperature: float, seed: int | None) -> None:
    """Beside a greedy, an unseeded and a seeded row (all asking for logprobs), whatever the
    broken row asks for; a seeded broken row draws nothing from its generator."""
    logits = torch.stack([logits_row(1), logits_row(2), logits_row(3), logits_row(4)])
    if poison == "all -inf":
        logits[1] = float("-inf")
    else:
        logits[1, 4] = float(poison.lstrip("+"))
    asks = [
        {"temperature": 0.0},
        {"temperature": temperature, "seed": seed},
        {"temperature": 0.9},
        {"temperature": 0.9, "seed": 8},
    ]
    seqs = [Sequence([1], SamplingParams(**s, logprobs=3), 1) for s in asks]  # type: ignore[arg-type]
    results = Sampler().sample(logits, seqs)
    assert isinstance(results[1], ValueError)
    assert str(results[1]) == "the model's logits for this request hold NaN or infinity"
    assert picked(results[0])[0] == int(logits[0].argmax())
    for row in (2, 3):
        token, logprob = picked(results[row])
        assert 0 <= token < VOCAB and logprob is not None and logprob.token_id == token
    if generator := seqs[1].generator:
        assert generator.get_state().equal(torch.Generator().manual_seed(5).get_state())


# -- batched and unseeded: float32 on the device ----------------------------------------------


def row_settings() -> st.SearchStrategy[dict[str, float | int]]:
    return st.fixed_dictionaries(
        {
            "temperature": st.one_of(st.sampled_from((1e-5, 0.01, 2.0)), st.floats(1e-5, 2.0)),
            "top_p": st.one_of(st.sampled_from((5e-324, 0.5, 1.0)), st.floats(5e-324, 1.0)),
            "top_k": st.one_of(st.sampled_from((-1, 0, 1, VOCAB, 10**12)), st.integers(-1, 60)),
        }
    )


def near_the_nucleus_edge(row: torch.Tensor, params: SamplingParams) -> bool:
    """Whether a token's mass before it (in the reference's top-k cut) lies within float32's
    reach of top_p: there float32 and float64 may rightly disagree on the nucleus."""
    probs = reference(row, SamplingParams(temperature=params.temperature, top_k=params.top_k))
    ordered = probs.sort(descending=True, stable=True).values
    before = (ordered.cumsum(dim=-1) - ordered)[1:]  # the first token is always kept
    return params.top_p < 1 and bool(((before - params.top_p).abs() < 1e-6).any())


Row = tuple[dict[str, float | int], int, bool, int]
"""A row's settings, how many of its logits are masked, whether they are rounded to whole
numbers (ties), and a top_k narrow enough for the top-k window."""


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(
    seed=st.integers(0, 10**6),
    rows=st.lists(
        st.tuples(row_settings(), st.integers(0, VOCAB - 1), st.booleans(), st.integers(1, 6)),
        min_size=1,
        max_size=6,
    ),
    cuts=st.sampled_from(("as drawn", "no top_p", "narrow top_k")),
)
def test_a_batch_of_rows_is_cut_as_each_rows_float64_distribution(
    seed: int, rows: list[Row], cuts: str
) -> None:
    """One float32 pass over rows of different settings gives each row its own float64
    distribution within 1e-6 (away from the nucleus's edge, where float32 may round a token
    in or out); rows rounded to whole numbers have ties at the k-th, which are kept. A third
    of the batches make no top-p cut (made without a sort), a third cut every row by a top_k
    narrow enough for the top-k window, which then cuts as the sort of the rows does."""
    logits = torch.stack([logits_row(seed + i, masked=r[1]) for i, r in enumerate(rows)])
    for row, (_, _, whole, _) in zip(logits, rows, strict=True):
        if whole:
            row.round_()
    change = {
        "as drawn": lambda k: {},
        "no top_p": lambda k: {"top_p": 1.0},
        "narrow top_k": lambda k: {"top_k": k},
    }[cuts]
    params = [SamplingParams(**{**s, **change(k)}) for s, _, _, k in rows]  # type: ignore[arg-type]
    assume(not any(near_the_nucleus_edge(r, p) for r, p in zip(logits, params, strict=True)))
    settings = Settings.of(params, VOCAB, logits.device)
    assert settings.windowed or cuts != "narrow top_k"
    probs = torch.softmax(cut_logits(logits, settings), dim=-1)
    for row, p, got in zip(logits, params, probs, strict=True):
        expected = distribution(row, p)
        assert torch.allclose(got.double(), expected, atol=1e-6), (p, got, expected)
        assert (got[expected == 0] == 0).all(), p  # what the reference cuts is cut
        assert (got[expected > 1e-30] > 0).all(), p  # and nothing float32 can hold is
    if settings.windowed:
        sorted_rows = replace(settings, windowed=False)
        assert torch.equal(cut_logits(logits, settings), cut_logits(logits, sorted_rows))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.3, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=0.5, top_k=4, top_p=0.9),
    ],
    ids=["temperature", "top_k", "top_p", "top_k+top_p"],
)
def test_unseeded_draws_follow_the_distribution(params: SamplingParams) -> None:
    """20,000 rows drawn in one batch: each token's frequency within 4 sigma of its float64
    probability, the chi-square statistic within 6 sigma of its mean, and cut tokens never
    drawn (torch's global RNG seeded: no flake)."""
    torch.manual_seed(1234)
    row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, float("-inf")])
    n = 20_000
    tokens = draw(row.expand(n, -1), Settings.of([params] * n, len(row), row.device))
    counts = torch.bincount(tokens, minlength=len(row)).double()
    expected = distribution(row, params) * n
    assert (counts[expected == 0] == 0).all(), (counts, expected)
    kept = expected > 0
    assert ((counts - expected).abs() <= 4 * expected.sqrt() + 1).all(), (counts, expected)
    chi2 = float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())
    df = int(kept.sum()) - 1
    assert chi2 <= df + 6 * math.sqrt(2 * max(df, 1)), (chi2, df)


def test_a_seeded_request_gives_the_same_tokens_alone_and_beside_unseeded_rows() -> None:
    """A seeded request's 32 tokens alone equal its tokens in a batch of 16 where unseeded
    sampled, greedy and logprob rows (in other positions from step to step) draw beside it."""
    steps = [logits_row(100 + step) for step in range(32)]
    params = {"temperature": 0.9, "top_p": 0.95, "top_k": 20, "seed": 42}
    sampler = Sampler()
    alone_seq = Sequence([1], SamplingParams(**params), 32)  # type: ignore[arg-type]
    alone = [picked(sampler.sample(row[None], [alone_seq])[0])[0] for row in steps]
    batch_seq = Sequence([1], SamplingParams(**params, logprobs=2), 32)  # type: ignore[arg-type]
    others = [
        Sequence([1], SamplingParams(temperature=t, logprobs=(i % 3 or None)), 32)
        for i, t in enumerate([1.0, 0.0, 0.7, 1.5] * 4)
    ][:15]
    beside = []
    for step, row in enumerate(steps):
        at = step % 16
        seqs = [*others[:at], batch_seq, *others[at:]]
        logits = torch.stack([logits_row(step * 16 + i) for i in range(16)])
        logits[at] = row
        beside.append(picked(sampler.sample(logits, seqs)[at])[0])
    assert beside == alone
    assert len(set(alone)) > 1  # it did sample


class DeviceReads(TorchFunctionMode):
    """Counts the calls that bring a tensor's values to the host (a sync on a GPU)."""

    READS = frozenset(
        {
            torch.Tensor.tolist,
            torch.Tensor.item,
            torch.Tensor.cpu,
            torch.Tensor.numpy,
            torch.Tensor.__int__,
            torch.Tensor.__float__,
            torch.Tensor.__bool__,
            torch.Tensor.__index__,
        }
    )

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += func in self.READS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("rows", (1, 16, 64))
def test_a_step_of_unseeded_rows_reads_the_device_once(rows: int) -> None:
    """Greedy, sampled (every cut) and logprob rows: one read for the whole batch."""
    kinds = [
        {"temperature": 0.0, "logprobs": 5},
        {"temperature": 0.8},
        {"temperature": 1.0, "top_k": 7, "logprobs": 0},
        {"temperature": 1.2, "top_p": 0.9, "top_k": 30},
        {"temperature": 0.6, "top_p": 0.5, "logprobs": 20},
    ]
    seqs = [Sequence([1], SamplingParams(**kinds[i % 5]), 1) for i in range(rows)]  # type: ignore[arg-type]
    logits = torch.stack([logits_row(i, masked=i % 7) for i in range(rows)])
    with DeviceReads() as reads:
        results = Sampler().sample(logits, seqs)
    assert reads.count == 1
    assert all(0 <= picked(result)[0] < VOCAB for result in results)


@pytest.mark.parametrize(
    "kind",
    [
        {"temperature": 0.0, "logprobs": 5},
        {"temperature": 0.8},
        {"temperature": 1.0, "top_k": 7, "logprobs": 0},
        {"temperature": 0.8, "top_k": 50, "top_p": 0.95},
        {"temperature": 0.6, "top_p": 0.5, "logprobs": 20},
    ],
    ids=["greedy", "temperature", "top_k", "top_k+top_p", "top_p"],
)
def test_nothing_in_the_batched_pass_reads_the_device_before_its_one_read(
    kind: dict[str, float],
) -> None:
    """On the meta device, where any read of a tensor's values raises, and so does any op
    whose output's shape depends on them (a boolean mask, nonzero: syncs on a GPU), unseeded
    rows of a 128K vocabulary run through the whole pass to the step's one read. (An op that
    syncs inside on a GPU but has a shape of its own, as torch.multinomial does, shows only
    there: bench_sampler.py --device cuda counts the syncs.)"""
    seqs = [Sequence([1], SamplingParams(**kind), 1) for _ in range(4)]  # type: ignore[arg-type]
    logits = torch.empty(len(seqs), 128_256, device="meta")
    sampled = Sampler().launch(logits, seqs)  # the whole pass, up to the read: nothing raises
    with pytest.raises(NotImplementedError, match="meta tensor"):
        sampled.read()


def step_maxima(logits: torch.Tensor) -> RowMaxima:
    """The rows' maxima as a CUDA-graph step leaves them: made in inference mode beside the
    logits (its buffers are inference tensors), packed side by side for one copy."""
    with torch.inference_mode():
        values, indices = row_max(logits)
        packed = torch.stack([indices.double(), values.double()], dim=1)
        return RowMaxima(values, indices, packed, torch.empty_like(packed))


def test_the_maxima_a_step_computed_give_what_its_logits_give() -> None:
    """A step that computed its rows' maxima with its logits: an all-greedy batch takes them
    as they are (the same tokens, a NaN row failing alone); a mixed batch (greedy, seeded,
    unseeded, logprobs) draws its sampled rows over them, into the step's own tokens (where
    the next step reads them), and gives what the same batch gives from the logits alone."""
    with torch.inference_mode():
        logits = torch.stack([logits_row(seed, vocab=256) for seed in range(4)])
        logits[2, 5] = float("nan")
    greedy = [Sequence([1], SamplingParams(temperature=0), max_tokens=4) for _ in range(4)]
    maxima = step_maxima(logits)
    taken = Sampler().launch(logits, greedy, maxima)
    assert taken.tokens is maxima.indices
    from_logits = Sampler().launch(logits, greedy).read()
    assert str(taken.read()) == str(from_logits)
    assert isinstance(from_logits[2], ValueError)

    def mixed() -> list[Sequence]:
        asks = [
            {"temperature": 0},
            {"temperature": 0.9, "seed": 11},
            {"temperature": 0.7},
            {"temperature": 0, "logprobs": 3},
        ]
        return [Sequence([1], SamplingParams(**ask), max_tokens=4) for ask in asks]  # type: ignore[arg-type]

    with torch.inference_mode():
        logits[2, 5] = 0.0
    maxima = step_maxima(logits)
    beside, alone = Sampler().launch(logits, mixed(), maxima), Sampler().launch(logits, mixed())
    assert beside.tokens is maxima.indices
    drawn, expected = beside.read(), alone.read()
    assert [drawn[row] for row in (0, 1, 3)] == [expected[row] for row in (0, 1, 3)]
    assert maxima.indices.tolist()[:2] == [picked(drawn[0])[0], picked(drawn[1])[0]]
    assert 0 <= picked(drawn[2])[0] < 256


def test_bf16_logits_sample_as_their_float32_values_do() -> None:
    """A GPU step hands the sampler its logits in the model's dtype (no float32 copy of 64
    rows a step): greedy, seeded, unseeded and logprobs rows get from bf16 logits what they
    get from the same values widened to float32, and a row's maximum is that dtype's."""
    logits = torch.stack([logits_row(seed, vocab=256) for seed in range(5)]).bfloat16()
    asks = [
        {"temperature": 0},
        {"temperature": 0.9, "seed": 11},
        {"temperature": 0.7, "top_k": 20, "top_p": 0.9},
        {"temperature": 0, "logprobs": 3},
        {"temperature": 1.3, "seed": 5, "logprobs": 2},
    ]

    def sample(rows: torch.Tensor) -> list[Picked | Exception]:
        torch.manual_seed(0)  # the unseeded row's draw
        seqs = [Sequence([1], SamplingParams(**ask), max_tokens=4) for ask in asks]  # type: ignore[arg-type]
        return Sampler().sample(rows, seqs)

    assert str(sample(logits)) == str(sample(logits.float()))
    values, indices = row_max(logits)
    assert values.dtype == torch.bfloat16
    assert torch.equal(indices, logits.float().argmax(dim=-1))
