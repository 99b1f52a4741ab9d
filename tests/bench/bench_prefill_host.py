"""What a long prompt's prefill costs the host before its forward: scheduling it (allocating
its KV blocks and naming each full block for prefix reuse), the step's input lists (token ids,
positions, KV slots), and those lists made tensors on the model's device.

The first token of an 8K-token prompt waits for all three on the engine thread. The baseline
is in the same process: `torch.tensor` made from the same lists, the way the step's tensors
were made before `device_io.upload` read them through NumPy.

    python tests/bench/bench_prefill_host.py [--tokens 1024,8192] [--device cpu|cuda]

Nothing asserts on time: the script prints milliseconds (median of ROUNDS, after WARMUP).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from flare.serve.engine.block_manager import BlockManager
from flare.serve.engine.runner import ModelRunner
from flare.serve.engine.scheduler import Scheduler
from flare.serve.engine.sequence import SamplingParams, Sequence

BLOCK = 16
ROUNDS = 15
WARMUP = 3


def one_prefill(tokens: int, device: torch.device) -> dict[str, float]:
    """Seconds of each part for one fresh prompt of `tokens` tokens in an empty cache."""
    blocks = BlockManager(2 * tokens // BLOCK + 2, BLOCK)
    scheduler = Scheduler(blocks, max_num_seqs=64, max_batched_tokens=2 * tokens)
    runner = ModelRunner(None, None, BLOCK, device)  # type: ignore[arg-type]
    prompt = [random.randrange(2, 128_000) for _ in range(tokens)]
    scheduler.add(Sequence(prompt, SamplingParams(temperature=0), max_tokens=1))
    started = time.perf_counter()
    batch = scheduler.schedule()
    scheduled = time.perf_counter()
    assert batch is not None and batch.prefill
    step = runner.step_input(batch.seqs, prefill=True)
    listed = time.perf_counter()
    runner.tensors(step)
    made = time.perf_counter()
    lists = (step.ids, step.positions, step.slots)
    [torch.tensor(values, dtype=torch.int64) for values in lists]
    baseline = time.perf_counter()
    return {
        "schedule": scheduled - started,
        "step input": listed - scheduled,
        "tensors": made - listed,
        "baseline: torch.tensor of ids, positions, slots": baseline - made,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tokens", default="1024,8192")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    for tokens in map(int, args.tokens.split(",")):
        for _ in range(WARMUP):
            one_prefill(tokens, device)
        rounds = [one_prefill(tokens, device) for _ in range(ROUNDS)]
        parts = {k: 1000 * statistics.median(r[k] for r in rounds) for k in rounds[0]}
        print(f"{tokens} tokens: " + ", ".join(f"{k} {v:.2f} ms" for k, v in parts.items()))
        if args.device == "cuda":
            torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
