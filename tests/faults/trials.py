"""Trials: each breaks flare one way at a seeded random point, then checks the invariants.

A trial is a function of a `Trial` (its seed's random numbers, its folder, what it found) and a
mode; `KINDS` names them with the issue-13 item each mode's violations belong to (None: a
promise no item of the issue is about, so a violation there is a new bug). A trial counts the
faults it injects, the faults flare caught (survived with every invariant intact, or refused
with its documented error), the protected packages lost, and every violation with the command
that showed it. `run_trial(lab, kind, seed)` runs one again exactly.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from faults.damage import PARTS, SMALL, corrupt_blob, corrupt_ref, disk_full
from faults.hosts import hosts
from faults.inputs import (
    MALFORMED,
    build_layers,
    build_link,
    build_moved,
    serve_cache,
    serve_malformed,
    serve_requests,
)
from faults.kills import (
    crash_build,
    kill_build,
    kill_copy,
    kill_gc,
    kill_publish,
    kill_pull,
    kill_reindex,
)
from faults.lab import (
    Lab,
)
from faults.trial import Outcome, Trial


@dataclass(frozen=True)
class Kind:
    """A kind of trial: its function, its modes (each with the item of issue 13 it belongs to,
    None for the promises no item is about) and its share of a soak run."""

    run: Callable[[Trial, str], None]
    modes: dict[str, int | None]
    weight: float
    needs_mount: bool = False


KINDS: dict[str, Kind] = {
    "kill-build": Kind(kill_build, {"random": None}, 3),
    "crash-build": Kind(crash_build, {"point": None}, 2),
    "kill-publish": Kind(kill_publish, {"random": None}, 2),
    "kill-pull": Kind(kill_pull, {"random": None}, 2),
    "kill-copy": Kind(kill_copy, {"random": None, "db": 7}, 2),
    "kill-gc": Kind(kill_gc, {"random": 8, "forget": 8, "sweep": 8}, 3),
    "kill-reindex": Kind(kill_reindex, {"random": None, "db": 7}, 1.5),
    "corrupt-blob": Kind(
        corrupt_blob,
        {f"{how}-{part}": None for how in ("flip", "truncate") for part in PARTS},
        2,
    ),
    "corrupt-ref": Kind(
        corrupt_ref,
        dict.fromkeys(
            ["garbage-tag", "payload-tag", "bad-name", "empty-tag", "garbage-record", "bad-pin"],
            9,
        ),
        2,
    ),
    "disk-full": Kind(
        disk_full,
        {f"{target}-{style}": None for target in SMALL for style in ("small", "filled")},
        2,
        needs_mount=True,
    ),
    "hosts": Kind(hosts, {"sqlite": None, "postgresql": None}, 1),
    "serve-requests": Kind(serve_requests, {"hostile": 1}, 0.2),
    "serve-cache": Kind(serve_cache, {"flip": 4}, 0.3),
    "serve-malformed": Kind(serve_malformed, dict.fromkeys(MALFORMED, 5), 0.4),
    "build-link": Kind(build_link, {"out": 10, "hub": 10}, 0.5),
    "build-layers": Kind(build_layers, {"huge": 11}, 0.4),
    "build-moved": Kind(build_moved, {"moved": 12}, 0.4),
}


def run_trial(lab: Lab, kind: str, seed: int) -> Outcome:
    """Run one trial of KIND (its mode drawn from its seed) or KIND/MODE; never raises: a
    failure of the harness itself is reported as a violation too."""
    kind, _, mode = kind.partition("/")
    spec = KINDS[kind]
    trial = Trial(lab, kind, seed)
    modes = sorted(m for m in spec.modes if m != "postgresql" or lab.postgres)
    drawn = trial.rng.choice(modes)  # drawn even when given: the seed's later draws stay
    mode = mode or drawn
    trial.item = spec.modes[mode]
    trial.outcome.kind = f"{kind}/{mode}"
    trial.kind = trial.outcome.kind
    started = time.monotonic()
    try:
        spec.run(trial, mode)
    except Exception:
        trial.violate(f"harness error: {traceback.format_exc(limit=-3)}", item=None)
    finally:
        trial.close()
    trial.outcome.seconds = time.monotonic() - started
    return trial.outcome
