"""The registry bench's verify section: one package of a synthetic checkpoint verified against
`b3sum` over the same blobs (bench_registry.py runs it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tests' helpers

from checkpoints import make_synthetic_llama
from common import flare_command, flare_env
from registry_measure import (
    GIB,
    Section,
    Target,
    Timing,
    alternate,
    log,
    open_registry,
    process,
    profile_top,
    time_stages,
)

from flare.registry.registry import Registry
from flare.store.encoding import Encoding
from flare.store.hashing import hash_file
from flare.store.layout import blob_key

VERIFY_TARGET = 1.2
BIG = "big"


# -- 3. verify ----------------------------------------------------------------------------


def build_big(workdir: Path, size: int) -> tuple[Registry, list[Path]]:
    """Build package `big` from a synthetic checkpoint; return its registry and blob files."""
    checkpoint, home = workdir / "big-checkpoint", workdir / "big-home"
    log(f"writing a synthetic Llama checkpoint of about {size / GIB:.2f} GiB")
    make_synthetic_llama(checkpoint, size)
    log("building it: flare build --name big")
    command = [*flare_command(), "build", str(checkpoint), "--name", BIG, "--json"]
    subprocess.run(command, check=True, capture_output=True, env=flare_env(home, home / "config"))
    shutil.rmtree(checkpoint)
    os.sync()
    registry = open_registry(home / "registry", home)
    _name, digest, manifest = registry.manifest(BIG)
    keys = [blob_key(d, Encoding.PLAIN) for d in [digest, *manifest.blobs()]]
    return registry, [registry.store.backend.local_path(k) for k in keys]


def check_b3sum(paths: list[Path]) -> None:
    """b3sum must print each blob's own name: the baseline hashes the same bytes."""
    done = subprocess.run(["b3sum", *map(str, paths)], check=True, capture_output=True, text=True)
    for line in done.stdout.splitlines():
        hex_digest, path = line.split(maxsplit=1)
        if Path(path).name != hex_digest:
            raise RuntimeError(f"b3sum gives {hex_digest} for {path}")


def bench_verify(workdir: Path, size: int, repeat: int) -> Section:
    """Time verifying package `big` against b3sum over its blob files."""
    section = Section(
        f"3. verify a {size / GIB:.2f} GiB package (target: within {VERIFY_TARGET}x of b3sum)"
    )
    registry, paths = build_big(workdir, size)
    report = registry.verify(BIG)
    if not report.ok or report.checked != len(paths):
        raise RuntimeError(f"verify of {BIG} failed: {report}")
    check_b3sum(paths)
    nbytes = sum(p.stat().st_size for p in paths)
    section.notes.append(
        f"{len(paths)} blob files, {nbytes / GIB:.3f} GiB (index and payloads included), "
        f"{len(os.sched_getaffinity(0))} cores; page cache warm; verify finds all {report.checked}"
        " intact and b3sum prints each file's own name"
    )
    verify = Timing(f'Registry.verify("{BIG}")')
    b3sum = Timing("b3sum BLOB_FILES > /dev/null")
    log("timing verify")
    alternate(
        [(verify, lambda: registry.verify(BIG)), (b3sum, process(["b3sum", *map(str, paths)]))],
        repeat,
    )
    section.timings = [verify, b3sum]
    section.targets = [Target("verify", verify, VERIFY_TARGET, b3sum)]
    if section.missed():
        section.diagnosis = explain_verify(registry, paths)
    return section


def explain_verify(registry: Registry, paths: list[Path]) -> list[str]:
    """Where verify's time goes: the look-ups, then the same hashing done in other ways."""
    log("profiling verify")
    parts = time_stages(
        [
            ("resolve + read_manifest (one small index read)", lambda: registry.manifest(BIG)),
            ("store.sweep_temps()", registry.store.sweep_temps),
            ("Registry.verify(workers=1): one file at a time", lambda: registry.verify(BIG, 1)),
            ("hash_file() per file in turn, threads: auto", lambda: [hash_file(p) for p in paths]),
            ("hash_file() per file in turn, 1 thread", lambda: [hash_file(p, 1) for p in paths]),
        ]
    )
    lines = ["verify's look-ups, and the same hashing done other ways (min of 3):"]
    lines += [f"  {name:<58} {s:7.3f} s" for name, s in parts]
    lines.append("(cProfile sees the main thread only: pool workers' hashing shows as waiting)")
    return [*lines, *profile_top(lambda: registry.verify(BIG))]
