"""Shared fixtures: a fresh store, the real `flare` command, small real filesystems."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from flare.store import BlobStore


@pytest.fixture
def store(tmp_path: Path) -> BlobStore:
    """An empty local store."""
    return BlobStore(tmp_path / "store")


@pytest.fixture
def flare_env(tmp_path: Path) -> dict[str, str]:
    """An environment where flare sees no user config and keeps everything under tmp_path.
    Builds prepare nothing (target none) unless a test asks: compiling a forward takes a
    minute on two cores, so tests/test_compiled.py does it once per session."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
    env["FLARE_HOME"] = str(tmp_path / "home")
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    env["FLARE_BUILD_TARGET"] = "none"
    return env


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """paths.kernel_cache shared by the session's builds: a forward of given shapes compiles
    once per test run (a minute on two cores), then every build of those shapes reuses it."""
    return tmp_path_factory.mktemp("kernel-cache")


RunFlare = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def run_flare(flare_env: dict[str, str]) -> RunFlare:
    """Run the real `flare` command (as `python -m flare`) and capture what it prints."""

    def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "flare", *args],
            env={**flare_env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=120,
        )

    return run


def mount_tmpfs(path: Path, size: str, *options: str) -> None:
    """Mount a small tmpfs at path (root only); skip the test where that is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    opts = ",".join((f"size={size}", *options))
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 4 MiB filesystem, to run out of space on."""
    mount = tmp_path / "small"
    mount_tmpfs(mount, "4m")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)
