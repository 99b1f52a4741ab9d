"""How the registry bench measures and reports: timings against targets, alternating cases,
profiles and the small helpers every section uses."""

from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tests' helpers

from blake3 import blake3
from common import timed

from flare.registry.registry import Registry, default_database
from flare.store.digest import Digest
from flare.store.encoding import Encoding
from flare.store.hashing import hash_bytes
from flare.store.layout import blob_key
from flare.store.package import (
    FORMAT_VERSION,
    RUNTIME_ABI,
    Artifact,
    Manifest,
    Model,
    Payload,
    PayloadTensor,
    Recipe,
    SourceFile,
    Toolchain,
)

GIB = 1 << 30
MODELS = 50
VERSIONS = 4
"""Packages per name, tagged v1..v4; the newest is also tagged `latest`."""
PROFILE_LINES = 8


def package_name(index: int) -> str:
    """The name the index-th package is published under (VERSIONS packages per name)."""
    return f"model-{index // VERSIONS:05d}"


def make_manifest(
    index: int, payloads: list[tuple[Digest, int]], artifacts: list[Artifact]
) -> Manifest:
    """A valid manifest for the index-th package, naming the given blobs."""
    model = f"org/model-{(index // VERSIONS) % MODELS}"
    source = SourceFile(path="model.safetensors", digest=str(payloads[0][0]), size=payloads[0][1])
    return Manifest(
        format=FORMAT_VERSION,
        name=package_name(index),
        model=Model(id=model, revision=None, files=(source,)),
        recipe=Recipe(name="llama", version=1, architecture="LlamaForCausalLM"),
        options={"ranks": 1, "payload_bytes": 256 << 20},
        ranks=1,
        toolchain=Toolchain(runtime_abi=RUNTIME_ABI),
        payloads=tuple(
            Payload(
                digest=str(digest),
                size=size,
                ranks=(0,),
                tensors=(PayloadTensor(name=f"w{k}", dtype="BF16", shape=(size // 2,)),),
            )
            for k, (digest, size) in enumerate(payloads)
        ),
        artifacts=tuple(artifacts),
        inputs=str(hash_bytes(f"inputs of package {index}".encode())),
    )


# -- results ------------------------------------------------------------------------------


@dataclass
class Timing:
    """One timed case: its label and the seconds of each timed run."""

    label: str
    runs: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    def summary(self) -> str:
        """'median (min-max)' in seconds."""
        return f"{self.median:7.3f} ({min(self.runs):.3f}-{max(self.runs):.3f})"


@dataclass
class Target:
    """A case against a limit: in seconds (no baseline), or as a ratio to a baseline."""

    name: str
    subject: Timing
    limit: float
    baseline: Timing | None = None

    @property
    def value(self) -> float:
        if self.baseline is None:
            return self.subject.median
        return self.subject.median / self.baseline.median

    def verdict(self) -> str:
        return "PASS" if self.value <= self.limit else "MISS"

    def describe(self) -> str:
        """The measured figure against the limit, with the verdict."""
        if self.baseline is None:
            figure = f"{self.value:.3f} s vs {self.limit} s ({self.value / self.limit:.2f}x)"
        else:
            figure = f"{self.value:.2f}x {self.baseline.label} (limit {self.limit}x)"
        return f"{self.verdict()}  {self.name}: {figure}"


@dataclass
class Section:
    """One part of the benchmark: what it set up, its timings, targets and diagnostics."""

    title: str
    notes: list[str] = field(default_factory=list)
    timings: list[Timing] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    diagnosis: list[str] = field(default_factory=list)

    def missed(self) -> list[Target]:
        return [t for t in self.targets if t.verdict() == "MISS"]


# -- small helpers ------------------------------------------------------------------------


def log(message: str) -> None:
    """Progress on stderr."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def git_state() -> str:
    """The commit this checkout is at, and the tracked files changed since (figures depend on
    the code that ran: others may be changing the working tree meanwhile)."""
    repo = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "log", "-1", "--format=%h %s"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    edits = [line[3:] for line in changed if line.strip()]
    head = head if len(head) <= 72 else head[:69] + "..."
    return f"{head}; tracked files changed: {', '.join(edits) or 'none'}"


def load() -> str:
    """The 1, 5 and 15 minute load averages."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def alternate(cases: list[tuple[Timing, Callable[[], object]]], repeat: int) -> None:
    """Run each case once untimed, then all of them `repeat` times, the order rotating."""
    for _timing, action in cases:
        action()
    for run in range(repeat):
        shift = run % len(cases)
        for timing, action in cases[shift:] + cases[:shift]:
            timing.runs.append(timed(action))


def shell(command: str) -> Callable[[], object]:
    """A shell command run with its output discarded, failing loudly."""
    return lambda: subprocess.run(command, shell=True, check=True, stdout=subprocess.DEVNULL)


def process(command: list[str], env: dict[str, str] | None = None) -> Callable[[], object]:
    """A process run with its output discarded, failing loudly."""
    return lambda: subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=env)


def open_registry(location: Path, home: Path) -> Registry:
    """The registry at a folder, with its default SQLite index DB beside the blobs."""
    return Registry(str(location), default_database(str(location), home))


def write_blob(root: Path, data: bytes) -> Digest:
    """Store bytes as a plain blob by writing its file directly (no temp file, no fsync).

    The result is what BlobStore.put_bytes leaves: the file named by its BLAKE3 digest under
    blobs/blake3/<2 hex>/, read-only.
    """
    digest = Digest(blake3(data).hexdigest())
    path = root / blob_key(digest, Encoding.PLAIN)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
    except FileExistsError:
        return digest
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    return digest


@contextmanager
def no_fsync() -> Iterator[None]:
    """Skip fsync while populating (durability is not what is measured); sync once after."""
    with mock.patch("os.fsync", lambda _fd: None):
        yield
    os.sync()


def profile_top(action: Callable[[], object], limit: int = PROFILE_LINES) -> list[str]:
    """The functions cProfile finds the most own time in, while the action runs once."""
    profiler = cProfile.Profile()
    profiler.runcall(action)
    entries: dict[Any, Any] = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    total = sum(e[2] for e in entries.values())
    ranked = sorted(entries.items(), key=lambda item: item[1][2], reverse=True)[:limit]
    lines = [f"cProfile, own time (profiled run: {total:.3f} s of own time in all):"]
    for (path, line, function), (_cc, calls, own, cumulative, _callers) in ranked:
        where = "/".join(Path(path).parts[-2:]) + f":{line}" if line else "builtin"
        lines.append(
            f"  {own:7.3f} s own {cumulative:7.3f} s cum {calls:>8} calls  {function} ({where})"
        )
    return lines


def stages(parts: list[tuple[str, float]]) -> list[str]:
    """Stage timings as lines, each with its share of their sum."""
    total = sum(s for _, s in parts) or 1.0
    return [f"  {name:<58} {s:7.3f} s  {100 * s / total:5.1f}%" for name, s in parts]


def time_stages(
    steps: list[tuple[str, Callable[[], object]]], runs: int = 3
) -> list[tuple[str, float]]:
    """Each step's best time over a few runs."""
    return [(name, min(timed(action) for _ in range(runs))) for name, action in steps]
