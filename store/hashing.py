"""BLAKE3 hashing: one large file on several threads, many files on a thread pool.

BLAKE3 is a tree hash, so the digest is the same whatever the thread count; threads only
change how fast it comes.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from blake3 import blake3

from flare.errors import IntegrityError, from_os_error
from flare.store.digest import Digest

Progress = Callable[[int], None]
"""Called with the number of bytes just processed."""

T = TypeVar("T")
R = TypeVar("R")

MMAP_SLICE = 64 << 20
"""Bytes fed to the hasher per call: large enough for all threads, small enough for progress."""


def new_hasher(threads: int | None = None) -> blake3:
    """A hasher that uses `threads` threads for large inputs (None: as many as useful)."""
    return blake3(max_threads=blake3.AUTO if threads is None else max(1, threads))


def hash_bytes(data: bytes | memoryview) -> Digest:
    """The digest of bytes held in memory."""
    return Digest(new_hasher().update(data).hexdigest())


@dataclass(frozen=True)
class FileState:
    """What tells us a file changed: identity, size and modification times."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileState:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def check_unchanged(path: Path, before: FileState, after: FileState) -> None:
    """Refuse a result computed from a file that changed while it was read."""
    if before != after:
        raise IntegrityError(
            f"{path} changed while it was read (size {before.size} -> {after.size})",
            "nothing was stored under a wrong digest; retry once the file is no longer written",
        )


def hash_open_file(fd: int, size: int, threads: int | None, progress: Progress | None) -> str:
    """Hash `size` bytes of an open file through a read-only memory map, in slices."""
    hasher = new_hasher(threads)
    if size == 0:
        return hasher.hexdigest()
    with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            for offset in range(0, size, MMAP_SLICE):
                piece = view[offset : offset + MMAP_SLICE]
                hasher.update(piece)
                piece.release()
                if progress:
                    progress(min(MMAP_SLICE, size - offset))
        finally:
            view.release()
    return hasher.hexdigest()


def hash_file(
    path: Path, threads: int | None = None, progress: Progress | None = None
) -> tuple[Digest, int]:
    """Hash one file, using several threads on its tree; fails if the file changes meanwhile."""
    digest, state = hash_file_state(path, threads, progress)
    return digest, state.size


def hash_file_state(
    path: Path, threads: int | None = None, progress: Progress | None = None
) -> tuple[Digest, FileState]:
    """Hash one file and return the state it had throughout (for stat records)."""
    try:
        with open(path, "rb", buffering=0) as handle:
            before = FileState.of(os.fstat(handle.fileno()))
            hex_digest = hash_open_file(handle.fileno(), before.size, threads, progress)
            after = FileState.of(os.fstat(handle.fileno()))
    except OSError as exc:
        raise from_os_error(exc, "read", path) from exc
    except ValueError as exc:  # mmap: the size this host saw has moved (a network client's)
        raise IntegrityError(
            f"{path} changed while it was read ({exc})", "retry once it is no longer written"
        ) from exc
    check_unchanged(path, before, after)
    return Digest(hex_digest), before


def default_workers() -> int:
    """Worker threads for many-file work: the cores this process may use."""
    return max(1, len(os.sched_getaffinity(0)))


def parallel_map(
    action: Callable[[T], R], items: Iterable[T], workers: int | None = None
) -> list[R]:
    """Apply `action` to every item on a thread pool; results keep the items' order."""
    listed: Sequence[T] = list(items)
    if len(listed) <= 1 or workers == 1:
        return [action(item) for item in listed]
    with ThreadPoolExecutor(max_workers=workers or default_workers()) as pool:
        return list(pool.map(action, listed))
