"""The content-addressed blob store: immutable bytes named by their BLAKE3 digest.

A blob is written to a temp file inside the store, hashed while written, fsynced, made
read-only and renamed into `blobs/blake3/<2 hex>/<64 hex>[.zst]`, never over a file already
there; concurrent writers of one blob are harmless (they hold the same bytes).

A writer that finds its blob stored reuses it (`existing`) after a cheap check, not a re-read:
the plain size the stored file claims (its size, or the size its zstd frame header records)
must be the size just written. A stored file that claims another size, or that is not a
regular file, was damaged after it was written (truncated, replaced): it is moved to
quarantine and the writer's own bytes are published in its place (`repaired`). Damage that
keeps the claimed size (changed bytes, a zstd frame cut short after its header) is not seen by
writers: readers check digests, and `verify` quarantines such a blob.
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG
from typing import BinaryIO, Literal

from flare.errors import (
    FlareError,
    IntegrityError,
    InvalidInputError,
    NotFoundError,
    from_os_error,
)
from flare.store.backends import Backend, StoredFile, TempFile, open_backend
from flare.store.backends.base import TMP_DIR
from flare.store.copying import COPY_CHUNK, copy_hashing, hash_stream
from flare.store.digest import Digest, parse_prefix, resolve_prefix
from flare.store.encoding import (
    VERIFY_HINT,
    BoundedZstdReader,
    Encoding,
    check_zstd_level,
    zstd_plain_size,
    zstd_writer,
)
from flare.store.hashing import (
    FileState,
    Progress,
    check_unchanged,
    hash_bytes,
    hash_file,
    hash_file_state,
    parallel_map,
)
from flare.store.layout import (
    BLOB_DIR,
    QUARANTINE_DIR,
    TRASH_DIR,
    blob_key,
    parse_blob_key,
    parse_quarantined,
    quarantine_key,
)
from flare.store.reports import StoreUsage, VerifyReport
from flare.store.splice import Piece, PiecesReader, pieces_size, splice_hashing
from flare.store.trees import list_tree

CONFIRM_AFTER_S = 5.0
"""On a network filesystem, a blob that read wrong twice is read once more this much later
before verify calls it corrupt: long enough for a client's stale read to pass."""
LARGE_BLOB = 64 << 20
"""Blobs this large are hashed one at a time, each on all threads (as b3sum does)."""


@dataclass(frozen=True)
class PutResult:
    """What a put stored: the digest, the plain size, and how the bytes got there."""

    digest: Digest
    size: int
    method: str
    """copy, reflink, hardlink, existing (the blob was already stored, with the right size),
    or repaired (a stored file of the wrong size was moved to quarantine, and these bytes
    published in its place)."""


@dataclass(frozen=True)
class BlobInfo:
    """One stored blob: its digest, how it is kept, and the bytes it takes in the store."""

    digest: Digest
    encoding: Encoding
    stored_size: int


class BlobStore:
    """Blobs under one root (a local path, a NAS mount, or an fsspec URL)."""

    def __init__(
        self, location: str | Path, encoding: Encoding = Encoding.PLAIN, zstd_level: int = 3
    ) -> None:
        self.backend: Backend = open_backend(location)
        self.encoding = encoding
        self.zstd_level = check_zstd_level(zstd_level)
        self._ready = False

    @property
    def location(self) -> str:
        return self.backend.location

    # -- lookup ---------------------------------------------------------------------------

    def locate(self, digest: Digest) -> BlobInfo | None:
        """The stored blob with this digest, in whichever encoding it was kept."""
        for encoding in (self.encoding, *(e for e in Encoding if e is not self.encoding)):
            size = self.backend.size(blob_key(digest, encoding))
            if size is not None:
                return BlobInfo(digest, encoding, size)
        return None

    def has(self, digest: Digest) -> bool:
        return self.locate(digest) is not None

    def absent(self, names: Iterable[str]) -> list[str]:
        """The names that are hex digests of no stored blob: the side files (signatures,
        marks) of packages whose index gc swept. Names that are not digests are left out, and
        so are blobs in the trash (a later gc may put one back: store/trash.py)."""
        gone = []
        for name in names:
            try:
                if not self.has(Digest(name)) and not self._in_trash(name):
                    gone.append(name)
            except InvalidInputError:
                continue
        return gone

    def _in_trash(self, hex_digest: str) -> bool:
        listed = self.backend.list_dir(f"{TRASH_DIR}/{hex_digest[:2]}")
        return any(name.startswith(f"{hex_digest}.") for name in listed)

    def iter_blobs(self, stray: list[str] | None = None) -> Iterator[BlobInfo]:
        """Every stored blob; files that are not blobs are appended to `stray` if given."""
        for stored in self.backend.iter_files(BLOB_DIR):
            parsed = parse_blob_key(stored.key)
            if parsed is None:
                if stray is not None:
                    stray.append(stored.key)
                continue
            yield BlobInfo(parsed[0], parsed[1], stored.size)

    def resolve(self, text: str) -> Digest:
        """The stored digest a full digest or a unique prefix (8+ hex digits) names."""
        prefix = parse_prefix(text)
        candidates = (
            info.digest
            for stored in self.backend.iter_files(f"{BLOB_DIR}/{prefix[:2]}")
            if (parsed := parse_blob_key(stored.key))
            for info in [BlobInfo(parsed[0], parsed[1], stored.size)]
        )
        return resolve_prefix(prefix, candidates, self.location)

    def require_existing(self) -> None:
        """Refuse to read a store that is not there (a mistyped path), rather than show nothing."""
        if not self.backend.list_dir(""):
            raise NotFoundError(f"no store at {self.location}", "check the path, or put something")

    def require(self, digest: Digest) -> BlobInfo:
        """The stored blob, or a NotFoundError that says where we looked."""
        info = self.locate(digest)
        if info is None:
            raise NotFoundError(f"blob {digest} is not in {self.location}", "check the digest")
        return info

    # -- writing --------------------------------------------------------------------------

    def put_bytes(self, data: bytes) -> PutResult:
        """Store bytes held in memory."""
        return self.put_stream(io.BytesIO(data), size=len(data))

    def put_stream(
        self,
        stream: BinaryIO,
        size: int | None = None,
        expect: Digest | None = None,
        progress: Progress | None = None,
    ) -> PutResult:
        """Store a stream, hashed while written; `expect` refuses bytes with another digest."""
        self._prepare_writes()
        if self.encoding is Encoding.ZSTD and size is None:
            return self._put_unsized_zstd(stream, expect, progress)
        temp, digest, total = self._write_temp(stream, size, progress)
        return self._publish(temp, digest, total, "copy", expect)

    def put_pieces(self, pieces: Sequence[Piece], progress: Progress | None = None) -> PutResult:
        """Store the concatenation of pieces (bytes, runs of open files): copied file to file
        by the kernel where this store is a folder on a local disk in the plain encoding, else
        streamed: on a network filesystem the kernel copy would be hashed by reading the new
        file back from the server, twice the traffic of hashing the bytes as they are sent."""
        kernel_copy = self.backend.local_path(TMP_DIR) is not None and not self.backend.network
        if self.encoding is not Encoding.PLAIN or not kernel_copy:
            reader = PiecesReader(pieces)
            return self.put_stream(reader, reader.size, progress=progress)  # type: ignore[arg-type]
        self._prepare_writes()
        temp = self.backend.create_temp()
        try:
            hex_digest = splice_hashing(pieces, temp.file.fileno(), progress)
        except OSError as exc:
            self.backend.discard(temp)
            raise from_os_error(exc, "write a blob into", self.location) from exc
        except BaseException:
            self.backend.discard(temp)
            raise
        return self._publish(temp, Digest(hex_digest), pieces_size(pieces), "copy", None)

    def put_file(
        self,
        path: Path,
        link: bool = True,
        progress: Progress | None = None,
        expect: Digest | None = None,
    ) -> PutResult:
        """Store a file: linked where the store and file share a filesystem, else copied.
        With `expect`, bytes that hash to another digest are not stored (IntegrityError)."""
        path = Path(path)
        if not path.exists():
            raise NotFoundError(f"no such file: {path}", "check the path")
        if not path.is_file():
            raise InvalidInputError(f"not a regular file: {path}", "store files or folders")
        if link and self.encoding is Encoding.PLAIN:
            linked = self._put_linked(path, progress, expect)
            if linked is not None:
                return linked
        self._prepare_writes()
        try:
            with open(path, "rb", buffering=0) as source:
                before = FileState.of(os.fstat(source.fileno()))
                temp, digest, total = self._write_temp(source, before.size, progress)  # type: ignore[arg-type]
                after = FileState.of(os.fstat(source.fileno()))
        except OSError as exc:
            raise from_os_error(exc, "read", path) from exc
        try:
            check_unchanged(path, before, after)
        except IntegrityError:
            self.backend.discard(temp)
            raise
        return self._publish(temp, digest, total, "copy", expect)

    def put_tree(
        self,
        root: Path,
        link: bool = True,
        workers: int | None = None,
        progress: Progress | None = None,
    ) -> dict[str, PutResult]:
        """Store every file under a folder, many at once; keys are POSIX paths relative to it."""
        files = list_tree(Path(root))
        results = parallel_map(
            lambda rel: self.put_file(root / rel, link, progress), files, workers
        )
        return dict(zip(files, results, strict=True))

    def copy_to(
        self, other: BlobStore, digest: Digest, progress: Progress | None = None
    ) -> PutResult:
        """Copy one blob into another store: linked on one filesystem, always verified.

        A copy already there is reused when it claims the source's plain size. One that
        claims another size is replaced (`repaired`) once the copied bytes hash right; if they
        do not, the source is the damaged one: the copy there stays, reported `existing`."""
        info = self.require(digest)
        size = self.plain_size(info)
        stored = other._stored_size_matches(digest, size)
        if stored:
            return PutResult(digest, size, "existing")
        try:
            return self._copy_into(other, info, size, progress)
        except IntegrityError:
            held = other.locate(digest) if stored is not None and other.touch(digest) else None
            if held is None:
                raise
            return PutResult(digest, other.plain_size(held), "existing")

    def _copy_into(
        self, other: BlobStore, info: BlobInfo, size: int, progress: Progress | None
    ) -> PutResult:
        digest = info.digest
        source_path = self.backend.local_path(blob_key(digest, info.encoding))
        if source_path and info.encoding is other.encoding is Encoding.PLAIN:
            linked = other._put_linked(source_path, progress, expect=digest)
            if linked is not None:
                return linked
        with self.open(digest) as reader:
            return other.put_stream(reader, size, expect=digest, progress=progress)

    def _write_temp(
        self, stream: BinaryIO, size: int | None, progress: Progress | None
    ) -> tuple[TempFile, Digest, int]:
        """Write the stream into a new temp file in this store's encoding, hashing it."""
        temp = self.backend.create_temp()
        try:
            digest, total = self._fill_temp(temp, stream, size, progress)
        except BaseException:
            self.backend.discard(temp)
            raise
        return temp, digest, total

    def _fill_temp(
        self, temp: TempFile, stream: BinaryIO, size: int | None, progress: Progress | None
    ) -> tuple[Digest, int]:
        """Write the stream into the temp file in this store's encoding; return its digest."""
        try:
            sink = temp.file
            if self.encoding is Encoding.ZSTD:
                assert size is not None
                sink = zstd_writer(temp.file, size, self.zstd_level)
            hex_digest, total = copy_hashing(stream, sink, progress, size)
            if size is not None and total != size:
                held = "more" if total > size else str(total)
                raise IntegrityError(
                    f"expected {size} bytes but the source held {held}",
                    "the source changed while it was read; nothing was stored",
                )
            if sink is not temp.file:
                sink.close()  # ends the zstd frame; temp.file stays open
        except OSError as exc:
            raise from_os_error(exc, "write a blob into", self.location) from exc
        return Digest(hex_digest), total

    def _put_unsized_zstd(
        self, stream: BinaryIO, expect: Digest | None, progress: Progress | None
    ) -> PutResult:
        """zstd frames record their size up front: spool a stream of unknown size first."""
        spool = BlobStore(self.location, Encoding.PLAIN)
        temp, _, total = spool._write_temp(stream, None, progress)
        try:
            temp.file.flush()
            temp.file.close()
            with spool.backend.open_read(temp.key) as plain:
                return self.put_stream(plain, size=total, expect=expect)
        finally:
            spool.backend.discard(temp)

    def _put_linked(
        self, path: Path, progress: Progress | None, expect: Digest | None = None
    ) -> PutResult | None:
        """Share the file's bytes with a temp file (reflink, else hardlink), hash, publish.

        A reflink is a new inode whose pages are not cached yet, so the source is hashed
        instead: its state, unchanged from before the clone to after the hash, proves the
        clone holds the hashed bytes. A hardlink is the source's own inode: it is hashed as is.
        """
        self._prepare_writes()
        try:
            before = FileState.of(os.stat(path))
        except OSError as exc:  # gone meanwhile (a registry unmounted mid-copy): said so
            raise from_os_error(exc, "read", path) from exc
        linked = self.backend.link_temp(path)
        if linked is None:
            return None
        temp, method = linked
        try:
            assert temp.path is not None
            hashed = path if method == "reflink" else temp.path
            digest, seen = hash_file_state(hashed, progress=progress)
            if method == "reflink":
                check_unchanged(path, before, seen)
        except BaseException:
            self.backend.discard(temp)
            raise
        return self._publish(temp, digest, seen.size, method, expect)

    def _publish(
        self, temp: TempFile, digest: Digest, size: int, method: str, expect: Digest | None
    ) -> PutResult:
        """Put a complete temp file in place under its digest, unless that blob is stored
        with the right size (`size`, the plain size of the hashed temp file); a stored file of
        the wrong size is moved to quarantine first, and the temp file published instead."""
        if expect is not None and digest != expect:
            self.backend.discard(temp)
            raise IntegrityError(
                f"bytes for {expect} hash to {digest}", "the source is corrupt; nothing was stored"
            )
        try:
            intact, repaired = self._check_stored(digest, size)
        except BaseException:
            self.backend.discard(temp)
            raise
        if intact:
            self.backend.discard(temp)
            return PutResult(digest, size, "existing")
        # no clobber: a file at the key now is another writer's, published since the check
        published = self.backend.commit(temp, blob_key(digest, self.encoding))
        if not published:
            self.touch(digest)
        if repaired:
            return PutResult(digest, size, "repaired")
        return PutResult(digest, size, method if published else "existing")

    def _check_stored(self, digest: Digest, size: int) -> tuple[bool, bool]:
        """Touch the stored blob and check the plain size it claims: whether a copy of the
        right size is stored, and whether one of the wrong size was moved to quarantine."""
        repaired = False
        for encoding in self._encodings():
            if not self.backend.touch(blob_key(digest, encoding)):
                continue
            state = self._check_size(digest, encoding, size)
            if state == "intact":
                return True, repaired
            repaired = repaired or state == "quarantined"
        return False, repaired

    def _stored_size_matches(self, digest: Digest, size: int) -> bool | None:
        """Touch the stored blob; whether a copy claims `size` plain bytes (None: no copy is
        stored). Nothing is moved: a copy into this store takes the size from another store's
        blob (which may be the damaged one), so it writes first, and its publish repairs with
        the size of the bytes it hashed."""
        found = None
        for encoding in self._encodings():
            key = blob_key(digest, encoding)
            if self.backend.touch(key):
                try:
                    if self._claimed_size(key, encoding) == size:
                        return True
                except NotFoundError:
                    continue
                found = False
        return found

    def _check_size(
        self, digest: Digest, encoding: Encoding, size: int
    ) -> Literal["intact", "quarantined", "absent"]:
        """Check one stored copy's claimed plain size; quarantine it if wrong.

        A wrong size is read again past this host's caches before anything moves, and what
        was moved is checked once more: if another writer repaired the blob between our
        check and our move, the right-size file we took is put back (no clobber) rather than
        left in quarantine."""
        key = blob_key(digest, encoding)
        try:
            if self._claimed_size(key, encoding) == size:
                return "intact"
            if self._claimed_size(key, encoding, uncached=True) == size:
                return "intact"
            moved = self._quarantine(BlobInfo(digest, encoding, 0))
        except FlareError as exc:
            if _gone(exc):
                return "absent"  # quarantined or collected meanwhile: nothing here to check
            raise
        try:
            taken_by_mistake = self._claimed_size(moved, encoding, uncached=True) == size
        except FlareError as exc:
            if not _gone(exc):
                raise
            taken_by_mistake = False
        if not taken_by_mistake:
            return "quarantined"
        if self.backend.move_no_clobber(moved, key):
            return "intact"
        return "absent"  # the key is another writer's again; ours commits no-clobber

    def _claimed_size(self, key: str, encoding: Encoding, uncached: bool = False) -> int | None:
        """The plain size the file at key claims, through a fresh open: its size, or the size
        its zstd frame header records; None for one that holds no blob (not a regular file,
        not a zstd frame with a recorded size). Raises NotFoundError when it is gone."""
        local = self.backend.local_path(key)
        if local is not None:
            try:
                if not S_ISREG(os.stat(local).st_mode):
                    return None
            except FileNotFoundError as exc:
                raise NotFoundError(f"{local} is gone", "") from exc
            except OSError as exc:
                raise from_os_error(exc, "read", local) from exc
        opener = self.backend.open_uncached if uncached else self.backend.open_read
        try:
            with opener(key) as raw:
                if encoding is Encoding.PLAIN:
                    return raw.seek(0, io.SEEK_END)
                try:
                    return zstd_plain_size(raw, f"{self.location}/{key}")
                except IntegrityError:
                    return None
        except FlareError as exc:
            if _gone(exc) and not isinstance(exc, NotFoundError):
                raise NotFoundError(exc.what, "") from exc
            raise
        except OSError as exc:
            raise from_os_error(exc, "read", f"{self.location}/{key}") from exc

    def _encodings(self) -> tuple[Encoding, ...]:
        """The configured encoding first, then the other."""
        return (self.encoding, *(e for e in Encoding if e is not self.encoding))

    def touch(self, digest: Digest) -> bool:
        """Mark a stored blob as just used, so gc's grace period protects it; False if absent.

        Writers touch a blob they find already stored: it may have been garbage a moment ago,
        and a collector deletes only blobs untouched for its whole grace period. The blob is
        opened to be touched, so the answer comes from the server on a network filesystem,
        not from a client's cache that may still list a blob another host collected."""
        encodings = (self.encoding, *(e for e in Encoding if e is not self.encoding))
        return any(self.backend.touch(blob_key(digest, e)) for e in encodings)

    def confirm(self, digest: Digest) -> bool:
        """Whether the blob is stored, asked of the server where there is one (a fresh open),
        for decisions a stale cache must not make: that a new package is complete."""
        encodings = (self.encoding, *(e for e in Encoding if e is not self.encoding))
        return any(self.backend.exists(blob_key(digest, e)) for e in encodings)

    # -- reading --------------------------------------------------------------------------

    def plain_size(self, info: BlobInfo) -> int:
        """The size of the blob's content, whatever its encoding."""
        if info.encoding is Encoding.PLAIN:
            return info.stored_size
        key = blob_key(info.digest, info.encoding)
        with self.backend.open_read(key) as raw:
            return zstd_plain_size(raw, f"{self.location}/{key}")

    def open(self, digest: Digest, expected_size: int | None = None) -> BinaryIO:
        """A reader of the blob's plain bytes (not verified: see read_bytes and get)."""
        info = self.require(digest)
        raw = self.backend.open_read(blob_key(digest, info.encoding))
        return self._plain_reader(info, raw, expected_size)

    def _plain_reader(
        self, info: BlobInfo, raw: BinaryIO, expected_size: int | None = None
    ) -> BinaryIO:
        """The plain bytes of a stored blob's file, open as `raw` (closed with the reader)."""
        if info.encoding is Encoding.PLAIN:
            return raw
        key = blob_key(info.digest, info.encoding)
        try:
            reader = BoundedZstdReader(raw, f"{self.location}/{key}", expected_size)
        except BaseException:
            raw.close()
            raise
        return io.BufferedReader(reader, COPY_CHUNK)  # type: ignore[return-value]

    def read_bytes(self, digest: Digest) -> bytes:
        """The blob's content (a small one: an index, a ref), checked against its digest."""
        with self.open(digest) as reader:
            data = reader.read()
        self._check_digest(digest, hash_bytes(data).hex)
        return data

    def get(self, digest: Digest, dest: Path, progress: Progress | None = None) -> tuple[Path, int]:
        """Write the blob's content to `dest` (a file, or a folder to write into) atomically,
        verified while copied; return the file written and its size."""
        dest = Path(dest)
        if dest.is_dir():
            dest = dest / digest.hex
        partial = dest.with_name(f".{dest.name}.{os.getpid()}.part")
        try:
            with self.open(digest) as reader, open(partial, "wb") as sink:
                hex_digest, total = copy_hashing(reader, sink, progress)
                sink.flush()
                os.fsync(sink.fileno())
            self._check_digest(digest, hex_digest)
            os.replace(partial, dest)
        except OSError as exc:
            raise from_os_error(exc, "write", dest) from exc
        finally:
            partial.unlink(missing_ok=True)
        return dest, total

    def stream(self, digest: Digest, sink: BinaryIO, progress: Progress | None = None) -> int:
        """Write the blob's content to an open stream (stdout), hashed as it goes; a mismatch
        is raised once the bytes are out, so whoever reads the stream checks the exit status."""
        with self.open(digest) as reader:
            hex_digest, total = copy_hashing(reader, sink, progress)
        sink.flush()
        self._check_digest(digest, hex_digest)
        return total

    def _check_digest(self, digest: Digest, hex_digest: str) -> None:
        if hex_digest != digest.hex:
            raise IntegrityError(
                f"blob {digest} in {self.location} is corrupt (it hashes to {hex_digest[:16]})",
                VERIFY_HINT,
            )

    # -- maintenance ----------------------------------------------------------------------

    def verify(
        self,
        digests: Iterable[Digest] | None = None,
        workers: int | None = None,
        progress: Progress | None = None,
        dry_run: bool = False,
        restore: bool = False,
        confirm_after_s: float = CONFIRM_AFTER_S,
    ) -> VerifyReport:
        """Re-hash blobs in parallel; move the corrupt ones to quarantine/, never delete them.

        A blob counts as corrupt only when its bytes as stored hash wrong: a bad first read is
        read again past this host's caches, and on a network filesystem once more
        `confirm_after_s` later; a read that hashes right proves the bytes (verify moving a
        good blob breaks every package that needs it). With `restore`, quarantined files that
        hash right are put back first. With `dry_run`, nothing moves, not even stale temps."""
        report = VerifyReport(dry_run=dry_run)
        if not dry_run:
            self.sweep_temps()
            if restore:
                report.restored = self.restore()
        if digests is None:
            infos = list(self.iter_blobs(report.stray))
        else:
            located = [(d, self.locate(d)) for d in digests]
            report.missing = [d for d, info in located if info is None]
            infos = [info for _, info in located if info is not None]
        large = [i for i in infos if i.stored_size >= LARGE_BLOB]
        small = [i for i in infos if i.stored_size < LARGE_BLOB]
        intact = [self._is_intact(info, progress) for info in large]  # each on every thread
        intact += parallel_map(lambda info: self._is_intact(info, progress), small, workers)
        failed = [info for info, ok in zip(large + small, intact, strict=True) if not ok]
        report.checked = len(infos)
        report.checked_bytes = sum(info.stored_size for info in infos)
        corrupt = self._confirm_corrupt(failed, workers, confirm_after_s)
        report.reread = [info.digest for info in failed if info not in corrupt]
        for info in corrupt:
            report.corrupt.append(info.digest)
            if not dry_run:
                report.quarantined.append(self._quarantine(info))
        return report

    def _confirm_corrupt(
        self, suspects: list[BlobInfo], workers: int | None, confirm_after_s: float
    ) -> list[BlobInfo]:
        """The suspects whose bytes as stored hash wrong: read past the caches, and on a
        network filesystem again after a pause (a client may serve a stale read for a while)."""
        rounds = 2 if self.backend.network else 1
        for round_ in range(rounds):
            if not suspects:
                break
            if round_:
                time.sleep(confirm_after_s)
            again = parallel_map(lambda info: self._is_intact(info, None, True), suspects, workers)
            suspects = [info for info, ok in zip(suspects, again, strict=True) if not ok]
        return suspects

    def _is_intact(self, info: BlobInfo, progress: Progress | None, uncached: bool = False) -> bool:
        """Whether the blob hashes to its digest: a local plain blob through a memory map on
        several threads, anything else (or with `uncached`, past the client's caches; or on a
        network filesystem, whose clients may not keep a map coherent) by reading it."""
        key = blob_key(info.digest, info.encoding)
        local = self.backend.local_path(key)
        if local is not None:
            try:
                kind = os.stat(local).st_mode
            except FileNotFoundError:
                return True  # moved or collected meanwhile: nothing here to call corrupt
            if not S_ISREG(kind):  # a folder, a FIFO (whose open would block): none of its bytes
                return False
        try:
            mapped = not (uncached or self.backend.network) and info.encoding is Encoding.PLAIN
            if local is not None and mapped:
                return hash_file(local, progress=progress)[0] == info.digest
            raw = self.backend.open_uncached(key) if uncached else self.backend.open_read(key)
            with self._plain_reader(info, raw) as reader:
                return hash_stream(reader, progress) == info.digest.hex
        except IntegrityError:
            return False
        except NotFoundError:
            return True  # moved or collected meanwhile: nothing here to call corrupt

    def _quarantine(self, info: BlobInfo) -> str:
        key = blob_key(info.digest, info.encoding)
        dest = quarantine_key(info.digest, info.encoding)
        self.backend.move(key, dest)
        return dest

    def restore(self) -> list[str]:
        """Put back quarantined files whose bytes, read past the caches, hash to their name:
        a blob quarantined after a stale read (or repaired by hand) serves again. A good copy
        of a blob stored again since is removed (the store has those very bytes); a bad one
        stays. Returns the quarantine keys put back."""
        restored = []
        for stored in list(self.backend.iter_files(QUARANTINE_DIR)):
            name = stored.key.rsplit("/", 1)[-1]
            parsed = parse_quarantined(name)
            if parsed is None:
                continue  # not a file verify put there
            digest, encoding = parsed
            info = BlobInfo(digest, encoding, stored.size)
            if not self._hashes_right(stored.key, info):
                continue
            if self.backend.move_no_clobber(stored.key, blob_key(info.digest, encoding)):
                restored.append(stored.key)
            else:
                self.backend.remove(stored.key)
        return restored

    def _hashes_right(self, key: str, info: BlobInfo) -> bool:
        """Whether the file at key holds the blob's bytes, read past this host's caches."""
        try:
            with self._plain_reader(info, self.backend.open_uncached(key)) as reader:
                return hash_stream(reader, None) == info.digest.hex
        except (IntegrityError, NotFoundError):
            return False

    def sweep_temps(self, stale_after_s: float | None = None) -> list[str]:
        """Remove temp files that dead writers left behind (never a live writer's)."""
        return self.backend.sweep_temps(
            self.backend.stale_after_s if stale_after_s is None else stale_after_s
        )

    def _prepare_writes(self) -> None:
        """Before the first write: create the store's folders, clear what dead writers left."""
        if not self._ready:
            self.backend.ensure()
            self.sweep_temps()
            self._ready = True

    def usage(self) -> StoreUsage:
        """Blob count and bytes, plus what temp files and quarantine hold."""
        infos = list(self.iter_blobs())
        return StoreUsage(
            blobs=len(infos),
            stored_bytes=sum(i.stored_size for i in infos),
            temp_bytes=_total(self.backend.iter_files(TMP_DIR)),
            quarantine_bytes=_total(self.backend.iter_files(QUARANTINE_DIR)),
            trash_bytes=_total(self.backend.iter_files(TRASH_DIR)),
            free_bytes=self.backend.free_bytes(),
        )


def _total(files: Iterable[StoredFile]) -> int:
    return sum(f.size for f in files)


def _gone(exc: FlareError) -> bool:
    """Whether a backend's error says the file is not there (fsspec's FileNotFoundError
    carries no errno, so it is not always a NotFoundError)."""
    return isinstance(exc, NotFoundError) or isinstance(exc.__cause__, FileNotFoundError)
