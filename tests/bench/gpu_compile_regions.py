"""The compiled forward as one graph for every decoder layer, against the whole step as one graph.

A server's warm-up traces its compiled forward before it loads the package's graphs from
Inductor's cache; tracing the whole step costs time for every layer (bench_trace_layers.py).
flare's `CompiledForward` compiles one decoder layer's call, the first layer's, and the logits'
(three graphs whatever the depth). This script measures, on one GPU, what each way costs a
start and a step: gpu_attention.py's Llama of serving shape (8 layers, Llama-3.2-1B's 32/8
heads, random bf16 weights built on the GPU, no package) with FlashInfer attention, compiled
into an empty Inductor cache in one process, then loaded from that cache in a fresh one, as a
package's build and a server's start do. Baseline: the whole step compiled the same way, in
this script.

    python tests/bench/gpu_compile_regions.py

Prints JSON per way and process (each process's result also on stderr as it ends): warm-up
seconds (trace, then compile or load), what it made (compilations.describe), Inductor's and
AOTAutograd's cache counters, and the median of 8 prefill steps of one sequence at 1, 40 and
512 tokens, in ms (eager steps: no CUDA graph, so the host's time per step shows).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WAYS = ("whole", "layers")
TOKENS = (1, 40, 512)
REPEATS = 8


def whole_step(forward: Any, model: Any) -> Any:
    """The step as the seventh to ninth sessions compiled it: one graph, every layer in it."""
    import torch

    from flare.serve.engine.attention_op import bound_attention

    operator = forward._operator
    step = torch.compile(
        lambda ids, pos, last: model.compute_logits(model.forward(ids, pos, operator)[last]),
        fullgraph=True,
    )

    def run(ids: Any, pos: Any, last: Any, attention: Any) -> Any:
        for tensor in (ids, pos, last):
            torch._dynamo.decorators.mark_unbacked(tensor, 0)
        with bound_attention(attention):
            return step(ids, pos, last)

    return run


def one_process(way: str, cache: Path) -> dict[str, Any]:
    """Warm up the `way` forward with Inductor's cache in `cache`; time prefill steps."""
    import torch
    from gpu_attention import build_model
    from torch._dynamo.utils import counters

    from flare.serve import compilations
    from flare.serve.compiled import CompiledForward, use_cache_folder, warm_up
    from flare.serve.engine.attention_choice import make_attention
    from flare.serve.engine.block_manager import BlockManager
    from flare.serve.engine.runner import ModelRunner
    from flare.serve.engine.sequence import SamplingParams, Sequence

    use_cache_folder(cache)
    device = torch.device("cuda")
    model = build_model(device, heads=32)
    spec = model.attention_spec
    _, attention = make_attention("flashinfer", spec, 256 * 16, 16, torch.bfloat16, device)
    forward = CompiledForward(model)
    runner = ModelRunner(
        model, attention, 16, device, whole_step(forward, model) if way == "whole" else forward
    )
    blocks = BlockManager(256, 16)
    before = compilations.snapshot()
    started = time.perf_counter()
    warm_up(runner, blocks)
    torch.cuda.synchronize()
    warm = time.perf_counter() - started
    steps = {}
    for tokens in TOKENS:
        seconds = []
        for _ in range(REPEATS):
            seq = Sequence(list(range(1, tokens + 1)), SamplingParams(temperature=0), max_tokens=2)
            blocks.allocate(seq)
            torch.cuda.synchronize()
            started = time.perf_counter()
            runner.run([seq], prefill=True)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)
            blocks.free_sequence(seq)
            blocks.forget(seq)
        steps[tokens] = round(sorted(seconds)[REPEATS // 2] * 1000, 2)
    return {
        "warm_up_s": round(warm, 2),
        "made": (compilations.snapshot() - before).describe(),
        "caches": {
            key: value
            for group in ("inductor", "aot_autograd")
            for key, value in counters[group].items()
            if "cache" in key and "async" not in key
        },
        "prefill_step_ms_by_tokens": steps,
    }


def main() -> None:
    if len(sys.argv) == 3:  # a child: one way, one cache folder
        print(json.dumps(one_process(sys.argv[1], Path(sys.argv[2]))))
        return
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for way in WAYS:
            cache = Path(scratch) / way
            for process in ("compile", "load"):
                command = [sys.executable, __file__, way, str(cache)]
                done = subprocess.run(command, capture_output=True, text=True, check=True)
                report.setdefault(way, {})[process] = json.loads(done.stdout.splitlines()[-1])
                print(way, process, report[way][process], file=sys.stderr, flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
