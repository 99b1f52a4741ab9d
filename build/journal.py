"""The build journal: each phase's outputs, recorded by the digest of its inputs.

A record is written (atomically) only after the outputs it names are durable, so a build
killed at any moment finds either a complete record or none, and a rerun with the same
inputs reuses every recorded output that is still in the store.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flare.atomic import write_file_atomic
from flare.errors import from_os_error
from flare.store.digest import Digest
from flare.store.hashing import hash_bytes
from flare.store.package import canonical_json

JOURNAL_VERSION = 1
"""Bumped when what a phase records changes: older records are then simply not found."""


def inputs_digest(phase: str, inputs: Any) -> Digest:
    """The key of a phase's record: the digest of its canonical inputs."""
    text = canonical_json({"journal": JOURNAL_VERSION, "phase": phase, "inputs": inputs})
    return hash_bytes(text.encode())


class Journal:
    """Records and locks under the staging area."""

    def __init__(self, staging: Path) -> None:
        self.staging = staging

    def _path(self, phase: str, key: Digest) -> Path:
        return self.staging / "journal" / phase / f"{key.hex}.json"

    def get(self, phase: str, key: Digest) -> dict[str, Any] | None:
        """The record for these inputs, or None (absent or unreadable: redo the phase)."""
        try:
            text = self._path(phase, key).read_bytes().decode("utf-8", "surrogateescape")
            return json.loads(text)
        except (OSError, ValueError):  # absent (FileNotFoundError), unreadable or not JSON
            return None

    def put(self, phase: str, key: Digest, record: dict[str, Any]) -> None:
        """Write the record; a path in it keeps its bytes (`surrogateescape`, undone by `get`),
        so a source folder whose name is not UTF-8 is recorded, and found again by --check."""
        text = canonical_json(record).encode("utf-8", "surrogateescape")
        write_file_atomic(self._path(phase, key), text)

    @contextmanager
    def lock(self, key: Digest) -> Iterator[bool]:
        """Hold the build lock for these inputs; yields True if another build held it first."""
        path = self.staging / "locks" / f"{key.hex}.lock"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise from_os_error(exc, "create a lock in", path.parent) from exc
        try:
            waited = False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                waited = True
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield waited
        finally:
            os.close(fd)
