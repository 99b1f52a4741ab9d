"""Registry faults found after issue 13's and 14's fixes, each made to happen every time: a full
disk under the index DB (exit 8, and nothing stuck once there is room), gc run between a copy's
hard links and its publish, gc paused between its last look at a garbage blob and its removal
while a writer reuses that blob, and verify of every package beside a corrupt package index."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import mount_tmpfs
from registry_helpers import (
    age,
    carry_on,
    flare,
    lab_env,
    stopped_at,
    tiny_sources,
    wait_stopped,
)
from sqlalchemy import create_engine, text

CORRUPT, NO_SPACE = 6, 8


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_sources(tmp_path_factory.mktemp("sources"), 2)


@pytest.fixture
def host(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A host whose registry is a local folder with its SQLite index beside it."""
    with lab_env("sqlite", tmp_path) as env:
        yield env


@pytest.fixture
def mounts(tmp_path: Path) -> Iterator[list[Path]]:
    """Small real filesystems mounted by the test (tmpfs), unmounted at its end."""
    mounted: list[Path] = []
    yield mounted
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


def small_fs(mounts: list[Path], path: Path, size: str = "16m") -> Path:
    mount_tmpfs(path, size)
    mounts.append(path)
    return path


def fill(folder: Path) -> Path:
    """Take every free byte of the filesystem holding `folder`: its next write meets ENOSPC."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)
    return filler


def whole(env: dict[str, str], ref: str | None = None) -> None:
    """`registry verify` passes: every blob of the package (or of every package) is there."""
    done = flare(env, "registry", "verify", "--json", *([ref] if ref else []), check=False)
    report = json.loads(done.stdout or "{}")
    assert done.returncode == 0 and report.get("ok"), (done.stdout, done.stderr)


def refused_for_space(done: subprocess.CompletedProcess[str], where: Path) -> None:
    """Exit 8, a one-line error that says the index DB's disk is full and where to free space."""
    assert done.returncode == NO_SPACE, done.stderr
    assert "internal error" not in done.stderr and "Traceback" not in done.stderr
    assert "index DB" in done.stderr and "disk is full" in done.stderr, done.stderr
    assert f"free space on the filesystem holding {where}" in done.stderr, done.stderr


# -- a full disk under the index DB ----------------------------------------------------------


def test_a_full_disk_while_a_new_index_db_is_created_is_exit_8_and_leaves_nothing_stuck(
    host: dict[str, str], sources: Path, tmp_path: Path, mounts: list[Path]
) -> None:
    disk = small_fs(mounts, tmp_path / "disk")
    env = host | {"FLARE_REGISTRY": str(disk / "registry"), "FLARE_DATABASE": ""}
    filler = fill(disk)
    refused_for_space(
        flare(env, "build", str(sources / "tiny-0"), "--name", "a", check=False), disk / "registry"
    )
    filler.unlink()
    flare(env, "build", str(sources / "tiny-0"), "--name", "a")
    assert [row["name"] for row in json.loads(flare(env, "registry", "ls", "--json").stdout)] == [
        "a"
    ]
    flare(env, "registry", "verify")


@pytest.fixture
def db_disk(host: dict[str, str], sources: Path, tmp_path: Path, mounts: list[Path]) -> Path:
    """An index DB on a small disk of its own (registry.database), made by a first build."""
    disk = small_fs(mounts, tmp_path / "db")
    host["FLARE_DATABASE"] = f"sqlite:///{disk / 'index.db'}"
    flare(host, "build", str(sources / "tiny-0"), "--name", "a")
    return disk


def build_b_when_there_is_room(env: dict[str, str], sources: Path, filler: Path) -> None:
    filler.unlink()
    again = json.loads(flare(env, "build", str(sources / "tiny-1"), "--name", "b", "--json").stdout)
    rows = json.loads(flare(env, "registry", "ls", "--json").stdout)
    assert sorted((r["name"], r["digest"]) for r in rows)[1] == ("b", again["digest"])
    flare(env, "registry", "verify")


def test_a_full_disk_while_sqlite_writes_a_publish_is_exit_8_and_the_build_runs_again(
    host: dict[str, str], sources: Path, db_disk: Path
) -> None:
    """The disk fills while another process holds the DB open (its WAL's shared memory made,
    its WAL emptied): the store takes the blobs, the WAL cannot take the publish's rows."""
    holder = sqlite3.connect(db_disk / "index.db")
    try:
        holder.execute("SELECT count(*) FROM packages").fetchone()
        holder.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        filler = fill(db_disk)
        built = flare(host, "build", str(sources / "tiny-1"), "--name", "b", check=False)
        refused_for_space(built, db_disk)
        assert "database or disk is full" in built.stderr and "phase publish" in built.stderr
    finally:
        holder.close()
    build_b_when_there_is_room(host, sources, filler)


def test_an_index_db_opened_on_a_full_disk_is_exit_8(
    host: dict[str, str], sources: Path, db_disk: Path
) -> None:
    """Opening a WAL DB makes its shared-memory file, which a full disk refuses (an I/O error
    in SQLite's words): reading commands and builds alike say the disk is full."""
    filler = fill(db_disk)
    refused_for_space(flare(host, "registry", "ls", check=False), db_disk)
    refused_for_space(
        flare(host, "build", str(sources / "tiny-1"), "--name", "b", check=False), db_disk
    )
    build_b_when_there_is_room(host, sources, filler)


def local_postgres_data(server: str) -> Path | None:
    """The data folder of the PostgreSQL server at `server`, if it runs on this host."""
    engine = create_engine(server)
    try:
        with engine.connect() as connection:
            folder = Path(connection.scalar(text("SHOW data_directory")))
    finally:
        engine.dispose()
    return folder if folder.is_dir() else None


@pytest.fixture
def postgres_on_a_small_disk(mounts: list[Path]) -> Iterator[tuple[str, Path]]:
    """A fresh PostgreSQL database whose tablespace is a small tmpfs of its own: its URL and
    the mount (in a folder of /tmp the server's user can reach, unlike pytest's)."""
    server = os.environ.get("FLARE_TEST_POSTGRES")
    if not server:
        pytest.skip("set FLARE_TEST_POSTGRES to a server URL to test the PostgreSQL backend")
    data = local_postgres_data(server)
    if data is None:
        pytest.skip("the PostgreSQL server is not on this host: its tablespace cannot be mounted")
    reachable = Path(tempfile.mkdtemp(prefix="flare-pg-"))
    reachable.chmod(0o711)
    disk = small_fs(mounts, reachable / "disk", "32m")
    owner = data.stat()
    os.chown(disk, owner.st_uid, owner.st_gid)
    name = f"flare_full_{os.getpid()}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f"CREATE TABLESPACE {name} LOCATION '{disk}'"))
        connection.execute(text(f"CREATE DATABASE {name} TABLESPACE {name}"))
    try:
        yield server.rsplit("/", 1)[0] + f"/{name}", disk
    finally:
        with admin.connect() as connection:
            connection.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            connection.execute(text(f"DROP TABLESPACE IF EXISTS {name}"))
        admin.dispose()
        subprocess.run(["umount", "-l", str(disk)], check=False)
        mounts.remove(disk)
        shutil.rmtree(reachable, ignore_errors=True)


def test_a_full_disk_on_the_postgresql_server_is_exit_8(
    host: dict[str, str], sources: Path, postgres_on_a_small_disk: tuple[str, Path]
) -> None:
    """SQLSTATE 53100 (disk_full): the server cannot extend a table for a publish's rows (the
    tables are made, empty, by `ls` on a new registry before the disk fills)."""
    url, disk = postgres_on_a_small_disk
    env = host | {"FLARE_DATABASE": url}
    (Path(env["FLARE_REGISTRY"]) / "refs").mkdir(parents=True)
    assert json.loads(flare(env, "registry", "ls", "--json").stdout) == []
    filler = fill(disk)
    built = flare(env, "build", str(sources / "tiny-0"), "--name", "a", check=False)
    assert built.returncode == NO_SPACE, built.stderr
    assert "disk is full" in built.stderr and "PostgreSQL server's disk" in built.stderr
    filler.unlink()
    flare(env, "build", str(sources / "tiny-0"), "--name", "a")
    assert len(json.loads(flare(env, "registry", "ls", "--json").stdout)) == 1
    flare(env, "registry", "verify")


# -- gc between a copy's links and its publish -----------------------------------------------


def test_gc_between_a_copys_hard_links_and_its_publish_keeps_what_it_linked(
    host: dict[str, str], sources: Path, tmp_path: Path
) -> None:
    """A copy on one filesystem hard-links each blob: the destination's blob is the source's
    inode, with the source's modification time. A package built a day ago, copied: gc with no
    grace runs after the links and before the tag (the copy stopped there), then the copy
    publishes. Every blob it linked must still be there."""
    origin = host | {
        "FLARE_REGISTRY": str(tmp_path / "origin"),
        "FLARE_DATABASE": f"sqlite:///{tmp_path / 'origin.db'}",
    }
    flare(origin, "build", str(sources / "tiny-0"), "--name", "a")
    age(tmp_path / "origin" / "blobs", 86400)
    args = (
        "registry",
        "copy",
        "a",
        "--from",
        origin["FLARE_REGISTRY"],
        "--to",
        host["FLARE_REGISTRY"],
        "--json",
    )
    copy = stopped_at(host, "copy:publish", *args)
    flare(host, "registry", "gc", "--grace", "0")
    report = json.loads(carry_on(copy))
    assert report["methods"].get("hardlink"), report  # this filesystem links (ext4, tmpfs, XFS)
    whole(host, "a")
    flare(host, "registry", "gc", "--grace", "0")
    whole(host, "a")


# -- gc beside a writer that reuses a garbage blob -------------------------------------------


@pytest.fixture
def garbage(host: dict[str, str], sources: Path) -> str:
    """Package a, built a day ago and removed: every blob of it is garbage gc may sweep. Its
    digest."""
    digest = json.loads(
        flare(host, "build", str(sources / "tiny-0"), "--name", "a", "--json").stdout
    )["digest"]
    flare(host, "registry", "rm", "a")
    age(Path(host["FLARE_REGISTRY"]) / "blobs", 86400)
    return digest


def other_host(env: dict[str, str], name: str) -> dict[str, str]:
    """Another process on the same registry and index DB, with a staging area of its own (so
    its build stores every payload again rather than reuse a journal's record)."""
    return env | {"FLARE_HOME": str(Path(env["FLARE_HOME"]).parent / name)}


def test_a_garbage_blob_a_build_reuses_while_gc_is_about_to_remove_it_stays(
    host: dict[str, str], sources: Path, garbage: str
) -> None:
    """gc's last look finds blob X old and unreached; before it removes X (it stopped there),
    a build of the same package finds X stored, touches it, publishes, checks its package
    whole and ends. Then gc goes on. X must stay: the package is tagged."""
    gc = stopped_at(host, "gc:doomed", "registry", "gc", "--grace", "0", "--json")
    writer = other_host(host, "writer")
    built = json.loads(
        flare(writer, "build", str(sources / "tiny-0"), "--name", "a", "--json").stdout
    )
    assert built["digest"] == garbage
    report = json.loads(carry_on(gc))
    whole(host, "a")
    assert len(report["put_back"]) == 1 and report["deleted"] == [], report
    flare(host, "registry", "gc", "--grace", "0")
    whole(host, "a")


def test_a_build_puts_back_a_blob_gc_moved_to_its_trash_after_the_build_found_it(
    host: dict[str, str], sources: Path, garbage: str
) -> None:
    """As above, but the build's last check comes after gc moved X to its trash and before gc
    empties the trash (each stopped there in turn): the build finds X gone, puts it back from
    the trash and succeeds; the package is whole."""
    points = "gc:doomed,gc:empty"
    gc = stopped_at(host, points, "registry", "gc", "--grace", "0", "--json")
    writer = other_host(host, "writer")
    build = stopped_at(writer, "publish:check", "build", str(sources / "tiny-0"), "--name", "a")
    gc.send_signal(signal.SIGCONT)
    wait_stopped(gc, "gc:empty")
    assert len(list((Path(host["FLARE_REGISTRY"]) / "trash").rglob("*.*.*"))) == 1
    carry_on(build)
    assert not list((Path(host["FLARE_REGISTRY"]) / "trash").rglob("*.*.*"))
    carry_on(gc)
    whole(host, "a")


def test_a_garbage_blob_stored_again_while_gc_is_about_to_remove_it_stays(
    host: dict[str, str], sources: Path, tmp_path: Path
) -> None:
    """The bare race, with no lease or tag to help: gc's last look finds blob X old and
    unreached; before it removes X, `flare store put` of the same bytes finds X stored (it
    touches X, writes nothing and says `existing`). X must stay: the writer relies on it."""
    flare(host, "build", str(sources / "tiny-0"), "--name", "a")  # a registry with a root
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(1 << 16))
    put = ("store", "put", str(data), "--no-link", "--json")
    digest = json.loads(flare(host, *put).stdout)[0]["digest"]
    age(Path(host["FLARE_REGISTRY"]) / "blobs", 86400)
    gc = stopped_at(host, "gc:doomed", "registry", "gc", "--grace", "0", "--json")
    assert json.loads(flare(host, *put).stdout)[0]["method"] == "existing"
    report = json.loads(carry_on(gc))
    assert flare(host, "store", "verify", digest, check=False).returncode == 0, report
    assert report["put_back"] == [digest] and report["deleted"] == [], report


# -- verify of every package beside a corrupt package index ----------------------------------


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    path.chmod(0o444)


def blob_path(env: dict[str, str], digest: str) -> Path:
    hex_digest = digest.removeprefix("blake3:")
    return Path(env["FLARE_REGISTRY"]) / "blobs" / "blake3" / hex_digest[:2] / hex_digest


def test_verify_of_every_package_reports_a_corrupt_index_and_checks_the_others(
    host: dict[str, str], sources: Path
) -> None:
    """Package a's index and a payload of package b flipped: `registry verify` (no REF) names
    both, quarantines both, prints its JSON report and exits 6; it does not stop at a's index."""
    built = {
        name: json.loads(
            flare(host, "build", str(sources / f"tiny-{i}"), "--name", name, "--json").stdout
        )
        for i, name in enumerate("ab")
    }
    index = built["a"]["digest"]
    shown = json.loads(flare(host, "registry", "show", "b", "--json").stdout)
    payload = shown["manifest"]["payloads"][0]["digest"]
    for digest in (index, payload):
        flip_a_byte(blob_path(host, digest))
    done = flare(host, "registry", "verify", "--json", check=False)
    assert done.returncode == CORRUPT and done.stdout.strip(), f"no report: {done.stderr}"
    report = json.loads(done.stdout)
    assert sorted(report["corrupt"]) == sorted([index, payload]), report
    assert len(report["quarantined"]) == 2 and report["missing"] == [], report
    assert not blob_path(host, index).exists() and not blob_path(host, payload).exists()
