"""Registries on both index backends, and tiny packages to fill them."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from flare.build.pipeline import Build, BuildRequest, PhaseReport
from flare.build.tiny import make_tiny_llama
from flare.registry.registry import Registry
from flare.store import Digest

BACKENDS = ["sqlite", "postgresql"]


class Quiet:
    """Build events, dropped."""

    def phase_started(self, name: str, total: int) -> None: ...
    def advance(self, nbytes: int) -> None: ...
    def phase_finished(self, report: PhaseReport) -> None: ...
    def note(self, message: str) -> None: ...


@contextmanager
def database(backend: str, folder: Path) -> Iterator[str]:
    """A fresh, empty index DB URL on the given backend (a new PostgreSQL database each time)."""
    if backend == "sqlite":
        yield f"sqlite:///{folder / 'index.db'}"
        return
    server = os.environ.get("FLARE_TEST_POSTGRES")
    if not server:
        if os.environ.get("CI"):
            pytest.fail("CI must start PostgreSQL and set FLARE_TEST_POSTGRES (.ci/run does)")
        pytest.skip("set FLARE_TEST_POSTGRES to a server URL to test the PostgreSQL backend")
    with postgres_database(server) as url:
        yield url


@contextmanager
def postgres_database(server: str) -> Iterator[str]:
    """A fresh PostgreSQL database on the server, dropped afterwards (the test suite's and the
    soak's: tests/faults/trials.py)."""
    name = f"flare_test_{secrets.token_hex(6)}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f"CREATE DATABASE {name}"))
    try:
        yield server.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as connection:
            connection.execute(text(f"DROP DATABASE {name} WITH (FORCE)"))
        admin.dispose()


@contextmanager
def lab_env(backend: str, folder: Path) -> Iterator[dict[str, str]]:
    """The environment of a lab host: a shared registry folder and a fresh index DB URL."""
    with database(backend, folder) as url:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
        env["FLARE_BUILD_TARGET"] = "none"  # eager packages: tests/test_compiled.py compiles
        env |= {
            "FLARE_HOME": str(folder / "home"),
            "XDG_CONFIG_HOME": str(folder / "xdg"),
            "FLARE_REGISTRY": str(folder / "shared"),
            "FLARE_DATABASE": url,
        }
        yield env


def flare(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run the flare command to its end; with `check`, it must succeed."""
    done = subprocess.run(
        [sys.executable, "-m", "flare", *args], env=env, capture_output=True, text=True, timeout=300
    )
    if check:
        assert done.returncode == 0, (args, done.stderr)
    return done


def answered(
    env: dict[str, str], *args: str, timeout: int = 120
) -> subprocess.CompletedProcess[str]:
    """Run the real command: it must answer within `timeout` (a hang fails the test, it does
    not block the suite) and print no traceback; its exit code is the caller's to check."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "flare", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"flare {' '.join(args)} hung (no answer in {timeout} s)")
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr, done.stderr
    return done


def start(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    """Start the flare command and return at once (to kill it, or to run beside it)."""
    return subprocess.Popen(
        [sys.executable, "-m", "flare", *args],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def stopped_at(env: dict[str, str], points: str, *args: str) -> subprocess.Popen[str]:
    """Start the flare command, set to stop (SIGSTOP) at crash points (`NAME[:N],...`, faults.py);
    return once it stopped at the first."""
    process = start(env | {"FLARE_STOP_AT": points}, *args)
    wait_stopped(process, points)
    return process


def wait_stopped(process: subprocess.Popen[str], point: str) -> None:
    """Wait until the process has stopped (at `point`, which the message names)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        state = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "T":
            return
        assert process.poll() is None, f"ended before {point}: {process.communicate()}"
        time.sleep(0.02)
    process.kill()
    raise AssertionError(f"never reached {point}")


def carry_on(process: subprocess.Popen[str]) -> str:
    """Let a stopped command go on; it must succeed. Returns what it printed."""
    process.send_signal(signal.SIGCONT)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    return out


def age(folder: Path, seconds: float) -> None:
    """Set every file under folder back in time, as if written that long ago."""
    then = time.time() - seconds
    for path in folder.rglob("*"):
        if path.is_file():
            os.utime(path, (then, then), follow_symlinks=False)


def tiny_source(root: Path, seed: int) -> Path:
    """A tiny checkpoint per seed, made once per folder."""
    folder = root / f"tiny-{seed}"
    if not (folder / "model.safetensors").exists():
        make_tiny_llama(folder, seed=seed)
    return folder


def tiny_sources(root: Path, count: int) -> Path:
    """`count` tiny checkpoints, `tiny-0` to `tiny-<count - 1>`, under root."""
    for seed in range(count):
        tiny_source(root, seed)
    return root


def build_into(
    registry: Registry, source: Path, name: str, staging: Path, tag: str = "latest"
) -> Digest:
    """Build and publish a package; return its digest."""
    request = BuildRequest(
        source=str(source), name=name, tag=tag, staging=staging, hub_cache=staging / "hub"
    )
    return Build(request, registry, Quiet()).run().digest
