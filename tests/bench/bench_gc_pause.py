"""What Python's garbage collector stops a loaded engine for, with and without the heap frozen
(serve/heap.py's `freeze_heap`, which flare's serving processes call once loaded).

The seeded tiny Llama is built by the real pipeline and loaded on the CPU in a fresh process
per mode; WIDTH greedy requests decode for STEPS engine steps while `gc.callbacks` time every
collection. The interesting one is the full collection (generation 2): it walks every tracked
object, and a loaded process holds hundreds of thousands, so the step it falls in stalls every
stream.

    python tests/bench/bench_gc_pause.py [--width 32] [--steps 430] [--json]

Nothing asserts on time: the script prints its figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tests' helpers

MODES = ("as loaded", "heap frozen")
PROMPT = 32


class Collections:
    """Every collection's generation and seconds, from gc.callbacks."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._started = 0.0
        gc.callbacks.append(self._note)

    def _note(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._started))

    def figures(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for generation in range(3):
            times = [s for g, s in self.pauses if g == generation]
            out[f"gen{generation}_collections"] = len(times)
            out[f"gen{generation}_longest_ms"] = round(1000 * max(times, default=0.0), 2)
            out[f"gen{generation}_total_ms"] = round(1000 * sum(times), 2)
        return out


def measure(mode: str, width: int, steps: int) -> dict[str, Any]:
    """One mode, in this process: build, load, (freeze), decode, time the collections."""
    import torch
    from test_runtime import build_package

    from flare.build.tiny import make_tiny_llama
    from flare.serve.heap import freeze_heap
    from flare.serve.runtime import GenerateRuntime, SamplingParams, load_runtime

    with tempfile.TemporaryDirectory(prefix="flare-gc-pause-") as work:
        root = Path(work)
        manifest, files, _ = build_package(make_tiny_llama(root / "tiny"), root, "tiny")
        runtime = load_runtime(manifest, files, "cpu", kv_cache_tokens=width * 1024)
        assert isinstance(runtime, GenerateRuntime)
        if mode == "heap frozen":
            freeze_heap()
        collectable, frozen = len(gc.get_objects()), gc.get_freeze_count()
        params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
        generator = torch.Generator().manual_seed(0)
        for _ in range(width):
            runtime.submit(torch.randint(5, 200, (PROMPT,), generator=generator).tolist(), params)
        collections = Collections()
        started = time.perf_counter()
        for _ in range(steps):
            runtime.engine.step()
        seconds = time.perf_counter() - started
        return {
            "mode": mode,
            "objects_collected_over": collectable,
            "objects_frozen": frozen,
            "ms_per_step": round(1000 * seconds / steps, 3),
            **collections.figures(),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--steps", type=int, default=430)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(measure(args.mode, args.width, args.steps)))
        return 0
    rows = []
    for mode in MODES:
        command = [sys.executable, __file__, "--mode", mode]
        command += ["--width", str(args.width), "--steps", str(args.steps)]
        done = subprocess.run(command, check=True, capture_output=True, text=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    columns = [key for key in rows[0] if key != "mode"]
    print("| mode | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for row in rows:
        print(f"| {row['mode']} | " + " | ".join(str(row[c]) for c in columns) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
