"""Trials of several hosts sharing one registry (SQLite or PostgreSQL index): builds, tags,
pulls, gc, listings and removals interleaved at random."""

from __future__ import annotations

import random
import threading
import time

from registry_helpers import postgres_database

from faults import checks
from faults.lab import (
    Home,
)
from faults.trial import Trial, listing_complete, nothing_lost, refs_sound, verify_exact

HOST_OPS = {"build": 4, "tag": 2, "pull": 1, "gc": 3, "ls": 1, "rm": 1}


def hosts(t: Trial, mode: str) -> None:
    """Four hosts on one registry folder (index on SQLite, or on PostgreSQL), building, tagging,
    pulling, removing and collecting (gc --grace 0) at once for a few seconds. Every command
    ends as documented; at the end every tag a host last wrote names that host's package,
    complete; ls matches the store; verify passes."""
    shared = t.root / "shared"
    database = ""
    if mode == "postgresql":
        if not t.lab.postgres:
            t.note("no PostgreSQL server given")
            return
        database = t.stack.enter_context(postgres_database(t.lab.postgres))
    t.lab.copy_base(shared)
    homes = [t.home(f"host{i}", registry=shared, database=database) for i in range(4)]
    if database:
        t.check(homes[0].run("registry", "reindex"))
    before = checks.protected(shared)
    deadline = time.monotonic() + t.rng.uniform(4.0, 9.0)
    last: dict[tuple[str, str], str] = {}
    seeds = [t.rng.randrange(1 << 30) for _ in homes]
    workers = [
        threading.Thread(target=_host, args=(t, i, home, random.Random(seed), deadline, last))
        for i, (home, seed) in enumerate(zip(homes, seeds, strict=True))
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    for (name, tag), digest in sorted(last.items()):
        now = checks.protected(shared).get(f"{name}:{tag}")
        problem = checks.package_problem(shared, digest)
        if now != digest or problem:
            t.outcome.lost += 1
            t.violate(f"data lost: {name}:{tag} was {digest[:12]}, now {now}: {problem}")
    home = homes[0]
    rows = listing_complete(t, home)
    if rows != checks.records(shared):
        t.violate("after the hosts stopped, ls does not list what the store records")
    verify_exact(t, home)
    refs_sound(t, shared)
    nothing_lost(t, shared, before)
    if not t.outcome.violations:
        t.caught(t.outcome.faults)


def _host(t: Trial, i: int, home: Home, rng: random.Random, deadline: float, last: dict) -> None:
    """One host's loop of random commands; tags h<i> and t<i> are this host's alone."""
    while time.monotonic() < deadline:
        op = rng.choices(list(HOST_OPS), weights=list(HOST_OPS.values()))[0]
        name, source = rng.choice([("tiny", "ck"), ("other", "ck2")])
        t.fault()
        if op == "build":
            done = home.run(*t.lab.build_args(name, source, rng.choice(["r1", "r2"]), f"h{i}"))
            if t.check(done):
                last[(name, f"h{i}")] = done.json()["digest"].removeprefix("blake3:")  # type: ignore[index]
        elif op == "tag":
            done = home.run("registry", "tag", f"{name}:h{i}", f"{name}:t{i}", "--json")
            if t.check(done, ok=(0, 3)) and done.rc == 0:
                last[(name, f"t{i}")] = done.json()["digest"].removeprefix("blake3:")  # type: ignore[index]
        elif op == "rm":  # removes every tag of the name on that package: h<i> too, maybe
            done = home.run("registry", "rm", f"{name}:t{i}", "--json")
            if t.check(done, ok=(0, 3)) and done.rc == 0:
                for tag in done.json()["tags"]:  # type: ignore[index]
                    last.pop((name, tag), None)
        elif op == "pull":  # not there yet (3), or built for two ranks (12)
            pulled = home.run("pull", f"{name}:h{rng.randrange(4)}", "--device", "cpu")
            t.check(pulled, ok=(0, 3, 12))
        elif op == "gc":
            t.check(home.run("registry", "gc", "--grace", "0"))
        else:
            t.check(home.run("registry", "ls", "--json"))


# -- serving ---------------------------------------------------------------------------------
