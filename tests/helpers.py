"""Small helpers the tests share."""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path

from flare.store.digest import Digest
from flare.store.hashing import Progress, hash_file, parallel_map


def write_random(path: Path, size: int, seed: int = 0) -> bytes:
    """A file of seeded pseudo-random bytes; returns them."""
    data = random.Random(seed).randbytes(size)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


def hash_files(
    paths: Iterable[Path], workers: int | None = None, progress: Progress | None = None
) -> list[tuple[Digest, int]]:
    """Hash many files at once, each also on several threads: the many-files case of the
    hashing tests and of bench_store (the build hashes through its stat cache instead)."""
    return parallel_map(lambda path: hash_file(path, progress=progress), paths, workers)
