"""The registry under faults: processes killed (SIGKILL) at its crash points and at seeded random
times, and ref files damaged by hand. After each, the next command works and `registry verify`
answers as docs/package-format.md says ("Garbage collection", "Refs")."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from registry_helpers import BACKENDS, build_into, flare, lab_env, start, tiny_sources
from sqlalchemy import create_engine, inspect

from flare.registry import gc
from flare.registry.models import metadata
from flare.registry.registry import Registry
from flare.store import Digest

KILLED = -signal.SIGKILL
NOT_FOUND, INDEX_UNUSABLE = 3, 10


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_sources(tmp_path_factory.mktemp("sources"), 4)


@pytest.fixture(params=BACKENDS)
def lab(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, str]]:
    with lab_env(request.param, tmp_path) as env:
        yield env


def crashing(env: dict[str, str], point: str) -> dict[str, str]:
    """The same host, set to die with SIGKILL at a crash point (faults.py)."""
    return env | {"FLARE_CRASH_AT": point}


def listed(env: dict[str, str], *args: str) -> list[tuple[str, str, tuple[str, ...]]]:
    rows = json.loads(flare(env, "registry", "ls", "--json", *args).stdout)
    return sorted((r["name"], r["digest"], tuple(r["tags"])) for r in rows)


# -- item 7: a new index DB ------------------------------------------------------------------


def test_a_kill_between_creating_and_stamping_the_index_db_bricks_nothing(
    lab: dict[str, str], sources: Path
) -> None:
    killed = flare(
        crashing(lab, "index:stamp"), "build", str(sources / "tiny-0"), "--name", "a", check=False
    )
    assert killed.returncode == KILLED, killed.stderr
    flare(lab, "build", str(sources / "tiny-0"), "--name", "a")
    assert [(name, tags) for name, _, tags in listed(lab)] == [("a", ("latest",))]
    flare(lab, "registry", "reindex")
    flare(lab, "registry", "verify")


def test_a_copy_killed_while_it_creates_the_new_registry_s_index_db(
    tmp_path: Path, sources: Path
) -> None:
    """Seen in the field: `registry copy --to NEW` killed as it made NEW's SQLite index."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
    env["FLARE_BUILD_TARGET"] = "none"  # eager packages: tests/test_compiled.py compiles
    env |= {"FLARE_HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    flare(env, "build", str(sources / "tiny-0"), "--name", "a")
    new = str(tmp_path / "new")
    killed = flare(crashing(env, "index:stamp"), "registry", "copy", "a", "--to", new, check=False)
    assert killed.returncode == KILLED, killed.stderr
    assert listed(env, "--registry", new) == []
    flare(env, "registry", "copy", "a", "--to", new)
    assert listed(env, "--registry", new) == listed(env)
    flare(env, "registry", "verify", "--registry", new)


def test_an_index_db_without_its_version_row_is_made_again(
    lab: dict[str, str], sources: Path
) -> None:
    """What an older flare's killed creation left: every table, no alembic version row."""
    engine = create_engine(lab["FLARE_DATABASE"])
    with engine.begin() as connection:
        metadata.create_all(connection)
    engine.dispose()
    flare(lab, "build", str(sources / "tiny-0"), "--name", "a")
    assert [name for name, _, _ in listed(lab)] == ["a"]
    engine = create_engine(lab["FLARE_DATABASE"])
    with engine.connect() as connection:
        assert "alembic_version" in inspect(connection).get_table_names()
    engine.dispose()


# -- item 8: a killed gc ---------------------------------------------------------------------


def with_old_packages(lab: dict[str, str], sources: Path) -> dict[str, str]:
    """a and b, each built twice under `latest`: the first builds stay recorded, untagged, for
    gc to collect. Returns the digest of each build."""
    made = {}
    for key, name, seed in (("a0", "a", 0), ("b0", "b", 1), ("a1", "a", 2), ("b1", "b", 3)):
        built = flare(lab, "build", str(sources / f"tiny-{seed}"), "--name", name, "--json")
        made[key] = json.loads(built.stdout)["digest"]
    return made


def stored(lab: dict[str, str]) -> set[str]:
    listing = flare(lab, "store", "ls", "--json", "--store", lab["FLARE_REGISTRY"]).stdout
    return {entry["digest"] for entry in json.loads(listing)}


def needed(lab: dict[str, str], digest: str) -> set[str]:
    """A package's blobs, its index included."""
    shown = json.loads(flare(lab, "registry", "show", digest, "--json").stdout)["manifest"]
    return {digest} | {part["digest"] for part in shown["payloads"] + shown["artifacts"]}


def usage(lab: dict[str, str]) -> dict[str, int]:
    return json.loads(flare(lab, "registry", "du", "--json").stdout)


def assert_listed_packages_are_whole(lab: dict[str, str]) -> None:
    """What a reader sees right after a killed gc: every package verify checks is whole, and
    every package ls lists is recorded in the store, with its index (no phantom)."""
    verified = flare(lab, "registry", "verify", "--json", check=False)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    registry = Path(lab["FLARE_REGISTRY"])
    for name, digest, _ in listed(lab):
        hex_digest = digest.removeprefix("blake3:")
        assert (registry / "refs" / name / "packages" / hex_digest).is_file(), (name, digest)
        assert (registry / "blobs" / "blake3" / hex_digest[:2] / hex_digest).is_file(), digest


def assert_collected(lab: dict[str, str], made: dict[str, str]) -> None:
    """After a gc that ran to its end: only a1 and b1 are left, whole, in the store and in the
    index DB, and the DB says what a reindex from the store says."""
    assert listed(lab) == [("a", made["a1"], ("latest",)), ("b", made["b1"], ("latest",))]
    assert stored(lab) == needed(lab, made["a1"]) | needed(lab, made["b1"])
    for old in ("a0", "b0"):
        gone = flare(lab, "registry", "show", f"{old[0]}@{made[old]}", check=False)
        assert gone.returncode == NOT_FOUND, gone.stderr
    before = (listed(lab), usage(lab))
    flare(lab, "registry", "reindex")
    assert (listed(lab), usage(lab)) == before
    flare(lab, "registry", "verify")
    flare(lab, "store", "verify", "--store", lab["FLARE_REGISTRY"])


@pytest.mark.parametrize("point", ["forget:refs:2", "gc:sweep:3"])
def test_a_gc_killed_at_a_crash_point_is_finished_by_the_next(
    lab: dict[str, str], sources: Path, point: str
) -> None:
    made = with_old_packages(lab, sources)
    killed = flare(crashing(lab, point), "registry", "gc", "--grace", "0", check=False)
    assert killed.returncode == KILLED, killed.stderr
    assert_listed_packages_are_whole(lab)
    flare(lab, "registry", "gc", "--grace", "0")
    assert_collected(lab, made)


def test_rows_an_older_gc_left_listed_are_dropped_by_the_next(
    lab: dict[str, str], sources: Path
) -> None:
    """An older flare swept a0, removed its ref file, and was killed before its index DB
    rows: ls listed a package no command could find."""
    made = with_old_packages(lab, sources)
    registry = Path(lab["FLARE_REGISTRY"])
    hex_digest = made["a0"].removeprefix("blake3:")
    (registry / "refs" / "a" / "packages" / hex_digest).unlink()
    (registry / "blobs" / "blake3" / hex_digest[:2] / hex_digest).unlink()
    assert made["a0"] in {digest for _, digest, _ in listed(lab)}
    reported = json.loads(flare(lab, "registry", "gc", "--grace", "0", "--json").stdout)
    assert f"a@{made['a0']}" in reported["forgotten"]
    assert_collected(lab, made)


def write_garbage(registry: Path, count: int, seed: int) -> None:
    """Unreachable blob files, old enough for any grace period: work for a sweep to be killed
    in the middle of (written straight into blobs/: no fsync, as a test fixture may)."""
    from flare.store.hashing import hash_bytes

    for i in range(count):
        data = f"garbage {seed} {i}".encode()
        hex_digest = hash_bytes(data).hex
        path = registry / "blobs" / "blake3" / hex_digest[:2] / hex_digest
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        os.utime(path, (0, 0))


def test_gc_killed_at_random_times_leaves_no_half_collected_package(
    lab: dict[str, str], sources: Path
) -> None:
    """Each round records an old package under many names, untagged (forgetting them takes a
    while), and leaves garbage blobs (so does sweeping them); then gc is killed at a seeded
    random moment once it has changed something. Right after each kill, verify passes and ls
    lists only recorded packages; the last gc finishes every round's work."""
    rng = random.Random(13)
    made = with_old_packages(lab, sources)
    root = Path(lab["FLARE_REGISTRY"])
    old = made["a0"].removeprefix("blake3:")
    killed = 0
    for round_ in range(6):
        flare(lab, "build", str(sources / "tiny-0"), "--name", "a", "--tag", "again")
        registry = Registry(lab["FLARE_REGISTRY"], lab["FLARE_DATABASE"])
        manifest = registry.manifest("a:again")[2]
        for i in range(12):
            registry.publish(f"old{i}", None, Digest(old), manifest)
        registry.remove("a:again")
        registry.db.dispose()
        write_garbage(root, 2000, round_)
        watched = [root / "refs" / f"old{i}" / "packages" / old for i in (0, 11)]
        watched += sorted((root / "blobs" / "blake3").glob("0*/*"))[:20]
        gc = start(lab, "registry", "gc", "--grace", "0")
        deadline = time.monotonic() + 60
        while all(p.exists() for p in watched) and gc.poll() is None:
            assert time.monotonic() < deadline, "gc changed nothing in 60 s"
            time.sleep(0.002)
        time.sleep(rng.uniform(0.0, 0.15))
        gc.send_signal(signal.SIGKILL)
        killed += gc.wait() == KILLED
        assert_listed_packages_are_whole(lab)
    assert killed >= 3, f"only {killed} of 6 gcs were still running when killed"
    flare(lab, "registry", "gc", "--grace", "0")
    assert_collected(lab, made)


# -- item 9: bad ref files -------------------------------------------------------------------

BAD_REF = 14


@pytest.fixture
def host(tmp_path: Path, sources: Path) -> dict[str, str]:
    """One host with alice's signing key, a and b built (and signed), and garbage to collect:
    a build of c, removed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
    env["FLARE_BUILD_TARGET"] = "none"  # eager packages: tests/test_compiled.py compiles
    env |= {"FLARE_HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    env |= {"FLARE_REGISTRY": str(tmp_path / "home" / "registry")}
    flare(env, "key", "generate", "--publisher", "alice")
    for name, seed in (("a", 0), ("b", 1), ("c", 2)):
        flare(env, "build", str(sources / f"tiny-{seed}"), "--name", name)
    flare(env, "registry", "rm", "c")
    return env


def payload_of(env: dict[str, str], ref: str) -> str:
    shown = json.loads(flare(env, "registry", "show", ref, "--json").stdout)
    return shown["manifest"]["payloads"][0]["digest"]


def damage(env: dict[str, str], kind: str) -> str:
    """Damage one ref file as a hostile tester did; return its key."""
    root = Path(env["FLARE_REGISTRY"])
    if kind == "random bytes":
        (root / "refs/a/tags/latest").write_bytes(random.Random(5).randbytes(64))
        return "refs/a/tags/latest"
    if kind == "a payload":
        (root / "refs/a/tags/latest").write_text(payload_of(env, "a") + "\n")
        return "refs/a/tags/latest"
    (root / "refs/BAD..NAME/tags").mkdir(parents=True)
    (root / "refs/BAD..NAME/tags/latest").write_text("x")
    return "refs/BAD..NAME"


def refused(done: object, key: str, code: int = BAD_REF) -> None:
    """One line naming the bad file, the documented exit code, no traceback."""
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)  # type: ignore[attr-defined]
    stderr: str = done.stderr  # type: ignore[attr-defined]
    assert key in stderr and stderr.count("\n") == 1 and "internal error" not in stderr, stderr


@pytest.mark.parametrize("kind", ["random bytes", "a payload", "a bad name"])
def test_a_bad_ref_file_is_named_and_the_rest_still_works(host: dict[str, str], kind: str) -> None:
    root = Path(host["FLARE_REGISTRY"])
    before = stored(host)
    key = damage(host, kind)

    flare(host, "pull", "b", "--device", "cpu")  # another name works
    assert {name for name, _, _ in listed(host)} == {"a", "b"}
    if key.startswith("refs/a/"):
        refused(flare(host, "pull", "a", "--device", "cpu", check=False), key)
        refused(flare(host, "registry", "show", "a", check=False), key)
    else:
        flare(host, "pull", "a", "--device", "cpu")

    gc = flare(host, "registry", "gc", "--grace", "0", check=False)
    refused(gc, key)
    assert "gc deletes nothing" in gc.stderr
    assert stored(host) == before  # c's blobs too: nothing deleted

    reindexed = flare(host, "registry", "reindex", "--json", check=False)
    assert reindexed.returncode == BAD_REF, reindexed.stderr
    report = json.loads(reindexed.stdout)
    assert [bad["file"] for bad in report["bad_refs"]] == [key]
    assert report["packages"] == 2  # a's record and b's: only the bad file is left out
    tags = {(name, tags) for name, _, tags in listed(host)}
    assert tags == (
        {("a", ()), ("b", ("latest",))}
        if key.startswith("refs/a/")
        else {("a", ("latest",)), ("b", ("latest",))}
    )

    verified = flare(host, "registry", "verify", "--json", check=False)
    assert verified.returncode == BAD_REF, verified.stderr
    assert [bad["file"] for bad in json.loads(verified.stdout)["bad_refs"]] == [key]

    fixed = root / key
    (fixed.unlink if fixed.is_file() else lambda: shutil.rmtree(fixed))()
    flare(host, "registry", "verify")
    flare(host, "registry", "gc", "--grace", "0")
    flare(host, "registry", "verify")


def test_verify_names_every_bad_ref_file(host: dict[str, str]) -> None:
    root = Path(host["FLARE_REGISTRY"])
    b_hex = json.loads(flare(host, "registry", "show", "b", "--json").stdout)["digest"][7:]
    bad = {
        "refs/a/tags/latest": random.Random(7).randbytes(40),
        "refs/b/tags/payload": (payload_of(host, "b") + "\n").encode(),
        "refs/b/tags/BIG": f"blake3:{b_hex}\n".encode(),
        "refs/a/packages/not-a-digest": b"{}",
        f"refs/a/packages/{b_hex}": b"\xff\xfe not json",
        "refs/a/notes": b"hello",
        "refs/b/pins": b"",
        "refs/BAD..NAME": None,
        "refs/b/tags/folder": None,
    }
    for key, data in bad.items():
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data) if data is not None else path.mkdir()
    done = flare(host, "registry", "verify", "--json", check=False)
    assert done.returncode == BAD_REF, done.stderr
    report = json.loads(done.stdout)
    assert sorted(b["file"] for b in report["bad_refs"]) == sorted(bad)
    assert not report["ok"] and report["missing"] == [] and report["corrupt"] == []
    text = flare(host, "registry", "verify", check=False).stdout
    assert all(f"bad ref file {key}: " in text for key in bad) and "FAILED" in text


def test_a_tag_made_while_gc_forgets_keeps_its_package(tmp_path: Path, sources: Path) -> None:
    """gc read the refs when a0 was untagged; a0 is tagged again before gc forgets it: the
    record and the new tag stay, and the package is kept whole."""
    registry = Registry(str(tmp_path / "registry"), f"sqlite:///{tmp_path / 'index.db'}")
    a0 = build_into(registry, sources / "tiny-0", "a", tmp_path / "staging")
    build_into(registry, sources / "tiny-1", "a", tmp_path / "staging")
    found = gc.roots(registry, records=True)
    assert a0 not in found.packages
    registry.tag(f"a@{a0.hex}", "a:back")
    assert gc._forget_doomed(registry, found, old_before=float("inf")) == []
    assert registry.resolve("a:back") == ("a", a0)
    assert gc.collect(registry, grace_s=0).forgotten == []
    assert registry.verify().ok and registry.verify("a:back").ok
    registry.db.dispose()
