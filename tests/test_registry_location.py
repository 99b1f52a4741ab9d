"""Which registry a command opens, and with which index DB.

Only commands that write (build, `registry copy --to`) create a registry; every other one
says there is none at a folder that holds none (a working folder, the host cache) and leaves
it as it was. A folder is one registry however it is spelled (`/x`, `/x/`, `file:///x`).
`registry.database` is the index of the configured registry (paths.registry), not of every
registry a command names; a bad URL or a PostgreSQL database that does not exist is one line
and exit 10."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import RunFlare
from registry_helpers import database, flare, tiny_source
from sqlalchemy import create_engine, text

NOT_FOUND, INDEX_UNUSABLE = 3, 10


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert "Traceback" not in stderr and "internal error" not in stderr, stderr
    return lines[0]


def tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_source(tmp_path_factory.mktemp("sources"), 0)


def names(run_flare: RunFlare, *args: str, env: dict[str, str] | None = None) -> list[str]:
    done = run_flare("registry", "ls", "--json", *args, env=env)
    assert done.returncode == 0, done.stderr
    return [row["name"] for row in json.loads(done.stdout)]


# -- item 4: reading commands create nothing; one folder, one registry ------------------------


def test_reading_commands_on_a_folder_without_a_registry_exit_3_and_leave_it_alone(
    run_flare: RunFlare, tmp_path: Path, source: Path
) -> None:
    assert run_flare("key", "generate", "--publisher", "alice").returncode == 0
    assert run_flare("build", str(source), "--name", "tiny").returncode == 0
    assert run_flare("pull", "tiny", "--device", "cpu").returncode == 0
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("a working folder\n")
    cache = tmp_path / "home" / "packages"  # the host cache: blobs, no registry
    for folder in (work, cache):
        before = tree(folder)
        for command in (
            ("registry", "ls"),
            ("registry", "show", "tiny"),
            ("registry", "gc", "--dry-run"),
            ("registry", "reindex"),
            ("registry", "verify"),
            ("verify", "tiny"),
            ("pull", "tiny", "--device", "cpu"),
        ):
            done = run_flare(*command, "--registry", str(folder))
            assert done.returncode == NOT_FOUND, (command, done.stderr)
            assert one_line(done.stderr).startswith(f"error: no registry at {folder};")
            assert "`flare build` or `flare registry copy --to` creates one" in done.stderr
        assert tree(folder) == before  # no index.db, no lock file


def test_writing_commands_create_the_registry(
    run_flare: RunFlare, tmp_path: Path, source: Path
) -> None:
    built = tmp_path / "built"
    assert (
        run_flare("build", str(source), "--name", "tiny", "--registry", str(built)).returncode == 0
    )
    copied = tmp_path / "copied"
    done = run_flare("registry", "copy", "tiny", "--from", str(built), "--to", str(copied))
    assert done.returncode == 0, done.stderr
    assert names(run_flare, "--registry", str(copied)) == ["tiny"]


def test_a_file_url_and_its_path_are_one_registry(
    run_flare: RunFlare, tmp_path: Path, source: Path
) -> None:
    folder = tmp_path / "reg"
    url = f"file://{folder}"
    assert run_flare("build", str(source), "--name", "a", "--registry", url).returncode == 0
    for spelling in (str(folder), f"{folder}/", f"{tmp_path}/x/../reg", url):
        assert names(run_flare, "--registry", spelling) == ["a"], spelling
    assert run_flare("registry", "tag", "a", "a:v1", "--registry", f"{folder}/").returncode == 0
    rows = json.loads(run_flare("registry", "ls", "--json", "--registry", url).stdout)
    assert rows[0]["tags"] == ["latest", "v1"]
    assert not (tmp_path / "home" / "indexes").exists()  # no second, per-host index of it


def test_a_lost_index_db_is_filled_from_the_store_when_made_again(
    run_flare: RunFlare, tmp_path: Path, source: Path
) -> None:
    assert run_flare("build", str(source), "--name", "a").returncode == 0
    (tmp_path / "home" / "registry" / "index.db").unlink()
    done = run_flare("registry", "ls", "--json")
    assert [row["name"] for row in json.loads(done.stdout)] == ["a"]
    assert "filled the new index DB" in done.stderr and "(1 package records)" in done.stderr


# -- item 3: registry.database, and its errors -------------------------------------------------


@pytest.fixture
def postgres(tmp_path: Path) -> Iterator[str]:
    with database("postgresql", tmp_path) as url:
        yield url


def test_registry_database_indexes_the_configured_registry_however_it_is_spelled(
    run_flare: RunFlare, tmp_path: Path, source: Path, postgres: str
) -> None:
    """A lab's PostgreSQL is the index of the lab's registry: that registry named as
    `file://...` or with a trailing slash is indexed there too; a copy's destination keeps its
    own index, and PostgreSQL lists only the lab registry's packages."""
    shared = tmp_path / "shared"
    lab = {"FLARE_REGISTRY": str(shared), "FLARE_DATABASE": postgres}
    assert run_flare("build", str(source), "--name", "a", env=lab).returncode == 0
    for spelling in (f"file://{shared}", f"{shared}/"):
        assert names(run_flare, "--registry", spelling, env=lab) == ["a"]
    assert not (shared / "index.db").exists()
    other = tmp_path / "other"
    done = run_flare("registry", "copy", "a", "--to", str(other), env=lab)
    assert done.returncode == 0, done.stderr
    assert (other / "index.db").exists()
    done = run_flare("registry", "rm", "a", "--registry", str(other), env=lab)
    assert done.returncode == 0, done.stderr
    assert names(run_flare, "--registry", str(other), env=lab) == []
    assert names(run_flare, env=lab) == ["a"]  # the lab's index lost nothing
    engine = create_engine(postgres)
    with engine.connect() as connection:
        assert connection.execute(text("SELECT name FROM publications")).all() == [("a",)]
    engine.dispose()


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("not a url", "Could not parse SQLAlchemy URL"),
        ("postgresql+psycopg://flare:secret@db:5432:1/flare", "invalid literal for int()"),
        ("sqlite://", "a SQLite URL must name a file"),
    ],
)
def test_a_malformed_database_url_is_one_line_and_exit_10(
    run_flare: RunFlare, tmp_path: Path, source: Path, url: str, says: str
) -> None:
    assert run_flare("build", str(source), "--name", "a").returncode == 0
    done = run_flare("registry", "ls", env={"FLARE_DATABASE": url})
    assert done.returncode == INDEX_UNUSABLE, done.stderr
    line = one_line(done.stderr)
    assert "is not a usable index DB URL" in line and says in line
    assert "postgresql+psycopg://USER@HOST/DB" in line and "secret" not in line


def test_a_postgresql_database_that_does_not_exist_says_to_create_it(
    tmp_path: Path, source: Path, postgres: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
    env |= {"FLARE_HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    env |= {"FLARE_BUILD_TARGET": "none"}
    missing = postgres.rsplit("/", 1)[0] + "/no_such_db"
    built = flare(
        env | {"FLARE_DATABASE": missing}, "build", str(source), "--name", "a", check=False
    )
    assert built.returncode == INDEX_UNUSABLE, built.stderr
    line = one_line(built.stderr)
    assert "the PostgreSQL database no_such_db does not exist on 127.0.0.1:" in line
    assert "createdb no_such_db" in line


def test_an_empty_registry_or_payload_size_is_refused_not_taken_for_the_default(
    run_flare: RunFlare, tmp_path: Path, source: Path
) -> None:
    """`--registry ''` (an unset shell variable, most often) would have opened the configured
    registry, a build publishing where it was not sent; `--payload-size 0` would make every
    tensor a blob. Both are one line, exit 4, before any work."""
    for args in (
        ("registry", "ls", "--registry", ""),
        ("build", str(source), "--name", "tiny", "--registry", " "),
        ("registry", "show", "tiny", "--registry", ""),
    ):
        done = run_flare(*args)
        assert done.returncode == 4, (args, done.stderr)
        assert "is empty; give a path or URL" in one_line(done.stderr)
    done = run_flare("registry", "copy", "no-such-package", "--to", "")  # not "not found"
    assert done.returncode == 4, done.stderr
    assert "'' is empty; give a path or URL, or name the registry to copy to" in done.stderr
    done = run_flare("build", str(source), "--name", "tiny", "--payload-size", "0")
    assert done.returncode == 4
    assert one_line(done.stderr) == (
        "error: --payload-size 0 is no size for a payload; use e.g. 256M (the default)"
    )
    assert not (tmp_path / "home" / "registry").exists()


def test_a_build_without_a_good_name_or_tag_creates_no_registry(
    run_flare: RunFlare, tmp_path: Path, source: Path
) -> None:
    """A build refused for its name, its tag, or a missing --name says so in one line
    (exit 4) before the registry is opened: a registry path that did not exist is not made."""
    fresh = tmp_path / "fresh-registry"
    for args, says in (
        (("--name", "Bad Name"), "bad package name 'Bad Name'"),
        (("--name", "tiny", "--tag", "x/y"), "bad tag 'x/y'"),
        ((), "flare build needs SOURCE and --name"),
    ):
        done = run_flare("build", str(source), *args, "--registry", str(fresh))
        assert done.returncode == 4, (args, done.stderr)
        assert says in one_line(done.stderr)
        assert not fresh.exists()


def test_a_workers_count_outside_its_range_is_a_usage_error(
    run_flare: RunFlare, source: Path
) -> None:
    """`--workers 0` ran with the default; `--workers 100000` would have started as many
    threads as there were blobs. Both are refused (exit 2) by every command that takes it."""
    for command in (
        ("registry", "copy", "tiny", "--to", "elsewhere"),
        ("registry", "verify"),
        ("store", "verify"),
        ("build", str(source), "--name", "tiny"),
    ):
        for workers in ("0", "100000"):
            done = run_flare(*command, "--workers", workers)
            assert done.returncode == 2, (command, workers, done.stderr)
            assert "is not in the range 1<=x<=256" in done.stderr, done.stderr
