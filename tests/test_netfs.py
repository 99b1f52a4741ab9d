"""A registry shared over a real network filesystem: one folder exported by an sshd on
loopback and mounted twice with sshfs, the mounts standing for two hosts of a lab.

Several processes per mount build, tag and pull at once; every build succeeds, both hosts list
every package, verify quarantines nothing, and the bytes on the server all hash right. A gc on
one host while the other builds and pulls removes nothing a package needs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from checkpoints import make_llama
from netfs import NetworkShare, missing_tools, network_share

from flare.store.hashing import hash_file

DCACHE_S = 2
"""sshfs's directory and attribute cache, shortened from its default 20 s so the test can wait
it out; the hosts' flare is told one second more (FLARE_CACHE_WINDOW), as its defaults are."""
WORKERS_PER_HOST = 2


class Host:
    """One host: its own FLARE_HOME (host-local index and package cache) and its mount."""

    def __init__(self, home: Path, mount: Path) -> None:
        self.home = home
        self.registry = mount / "registry"
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
        self.env = env | {
            "FLARE_HOME": str(home),
            "XDG_CONFIG_HOME": str(home / "xdg"),
            "FLARE_REGISTRY": str(self.registry),
            # as flare's own defaults: the client's cache, and a second for the kernel's
            "FLARE_CACHE_WINDOW": f"{DCACHE_S + 1}s",
            "FLARE_BUILD_TARGET": "none",  # eager packages: tests/test_compiled.py compiles
        }

    def run(
        self, *args: str, check: bool = True, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, "-m", "flare", *args],
            env=self.env | (env or {}),
            capture_output=True,
            text=True,
            timeout=600,
        )
        if check:
            assert done.returncode == 0, (args, done.stdout, done.stderr)
        return done

    def json(self, *args: str) -> object:
        return json.loads(self.run(*args, "--json").stdout)

    def listed(self) -> set[str]:
        return {f"{r['name']}:{t}" for r in self.json("registry", "ls") for t in r["tags"]}


@pytest.fixture(scope="module")
def share(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetworkShare]:
    """One export, mounted twice with sshfs (its caches shortened to DCACHE_S)."""
    why = missing_tools()
    if why is not None:
        pytest.skip(f"no sshfs share: {why}")
    root = tmp_path_factory.mktemp("netfs")
    timeouts = f"dcache_timeout={DCACHE_S},entry_timeout={DCACHE_S},attr_timeout={DCACHE_S}"
    with network_share(root, 2, timeouts) as made:
        yield made


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("checkpoints")
    for seed in range(3):
        make_llama(root / f"ckpt-{seed}", seed=seed)
    return root


@pytest.fixture
def hosts(share: NetworkShare, tmp_path: Path) -> list[Host]:
    """Two hosts on a fresh registry folder, each with a key the other trusts."""
    for mount in share.mounts:
        assert (mount / ".").is_dir()
    folder = f"run-{tmp_path.name}"
    (share.export / folder).mkdir()
    made = []
    for index, mount in enumerate(share.mounts):
        made.append(Host(tmp_path / f"host{index}", mount / folder))
    keys = []
    for index, host in enumerate(made):
        key = host.json("key", "generate", "--publisher", f"lab{index}")
        public = host.home / f"lab{index}.pub"
        public.write_text(key["public_key"])
        keys.append(public)
    for index, host in enumerate(made):
        other = 1 - index
        host.run("trust", "add", f"lab{other}", "--key", str(keys[other]))
    return made


def build_tag_pull(host: Host, worker: str, seed: int, checkpoints: Path) -> list[str]:
    """What one process of the experiment does: two builds (one of a checkpoint every worker
    builds too), a tag, and a pull of each."""
    made = []
    for source, name in ((f"ckpt-{seed}", f"{worker}-own"), ("ckpt-2", f"{worker}-shared")):
        host.run("build", str(checkpoints / source), "--name", name)
        host.run("registry", "tag", f"{name}:latest", f"{name}:v1")
        host.run("pull", f"{name}:v1", "--device", "cpu")
        made += [f"{name}:latest", f"{name}:v1"]
    return made


def wait_until_listed(host: Host, expected: set[str]) -> set[str]:
    """Another host's writes reach this one's listings once its client's cache expires."""
    deadline = time.monotonic() + 10 * DCACHE_S + 30
    while True:
        listed = host.listed()
        if expected <= listed or time.monotonic() > deadline:
            return listed
        time.sleep(DCACHE_S / 2)


def server_side_blobs(share: NetworkShare, host: Host) -> list[Path]:
    folder = share.export / host.registry.parent.name / "registry" / "blobs"
    return [p for p in folder.rglob("*") if p.is_file()]


def test_two_hosts_build_tag_and_pull_into_one_registry_at_once(
    share: NetworkShare, hosts: list[Host], checkpoints: Path
) -> None:
    jobs = [
        (host, f"h{index}w{worker}", worker % 2)
        for index, host in enumerate(hosts)
        for worker in range(WORKERS_PER_HOST)
    ]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: build_tag_pull(*job, checkpoints), jobs))
    expected = {ref for made in results for ref in made}
    for host in hosts:
        assert wait_until_listed(host, expected) == expected
    for host in hosts:
        report = host.json("registry", "verify")
        assert report["ok"] and report["quarantined"] == [] and report["corrupt"] == []
    server = share.export / hosts[0].registry.parent.name / "registry"
    assert not (server / "index.db").exists()  # each host keeps its own index
    quarantine = server / "quarantine"
    assert not quarantine.exists() or list(quarantine.iterdir()) == []
    blobs = server_side_blobs(share, hosts[0])
    assert len(blobs) > 10
    for path in blobs:
        assert hash_file(path)[0].hex == path.name, path


def test_a_registry_on_sshfs_keeps_its_index_on_each_host(share: NetworkShare) -> None:
    from flare.registry.registry import default_database

    registry = share.mounts[0] / "any-registry"
    database = default_database(str(registry), Path("/home/me/.flare"))
    assert database.startswith("sqlite:////home/me/.flare/indexes/")
    assert str(share.mounts[0]) not in database


def test_changes_on_one_host_reach_the_other_through_the_journal_only(
    share: NetworkShare, hosts: list[Host], checkpoints: Path
) -> None:
    """Host 1 indexes host 0's tag, pin and removal from journal entries; a ref file changed
    behind flare's back (no entry) stays unseen until `reindex`: opening the registry does not
    read every ref again."""
    first, second = hosts
    first.run("build", str(checkpoints / "ckpt-0"), "--name", "alpha")
    first.run("build", str(checkpoints / "ckpt-1"), "--name", "beta")
    assert wait_until_listed(second, {"alpha:latest", "beta:latest"}) == {
        "alpha:latest",
        "beta:latest",
    }
    first.run("registry", "tag", "alpha", "alpha:prod")
    first.run("registry", "pin", "alpha:prod")
    first.run("registry", "rm", "beta")
    assert wait_until_listed(second, {"alpha:prod"}) == {"alpha:latest", "alpha:prod"}
    rows = second.json("registry", "ls")
    assert [r["pinned"] for r in rows] == [True]

    time.sleep(DCACHE_S + 1)
    second.listed()  # applies every entry the second time: all settled
    server = share.export / first.registry.parent.name / "registry"
    (server / "refs" / "alpha" / "tags" / "sneaked").write_text(rows[0]["digest"] + "\n")
    time.sleep(DCACHE_S + 1)
    assert "alpha:sneaked" not in second.listed()
    second.run("registry", "reindex")
    assert "alpha:sneaked" in second.listed()


def test_an_old_shared_index_db_is_ignored_and_said_so_once(
    share: NetworkShare, hosts: list[Host], checkpoints: Path
) -> None:
    first, second = hosts
    first.run("build", str(checkpoints / "ckpt-0"), "--name", "alpha")
    (first.registry / "index.db").write_bytes(b"SQLite format 3\x00 of an older flare")
    time.sleep(DCACHE_S + 1)
    said = second.run("registry", "ls")
    assert said.stderr.count("no longer used") == 1 and "alpha" in said.stdout
    assert "no longer used" not in second.run("registry", "ls").stderr


def test_a_sqlite_index_inside_a_shared_registry_is_refused(
    hosts: list[Host], checkpoints: Path
) -> None:
    host = hosts[0]
    host.run("build", str(checkpoints / "ckpt-0"), "--name", "alpha")
    shared = f"sqlite:///{host.registry / 'index.db'}"
    refused = host.run("registry", "ls", check=False, env={"FLARE_DATABASE": shared})
    assert refused.returncode == 4, refused.stderr
    assert "network filesystem (fuse.sshfs)" in refused.stderr
    assert "PostgreSQL" in refused.stderr


def gc_until_done(host: Host, busy: list[bool]) -> int:
    """`gc --grace 0` again and again on one host while the other works."""
    rounds = 0
    while busy[0]:
        host.run("registry", "gc", "--grace", "0")
        rounds += 1
    return rounds


def age(paths: list[Path], seconds: float) -> None:
    """Set modification times back, on the server, as if the files were written long ago."""
    then = time.time() - seconds
    for path in paths:
        os.utime(path, (then, then))


def test_gc_on_one_host_while_the_other_builds_and_pulls_removes_nothing_needed(
    share: NetworkShare, hosts: list[Host], checkpoints: Path
) -> None:
    worker, collector = hosts
    worker.run("build", str(checkpoints / "ckpt-0"), "--name", "old")
    worker.run("registry", "rm", "old")  # garbage now, sharing every payload with "again"
    busy = [True]
    with ThreadPoolExecutor(1) as pool:
        rounds = pool.submit(gc_until_done, collector, busy)
        try:
            for source, name in (("ckpt-0", "again"), ("ckpt-1", "fresh")):
                worker.run("build", str(checkpoints / source), "--name", name)
                worker.run("pull", name, "--device", "cpu")
        finally:
            busy[0] = False
        assert rounds.result() >= 1
    for host in hosts:
        assert wait_until_listed(host, {"again:latest", "fresh:latest"}) >= {"again:latest"}
        report = host.json("registry", "verify")
        assert report["ok"] and report["missing"] == [] and report["quarantined"] == []


def test_gc_on_a_shared_registry_waits_out_caches_and_clocks_before_it_deletes(
    share: NetworkShare, hosts: list[Host], checkpoints: Path
) -> None:
    """--grace 0 on a network filesystem still keeps what was written less than a cache
    window plus the clock skew ago (another host's lease or touch may not show yet)."""
    from flare.registry.registry import CLOCK_SKEW_S

    writer, collector = hosts
    digest = writer.json("build", str(checkpoints / "ckpt-0"), "--name", "gone")["digest"]
    writer.run("registry", "rm", "gone")
    server = share.export / writer.registry.parent.name / "registry"
    index = server / "blobs" / "blake3" / digest[7:9] / digest[7:]
    time.sleep(DCACHE_S + 1)
    kept = collector.json("registry", "gc", "--grace", "0")
    assert digest not in kept["deleted"] and index.exists()
    age([p for p in (server / "blobs").rglob("*") if p.is_file()], CLOCK_SKEW_S + DCACHE_S + 5)
    time.sleep(DCACHE_S + 1)
    swept = collector.json("registry", "gc", "--grace", "0")
    assert digest in swept["deleted"] and not index.exists()
    # in the trash for a window (a touch through a stale view may still land on it), which a
    # later gc deletes once that long has passed: moved there as if that long ago
    trashed = [p for p in (server / "trash").rglob("*.*.*") if p.is_file()]
    assert any(p.name.startswith(f"{digest[7:]}.") for p in trashed)
    assert swept["in_trash"] == sum(p.stat().st_size for p in trashed) > 0
    window = CLOCK_SKEW_S + 2 * DCACHE_S
    for path in trashed:
        name, moved, seen = path.name.split(".")
        path.rename(path.with_name(f"{name}.{int(moved) - int((window + 5) * 1e9)}.{seen}"))
    time.sleep(DCACHE_S + 1)
    emptied = collector.json("registry", "gc", "--grace", "0")
    assert emptied["in_trash"] == 0 and emptied["put_back"] == []
    assert not list((server / "trash").rglob("*.*.*"))


HOLD_LEASE = """
import sys
from flare.registry.leases import hold_lease
from flare.store import BlobStore, Digest
store = BlobStore(sys.argv[1])
with hold_lease(store, "serve", [Digest.parse(sys.argv[2])]):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_a_lease_from_a_host_whose_clock_is_behind_still_protects_its_package(
    share: NetworkShare, hosts: list[Host], checkpoints: Path
) -> None:
    """A serving host whose clock is 150 s behind writes lease expiries that the collecting
    host's clock already finds past: gc allows for the clock skew."""
    faketime = shutil.which("faketime")
    if faketime is None:
        pytest.skip("faketime is not installed (Debian package faketime)")
    from flare.registry.registry import CLOCK_SKEW_S

    server_host, collector = hosts
    digest = server_host.json("build", str(checkpoints / "ckpt-1"), "--name", "served")["digest"]
    server_host.run("registry", "rm", "served")
    server = share.export / server_host.registry.parent.name / "registry"
    age([p for p in (server / "blobs").rglob("*") if p.is_file()], CLOCK_SKEW_S + DCACHE_S + 5)
    behind = f"-{int(CLOCK_SKEW_S) + 30}s"
    command = [faketime, "-f", behind, sys.executable, "-c", HOLD_LEASE]
    holder = subprocess.Popen(
        [*command, str(server_host.registry), digest],
        env=server_host.env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        time.sleep(DCACHE_S + 1)
        kept = collector.json("registry", "gc", "--grace", "0")
        assert digest not in kept["deleted"]
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)
    time.sleep(DCACHE_S + 1)
    assert digest in collector.json("registry", "gc", "--grace", "0")["deleted"]


def test_verify_through_sshfs_moves_a_blob_only_when_the_server_holds_bad_bytes(
    share: NetworkShare, tmp_path: Path
) -> None:
    """On the real mount: a first read cut short (a stale client view) moves nothing; bytes
    damaged on the server are quarantined after the confirming reads, and --restore brings a
    repaired copy back."""
    from test_netfs_verify import StaleReads

    from flare.store import BlobStore
    from flare.store.layout import blob_key

    folder = share.mounts[0] / f"store-{tmp_path.name}"
    store = BlobStore(folder)
    assert store.backend.network
    good = store.put_bytes(b"good " * 100_000).digest
    bad = store.put_bytes(b"bad " * 100_000).digest
    store.backend = StaleReads(folder, stale=1, network=True)
    stale = store.verify(confirm_after_s=0.1)
    assert stale.ok and sorted(stale.reread) == sorted([good, bad]) and stale.quarantined == []

    on_server = share.export / folder.name / blob_key(bad, store.encoding)
    original = on_server.read_bytes()
    on_server.chmod(0o644)
    on_server.write_bytes(b"x" + original[1:])
    time.sleep(DCACHE_S + 1)
    store.backend = StaleReads(folder, stale=0, network=True)
    damaged = store.verify(confirm_after_s=0.1)
    assert damaged.corrupt == [bad] and len(damaged.quarantined) == 1
    (share.export / folder.name / damaged.quarantined[0]).write_bytes(original)
    restored = store.verify(restore=True, confirm_after_s=0.1)
    assert restored.restored == damaged.quarantined and restored.ok and store.has(bad)
