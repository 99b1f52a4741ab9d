"""Soak: break flare on purpose at seeded random points, trial after trial; check the invariants
after every trial; print what was injected, caught and lost.

Trials (tests/faults/trials.py, shared with the CI subset in tests/faults/test_faults.py):
SIGKILL of build, of its publish phase, pull, `registry copy --to`, `registry gc --grace 0` and
`registry reindex` at random moments and at the crash points FLARE_CRASH_AT offers (and a few
more, chosen with tests/faults/killshim.py); corrupted blobs (a flipped byte, a truncation) and
ref files; full disks (a small tmpfs under the registry, the staging area, the host cache or a
copy's destination, or one filled while the command runs); four hosts building, tagging,
pulling, removing and collecting at once on one registry folder (index on SQLite, and on
PostgreSQL when a server is given); hostile requests to a server; hostile checkpoints. After
each: the next command works or fails with its documented error (never an internal error),
`registry verify` passes or names exactly what was broken on purpose, nothing references a
missing blob, a resumed build gives the digest of an uninterrupted one (built once at the
start), and no package a tag or pin protected is lost.

    python tests/bench/soak.py [--trials N] [--minutes N] [--jobs J] [--seed S]
        [--postgres URL] [--kinds K,...]
    python tests/bench/soak.py --repro KIND[/MODE]:SEED [--repro ...]

A run is 200 trials unless --trials or --minutes says otherwise (both: whichever comes first).

Needs root for the tmpfs mounts (disk-full trials are skipped otherwise). Prints one line per
trial on stderr, then a table per trial kind and mode (trials, faults injected, caught, failed,
violations, packages lost), then every violation with the issue-13 item it belongs to, the
command that showed it and how to run that trial again. Exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the `faults` package

from faults.lab import Lab, can_mount
from faults.trial import Outcome, Violation
from faults.trials import KINDS, run_trial

ROUND = 40
"""Trials per round of the schedule: each kind gets its weight's share of a round, shuffled."""
DEFAULT_TRIALS = 200


def schedule(rng: random.Random, kinds: list[str]) -> list[str]:
    """One round of trial kinds, in proportion to their weights, in seeded random order."""
    total = sum(KINDS[k].weight for k in kinds)
    round_ = [k for k in kinds for _ in range(max(1, round(ROUND * KINDS[k].weight / total)))]
    rng.shuffle(round_)
    return round_


def soak(
    lab: Lab, trials: float, minutes: float, seed: int, kinds: list[str], jobs: int
) -> list[Outcome]:
    """Trials until `trials` are done or `minutes` are up, `jobs` at once; trial i has the
    seed seed * 1,000,000 + i and its kind from the seeded schedule, whatever the timing."""
    rng = random.Random(seed)
    deadline = time.monotonic() + minutes * 60
    planned: list[str] = []
    outcomes: list[Outcome] = []
    started = 0
    lock = threading.Lock()

    def next_trial() -> tuple[str, int] | None:
        nonlocal started
        with lock:
            if started >= trials or time.monotonic() >= deadline:
                return None
            if started == len(planned):
                planned.extend(schedule(rng, kinds))
            started += 1
            return planned[started - 1], started - 1

    def worker() -> None:
        while (job := next_trial()) is not None:
            kind, number = job
            outcome = trial(lab, kind, seed * 1_000_000 + number, number)
            with lock:
                outcomes.append(outcome)

    threads = [threading.Thread(target=worker) for _ in range(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sorted(outcomes, key=lambda o: o.seed)


def trial(lab: Lab, kind: str, seed: int, number: int) -> Outcome:
    """Run one trial (KIND or KIND/MODE) and print a line about it."""
    outcome = run_trial(lab, kind, seed)
    items = sorted({"new" if v.item is None else str(v.item) for v in outcome.violations})
    found = f", {len(outcome.violations)} violations (items {', '.join(items)})" * bool(items)
    print(
        f"[{number:4}] {outcome.kind:30} seed {seed}: {outcome.faults} faults, "
        f"{outcome.caught} caught{found}, {outcome.seconds:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    return outcome


def summary(outcomes: list[Outcome], seconds: float) -> str:
    """The table per kind and mode, the totals, then every violation."""
    rows: dict[str, list[int]] = defaultdict(lambda: [0] * 6)
    items: dict[str, set[str]] = defaultdict(set)
    for o in outcomes:
        row = rows[o.kind]
        failed = bool(o.violations)
        for i, value in enumerate((1, o.faults, o.caught, failed, len(o.violations), o.lost)):
            row[i] += value
        items[o.kind] |= {"new" if v.item is None else str(v.item) for v in o.violations}
    header = ("kind/mode", "trials", "faults", "caught", "failed", "violations", "lost", "items")
    table = [header]
    for kind in sorted(rows):
        table.append((kind, *map(str, rows[kind]), ",".join(sorted(items[kind]))))
    totals = [sum(r[i] for r in rows.values()) for i in range(6)]
    table.append(("total", *map(str, totals), ""))
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"\n{len(outcomes)} trials in {seconds / 60:.1f} min")
    violations = [v for o in outcomes for v in o.violations]
    by_item: dict[str, int] = defaultdict(int)
    for v in violations:
        by_item["new" if v.item is None else f"item {v.item}"] += 1
    if violations:
        lines.append("violations by item: " + ", ".join(f"{k}: {n}" for k, n in by_item.items()))
    for o in outcomes:
        if o.violations:
            lines.extend(["", f"{o.kind} seed {o.seed}: {'; '.join(o.notes)}".rstrip(": ")])
            lines.append(f"    again: {o.violations[0].reproduce()}")
            lines.extend(_violation(v) for v in dict.fromkeys(o.violations))
    return "\n".join(lines)


def _violation(v: Violation) -> str:
    item = "new (no item)" if v.item is None else f"item {v.item}"
    command = f"\n        command: {v.command}" if v.command else ""
    return f"  [{item}] {v.what}{command}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, help="stop starting trials after this")
    parser.add_argument(
        "--trials", type=int, help="stop after this many (default 200 unless --minutes)"
    )
    parser.add_argument("--jobs", type=int, default=1, help="trials at once (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--postgres", default=os.environ.get("FLARE_TEST_POSTGRES"))
    parser.add_argument("--kinds", help="comma-separated trial kinds (default: all)")
    parser.add_argument("--repro", action="append", default=[], help="KIND[/MODE]:SEED, run alone")
    parser.add_argument("--workdir", default=tempfile.gettempdir())
    args = parser.parse_args()
    kinds = args.kinds.split(",") if args.kinds else list(KINDS)
    if not can_mount():
        print("not root: the disk-full trials are skipped", file=sys.stderr)
        kinds = [k for k in kinds if not KINDS[k].needs_mount]
    root = Path(tempfile.mkdtemp(prefix="flare-soak-", dir=args.workdir))
    started = time.monotonic()
    try:
        print(f"preparing the lab in {root}", file=sys.stderr, flush=True)
        lab = Lab(root, args.postgres).prepare()
        if args.repro:
            outcomes = [
                trial(lab, kind, int(seed), n)
                for n, (kind, seed) in enumerate(r.rsplit(":", 1) for r in args.repro)
            ]
        else:
            trials = args.trials or (float("inf") if args.minutes else DEFAULT_TRIALS)
            minutes = args.minutes or float("inf")
            outcomes = soak(lab, trials, minutes, args.seed, kinds, args.jobs)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(summary(outcomes, time.monotonic() - started))
    sys.exit(1 if any(o.violations for o in outcomes) else 0)


if __name__ == "__main__":
    main()
