"""Benchmark of the registry's `ls`, `gc` and `verify` against targets and baselines.

Everything is measured in one run, each case against a baseline timed in the same run:

1. ls: a registry of N packages (default 10,000), written without builds: each package's
   index (a real Manifest, encoded with encode_index) names a few shared payload and artifact
   blobs and one payload blob of its own, and is published with Registry.publish, so the
   index DB is written by flare's own code (fsync is skipped while populating, then
   everything is synced once). Consistency is checked before timing: `reindex()` counts N
   packages and gives the same listing. Timed: `Registry.listings()` in-process and
   `flare registry ls --json > /dev/null` as a process. Target: under 0.5 s each. Floors,
   for reference: the three SQL queries of a listing run directly through sqlite3, and
   `python -c "import flare.cli"`.
2. gc: a store of M blobs (default 100,000; distinct 64-byte blobs, written as files under
   their BLAKE3 names, each read-only like the store's own) and a few tagged packages
   holding a fraction L of them (one section per --gc-live fraction; default 0.9, a store
   that is collected regularly, then 0, everything garbage: the worst case). Timed:
   `collect(registry, grace_s=3600, dry_run=True)` (marks from the roots' marks files,
   lists every blob, stats every candidate for its age and size, keeps them all as recent)
   and with grace 0 (would sweep them all); the sweep runs in one process per core (at most
   8), and the first case is timed with one process too, for reference. Baseline:
   `find STORE/blobs -type f | wc -l` in a shell. Target: at most 2x. `find -printf '%s %T@'`
   (which stats every file, as gc must for every unreachable one) is shown for reference,
   with gc's ratio to it.
3. verify: one package built from a synthetic Llama checkpoint of about G GiB (default 1)
   with `flare build`. Timed: `Registry.verify("big")`. Baseline: `b3sum` over the same
   blob files (the index and every blob the manifest names). Target: at most 1.2x.

Every case runs once untimed (so that dentries, the page cache and the DB pages are warm),
then the cases of a section alternate, their order rotating, --repeat times; tables give
medians with min and max. Other work on the machine disturbs the figures, so the load
average is printed at the start and end. Nothing asserts on time: targets print PASS or
MISS, and for a MISS the script measures where the time goes (stages timed one by one, and
the functions cProfile finds the most time in).

    python tests/bench/bench_registry.py [--packages 10000] [--blobs 100000] [--verify-gib 1]
        [--repeat 5] [--workdir DIR]

The work happens in a fresh folder under --workdir (default /tmp), removed at the end.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tests' helpers

from blake3 import blake3
from checkpoints import make_synthetic_llama
from common import flare_command, flare_env, scratch, timed

from flare.registry import gc, refs
from flare.registry.marks import Marked
from flare.registry.registry import Registry, default_database
from flare.store.backends.local import MAX_SWEEP_PROCESSES
from flare.store.digest import Digest
from flare.store.encoding import Encoding
from flare.store.hashing import hash_bytes, hash_file
from flare.store.layout import BLOB_DIR, blob_key
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
    encode_index,
)
from flare.store.sweep import sweep_share, unmarked

GIB = 1 << 30
LS_TARGET_S = 0.5
GC_TARGET = 2.0
VERIFY_TARGET = 1.2
VERSIONS = 4
"""Packages per name, tagged v1..v4; the newest is also tagged `latest`."""
MODELS = 50
PIN_EVERY = 100
SHARED_PAYLOADS = 3
SHARED_PAYLOAD_BYTES = 4096
GC_PACKAGES = 5
GC_BLOBS_PER_PACKAGE = 20
BIG = "big"
PROFILE_LINES = 8


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


# -- 1. ls --------------------------------------------------------------------------------


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


def shared_blobs(root: Path) -> tuple[list[tuple[Digest, int]], list[Artifact]]:
    """The payloads and artifacts every package of the ls registry shares."""
    payloads = []
    for k in range(SHARED_PAYLOADS):
        data = f"shared payload {k} ".encode().ljust(SHARED_PAYLOAD_BYTES, b".")
        payloads.append((write_blob(root, data), len(data)))
    artifacts = []
    for kind, path in (("config", "config.json"), ("tokenizer", "tokenizer.json")):
        data = json.dumps({"file": path}).encode()
        artifacts.append(
            Artifact(kind=kind, path=path, digest=str(write_blob(root, data)), size=len(data))
        )
    return payloads, artifacts


def populate_packages(registry: Registry, count: int) -> None:
    """Publish `count` distinct packages through Registry.publish, indexes written directly."""
    root = Path(registry.location)
    payloads, artifacts = shared_blobs(root)
    started = time.perf_counter()
    with no_fsync():
        for index in range(count):
            name = package_name(index)
            data = f"payload of package {index} ".encode().ljust(64, b".")
            unique = (write_blob(root, data), len(data))
            manifest = make_manifest(index, [*payloads, unique], artifacts)
            digest = write_blob(root, encode_index(manifest))
            registry.publish(name, f"v{index % VERSIONS + 1}", digest, manifest)
            if index % VERSIONS == VERSIONS - 1 or index == count - 1:
                registry.publish(name, refs.DEFAULT_TAG, digest, manifest)
            if index % PIN_EVERY == 0:
                registry.pin(f"{name}@{digest.hex}")
            if (index + 1) % 2000 == 0:
                log(f"  published {index + 1} packages ({time.perf_counter() - started:.0f} s)")


def check_ls_registry(registry: Registry, count: int) -> list[str]:
    """Check the store and the DB agree (reindex gives the same listing); return notes."""
    before = registry.listings()
    log("verifying every blob of the ls registry")
    report = registry.store.verify()
    if not report.ok or report.stray:
        raise RuntimeError(f"the ls registry's store is not sound: {report}")
    log("reindexing the ls registry from its store")
    started = time.perf_counter()
    indexed = registry.reindex().packages
    reindex_s = time.perf_counter() - started
    after = registry.listings()
    if indexed != count or len(before) != count or before != after:
        raise RuntimeError(
            f"reindex gives {indexed} packages and {len(after)} listings, "
            f"published {count} ({len(before)} listed before; same: {before == after})"
        )
    rows = registry.db.read(
        lambda c: c.exec_driver_sql(
            "SELECT (SELECT count(*) FROM package_blobs), (SELECT count(*) FROM tags)"
        ).one()
    )
    return [
        f"{count} packages under {count // VERSIONS + (count % VERSIONS > 0)} names, "
        f"{rows[1]} tags, {sum(r.pinned for r in after)} pins, {rows[0]} package-blob rows, "
        f"{report.checked} blobs (all verified)",
        f"store and DB agree: reindex gives {indexed} packages and the same listing "
        f"(reindex took {reindex_s:.1f} s)",
    ]


def raw_listing(database: Path) -> Callable[[], object]:
    """The three queries of a listing, run directly through sqlite3 (a floor for the ORM)."""
    queries = (
        "SELECT b.package, sum(b.size) FROM package_blobs b JOIN (SELECT blob FROM package_blobs"
        " GROUP BY blob HAVING count(*) = 1) s ON s.blob = b.blob GROUP BY b.package",
        "SELECT name, tag, digest FROM tags",
        "SELECT * FROM publications p JOIN packages k ON k.digest = p.digest"
        " ORDER BY p.created DESC, p.name, p.digest",
    )
    connection = sqlite3.connect(database, check_same_thread=False)

    def run() -> int:
        return sum(len(connection.execute(q).fetchall()) for q in queries)

    return run


def bench_ls(workdir: Path, count: int, repeat: int) -> Section:
    """Populate a registry of `count` packages and time listing it, in-process and as `ls`."""
    section = Section(f"1. ls with {count} packages (target: under {LS_TARGET_S} s)")
    home, location = workdir / "ls-home", workdir / "ls-registry"
    registry = open_registry(location, home)
    log(f"publishing {count} packages into {location}")
    populate_packages(registry, count)
    section.notes += check_ls_registry(registry, count)
    env = flare_env(home, home / "config", registry=str(location))
    in_process = Timing("Registry.listings() in-process")
    command = Timing("flare registry ls --json > /dev/null")
    raw = Timing("floor: the listing's 3 SQL queries via sqlite3")
    startup = Timing('floor: python -c "import flare.cli"')
    log("timing ls")
    alternate(
        [
            (in_process, registry.listings),
            (command, process([*flare_command(), "registry", "ls", "--json"], env)),
            (raw, raw_listing(location / "index.db")),
            (startup, process([sys.executable, "-c", "import flare.cli"], env)),
        ],
        repeat,
    )
    section.timings = [in_process, command, raw, startup]
    section.targets = [
        Target("ls in-process", in_process, LS_TARGET_S),
        Target("flare registry ls --json", command, LS_TARGET_S),
    ]
    if section.missed():
        section.diagnosis = explain_ls(registry, env, startup)
    return section


def explain_ls(registry: Registry, env: dict[str, str], startup: Timing) -> list[str]:
    """Where a listing's time goes: the `ls --json` process step by step, what its imports
    cost, and a profile of listings()."""
    log("profiling ls")
    inside = [cli_steps(env) for _ in range(3)]
    steps = [statistics.median(run[k] for run in inside) for k in range(len(LS_STEPS) + 1)]
    lines = ["flare registry ls --json, step by step inside one process (median of 3):"]
    lines += stages(list(zip(("interpreter start-up and exit", *LS_STEPS), steps, strict=True)))
    bare = statistics.median(timed(process([sys.executable, "-c", "pass"], env)) for _ in range(3))
    lines.append(
        f'(as processes: python -c "pass" takes {bare:.3f} s, python -c "import flare.cli" '
        f"{startup.median:.3f} s)"
    )
    lines += import_costs(env)
    return [*lines, *profile_top(registry.listings)]


LS_STEPS = (
    "import flare.cli",
    "open_registry(): config, engine, migrate check",
    "Registry.listings()",
    "vars() of every Listing (as the CLI does)",
    "print_json() (json.dumps + rich Console.out)",
)
LS_SNIPPET = """
import json, os, sys, time
marks = [time.perf_counter()]
from flare import cli
from flare.cli_common import print_json
from flare.registry.commands import open_registry
marks.append(time.perf_counter())
registry = open_registry()
marks.append(time.perf_counter())
rows = registry.listings()
marks.append(time.perf_counter())
dicts = [vars(r) for r in rows]
marks.append(time.perf_counter())
print_json(dicts)
marks.append(time.perf_counter())
with open(sys.argv[1], "w") as report:
    json.dump([b - a for a, b in zip(marks, marks[1:])], report)
"""


def cli_steps(env: dict[str, str]) -> list[float]:
    """One `ls --json` done step by step in a fresh process: [start-up, *LS_STEPS] seconds."""
    with tempfile.NamedTemporaryFile(suffix=".json") as report:
        command = [sys.executable, "-c", LS_SNIPPET, report.name]
        wall = timed(process(command, env))
        inside = json.loads(Path(report.name).read_text())
    return [wall - sum(inside), *inside]


def import_costs(env: dict[str, str], limit: int = PROFILE_LINES) -> list[str]:
    """`python -X importtime -c "import flare.cli"`: own import time by package."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import flare.cli"],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    own: dict[str, int] = {}
    for line in done.stderr.splitlines():
        fields = line.removeprefix("import time:").split("|")
        if len(fields) != 3 or not fields[0].strip().isdigit():
            continue
        parts = fields[2].strip().split(".")
        package = ".".join(parts[:2]) if parts[0] == "flare" else parts[0]
        own[package] = own.get(package, 0) + int(fields[0])
    total = sum(own.values()) / 1e6
    ranked = sorted(own.items(), key=lambda item: item[1], reverse=True)[:limit]
    lines = [f"python -X importtime, own time by package ({total:.3f} s in all, as measured):"]
    lines += [f"  {package:<30} {us / 1e6:7.3f} s" for package, us in ranked]
    return lines


# -- 2. gc --------------------------------------------------------------------------------


def populate_blobs(registry: Registry, count: int, live: float) -> list[str]:
    """Write `count` distinct 64-byte blobs and publish a few tagged packages holding the
    `live` fraction of them (at least GC_BLOBS_PER_PACKAGE each)."""
    root = Path(registry.location)
    digests = [write_blob(root, n.to_bytes(8, "big") * 8) for n in range(count)]
    held: list[Digest] = []
    per_package = max(GC_BLOBS_PER_PACKAGE, int(count * live) // GC_PACKAGES)
    for k in range(GC_PACKAGES):
        chosen = digests[k * per_package : (k + 1) * per_package]
        held += chosen
        manifest = make_manifest(k * VERSIONS, [(d, 64) for d in chosen], [])
        index = write_blob(root, encode_index(manifest))
        registry.publish(f"gc-{k}", refs.DEFAULT_TAG, index, manifest)
    os.sync()
    sample = digests[:: max(1, count // 1000)]
    report = registry.store.verify(sample)
    if not report.ok or report.checked != len(sample):
        raise RuntimeError(f"the gc store's blobs are not sound: {report}")
    return [
        f"{count} blobs of 64 bytes plus {GC_PACKAGES} tagged packages holding "
        f"{len(set(held))} of them ({report.checked} blobs verified)"
    ]


def check_gc(registry: Registry, files: int) -> list[str]:
    """Run both collections once and check what they found; return notes."""
    keep = gc.collect(registry, grace_s=3600, dry_run=True)
    sweep = gc.collect(registry, grace_s=0, dry_run=True)
    candidates = files - keep.marked
    if keep.deleted or keep.kept_recent != candidates or len(sweep.deleted) != candidates:
        raise RuntimeError(f"unexpected gc reports: {keep} / {len(sweep.deleted)} deleted")
    return [
        f"find counts {files} blob files; gc marks {keep.marked} from {keep.roots} roots; "
        f"grace 3600 keeps {keep.kept_recent} as recent, grace 0 would delete "
        f"{len(sweep.deleted)}"
    ]


def count_files(blobs: Path) -> int:
    """What the baseline prints: the number of files under the store's blobs folder."""
    done = subprocess.run(
        f"find {blobs} -type f | wc -l", shell=True, check=True, capture_output=True, text=True
    )
    return int(done.stdout)


def bench_gc(workdir: Path, count: int, repeat: int, live: float) -> Section:
    """Time a dry-run collection over `count` blobs against listing them with find."""
    section = Section(
        f"2. gc over {count} blobs, {live:.1%} of them live "
        f"(target: within {GC_TARGET}x of find | wc -l)"
    )
    home, location = workdir / f"gc-{live:g}-home", workdir / f"gc-{live:g}-registry"
    registry = open_registry(location, home)
    log(f"writing {count} blobs into {location}")
    section.notes += populate_blobs(registry, count, live)
    blobs = location / BLOB_DIR
    section.notes += check_gc(registry, count_files(blobs))
    processes = registry.store.backend.sweep_processes
    keep = Timing(f"collect(grace_s=3600, dry_run=True), {processes} sweep processes")
    sweep = Timing(f"collect(grace_s=0, dry_run=True), {processes} sweep processes")
    single = Timing("ref: collect(grace_s=3600, dry_run=True), 1 sweep process")
    find = Timing("find STORE/blobs -type f | wc -l")
    find_stat = Timing("ref: find STORE/blobs -type f -printf '%s %T@\\n' | wc -l")
    log("timing gc")
    alternate(
        [
            (keep, lambda: gc.collect(registry, grace_s=3600, dry_run=True)),
            (sweep, lambda: gc.collect(registry, grace_s=0, dry_run=True)),
            (single, lambda: collect_in_one_process(registry)),
            (find, shell(f"find {blobs} -type f | wc -l")),
            (find_stat, shell(f"find {blobs} -type f -printf '%s %T@\\n' | wc -l")),
        ],
        repeat,
    )
    doomed = workdir / f"gc-{live:g}-doomed.txt"
    swept = gc.collect(registry, grace_s=0, dry_run=True).deleted
    doomed.write_text("".join(f"{blob_key(Digest.parse(d), Encoding.PLAIN)}\n" for d in swept))
    deleting = Timing("collect(grace_s=0), deleting: into the trash, then out of it")
    rm = Timing("ref: xargs rm of the same blob files")
    log("timing gc that deletes, on a fresh copy of the store each run")
    on_copies(
        location,
        repeat,
        [
            (deleting, lambda copy: partial(gc.collect, open_registry(copy, home), 0)),
            (rm, lambda copy: shell(f"cd {copy} && xargs -a {doomed} rm -f")),
        ],
    )
    section.timings = [keep, sweep, single, find, find_stat, deleting, rm]
    section.notes.append(
        f"gc that deletes {len(swept)} blobs / rm of those files: "
        f"{deleting.median / rm.median:.2f}x (each on a fresh copy of the store)"
    )
    section.notes.append(
        f"the sweep runs in {processes} processes (one per core, at most "
        f"{MAX_SWEEP_PROCESSES}); in one process it takes {single.median / find.median:.2f}x find"
    )
    section.notes.append(
        f"gc / find -printf (a stat per file): {keep.median / find_stat.median:.2f}x (grace "
        f"3600), {sweep.median / find_stat.median:.2f}x (grace 0)"
    )
    section.targets = [
        Target("gc, grace 3600 (keeps all)", keep, GC_TARGET, find),
        Target("gc, grace 0 (would sweep all)", sweep, GC_TARGET, find),
    ]
    if section.missed():
        section.diagnosis = explain_gc(registry, blobs, find.median)
    return section


def on_copies(
    store: Path, repeat: int, cases: list[tuple[Timing, Callable[[Path], Callable[[], object]]]]
) -> None:
    """Time actions that change a store, each run on a fresh copy of it (copied untimed): a
    case gives the action to time for the copy's folder."""
    copy = store.with_name(f"{store.name}-copy")
    for _ in range(repeat):
        for timing, prepare in cases:
            shutil.rmtree(copy, ignore_errors=True)
            subprocess.run(["cp", "-a", str(store), str(copy)], check=True)
            os.sync()  # the copy's writeback is not what is timed
            action = prepare(copy)
            timing.runs.append(timed(action))
    shutil.rmtree(copy, ignore_errors=True)


def collect_in_one_process(registry: Registry) -> object:
    """A dry-run collection with grace 3600 whose sweep runs in this process only."""
    with mock.patch.object(registry.store.backend, "sweep_processes", 1):
        return gc.collect(registry, grace_s=3600, dry_run=True)


def walk_names(top: Path) -> int:
    """Files under a folder by name only (what find -type f does: no stat)."""
    return sum(len(files) for _dir, _dirs, files in os.walk(top))


def walk_scandir_stat(top: Path) -> int:
    """Files under the two-level blob folder with one stat each, through os.scandir."""
    total = 0
    for shard in os.scandir(top):
        for entry in os.scandir(shard.path):
            total += entry.stat(follow_symlinks=False).st_size
    return total


def explain_gc(registry: Registry, blobs: Path, find_s: float) -> list[str]:
    """Where a collection's time goes: its stages one by one, then a profile of it."""
    log("profiling gc")
    store = registry.store
    found = gc.roots(registry)
    marked = Marked(gc.mark(registry, found, keep=False), found.blobs)
    keys = list(store.backend.iter_names(BLOB_DIR))
    candidates = [c for share in unmarked(store, marked.in_folder) for c in share.unmarked]
    folders = store.backend.list_dir(BLOB_DIR)
    parts = time_stages(
        [
            ("roots(): refs, tags, pins, leases", lambda: gc.roots(registry)),
            ("mark(): the roots' marks files", lambda: gc.mark(registry, found, False)),
            ("list names under blobs/ (no stat)", lambda: list(store.backend.iter_names(BLOB_DIR))),
            (
                "sweep: list, drop marked names, stat and parse the rest, all processes",
                lambda: list(unmarked(store, marked.in_folder)),
            ),
            (
                "the same, one process",
                lambda: sweep_share(store, folders, marked.in_folder),
            ),
            (
                "one stat per candidate, by path, one thread (for reference)",
                lambda: [store.backend.stat(key) for _, key, _, _ in candidates],
            ),
        ]
    )
    scandir_s = min(timed(lambda: walk_scandir_stat(blobs)) for _ in range(3))
    lines = [
        f"gc stages, each timed alone (min of 3), {len(keys)} blobs, {len(candidates)} candidates:"
    ]
    lines += stages(parts)
    lines += [
        f"(find -type f: {find_s:.3f} s; os.scandir + DirEntry.stat, one stat per file: "
        f"{scandir_s:.3f} s)",
        *profile_top(lambda: gc.collect(registry, grace_s=3600, dry_run=True)),
    ]
    return lines


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


# -- report and main ----------------------------------------------------------------------


def print_section(section: Section) -> None:
    """A section's notes, its timings table, its verdicts and any diagnosis."""
    print(f"\n{section.title}")
    for note in section.notes:
        print(f"  {note}")
    print(f"  {'case':<58} {'median (min-max) s':>22}")
    for timing in section.timings:
        print(f"  {timing.label:<58} {timing.summary():>22}")
    for target in section.targets:
        print(f"  {target.describe()}")
    if section.diagnosis:
        print("  where the time goes:")
        for line in section.diagnosis:
            print(f"    {line}")


def print_report(sections: list[Section], started_load: str, code: str, repeat: int) -> None:
    """Every section, then one verdict line per target."""
    print(
        f"flare registry benchmark: {platform.node()}, {platform.platform()}, "
        f"Python {platform.python_version()}, {os.cpu_count()} cores, {repeat} timed runs"
    )
    print(f"code: {code}")
    print(f"load average (1/5/15 min): {started_load} at start, {load()} at end")
    for section in sections:
        print_section(section)
    print("\nverdicts:")
    for section in sections:
        for target in section.targets:
            print(f"  {target.describe()}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """--packages, --blobs, --verify-gib, --repeat, --workdir."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--packages", type=int, default=10_000, help="packages for ls")
    parser.add_argument("--blobs", type=int, default=100_000, help="blobs for gc")
    parser.add_argument(
        "--gc-live",
        type=float,
        nargs="+",
        default=[0.9, 0.0],
        help="fractions of the gc store's blobs that packages hold, a section each "
        "(default: 0.9, a store collected regularly, and 0, all garbage: the worst case)",
    )
    parser.add_argument("--verify-gib", type=float, default=1.0, help="package size for verify")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs of each case")
    parser.add_argument("--workdir", type=Path, help="folder to work in (default: under /tmp)")
    args = parser.parse_args(argv)
    if min(args.packages, args.repeat) < 1 or args.blobs < GC_PACKAGES * GC_BLOBS_PER_PACKAGE:
        parser.error("--packages and --repeat must be positive, --blobs at least 100")
    if args.verify_gib * GIB < 16 << 20:
        parser.error("--verify-gib must be at least 1/64 (16 MiB)")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the three sections in a fresh folder under --workdir (or /tmp), removed at the end."""
    args = parse_args(argv)
    started_load, code = load(), git_state()
    with scratch(args.workdir, "flare-bench-registry-") as workdir:
        log(f"working in {workdir}; load average {started_load}")
        sections = [
            bench_ls(workdir, args.packages, args.repeat),
            *(bench_gc(workdir, args.blobs, args.repeat, live) for live in args.gc_live),
            bench_verify(workdir, int(args.verify_gib * GIB), args.repeat),
        ]
    print_report(sections, started_load, code, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
