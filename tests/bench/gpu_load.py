"""Weights to the device at read speed (issue 16): the load against reading the blobs once.

Builds a synthetic Llama package of about `--size-mb` of random BF16 weights, reads its blobs
once so the page cache holds them (the host cache a restarted server reads), then times in
alternating rounds, all in the same run:

- `cat`: `cat BLOBS > /dev/null`, the time to read the weights once: the baseline;
- `mmap+copy`: each blob memory-mapped and copied whole to the device, nothing checked: what
  the old loader's reads and copies cost at best;
- `mapped`: `PackageFiles.tensors` without staging into an empty model on the device: each
  tensor a view of the map, hashed on other threads, copied into its parameter (the CPU's
  loader, and the GPU's before staging);
- `staged N MiB x R`: `PackageFiles.tensors` through `Staging` (N MiB reads, `--chunk-mb`,
  R of them in flight at once, `--readers`, into pinned buffers, each hashed and copied on a
  side stream into one device buffer per payload, checked, then copied device to device into
  the model), the pinned buffers' allocation included.

`staging_for(device)` picks what `flare serve` runs on that device (marked "ships"). Each
load ends when the device is idle. Before any timing, every load's model must hold the mapped
load's weights bit for bit (else the script stops, saying which tensor differs). Prints
seconds (median, min-max), GB/s and the ratio to `cat`; the goal on a GPU host is a shipped
load within 2x of `cat`.

    python tests/bench/gpu_load.py [--size-mb 2000] [--repeat 5] [--device cuda]
        [--chunk-mb 16 [4 64 ...]] [--readers 2 [1 4 ...]] [--workdir DIR] [--json]

Nothing asserts on time: the script prints its figures and met/missed against the goal.
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tests' helpers

from bench_load import build, read_all
from common import log, scratch

from flare.serve.models.staging import CHUNK, READERS

GOAL = 2.0
"""The shipped load may take at most this many times what reading the blobs once takes."""


def cat(paths: list[Path]) -> Callable[[], None]:
    def run() -> None:
        with open(os.devnull, "wb") as null:
            subprocess.run(["cat", *map(str, paths)], stdout=null, check=True)

    return run


def mmap_copy(paths: list[Path], device: object) -> Callable[[], None]:
    """Every blob mapped and copied whole to the device: no header, no hash, no model."""
    import torch

    def run() -> None:
        for path in paths:
            with open(path, "rb") as handle:
                mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
            host = torch.frombuffer(mapped, dtype=torch.uint8)
            torch.empty(len(host), dtype=torch.uint8, device=device).copy_(host)
            del host
            mapped.close()

    return run


class Load:
    """The package's weights into one empty model on the device: mapped (`chunk` 0), or
    staged in chunks of `chunk` bytes, `readers` at once; the model stays, for the check of
    what was loaded."""

    def __init__(
        self,
        manifest: object,
        files: dict[str, Path],
        device: object,
        chunk: int,
        readers: int,
        hash_threads: int | None = None,
    ) -> None:
        self.manifest, self.files, self.device = manifest, files, device
        self.chunk, self.readers, self.hash_threads = chunk, readers, hash_threads
        self.model = empty(manifest, files, device)

    def __call__(self) -> None:
        from flare.serve.models.files import PackageFiles
        from flare.serve.models.staging import Staging

        staging = (
            Staging(self.device, self.chunk, readers=self.readers, hash_threads=self.hash_threads)  # type: ignore[arg-type]
            if self.chunk
            else None
        )
        package = PackageFiles(self.manifest, self.files)  # type: ignore[arg-type]
        self.model.load_weights(package.tensors(0, staging))


def empty(manifest: object, files: dict[str, Path], device: object) -> Any:
    """An empty BF16 model of the package's shapes on the device."""
    import torch

    from flare.serve.models import empty_model
    from flare.serve.models.files import PackageFiles

    package = PackageFiles(manifest, files)  # type: ignore[arg-type]
    recipe = package.manifest.recipe
    config = package.require_json("config.json")
    return empty_model(recipe.name, recipe.version, config, device, torch.bfloat16)  # type: ignore[arg-type]


def same_weights(loads: dict[str, Load]) -> None:
    """Every load left the same weights, bit for bit, as the mapped one: a staged read that
    put a chunk in the wrong place, or lost one, fails here before any figure is printed."""
    import torch

    want = dict(loads["mapped"].model.named_parameters())
    for name, loaded in loads.items():
        for parameter, value in loaded.model.named_parameters():
            bits = value.detach().flatten().view(torch.uint8)  # random bytes hold NaNs
            if not torch.equal(bits, want[parameter].detach().flatten().view(torch.uint8)):
                raise SystemExit(f"{name} loaded {parameter} wrong: it differs from mapped")
    log(f"the same weights, bit for bit, from {', '.join(loads)}")


def timed(action: Callable[[], None], device: object) -> float:
    import torch

    gc.collect()
    start = time.perf_counter()
    action()
    if getattr(device, "type", "") == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def benchmark(
    workdir: Path,
    size: int,
    repeat: int,
    device_name: str,
    chunks_mb: list[int],
    readers: list[int],
) -> dict[str, object]:
    import torch

    from flare.serve.models.files import staging_for

    device = torch.device(device_name)
    log(f"building a synthetic package of about {size / 1e6:.0f} MB in {workdir}")
    manifest, files = build(workdir, size)
    paths = sorted(set(files.values()))
    weights = sum(p.size for p in manifest.payloads)  # type: ignore[attr-defined]
    payloads = sorted(files[str(p.digest)] for p in manifest.payloads)  # type: ignore[attr-defined]
    read_all(paths)
    shipping = staging_for(device)
    shipped = "mapped"
    staged = {f"staged {mb} MiB x {r}": (mb << 20, r) for mb in chunks_mb for r in readers}
    if shipping is not None:
        shipped = f"staged {shipping.chunk >> 20} MiB x {shipping.readers}"
        staged[shipped] = (shipping.chunk, shipping.readers)
    loads = {"mapped": Load(manifest, files, device, 0, 0)}
    loads.update({name: Load(manifest, files, device, *how) for name, how in staged.items()})
    del shipping
    cases: dict[str, Callable[[], None]] = {
        "cat": cat(payloads),
        "mmap+copy": mmap_copy(payloads, device),
        **loads,
    }
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for action in cases.values():
        timed(action, device)  # once untimed: first-touch costs, allocator warm-up
    same_weights(loads)
    for index in range(repeat):
        order = list(cases.items())
        for name, action in order if index % 2 == 0 else order[::-1]:
            seconds[name].append(timed(action, device))
        log(f"  round {index + 1}: " + ", ".join(f"{n} {s[-1]:.3f} s" for n, s in seconds.items()))
    base = statistics.median(seconds["cat"])
    ratio = statistics.median(seconds[shipped]) / base
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "",
        "weights_bytes": weights,
        "payloads": len(payloads),
        "cpus": len(os.sched_getaffinity(0)),
        "shipped": shipped,
        "seconds": seconds,
        "gb_per_s": {n: weights / statistics.median(s) / 1e9 for n, s in seconds.items()},
        "over_cat": {n: statistics.median(s) / base for n, s in seconds.items()},
        "verdict": "met" if ratio <= GOAL else "missed",
    }


def print_table(report: dict) -> None:
    print(
        f"\nload of {report['weights_bytes'] / 1e6:.0f} MB of BF16 weights in "
        f"{report['payloads']} payloads to {report['device']} {report['device_name']} "
        f"({report['cpus']} CPUs), page cache warm; seconds median (min-max)\n"
    )
    print("| read | seconds | GB/s | x cat |")
    print("|---|---|---|---|")
    for name, runs in report["seconds"].items():
        mark = " (ships)" if name == report["shipped"] else ""
        print(
            f"| {name}{mark} | {statistics.median(runs):.3f} ({min(runs):.3f}-{max(runs):.3f}) "
            f"| {report['gb_per_s'][name]:.2f} | {report['over_cat'][name]:.2f} |"
        )
    print(f"\nshipped load within {GOAL:.0f}x cat: {report['verdict']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=2000, help="weights to build, in MB")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds")
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument(
        "--chunk-mb", type=int, nargs="+", default=[CHUNK >> 20], help="staged read sizes to time"
    )
    parser.add_argument(
        "--readers", type=int, nargs="+", default=[READERS], help="reads in flight to time"
    )
    parser.add_argument("--workdir", type=Path, help="parent of the scratch folder (/tmp)")
    parser.add_argument("--json", action="store_true", help="print everything as JSON")
    args = parser.parse_args(argv)
    with scratch(args.workdir, "flare-bench-gpu-load-") as workdir:
        report = benchmark(
            workdir,
            args.size_mb * 1_000_000,
            args.repeat,
            args.device,
            args.chunk_mb,
            args.readers,
        )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
