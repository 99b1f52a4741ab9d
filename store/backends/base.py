"""The interface a blob store needs from the place its files live."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

TMP_DIR = "tmp"


@dataclass
class TempFile:
    """A file being written inside the store, invisible under any blob name until committed."""

    key: str
    file: BinaryIO
    path: Path | None = None
    """Its local path, where the backend has one (for memory-mapped hashing)."""


@dataclass(frozen=True)
class StoredFile:
    """One file the backend lists: its key under the store root and its size in bytes."""

    key: str
    size: int


class Backend(Protocol):
    """Files under one root, with the atomic publish a content-addressed store relies on."""

    location: str
    stale_after_s: float
    sweep_processes: int
    """How many processes gc's sweep lists this store's folders with (store/sweep.py)."""
    network: bool
    """Other hosts share these files through clients that may cache stale listings, sizes
    and bytes: verify confirms a bad read after a pause, and nothing is memory-mapped."""

    def ensure(self, *folders: str) -> None:
        """Create the root, its working folders and `folders` if they are missing."""

    def local_path(self, key: str) -> Path | None:
        """The key's path on a local filesystem, or None when the backend has none."""

    def size(self, key: str) -> int | None:
        """The size of the file at key, or None when there is none."""

    def open_read(self, key: str) -> BinaryIO:
        """Open the file at key for reading."""

    def open_uncached(self, key: str) -> BinaryIO:
        """Open the file at key to read its bytes as stored, past this host's caches."""

    def create_temp(self) -> TempFile:
        """A new, uniquely named temporary file inside the store, open for writing."""

    def link_temp(self, source: Path) -> tuple[TempFile, str] | None:
        """Make a temporary file that shares the source's bytes (reflink or hardlink).

        Returns the temp file and the method used, or None when this backend or
        filesystem cannot share bytes with the source.
        """

    def commit(self, temp: TempFile, key: str) -> bool:
        """Make the temp file durable and read-only, then publish it at key atomically.

        Returns False (and discards the temp file) when a file was already at key.
        """

    def discard(self, temp: TempFile) -> None:
        """Close and remove a temp file that will not be published."""

    def iter_names(self, prefix: str) -> Iterator[str]:
        """The key of every file under the folder `prefix`, recursively, without a stat each."""

    def iter_files(self, prefix: str) -> Iterator[StoredFile]:
        """Every file under the folder `prefix`, recursively, with its size."""

    def move(self, key: str, new_key: str) -> None:
        """Move a file to another key (used to quarantine corrupt blobs)."""

    def move_no_clobber(self, key: str, new_key: str) -> bool:
        """Move a file to another key only if nothing is there; False (file left) if taken."""

    def remove(self, key: str) -> None:
        """Delete the file at key; a missing file is not an error."""

    def sweep_temps(self, stale_after_s: float) -> list[str]:
        """Remove temp files abandoned by dead writers; return their keys."""

    def read(self, key: str) -> bytes | None:
        """The whole content of a small file, or None when there is none."""

    def write_atomic(self, key: str, data: bytes) -> None:
        """Replace a small mutable file (a ref) so that readers see the old or the new bytes."""

    def list_dir(self, prefix: str) -> list[str]:
        """The names directly under a folder (files and folders), sorted; [] if it is absent."""

    def stat_folder(
        self, prefix: str, skip: list[list[str]]
    ) -> tuple[int, list[tuple[str, int, float]]]:
        """How many names directly under a folder the `skip` lists hold, and (name, size,
        modification time) of each other file there (0 and [] if the folder is absent): gc's
        sweep, which drops the live blobs before any per-file work, as one detailed listing
        where the store has one."""

    def stat(self, key: str) -> tuple[int, float] | None:
        """The file's size and modification time, or None when there is none."""

    def touch(self, key: str) -> bool:
        """Set the file's modification time to now (marks a blob as in use for gc's grace);
        False if there is no file (asked of the server, not of a client's cache)."""

    def exists(self, key: str) -> bool:
        """Whether a file is at key, asked of the server, not of a client's cache."""

    def free_bytes(self) -> int | None:
        """Free space under the root, where the backend can tell."""
