"""A registry at a URL whose filesystem has real folders (fsspec's `local://`, as sftp:// and
smb:// are; and `file://`, which is the local path) takes a first build into nothing, and then
every command a lab runs: the store makes each folder it writes or moves a file into, where
object stores (memory://, s3://) have none and pay no request for it."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from helpers import CliHome
from registry_helpers import age, flare, tiny_source

from flare.store import BlobStore
from flare.store.backends.remote import FsspecBackend

CORRUPT = 6


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sources")
    tiny_source(root, 0)
    tiny_source(root, 1)
    return root


@pytest.mark.parametrize("scheme", ["local", "file"])
def test_a_url_registry_is_built_into_listed_verified_pulled_and_collected(
    tmp_path: Path, sources: Path, scheme: str
) -> None:
    folder = tmp_path / "registry"  # not there: the first build makes every folder it needs
    host = CliHome(tmp_path / "host", FLARE_REGISTRY=f"{scheme}://{folder}")
    host.run("key", "generate", "--publisher", "alice")
    first = host.run("build", str(sources / "tiny-0"), "--name", "one").stdout
    assert first.strip().splitlines()[-1].startswith("one@blake3:")
    host.run("build", str(sources / "tiny-1"), "--name", "two")
    assert (folder / "leases").is_dir() and (folder / "journal").is_dir()
    assert any((folder / "blobs" / "blake3").rglob("*"))

    listed = json.loads(host.run("registry", "ls", "--json").stdout)
    assert sorted(row["name"] for row in listed) == ["one", "two"]
    host.run("registry", "verify")
    host.run("store", "verify")
    host.run("verify", "one")

    pulled = host.run("pull", "one", "--json").stdout
    assert "one" in pulled
    assert any(path.is_file() for path in (tmp_path / "host" / "packages").rglob("*"))

    host.run("registry", "rm", "two")
    age(folder, 7200)  # past the grace, the lease and a shared registry's margin for clocks
    collected = host.run("registry", "gc", "--grace", "0s").stdout
    assert "freed 0 bytes" not in collected, collected
    host.run("registry", "verify")
    host.run("pull", "one")


def test_a_corrupt_blob_is_moved_into_a_quarantine_folder_made_for_it(
    tmp_path: Path, sources: Path
) -> None:
    folder = tmp_path / "registry"
    host = CliHome(tmp_path / "host", FLARE_REGISTRY=f"local://{folder}")
    host.run("build", str(sources / "tiny-0"), "--name", "one")
    blobs = [path for path in (folder / "blobs").rglob("*") if path.is_file()]
    blob = max(blobs, key=lambda path: path.stat().st_size)
    good = blob.read_bytes()
    blob.chmod(0o644)
    blob.write_bytes(b"not what was stored")
    assert not (folder / "quarantine").exists()

    checked = flare(host.env, "registry", "verify", check=False)
    assert checked.returncode == CORRUPT, checked.stderr
    [quarantined] = (folder / "quarantine").iterdir()
    assert quarantined.name.split(".")[0] == blob.name and not blob.exists()

    quarantined.write_bytes(good)  # repaired: --restore puts it back at its key
    host.run("registry", "verify", "--restore")
    assert blob.read_bytes() == good and not any((folder / "quarantine").iterdir())


def test_writes_to_a_local_url_make_their_folders(tmp_path: Path) -> None:
    backend = FsspecBackend(f"local://{tmp_path / 'store'}")
    backend.ensure()
    backend.write_atomic("refs/a/b/c.json", b"{}")
    assert (tmp_path / "store" / "refs" / "a" / "b" / "c.json").read_bytes() == b"{}"
    backend.write_atomic("refs/a/b/c.json", b"[]")
    assert backend.read("refs/a/b/c.json") == b"[]"
    assert backend.move_no_clobber("refs/a/b/c.json", "elsewhere/deep/c.json")
    assert backend.read("elsewhere/deep/c.json") == b"[]"

    store = BlobStore(f"local://{tmp_path / 'blobs'}")
    digest = store.put_bytes(b"hello").digest
    assert store.read_bytes(digest) == b"hello"


def test_an_object_store_pays_no_request_for_folders(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = FsspecBackend("memory://flare-url-writes/store")
    backend.ensure()
    made: list[str] = []
    monkeypatch.setattr(backend.fs, "makedirs", lambda path, exist_ok=False: made.append(path))
    backend.write_atomic("refs/a/b.json", b"{}")
    temp = backend.create_temp()
    temp.file.write(b"x")
    assert backend.commit(temp, "blobs/blake3/ab/abcd")
    backend.move("blobs/blake3/ab/abcd", "quarantine/abcd.1")
    assert made == []
    assert backend.read("refs/a/b.json") == b"{}"
    assert backend.read("quarantine/abcd.1") == b"x"


class _NoSuchPath(OSError):
    """An OSError subclass carrying ENOENT, as smbprotocol raises, not a FileNotFoundError."""


def test_a_missing_folder_is_recognised_by_its_errno(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = FsspecBackend(f"local://{tmp_path / 'store'}")
    backend.ensure()
    pipe_file = backend.fs.pipe_file

    def smb_like(path: str, data: bytes) -> None:
        try:
            pipe_file(path, data)
        except FileNotFoundError as exc:
            raise _NoSuchPath(errno.ENOENT, "no such path") from exc

    monkeypatch.setattr(backend.fs, "pipe_file", smb_like)
    backend.write_atomic("leases/x.json", b"{}")
    assert (tmp_path / "store" / "leases" / "x.json").read_bytes() == b"{}"
