"""Registries on both index backends, and tiny packages to fill them."""

from __future__ import annotations

import os
import secrets
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
