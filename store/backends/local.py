"""A store on a local path (a NAS mount is a local path): fsync, rename, read-only blobs."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import io
import os
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from flare.store.backends.base import TMP_DIR, StoredFile, TempFile
from flare.store.backends.linking import hardlink, reflink
from flare.store.errors import FlareError, from_os_error

WRITEBACK_EVERY = 64 << 20
"""Bytes written between requests to start writing them to disk."""
_SYNC_FILE_RANGE_WRITE = 2
_libc = ctypes.CDLL(None, use_errno=True)
_sync_file_range = getattr(_libc, "sync_file_range", None)


class WritebackFile(io.FileIO):
    """A file that asks the kernel to start writing its pages to disk as they fill.

    The final fsync then waits for the last few megabytes instead of the whole blob, so
    hashing, copying and disk writes overlap: a durable put costs about what `cp` + `sync` does.
    """

    _flushed = 0

    def write(self, data: bytes | memoryview) -> int:  # type: ignore[override]
        """Write all of `data`: a raw write may stop short (at ENOSPC, the next one raises)."""
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += super().write(view[done:]) or 0
        self._start_writeback()
        return done

    def _start_writeback(self) -> None:
        position = self.tell()
        if _sync_file_range is not None and position - self._flushed >= WRITEBACK_EVERY:
            start, length = ctypes.c_int64(self._flushed), ctypes.c_int64(position - self._flushed)
            _sync_file_range(self.fileno(), start, length, _SYNC_FILE_RANGE_WRITE)
            self._flushed = position


def fsync_dir(path: Path) -> None:
    """Make a rename or link inside `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: Path, data: bytes) -> None:
    """Write a small file durably: temp file beside it, fsync, rename, fsync the folder."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{temp_name()}")
        try:
            with open(partial, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
        fsync_dir(path.parent)
    except OSError as exc:
        raise from_os_error(exc, "write", path) from exc


def make_dir_durable(path: Path) -> None:
    """Create a folder (and parents) so that a crash cannot lose its entry."""
    if path.is_dir():
        return
    make_dir_durable(path.parent)
    try:
        path.mkdir()
    except FileExistsError:
        return
    fsync_dir(path.parent)


def publish_no_clobber(temp: Path, dest: Path) -> bool:
    """Give the temp file its final name only if that name is free; False if it was taken.

    A hardlink fails atomically when the name exists, so of two racing writers exactly one
    publishes and nobody replaces a blob another host may be reading. Where links are not
    supported, fall back to rename (the content is the same by construction).
    """
    try:
        os.link(temp, dest)
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
            raise
        os.replace(temp, dest)
    return True


def temp_name() -> str:
    """A unique temp file name that says which host and process writes it."""
    host = socket.gethostname().replace(".", "_") or "host"
    return f"{host}.{os.getpid()}.{secrets.token_hex(8)}.part"


class LocalBackend:
    """Files under a directory. Writers hold an flock on their temp file while they write."""

    stale_after_s = 900.0
    """A temp file this old whose writer holds no lock was abandoned by a dead process."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.location = str(root)

    def _path(self, key: str) -> Path:
        return self.root / key

    def ensure(self) -> None:
        try:
            (self.root / TMP_DIR).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise from_os_error(exc, "create the store at", self.root) from exc

    def local_path(self, key: str) -> Path:
        return self._path(key)

    def size(self, key: str) -> int | None:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            return None

    def open_read(self, key: str) -> BinaryIO:
        try:
            return open(self._path(key), "rb")
        except OSError as exc:
            raise from_os_error(exc, "read", self._path(key)) from exc

    def create_temp(self) -> TempFile:
        path = self.root / TMP_DIR / temp_name()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise from_os_error(exc, "create a temporary file in", path.parent) from exc
        fcntl.flock(fd, fcntl.LOCK_EX)
        return TempFile(key=f"{TMP_DIR}/{path.name}", file=WritebackFile(fd, "wb"), path=path)

    def link_temp(self, source: Path) -> tuple[TempFile, str] | None:
        temp = self.create_temp()
        assert temp.path is not None
        try:
            with open(source, "rb") as src:
                if reflink(src.fileno(), temp.file.fileno()):
                    return temp, "reflink"
            self.discard(temp)
            return self._hardlink_temp(source)
        except OSError as exc:
            self.discard(temp)
            raise from_os_error(exc, "link", source) from exc

    def _hardlink_temp(self, source: Path) -> tuple[TempFile, str] | None:
        path = self.root / TMP_DIR / temp_name()
        if not hardlink(source, path):
            return None
        handle = open(path, "rb", buffering=0)  # noqa: SIM115 (returned, closed by commit)
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        if not _same_file(path, handle.fileno()):  # a sweeper took it before we locked it
            handle.close()
            return None
        try:  # read-only from now on, so the bytes we hash are the bytes we publish
            os.fchmod(handle.fileno(), 0o444)
        except PermissionError:  # not our file to freeze: copy it instead
            handle.close()
            path.unlink(missing_ok=True)
            return None
        return TempFile(key=f"{TMP_DIR}/{path.name}", file=handle, path=path), "hardlink"  # type: ignore[arg-type]

    def commit(self, temp: TempFile, key: str) -> bool:
        assert temp.path is not None
        dest = self._path(key)
        if dest.exists():
            self.discard(temp)
            return False
        try:
            fd = temp.file.fileno()
            os.fsync(fd)
            os.fchmod(fd, 0o444)
            make_dir_durable(dest.parent)
            published = publish_no_clobber(temp.path, dest)
            fsync_dir(dest.parent)
        except OSError as exc:
            self.discard(temp)
            raise from_os_error(exc, "publish a blob at", dest) from exc
        self.discard(temp)
        return published

    def discard(self, temp: TempFile) -> None:
        temp.file.close()
        if temp.path is not None:
            temp.path.unlink(missing_ok=True)

    def iter_names(self, prefix: str) -> Iterator[str]:
        """Folders are told from files by the directory entry's type: no stat per file."""
        folders = [prefix.strip("/")]
        root = str(self.root)
        while folders:
            folder = folders.pop()
            try:
                entries = list(os.scandir(f"{root}/{folder}"))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for entry in entries:
                key = f"{folder}/{entry.name}"
                if entry.is_dir(follow_symlinks=False):
                    folders.append(key)
                else:
                    yield key

    def iter_files(self, prefix: str) -> Iterator[StoredFile]:
        root = str(self.root)
        for key in self.iter_names(prefix):
            try:
                yield StoredFile(key=key, size=os.stat(f"{root}/{key}").st_size)
            except FileNotFoundError:
                continue

    def move(self, key: str, new_key: str) -> None:
        dest = self._path(new_key)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(self._path(key), dest)
            fsync_dir(dest.parent)
        except OSError as exc:
            raise from_os_error(exc, "move", self._path(key)) from exc

    def remove(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as exc:
            raise from_os_error(exc, "remove", self._path(key)) from exc

    def sweep_temps(self, stale_after_s: float) -> list[str]:
        """Remove temp files older than the threshold whose writer no longer holds its lock."""
        removed = []
        try:
            entries = list(os.scandir(self.root / TMP_DIR))
        except FileNotFoundError:
            return removed
        cutoff = time.time() - stale_after_s
        for entry in entries:
            if _is_abandoned(entry, cutoff):
                Path(entry.path).unlink(missing_ok=True)
                removed.append(f"{TMP_DIR}/{entry.name}")
        return removed

    def read(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise from_os_error(exc, "read", self._path(key)) from exc

    def write_atomic(self, key: str, data: bytes) -> None:
        write_file_atomic(self._path(key), data)

    def list_dir(self, prefix: str) -> list[str]:
        """Names under a folder, without dot-files (a small file's temp copy while written)."""
        try:
            return sorted(n for n in os.listdir(self._path(prefix)) if not n.startswith("."))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def stat(self, key: str) -> tuple[int, float] | None:
        try:
            st = os.stat(f"{self.root}/{key}")
        except FileNotFoundError:
            return None
        return st.st_size, st.st_mtime

    def touch(self, key: str) -> None:
        """Best effort: another user's blob cannot be touched (leases protect it instead)."""
        with contextlib.suppress(FileNotFoundError, PermissionError):
            os.utime(self._path(key))

    def free_bytes(self) -> int | None:
        try:
            st = os.statvfs(self.root)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize


def _same_file(path: Path, fd: int) -> bool:
    """True while `path` still names the file open as `fd`."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    return os.path.samestat(st, os.fstat(fd))


def _is_abandoned(entry: os.DirEntry[str], cutoff: float) -> bool:
    """True for a temp file untouched since `cutoff` whose lock nobody holds (its owner died)."""
    try:
        if entry.stat(follow_symlinks=False).st_mtime > cutoff:
            return False
        fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        raise FlareError(f"cannot check the lock of {entry.path}: {exc.strerror}") from exc
    finally:
        os.close(fd)
    return True
