"""Trials: each breaks flare one way at a seeded random point, then checks the invariants.

A trial is a function of a `Trial` (its seed's random numbers, its folder, what it found) and a
mode; `KINDS` names them with the issue-13 item each mode's violations belong to (None: a
promise no item of the issue is about, so a violation there is a new bug). A trial counts the
faults it injects, the faults flare caught (survived with every invariant intact, or refused
with its documented error), the protected packages lost, and every violation with the command
that showed it. `run_trial(lab, kind, seed)` runs one again exactly.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from registry_helpers import postgres_database

from faults import checks
from faults.lab import (
    BASE_PACKAGES,
    COMMAND_TIMEOUT_S,
    LIVE,
    PULLABLE,
    Home,
    Lab,
    Run,
    kill_group,
    remount,
    tmpfs,
    write_filler,
)
from faults.serving import Server, hostile_requests

DEFAULT = object()
SYMPTOMS = [("already exists", 7), ("UnicodeDecodeError", 9), ("MemoryError", 11)]
"""Messages that tell which item of issue 13 a failure is, whatever trial met it."""


@dataclass(frozen=True)
class Violation:
    """An invariant that did not hold: what, in which trial, shown by which command."""

    kind: str
    seed: int
    item: int | None
    what: str
    command: str = ""

    def reproduce(self) -> str:
        return f"python tests/bench/soak.py --repro {self.kind}:{self.seed}"


@dataclass
class Outcome:
    """What one trial did and found."""

    kind: str
    seed: int
    faults: int = 0
    caught: int = 0
    lost: int = 0
    violations: list[Violation] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


class Trial:
    """One trial's seeded random numbers, folder, homes, mounts and findings."""

    def __init__(self, lab: Lab, kind: str, seed: int) -> None:
        self.lab, self.kind, self.seed = lab, kind, seed
        self.rng = random.Random(f"{kind}/{seed}")
        self.root = lab.trials / f"{kind}-{seed}"
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True)
        self.item: int | None = None
        self.outcome = Outcome(kind, seed)
        self.stack = ExitStack()
        self._lock = threading.Lock()

    def home(
        self, name: str = "host", base: bool = False, registry: Path | None = None, database=""
    ) -> Home:
        """A host under the trial's folder; with `base`, its registry starts as the lab's
        prepared one."""
        return self.lab.host(self.root / name, base, registry, database)

    def mount(self, path: Path, size: str) -> Path:
        return self.stack.enter_context(tmpfs(path, size))

    # -- findings ---------------------------------------------------------------------------

    def fault(self, count: int = 1) -> None:
        self.outcome.faults += count

    def caught(self, count: int = 1) -> None:
        self.outcome.caught += count

    def note(self, text: str) -> None:
        self.outcome.notes.append(text)

    def violate(self, what: str, run: Run | None = None, item: object = DEFAULT) -> None:
        if item is DEFAULT:
            item = self.item if self.item is not None else _symptom(run)
        command = run.command() if run else ""
        with self._lock:
            self.outcome.violations.append(Violation(self.kind, self.seed, item, what, command))  # type: ignore[arg-type]

    def check(self, run: Run, ok: tuple[int, ...] = (0,), item: object = DEFAULT) -> bool:
        """The command answered, and with one of the exit codes `ok`; never an internal error
        or a traceback (bad input, a full disk or a broken store get a documented code)."""
        if run.timed_out:
            self.violate(f"no answer within {run.seconds:.0f} s", run, item)
        elif run.rc < 0:
            self.violate(f"died of signal {-run.rc}", run, item)
        elif "internal error" in run.err or "Traceback" in run.err:
            self.violate(f"internal error: {run.message()}", run, item)
        elif run.rc not in ok:
            said = run.message() or " ".join(run.out.split())[:300]
            self.violate(f"exit {run.rc} (expected {_codes(ok)}): {said}", run, item)
        else:
            return True
        return False

    def close(self) -> None:
        self.stack.close()
        shutil.rmtree(self.root, ignore_errors=True)


def _codes(ok: tuple[int, ...]) -> str:
    return f"{ok[0]}-{ok[-1]}" if len(ok) > 2 else " or ".join(map(str, ok))


def _symptom(run: Run | None) -> int | None:
    text = run.err if run else ""
    return next((item for marker, item in SYMPTOMS if marker in text), None)


# -- invariants ------------------------------------------------------------------------------


def listing_complete(t: Trial, home: Home, item: object = DEFAULT, **kw: str) -> set[tuple]:
    """`registry ls` works, and every package it lists has its index and all its blobs.
    Returns the (name, hex) rows."""
    done = home.run("registry", "ls", "--json", *_registry(kw))
    if not t.check(done, item=item):
        return set()
    rows = {(row["name"], row["digest"].removeprefix("blake3:")) for row in done.json()}  # type: ignore[union-attr]
    root = Path(kw.get("registry", home.registry))
    for name, hex_digest in sorted(rows):
        problem = checks.package_problem(root, hex_digest)
        if problem is not None:
            t.violate(f"registry ls lists {name}@{hex_digest[:12]}: {problem}", done, item)
    return rows


def verify_exact(
    t: Trial,
    home: Home,
    corrupt: set[str] = frozenset(),
    missing: set[str] = frozenset(),
    item: object = DEFAULT,
    **kw: str,
) -> bool:
    """`registry verify` names exactly the blobs broken on purpose: corrupt ones (exit 6),
    else missing ones (exit 3), else passes (exit 0)."""
    done = home.run("registry", "verify", "--json", *_registry(kw))
    want = 6 if corrupt else 3 if missing else 0
    if not t.check(done, ok=(want,), item=item):
        return False
    if not done.out.strip():
        t.violate(f"verify printed no report (exit {done.rc}): {done.message()}", done, item)
        return False
    report = done.json()
    found_corrupt = {d.removeprefix("blake3:") for d in report["corrupt"]}  # type: ignore[index]
    found_missing = {d.removeprefix("blake3:") for d in report["missing"]}  # type: ignore[index]
    if (found_corrupt, found_missing) != (set(corrupt), set(missing)):
        t.violate(
            f"verify named corrupt {_short(found_corrupt)}, missing {_short(found_missing)}; "
            f"broken on purpose: corrupt {_short(corrupt)}, missing {_short(missing)}",
            done,
            item,
        )
        return False
    return True


def refs_sound(t: Trial, root: Path, ignore: set[Path] = frozenset(), item=DEFAULT) -> None:
    """Every tag and pin names a complete package."""
    for problem in checks.dangling_refs(root, ignore):
        t.violate(f"a ref names a missing blob: {problem}", item=item)


def nothing_lost(
    t: Trial, root: Path, before: dict[str, str], spared: set[str] = frozenset(), item=DEFAULT
) -> None:
    """Every package a tag or pin protected before the trial is still complete."""
    for problem in checks.lost(root, before, spared):
        t.outcome.lost += 1
        t.violate(f"data lost: {problem}", item=item)


def settle(t: Trial, home: Home, before: dict[str, str], item: object = DEFAULT) -> None:
    """The invariants after any trial on a registry: the next commands work, verify passes,
    nothing references a missing blob, nothing protected was lost."""
    listing_complete(t, home, item)
    verify_exact(t, home, item=item)
    refs_sound(t, home.registry, item=item)
    nothing_lost(t, home.registry, before, item=item)


def _registry(kw: dict[str, str]) -> list[str]:
    return ["--registry", kw["registry"]] if "registry" in kw else []


def _short(digests: set[str] | frozenset[str]) -> str:
    return "[" + ", ".join(sorted(d[:12] for d in digests)) + "]"


def live_package(ref: str) -> tuple[str, str, str, str]:
    """(name, source, config, tag) of one of the prepared registry's live packages."""
    name, tag = ref.split(":")
    package = next(p for p in BASE_PACKAGES if (p.name, p.tag) == (name, tag))
    return package.name, package.source, package.config, package.tag


def resume_to_clean(t: Trial, home: Home, args: list[str], want: str, faults: int) -> None:
    """The interrupted build, run again to its end, gives the digest of an uninterrupted one."""
    done = home.run(*args)
    if not t.check(done):
        return
    got = done.json()["digest"]  # type: ignore[index]
    if got == want:
        t.caught(faults)
    else:
        t.violate(f"the resumed build gave {got}, an uninterrupted one gives {want}", done)


# -- kills -----------------------------------------------------------------------------------


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


def spoil(path: Path, how: str, rng: random.Random) -> None:
    """Flip one byte of a file, or cut it short, in place (as a disk or a person would)."""
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[rng.randrange(len(data))] ^= rng.randint(1, 255)
    else:
        data = data[: rng.randrange(len(data))]
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    os.chmod(path, 0o444)


PARTS = ("index", "payloads", "artifacts")


def corrupt_blob(t: Trial, mode: str) -> None:
    """Flip a byte of, or truncate, one blob of a live package (index, payload or artifact).
    Pull refuses it (exit 6); verify names exactly that blob and quarantines it; building the
    package again restores it; nothing else is lost."""
    home = t.home(base=True)
    before = checks.protected(home.registry)
    ref = t.rng.choice(LIVE)
    package = before[ref]
    manifest = checks.manifest(home.registry, package)
    assert manifest is not None
    how, part = mode.split("-")
    victim = package if part == "index" else t.rng.choice(manifest[part])["digest"][7:]
    path = checks.blob_path(home.registry, victim)
    assert path is not None
    spoil(path, how, t.rng)
    t.fault()
    if ref in PULLABLE:
        t.check(home.run("pull", ref, "--device", "cpu"), ok=(6,))
    if verify_exact(t, home, corrupt={victim}):
        t.caught()
    if checks.blob_path(home.registry, victim) is not None:  # not quarantined: as flare advises
        t.check(home.run("store", "verify"), ok=(6,))
    verify_exact(t, home, missing={victim})
    affected = {r for r, d in before.items() if d == victim or victim in _needs(home, d)}
    for rebuilt in sorted(affected & set(LIVE)):
        name, source, config, tag = live_package(rebuilt)
        done = home.run(*t.lab.build_args(name, source, config, tag))
        if t.check(done) and done.json()["digest"] != t.lab.digest(name, source, config):  # type: ignore[index]
            t.violate(f"rebuilding {rebuilt} gave another digest", done)
    settle(t, home, before)


def _needs(home: Home, package: str) -> set[str]:
    found = checks.manifest(home.registry, package)
    return checks.needed(found) if found else set()


def corrupt_ref(t: Trial, mode: str) -> None:
    """Break one ref file (item 9): random bytes in a tag, a tag naming a payload blob, a
    folder with a bad name, an empty tag, garbage in a package record, a pin that is no
    digest. verify names the file; every other command names it or goes on; gc deletes
    nothing a readable registry would keep."""
    home = t.home(base=True)
    before = checks.protected(home.registry)
    tiny = before["tiny:latest"]
    manifest = checks.manifest(home.registry, tiny)
    assert manifest is not None
    refs = home.registry / "refs"
    path, data = {
        "garbage-tag": (refs / "tiny/tags/latest", t.rng.randbytes(t.rng.randint(1, 80))),
        "payload-tag": (
            refs / "tiny/tags/latest",
            f"{t.rng.choice(manifest['payloads'])['digest']}\n".encode(),
        ),
        "bad-name": (refs / "BAD..NAME/tags/x", b"x"),
        "empty-tag": (refs / "tiny/tags/latest", b""),
        "garbage-record": (refs / f"tiny/packages/{tiny}", t.rng.randbytes(40)),
        "bad-pin": (refs / "tiny/pins/not-a-digest", b""),
    }[mode]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    t.fault()
    t.item = 9
    relative = str(path.relative_to(home.registry))
    named = ("refs/BAD..NAME",) if mode == "bad-name" else (relative,)  # the folder will do
    verified = home.run("registry", "verify", "--json")
    if t.check(verified, ok=tuple(range(2, 15))):
        if any(name in verified.out + verified.err for name in named):
            t.caught()
        else:
            t.violate(f"verify does not name the broken ref file {relative}", verified)
    t.check(home.run("registry", "ls"))
    t.check(home.run("registry", "reindex"), ok=tuple(range(0, 15)))
    unaffected = "other:latest"
    t.check(home.run("pull", unaffected, "--device", "cpu"))
    if mode in ("garbage-tag", "payload-tag", "empty-tag"):
        refused = home.run("pull", "tiny", "--device", "cpu")
        if t.check(refused, ok=tuple(range(2, 15))) and relative not in refused.err:
            t.violate(f"pull of the broken tag does not name {relative}", refused)
    t.check(home.run("registry", "gc", "--grace", "0"), ok=tuple(range(0, 15)))
    nothing_lost(t, home.registry, before)
    path.unlink()
    if mode == "garbage-record":
        path.write_bytes(b'{"created": "2026-01-01T00:00:00+00:00", "publisher": "soak"}')
    if mode in ("garbage-tag", "payload-tag", "empty-tag"):
        path.write_text(f"blake3:{tiny}\n")
    refs_sound(t, home.registry)


# -- full disks ------------------------------------------------------------------------------


SMALL = {"registry": (48, 640), "staging": (4, 96), "cache": (32, 480), "dest": (32, 480)}
"""Sizes of the small filesystem, in KiB, per target: from too small to just enough."""


def disk_full(t: Trial, mode: str) -> None:
    """Run out of space (a small tmpfs, or one filled while the command runs) in the registry
    or the staging area during a build, the host cache during a pull, or the destination of a
    copy. The command succeeds or exits 8 saying so; with space freed, it runs again to the
    clean result, and nothing it wrote is broken."""
    target, style = mode.split("-")
    filled = style == "filled"
    base = target in ("cache", "dest")
    home = t.home(base=base)
    before = checks.protected(home.registry)
    place = {
        "registry": home.registry,
        "staging": home.staging,
        "cache": home.cache,
        "dest": t.root / "dest",
    }[target]
    low, high = SMALL[target]
    size = "4m" if filled else f"{t.rng.randint(low, high)}k"
    t.mount(place, size)
    t.note(f"{target} on a {size} tmpfs" + ", filled while the command ran" * filled)
    ref = t.rng.choice(PULLABLE)
    config = t.rng.choice(["r1", "r2"])
    build = t.lab.build_args("tiny", "ck", config, "k")
    command = {
        "registry": build,
        "staging": build,
        "cache": ["pull", ref, "--device", "cpu"],
        "dest": ["registry", "copy", ref, "--to", str(place)],
    }[target]
    t.fault()
    if filled:
        process = home.start(*command)
        took = {"registry": "build", "staging": "build", "cache": "pull", "dest": "copy"}[target]
        time.sleep(t.rng.uniform(0.05, t.lab.seconds[took]))
        write_filler(place)
        first = home.finish(process, command)
    else:
        first = home.run(*command)
    if t.check(first, ok=(0, 8)) and (first.rc == 0 or "space" in first.err.lower()):
        t.caught()
    elif first.rc == 8:
        t.violate("exit 8 without saying the disk is full", first)
    for filler in place.glob("filler-*"):
        filler.unlink()
    remount(place, "64m")
    again = home.run(*command)
    if not t.check(again):
        return
    if target in ("registry", "staging"):
        want = t.lab.digest("tiny", "ck", config)
        if again.json()["digest"] != want:  # type: ignore[index]
            t.violate(f"after the disk was freed the build gave another digest than {want}", again)
    if target == "cache":
        t.check(home.run("store", "verify", "--store", str(place)))
    if target == "dest":
        verify_exact(t, home, registry=str(place))
        refs_sound(t, place)
    settle(t, home, before)


# -- hosts at once ---------------------------------------------------------------------------


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


def serve_requests(t: Trial, mode: str) -> None:
    """Hostile requests to a running server (items 1, 2, 3, 6): a sampling parameter that
    overflows among six ordinary completions, a lone surrogate, a 5 MB prompt while /health
    is polled, /openapi.json. Each gets its documented answer and harms no other request."""
    home = t.home(base=True)
    server = t.stack.enter_context(Server.start(home, "tiny"))
    if server.url is None:
        t.violate(f"the server did not start: {server.message()}", item=None)
        return
    hostile_requests(t, server)
    stopped = server.stop()
    if stopped not in (0, None):
        t.violate(f"the server exited {stopped} on SIGTERM", item=None)


def serve_cache(t: Trial, mode: str) -> None:
    """A byte flipped in a pulled payload in the host cache (item 4): serve refuses (exit 6)
    and quarantines it rather than serve the changed weights."""
    t.item = 4
    home = t.home(base=True)
    if not t.check(home.run("pull", "tiny", "--device", "cpu"), item=None):
        return
    manifest = checks.manifest(home.registry, checks.protected(home.registry)["tiny:latest"])
    assert manifest is not None
    victim = t.rng.choice(manifest["payloads"])["digest"][7:]
    path = checks.blob_path(home.cache, victim)
    assert path is not None
    copy = path.with_name(path.name + ".soak")
    shutil.copyfile(path, copy)  # a new inode: the registry's blob stays whole
    spoil(copy, "flip", t.rng)
    os.replace(copy, path)
    t.fault()
    server = t.stack.enter_context(Server.start(home, "tiny"))
    if server.url is not None:
        t.violate(f"serve loaded a payload whose bytes changed in the host cache ({victim[:12]})")
        return
    if server.returncode != 6 or "internal error" in server.err:
        t.violate(f"serve exited {server.returncode}, not 6: {server.message()}")
        return
    if not list((home.cache / "quarantine").glob(f"{victim}*")):
        t.violate(f"serve refused the changed payload {victim[:12]} but did not quarantine it")
        return
    t.caught()
    verify_exact(t, home, item=None)


MALFORMED = {
    "config-is-payload": "config.json is a payload blob",
    "tokenizer-is-template": "tokenizer.json is the chat template",
    "payload-size": "a payload is said to be 10^18 bytes",
    "dtype": "a payload's BF16 tensors are said to be F64",
}


def serve_malformed(t: Trial, mode: str) -> None:
    """A signed package whose manifest lies about its parts (item 5): serve refuses it with a
    clear error naming the part (exit 6), never an internal error, never serving it."""
    t.item = 5
    home = t.home(base=True)
    index = _malformed_index(home, mode)
    path = t.root / "index.bin"
    path.write_bytes(index)
    stored = home.run("store", "put", "--no-link", str(path), "--json")
    if not t.check(stored, item=None):
        return
    digest = stored.json()[0]["digest"]  # type: ignore[index]
    if not t.check(home.run("registry", "tag", digest, "bad:latest"), item=None):
        return
    if not t.check(home.run("sign", "bad"), item=None):
        return
    t.fault()
    server = t.stack.enter_context(Server.start(home, "bad"))
    if server.url is not None:
        t.violate(f"serve served a signed package where {MALFORMED[mode]}")
    elif server.returncode != 6 or "internal error" in server.err:
        t.violate(f"{MALFORMED[mode]}: serve exited {server.returncode}, not 6: {server.message()}")
    else:
        t.caught()


def _malformed_index(home: Home, mode: str) -> bytes:
    """tiny:latest's index with one lie in its manifest, encoded as flare encodes indexes."""
    from flare.store.package import Manifest, encode_index

    manifest = checks.manifest(home.registry, checks.protected(home.registry)["tiny:latest"])
    assert manifest is not None
    by_path = {a["path"]: a for a in manifest["artifacts"]}
    payload = manifest["payloads"][0]
    if mode == "config-is-payload":
        by_path["config.json"] |= {"digest": payload["digest"], "size": payload["size"]}
    elif mode == "tokenizer-is-template":
        template = by_path["chat_template.jinja"]
        by_path["tokenizer.json"] |= {"digest": template["digest"], "size": template["size"]}
    elif mode == "payload-size":
        payload["size"] = 10**18
    else:
        for tensor in payload["tensors"]:
            tensor["dtype"] = "F64"
    manifest["name"] = "bad"
    return encode_index(Manifest.model_validate_json(json.dumps(manifest)))


# -- build input -----------------------------------------------------------------------------


def build_link(t: Trial, mode: str) -> None:
    """A checkpoint with a link out of itself (item 10) is refused, naming the link and its
    target, and the target's bytes never become a blob; a hub-cache snapshot's links into its
    own repo folder still build."""
    t.item = 10
    home = t.home()
    if mode == "hub":
        t.fault()
        if _hub_snapshot_builds(t, home):
            t.caught()
        return
    source = t.root / "ck-linked"
    shutil.copytree(t.lab.source("ck"), source)
    secret = t.root / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_bytes(t.rng.randbytes(t.rng.randint(16, 4096)))
    link = source / t.rng.choice(["vocab.txt", "notes.txt", "sub/extra.json"])
    link.parent.mkdir(exist_ok=True)
    link.symlink_to(secret)
    t.fault()
    done = home.run("build", str(source), "--name", "linked", "--json")
    leaked = checks.blob_path(home.registry, _hex_of(secret.read_bytes())) is not None
    if done.rc == 0 or leaked:
        t.violate(f"a link out of the checkpoint ({link.name} -> {secret}) was published", done)
    elif t.check(done, ok=tuple(range(2, 15))):
        named = str(link.relative_to(source)) in done.err and str(secret) in done.err
        if named:
            t.caught()
        else:
            t.violate("the refusal does not name the link and its target", done)


def _hub_snapshot_builds(t: Trial, home: Home) -> bool:
    revision = t.rng.randbytes(20).hex()
    repo = t.root / "hub" / "models--soak--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in sorted(t.lab.source("ck").iterdir()):
        blob = repo / "blobs" / _hex_of(file.read_bytes())
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob.name)
    hub = {"FLARE_HUB_CACHE": str(t.root / "hub")}
    return t.check(home.run("build", "soak/tiny", "--name", "hub", env=hub))


def _hex_of(data: bytes) -> str:
    import blake3

    return blake3.blake3(data).hexdigest()


LAYERS = [10**9, 10**6, 2**31 - 1, 10**12]


def build_layers(t: Trial, mode: str) -> None:
    """config.json claims a billion layers (item 11): the build refuses within seconds, with a
    clear error, in bounded memory."""
    t.item = 11
    home = t.home()
    source = t.root / "ck-huge"
    shutil.copytree(t.lab.source("ck"), source)
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = t.rng.choice(LAYERS)
    (source / "config.json").write_text(json.dumps(config))
    t.fault()
    done = home.run("build", str(source), "--name", "huge", timeout=10, memory_limit=3 << 30)
    if t.check(done, ok=(4, 6)):
        if done.seconds > 5:
            t.violate(f"the refusal took {done.seconds:.1f} s", done)
        else:
            t.caught()


def build_moved(t: Trial, mode: str) -> None:
    """The same checkpoint under another folder name builds to the same digest (item 12)."""
    t.item = 12
    home = t.home()
    moved = t.root / f"copy-{t.rng.randrange(10**6)}" / t.rng.choice(["model", "ckpt", "x"])
    shutil.copytree(t.lab.source("ck"), moved)
    t.fault()
    done = home.run(*t.lab.build_args("tiny", "ck", "r1"))
    moved_done = home.run("build", str(moved), "--name", "tiny", "--payload-size", "16K", "--json")
    if t.check(done) and t.check(moved_done):
        here, there = done.json()["digest"], moved_done.json()["digest"]  # type: ignore[index]
        if here != there:
            t.violate(f"{t.lab.source('ck')} builds to {here}, its copy at {moved} to {there}")
        else:
            t.caught()


# -- the catalogue ---------------------------------------------------------------------------


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
