"""A blob given as pieces of open files: written by the kernel, hashed as it lands.

A package payload is a new header followed by byte ranges of checkpoint files. Copying those
ranges through Python costs two copies per byte (into a buffer, out to the file); the kernel
copies them file to file instead (`copy_file_range`, which on some filesystems shares the
extents or copies on the server; `sendfile` across filesystems; a plain read and write only
where neither is allowed), as `cp` does. The digest is taken from the written file itself,
from its pages in the page cache (mapped, or read back where a filesystem cannot map them)
in spans as they land, so a blob is correct by construction even if a source changed
meanwhile; writeback of each span starts at once, so the final fsync waits for the last span.
"""

from __future__ import annotations

import errno
import io
import mmap
import os
from collections.abc import Sequence
from contextlib import ExitStack
from typing import NamedTuple

from blake3 import blake3

from flare.errors import FlareError, from_os_error
from flare.store.backends.direct import start_writeback
from flare.store.hashing import Progress, new_hasher

SPAN = 16 << 20
"""Bytes copied before they are hashed and their writeback started: large enough to keep
the disk busy, small enough to be hashed while they are still in the CPU's reach."""


SHORT_ROW = 1 << 20
"""Runs shorter than this (a tensor sliced along a later dimension, row by row) are read into
a buffer and written a span at a time: a kernel copy costs about 20 µs a call whatever its
length (2 KiB rows: 0.1 GB/s), a read about 3 µs (docs/performance.md)."""


class FileRuns(NamedTuple):
    """`rows` runs of `length` bytes of an open file, `stride` apart, from `offset`: a whole
    tensor is one run; a slice along a later dimension is one run per row."""

    fd: int
    offset: int
    rows: int
    stride: int
    length: int


Piece = bytes | FileRuns


def pieces_size(pieces: Sequence[Piece]) -> int:
    """The bytes the pieces add up to."""
    return sum(len(p) if isinstance(p, bytes) else p.rows * p.length for p in pieces)


class PiecesReader(io.RawIOBase):
    """The pieces as one stream: for stores without local files, and for peers."""

    def __init__(self, pieces: Sequence[Piece]) -> None:
        super().__init__()
        self._pieces = list(pieces)
        self.size = pieces_size(self._pieces)
        self._piece = 0
        self._done = 0
        """Bytes of the current piece already returned."""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        view = memoryview(buffer).cast("B")
        filled = 0
        while filled < len(view) and self._piece < len(self._pieces):
            filled += self._fill(view[filled:])
        return filled

    def _fill(self, view: memoryview) -> int:
        """Copy from the current piece into view; move to the next piece when it is done."""
        piece = self._pieces[self._piece]
        if isinstance(piece, bytes):
            got = min(len(view), len(piece) - self._done)
            view[:got] = piece[self._done : self._done + got]
            total = len(piece)
        else:
            row, column = divmod(self._done, piece.length)
            take = min(len(view), piece.length - column)
            got = os.preadv(piece.fd, [view[:take]], piece.offset + row * piece.stride + column)
            if got == 0:
                raise _short_source(piece.offset)
            total = piece.rows * piece.length
        self._done += got
        if self._done == total:
            self._piece, self._done = self._piece + 1, 0
        return got


def splice_hashing(pieces: Sequence[Piece], dest: int, progress: Progress | None = None) -> str:
    """Write the pieces into the empty file `dest` (open for reading and writing) in the
    kernel; return the BLAKE3 hex digest of the bytes the file then holds."""
    size = pieces_size(pieces)
    hasher = new_hasher(1)
    if size == 0:
        return hasher.hexdigest()
    os.ftruncate(dest, size)  # so that the whole file can be mapped before it is filled
    with ExitStack() as stack:
        writer = _SpanWriter(dest, _map(dest, size, stack), hasher, progress)
        for piece in pieces:
            if isinstance(piece, bytes):
                writer.write(piece)
            elif piece.rows > 1 and piece.length < SHORT_ROW:
                writer.gather(piece)
            else:
                for row in range(piece.rows):
                    writer.copy(piece.fd, piece.offset + row * piece.stride, piece.length)
        writer.hash_landed()
    return hasher.hexdigest()


def _map(dest: int, size: int, stack: ExitStack) -> memoryview | None:
    """The file's pages, read-only, or None where the filesystem cannot map it (FUSE with
    direct I/O, CIFS without a cache): the spans are then read back to be hashed."""
    try:
        mapped = stack.enter_context(mmap.mmap(dest, size, prot=mmap.PROT_READ))
    except (OSError, ValueError):  # ValueError: the size mmap saw is not yet the truncated one
        return None
    return stack.enter_context(memoryview(mapped))


class _SpanWriter:
    """Appends to the file, and hashes and starts writing back each span once it is full."""

    def __init__(
        self, dest: int, landed: memoryview | None, hasher: blake3, progress: Progress | None
    ) -> None:
        self._dest, self._landed, self._hasher, self._progress = dest, landed, hasher, progress
        self._end = 0
        self._hashed = 0
        self._copier = 0
        """Index in COPIERS of the first way of copying this filesystem pair has not refused."""

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            done = os.pwrite(self._dest, view, self._end)
            view = view[done:]
            self._advance(done)

    def copy(self, source: int, offset: int, length: int) -> None:
        """`length` bytes of `source` from `offset`, file to file in the kernel if it can."""
        while length:
            done = self._copy_some(source, offset, min(length, SPAN))
            if done == 0:
                raise _short_source(offset)
            offset, length = offset + done, length - done
            self._advance(done)

    def gather(self, runs: FileRuns) -> None:
        """Short rows: read into a buffer with one read each, written a span at a time."""
        per_span = max(1, SPAN // runs.length)
        buffer = memoryview(bytearray(min(runs.rows, per_span) * runs.length))
        for first in range(0, runs.rows, per_span):
            count = min(per_span, runs.rows - first)
            for index in range(count):
                start = runs.offset + (first + index) * runs.stride
                row = buffer[index * runs.length : (index + 1) * runs.length]
                if os.preadv(runs.fd, [row], start) != runs.length:
                    raise _short_source(start)
            self.write(buffer[: count * runs.length])

    def _copy_some(self, source: int, offset: int, length: int) -> int:
        while True:
            copier, refusals = COPIERS[self._copier]
            try:
                return copier(source, self._dest, offset, self._end, length)
            except OSError as exc:
                if exc.errno not in refusals:
                    raise
                self._copier += 1

    def _advance(self, done: int) -> None:
        self._end += done
        if self._end - self._hashed >= SPAN:
            self.hash_landed()

    def hash_landed(self) -> None:
        """Start writing back what landed since the last span, and hash it."""
        start, end = self._hashed, self._end
        if end == start:
            return
        start_writeback(self._dest, start, end - start)
        if self._landed is not None:
            self._hasher.update(self._landed[start:end])
        else:
            self._hasher.update(_read_back(self._dest, start, end))
        if self._progress:
            self._progress(end - start)
        self._hashed = end


def _kernel_copy(source: int, dest: int, offset: int, at: int, length: int) -> int:
    return os.copy_file_range(source, dest, length, offset, at)


def _sendfile(source: int, dest: int, offset: int, at: int, length: int) -> int:
    os.lseek(dest, at, os.SEEK_SET)
    return os.sendfile(dest, source, offset, length)


def _read_write(source: int, dest: int, offset: int, at: int, length: int) -> int:
    data = os.pread(source, length, offset)
    return os.pwrite(dest, data, at) if data else 0


COPIERS = (
    (_kernel_copy, {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP}),
    (_sendfile, {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP}),
    (_read_write, set()),
)
"""Ways to copy a run, in order, each with the errors that mean "not between these files":
`copy_file_range` (one filesystem: may share extents or copy on the server), `sendfile`
(any two files whose filesystems can splice), and a plain read and write."""


def _read_back(dest: int, start: int, end: int) -> bytes:
    """The bytes the file holds in [start, end), read back from the page cache."""
    data = os.pread(dest, end - start, start)
    if len(data) != end - start:
        raise OSError(errno.EIO, "the new blob file is shorter than what was written into it")
    return data


def _short_source(offset: int) -> FlareError:
    return from_os_error(
        OSError(errno.EIO, "source file is shorter than its header says"),
        "read",
        f"tensor data at offset {offset}",
    )
