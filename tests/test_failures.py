"""Failure handling: a full disk, a read-only store, changed sources, no lost data."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import mount_tmpfs
from helpers import write_random

from flare.errors import IntegrityError, NoSpaceError, PermissionDeniedError
from flare.store import BlobStore


def test_disk_full_during_put_leaves_no_blob_and_no_temp(small_fs: Path, tmp_path: Path) -> None:
    store = BlobStore(small_fs / "store")
    kept = store.put_bytes(b"already stored")
    big = tmp_path / "big.bin"
    write_random(big, 6 << 20)

    with pytest.raises(NoSpaceError, match="No space left") as info:
        store.put_file(big)
    assert str(small_fs) in str(info.value) and "nothing was stored" in str(info.value)
    assert [i.digest for i in store.iter_blobs()] == [kept.digest]
    assert list((small_fs / "store" / "tmp").iterdir()) == []

    small = store.put_bytes(b"the store is usable after")
    assert store.read_bytes(small.digest) == b"the store is usable after"
    assert store.verify().ok


def test_disk_full_with_zstd_encoding(small_fs: Path, tmp_path: Path) -> None:
    from flare.store import Encoding

    store = BlobStore(small_fs / "store", Encoding.ZSTD)
    big = tmp_path / "random.bin"
    write_random(big, 6 << 20)  # random bytes do not compress
    with pytest.raises(NoSpaceError):
        store.put_file(big)
    assert list(store.iter_blobs()) == []
    assert list((small_fs / "store" / "tmp").iterdir()) == []


@pytest.fixture
def read_only_store(tmp_path: Path) -> Iterator[BlobStore]:
    """A store holding one blob on a filesystem remounted read-only."""
    mount = tmp_path / "ro"
    mount_tmpfs(mount, "4m")
    store = BlobStore(mount / "store")
    store.put_bytes(b"kept")
    subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
    yield BlobStore(mount / "store")
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_writing_to_a_read_only_store_is_permission_denied(
    read_only_store: BlobStore, tmp_path: Path
) -> None:
    source = tmp_path / "new.bin"
    source.write_bytes(b"new")
    with pytest.raises(PermissionDeniedError, match="Read-only file system"):
        read_only_store.put_file(source, link=False)
    assert read_only_store.verify().ok


def test_in_place_change_of_the_same_size_is_detected(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "store")
    source = tmp_path / "weights.bin"
    write_random(source, 40 << 20)

    def overwrite_head(_n: int) -> None:
        with open(source, "r+b") as handle:
            handle.write(b"\xff" * 16)

    with pytest.raises(IntegrityError, match="changed while it was read"):
        store.put_file(source, link=False, progress=overwrite_head)
    assert list(store.iter_blobs()) == []
