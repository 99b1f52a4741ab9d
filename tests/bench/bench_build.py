"""Benchmark of `flare build` against copying the checkpoint durably, with rebuild and resume.

Everything is measured in one run on one synthetic Llama-shaped checkpoint (random bf16
bytes, read once before timing so that it sits in the page cache):

1. floor: `cp -r CKPT DEST && sync`, against a cold build, `flare build CKPT --name bench
   --json` in a subprocess with a fresh FLARE_HOME (empty staging and registry). Target: the
   cold build takes at most 1.5x the floor.
2. rebuild: the same command again on the same FLARE_HOME, every phase reused. Target: at
   most 5% of the cold build. Both the process's wall time (Python start-up included) and
   the sum of the phase seconds the build reports are given, each with its verdict.
3. resume: a build on a fresh FLARE_HOME killed (SIGKILL, `FLARE_CRASH_AT=assemble:payload:K`)
   at half of its payloads, then the rerun that completes it, timed. Target: at most 60% of
   the cold build, and the same package digest as the cold build.

Disk writes are noisy, so one untimed floor and cold build come first, then the floor and
the cold build alternate (which goes first alternates too), each followed by its rebuild and
a killed-and-resumed build; before every timed run the previous destination is deleted and
everything synced. Before each floor, cold build and killed build, an untimed `cp -r`, `sync`,
`rm`, `sync` of the checkpoint puts the disk in one state: on a filesystem mounted with
`discard` (a VM's thin disk), writing 2 GiB where blocks were freed seconds ago took 1.2 s and
where they were freed 10 s before took 2.9 s, which otherwise decides the ratios by chance.
Tables give medians with min and max. Nothing here asserts on time: targets are printed as
PASS or MISS.

    python tests/bench/bench_build.py [--size-gib 2] [--repeat 3] [--workdir DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tests' helpers

from checkpoints import make_synthetic_llama
from common import flare_command, flare_env, log, remove, run, scratch, sync, timed

from flare.registry.refs import read_manifest, resolve_package
from flare.store.blobs import BlobStore

MIB = 1 << 20
GIB = 1 << 30
CHUNK = 64 * MIB
PACKAGE = "bench"
COLD_TARGET = 1.5
"""The most a cold build may take, as a multiple of the floor's median time."""
REBUILD_TARGET = 0.05
"""The most a rebuild with every phase recorded may take, as a fraction of a cold build."""
RESUME_TARGET = 0.60
"""The most the rerun after a kill at half way may take, as a fraction of a cold build."""


@dataclass
class BuildRun:
    """One `flare build --json` process: its wall time and what it reported."""

    wall_s: float
    returncode: int
    digest: str | None = None
    phases: list[dict[str, Any]] = field(default_factory=list)

    def phase_s(self) -> float:
        """The sum of the phase seconds the build reported."""
        return sum(p["seconds"] for p in self.phases)

    def statuses(self) -> str:
        """Each phase's status, e.g. 'resolve=reused assemble=resumed'."""
        return " ".join(f"{p['name']}={p['status']}" for p in self.phases)

    def status(self, name: str) -> str | None:
        """The status of one phase, or None if the build did not report it."""
        return next((p["status"] for p in self.phases if p["name"] == name), None)


@dataclass
class Results:
    """Everything one run measured."""

    environment: dict[str, str]
    checkpoint_bytes: int = 0
    payloads: int = 0
    crash_at: int = 0
    reference_digest: str = ""
    floor_s: list[float] = field(default_factory=list)
    cold: list[BuildRun] = field(default_factory=list)
    cold_sync_s: list[float] = field(default_factory=list)
    """`sync` right after each cold build (not counted in its time): what it left unwritten."""
    rebuild: list[BuildRun] = field(default_factory=list)
    killed: list[BuildRun] = field(default_factory=list)
    blobs_after_kill: list[int] = field(default_factory=list)
    resume: list[BuildRun] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class Target:
    """One target: a measured ratio and the most it may be."""

    name: str
    ratio: float
    limit: float

    def verdict(self) -> str:
        """PASS when the ratio is within the limit, else MISS."""
        return "PASS" if self.ratio <= self.limit else "MISS"


# -- small helpers ------------------------------------------------------------------------


def reset(*paths: Path) -> None:
    """Delete earlier destinations and sync, so that no run pays for another's writes."""
    for path in paths:
        remove(path)
    sync()


def precondition(checkpoint: Path, scratch: Path) -> None:
    """Write the checkpoint's bytes once and free them again, untimed, so that every timed
    run writes into the disk in the same state (see the module's docstring)."""
    reset(scratch)
    run("cp", "-r", checkpoint, scratch)
    reset(scratch)


def warm(folder: Path) -> None:
    """Read every file once so that the timed runs find them in the page cache."""
    buffer = bytearray(CHUNK)
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with open(path, "rb", buffering=0) as src:
                while src.readinto(buffer):
                    pass


def folder_bytes(folder: Path) -> int:
    """Total size of the files under a folder."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def stats(values: list[float]) -> dict[str, float]:
    """Median, min and max."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt_s(values: list[float]) -> str:
    """'median (min-max)' in seconds."""
    s = stats(values)
    return f"{s['median']:6.3f} ({s['min']:.3f}-{s['max']:.3f})"


# -- running flare ------------------------------------------------------------------------


def flare_build(
    checkpoint: Path, home: Path, config_home: Path, crash_at: str | None = None
) -> BuildRun:
    """Time `flare build CKPT --name bench --json` as a process; parse its JSON if it ends well.

    With a crash point the process is expected to die of SIGKILL; anything else fails.
    """
    command = [*flare_command(), "build", str(checkpoint), "--name", PACKAGE, "--json"]
    env = flare_env(home, config_home, crash_at=crash_at)
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if crash_at is not None:
        if done.returncode != -signal.SIGKILL:
            raise RuntimeError(
                f"the build with FLARE_CRASH_AT={crash_at} exited {done.returncode}, "
                f"not killed: {done.stderr.strip()}"
            )
        return BuildRun(wall, done.returncode)
    if done.returncode != 0:
        raise RuntimeError(f"flare build failed ({done.returncode}): {done.stderr.strip()}")
    report = json.loads(done.stdout)
    return BuildRun(wall, done.returncode, report["digest"], report["phases"])


def package_payloads(home: Path) -> tuple[int, str]:
    """The number of payloads of the package `bench` in FLARE_HOME's registry, and its digest."""
    store = BlobStore(home / "registry")
    _name, digest = resolve_package(store, PACKAGE)
    return len(read_manifest(store, digest).payloads), str(digest)


def stored_blobs(home: Path) -> int:
    """How many blobs FLARE_HOME's registry holds."""
    return sum(1 for _ in BlobStore(home / "registry").iter_blobs())


# -- the runs -----------------------------------------------------------------------------


def make_checkpoint(checkpoint: Path, size: int) -> int:
    """Write the synthetic checkpoint, sync it, read it into the page cache; return its bytes."""
    log(f"writing a synthetic Llama checkpoint of about {size / GIB:.2f} GiB to {checkpoint}")
    make_synthetic_llama(checkpoint, size)
    sync()
    warm(checkpoint)
    return folder_bytes(checkpoint)


def floor_run(checkpoint: Path, dest: Path) -> float:
    """`cp -r CKPT DEST && sync` into a new DEST; DEST is deleted again (and synced) after."""
    reset(dest)
    precondition(checkpoint, dest)
    seconds = timed(lambda: (run("cp", "-r", checkpoint, dest), sync()))
    reset(dest)
    return seconds


def cold_run(results: Results, checkpoint: Path, home: Path, config_home: Path) -> BuildRun:
    """A build on a fresh FLARE_HOME; the home is left in place for the rebuild."""
    reset(home)
    precondition(checkpoint, home)
    build = flare_build(checkpoint, home, config_home)
    results.cold_sync_s.append(timed(sync))
    if build.digest != results.reference_digest:
        raise RuntimeError(f"cold build made {build.digest}, not {results.reference_digest}")
    return build


def rebuild_run(checkpoint: Path, home: Path, config_home: Path) -> BuildRun:
    """The same build again on the same FLARE_HOME: every phase should be reused."""
    sync()
    return flare_build(checkpoint, home, config_home)


def resume_run(results: Results, checkpoint: Path, home: Path, config_home: Path) -> BuildRun:
    """Kill a build on a fresh FLARE_HOME at half its payloads, then time the completing rerun."""
    reset(home)
    precondition(checkpoint, home)
    crash_at = f"assemble:payload:{results.crash_at}"
    results.killed.append(flare_build(checkpoint, home, config_home, crash_at))
    results.blobs_after_kill.append(stored_blobs(home))
    sync()
    build = flare_build(checkpoint, home, config_home)
    if build.digest != results.reference_digest:
        raise RuntimeError(f"resumed build made {build.digest}, not {results.reference_digest}")
    reset(home)
    return build


def benchmark(workdir: Path, size: int, repeat: int) -> Results:
    """Make the checkpoint in `workdir`, then run the floor, cold, rebuild and resume runs."""
    results = Results(environment(workdir))
    load = os.getloadavg()[0]
    if load > 0.5:
        results.notes.append(f"load average {load:.2f} at start: other work may skew figures")
    checkpoint, dest = workdir / "ckpt", workdir / "cp-dest"
    cold_home, resume_home = workdir / "home-cold", workdir / "home-resume"
    config_home = workdir / "xdg-config"
    config_home.mkdir()
    results.checkpoint_bytes = make_checkpoint(checkpoint, size)

    log("untimed first runs: floor, cold build (payload count and reference digest)")
    floor_run(checkpoint, dest)
    reset(cold_home)
    flare_build(checkpoint, cold_home, config_home)
    results.payloads, results.reference_digest = package_payloads(cold_home)
    results.crash_at = max(1, results.payloads // 2)
    reset(cold_home)

    for index in range(repeat):
        order: list[Callable[[], None]] = [
            lambda: results.floor_s.append(floor_run(checkpoint, dest)),
            lambda: results.cold.append(cold_run(results, checkpoint, cold_home, config_home)),
        ]
        if index % 2:
            order.reverse()
        for action in order:
            action()
        results.rebuild.append(rebuild_run(checkpoint, cold_home, config_home))
        reset(cold_home)
        results.resume.append(resume_run(results, checkpoint, resume_home, config_home))
        log(
            f"  round {index + 1}/{repeat}: floor {results.floor_s[-1]:.3f} s, "
            f"cold {results.cold[-1].wall_s:.3f} s, rebuild {results.rebuild[-1].wall_s:.3f} s, "
            f"resume {results.resume[-1].wall_s:.3f} s"
        )
    check_statuses(results)
    return results


def check_statuses(results: Results) -> None:
    """Note any rebuild phase that was not reused and any resume whose assemble did not resume."""
    for index, build in enumerate(results.rebuild):
        if any(p["status"] != "reused" for p in build.phases):
            results.notes.append(f"rebuild #{index + 1} redid work: {build.statuses()}")
    for index, build in enumerate(results.resume):
        if build.status("assemble") != "resumed":
            results.notes.append(f"resume #{index + 1}: assemble was {build.status('assemble')}")


# -- report -------------------------------------------------------------------------------


def environment(workdir: Path) -> dict[str, str]:
    """What the figures depend on: cores, kernel, filesystem, the flare command."""
    return {
        "cores": str(len(os.sched_getaffinity(0))),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "workdir": str(workdir),
        "workdir_fs": run("findmnt", "-n", "-o", "FSTYPE", "-T", workdir).strip(),
        "workdir_mount": run("findmnt", "-n", "-o", "OPTIONS", "-T", workdir).strip(),
        "cp": run("cp", "--version").splitlines()[0],
        "flare": " ".join(flare_command()),
        "data": "synthetic Llama checkpoint, random bf16 bytes, in page cache",
        "load_at_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def median_run(runs: list[BuildRun]) -> BuildRun:
    """The run with the median wall time (the lower middle one for an even count)."""
    ordered = sorted(runs, key=lambda r: r.wall_s)
    return ordered[(len(ordered) - 1) // 2]


def targets(results: Results) -> list[Target]:
    """The four verdicts: cold vs floor, rebuild (wall and phases), resume, all from medians."""
    cold = statistics.median(r.wall_s for r in results.cold)
    floor = statistics.median(results.floor_s)
    return [
        Target("cold build / floor (cp -r + sync)", cold / floor, COLD_TARGET),
        Target(
            "rebuild / cold, process wall",
            statistics.median(r.wall_s for r in results.rebuild) / cold,
            REBUILD_TARGET,
        ),
        Target(
            "rebuild / cold, sum of phase seconds",
            statistics.median(r.phase_s() for r in results.rebuild) / cold,
            REBUILD_TARGET,
        ),
        Target(
            "resume after kill / cold, process wall",
            statistics.median(r.wall_s for r in results.resume) / cold,
            RESUME_TARGET,
        ),
    ]


def print_phases(build: BuildRun) -> None:
    """One build's per-phase table, then its phase total against its process wall time."""
    print(f"{'phase':<10} {'status':<8} {'seconds':>8} {'bytes':>14} {'GB/s':>6}")
    for p in build.phases:
        moved = p["bytes"] and p["seconds"] and p["status"] == "done"
        rate = f"{p['bytes'] / p['seconds'] / 1e9:6.2f}" if moved else ""
        print(f"{p['name']:<10} {p['status']:<8} {p['seconds']:8.3f} {p['bytes']:>14,} {rate:>6}")
    outside = build.wall_s - build.phase_s()
    print(f"{'phases':<10} {'':<8} {build.phase_s():8.3f}")
    print(f"{'process':<10} {'':<8} {build.wall_s:8.3f}  (outside phases: {outside:.3f} s)")


def print_tables(results: Results) -> None:
    """The timings, one cold build's phases, the digests, the notes and the verdicts."""
    print("environment: " + ", ".join(f"{k}={v}" for k, v in results.environment.items()))
    nbytes = results.checkpoint_bytes
    print(
        f"checkpoint: {nbytes:,} bytes ({nbytes / GIB:.2f} GiB), {results.payloads} payloads "
        f"at the default 256M, kill at FLARE_CRASH_AT=assemble:payload:{results.crash_at}"
    )
    cold = statistics.median(r.wall_s for r in results.cold)
    rows: list[tuple[str, list[float], bool]] = [
        ("floor: cp -r + sync", results.floor_s, True),
        ("cold build, process wall", [r.wall_s for r in results.cold], True),
        ("cold build, phase seconds", [r.phase_s() for r in results.cold], True),
        ("  sync after cold (not counted)", results.cold_sync_s, False),
        ("rebuild, process wall", [r.wall_s for r in results.rebuild], False),
        ("rebuild, phase seconds", [r.phase_s() for r in results.rebuild], False),
        ("killed build (not counted)", [r.wall_s for r in results.killed], False),
        ("resume, process wall", [r.wall_s for r in results.resume], False),
        ("resume, phase seconds", [r.phase_s() for r in results.resume], False),
    ]
    print(f"\n== times, {len(results.floor_s)} runs each ==")
    print(f"{'run':<32} {'seconds med (min-max)':<24} {'GB/s med':>8} {'/ cold med':>10}")
    for label, values, whole in rows:
        rate = f"{nbytes / statistics.median(values) / 1e9:8.2f}" if whole else ""
        share = statistics.median(values) / cold
        print(f"{label:<32} {fmt_s(values):<24} {rate:>8} {share:10.3f}")
    paired = statistics.median(
        c.wall_s / f for c, f in zip(results.cold, results.floor_s, strict=True)
    )
    print(f"cold / floor, median of the ratios of the same round: {paired:.3f}")

    print("\n== phases of the median cold build ==")
    print_phases(median_run(results.cold))
    print("\n== phases of the median rebuild ==")
    print_phases(median_run(results.rebuild))
    print("\n== phases of the median resume ==")
    print_phases(median_run(results.resume))
    print(
        "blobs in the store when the build was killed: "
        + ", ".join(str(n) for n in results.blobs_after_kill)
        + f" (of {results.payloads} payloads)"
    )

    print("\n== digests ==")
    print(f"cold:    {', '.join(sorted({r.digest or '' for r in results.cold}))}")
    print(f"resumed: {', '.join(sorted({r.digest or '' for r in results.resume}))}")
    same = all(r.digest == results.reference_digest for r in results.cold + results.resume)
    print(f"resumed digest equals cold digest: {'yes' if same else 'NO'}")

    if results.notes:
        print("\nnotes:")
        for note in results.notes:
            print(f"  {note}")
    print("\ntargets:")
    for target in targets(results):
        print(f"  {target.verdict():<4} {target.name}: {target.ratio:.3f} <= {target.limit:.2f}")


def print_json(results: Results) -> None:
    """The whole report as one JSON document on stdout."""
    document = {
        **asdict(results),
        "targets": [{**asdict(t), "verdict": t.verdict()} for t in targets(results)],
    }
    print(json.dumps(document, indent=2))


# -- main ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """--size-gib, --repeat, --workdir, --json."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=2.0, help="checkpoint size (GiB)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs of each case")
    parser.add_argument("--workdir", type=Path, help="folder to work in (default: under /tmp)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.size_gib * GIB < 64 * MIB:
        parser.error("--repeat must be positive and --size-gib at least 1/16 (64 MiB)")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark in a fresh folder under --workdir (or /tmp), removed at the end."""
    args = parse_args(argv)
    with scratch(args.workdir, "flare-bench-build-") as workdir:
        results = benchmark(workdir, int(args.size_gib * GIB), args.repeat)
    if args.json:
        print_json(results)
    else:
        print_tables(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
