"""Helpers the benchmark scripts share: progress on stderr, commands, timing, cleanup."""

from __future__ import annotations

import compileall
import functools
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


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


@functools.cache
def flare_command() -> list[str]:
    """The installed `flare` script beside this Python (else `python -m flare`), with flare's
    modules compiled to bytecode first, as `pip install` leaves them. An editable checkout
    run under PYTHONDONTWRITEBYTECODE (set on this VM) would otherwise compile every flare
    module from source in every timed process: about 40 ms no installed flare pays."""
    import flare

    root = Path(flare.__file__).parent
    compileall.compile_dir(root, quiet=1, rx=re.compile(r"/(\.venv|\.git|tests)/"))
    script = shutil.which("flare", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "flare"]


def flare_env(home: Path, config_home: Path, **settings: str | None) -> dict[str, str]:
    """This environment with every FLARE_ setting dropped but FLARE_HOME, FLARE_BUILD_TARGET
    (none: builds compile nothing unless a bench says --target) and the given ones
    (`registry="..."` sets FLARE_REGISTRY; None sets nothing). XDG_CONFIG_HOME points at an
    empty folder so that no user config file redirects the staging folder or the registry."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
    env["FLARE_HOME"] = str(home)
    env["XDG_CONFIG_HOME"] = str(config_home)
    env["FLARE_BUILD_TARGET"] = "none"  # builds prepare nothing unless a bench asks (--target)
    env.update({f"FLARE_{key.upper()}": value for key, value in settings.items() if value})
    return env


def replay_seconds(graph: Any, replays: int) -> float:
    """The median seconds of `replays` replays of a captured CUDA graph, each timed by CUDA
    events around it (after one untimed replay)."""
    import torch

    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)
