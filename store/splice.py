"""A blob given as pieces of open files: written by the kernel, hashed as it lands.

A package payload is a new header followed by byte ranges of checkpoint files. Copying those
ranges through Python costs two copies per byte (into a buffer, out to the file); the kernel
copies them file to file instead (`copy_file_range`, which on some filesystems shares the
extents or copies on the server; `sendfile` across filesystems), as `cp` does. The digest is
taken from the written file itself, read back from the page cache in spans as they land, so
a blob is correct by construction even if a source changed meanwhile; writeback of each span
starts at once, so the final fsync waits for the last span only.
"""

from __future__ import annotations

import errno
import io
import mmap
import os
from collections.abc import Sequence
from typing import NamedTuple

from blake3 import blake3

from flare.store.backends.local import start_writeback
from flare.store.errors import FlareError, from_os_error
from flare.store.hashing import Progress, new_hasher

SPAN = 16 << 20
"""Bytes copied before they are hashed and their writeback started: large enough to keep
the disk busy, small enough to be hashed while they are still in the CPU's reach."""
_NO_KERNEL_COPY = {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP}
"""copy_file_range refusals that sendfile does not share (another filesystem, mostly)."""


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
    with mmap.mmap(dest, size, prot=mmap.PROT_READ) as mapped, memoryview(mapped) as landed:
        writer = _SpanWriter(dest, landed, hasher, progress)
        for piece in pieces:
            if isinstance(piece, bytes):
                writer.write(piece)
            else:
                for row in range(piece.rows):
                    writer.copy(piece.fd, piece.offset + row * piece.stride, piece.length)
        writer.hash_landed()
    return hasher.hexdigest()


class _SpanWriter:
    """Appends to the file, and hashes and starts writing back each span once it is full."""

    def __init__(
        self, dest: int, landed: memoryview, hasher: blake3, progress: Progress | None
    ) -> None:
        self._dest, self._landed, self._hasher, self._progress = dest, landed, hasher, progress
        self._end = 0
        self._hashed = 0
        self._kernel_copy = True

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            done = os.pwrite(self._dest, view, self._end)
            view = view[done:]
            self._advance(done)

    def copy(self, source: int, offset: int, length: int) -> None:
        """`length` bytes of `source` from `offset`, file to file in the kernel."""
        while length:
            done = self._copy_some(source, offset, min(length, SPAN))
            if done == 0:
                raise _short_source(offset)
            offset, length = offset + done, length - done
            self._advance(done)

    def _copy_some(self, source: int, offset: int, length: int) -> int:
        if self._kernel_copy:
            try:
                return os.copy_file_range(source, self._dest, length, offset, self._end)
            except OSError as exc:
                if exc.errno not in _NO_KERNEL_COPY:
                    raise
                self._kernel_copy = False
        os.lseek(self._dest, self._end, os.SEEK_SET)
        return os.sendfile(self._dest, source, offset, length)

    def _advance(self, done: int) -> None:
        self._end += done
        if self._end - self._hashed >= SPAN:
            self.hash_landed()

    def hash_landed(self) -> None:
        """Start writing back what landed since the last span, and hash it."""
        if self._end == self._hashed:
            return
        start_writeback(self._dest, self._hashed, self._end - self._hashed)
        self._hasher.update(self._landed[self._hashed : self._end])
        if self._progress:
            self._progress(self._end - self._hashed)
        self._hashed = self._end


def _short_source(offset: int) -> FlareError:
    return from_os_error(
        OSError(errno.EIO, "source file is shorter than its header says"),
        "read",
        f"tensor data at offset {offset}",
    )
