"""verify is sure before it moves anything: a bad read is read again past the client's caches
(and, on a network filesystem, once more after a pause) before a blob counts as corrupt;
--dry-run moves nothing; --restore puts back quarantined blobs that hash right."""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path
from typing import BinaryIO

import pytest
from conftest import RunFlare

from flare.store import BlobStore, Digest, Encoding
from flare.store.backends.direct import open_uncached
from flare.store.backends.local import LocalBackend
from flare.store.layout import QUARANTINE_DIR, blob_key

CORRUPT_EXIT = 6


class StaleReads(LocalBackend):
    """The real folder, but the first `stale` reads of each blob return the bytes a client
    with a stale cache would: the file cut short, as when its size was read before the
    writer's last write reached this host. Later reads see the bytes as stored."""

    def __init__(self, root: Path, stale: int, network: bool) -> None:
        super().__init__(root)
        self.stale = stale
        self.reads: Counter[str] = Counter()
        self.__dict__["network"] = network  # what on_network_filesystem would find

    def open_read(self, key: str) -> BinaryIO:
        return self._maybe_stale(key, super().open_read(key))

    def open_uncached(self, key: str) -> BinaryIO:
        return self._maybe_stale(key, super().open_uncached(key))

    def _maybe_stale(self, key: str, handle: BinaryIO) -> BinaryIO:
        if not key.startswith("blobs/"):
            return handle
        self.reads[key] += 1
        if self.reads[key] > self.stale:
            return handle
        with handle:
            data = handle.read()
        return io.BytesIO(data[: len(data) // 2])


def stale_store(
    root: Path, stale: int, network: bool = False, encoding: Encoding = Encoding.PLAIN
) -> BlobStore:
    store = BlobStore(root, encoding)
    store.backend = StaleReads(Path(store.location), stale, network)
    return store


def damage(store: BlobStore, digest: Digest, encoding: Encoding = Encoding.PLAIN) -> bytes:
    """Flip one stored byte, as a bad disk would; return the original bytes."""
    path = Path(store.location, blob_key(digest, encoding))
    original = path.read_bytes()
    path.chmod(0o644)
    path.write_bytes(original[:10] + bytes([original[10] ^ 0xFF]) + original[11:])
    return original


def quarantined(store: BlobStore) -> list[Path]:
    return sorted(Path(store.location, QUARANTINE_DIR).glob("*"))


def test_a_stale_first_read_of_a_zstd_blob_quarantines_nothing(tmp_path: Path) -> None:
    """A zstd blob is read through the backend's reader in every version of verify: a stale
    first read used to be enough to move a good blob to quarantine."""
    store = stale_store(tmp_path / "store", stale=1, encoding=Encoding.ZSTD)
    digest = store.put_bytes(b"weights " * 50_000).digest
    report = store.verify()
    assert report.corrupt == [] and report.ok
    assert quarantined(store) == [] and store.has(digest)
    assert report.reread == [digest]


def test_a_stale_first_read_on_a_network_filesystem_quarantines_nothing(tmp_path: Path) -> None:
    store = stale_store(tmp_path / "store", stale=1, network=True)
    digest = store.put_bytes(b"payload " * 50_000).digest
    report = store.verify(confirm_after_s=0.05)
    assert report.ok and report.reread == [digest] and quarantined(store) == []


def test_on_a_network_filesystem_a_second_bad_read_is_confirmed_later(tmp_path: Path) -> None:
    """The uncached re-read can still be stale through a network client: the blob counts as
    corrupt only if a read after the pause agrees."""
    store = stale_store(tmp_path / "store", stale=2, network=True)
    digest = store.put_bytes(b"payload " * 50_000).digest
    report = store.verify(confirm_after_s=0.05)
    assert report.ok and report.reread == [digest] and quarantined(store) == []
    assert store.backend.reads[blob_key(digest, Encoding.PLAIN)] == 3


def test_on_a_local_disk_an_uncached_read_that_agrees_is_enough(tmp_path: Path) -> None:
    store = stale_store(tmp_path / "store", stale=2, network=False, encoding=Encoding.ZSTD)
    digest = store.put_bytes(b"payload " * 50_000).digest
    report = store.verify()
    assert report.corrupt == [digest] and len(quarantined(store)) == 1


@pytest.mark.parametrize("network", [False, True])
def test_real_corruption_is_still_quarantined(tmp_path: Path, network: bool) -> None:
    store = stale_store(tmp_path / "store", stale=0, network=network)
    good = store.put_bytes(b"good " * 10_000).digest
    bad = store.put_bytes(b"bad " * 10_000).digest
    damage(store, bad)
    report = store.verify(confirm_after_s=0.05)
    assert report.corrupt == [bad] and report.reread == [] and not report.ok
    assert [p.name.split(".")[0] for p in quarantined(store)] == [bad.hex]
    assert store.has(good) and not store.has(bad)


def test_dry_run_reports_and_moves_nothing(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "store")
    bad = store.put_bytes(b"bad " * 10_000).digest
    damage(store, bad)
    report = store.verify(dry_run=True)
    assert report.corrupt == [bad] and report.quarantined == [] and report.dry_run
    assert store.has(bad) and quarantined(store) == []


def test_restore_puts_back_what_hashes_right_and_keeps_what_does_not(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "store")
    fixed = store.put_bytes(b"fixed " * 10_000).digest
    rotten = store.put_bytes(b"rotten " * 10_000).digest
    again = store.put_bytes(b"stored again " * 10_000).digest
    originals = {d: damage(store, d) for d in (fixed, rotten, again)}
    report = store.verify()
    assert sorted(report.corrupt) == sorted([fixed, rotten, again])
    where = dict(zip(report.corrupt, report.quarantined, strict=True))
    for digest in (fixed, again):  # the bytes are good again (a repaired or stale copy)
        Path(store.location, where[digest]).write_bytes(originals[digest])
    store.put_bytes(b"stored again " * 10_000)

    restored = store.verify(restore=True)
    assert restored.restored == [where[fixed]] and restored.ok
    assert store.has(fixed) and store.read_bytes(fixed) == originals[fixed]
    assert [p.name for p in quarantined(store)] == [Path(where[rotten]).name]
    assert store.read_bytes(again) == originals[again]


def test_restore_refuses_a_good_copy_under_a_taken_name(tmp_path: Path) -> None:
    """Putting back never replaces a stored blob (a reader may have it open)."""
    store = BlobStore(tmp_path / "store")
    digest = store.put_bytes(b"kept " * 1000).digest
    key = blob_key(digest, Encoding.PLAIN)
    Path(store.location, QUARANTINE_DIR).mkdir()
    copy = f"{QUARANTINE_DIR}/{digest.hex}.1"
    Path(store.location, copy).write_bytes(Path(store.location, key).read_bytes())
    inode = Path(store.location, key).stat().st_ino
    assert not store.backend.move_no_clobber(copy, key)
    assert Path(store.location, key).stat().st_ino == inode


def test_the_uncached_reader_reads_every_byte(tmp_path: Path) -> None:
    """O_DIRECT reads in aligned chunks; the tail and a file of exactly one chunk end right."""
    for size in (0, 5, 4096, 16 << 20, (16 << 20) + 4097):
        path = tmp_path / f"f{size}"
        data = bytes(range(256)) * (size // 256) + bytes(size % 256)
        path.write_bytes(data)
        with open_uncached(path) as reader:
            assert reader.read() == data, size


def test_store_verify_cli_dry_run_then_quarantine_then_restore(
    run_flare: RunFlare, tmp_path: Path
) -> None:
    source = tmp_path / "blob.bin"
    source.write_bytes(b"cli " * 20_000)
    put = run_flare("store", "put", str(source), "--no-link", "--json")
    assert put.returncode == 0, put.stderr
    digest = Digest.parse(json.loads(put.stdout)[0]["digest"])
    store = BlobStore(tmp_path / "home" / "registry")
    original = damage(store, digest)

    dry = run_flare("store", "verify", "--dry-run")
    assert dry.returncode == CORRUPT_EXIT and "left in place" in dry.stdout
    assert store.has(digest)

    moved = run_flare("store", "verify")
    assert moved.returncode == CORRUPT_EXIT and "moved to quarantine/" in moved.stdout
    assert "flare store verify --restore" in moved.stdout

    quarantined(store)[0].write_bytes(original)  # a good copy after all
    back = run_flare("store", "verify", "--restore", "--json")
    assert back.returncode == 0, back.stdout
    assert len(json.loads(back.stdout)["restored"]) == 1 and store.has(digest)
