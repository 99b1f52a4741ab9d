"""The registry under faults: processes killed (SIGKILL) at its crash points and at seeded random
times, and ref files damaged by hand. After each, the next command works and `registry verify`
answers as docs/package-format.md says ("Garbage collection", "Refs")."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from registry_helpers import BACKENDS, flare, lab_env, tiny_sources
from sqlalchemy import create_engine, inspect

from flare.registry.models import metadata

KILLED = -signal.SIGKILL
NOT_FOUND, INDEX_UNUSABLE = 3, 10


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_sources(tmp_path_factory.mktemp("sources"), 4)


@pytest.fixture(params=BACKENDS)
def lab(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, str]]:
    with lab_env(request.param, tmp_path) as env:
        yield env


def crashing(env: dict[str, str], point: str) -> dict[str, str]:
    """The same host, set to die with SIGKILL at a crash point (faults.py)."""
    return env | {"FLARE_CRASH_AT": point}


def listed(env: dict[str, str], *args: str) -> list[tuple[str, str, tuple[str, ...]]]:
    rows = json.loads(flare(env, "registry", "ls", "--json", *args).stdout)
    return sorted((r["name"], r["digest"], tuple(r["tags"])) for r in rows)


# -- item 7: a new index DB ------------------------------------------------------------------


def test_a_kill_between_creating_and_stamping_the_index_db_bricks_nothing(
    lab: dict[str, str], sources: Path
) -> None:
    killed = flare(
        crashing(lab, "index:stamp"), "build", str(sources / "tiny-0"), "--name", "a", check=False
    )
    assert killed.returncode == KILLED, killed.stderr
    flare(lab, "build", str(sources / "tiny-0"), "--name", "a")
    assert [(name, tags) for name, _, tags in listed(lab)] == [("a", ("latest",))]
    flare(lab, "registry", "reindex")
    flare(lab, "registry", "verify")


def test_a_copy_killed_while_it_creates_the_new_registry_s_index_db(
    tmp_path: Path, sources: Path
) -> None:
    """Seen in the field: `registry copy --to NEW` killed as it made NEW's SQLite index."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
    env |= {"FLARE_HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    flare(env, "build", str(sources / "tiny-0"), "--name", "a")
    new = str(tmp_path / "new")
    killed = flare(crashing(env, "index:stamp"), "registry", "copy", "a", "--to", new, check=False)
    assert killed.returncode == KILLED, killed.stderr
    assert listed(env, "--registry", new) == []
    flare(env, "registry", "copy", "a", "--to", new)
    assert listed(env, "--registry", new) == listed(env)
    flare(env, "registry", "verify", "--registry", new)


def test_an_index_db_without_its_version_row_is_made_again(
    lab: dict[str, str], sources: Path
) -> None:
    """What an older flare's killed creation left: every table, no alembic version row."""
    engine = create_engine(lab["FLARE_DATABASE"])
    with engine.begin() as connection:
        metadata.create_all(connection)
    engine.dispose()
    flare(lab, "build", str(sources / "tiny-0"), "--name", "a")
    assert [name for name, _, _ in listed(lab)] == ["a"]
    engine = create_engine(lab["FLARE_DATABASE"])
    with engine.connect() as connection:
        assert "alembic_version" in inspect(connection).get_table_names()
    engine.dispose()
