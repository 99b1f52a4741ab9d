"""What one launch of each of a decode layer's kernels costs the host, on CUDA.

    python tests/bench/gpu_launch_cost.py [--out DIR]

A step that no CUDA graph replays (every prefill, and a decode wider than the widest graph)
launches its kernels one by one from Python, and on the H200 such a step of the 1B shape took
12-22 ms of host time for 159-175 kernels (docs/performance.md). This measures the host's
microseconds a call, for the calls a decoder layer makes, each on tiny inputs so the device
keeps ahead: a plain torch op (the baseline, in the same process), flare's Triton kernels
called straight and through their opaque operators (`flare::silu_mul`, `flare::add_rms_norm`,
`flare::linear` at one row), launched as dependents and not, and Dynamo's `mark_unbacked`
that a compiled layer's call makes three times. Median of REPEATS rounds of CALLS calls, the
device synchronized between rounds. Nothing asserts on time; it prints one JSON report.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from common import timed

CALLS = 2000
REPEATS = 5


def per_call_us(call: Callable[[], object]) -> float:
    """The host's microseconds a call: the median round, after one round of warm-up."""

    def round_of_calls() -> None:
        for _ in range(CALLS):
            call()

    rounds = []
    for _ in range(REPEATS + 1):
        torch.cuda.synchronize()
        rounds.append(timed(round_of_calls) / CALLS * 1e6)
    torch.cuda.synchronize()
    return round(statistics.median(rounds[1:]), 2)


def calls() -> dict[str, Callable[[], object]]:
    """Each measured call, by name, on inputs of a 1B decode step's one row."""
    from flare.serve.models.activation import silu_mul_rows
    from flare.serve.models.linear import few_rows
    from flare.serve.models.rms_norm import add_rms_norm

    device, dtype = torch.device("cuda"), torch.bfloat16
    x = torch.randn(1, 2048, device=device, dtype=dtype)
    gate_up = torch.randn(1, 16384, device=device, dtype=dtype)
    weight = torch.randn(3072, 2048, device=device, dtype=dtype)
    norm = torch.ones(2048, device=device, dtype=dtype)
    mark = torch._dynamo.decorators.mark_unbacked
    return {
        "torch.empty_like (baseline)": lambda: torch.empty_like(x),
        "x + x (one torch kernel)": lambda: x + x,
        "silu_mul kernel, straight": lambda: silu_mul_rows(gate_up, dependent=False),
        "silu_mul kernel, straight, dependent": lambda: silu_mul_rows(gate_up, dependent=True),
        "flare::silu_mul": lambda: torch.ops.flare.silu_mul(gate_up),
        "flare::add_rms_norm": lambda: add_rms_norm(x, x, norm, 1e-5),
        "few_rows, straight": lambda: few_rows(x, weight),
        "flare::linear (few_rows)": lambda: torch.ops.flare.linear(x, weight),
        "mark_unbacked": lambda: mark(x, 0),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_launch_cost.py needs CUDA (and Triton)", file=sys.stderr)
        return 2
    with torch.inference_mode():
        report = {name: per_call_us(call) for name, call in calls().items()}
    report = {"device": torch.cuda.get_device_name(0), "us_per_call": report}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_launch_cost.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
