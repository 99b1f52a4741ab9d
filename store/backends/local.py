"""A store on a local path (a NAS mount is a local path): fsync, rename, read-only blobs.

Every file is opened through store/backends/regular.py: a FIFO, socket or device where a blob
(or a ref, lease or temp file) belongs is never opened for reading, so it neither blocks a
command nor gets read; it counts as a damaged blob (verify quarantines it, a writer replaces it).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import time
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from stat import S_ISREG
from typing import BinaryIO

from flare.atomic import fsync_dir, host_name, temp_name, write_file_atomic
from flare.errors import FlareError, IntegrityError, from_os_error
from flare.store.backends.base import TMP_DIR, StoredFile, TempFile
from flare.store.backends.direct import BlobFile, open_uncached
from flare.store.backends.filesystems import on_network_filesystem
from flare.store.backends.linking import hardlink, reflink
from flare.store.backends.regular import NotAFileError, open_fd, open_file
from flare.store.hashing import default_workers

_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
_renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
_NOT_SUPPORTED = {errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS, errno.EINVAL}
"""What link(2) or renameat2(2) answer where a filesystem lacks them (sshfs: no
RENAME_NOREPLACE; some SMB servers: no hard links)."""


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
    publishes and nobody replaces a blob another host may be reading. Where the filesystem has
    no hard links, rename(2) with RENAME_NOREPLACE does the same; where it has neither, the
    name is checked and then replaced (the content is the same by construction, so a writer
    that loses that race replaces a blob with identical bytes).
    """
    try:
        os.link(temp, dest)
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in _NOT_SUPPORTED:
            raise
        return _rename_no_clobber(temp, dest)
    return True


def _rename_no_clobber(temp: Path, dest: Path) -> bool:
    """rename(2) that refuses an existing name, else a check and a plain rename."""
    if _renameat2 is not None:
        done = _renameat2(_AT_FDCWD, bytes(temp), _AT_FDCWD, bytes(dest), _RENAME_NOREPLACE)
        if done == 0:
            return True
        failed = ctypes.get_errno()
        if failed == errno.EEXIST:
            return False
        if failed not in _NOT_SUPPORTED:
            raise OSError(failed, os.strerror(failed), str(dest))
    if dest.exists():
        return False
    os.replace(temp, dest)
    return True


FOREIGN_STALE_S = 86400.0
"""Another host's temp file on a network filesystem is abandoned after this long unchanged."""


MAX_SWEEP_PROCESSES = 8
"""gc's sweep is CPU work here (names, sets, stats): one process per core, up to this many."""


class LocalBackend:
    """Files under a directory. Writers hold an flock on their temp file while they write."""

    stale_after_s = 900.0
    """A temp file this old whose writer holds no lock was abandoned by a dead process."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.location = str(root)
        self.sweep_processes = min(MAX_SWEEP_PROCESSES, default_workers())

    def _path(self, key: str) -> Path:
        """Where a key's file is, once no folder on the way there is a link (`_folder`)."""
        folder, _, name = key.rpartition("/")
        return self._folder(folder) / name if folder else self.root / key

    def _folder(self, folder: str) -> Path:
        """A folder of the store, refused if it or a folder above it (below the root) is a
        link: a store's own folders never are, and anyone who may write to a shared registry
        could make `tmp/` or `refs/NAME` a link to a folder of another user's, whose files
        that user's gc would then sweep, or a tag write or remove (IntegrityError, exit 6)."""
        path = self.root
        for part in folder.split("/"):
            path = path / part
            if path.is_symlink():
                raise IntegrityError(
                    f"{path} is a link to {os.readlink(path)}: a registry's own folders are "
                    "never links, and flare writes and removes nothing through one",
                    "replace the link with a folder (another user's hand?), then run flare "
                    "registry verify",
                )
        return path

    def ensure(self, *folders: str) -> None:
        try:
            for folder in (TMP_DIR, *folders):
                self._folder(folder).mkdir(parents=True, exist_ok=True)
                self._folder(folder)  # made meanwhile as a link: refused all the same
        except OSError as exc:
            raise from_os_error(exc, "create the store at", self.root) from exc

    def local_path(self, key: str) -> Path:
        return self._path(key)

    def size(self, key: str) -> int | None:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            return None

    @cached_property
    def network(self) -> bool:
        """True when other hosts may share this folder (its client may cache stale data)."""
        return on_network_filesystem(self.root)

    def open_read(self, key: str) -> BinaryIO:
        try:
            return open_file(self._path(key))
        except OSError as exc:
            raise from_os_error(exc, "read", self._path(key)) from exc

    def open_uncached(self, key: str) -> BinaryIO:
        try:
            return open_uncached(self._path(key))
        except OSError as exc:
            raise from_os_error(exc, "read", self._path(key)) from exc

    def create_temp(self) -> TempFile:
        path = self._folder(TMP_DIR) / temp_name()
        try:
            # read too: a spliced blob is hashed from its own pages (store/splice.py)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise from_os_error(exc, "create a temporary file in", path.parent) from exc
        fcntl.flock(fd, fcntl.LOCK_EX)
        return TempFile(key=f"{TMP_DIR}/{path.name}", file=BlobFile(fd, path), path=path)

    def link_temp(self, source: Path) -> tuple[TempFile, str] | None:
        try:
            src = open_file(source)
        except OSError as exc:
            raise from_os_error(exc, "link", source) from exc
        with src:
            temp = self.create_temp()
            assert temp.path is not None
            try:
                if reflink(src.fileno(), temp.file.fileno()):
                    return temp, "reflink"
            except OSError as exc:
                self.discard(temp)
                raise from_os_error(exc, "link", source) from exc
        self.discard(temp)
        try:
            return self._hardlink_temp(source)
        except OSError as exc:
            raise from_os_error(exc, "link", source) from exc

    def _hardlink_temp(self, source: Path) -> tuple[TempFile, str] | None:
        path = self._folder(TMP_DIR) / temp_name()
        if not hardlink(source, path):
            return None
        try:  # the source's inode: a FIFO swapped in for the source is refused, not read
            handle = open_file(path, buffering=0)  # returned, closed by commit
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        if not _same_file(path, handle.fileno()):  # a sweeper took it before we locked it
            handle.close()
            return None
        try:  # read-only from now on, so the bytes we hash are the bytes we publish
            os.fchmod(handle.fileno(), 0o444)
            # and new from now on: the blob will be this inode, and gc tells a blob just
            # stored from garbage by its modification time, which is still the source's
            os.utime(handle.fileno())
        except PermissionError:  # not our file to freeze: copy it instead
            handle.close()
            path.unlink(missing_ok=True)
            return None
        return TempFile(key=f"{TMP_DIR}/{path.name}", file=handle, path=path), "hardlink"  # type: ignore[arg-type]

    def commit(self, temp: TempFile, key: str) -> bool:
        assert temp.path is not None
        dest = self._path(key)
        if self.exists(key):
            self.discard(temp)
            return False
        try:
            temp.file.flush()
            fd = temp.file.fileno()
            os.fsync(fd)
            os.fchmod(fd, 0o444)
            make_dir_durable(dest.parent)
            published = publish_no_clobber(temp.path, dest)
            if not published and not self.exists(key):  # a client's stale "exists"
                os.replace(temp.path, dest)  # the same bytes by construction
                published = True
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
        while folders:
            folder = folders.pop()
            try:
                entries = list(os.scandir(self._folder(folder)))
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

    def move_no_clobber(self, key: str, new_key: str) -> bool:
        source, dest = self._path(key), self._path(new_key)
        try:
            make_dir_durable(dest.parent)
            if not publish_no_clobber(source, dest):
                if self.exists(new_key):
                    return False
                os.replace(source, dest)  # the name was taken only in a client's stale cache
            source.unlink(missing_ok=True)  # the link's source; gone already after a rename
            fsync_dir(dest.parent)
            fsync_dir(source.parent)
        except OSError as exc:
            raise from_os_error(exc, "move", source) from exc
        return True

    def remove(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as exc:
            raise from_os_error(exc, "remove", self._path(key)) from exc

    def sweep_temps(self, stale_after_s: float) -> list[str]:
        """Remove temp files older than the threshold whose writer no longer holds its lock.

        On a network filesystem a lock is seen on its own host only (sshfs has no remote
        locks; NFS mounted with local_lock neither): another host's temp file is left until it
        is FOREIGN_STALE_S old, as on an object store."""
        removed = []
        try:
            entries = list(os.scandir(self._folder(TMP_DIR)))
        except FileNotFoundError:
            return removed
        now, mine = time.time(), f"{host_name()}."
        for entry in entries:
            foreign = self.network and not entry.name.startswith(mine)
            cutoff = now - (max(stale_after_s, FOREIGN_STALE_S) if foreign else stale_after_s)
            if _is_abandoned(entry, cutoff):
                Path(entry.path).unlink(missing_ok=True)
                removed.append(f"{TMP_DIR}/{entry.name}")
        return removed

    def read(self, key: str) -> bytes | None:
        """The bytes of the file at key; None if there is none. A folder raises (the cause an
        IsADirectoryError, as reading one would), and a special file NotAFileError."""
        try:
            with open_file(self._path(key)) as handle:
                return handle.read()
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

    def stat_folder(
        self, prefix: str, skip: list[list[str]]
    ) -> tuple[int, list[tuple[str, int, float]]]:
        """One listing; the skipped names dropped from its set, list by list (no Python work
        per skipped name); then a stat relative to the open folder for each name left (no
        path walk per file). A name removed meanwhile is left out."""
        try:
            fd = os.open(self._folder(prefix.strip("/")), os.O_RDONLY | os.O_DIRECTORY)
        except (FileNotFoundError, NotADirectoryError):
            return 0, []
        found = []
        try:
            names = set(os.listdir(fd))
            listed = len(names)
            for listing in skip:
                names.difference_update(listing)
            for name in names:
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if S_ISREG(st.st_mode):
                    found.append((name, st.st_size, st.st_mtime))
        finally:
            os.close(fd)
        return listed - len(names), found

    def stat(self, key: str) -> tuple[int, float] | None:
        try:
            st = os.stat(self._path(key))
        except FileNotFoundError:
            return None
        return st.st_size, st.st_mtime

    def touch(self, key: str) -> bool:
        """Through a fresh open (a network client's cached attributes may list a file another
        host removed); setting the time is best effort: another user's blob cannot be touched
        (leases protect it instead). A special file there (a FIFO, a device) is there, but is
        neither opened nor touched: a writer finds it holds no blob, and replaces it."""
        try:
            fd = open_fd(self._path(key), folders=True)
        except NotAFileError:
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise from_os_error(exc, "touch", self._path(key)) from exc
        try:
            with contextlib.suppress(PermissionError):
                os.utime(fd)
        finally:
            os.close(fd)
        return True

    def exists(self, key: str) -> bool:
        """Asked by opening the file: a fresh answer from the server of a network filesystem
        (sshfs and NFS check on open), where a stat may answer from the client's cache. A
        folder or a special file there (not opened) is there too: what holds a key's name."""
        try:
            os.close(open_fd(self._path(key), folders=True))
        except NotAFileError:
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise from_os_error(exc, "open", self._path(key)) from exc
        return True

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
        fd = open_fd(entry.path)
    except (OSError, NotAFileError):
        return False  # unreadable, or no temp file of ours (a folder, a FIFO): left alone
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        raise FlareError(f"cannot check the lock of {entry.path}: {exc.strerror}") from exc
    finally:
        os.close(fd)
    return True
