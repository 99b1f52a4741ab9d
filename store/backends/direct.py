"""Writes and reads that bypass this host's page cache: a new blob's bytes go straight to the
device (O_DIRECT, with writeback started early where the filesystem refuses it), and a verify
reads a blob as stored, not as a client's cache remembers it."""

from __future__ import annotations

import ctypes
import errno
import io
import mmap
import os
from pathlib import Path
from typing import BinaryIO

from flare.store.backends.regular import open_fd, open_file

WRITEBACK_EVERY = 64 << 20
"""Buffered writes: bytes written between requests to start writing them to disk."""
ALIGN = 4096
"""O_DIRECT needs buffers, offsets and lengths aligned to the device's blocks."""
STAGE = 16 << 20
_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing a range of the file to disk now, without waiting:
    the fsync that makes the file durable then waits for the last range only."""
    if _sync_file_range is not None:
        _sync_file_range(fd, ctypes.c_int64(offset), ctypes.c_int64(length), _SYNC_FILE_RANGE_WRITE)


def _open_direct(path: Path) -> int | None:
    """A second descriptor on the file that bypasses the page cache, where allowed."""
    try:
        return os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError:
        return None  # tmpfs and some network filesystems refuse O_DIRECT


class BlobFile(io.RawIOBase):
    """A new blob's temp file, written straight to the device where the filesystem allows.

    Writing through the page cache costs a copy into pages the kernel must find first, and on
    a VM that can be three times slower than the disk; O_DIRECT moves the bytes from an
    aligned staging buffer to the device instead, so a durable put costs what the disk does.
    The unaligned tail goes through the page cache, and fsync makes the whole file durable.
    Where O_DIRECT is refused, writes are buffered and the kernel is asked to start writeback
    as they fill, so the final fsync waits for the last few megabytes only.
    """

    def __init__(self, fd: int, path: Path) -> None:
        super().__init__()
        self._fd = fd
        self._direct = _open_direct(path)
        self._stage = mmap.mmap(-1, STAGE) if self._direct is not None else None
        self._staged = 0
        self._offset = 0
        """Bytes already in the file."""
        self._written_back = 0

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def write(self, data: bytes | memoryview) -> int:  # type: ignore[override]
        """Take all of `data` (a raw write may stop short; at ENOSPC the next one raises)."""
        view = memoryview(data).cast("B")
        if self._stage is None:
            self._write_buffered(view)
            return len(view)
        done = 0
        while done < len(view):
            take = min(len(view) - done, STAGE - self._staged)
            self._stage[self._staged : self._staged + take] = view[done : done + take]
            self._staged += take
            done += take
            if self._staged == STAGE:
                self._write_stage(STAGE)
        return len(view)

    def _write_stage(self, length: int) -> None:
        """Write the first `length` staged bytes (a multiple of ALIGN) with O_DIRECT."""
        assert self._stage is not None and self._direct is not None
        with memoryview(self._stage) as staged:
            done = 0
            while done < length:
                try:
                    done += os.pwrite(self._direct, staged[done:length], self._offset + done)
                except OSError as exc:
                    if exc.errno != errno.EINVAL or done:
                        raise
                    break
            else:
                rest = self._staged - length
                staged[:rest] = staged[length : self._staged]
                self._offset += length
                self._staged = rest
                return
        self._fall_back_to_buffered()

    def _fall_back_to_buffered(self) -> None:
        """The filesystem took O_DIRECT at open but refuses its writes: buffer from now on."""
        assert self._stage is not None and self._direct is not None
        with memoryview(self._stage) as staged:
            pending = bytes(staged[: self._staged])
        os.close(self._direct)
        self._stage.close()
        self._direct, self._stage, self._staged = None, None, 0
        self._write_buffered(memoryview(pending))

    def _write_buffered(self, view: memoryview) -> None:
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], self._offset + done)
        self._offset += done
        if self._offset - self._written_back >= WRITEBACK_EVERY:
            start_writeback(self._fd, self._written_back, self._offset - self._written_back)
            self._written_back = self._offset

    def flush(self) -> None:
        """Write what is staged: the aligned part directly, the tail through the page cache."""
        if self._stage is None or not self._staged or self.closed:
            return
        aligned = self._staged - self._staged % ALIGN
        if aligned:
            self._write_stage(aligned)
        if self._stage is not None and self._staged:
            with memoryview(self._stage) as staged:
                tail = bytes(staged[: self._staged])
            self._staged = 0
            self._write_buffered(memoryview(tail))

    def close(self) -> None:
        """Close without writing what is staged (commit flushes; a discarded file is dropped)."""
        if self.closed:
            return
        if self._direct is not None:
            os.close(self._direct)
        if self._stage is not None:
            self._stage.close()
        os.close(self._fd)
        self._staged = 0
        super().close()


class DirectReader(io.RawIOBase):
    """Reads a file past the client's page cache: O_DIRECT reads of aligned chunks into an
    aligned buffer, so every byte comes from the disk or, on a network filesystem, from the
    server. verify re-reads a blob this way before it calls the blob corrupt."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd
        self._buffer = mmap.mmap(-1, STAGE)  # page-aligned, as O_DIRECT needs
        self._offset = 0
        """Bytes of the file read into the buffer so far (a multiple of ALIGN until EOF)."""
        self._start = 0
        self._end = 0
        """The buffer's bytes not yet returned: [_start, _end)."""
        self._eof = False
        """Set by a read that ended short of ALIGN: the file ends there."""

    def readable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def readinto(self, target: bytearray | memoryview) -> int:  # type: ignore[override]
        if self._start == self._end and not self._eof:
            self._fill()
        take = min(len(target), self._end - self._start)
        with memoryview(target).cast("B") as view:
            view[:take] = self._buffer[self._start : self._start + take]
        self._start += take
        return take

    def _fill(self) -> None:
        """Read the next aligned chunk into the buffer."""
        self._start, self._end = 0, os.preadv(self._fd, [self._buffer], self._offset)
        self._offset += self._end
        self._eof = self._end % ALIGN != 0 or self._end == 0

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._offset - (self._end - self._start)

    def seek(self, position: int, whence: int = os.SEEK_SET) -> int:
        """Go to a position: read from the aligned offset below it, skip the rest."""
        if whence == os.SEEK_CUR:
            position += self.tell()
        elif whence == os.SEEK_END:
            position += os.fstat(self._fd).st_size
        self._offset = position - position % ALIGN
        self._start = self._end = 0
        self._eof = False
        if position > self._offset:
            self._fill()
            self._start = min(position % ALIGN, self._end)
        return position

    def close(self) -> None:
        if not self.closed:
            self._buffer.close()
            os.close(self._fd)
        super().close()


def open_uncached(path: Path) -> BinaryIO:
    """A reader of the file's bytes as stored, not as this host's cache remembers them: a
    fresh open with O_DIRECT where the filesystem takes it (local disks, NFS, FUSE), else a
    fresh open after dropping the file's cached pages (posix_fadvise DONTNEED). What is no
    regular file is refused without being read (store/backends/regular.py)."""
    try:
        fd = open_fd(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # tmpfs and some filesystems refuse O_DIRECT
            raise
    else:
        try:
            reader = DirectReader(fd)
            reader.readinto(bytearray(0))  # the first read tells whether O_DIRECT reads work
            return reader  # type: ignore[return-value]
        except OSError as exc:
            reader.close()
            if exc.errno != errno.EINVAL:
                raise
    handle = open_file(path, buffering=0)
    os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return handle  # type: ignore[return-value]
