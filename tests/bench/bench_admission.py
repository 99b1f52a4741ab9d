"""What admitting a long prompt costs the engine's host: the scheduler's step for one prompt
(serve/engine/scheduler.py), whose KV blocks the BlockManager hands out and names, a block
at a time (serve/engine/block_manager.py). It runs before the prompt's prefill is launched,
so it is part of the prompt's first token.

    python tests/bench/bench_admission.py [--tokens 8192] [--blocks 220000]

Two cases: a prompt never seen (every block fresh, every full block named) and the same
prompt again (its full blocks found by name). The baseline, in the same run, is the floor of
naming: the prompt's ids made bytes and hashed in one call. Nothing asserts on time: the
script prints milliseconds, the median of many prompts.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import time
from array import array

from flare.serve.engine.block_manager import TOKEN, BlockManager
from flare.serve.engine.scheduler import Scheduler
from flare.serve.engine.sequence import SamplingParams, Sequence

BLOCK = 16
PROMPTS = 200


def admit(scheduler: Scheduler, prompt: list[int]) -> float:
    """Seconds the scheduler's step took to admit `prompt`, which is then finished."""
    seq = Sequence(prompt, SamplingParams(temperature=0), 8)
    scheduler.add(seq)
    started = time.perf_counter()
    batch = scheduler.schedule()
    took = time.perf_counter() - started
    assert batch is not None and batch.prefill and batch.seqs == [seq]
    scheduler.finish(seq)
    return took


def floor(prompt: list[int]) -> float:
    started = time.perf_counter()
    hashlib.blake2b(array(TOKEN, prompt).tobytes(), digest_size=16).digest()
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--blocks", type=int, default=220_000, help="the KV cache's blocks")
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 128_000) for _ in range(args.tokens)] for _ in range(PROMPTS)]
    scheduler = Scheduler(BlockManager(args.blocks, BLOCK), 64, args.tokens + BLOCK)
    fresh = [admit(scheduler, p) for p in prompts]
    again = [admit(scheduler, p) for p in prompts]
    base = statistics.median(floor(p) for p in prompts)
    print(f"| {args.tokens}-token prompt | ms (median of {PROMPTS}) | x the floor |")
    print("|---|---|---|")
    for case, times in (("never seen", fresh), ("seen before", again)):
        took = statistics.median(times)
        print(f"| {case} | {took * 1e3:.3f} | {took / base:.0f}x |")
    print(f"| floor: its ids as bytes, hashed once | {base * 1e3:.3f} | 1x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
