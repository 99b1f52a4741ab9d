"""The SQLite index DB when it is damaged or cannot be written: a DB whose pages are damaged
(its header whole, so it still opens) is reported by verify and moved aside by reindex; a
registry on a read-only filesystem still lists and verifies, and a command that must write to
it says so (exit 7), never "check that the server is up"."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import mount_tmpfs
from registry_helpers import flare, tiny_sources

from flare.registry.database import IndexDB, set_aside

INDEX_UNUSABLE, DENIED = 10, 7
PAGE = 4096


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_sources(tmp_path_factory.mktemp("sources"), 2)


def host_env(home: Path) -> dict[str, str]:
    """A host with its own FLARE_HOME and configuration, no FLARE_ settings inherited."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
    return env | {"FLARE_HOME": str(home / "home"), "XDG_CONFIG_HOME": str(home / "xdg")}


def build(env: dict[str, str], source: Path, name: str, registry: Path) -> None:
    """Publish a tiny package into the registry."""
    args = ("--target", "none", "--no-sign", "--registry", str(registry))
    flare(env, "build", str(source), "--name", name, *args)


def damage_pages(index: Path) -> bytes:
    """Flip bytes all over the DB past its first page (SQLite's header stays whole, so the DB
    still opens); returns the damaged bytes."""
    data = bytearray(index.read_bytes())
    for offset in range(PAGE, len(data), 997):
        data[offset] ^= 0xFF
    index.write_bytes(bytes(data))
    return bytes(data)


def one_line_error(done: subprocess.CompletedProcess[str], code: int, *words: str) -> None:
    """The command failed with `code` and one error line holding every word, no traceback."""
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, done.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_reindex_moves_a_damaged_sqlite_index_aside_and_rebuilds_it(
    tmp_path: Path, sources: Path
) -> None:
    env, registry = host_env(tmp_path), tmp_path / "R"
    build(env, sources / "tiny-0", "base", registry)
    at = ("--registry", str(registry))
    before = json.loads(flare(env, "registry", "ls", "--json", *at).stdout)
    index = registry / "index.db"
    damaged = damage_pages(index)

    listing = flare(env, "registry", "ls", *at, check=False)
    one_line_error(listing, INDEX_UNUSABLE, str(index), "flare registry reindex")

    checked = flare(env, "registry", "verify", *at, check=False)
    assert checked.returncode == INDEX_UNUSABLE, checked.stderr
    assert f"the index DB {index} is damaged" in checked.stdout
    assert checked.stdout.rstrip().endswith("FAILED") and "Traceback" not in checked.stderr
    as_json = flare(env, "registry", "verify", "--json", *at, check=False)
    report = json.loads(as_json.stdout)
    assert as_json.returncode == INDEX_UNUSABLE and not report["ok"]
    assert "flare registry reindex" in report["index_db"]

    rebuilt = flare(env, "registry", "reindex", *at)
    assert f"moved the unreadable index DB to {index}.corrupt" in rebuilt.stderr
    assert (registry / "index.db.corrupt").read_bytes() == damaged  # kept as it was
    assert json.loads(flare(env, "registry", "ls", "--json", *at).stdout) == before
    after = json.loads(flare(env, "registry", "verify", "--json", *at).stdout)
    assert after["ok"] and after["index_db"] is None


def test_a_second_damaged_index_does_not_replace_the_first_one_kept(
    tmp_path: Path, sources: Path
) -> None:
    env, registry = host_env(tmp_path), tmp_path / "R"
    build(env, sources / "tiny-0", "base", registry)
    at = ("--registry", str(registry))
    first = damage_pages(registry / "index.db")
    flare(env, "registry", "reindex", *at)
    second = damage_pages(registry / "index.db")
    flare(env, "registry", "reindex", *at)
    assert (registry / "index.db.corrupt").read_bytes() == first
    assert (registry / "index.db.corrupt.1").read_bytes() == second
    assert [r["name"] for r in json.loads(flare(env, "registry", "ls", "--json", *at).stdout)] == [
        "base"
    ]


def test_set_aside_moves_the_wal_with_its_db(tmp_path: Path) -> None:
    """A WAL left beside the new DB would be replayed into it: it goes with the old one."""
    index = tmp_path / "index.db"
    for suffix, data in (("", b"db"), ("-wal", b"wal"), ("-shm", b"shm")):
        Path(f"{index}{suffix}").write_bytes(data)
    moved = set_aside(index)
    assert moved == tmp_path / "index.db.corrupt"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "index.db.corrupt",
        "index.db.corrupt-shm",
        "index.db.corrupt-wal",
    ]
    assert Path(f"{moved}-wal").read_bytes() == b"wal"


def test_quick_check_passes_a_whole_db_and_finds_damaged_pages(
    tmp_path: Path, sources: Path
) -> None:
    env, registry = host_env(tmp_path), tmp_path / "R"
    build(env, sources / "tiny-0", "base", registry)
    url = f"sqlite:///{registry / 'index.db'}"
    whole = IndexDB(url)
    assert whole.check() is None
    whole.dispose()
    damage_pages(registry / "index.db")
    damaged = IndexDB(url)
    assert damaged.check() is not None
    damaged.dispose()


@pytest.fixture
def read_only_registry(tmp_path: Path, sources: Path) -> Iterator[tuple[dict[str, str], Path]]:
    """A registry holding `base` (tagged) and an untagged package, on a filesystem remounted
    read-only: a real one, as a lab's NFS export mounted `ro`, which stops root too."""
    mount = tmp_path / "ro"
    mount_tmpfs(mount, "64m")
    try:
        env, registry = host_env(tmp_path), mount / "R"
        build(env, sources / "tiny-0", "base", registry)
        build(env, sources / "tiny-1", "gone", registry)
        flare(env, "registry", "untag", "gone:latest", "--registry", str(registry))
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        yield env, registry
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_read_only_registry_lists_shows_and_verifies(
    read_only_registry: tuple[dict[str, str], Path],
) -> None:
    env, registry = read_only_registry
    at = ("--registry", str(registry))
    rows = json.loads(flare(env, "registry", "ls", "--json", *at).stdout)
    assert sorted(row["name"] for row in rows) == ["base", "gone"]
    flare(env, "registry", "show", "base", *at)
    assert json.loads(flare(env, "registry", "verify", "--json", *at).stdout)["ok"]


@pytest.mark.parametrize(
    "command",
    [
        ("registry", "reindex"),
        ("registry", "pin", "base"),
        ("registry", "tag", "base", "base:v2"),
        ("registry", "gc", "--grace", "0"),
    ],
)
def test_writing_to_a_read_only_registry_is_exit_7(
    read_only_registry: tuple[dict[str, str], Path], command: tuple[str, ...]
) -> None:
    env, registry = read_only_registry
    done = flare(env, *command, "--registry", str(registry), check=False)
    one_line_error(done, DENIED, str(registry), "ead-only file system")
    assert "server is up" not in done.stderr


def test_building_into_a_read_only_registry_is_exit_7(
    read_only_registry: tuple[dict[str, str], Path], sources: Path
) -> None:
    env, registry = read_only_registry
    args = ("--target", "none", "--no-sign", "--registry", str(registry))
    done = flare(env, "build", str(sources / "tiny-1"), "--name", "new", *args, check=False)
    one_line_error(done, DENIED, str(registry), "ead-only file system")


def test_an_unwritable_registry_folder_is_exit_7_for_a_user(tmp_path: Path, sources: Path) -> None:
    """The same without a read-only mount: a folder this user may not write (root may)."""
    if os.geteuid() == 0:
        pytest.skip("root writes any folder whatever its mode; the read-only mount tests cover it")
    env, registry = host_env(tmp_path), tmp_path / "R"
    build(env, sources / "tiny-0", "base", registry)
    at = ("--registry", str(registry))
    registry.chmod(0o555)
    try:
        assert json.loads(flare(env, "registry", "ls", "--json", *at).stdout)[0]["name"] == "base"
        done = flare(env, "registry", "reindex", *at, check=False)
        one_line_error(done, DENIED, str(registry), "not writable by this user")
    finally:
        registry.chmod(0o755)
