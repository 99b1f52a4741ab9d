"""The blob contract: atomic, idempotent, verified, linked where possible, never partial."""

from __future__ import annotations

import errno
import io
import mmap
import multiprocessing
import os
import shutil
import stat
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from blake3 import blake3
from helpers import write_random

from flare.errors import FlareError, IntegrityError, NotFoundError
from flare.store import BlobStore, Digest, Encoding
from flare.store.layout import blob_key
from flare.store.splice import FileRuns
from flare.store.sweep import Reached, unmarked


def stored_path(store: BlobStore, digest: Digest, encoding: Encoding = Encoding.PLAIN) -> Path:
    path = store.backend.local_path(blob_key(digest, encoding))
    assert path is not None
    return path


def temp_files(store: BlobStore) -> list[Path]:
    return list(Path(store.location, "tmp").glob("*"))


def test_put_bytes_lands_read_only_under_its_digest(store: BlobStore) -> None:
    result = store.put_bytes(b"weights")
    digest = Digest(blake3(b"weights").hexdigest())
    assert result.digest == digest and result.size == 7 and result.method == "copy"
    path = stored_path(store, digest)
    assert (
        path.relative_to(store.location).as_posix() == f"blobs/blake3/{digest.hex[:2]}/{digest.hex}"
    )
    assert path.read_bytes() == b"weights"
    assert stat.S_IMODE(path.stat().st_mode) == 0o444
    assert temp_files(store) == []


def test_put_is_idempotent(store: BlobStore) -> None:
    first = store.put_bytes(b"same")
    inode = stored_path(store, first.digest).stat().st_ino
    second = store.put_bytes(b"same")
    assert second.digest == first.digest and second.method == "existing"
    assert stored_path(store, first.digest).stat().st_ino == inode
    assert len(list(store.iter_blobs())) == 1


def test_put_stream_of_unknown_size(store: BlobStore) -> None:
    data = os.urandom(3 << 20)
    result = store.put_stream(io.BytesIO(data))
    assert result.digest.hex == blake3(data).hexdigest() and result.size == len(data)
    assert store.read_bytes(result.digest) == data


def test_put_stream_refuses_bytes_that_do_not_match_the_expected_digest(store: BlobStore) -> None:
    wrong = Digest("00" * 32)
    with pytest.raises(IntegrityError, match="hash to"):
        store.put_stream(io.BytesIO(b"not it"), expect=wrong)
    assert list(store.iter_blobs()) == [] and temp_files(store) == []


def test_import_on_one_filesystem_links_instead_of_copying(
    store: BlobStore, tmp_path: Path
) -> None:
    source = tmp_path / "model.safetensors"
    data = write_random(source, 1 << 20)
    result = store.put_file(source)
    assert result.method in ("reflink", "hardlink")
    blob = stored_path(store, result.digest)
    assert blob.read_bytes() == data and result.digest.hex == blake3(data).hexdigest()
    if result.method == "hardlink":
        assert blob.stat().st_ino == source.stat().st_ino


def test_copy_when_asked_gives_an_independent_blob(store: BlobStore, tmp_path: Path) -> None:
    source = tmp_path / "model.safetensors"
    write_random(source, 1 << 20)
    result = store.put_file(source, link=False)
    assert result.method == "copy"
    assert stored_path(store, result.digest).stat().st_ino != source.stat().st_ino


def test_a_source_that_changes_while_copied_is_not_stored(store: BlobStore, tmp_path: Path) -> None:
    source = tmp_path / "growing.bin"
    write_random(source, 40 << 20)

    def append(_n: int) -> None:
        with open(source, "ab") as handle:
            handle.write(b"x")

    with pytest.raises(IntegrityError, match=r"changed while it was read|held more"):
        store.put_file(source, link=False, progress=append)
    assert list(store.iter_blobs()) == [] and temp_files(store) == []


def test_put_tree_imports_a_checkpoint_folder(store: BlobStore, tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    files = {
        "config.json": b"{}",
        "model-00001-of-00002.safetensors": os.urandom(100_000),
        "model-00002-of-00002.safetensors": os.urandom(100_000),
        "tokenizer/tokenizer.json": b'{"v": 1}',
    }
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    results = store.put_tree(folder, workers=3)
    assert sorted(results) == sorted(files)
    for rel, result in results.items():
        assert store.read_bytes(result.digest) == files[rel]


def test_missing_source_and_missing_blob_are_not_found(store: BlobStore, tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="no such file"):
        store.put_file(tmp_path / "absent")
    with pytest.raises(NotFoundError, match="not in"):
        store.read_bytes(Digest("ab" * 32))


def _put_many(location: str, seed: int, count: int) -> list[str]:
    """Child process: put shared and own blobs, return their digests."""
    store = BlobStore(location)
    digests = []
    for i in range(count):
        shared = f"shared-{i}".encode() * 5000
        own = f"own-{seed}-{i}".encode() * 5000
        digests += [str(store.put_bytes(shared).digest), str(store.put_bytes(own).digest)]
    return digests


def test_concurrent_writers_lose_and_corrupt_nothing(store: BlobStore) -> None:
    with multiprocessing.get_context("spawn").Pool(6) as pool:
        results = pool.starmap(_put_many, [(store.location, seed, 20) for seed in range(6)])
    expected = {d for digests in results for d in digests}
    assert {str(i.digest) for i in store.iter_blobs()} == expected
    assert len(expected) == 20 + 6 * 20
    report = store.verify()
    assert report.ok and report.checked == len(expected)
    assert temp_files(store) == []


def test_a_blob_path_never_shows_partial_bytes(store: BlobStore) -> None:
    data = os.urandom(64 << 20)
    digest = Digest(blake3(data).hexdigest())
    path = stored_path(store, digest)
    seen: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if path.exists():
                seen.append(path.stat().st_size)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        store.put_bytes(data)
    finally:
        done.set()
        watcher.join()
    assert all(size == len(data) for size in seen)


def test_copy_between_stores_on_one_filesystem_links_and_verifies(
    store: BlobStore, tmp_path: Path
) -> None:
    result = store.put_bytes(os.urandom(1 << 20))
    other = BlobStore(tmp_path / "cache")
    copied = store.copy_to(other, result.digest)
    assert copied.method in ("reflink", "hardlink")
    assert other.read_bytes(result.digest) == store.read_bytes(result.digest)
    assert store.copy_to(other, result.digest).method == "existing"


def test_copy_of_a_corrupt_blob_is_refused(store: BlobStore, tmp_path: Path) -> None:
    result = store.put_bytes(b"good bytes" * 1000)
    corrupt(stored_path(store, result.digest))
    for other in (BlobStore(tmp_path / "cache"), BlobStore("memory://flare-copy-test")):
        with pytest.raises(IntegrityError):
            store.copy_to(other, result.digest)
        assert not other.has(result.digest)


def corrupt(path: Path) -> None:
    """Flip one byte of a stored (read-only) blob, as a bad disk would."""
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_verify_quarantines_corrupt_blobs_and_reports_missing_ones(store: BlobStore) -> None:
    good = store.put_bytes(b"good" * 1000).digest
    bad = store.put_bytes(b"bad" * 1000).digest
    original = stored_path(store, bad).read_bytes()
    corrupt(stored_path(store, bad))
    stray = Path(store.location, "blobs/blake3/zz/not-a-blob")
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"?")

    report = store.verify()
    assert report.corrupt == [bad] and not report.ok
    assert report.stray == ["blobs/blake3/zz/not-a-blob"] and stray.exists()
    assert not stored_path(store, bad).exists() and store.has(good)
    kept = Path(store.location, report.quarantined[0])
    assert kept.parent.name == "quarantine" and len(kept.read_bytes()) == len(original)

    missing = Digest("12" * 32)
    again = store.verify([good, bad, missing])
    assert again.missing == [bad, missing] and again.corrupt == []


def test_a_folder_where_a_blob_should_be_is_corrupt_and_verify_goes_on(store: BlobStore) -> None:
    """It once stopped verify with `Is a directory` (exit 1), the other blobs unchecked."""
    odd = store.put_bytes(b"odd" * 1000).digest
    good = store.put_bytes(b"good" * 1000).digest
    path = stored_path(store, odd)
    path.chmod(0o644)
    path.unlink()
    path.mkdir()
    report = store.verify([odd, good])
    assert report.corrupt == [odd] and report.checked == 2 and not path.exists()
    assert store.put_bytes(b"odd" * 1000).digest == odd  # the path is free to store it again
    assert store.verify([odd, good]).ok


def test_stale_temps_of_dead_writers_are_swept_but_live_ones_kept(store: BlobStore) -> None:
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_start_write_and_die, args=(store.location,))
    child.start()
    child.join()
    abandoned = temp_files(store)
    assert len(abandoned) == 1

    live = store.backend.create_temp()
    live.file.write(b"in progress")
    assert live.path is not None
    for path in (*abandoned, live.path):
        os.utime(path, (1, 1))  # both look old; only the dead writer's lock is free

    assert store.sweep_temps(stale_after_s=60) == [f"tmp/{abandoned[0].name}"]
    assert temp_files(store) == [live.path]
    store.backend.discard(live)


def test_young_temps_are_kept_even_without_a_lock(store: BlobStore) -> None:
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_start_write_and_die, args=(store.location,))
    child.start()
    child.join()
    assert store.sweep_temps() == []
    assert len(temp_files(store)) == 1


def _start_write_and_die(location: str) -> None:
    """Child process: begin writing a blob, then die without cleaning up."""
    store = BlobStore(location)
    store.backend.ensure()
    temp = store.backend.create_temp()
    temp.file.write(b"half a blob")
    os._exit(9)


def test_zstd_store_keeps_compressed_bytes_under_the_plain_digest(tmp_path: Path) -> None:
    plain = BlobStore(tmp_path / "plain")
    packed = BlobStore(tmp_path / "zstd", Encoding.ZSTD, zstd_level=3)
    data = b"\x00\x3c" * (2 << 20)
    a, b = plain.put_bytes(data), packed.put_bytes(data)
    assert a.digest == b.digest
    path = stored_path(packed, b.digest, Encoding.ZSTD)
    assert path.name.endswith(".zst") and path.stat().st_size < len(data) // 10
    assert packed.read_bytes(b.digest) == data
    assert packed.put_stream(io.BytesIO(data)).method == "existing"
    assert packed.verify().ok


def test_zstd_stream_of_unknown_size_is_spooled(tmp_path: Path) -> None:
    packed = BlobStore(tmp_path / "zstd", Encoding.ZSTD)
    data = os.urandom(1 << 20) + b"\x00" * (1 << 20)
    result = packed.put_stream(io.BytesIO(data))
    assert packed.read_bytes(result.digest) == data
    assert temp_files(packed) == []


def _forge(path: Path, claimed: int) -> None:
    """Rewrite the 4-byte content size in a zstd frame header to claim fewer bytes."""
    frame = bytearray(path.read_bytes())
    descriptor = frame[4]
    assert descriptor >> 6 == 2 and descriptor & 0x20, "expects a single-segment, 4-byte size"
    frame[5:9] = claimed.to_bytes(4, "little")
    path.chmod(0o644)
    path.write_bytes(bytes(frame))


def test_a_forged_zstd_frame_cannot_expand_past_its_recorded_size(tmp_path: Path) -> None:
    packed = BlobStore(tmp_path / "zstd", Encoding.ZSTD)
    digest = packed.put_bytes(b"\x00" * (1 << 20)).digest
    _forge(stored_path(packed, digest, Encoding.ZSTD), claimed=1000)
    received = 0
    with pytest.raises(IntegrityError), packed.open(digest) as reader:
        while chunk := reader.read(4096):
            received += len(chunk)
    assert received <= 1000
    with pytest.raises(IntegrityError):
        packed.open(digest, expected_size=1 << 20)
    assert packed.verify().corrupt == [digest]


@pytest.mark.parametrize("where", ["local", "zstd", "memory", "other-filesystem"])
def test_put_pieces_stores_exactly_the_concatenation(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A payload's pieces (bytes, a whole run, strided rows) land as one blob whose bytes and
    digest are their concatenation: copied by the kernel in a local plain store (sendfile from
    another filesystem), streamed into zstd and fsspec stores."""
    folder = request.getfixturevalue("small_fs") if where == "other-filesystem" else tmp_path
    source = folder / "weights.bin"
    data = os.urandom(3 << 20)
    source.write_bytes(data)
    location = f"memory://pieces-{where}" if where == "memory" else str(tmp_path / "store")
    encoding = Encoding.ZSTD if where == "zstd" else Encoding.PLAIN
    store = BlobStore(location, encoding)
    fd = os.open(source, os.O_RDONLY)
    try:
        short_rows = FileRuns(fd, 7, 300, 4096, 1000)  # read row by row into a buffer
        long_rows = FileRuns(fd, 9, 2, 3 << 19, 5 << 18)  # a kernel copy per row
        pieces = [b"header", FileRuns(fd, 100, 1, 0, 2 << 20), short_rows, long_rows]
        result = store.put_pieces(pieces)
    finally:
        os.close(fd)
    expected = b"header" + data[100 : 100 + (2 << 20)]
    for runs in (short_rows, long_rows):
        for row in range(runs.rows):
            start = runs.offset + row * runs.stride
            expected += data[start : start + runs.length]
    assert result.size == len(expected)
    assert result.digest == Digest(blake3(expected).hexdigest())
    assert store.read_bytes(result.digest) == expected


def test_put_pieces_falls_back_where_the_kernel_cannot_copy_or_map(
    tmp_path: Path, small_fs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem pair that refuses both kernel copies (FUSE, say), under a store that
    cannot be memory-mapped (CIFS without a cache): plain reads and writes, a read-back
    hash, the same blob. (The refusals are injected: no such filesystem mounts here.)"""
    source = small_fs / "weights.bin"
    data = os.urandom(1 << 20)
    source.write_bytes(data)

    def refuse(code: int) -> Callable[..., object]:
        def call(*_args: object, **_kwargs: object) -> object:
            raise OSError(code, os.strerror(code))

        return call

    anonymous = mmap.mmap

    def map_no_file(fileno: int, *args: object, **kwargs: object) -> mmap.mmap:
        if fileno != -1:
            refuse(errno.ENODEV)()
        return anonymous(fileno, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "sendfile", refuse(errno.EINVAL))
    monkeypatch.setattr(mmap, "mmap", map_no_file)
    store = BlobStore(tmp_path / "store")
    fd = os.open(source, os.O_RDONLY)
    try:
        result = store.put_pieces([b"h", FileRuns(fd, 0, 1, 0, len(data))])
    finally:
        os.close(fd)
    assert result.digest == Digest(blake3(b"h" + data).hexdigest())
    assert store.read_bytes(result.digest) == b"h" + data


def test_put_pieces_refuses_a_source_shorter_than_its_runs(
    store: BlobStore, tmp_path: Path
) -> None:
    source = tmp_path / "short.bin"
    source.write_bytes(os.urandom(1000))
    fd = os.open(source, os.O_RDONLY)
    try:
        with pytest.raises(FlareError, match="shorter than its header says"):
            store.put_pieces([b"h", FileRuns(fd, 0, 1, 0, 5000)])
    finally:
        os.close(fd)
    assert temp_files(store) == [] and store.usage().blobs == 0


@pytest.mark.parametrize("where", ["local", "memory"])
def test_unmarked_lists_the_unreachable_blobs_with_size_and_time(
    where: str, tmp_path: Path
) -> None:
    """gc's sweep sees every blob its mark missed, as listed, and nothing else: not the
    marked ones, not a stray file in a fan-out folder, not a folder named like a blob."""
    location = str(tmp_path / "store") if where == "local" else f"memory://unmarked-{where}"
    store = BlobStore(location)
    live, dead, other = (store.put_bytes(os.urandom(n)) for n in (100, 2000, 3000))
    store.backend.write_atomic(f"blobs/blake3/{dead.digest.hex[:2]}/not-a-blob", b"x")
    if where == "local":
        folder = live.digest.hex[:2]
        Path(location, "blobs/blake3", folder, folder + "0" * 62).mkdir(parents=True)

    def reached(folder: str) -> list[list[str]]:
        return [[live.digest.hex]] if folder == live.digest.hex[:2] else [[]]

    shares = list(unmarked(store, reached))
    found = {hex_digest: rest for share in shares for hex_digest, *rest in share.unmarked}
    assert sorted(found) == sorted([dead.digest.hex, other.digest.hex])
    assert sum(share.marked for share in shares) == 1
    for result in (dead, other):
        key, size, modified = found[result.digest.hex]
        assert key == blob_key(result.digest, Encoding.PLAIN)
        assert (size, modified) == store.backend.stat(key)


def _sweep_store(tmp_path: Path, encoding: Encoding) -> tuple[BlobStore, set[str], set[str]]:
    """A store of 600 small blobs over most fan-out folders, a third of them live; one live
    and one dead blob kept in the other encoding, as a store whose encoding changed holds."""
    store = BlobStore(tmp_path / "store", encoding=encoding)
    other = BlobStore(tmp_path / "store", encoding=next(e for e in Encoding if e is not encoding))
    digests = [store.put_bytes(i.to_bytes(4, "big") * 16).digest.hex for i in range(600)]
    digests += [other.put_bytes(f"other {i}".encode()).digest.hex for i in range(2)]
    return store, set(digests[::3]), set(digests) - set(digests[::3])


def _reached(live: set[str]) -> Reached:
    def reached(folder: str) -> list[list[str]]:
        return [sorted(d for d in live if d.startswith(folder)), []]

    return reached


@pytest.mark.parametrize("encoding", list(Encoding))
def test_the_sweep_finds_the_same_in_any_number_of_processes(
    encoding: Encoding, tmp_path: Path
) -> None:
    """Shares in forked children find exactly what one process finds: every dead blob with
    its size and time, whatever its encoding, and every stored live blob counted as marked."""
    store, live, dead = _sweep_store(tmp_path, encoding)
    results = []
    for processes in (1, 2, 5):
        store.backend.sweep_processes = processes
        shares = list(unmarked(store, _reached(live)))
        assert len(shares) == processes
        found = sorted(blob for share in shares for blob in share.unmarked)
        results.append((sum(share.marked for share in shares), found))
    assert results[0] == results[1] == results[2]
    marked, found = results[0]
    assert marked == len(live) and {hex_digest for hex_digest, *_ in found} == dead
    for _, key, size, modified in found:
        assert (size, modified) == store.backend.stat(key)


def test_a_sweep_share_that_fails_in_its_child_is_done_again_here(tmp_path: Path) -> None:
    """A child that fails (here: the mark raises there) costs nothing but time: the parent
    does the share itself and the result is complete."""
    store, live, dead = _sweep_store(tmp_path, Encoding.PLAIN)
    store.backend.sweep_processes = 3
    parent = os.getpid()
    reached = _reached(live)

    def fails_in_children(folder: str) -> list[list[str]]:
        if os.getpid() != parent:
            raise OSError(errno.EIO, "injected")
        return reached(folder)

    shares = list(unmarked(store, fails_in_children))
    assert {hex_digest for share in shares for hex_digest, *_ in share.unmarked} == dead


def test_a_sweep_stopped_early_leaves_no_child_behind(tmp_path: Path) -> None:
    """A caller that stops after the first share (an error, a Ctrl-C) gets its children
    killed and reaped: none is left running or as a zombie."""
    store, live, _ = _sweep_store(tmp_path, Encoding.PLAIN)
    store.backend.sweep_processes = 4
    listing = Path(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/children")
    before = listing.read_text().split()
    sweep = unmarked(store, _reached(live))
    next(sweep)
    assert len(listing.read_text().split()) == len(before) + 3  # the other shares' children
    sweep.close()
    assert listing.read_text().split() == before


def test_memory_backend_through_fsspec(tmp_path: Path) -> None:
    remote = BlobStore("memory://flare-tests/store")
    data = os.urandom(300_000)
    result = remote.put_bytes(data)
    source = tmp_path / "f.bin"
    source.write_bytes(data + b"!")
    other = remote.put_file(source)
    assert other.method == "copy"
    assert remote.read_bytes(result.digest) == data
    assert remote.resolve(result.digest.hex[:10]) == result.digest
    assert remote.get(other.digest, tmp_path) == (tmp_path / other.digest.hex, len(data) + 1)
    assert remote.get(other.digest, tmp_path / "out.bin")[1] == len(data) + 1
    assert (tmp_path / "out.bin").read_bytes() == data + b"!"
    assert remote.verify().ok and remote.usage().blobs == 2
    local = BlobStore(tmp_path / "local")
    assert remote.copy_to(local, result.digest).method == "copy"
    assert local.read_bytes(result.digest) == data


@pytest.fixture
def xfs(tmp_path: Path) -> Iterator[Path]:
    """A loop-mounted XFS with reflinks (root and xfsprogs needed; skipped without them)."""
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    mkfs = shutil.which("mkfs.xfs", path=search)  # a user's PATH often lacks the sbin folders
    if mkfs is None:
        pytest.skip("no mkfs.xfs here")
    image, mount = tmp_path / "xfs.img", tmp_path / "xfs"
    with open(image, "wb") as handle:
        handle.truncate(512 << 20)
    made = subprocess.run([mkfs, "-q", "-m", "reflink=1", str(image)], capture_output=True)
    mount.mkdir()
    if (
        made.returncode != 0
        or subprocess.run(
            ["mount", "-o", "loop", str(image), str(mount)], capture_output=True
        ).returncode
    ):
        pytest.skip("no mkfs.xfs or loop mounts here")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_reflink_import_shares_extents_and_leaves_the_source_alone(xfs: Path) -> None:
    store = BlobStore(xfs / "store")
    source = xfs / "model.safetensors"
    data = write_random(source, 8 << 20)
    result = store.put_file(source)
    assert result.method == "reflink"
    assert source.stat().st_mode & 0o200, "a reflinked source stays writable"
    with open(source, "r+b") as handle:  # the user edits their file afterwards
        handle.write(b"\x00" * 4096)
    assert store.read_bytes(result.digest) == data and store.verify().ok
