"""A store behind an fsspec URL (memory://, s3:// with s3fs, ...), through the same interface.

Object stores have no rename that is atomic and no locks, so a blob is written under tmp/ and
moved into place once complete; abandoned temp files are recognised by age alone.

Object stores have no folders either, but other filesystems fsspec reaches (local://, sftp://,
smb://) do, and write nothing into a folder that is not there: a write or move to a key whose
folder is missing makes the folder and tries once more, so an object store pays nothing for it.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import fsspec

from flare.atomic import temp_name
from flare.errors import FlareError, InvalidInputError, from_os_error
from flare.extras import install_hint
from flare.store.backends.base import TMP_DIR, StoredFile, TempFile

_T = TypeVar("_T")


class FsspecBackend:
    """Files under an fsspec URL."""

    stale_after_s = 86400.0
    """Without locks, only age says a temp file was abandoned: wait a day."""
    sweep_processes = 1
    """An fsspec client (its event loop, its connections) may not survive a fork."""

    def __init__(self, url: str) -> None:
        try:
            self.fs, root = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as exc:
            raise InvalidInputError(
                f"cannot open store {url}: {exc}",
                f"install the filesystem's package (s3:// needs `{install_hint('s3')}`)",
            ) from exc
        self.root = root.rstrip("/")
        self.location = url
        protocols = {self.fs.protocol} if isinstance(self.fs.protocol, str) else self.fs.protocol
        self.network = "memory" not in protocols
        """Other hosts read the same objects through their own clients (memory:// is one
        process's own)."""

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def _into(self, key: str, write: Callable[[], _T]) -> _T:
        """Run `write`, which puts a file at key; if key's folder is missing (a filesystem with
        real folders), make it and run `write` once more. On an object store the first try
        succeeds, so this costs no request there."""
        try:
            return write()
        except OSError as exc:
            if not _is_missing(exc):
                raise
        parent = self._path(key).rsplit("/", 1)[0]
        self.fs.makedirs(parent, exist_ok=True)
        return write()

    def ensure(self, *folders: str) -> None:
        try:
            for folder in (TMP_DIR, *folders):
                self.fs.makedirs(self._path(folder), exist_ok=True)
        except OSError as exc:
            raise from_os_error(exc, "create the store at", self.location) from exc

    def local_path(self, key: str) -> Path | None:
        return None

    def size(self, key: str) -> int | None:
        try:
            return int(self.fs.info(self._path(key))["size"])
        except FileNotFoundError:
            return None

    def open_read(self, key: str) -> BinaryIO:
        try:
            return self.fs.open(self._path(key), "rb")
        except OSError as exc:
            raise from_os_error(exc, "read", self._path(key)) from exc

    def open_uncached(self, key: str) -> BinaryIO:
        self.fs.invalidate_cache(self._path(key))
        return self.open_read(key)

    def create_temp(self) -> TempFile:
        key = f"{TMP_DIR}/{temp_name()}"
        try:
            file = self._into(key, lambda: self.fs.open(self._path(key), "wb"))
            return TempFile(key=key, file=file)
        except OSError as exc:
            raise from_os_error(exc, "create a temporary file in", self.location) from exc

    def link_temp(self, source: Path) -> tuple[TempFile, str] | None:
        return None

    def commit(self, temp: TempFile, key: str) -> bool:
        try:
            temp.file.close()
            if self.fs.exists(self._path(key)):
                self.remove(temp.key)
                return False
            self._into(key, lambda: self.fs.mv(self._path(temp.key), self._path(key)))
        except OSError as exc:
            self.remove(temp.key)
            raise from_os_error(exc, "publish a blob at", self._path(key)) from exc
        return True

    def discard(self, temp: TempFile) -> None:
        temp.file.close()
        self.remove(temp.key)

    def iter_names(self, prefix: str) -> Iterator[str]:
        for stored in self.iter_files(prefix):
            yield stored.key

    def iter_files(self, prefix: str) -> Iterator[StoredFile]:
        top = self._path(prefix)
        if not self.fs.exists(top):
            return
        for path, info in self.fs.find(top, detail=True).items():
            key = path[len(self.root) + 1 :] if path.startswith(self.root) else path
            yield StoredFile(key=key.lstrip("/"), size=int(info["size"]))

    def move(self, key: str, new_key: str) -> None:
        try:
            self._into(new_key, lambda: self.fs.mv(self._path(key), self._path(new_key)))
        except OSError as exc:
            raise from_os_error(exc, "move", self._path(key)) from exc

    def move_no_clobber(self, key: str, new_key: str) -> bool:
        if self.fs.exists(self._path(new_key)):
            return False
        self.move(key, new_key)
        return True

    def remove(self, key: str) -> None:
        try:
            self.fs.rm(self._path(key))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise FlareError(f"cannot remove {self._path(key)}: {exc}") from exc

    def sweep_temps(self, stale_after_s: float) -> list[str]:
        cutoff = time.time() - stale_after_s
        removed = []
        for stored in list(self.iter_files(TMP_DIR)):
            modified = _modified(self.fs.info(self._path(stored.key)))
            if modified is not None and modified < cutoff:
                self.remove(stored.key)
                removed.append(stored.key)
        return removed

    def read(self, key: str) -> bytes | None:
        try:
            return self.fs.cat_file(self._path(key))
        except FileNotFoundError:
            return None

    def write_atomic(self, key: str, data: bytes) -> None:
        try:
            # object stores replace objects whole
            self._into(key, lambda: self.fs.pipe_file(self._path(key), data))
        except OSError as exc:
            raise from_os_error(exc, "write", self._path(key)) from exc

    def list_dir(self, prefix: str) -> list[str]:
        try:
            entries = self.fs.ls(self._path(prefix), detail=False)
        except FileNotFoundError:
            return []
        return sorted(str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def stat_folder(
        self, prefix: str, skip: list[list[str]]
    ) -> tuple[int, list[tuple[str, int, float]]]:
        """One detailed listing gives every size and time: no request per file."""
        try:
            entries = self.fs.ls(self._path(prefix), detail=True)
        except FileNotFoundError:
            return 0, []
        skipped, dropped, found = set().union(*skip), 0, []
        for info in entries:
            name = str(info["name"]).rstrip("/").rsplit("/", 1)[-1]
            if name in skipped:
                dropped += 1
            elif info.get("type") == "file":
                found.append((name, int(info["size"]), _modified(info) or 0.0))
        return dropped, found

    def stat(self, key: str) -> tuple[int, float] | None:
        try:
            info = self.fs.info(self._path(key))
        except FileNotFoundError:
            return None
        return int(info["size"]), _modified(info) or 0.0

    def touch(self, key: str) -> bool:
        """Object stores cannot change a modification time without rewriting the object."""
        return self.exists(key)

    def exists(self, key: str) -> bool:
        self.fs.invalidate_cache(self._path(key))
        return bool(self.fs.exists(self._path(key)))

    def free_bytes(self) -> int | None:
        return None


def _is_missing(exc: OSError) -> bool:
    """Whether an error says a path (here: a folder on the way to a key) does not exist; some
    clients (smbprotocol's) raise an OSError subclass that carries ENOENT without being a
    FileNotFoundError."""
    return isinstance(exc, FileNotFoundError) or exc.errno == errno.ENOENT


def _modified(info: dict[str, Any]) -> float | None:
    """A file's modification time from whichever field this filesystem reports."""
    for field in ("mtime", "LastModified", "created", "last_modified"):
        value = info.get(field)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, int | float):
            return float(value)
    return None
