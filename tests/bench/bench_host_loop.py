"""What the engine's host loop costs a step, without the forward: the Python a decode step runs
for every sequence (scheduling, the step's input lists, sampling's bookkeeping, landing the
tokens, detokenizing, the deltas), which on a GPU host bounds the steps a second once the
device's step is shorter.

The seeded tiny Llama is built by the real pipeline and loaded on the CPU in this process. For
each width, WIDTH greedy requests are prefilled and then stepped STEPS times twice, as the
engine's loop steps them: once as they are (the baseline: forward included), once with the
runner's `run_step` answering each step with the same fixed logits (a vocabulary of 256, so the
sampler's own arithmetic is negligible), which leaves the host loop alone. It prints the host
loop's milliseconds a step, its microseconds a sequence, and its share of the whole step.

    python tests/bench/bench_host_loop.py [--widths 1,16,64] [--steps 300] [--json]

Nothing asserts on time: the script prints its figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tests' helpers

PROMPT = 200
FIXED_VOCAB = 256


def step_times(engine: Any, steps: int) -> float:
    """The median wall time of `steps` engine steps."""
    walls = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - started)
    return statistics.median(walls)


def measure(runtime: Any, width: int, steps: int) -> dict[str, Any]:
    """One width: the whole step, then the host loop alone, on the same requests."""
    import torch

    from flare.serve.engine.runner import StepLogits
    from flare.serve.runtime import SamplingParams

    engine, runner = runtime.engine, runtime.runner
    params = SamplingParams(temperature=0, max_tokens=2 * steps + 8, ignore_eos=True)
    generator = torch.Generator().manual_seed(width)
    prompts = torch.randint(5, FIXED_VOCAB, (width, PROMPT), generator=generator).tolist()
    handles = [runtime.submit(prompt, params) for prompt in prompts]
    for _ in range(3):  # the prefill, then decode steps
        engine.step()
    if len(engine.scheduler.running) != width:
        raise RuntimeError(f"{len(engine.scheduler.running)} of {width} sequences decode together")
    whole = step_times(engine, steps)
    with torch.inference_mode():
        logits = torch.randn(width, FIXED_VOCAB, generator=generator)
    runner.run_step = lambda step, fresh=None: StepLogits(logits[: len(step.ids)])
    try:
        alone = step_times(engine, steps)
    finally:
        del runner.run_step  # the class's own again
    for handle in handles:
        handle.cancel()
    engine.step()  # takes the cancellations
    return {
        "width": width,
        "whole_step_ms": round(1000 * whole, 3),
        "host_loop_ms": round(1000 * alone, 3),
        "host_loop_us_per_sequence": round(1e6 * alone / width, 1),
        "host_loop_share": round(alone / whole, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--widths", default="1,16,64")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from test_runtime import build_package

    from flare.build.tiny import make_tiny_llama
    from flare.serve.runtime import GenerateRuntime, load_runtime

    widths = [int(w) for w in args.widths.split(",")]
    with tempfile.TemporaryDirectory(prefix="flare-host-loop-") as work:
        root = Path(work)
        manifest, files, _ = build_package(make_tiny_llama(root / "tiny"), root, "tiny")
        tokens = max(widths) * (PROMPT + 2 * args.steps + 64)
        runtime = load_runtime(manifest, files, "cpu", kv_cache_tokens=tokens)
        assert isinstance(runtime, GenerateRuntime)
        rows = [measure(runtime, width, args.steps) for width in widths]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    columns = list(rows[0])
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in columns) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
