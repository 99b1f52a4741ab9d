"""The weights' read beside busy Python: what each way of reading costs the thread it runs beside.

A server's start reads the weights on threads of its own while its main thread runs Python
(the backends' imports, Dynamo's trace): both share the GIL and the host's cores, and the
start waits for the slower. This script builds gpu_load.py's synthetic package, then times, in
alternating rounds of the same run, a fixed piece of Python work on the main thread (rounds of
a large module's source compiled, one C call that holds the GIL as an import's unmarshal does,
then small dict and string work at the bytecode level, as tracing does) alone, and again
while a staged load (`Staging`: `--chunk-mb`, `--readers`, `--hash-threads`) runs on a
thread of its own, with the interpreter's switch interval at WeightsLoading's. For each way
of reading it prints the load's seconds and GB/s beside the work and the work's slowdown
(its seconds beside the load over its seconds alone).

    python tests/bench/gpu_load_beside.py [--size-mb 2000] [--repeat 3] [--device cuda]
        [--chunk-mb 16] [--readers 1 2 4] [--hash-threads 0 4] [--work-s 1.0]

`--hash-threads 0` is the hash's default (as many threads as useful). Nothing asserts on time.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tests' helpers

from bench_load import build, read_all
from common import log, scratch
from gpu_load import Load, timed

from flare.serve.models import WeightsLoading


def python_work(rounds: int) -> float:
    """Seconds to run `rounds` of Python at the bytecode level (small calls, dicts, strings:
    what tracing does) and one `compile` of a large module's source (a C call that holds the
    GIL throughout, as an import's unmarshal does) each."""
    source = inspect.getsource(inspect)
    started = time.perf_counter()
    for _ in range(rounds):
        compile(source, "inspect.py", "exec")
        table: dict[str, int] = {}
        for number in range(20_000):
            table[str(number % 997)] = table.get(str(number % 991), 0) + len(str(number))
    return time.perf_counter() - started


def rounds_for(seconds: float) -> int:
    """Rounds of `python_work` that take about `seconds` alone."""
    once = min(python_work(1) for _ in range(3))
    return max(1, round(seconds / once))


def beside(load: Load, rounds: int, device: object) -> tuple[float, float]:
    """The load's seconds on a thread of its own and the work's on this one, run together."""
    took: list[float] = []
    switch = sys.getswitchinterval()
    sys.setswitchinterval(WeightsLoading.SWITCH_S)
    try:
        reader = threading.Thread(target=lambda: took.append(timed(load, device)))
        reader.start()
        work = python_work(rounds)
        reader.join()
    finally:
        sys.setswitchinterval(switch)
    return took[0], work


def benchmark(args: argparse.Namespace, workdir: Path) -> dict[str, object]:
    import torch

    device = torch.device(args.device)
    manifest, files = build(workdir, args.size_mb * 1_000_000)
    read_all(sorted(set(files.values())))
    weights = sum(p.size for p in manifest.payloads)  # type: ignore[attr-defined]
    ways = {
        f"{mb} MiB x {r}, hash {h or 'all'}": (mb << 20, r, h or None)
        for mb in args.chunk_mb
        for r in args.readers
        for h in args.hash_threads
    }
    loads = {name: Load(manifest, files, device, *how) for name, how in ways.items()}
    rounds = rounds_for(args.work_s)
    alone: list[float] = []
    load_s: dict[str, list[float]] = {name: [] for name in loads}
    work_s: dict[str, list[float]] = {name: [] for name in loads}
    for load in loads.values():
        timed(load, device)  # once untimed: first-touch costs, allocator warm-up
    for index in range(args.repeat):
        alone.append(python_work(rounds))
        order = list(loads.items())
        for name, load in order if index % 2 == 0 else order[::-1]:
            seconds, work = beside(load, rounds, device)
            load_s[name].append(seconds)
            work_s[name].append(work)
        log(f"  round {index + 1}: work alone {alone[-1]:.3f} s")
    base = statistics.median(alone)
    return {
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "weights_bytes": weights,
        "work_alone_s": base,
        "ways": {
            name: {
                "load_s": statistics.median(load_s[name]),
                "load_gb_per_s": weights / statistics.median(load_s[name]) / 1e9,
                "work_s": statistics.median(work_s[name]),
                "work_slowdown": statistics.median(work_s[name]) / base,
            }
            for name in loads
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--chunk-mb", type=int, nargs="+", default=[16])
    parser.add_argument("--readers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--hash-threads", type=int, nargs="+", default=[0, 4])
    parser.add_argument("--work-s", type=float, default=1.0, help="the work's seconds alone")
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    with scratch(args.workdir, "flare-bench-load-beside-") as workdir:
        report = benchmark(args, workdir)
    print(json.dumps(report, indent=2))
    size = report["weights_bytes"] / 1e9  # type: ignore[operator]
    print(f"\nwork alone {report['work_alone_s']:.3f} s; weights {size:.2f} GB")
    print("| read | load s beside | GB/s | work s beside | work slowdown |\n|---|---|---|---|---|")
    for name, way in report["ways"].items():  # type: ignore[attr-defined]
        print(
            f"| {name} | {way['load_s']:.3f} | {way['load_gb_per_s']:.2f} | {way['work_s']:.3f} "
            f"| {way['work_slowdown']:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
