"""Small helpers the tests share."""

from __future__ import annotations

import os
import random
import subprocess
import sys
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


class CliHome:
    """One host's environment for the `flare` command: its own FLARE_HOME and config, eager
    packages (tests/test_compiled.py compiles), plus `extra` settings."""

    def __init__(self, root: Path, **extra: str) -> None:
        self.root = root
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
        env["FLARE_BUILD_TARGET"] = "none"
        self.env = env | {"FLARE_HOME": str(root), "XDG_CONFIG_HOME": str(root / "xdg")} | extra

    def run(self, *args: str, code: int = 0) -> subprocess.CompletedProcess[str]:
        """`flare ARGS`, which must exit `code`; a failure says one line, never a traceback."""
        done = subprocess.run(
            [sys.executable, "-m", "flare", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == code, (args, done.stdout, done.stderr)
        if code:
            assert done.stderr.count("\n") == 1, done.stderr  # one line: no traceback
            assert "Traceback" not in done.stderr and "internal error" not in done.stderr
        return done
