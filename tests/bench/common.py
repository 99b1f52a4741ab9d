"""Helpers the benchmark scripts share: progress on stderr, commands, timing, cleanup."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def log(message: str) -> None:
    """Progress, on stderr so that --json output stays clean."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def run(*args: str | Path) -> str:
    """Run a command, fail loudly with its stderr, return its stdout."""
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, args))} failed: {done.stderr.strip()}")
    return done.stdout


def sync() -> None:
    """Flush every filesystem: nothing dirty is left for the next timed run to write."""
    run("sync")


def timed(action: Callable[[], object]) -> float:
    """Seconds the action takes."""
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def remove(path: Path) -> None:
    """Delete a file or folder if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


@contextmanager
def scratch(parent: Path | None, prefix: str) -> Iterator[Path]:
    """A fresh folder under `parent` (default /tmp) for one run, removed afterwards; left in
    place (and said so) while a filesystem is still mounted inside it."""
    parent = parent or Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield workdir
    finally:
        mounted = [p for p in workdir.rglob("*") if p.is_dir() and os.path.ismount(p)]
        if mounted:
            log(f"left {workdir} in place: {mounted[0]} is still mounted")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
