"""Per-step sampling time: the batched sampler against the per-row path it replaced, same run.

For 1, 16 and 64 sampled rows over a vocabulary of 128,256 (Llama 3's), float32 logits on the
chosen device, and four settings (temperature 0.8 alone; with top_p 0.95 and top_k 50; with
top_p 0.95 and 5 logprobs a row; and seeded rows, which both paths draw on the CPU), each path
samples the same logits `--steps` times after one untimed warm-up step. Beside the times, the
largest difference between the batched pass's float32 distribution (softmax of `cut_logits`,
on the device) and the float64 `distribution` of the same rows, up to four of them.

Baseline: the sampler as it was before the batched pass (flare a5d77f7, reproduced here
verbatim in `per_row`): one read of every row's argmax, then per sampled row a float64
softmax of the vocabulary, its cuts, a copy to the CPU and torch.multinomial there, and per
logprob row a float64 log_softmax read row by row.

    python tests/bench/bench_sampler.py [--device cpu|cuda] [--steps 5] [--vocab 128256]
        [--rows 1 16 64] [--settings temperature top_p+top_k top_p+logprobs seeded]

Prints the median per-step milliseconds of both paths (on the CPU with one thread: timings
with several move most on a shared machine), their ratio and, on a GPU, the device syncs per
step that each path makes (torch's sync debug mode counts them). Nothing asserts on time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Callable

import torch

from flare.serve.engine.sampler import (
    GREEDY_BELOW,
    LOGPROB_FLOOR,
    Sampler,
    Settings,
    cut_logits,
    distribution,
)
from flare.serve.engine.sequence import SamplingParams, Sequence, TokenLogprob

SETTINGS = {
    "temperature": {"temperature": 0.8},
    "top_p+top_k": {"temperature": 0.8, "top_p": 0.95, "top_k": 50},
    "top_p+logprobs": {"temperature": 0.8, "top_p": 0.95, "logprobs": 5},
    "seeded": {"temperature": 0.8, "top_p": 0.95, "seed": 7},
}


def per_row(logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, TokenLogprob | None]]:
    """The sampler before the batched pass: `scan`, then `pick` row by row."""
    broken = (logits.isnan() | logits.isposinf()).any(dim=-1) | logits.isneginf().all(dim=-1)
    tops, bad = torch.stack([logits.argmax(dim=-1), broken.long()]).tolist()
    out = []
    for row, seq in enumerate(seqs):
        if bad[row]:
            raise ValueError("the model's logits for this request hold NaN or infinity")
        token = tops[row] if seq.params.temperature < GREEDY_BELOW else _draw(logits[row], seq)
        wanted = seq.params.logprobs
        out.append((token, None if wanted is None else _logprob(logits[row], token, wanted)))
    return out


def _draw(logits: torch.Tensor, seq: Sequence) -> int:
    probs = distribution(logits, seq.params)
    return int(torch.multinomial(probs.cpu(), 1, generator=seq.generator))


def _logprob(logits: torch.Tensor, token: int, n: int) -> TokenLogprob:
    logprobs = torch.log_softmax(logits.double(), dim=-1).clamp(min=LOGPROB_FLOOR)
    top = torch.topk(logprobs, min(n, logprobs.numel()))
    alternatives = list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    return TokenLogprob(token, float(logprobs[token]), alternatives)


def per_step(
    path: Callable[[], object], device: torch.device, steps: int
) -> tuple[float, float | None]:
    """Median milliseconds per step (after a warm-up step) and, on a GPU, syncs per step."""
    path()
    syncs = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            path()
            torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in caught)
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        path()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000, syncs


def float64_gap(logits: torch.Tensor, params: list[SamplingParams]) -> float:
    """The largest difference between the batched float32 distribution and the float64 one."""
    settings = Settings.of(params, logits.shape[-1], logits.device)
    batched = torch.softmax(cut_logits(logits, settings), dim=-1).double()
    exact = torch.stack([distribution(row, p) for row, p in zip(logits, params, strict=True)])
    return float((batched - exact).abs().max())


def compare(
    name: str, asks: dict[str, float], rows: int, vocab: int, device: torch.device, steps: int
) -> dict[str, object]:
    """Both paths on the same random logits and sequences."""
    generator = torch.Generator(device=device).manual_seed(rows)
    logits = torch.randn(rows, vocab, device=device, generator=generator) * 4
    seqs = [Sequence([1], SamplingParams(**asks), 1) for _ in range(rows)]  # type: ignore[arg-type]
    sampler = Sampler()
    old, old_syncs = per_step(lambda: per_row(logits, seqs), device, steps)
    new, new_syncs = per_step(lambda: sampler.sample(logits, seqs), device, steps)
    return {
        "settings": name,
        "rows": rows,
        "vocab": vocab,
        "per_row_ms": round(old, 3),
        "batched_ms": round(new, 3),
        "speedup": round(old / new, 2),
        "per_row_syncs": old_syncs,
        "batched_syncs": new_syncs,
        "max_abs_diff_vs_float64": float64_gap(logits[:4], [s.params for s in seqs[:4]]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=128_256)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # other work on a shared machine moves threaded timings most
    for name in args.settings:
        for rows in args.rows:
            result = compare(name, SETTINGS[name], rows, args.vocab, device, args.steps)
            print(json.dumps(result), flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(json.dumps({"device": name, "torch": torch.__version__, "steps": args.steps}))


if __name__ == "__main__":
    main()
