"""A writer that finds its blob stored checks the size the stored file claims before reusing it:
a blob damaged after it was written (truncated, replaced by a file of another size) is moved to
quarantine and the writer's fresh bytes are published in its place (`repaired`)."""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

import pytest
from blake3 import blake3

from flare.errors import IntegrityError
from flare.store import BlobStore, Digest, Encoding
from flare.store.layout import QUARANTINE_DIR, blob_key, parse_quarantined

DATA = os.urandom(300_000)
DIGEST = Digest(blake3(DATA).hexdigest())


def stored_path(store: BlobStore, digest: Digest, encoding: Encoding = Encoding.PLAIN) -> Path:
    path = store.backend.local_path(blob_key(digest, encoding))
    assert path is not None
    return path


def truncate(path: Path, size: int) -> None:
    """Cut a stored (read-only) blob short, as a bad disk or a hostile hand would."""
    path.chmod(0o644)
    with open(path, "r+b") as handle:
        handle.truncate(size)


def quarantined(store: BlobStore) -> dict[str, bytes]:
    """What quarantine/ holds, by file name: every name one that verify would have written."""
    found = {}
    for stored in store.backend.iter_files(QUARANTINE_DIR):
        name = stored.key.rsplit("/", 1)[-1]
        assert parse_quarantined(name) is not None, name
        found[name] = store.backend.read(stored.key) or b""
    return found


def assert_whole(store: BlobStore, digest: Digest = DIGEST, data: bytes = DATA) -> None:
    assert store.read_bytes(digest) == data
    assert store.verify([digest]).ok


@pytest.mark.parametrize("keep", [0, 1000, len(DATA) - 1])
def test_a_truncated_plain_blob_is_repaired_by_the_next_put(store: BlobStore, keep: int) -> None:
    store.put_bytes(DATA)
    path = stored_path(store, DIGEST)
    truncate(path, keep)

    result = store.put_bytes(DATA)
    assert (result.digest, result.size, result.method) == (DIGEST, len(DATA), "repaired")
    assert_whole(store)
    assert stat.S_IMODE(path.stat().st_mode) == 0o444
    assert list(quarantined(store).values()) == [DATA[:keep]]
    assert store.put_bytes(DATA).method == "existing"  # repaired once, then reused


def test_a_longer_file_at_the_blob_name_is_repaired(store: BlobStore) -> None:
    store.put_bytes(DATA)
    path = stored_path(store, DIGEST)
    path.chmod(0o644)
    path.write_bytes(DATA + b"tail")
    assert store.put_bytes(DATA).method == "repaired"
    assert_whole(store)
    assert list(quarantined(store).values()) == [DATA + b"tail"]


def test_a_folder_at_the_blob_name_is_quarantined_and_the_blob_stored(store: BlobStore) -> None:
    store.put_bytes(DATA)
    path = stored_path(store, DIGEST)
    path.chmod(0o644)
    path.unlink()
    path.mkdir()
    assert store.put_bytes(DATA).method == "repaired"
    assert path.is_file()
    assert_whole(store)
    assert [p.is_dir() for p in Path(store.location, QUARANTINE_DIR).iterdir()] == [True]


def test_a_correct_blob_is_reused_not_replaced(store: BlobStore, tmp_path: Path) -> None:
    store.put_bytes(DATA)
    inode = stored_path(store, DIGEST).stat().st_ino
    source = tmp_path / "source.bin"
    source.write_bytes(DATA)
    for put in (
        lambda: store.put_bytes(DATA),
        lambda: store.put_stream(io.BytesIO(DATA)),
        lambda: store.put_file(source),
        lambda: store.put_file(source, link=False),
    ):
        assert put().method == "existing"
        assert stored_path(store, DIGEST).stat().st_ino == inode
    assert quarantined(store) == {}
    assert not Path(store.location, QUARANTINE_DIR).exists()


def test_a_linked_put_repairs_with_the_source_file(store: BlobStore, tmp_path: Path) -> None:
    store.put_bytes(DATA)
    truncate(stored_path(store, DIGEST), 10)
    source = tmp_path / "source.bin"
    source.write_bytes(DATA)
    assert store.put_file(source).method == "repaired"
    assert_whole(store)
    assert list(quarantined(store).values()) == [DATA[:10]]


@pytest.mark.parametrize("keep", [0, 5])
def test_a_zstd_blob_cut_into_its_header_is_repaired(tmp_path: Path, keep: int) -> None:
    packed = BlobStore(tmp_path / "zstd", Encoding.ZSTD)
    packed.put_bytes(DATA)
    path = stored_path(packed, DIGEST, Encoding.ZSTD)
    frame = path.read_bytes()
    truncate(path, keep)

    assert packed.put_stream(io.BytesIO(DATA), len(DATA)).method == "repaired"
    assert path.read_bytes() == frame
    assert_whole(packed)
    assert list(quarantined(packed).values()) == [frame[:keep]]


def test_a_zstd_frame_of_other_content_at_the_blob_name_is_repaired(tmp_path: Path) -> None:
    """The frame header records the plain size: a frame of another size is not this blob."""
    packed = BlobStore(tmp_path / "zstd", Encoding.ZSTD)
    packed.put_bytes(DATA)
    other = packed.put_bytes(b"other content").digest
    path = stored_path(packed, DIGEST, Encoding.ZSTD)
    path.chmod(0o644)
    path.write_bytes(stored_path(packed, other, Encoding.ZSTD).read_bytes())

    assert packed.put_stream(io.BytesIO(DATA)).method == "repaired"  # unsized: spooled first
    assert_whole(packed)
    assert len(quarantined(packed)) == 1


def test_a_correct_zstd_blob_is_reused(tmp_path: Path) -> None:
    packed = BlobStore(tmp_path / "zstd", Encoding.ZSTD)
    packed.put_bytes(DATA)
    inode = stored_path(packed, DIGEST, Encoding.ZSTD).stat().st_ino
    assert packed.put_bytes(DATA).method == "existing"
    assert stored_path(packed, DIGEST, Encoding.ZSTD).stat().st_ino == inode
    assert quarantined(packed) == {}


def test_a_damaged_copy_in_the_other_encoding_is_repaired(tmp_path: Path) -> None:
    """A zstd store that holds the content plain (stored before the setting changed)."""
    BlobStore(tmp_path / "store").put_bytes(DATA)
    truncate(stored_path(BlobStore(tmp_path / "store"), DIGEST), 100)
    packed = BlobStore(tmp_path / "store", Encoding.ZSTD)
    assert packed.put_bytes(DATA).method == "repaired"
    assert packed.locate(DIGEST).encoding is Encoding.ZSTD  # type: ignore[union-attr]
    assert not stored_path(packed, DIGEST).exists()  # the damaged plain copy is quarantined
    assert_whole(packed)
    assert list(quarantined(packed).values()) == [DATA[:100]]


def test_a_truncated_blob_in_an_fsspec_store_is_repaired() -> None:
    remote = BlobStore("memory://flare-existing-blob/store")
    remote.put_bytes(DATA)
    key = blob_key(DIGEST, Encoding.PLAIN)
    remote.backend.fs.pipe_file(remote.backend._path(key), DATA[:7])  # type: ignore[attr-defined]
    assert remote.put_bytes(DATA).method == "repaired"
    assert_whole(remote)
    assert list(quarantined(remote).values()) == [DATA[:7]]
    assert remote.put_bytes(DATA).method == "existing"


def test_copy_to_repairs_a_truncated_copy_in_the_destination(
    store: BlobStore, tmp_path: Path
) -> None:
    store.put_bytes(DATA)
    for other in (
        BlobStore(tmp_path / "cache"),
        BlobStore(tmp_path / "packed", Encoding.ZSTD),
        BlobStore("memory://flare-existing-blob/copy"),
    ):
        assert other.put_bytes(DATA).method == "copy"  # its own file, not linked to the source
        key = blob_key(DIGEST, other.encoding)
        local = other.backend.local_path(key)
        if local is not None:
            truncate(local, 0 if other.encoding is Encoding.ZSTD else 1234)
        else:
            other.backend.fs.pipe_file(other.backend._path(key), b"")  # type: ignore[attr-defined]

        assert store.copy_to(other, DIGEST).method == "repaired"
        assert_whole(other)
        assert len(quarantined(other)) == 1
        assert store.copy_to(other, DIGEST).method == "existing"
    assert_whole(store)


def test_a_damaged_source_never_quarantines_a_good_destination(
    store: BlobStore, tmp_path: Path
) -> None:
    """copy_to compares the destination with the source's size; when they differ, the copy is
    written and hashed first, and only the size of bytes that hash right moves a file away.
    Bytes that hash wrong condemn the source: the destination's copy stays, as before."""
    store.put_bytes(DATA)
    other = BlobStore(tmp_path / "cache")
    assert other.put_bytes(DATA).method == "copy"
    inode = stored_path(other, DIGEST).stat().st_ino
    truncate(stored_path(store, DIGEST), 100)

    result = store.copy_to(other, DIGEST)
    assert (result.method, result.size) == ("existing", len(DATA))
    assert stored_path(other, DIGEST).stat().st_ino == inode
    assert quarantined(other) == {}
    assert_whole(other)
    with pytest.raises(IntegrityError):  # where nothing is stored, the damage is reported
        store.copy_to(BlobStore(tmp_path / "empty"), DIGEST)


def test_a_writer_that_loses_the_repair_race_puts_a_good_blob_back(
    store: BlobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two writers find the same damaged blob; the other repairs it between this one's check
    and its move. What this one moved has the right size: it goes back, not to quarantine."""
    store.put_bytes(DATA)
    truncate(stored_path(store, DIGEST), 10)
    other = BlobStore(store.location)
    real = BlobStore._quarantine
    raced = []

    def quarantine_after_a_rival(self: BlobStore, info: object) -> str:
        if self is store and not raced:
            raced.append(other.put_bytes(DATA).method)  # the rival repairs first
        return real(self, info)  # type: ignore[arg-type]

    monkeypatch.setattr(BlobStore, "_quarantine", quarantine_after_a_rival)
    inode_before = stored_path(store, DIGEST).stat().st_ino
    assert store.put_bytes(DATA).method == "existing"
    assert raced == ["repaired"]
    path = stored_path(store, DIGEST)
    assert path.stat().st_ino != inode_before
    assert_whole(store)
    assert list(quarantined(store).values()) == [DATA[:10]]  # only the damaged file
