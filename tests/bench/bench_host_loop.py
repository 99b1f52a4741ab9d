"""What the engine's host loop costs a step, without the forward: the Python a decode step runs
for every sequence (scheduling, the step's input lists, sampling's bookkeeping, landing the
tokens, detokenizing, the deltas), which on a GPU host bounds the steps a second once the
device's step is shorter.

The seeded tiny Llama is built by the real pipeline and loaded on the CPU in this process. For
each width (at most the package's max concurrency, 32), WIDTH greedy requests are prefilled
and then stepped STEPS times twice, as the engine's loop steps them: once as they are (the
baseline: the forward included), then with the runner's `run_step` answering each step with
the same fixed logits (a vocabulary of 256, so the sampler's arithmetic is negligible), which
leaves the host loop alone. As in the engine process, the heap is frozen once loaded and each
request's deltas are forwarded as they are pushed (here into a list emptied after each step,
as the engine process's sender empties its own). It prints the host loop's milliseconds a
step, its microseconds a sequence, and its share of the whole step.

    python tests/bench/bench_host_loop.py [--widths 1,16,32] [--steps 150] [--json]

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

PROMPT = 100
FIXED_VOCAB = 256


def step_times(engine: Any, steps: int, sink: list[Any]) -> float:
    """The median wall time of `steps` engine steps (the deltas they pushed dropped after)."""
    walls = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - started)
        sink.clear()
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
    handles, sink = [runtime.submit(prompt, params) for prompt in prompts], []
    for handle in handles:
        handle.forward(sink.append)
    for _ in range(3):  # the prefill, then decode steps
        engine.step()
    if len(engine.scheduler.running) != width:
        raise RuntimeError(f"{len(engine.scheduler.running)} of {width} sequences decode together")
    whole = step_times(engine, steps, sink)
    with torch.inference_mode():
        logits = torch.randn(width, FIXED_VOCAB, generator=generator)
    runner.run_step = lambda step, fresh=None: StepLogits(logits[: len(step.ids)])
    try:
        alone = step_times(engine, steps, sink)
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
    parser.add_argument("--widths", default="1,16,32")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from test_runtime import build_package

    from flare.build.tiny import make_tiny_llama
    from flare.serve.heap import freeze_heap
    from flare.serve.runtime import GenerateRuntime, load_runtime

    widths = [int(w) for w in args.widths.split(",")]
    with tempfile.TemporaryDirectory(prefix="flare-host-loop-") as work:
        root = Path(work)
        manifest, files, _ = build_package(make_tiny_llama(root / "tiny"), root, "tiny")
        tokens = max(widths) * (PROMPT + 2 * args.steps + 64)
        runtime = load_runtime(manifest, files, "cpu", kv_cache_tokens=tokens)
        assert isinstance(runtime, GenerateRuntime)
        freeze_heap()
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
