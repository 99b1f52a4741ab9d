"""Load benchmark: what checking a package while loading it costs (issue 13, item 4).

`flare serve` compares every payload's safetensors header with the manifest before it makes
tensors from the payload, hashes it (BLAKE3 on all threads: on the CPU the memory map, while
the tensors are copied into the model; on a GPU each chunk as it is read onto the device), and
hashes every artifact it reads. This script builds a synthetic Llama package of about
`--size-mb` of seeded random BF16 weights, then loads it in alternating runs with the check
(the code as it ships) and without it (the same code with `hash_bytes`, the staged loader's
hasher and `PackageFiles._check_digest` replaced by no-ops for those runs), and prints the
overhead: median time with the check over median time without, minus one. Target: under 10%.

Two loads are timed, each warm (blobs in the page cache: read once before any timing) and
cold (every blob dropped from the page cache with posix_fadvise before each run, so the
load reads the disk):

- `load_runtime`: what `flare serve` does between the pull and "serving ... at", the time
  it prints as "loaded NAME ... in S s" (model, weights, tokenizer, KV cache);
- `load_model`: the model and its weights only, where the hash weighs most.

Each run records wall-clock seconds and the process's CPU seconds (all its threads): on a
machine that other work keeps busy, wall times swing with that work, while the CPU overhead
stays put and bounds what the check costs when no core is free for it.

    python tests/bench/bench_load.py [--size-mb 400] [--repeat 7] [--device cpu]
        [--workdir DIR] [--json]

Nothing asserts on time: the script prints its figures and PASS/MISS against the target.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tests' helpers

from common import log, scratch

TARGET = 0.10
"""The check may add at most this fraction to the load time."""


@dataclass
class Case:
    """One load, timed with and without the check in alternating runs: wall-clock seconds,
    and the process's CPU seconds (all threads), which another session's load disturbs less."""

    load: str
    cache: str
    checked_s: list[float] = field(default_factory=list)
    unchecked_s: list[float] = field(default_factory=list)
    checked_cpu_s: list[float] = field(default_factory=list)
    unchecked_cpu_s: list[float] = field(default_factory=list)

    def overhead(self) -> float:
        """Median wall time with the check over median time without, minus one."""
        return _overhead(self.checked_s, self.unchecked_s)

    def paired(self) -> float:
        """The median overhead of runs made back to back."""
        pairs = zip(self.checked_s, self.unchecked_s, strict=True)
        return statistics.median(c / u for c, u in pairs) - 1

    def cpu_overhead(self) -> float:
        """The same from CPU seconds: what the check costs where the cores are all busy."""
        return _overhead(self.checked_cpu_s, self.unchecked_cpu_s)

    def verdict(self) -> str:
        return "PASS" if self.overhead() < TARGET else "MISS"


def _overhead(checked: list[float], unchecked: list[float]) -> float:
    return statistics.median(checked) / statistics.median(unchecked) - 1


def build(workdir: Path, size: int) -> tuple[object, dict[str, Path]]:
    """Build the synthetic package into a registry folder; its manifest and blob files."""
    from checkpoints import make_synthetic_llama
    from registry_helpers import Quiet

    from flare.build.pipeline import Build, BuildRequest
    from flare.registry.registry import Registry
    from flare.serve.cache import HostCache

    source = make_synthetic_llama(workdir / "checkpoint", size)
    registry = Registry(str(workdir / "registry"), f"sqlite:///{workdir / 'index.db'}")
    request = BuildRequest(
        source=str(source), name="synthetic", staging=workdir / "staging", hub_cache=workdir
    )
    manifest = Build(request, registry, Quiet()).run().manifest
    registry.db.dispose()
    return manifest, HostCache(workdir / "registry").files(manifest)


class NoHash:
    """A hasher that hashes nothing: the staged loader's, for the runs without the check."""

    def update(self, data: object) -> NoHash:
        return self

    def hexdigest(self) -> str:
        return "0" * 64


@contextmanager
def unchecked() -> Iterator[None]:
    """The loader without its digest check: no hashing (headers are still compared), the
    mapped loader's (hash_bytes) nor the staged one's (its hasher)."""
    from flare.serve.models import files, staging

    hash_bytes, check = files.hash_bytes, files.PackageFiles._check_digest
    new_hasher = staging.new_hasher
    files.hash_bytes = lambda data: None  # type: ignore[assignment,return-value]
    files.PackageFiles._check_digest = lambda self, actual, part: None  # type: ignore[method-assign]
    staging.new_hasher = lambda: NoHash()  # type: ignore[assignment,return-value]
    try:
        yield
    finally:
        files.hash_bytes = hash_bytes
        files.PackageFiles._check_digest = check  # type: ignore[method-assign]
        staging.new_hasher = new_hasher


def drop_from_page_cache(files: list[Path]) -> None:
    """Evict the blobs' pages (clean pages of unmapped files go; nothing else is touched)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(files: list[Path]) -> None:
    for path in files:
        path.read_bytes()


def timer(
    load: Callable[[], object], before: Callable[[], None], device: str
) -> Callable[[], tuple[float, float]]:
    """Wall and CPU seconds one load takes, after `before` (which is not timed)."""

    def run() -> tuple[float, float]:
        import torch

        gc.collect()
        before()
        start, cpu = time.perf_counter(), time.process_time()
        loaded = load()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
        del loaded
        return seconds, cpu_seconds

    return run


def measure(case: Case, run: Callable[[], tuple[float, float]], repeat: int) -> None:
    """One untimed run of each, then `repeat` pairs, alternating which goes first."""

    def without() -> tuple[float, float]:
        with unchecked():
            return run()

    run()
    without()
    for index in range(repeat):
        order = [(case.checked_s, case.checked_cpu_s, run)]
        order.append((case.unchecked_s, case.unchecked_cpu_s, without))
        for wall, cpu, action in order if index % 2 == 0 else order[::-1]:
            seconds, cpu_seconds = action()
            wall.append(seconds)
            cpu.append(cpu_seconds)
        log(
            f"  {case.load} / {case.cache} #{index + 1}: with the check "
            f"{case.checked_s[-1]:.3f} s ({case.checked_cpu_s[-1]:.3f} s CPU), without "
            f"{case.unchecked_s[-1]:.3f} s ({case.unchecked_cpu_s[-1]:.3f} s CPU)"
        )


def benchmark(workdir: Path, size: int, repeat: int, device: str) -> dict[str, object]:
    import torch

    from flare.serve.models import load_model
    from flare.serve.models.files import PackageFiles
    from flare.serve.runtime import load_runtime

    load_average = os.getloadavg()[0]
    log(f"building a synthetic package of about {size / 1e6:.0f} MB in {workdir}")
    manifest, files = build(workdir, size)
    paths = sorted(set(files.values()))
    weights = sum(p.size for p in manifest.payloads)  # type: ignore[attr-defined]
    target = torch.device(device)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    loads: dict[str, Callable[[], object]] = {
        "load_runtime": lambda: load_runtime(manifest, files, device),  # type: ignore[arg-type]
        "load_model": lambda: load_model(PackageFiles(manifest, files), target, dtype),  # type: ignore[arg-type]
    }
    befores = {"warm": lambda: None, "cold": lambda: drop_from_page_cache(paths)}
    read_all(paths)
    cases = []
    for load_name, load in loads.items():
        for cache, before in befores.items():
            case = Case(load_name, cache)
            measure(case, timer(load, before, device), repeat)
            cases.append(case)
    return {
        "device": device,
        "weights_bytes": weights,
        "payloads": len(manifest.payloads),  # type: ignore[attr-defined]
        "cpus": len(os.sched_getaffinity(0)),
        "load_average": load_average,
        "cases": [
            {
                **asdict(c),
                "overhead": c.overhead(),
                "paired": c.paired(),
                "cpu_overhead": c.cpu_overhead(),
                "verdict": c.verdict(),
            }
            for c in cases
        ],
    }


def spread(seconds: list[float]) -> str:
    return f"{statistics.median(seconds):.3f} ({min(seconds):.3f}-{max(seconds):.3f})"


def print_table(report: dict[str, object]) -> None:
    print(
        f"\nload of {report['weights_bytes'] / 1e6:.0f} MB of BF16 weights in "
        f"{report['payloads']} payloads on {report['device']} ({report['cpus']} CPUs, load "
        f"average {report['load_average']:.1f} at the start); wall seconds, median (min-max)\n"
    )
    print(
        "| load | page cache | with the check | without | overhead | paired | CPU overhead "
        "| target < 10% |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for case in report["cases"]:  # type: ignore[attr-defined]
        print(
            f"| `{case['load']}` | {case['cache']} | {spread(case['checked_s'])} | "
            f"{spread(case['unchecked_s'])} | {case['overhead']:+.1%} | {case['paired']:+.1%} | "
            f"{case['cpu_overhead']:+.1%} | {'met' if case['verdict'] == 'PASS' else 'missed'} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=400, help="weights to build, in MB")
    parser.add_argument("--repeat", type=int, default=7, help="timed pairs per case")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--workdir", type=Path, help="parent of the scratch folder (/tmp)")
    parser.add_argument("--json", action="store_true", help="print everything as JSON")
    args = parser.parse_args(argv)
    with scratch(args.workdir, "flare-bench-load-") as workdir:
        report = benchmark(workdir, args.size_mb * 1_000_000, args.repeat, args.device)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
