"""Registry faults found after issue 13's and 14's fixes, each made to happen every time: a full
disk under the index DB (exit 8, and nothing stuck once there is room), gc run between a copy's
hard links and its publish, gc paused between its last look at a garbage blob and its removal
while a writer reuses that blob, and verify of every package beside a corrupt package index."""

from __future__ import annotations

import errno
import json
import os
import shutil
import sqlite3
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import mount_tmpfs
from registry_helpers import age, carry_on, flare, lab_env, stopped_at, tiny_sources
from sqlalchemy import create_engine, text

NOT_FOUND, CORRUPT, NO_SPACE = 3, 6, 8


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
    flare(host, "registry", "verify", "a")
    flare(host, "registry", "gc", "--grace", "0")
    flare(host, "registry", "verify", "a")
