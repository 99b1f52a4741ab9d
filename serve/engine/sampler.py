"""Picks every sequence's next token from its row of logits, with its own settings and RNG, in
one batched pass per step that reads the device once.

A step's rows are split by what they ask for. Greedy rows (temperature below GREEDY_BELOW, 0
included) take the argmax. Sampled rows without a seed are drawn together on the logits'
device, in float32 (the nucleus's mass summed in float64): each row is shifted by its
maximum and scaled by its temperature (so no temperature the API accepts can overflow it),
cut by top-k (ties at the k-th value kept; a top_k past the vocabulary keeps it all) and
top-p (the nucleus always keeps the most likely token), from one sort of the rows (or, where
every row's top_k is narrow, one topk), then drawn by an exponential race (the Gumbel-max
trick: argmax of the cut logits minus the log of Exponential(1) noise), which needs neither a
sync nor the CPU. Sampled rows with a seed keep their own CPU generator and the float64
arithmetic of `distribution`, where every temperature and top_p the API accepts is
representable, so a seeded request gives the same tokens on any device and in any batch;
their distributions come to the host in one copy for all of them (the step's one extra sync,
only when such rows sample). Logprobs are those of the model's own distribution (before
temperature and cuts), as the OpenAI API reports them, in float64, for the rows that ask.

Every row's token, its maximum (which says whether the row can be trusted at all: NaN or +inf
anywhere, or nothing above -inf, and no token of it can be), and the logprobs come back in one
read; a row that cannot be trusted fails its sequence alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flare.serve.engine.device_io import settle, upload
from flare.serve.engine.sequence import SamplingParams, Sequence, TokenLogprob

GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy (as vLLM's): the distribution is the argmax up to float
rounding anyway, and taking it breaks ties as greedy does, without drawing."""
WINDOW_SHARE = 8
"""Both cuts are made in a topk window instead of a sort of the vocabulary where every row's
top_k is at most this share of it (a top_k of 50 over 128K tokens: a selection, not a sort)."""
ROW_MAX_PARTS, MAX_ROW_MAX_PARTS = 64, 256
"""The fewest and most parts `row_max` splits a row into (the first that divides it)."""
LOGPROB_FLOOR = -9999.0
"""The logprob reported for a token of probability zero (a masked logit): JSON has no -inf,
and OpenAI reports this value for tokens that cannot come."""

Picked = tuple[int, TokenLogprob | None]
"""A sequence's next token and, if it asked, its logprobs."""


class Sampler:
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[Picked | Exception]:
        """Each sequence's token (and logprobs if it asked) from its row of `logits`
        [rows, vocab], or the exception that fails that sequence alone: one read of the
        device for the whole batch, one more before it when seeded rows sample."""
        return self.launch(logits, seqs).read()

    @torch.inference_mode()  # a CUDA-graph step's tokens are its buffer's, an inference tensor
    def launch(
        self, logits: torch.Tensor, seqs: list[Sequence], maxima: RowMaxima | None = None
    ) -> Sampled:
        """Start sampling: the tokens are on the device when this returns (the next step may
        take them there), and on their way to the host, which `Sampled.read` waits for.
        Seeded rows read their distributions here (the host draws them). `maxima`: the
        rows' maxima where the step's forward computed them; a batch that is all greedy and
        asks no logprobs then only copies them to the host."""
        groups = _Groups.of(seqs)
        if maxima is not None and groups.greedy_alone:
            return Sampled(maxima.indices, [], [], _ReadBack.packed(maxima))
        # NaN where a NaN is, +inf where +inf, -inf where all are
        values, tokens = (maxima.values, maxima.indices) if maxima else row_max(logits)
        if groups.free:
            free = upload(groups.free, torch.long, logits.device)
            asks = [seqs[row].params for row in groups.free]
            settings = Settings.of(asks, logits.shape[-1], logits.device)
            tokens[free] = draw(logits[free], settings)
        if groups.seeded:
            seeded = upload(groups.seeded, torch.long, logits.device)
            drawn = _draw_seeded(logits, values[seeded], groups.seeded, seqs)
            tokens[seeded] = upload(drawn, torch.long, logits.device)
        wanted = [seqs[row].params.logprobs or 0 for row in groups.logprobs]
        parts = [tokens, values]
        if groups.logprobs:
            parts += _logprobs(logits, tokens, groups.logprobs, max(wanted))
        return Sampled(tokens, groups.logprobs, wanted, _ReadBack.of(parts))


@dataclass(frozen=True)
class RowMaxima:
    """Each row's maximum and the first index holding it (`row_max`), computed beside the
    logits by the step that made them (a decode step's CUDA graph), and the same side by
    side in float64 [rows, 2] (index, maximum), which one copy brings to `host` (pinned,
    at least as many rows; the caller keeps it unread-over until the step has landed)."""

    values: torch.Tensor
    indices: torch.Tensor
    packed: torch.Tensor
    host: torch.Tensor


@dataclass(frozen=True)
class Sampled:
    """A step's sampling, launched: its tokens on the device, its results on their way."""

    tokens: torch.Tensor
    """long [rows], on the logits' device: what the next step's forward may read."""
    logprob_rows: list[int]
    wanted: list[int]
    readback: _ReadBack

    def read(self) -> list[Picked | Exception]:
        """Per row, its token and logprobs, or the error that fails its sequence (this waits
        for the device)."""
        return _results(len(self.tokens), self.logprob_rows, self.wanted, self.readback.read())


class _ReadBack:
    """Device values copied to the host in one copy, started now, without waiting (into
    pinned memory, where the device is a GPU), as float64 (token ids and flags are exact in
    it): parts one after another (`of`), or tokens and maxima side by side (`packed`)."""

    def __init__(
        self,
        source: torch.Tensor,
        sizes: list[int],
        host: torch.Tensor | None = None,
        interleaved: bool = False,
    ) -> None:
        """`host`: a pinned buffer of `source`'s shape to copy into (else one is made)."""
        self.sizes, self.interleaved = sizes, interleaved
        self.done: torch.cuda.Event | None = None
        if source.device.type != "cuda":
            self.host = source
            return
        if host is None:
            host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
        self.host = host
        self.host.copy_(source, non_blocking=True)
        self.done = torch.cuda.Event()
        self.done.record()

    @classmethod
    def of(cls, parts: list[torch.Tensor]) -> _ReadBack:
        """Parts of any shapes, flattened and joined on the device first."""
        flat = torch.cat([part.reshape(-1).double() for part in parts])
        return cls(flat, [part.numel() for part in parts])

    @classmethod
    def packed(cls, maxima: RowMaxima) -> _ReadBack:
        """The tokens and maxima a step computed side by side: one copy into their pinned
        buffer, nothing made anew on the device or the host."""
        rows = len(maxima.packed)
        return cls(maxima.packed, [rows, rows], maxima.host[:rows], interleaved=True)

    def read(self) -> list[list[float]]:
        """The parts' values, one list per part, once the copy is done."""
        settle(self.done)
        flat = self.host.reshape(-1).tolist()
        if self.interleaved:
            return [flat[0::2], flat[1::2]]
        out, at = [], 0
        for size in self.sizes:
            out.append(flat[at : at + size])
            at += size
        return out


@dataclass(frozen=True)
class _Groups:
    """The rows of a batch by what they need: drawn on the device (`free`), drawn on the CPU
    with their own generator (`seeded`), logprobs; the rest are greedy."""

    free: list[int]
    seeded: list[int]
    logprobs: list[int]

    @property
    def greedy_alone(self) -> bool:
        """Every row greedy, none asking for logprobs: the row maxima are the whole answer."""
        return not (self.free or self.seeded or self.logprobs)

    @classmethod
    def of(cls, seqs: list[Sequence]) -> _Groups:
        sampled = [row for row, s in enumerate(seqs) if s.params.temperature >= GREEDY_BELOW]
        return cls(
            free=[row for row in sampled if seqs[row].generator is None],
            seeded=[row for row in sampled if seqs[row].generator is not None],
            logprobs=[row for row, s in enumerate(seqs) if s.params.logprobs is not None],
        )


@dataclass(frozen=True)
class Settings:
    """Sampled rows' settings as per-row tensors on their logits' device, and what the host
    knows of them without reading the device (which cuts any row asks for)."""

    temperature: torch.Tensor
    """float32 [rows]."""
    top_k: torch.Tensor
    """long [rows]; 0 where the row makes no top-k cut (0, -1, or the vocabulary or more)."""
    top_p: torch.Tensor
    """float64 [rows] (the nucleus's mass is summed in float64); inf where the row makes no
    top-p cut (top_p 1)."""
    max_k: int
    """The largest top-k cut of any row, 0 if none: a topk this wide finds every row's k-th."""
    nucleus: bool
    """Whether any row cuts by top_p: then the rows are sorted once, for both cuts, or only
    their top max_k where `windowed`."""
    windowed: bool
    """Whether every row cuts by top_k and the widest cut is at most 1/WINDOW_SHARE of the
    vocabulary: then a topk that wide stands in for the sort."""

    @classmethod
    def of(cls, params: list[SamplingParams], vocab: int, device: torch.device) -> Settings:
        """The settings of rows of `params` over a vocabulary of `vocab` tokens."""
        columns = [
            [p.temperature for p in params],
            [p.top_k if 0 < p.top_k < vocab else 0 for p in params],
            [p.top_p if p.top_p < 1 else float("inf") for p in params],
        ]
        temperature, top_k, top_p = upload(columns, torch.float64, device)
        max_k = max(columns[1])
        return cls(
            temperature=temperature.float(),
            top_k=top_k.long(),
            top_p=top_p,
            max_k=max_k,
            nucleus=any(p.top_p < 1 for p in params),
            windowed=min(columns[1]) > 0 and max_k * WINDOW_SHARE <= vocab,
        )


def row_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's maximum (in the logits' dtype) and the first index that holds it (NaN
    counts as the greatest), as `max(dim=-1)` gives them, in two passes where the vocabulary
    splits evenly into ROW_MAX_PARTS to MAX_ROW_MAX_PARTS parts: torch reduces a short
    batch's 128K-wide rows with one block each (27 microseconds at batch 1 on the H200, 2% of
    a 1B decode step); the parts' maxima are found in parallel, then the first part holding
    the greatest."""
    rows, vocab = logits.shape
    parts = next((n for n in range(ROW_MAX_PARTS, MAX_ROW_MAX_PARTS + 1) if vocab % n == 0), 1)
    if parts == 1:
        top = logits.max(dim=-1)
        return top.values, top.indices
    width = vocab // parts
    each = logits.reshape(rows, parts, width).max(dim=-1)
    best = each.values.max(dim=-1)
    within = each.indices.gather(1, best.indices[:, None])[:, 0]
    return best.values, best.indices * width + within


def draw(logits: torch.Tensor, settings: Settings) -> torch.Tensor:
    """One token per row [rows] from softmax(cut_logits): the exponential race, argmax of
    probs / E with E ~ Exponential(1), taken in logs (E kept above zero, so a token of
    probability zero can never win)."""
    cut = cut_logits(logits, settings)
    noise = torch.empty_like(cut).exponential_().clamp_(min=torch.finfo(cut.dtype).tiny)
    return (cut - noise.log_()).argmax(dim=-1)


def cut_logits(logits: torch.Tensor, settings: Settings) -> torch.Tensor:
    """The float32 logits [rows, vocab] that sampled rows are drawn from: shifted by their
    maximum (so dividing by a tiny temperature gives -inf, never inf - inf), scaled, and -inf
    outside the top-k and top-p cuts; their softmax is `distribution`'s within float32."""
    x = logits.float()
    scaled = (x - x.max(dim=-1, keepdim=True).values) / settings.temperature[:, None]
    if settings.nucleus and settings.windowed:
        keep = _nucleus_in_window(x, scaled, settings)
    elif settings.nucleus:
        keep = _nucleus(x, settings)
    elif settings.max_k > 0:
        keep = x >= _kth(torch.topk(x, settings.max_k, dim=-1).values, settings.top_k)
    else:
        return scaled
    return scaled.masked_fill(~keep, float("-inf"))


def _kth(descending: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Each row's k-th largest logit [rows, 1] from its largest values in descending order
    (at least the largest top_k of them), or -inf where the row makes no top-k cut."""
    index = (top_k.clamp(min=1) - 1)[:, None]
    return torch.where(top_k[:, None] > 0, descending.gather(1, index), float("-inf"))


def _nucleus(x: torch.Tensor, settings: Settings) -> torch.Tensor:
    """Which tokens [rows, vocab] survive both cuts, from one stable sort of the rows: the
    top-k cut (ties kept), then the fewest most likely tokens whose mass reaches top_p."""
    ordered, order = torch.sort(x, dim=-1, descending=True, stable=True)
    kept = ordered >= _kth(ordered, settings.top_k)
    scaled = (ordered - ordered[:, :1]) / settings.temperature[:, None]
    probs = torch.softmax(scaled.masked_fill(~kept, float("-inf")).double(), dim=-1)
    outside = probs.cumsum(dim=-1) - probs >= settings.top_p[:, None]
    outside[:, 0] = False
    return torch.empty_like(kept).scatter_(1, order, kept & ~outside)


def _nucleus_in_window(x: torch.Tensor, scaled: torch.Tensor, settings: Settings) -> torch.Tensor:
    """What `_nucleus` keeps, where every row cuts by top_k, from the rows' top max_k alone.
    Every token above a row's k-th value is in that window, where a stable sort of it gives
    them the sort's order (by value, then by index); the k-th value's ties may run past it,
    so they are kept in index order while the mass before them (the mass above the k-th
    plus that of the ties before) is below top_p; the first token is always kept."""
    values, index = torch.topk(x, settings.max_k, dim=-1)
    kth = _kth(values, settings.top_k)
    by_index = index.argsort(dim=-1)
    values, order = values.gather(1, by_index).sort(dim=-1, descending=True, stable=True)
    index = index.gather(1, by_index).gather(1, order)
    log_total = scaled.masked_fill(x < kth, float("-inf")).double().logsumexp(-1, keepdim=True)
    above = values > kth
    probs = (scaled.gather(1, index).double() - log_total).exp().masked_fill(~above, 0.0)
    first = torch.arange(values.shape[-1], device=x.device) == 0
    top_p = settings.top_p[:, None]
    keep = torch.zeros_like(x, dtype=torch.bool)
    keep.scatter_(1, index, above & ((probs.cumsum(dim=-1) - probs < top_p) | first))
    tied = x == kth
    rank = tied.cumsum(dim=-1) - 1
    at_kth = index.gather(1, (settings.top_k - 1)[:, None])
    tie = (scaled.gather(1, at_kth).double() - log_total).exp()
    mass_before = probs.sum(dim=-1, keepdim=True) + tie * rank
    first_tie = ~above[:, :1] & (rank == 0)
    return keep | (tied & ((mass_before < top_p) | first_tie))


def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The float64 probabilities a seeded row is drawn from: logits shifted by their maximum
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


def _draw_seeded(
    logits: torch.Tensor, maxima: torch.Tensor, rows: list[int], seqs: list[Sequence]
) -> list[int]:
    """The seeded `rows`' tokens (`maxima` are their rows' maxima), drawn on the CPU with
    their own generators from their float64 distributions, which come over in one copy; a
    broken row draws nothing (its generator stays where it was) and gets a placeholder, as
    its sequence fails."""
    probs = torch.stack([distribution(logits[row], seqs[row].params) for row in rows])
    host = torch.cat([maxima[:, None].double(), probs], dim=1).cpu()
    drawn = []
    for row, top, dist in zip(rows, host[:, 0].tolist(), host[:, 1:], strict=True):
        generator = seqs[row].generator
        bad = not math.isfinite(top)
        drawn.append(0 if bad else int(torch.multinomial(dist, 1, generator=generator)))
    return drawn


def _logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], n: int
) -> list[torch.Tensor]:
    """For the `rows` that ask: the chosen token's logprob [rows], and the values and ids of
    the n most likely [rows, n] (at most the vocabulary), from one float64 log_softmax,
    floored."""
    index = upload(rows, torch.long, logits.device)
    logprobs = torch.log_softmax(logits[index].double(), dim=-1).clamp(min=LOGPROB_FLOOR)
    top = torch.topk(logprobs, min(n, logprobs.shape[-1]), dim=-1)
    return [logprobs.gather(1, tokens[index][:, None]), top.values, top.indices]


def _results(
    rows: int, logprob_rows: list[int], wanted: list[int], read: list[list[float]]
) -> list[Picked | Exception]:
    """Per sequence, its token and logprobs from the values read back (tokens, the rows'
    maxima, then for the logprob rows the `_logprobs`), or its error: a row whose maximum is
    not finite cannot be trusted."""
    tokens, maxima, *asked = read
    chosen, top_values, top_indices = asked or ([], [], [])
    width = len(top_values) // max(len(logprob_rows), 1)
    logprobs: dict[int, TokenLogprob] = {}
    for at, (row, n) in enumerate(zip(logprob_rows, wanted, strict=True)):
        span = slice(at * width, at * width + min(n, width))
        top = list(zip(map(int, top_indices[span]), top_values[span], strict=True))
        logprobs[row] = TokenLogprob(int(tokens[row]), chosen[at], top)
    return [
        ValueError("the model's logits for this request hold NaN or infinity")
        if not math.isfinite(maxima[row])
        else (int(tokens[row]), logprobs.get(row))
        for row in range(rows)
    ]
