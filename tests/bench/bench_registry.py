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
import json
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tests' helpers

from common import flare_command, flare_env, scratch, timed
from registry_gc import GC_BLOBS_PER_PACKAGE, GC_PACKAGES, bench_gc
from registry_measure import (
    GIB,
    PROFILE_LINES,
    VERSIONS,
    Section,
    Target,
    Timing,
    alternate,
    git_state,
    load,
    log,
    make_manifest,
    no_fsync,
    open_registry,
    package_name,
    process,
    profile_top,
    stages,
    write_blob,
)
from registry_verify import bench_verify

from flare.registry import refs
from flare.registry.registry import Registry
from flare.store.digest import Digest
from flare.store.package import (
    Artifact,
    encode_index,
)

LS_TARGET_S = 0.5
PIN_EVERY = 100
SHARED_PAYLOADS = 3
SHARED_PAYLOAD_BYTES = 4096


# -- 1. ls --------------------------------------------------------------------------------


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
