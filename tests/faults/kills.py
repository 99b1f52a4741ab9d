"""Trials that kill or crash a command at a random point: build, publish, pull, copy, gc and
reindex, each then resumed or repeated to a clean state."""

from __future__ import annotations

import threading
import time

from faults import checks
from faults.lab import (
    COMMAND_TIMEOUT_S,
    LIVE,
    PULLABLE,
    kill_group,
)
from faults.trial import (
    Trial,
    listing_complete,
    nothing_lost,
    refs_sound,
    resume_to_clean,
    settle,
    verify_exact,
)


def kill_build(t: Trial, mode: str) -> None:
    """SIGKILL a build at random moments (1-3 times), on an empty or a used registry; then it
    resumes to the clean digest and the registry is sound."""
    config = t.rng.choice(["r1", "r2"])
    home = t.home(base=t.rng.random() < 0.5)
    before = checks.protected(home.registry)
    args = t.lab.build_args("tiny", "ck", config, "k")
    kills = t.rng.randint(1, 3)
    for _ in range(kills):
        t.fault()
        home.kill_after(t.rng.uniform(0.05, t.lab.seconds["build"] * 1.2), *args)
    resume_to_clean(t, home, args, t.lab.digest("tiny", "ck", config), kills)
    settle(t, home, before)


def crash_build(t: Trial, mode: str) -> None:
    """Kill a build at one of the crash points flare offers (FLARE_CRASH_AT): after the N-th
    payload of assemble, after the index is stored, after the refs are written."""
    config = t.rng.choice(["r1", "r2"])
    home = t.home(base=t.rng.random() < 0.5)
    before = checks.protected(home.registry)
    points = [f"assemble:payload:{k}" for k in range(1, t.lab.payloads[config] + 1)]
    point = t.rng.choice([*points, "publish:index", "publish:ref"])
    args = t.lab.build_args("tiny", "ck", config, "k")
    killed = home.run(*args, env={"FLARE_CRASH_AT": point})
    t.fault()
    if killed.rc != -9:
        t.note(f"crash point {point} not reached (exit {killed.rc})")
    resume_to_clean(t, home, args, t.lab.digest("tiny", "ck", config), 1)
    settle(t, home, before)


def kill_publish(t: Trial, mode: str) -> None:
    """Kill a build at a random moment of its publish phase (storing the index, writing refs
    and index rows, signing)."""
    config = t.rng.choice(["r1", "r2"])
    home = t.home(base=t.rng.random() < 0.5)
    before = checks.protected(home.registry)
    args = t.lab.build_args("tiny", "ck", config, "k")
    process = home.start(*args)
    watchdog = threading.Timer(COMMAND_TIMEOUT_S, kill_group, [process])
    watchdog.start()
    assert process.stderr is not None
    for line in process.stderr:
        if line.strip() == "phase publish":
            time.sleep(t.rng.uniform(0.0, 0.15))
            break
    watchdog.cancel()
    home.finish(process, args, 0, kill=True)
    t.fault()
    resume_to_clean(t, home, args, t.lab.digest("tiny", "ck", config), 1)
    settle(t, home, before)


def kill_pull(t: Trial, mode: str) -> None:
    """Kill a pull at random moments; the next pull completes, the host cache and the registry
    verify."""
    home = t.home(base=True)
    before = checks.protected(home.registry)
    ref = t.rng.choice(PULLABLE)
    kills = t.rng.randint(1, 2)
    for _ in range(kills):
        t.fault()
        delay = t.rng.uniform(0.1, t.lab.seconds["pull"] * 1.1)
        home.kill_after(delay, "pull", ref, "--device", "cpu")
    if t.check(home.run("pull", ref, "--device", "cpu")):
        t.caught(kills)
    if home.cache.exists():
        t.check(home.run("store", "verify", "--store", str(home.cache)))
    settle(t, home, before)


def kill_copy(t: Trial, mode: str) -> None:
    """Kill `registry copy --to` at random moments (random), or right after a new destination's
    tables are created and before its schema is stamped (db, item 7); the destination then
    works, the copy completes, and both registries verify."""
    home = t.home(base=True)
    before = checks.protected(home.registry)
    dest = t.root / "dest"
    ref = t.rng.choice(LIVE)
    copy = ("registry", "copy", ref, "--to", str(dest))
    if mode == "db":
        t.fault()
        killed = home.run(*copy, kill_at=CREATE_TABLES)
        if killed.rc != -9:
            t.note(f"never reached {CREATE_TABLES} (exit {killed.rc})")
    for _ in range(t.rng.randint(1, 2) if mode == "random" else 0):
        t.fault()
        home.kill_after(t.rng.uniform(0.05, t.lab.seconds["copy"] * 1.1), *copy)
    caught = t.check(home.run("registry", "ls", "--registry", str(dest)), ok=(0, 3))
    caught &= t.check(home.run(*copy))
    rows = listing_complete(t, home, registry=str(dest))
    want = checks.protected(home.registry)[ref]
    if (ref.split(":")[0], want) not in rows:
        caught = False
        t.violate(f"after the copy, {dest} does not list {ref}")
    caught &= verify_exact(t, home, registry=str(dest))
    refs_sound(t, dest)
    if caught:
        t.caught(t.outcome.faults)
    settle(t, home, before)


CREATE_TABLES = "flare.registry.models:metadata.create_all:after"
"""Right after a new index DB's tables exist, before its schema version is stamped."""


def kill_gc(t: Trial, mode: str) -> None:
    """Kill `registry gc --grace 0` on a registry with garbage: at a random moment (random),
    right after it forgot a package's ref file and before its index rows (forget), or after
    the N-th blob it deleted (sweep). Then: ls lists only complete packages, verify passes,
    nothing protected was lost, and the next gc finishes the job."""
    home = t.home(base=True)
    before = checks.protected(home.registry)
    gc = ("registry", "gc", "--grace", "0")
    t.fault()
    if mode == "random":
        home.kill_after(t.rng.uniform(0.05, t.lab.seconds["gc"] * 1.2), *gc)
    else:
        point = {
            "forget": "flare.registry.refs:forget_package:after:1",
            "sweep": f"flare.store.backends.local:LocalBackend.remove:after:"
            f"{t.rng.randint(1, t.lab.garbage)}",
        }[mode]
        killed = home.run(*gc, kill_at=point)
        if killed.rc != -9:
            t.note(f"never reached {point} (exit {killed.rc})")
    t.item = 8
    listing_complete(t, home)
    verify_exact(t, home)
    refs_sound(t, home.registry, item=None)
    nothing_lost(t, home.registry, before, item=None)
    if not t.check(home.run(*gc)):
        return
    rows = listing_complete(t, home)
    stored = checks.records(home.registry)
    if rows != stored:
        t.violate(
            f"after the next gc, ls lists {sorted(r[1][:12] for r in rows - stored)} that the "
            f"store does not record, and misses {sorted(r[1][:12] for r in stored - rows)}"
        )
    for problem in checks.dangling_records(home.registry):
        t.violate(f"after the next gc, a package record is left half collected: {problem}")
    if not t.outcome.violations:
        t.caught()
    settle(t, home, before)


def kill_reindex(t: Trial, mode: str) -> None:
    """Kill `registry reindex` at a random moment, on the registry's DB or on a lost one
    (random), or right after a new DB's tables exist (db, item 7); the next reindex works and
    the index matches the store."""
    home = t.home(base=True)
    before = checks.protected(home.registry)
    lose_db = mode == "db" or t.rng.random() < 0.5
    if lose_db:
        for path in home.registry.glob("index.db*"):
            path.unlink()
    t.fault()
    if mode == "db":
        killed = home.run("registry", "reindex", kill_at=CREATE_TABLES)
        if killed.rc != -9:
            t.note(f"never reached {CREATE_TABLES} (exit {killed.rc})")
    else:
        home.kill_after(t.rng.uniform(0.05, t.lab.seconds["reindex"] * 1.2), "registry", "reindex")
    if not t.check(home.run("registry", "reindex")):
        return
    rows = listing_complete(t, home)
    if rows != checks.records(home.registry):
        t.violate("after reindex, ls does not list what the store records")
    else:
        t.caught()
    settle(t, home, before)


# -- corruption ------------------------------------------------------------------------------
