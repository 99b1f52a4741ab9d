"""Registry safety across processes: gc beside builds, copies and servers; killed gcs; several
"hosts" (processes) on one shared folder at once, on SQLite and on PostgreSQL."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from checkpoints import make_synthetic_llama
from registry_helpers import BACKENDS, age, flare, lab_env, start, stopped_at, tiny_sources

from flare.registry.registry import Registry

INDEX_UNUSABLE = 10


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tiny_sources(tmp_path_factory.mktemp("sources"), 4)
    make_synthetic_llama(root / "synthetic", 16 << 20)
    return root


@pytest.fixture(params=BACKENDS)
def lab(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, str]]:
    """The environment of a lab host: a shared registry folder and the index DB URL."""
    with lab_env(request.param, tmp_path) as env:
        yield env


def gc_until(env: dict[str, str], busy: subprocess.Popen[str]) -> int:
    """Collect garbage with no grace, again and again, while another process works."""
    rounds = 0
    while busy.poll() is None:
        done = flare(env, "registry", "gc", "--grace", "0", check=False)
        assert done.returncode == 0 or "no registry at" in done.stderr, done.stderr
        rounds += done.returncode == 0
    return rounds


def test_gc_while_a_build_writes_removes_nothing_it_needs(
    lab: dict[str, str], sources: Path
) -> None:
    build = start(
        lab,
        "build",
        str(sources / "synthetic"),
        "--name",
        "syn",
        "--ranks",
        "2",
        "--payload-size",
        "1M",
        "--json",
    )
    assert gc_until(lab, build) >= 1
    out, err = build.communicate()
    assert build.returncode == 0, err
    flare(lab, "registry", "verify", "syn")
    assert (
        json.loads(out)["digest"]
        == json.loads(flare(lab, "registry", "show", "syn", "--json").stdout)["digest"]
    )


def test_gc_while_a_copy_pulls_and_while_a_server_holds(
    lab: dict[str, str], sources: Path, tmp_path: Path
) -> None:
    origin = {
        **lab,
        "FLARE_REGISTRY": str(tmp_path / "origin"),
        "FLARE_DATABASE": f"sqlite:///{tmp_path / 'origin.db'}",
    }
    flare(origin, "build", str(sources / "synthetic"), "--name", "syn", "--payload-size", "1M")
    age(tmp_path / "origin" / "blobs", 3600)  # built an hour ago: linked blobs look that old
    copy = stopped_at(
        lab,
        "copy:publish",  # every blob linked or copied, the tag not written yet
        "registry",
        "copy",
        "syn",
        "--from",
        str(tmp_path / "origin"),
        "--to",
        lab["FLARE_REGISTRY"],
    )
    flare(lab, "registry", "gc", "--grace", "0")
    copy.send_signal(signal.SIGCONT)
    gc_until(lab, copy)
    assert copy.wait() == 0, copy.stderr.read() if copy.stderr else ""
    flare(lab, "registry", "verify", "syn")

    registry = Registry(lab["FLARE_REGISTRY"], lab["FLARE_DATABASE"])
    _, digest = registry.resolve("syn")
    from flare.registry.leases import hold_lease

    flare(lab, "registry", "rm", "syn")
    with hold_lease(registry.store, "serve", [digest]):
        flare(lab, "registry", "gc", "--grace", "0")
        assert registry.verify(f"blake3:{digest.hex}").ok
    registry.db.dispose()
    gone = json.loads(flare(lab, "registry", "gc", "--grace", "0", "--json").stdout)
    assert str(digest) in gone["deleted"]


def test_a_killed_gc_leaves_a_store_that_verifies(lab: dict[str, str], sources: Path) -> None:
    flare(lab, "build", str(sources / "tiny-0"), "--name", "kept")
    registry = Registry(lab["FLARE_REGISTRY"], lab["FLARE_DATABASE"])
    for i in range(3000):
        registry.store.put_bytes(f"garbage {i}".encode() * 100)
    registry.db.dispose()
    rng = random.Random(7)
    for _ in range(3):
        gc = start(lab, "registry", "gc", "--grace", "0")
        time.sleep(rng.uniform(0.3, 1.0))
        gc.send_signal(signal.SIGKILL)
        gc.wait()
        flare(lab, "store", "verify", "--store", lab["FLARE_REGISTRY"])
        flare(lab, "registry", "verify", "kept")
    flare(lab, "registry", "gc", "--grace", "0")
    assert (
        flare(lab, "store", "ls", "--json", "--store", lab["FLARE_REGISTRY"]).stdout.count(
            "blake3:"
        )
        == len(registry.manifest("kept")[2].blobs()) + 1
    )


def test_hosts_building_tagging_pinning_and_collecting_at_once(
    lab: dict[str, str], sources: Path
) -> None:
    script = (
        "set -e; F='{py} -m flare'; "
        "$F build {src} --name host{i} --tag v1 >/dev/null; "
        "$F registry tag host{i}:v1 host{i}:stable >/dev/null; "
        "$F registry pin host{i}:v1 >/dev/null; "
        "$F registry gc --grace 0 >/dev/null; "
        "$F registry ls --json >/dev/null"
    )
    hosts = [
        subprocess.Popen(
            ["sh", "-c", script.format(py=sys.executable, src=sources / f"tiny-{i}", i=i)],
            env=lab,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    errors = [host.communicate(timeout=300)[1] for host in hosts]
    assert [host.returncode for host in hosts] == [0] * 4, errors
    rows = json.loads(flare(lab, "registry", "ls", "--json").stdout)
    assert sorted((r["name"], tuple(r["tags"]), r["pinned"]) for r in rows) == [
        (f"host{i}", ("stable", "v1"), True) for i in range(4)
    ]
    flare(lab, "registry", "verify")
    flare(lab, "store", "verify", "--store", lab["FLARE_REGISTRY"])


def test_reindex_after_losing_or_corrupting_the_sqlite_index(tmp_path: Path, sources: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
    env["FLARE_BUILD_TARGET"] = "none"  # eager packages: tests/test_compiled.py compiles
    env |= {"FLARE_HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    flare(env, "build", str(sources / "tiny-0"), "--name", "alpha", "--tag", "v1")
    flare(env, "build", str(sources / "tiny-1"), "--name", "beta")
    flare(env, "registry", "pin", "beta")
    before = flare(env, "registry", "ls", "--json").stdout
    index = tmp_path / "home" / "registry" / "index.db"
    index.unlink()
    flare(env, "registry", "reindex")
    assert flare(env, "registry", "ls", "--json").stdout == before

    index.write_bytes(b"this is not a database" * 100)
    broken = flare(env, "registry", "ls", check=False)
    assert broken.returncode == INDEX_UNUSABLE
    assert "flare registry reindex" in broken.stderr and "Traceback" not in broken.stderr
    flare(env, "registry", "reindex")
    assert flare(env, "registry", "ls", "--json").stdout == before
    assert (index.parent / "index.db.corrupt").exists()


def test_hosts_publishing_the_same_package_at_once(lab: dict[str, str], sources: Path) -> None:
    hosts = [
        start(lab, "build", str(sources / "tiny-0"), "--name", "same", "--json") for _ in range(4)
    ]
    results = [host.communicate(timeout=300) for host in hosts]
    assert [host.returncode for host in hosts] == [0] * 4, [err for _, err in results]
    assert len({json.loads(out)["digest"] for out, _ in results}) == 1
    rows = json.loads(flare(lab, "registry", "ls", "--json").stdout)
    assert [(r["name"], r["tags"]) for r in rows] == [("same", ["latest"])]


OPEN_FRESH = """
import sys, time
from flare.registry.registry import Registry
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
registry = Registry(sys.argv[1], "sqlite:///" + sys.argv[1] + "/index.db")
print(len(registry.listings()))
"""


@pytest.mark.parametrize("round_", range(4))
def test_hosts_opening_a_new_sqlite_index_at_once(tmp_path: Path, round_: int) -> None:
    """The first open switches a new DB to WAL; hosts doing so together must all succeed."""
    at = str(time.time() + 2)  # all hosts open at the same instant, after their start-up
    hosts = [
        subprocess.Popen(
            [sys.executable, "-c", OPEN_FRESH, str(tmp_path / "shared"), at],
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(6)
    ]
    results = [host.communicate(timeout=120) for host in hosts]
    assert [host.returncode for host in hosts] == [0] * 6, [err for _, err in results]
    assert [out for out, _ in results] == ["0\n"] * 6
