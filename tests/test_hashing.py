"""Parallel hashing: the digest never depends on threads, and changes are caught."""

from __future__ import annotations

from pathlib import Path

import pytest
from blake3 import blake3
from helpers import hash_files, write_random

from flare.errors import IntegrityError
from flare.store.hashing import MMAP_SLICE, hash_file


@pytest.fixture
def large_file(tmp_path: Path) -> tuple[Path, bytes]:
    """A file that spans more than one hashing slice."""
    path = tmp_path / "large.bin"
    return path, write_random(path, MMAP_SLICE + 12345)


@pytest.mark.parametrize("threads", [1, 2, 4, None])
def test_digest_is_the_same_whatever_the_thread_count(
    large_file: tuple[Path, bytes], threads: int | None
) -> None:
    path, data = large_file
    digest, size = hash_file(path, threads=threads)
    assert digest.hex == blake3(data).hexdigest()
    assert size == len(data)


def test_empty_file_hashes_like_empty_bytes(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert hash_file(empty)[0].hex == blake3(b"").hexdigest()


def test_many_files_in_parallel_match_one_at_a_time(tmp_path: Path) -> None:
    paths = [tmp_path / f"f{i}" for i in range(12)]
    contents = [write_random(p, 1000 * i + 7, seed=i) for i, p in enumerate(paths)]
    parallel = hash_files(paths, workers=4)
    assert [d.hex for d, _ in parallel] == [blake3(c).hexdigest() for c in contents]
    assert parallel == hash_files(paths, workers=1)


def test_a_file_that_changes_while_hashed_is_refused(large_file: tuple[Path, bytes]) -> None:
    path, _ = large_file

    def append_once(_n: int) -> None:
        if path.stat().st_size == MMAP_SLICE + 12345:
            with open(path, "ab") as handle:
                handle.write(b"late bytes")

    with pytest.raises(IntegrityError, match="changed while it was read"):
        hash_file(path, progress=append_once)
