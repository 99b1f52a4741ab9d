"""Per-step sampling time: the batched sampler against the per-row path it replaced, same run.

For 1, 16 and 64 sampled rows (no seed) over a vocabulary of 128,256 (Llama 3's), float32
logits on the chosen device, two settings (temperature 0.8 alone; temperature 0.8 with top_p
0.95 and top_k 50; every row also asking for 5 logprobs in a third, the worst case), each
path samples the same logits `--steps` times after one untimed warm-up step.

Baseline: the sampler as it was before the batched pass (flare a5d77f7, reproduced here
verbatim in `per_row`): one read of every row's argmax, then per sampled row a float64
softmax of the vocabulary, its cuts, a copy to the CPU and torch.multinomial there, and per
logprob row a float64 log_softmax read row by row.

    python tests/bench/bench_sampler.py [--device cpu|cuda] [--steps 5] [--vocab 128256]

Prints per-step milliseconds of both paths, their ratio and, on a GPU, the device syncs per
step that each path makes (torch's sync debug mode counts them). Nothing asserts on time.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections.abc import Callable

import torch

from flare.serve.engine.sampler import GREEDY_BELOW, LOGPROB_FLOOR, Sampler, distribution
from flare.serve.engine.sequence import SamplingParams, Sequence, TokenLogprob

SETTINGS = {
    "temperature": {"temperature": 0.8},
    "top_p+top_k": {"temperature": 0.8, "top_p": 0.95, "top_k": 50},
    "top_p+logprobs": {"temperature": 0.8, "top_p": 0.95, "logprobs": 5},
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
    """Milliseconds per step (after a warm-up step) and, on a GPU, syncs per step."""
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
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        path()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps * 1000, syncs


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
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=128_256)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    args = parser.parse_args()
    device = torch.device(args.device)
    for name, asks in SETTINGS.items():
        for rows in args.rows:
            result = compare(name, asks, rows, args.vocab, device, args.steps)
            print(json.dumps(result), flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(json.dumps({"device": name, "torch": torch.__version__, "steps": args.steps}))


if __name__ == "__main__":
    main()
