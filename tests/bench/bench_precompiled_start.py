"""What a start's forward costs with the package's precompiled graphs, against tracing them.

A start used to trace the forward's three graphs with Dynamo and load each from Inductor's
cache (the package's); it now loads them as the build compiled and saved them
(serve/precompiled.py). This script times both on one CPU Llama, each in a fresh process
(what a start is), with the same Inductor cache: first a build (the graphs compiled ahead of
time and saved), then `--repeat` starts of each way, alternating: `precompiled` loads the
saved graphs; `traced` runs the forward as torch before 2.11 does (Dynamo traces each graph
at its first call; Inductor finds it in the cache, which a first traced start fills: that
start is not counted). Each start's figure is the forward's creation (the graphs loaded, for
`precompiled`) plus flare's warm-up (a prefill and a decode of two batches), as the ready
line's `artifacts` and `warm-up`; the process's imports are apart.

    python tests/bench/bench_precompiled_start.py [--layers 16] [--hidden 512] [--repeat 3]

Prints JSON: each way's seconds per start, their medians, and traced over precompiled.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

START = """
import json, sys, time
from pathlib import Path
import torch
from flare.build.tiny import llama_config
from flare.serve import compilations, compiled
from flare.serve.engine.attention_choice import make_attention
from flare.serve.engine.block_manager import BlockManager
from flare.serve.engine.runner import ModelRunner
from flare.serve.models import empty_model

way, folder, layers, hidden = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
compiled.settings()
compiled.use_cache_folder(folder / "inductor")
cpu = torch.device("cpu")
model = empty_model("llama", 2, llama_config(2000, hidden, layers, 8, 4), cpu, torch.float32)
_, attention = make_attention("torch", model.attention_spec, 64 * 16, 16, torch.float32, cpu)
import torch._inductor.compile_fx  # the engine imports it before the load: not counted
if compiled.AHEAD_OF_TIME:
    from flare.serve import precompiled  # likewise
compiled.AHEAD_OF_TIME = way != "traced"
before = compilations.snapshot()
started = time.perf_counter()
forward = compiled.CompiledForward(model, None if way == "build" else folder / "graphs")
compiled.warm_up(ModelRunner(model, attention, 16, cpu, forward), BlockManager(64, 16))
seconds = time.perf_counter() - started
if way == "build":
    forward.save(folder / "graphs")
made = compilations.snapshot() - before
print(json.dumps({"seconds": seconds, "made": made.describe(), "not_loaded": forward.not_loaded}))
"""


def start(way: str, folder: Path, layers: int, hidden: int) -> dict[str, object]:
    """One start of `way` in a fresh process, its figures."""
    done = subprocess.run(
        [sys.executable, "-c", START, way, str(folder), str(layers), str(hidden)],
        capture_output=True,
        text=True,
        check=True,
        timeout=1800,
    )
    return json.loads(done.stdout.splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="flare-precompiled-") as scratch:
        folder = Path(scratch)
        build = start("build", folder, args.layers, args.hidden)
        start("traced", folder, args.layers, args.hidden)  # fills Inductor's graph cache
        runs: dict[str, list[float]] = {"precompiled": [], "traced": []}
        made: dict[str, str] = {}
        for _ in range(args.repeat):
            for way, seconds in runs.items():
                figures = start(way, folder, args.layers, args.hidden)
                seconds.append(round(float(figures["seconds"]), 3))  # type: ignore[arg-type]
                made[way] = str(figures["made"])
    medians = {way: statistics.median(seconds) for way, seconds in runs.items()}
    report = {
        "layers": args.layers,
        "hidden": args.hidden,
        "build_s": round(float(build["seconds"]), 2),  # type: ignore[arg-type]
        "seconds": runs,
        "made": made,
        "median_s": medians,
        "traced_over_precompiled": round(medians["traced"] / medians["precompiled"], 2),
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
