"""Source file digests, remembered by a stat record the way git's index remembers files.

A file whose device, inode, size, mtime and ctime equal its record is not read again. A
record taken within a second of the file's last change is not trusted (the file could still
change within the same timestamp), so such a file is hashed again next time.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from flare.atomic import write_file_atomic
from flare.store.digest import Digest
from flare.store.hashing import FileState, Progress, hash_bytes, hash_file_state, parallel_map

RACY_WINDOW_NS = 1_000_000_000


@dataclass(frozen=True)
class StatRecord:
    """What a file looked like when it was hashed, and its digest."""

    path: str
    state: FileState
    digest: str
    recorded_ns: int


class StatCache:
    """Stat records under a folder of the staging area, one small file per source path."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.hashed = 0
        """Files hashed (not known from their records) by this cache's users."""
        self._lock = threading.Lock()

    def _record_path(self, path: Path) -> Path:
        """The record's file, named by the path's bytes as the filesystem has them
        (`os.fsencode`: a name that is not UTF-8 has a record too, not an error)."""
        return self.folder / f"{hash_bytes(os.fsencode(path)).hex[:32]}.json"

    def lookup(self, path: Path, state: FileState) -> Digest | None:
        """The recorded digest when the file is unchanged since a trustworthy record."""
        try:
            data = json.loads(self._record_path(path).read_text())
            record = StatRecord(
                data["path"], FileState(**data["state"]), data["digest"], data["recorded_ns"]
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None
        racy = record.recorded_ns - state.mtime_ns < RACY_WINDOW_NS
        if record.path != str(path) or record.state != state or racy:
            return None
        return Digest.parse(record.digest)

    def count_hashed(self) -> None:
        with self._lock:
            self.hashed += 1

    def remember(self, path: Path, state: FileState, digest: Digest) -> None:
        record = StatRecord(str(path), state, str(digest), time.time_ns())
        write_file_atomic(self._record_path(path), json.dumps(asdict(record)).encode())


def digest_files(
    paths: Sequence[Path],
    cache: StatCache,
    rehash: bool = False,
    workers: int | None = None,
    progress: Progress | None = None,
) -> list[tuple[Digest, FileState]]:
    """Digest and state of each file: from its stat record where valid, else hashed in parallel.

    The state is what the digest is of: a later reader compares it to catch a changed file."""

    def one(path: Path) -> tuple[Digest, FileState]:
        state = FileState.of(os.stat(path))
        known = None if rehash else cache.lookup(path, state)
        if known is not None:
            if progress:
                progress(state.size)
            return known, state
        digest, seen = hash_file_state(path, progress=progress)
        cache.remember(path, seen, digest)
        cache.count_hashed()
        return digest, seen

    return parallel_map(one, paths, workers)
