"""Trials that damage what flare keeps: a flipped or truncated blob, a bad ref file, a full
disk under the registry, the staging area, the host cache or a copy's destination."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

from faults import checks
from faults.lab import (
    LIVE,
    PULLABLE,
    Home,
    remount,
    write_filler,
)
from faults.trial import Trial, live_package, nothing_lost, refs_sound, settle, verify_exact


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
