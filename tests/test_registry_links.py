"""A registry's own folders are never links, and flare writes, sweeps and removes nothing
through one. Anyone who may write to a shared registry could make `tmp/` a link to a folder
of another user's (whose gc, build or copy would then sweep that user's old files) or
`refs/NAME` a link out of the registry (whose tag or untag would write or remove there): each
is refused in one line, exit 6, and nothing outside the registry is touched."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from conftest import RunFlare
from registry_helpers import tiny_source

INTEGRITY = 6


@pytest.fixture
def built(run_flare: RunFlare, tmp_path: Path) -> Path:
    """The registry folder of a host that built one package."""
    done = run_flare("build", str(tiny_source(tmp_path / "src", 0)), "--name", "alpha")
    assert done.returncode == 0, done.stderr
    registry = next(p.parent for p in tmp_path.rglob("blobs") if (p.parent / "refs").is_dir())
    return registry


def victims_folder(tmp_path: Path) -> Path:
    """A folder of another user's, its files two hours old (what a temp sweep removes)."""
    folder = tmp_path / "victim"
    folder.mkdir()
    for name in ("thesis.tex", "results.csv"):
        (folder / name).write_text("months of work")
        then = time.time() - 7200
        os.utime(folder / name, (then, then))
    return folder


@pytest.mark.parametrize(
    "command",
    [("registry", "gc", "--grace", "1h"), ("build", "SOURCE", "--name", "beta")],
    ids=["gc", "build"],
)
def test_a_tmp_folder_made_a_link_out_is_refused_and_what_it_leads_to_kept(
    run_flare: RunFlare, built: Path, tmp_path: Path, command: tuple[str, ...]
) -> None:
    victim = victims_folder(tmp_path)
    (built / "tmp").rmdir()
    (built / "tmp").symlink_to(victim)
    source = str(tiny_source(tmp_path / "src", 1))
    done = run_flare(*(source if part == "SOURCE" else part for part in command))
    assert done.returncode == INTEGRITY, done.stderr
    assert f"{built / 'tmp'} is a link to {victim}" in done.stderr
    assert "Traceback" not in done.stderr
    assert sorted(p.name for p in victim.iterdir()) == ["results.csv", "thesis.tex"]


def test_a_name_folder_made_a_link_out_is_neither_written_nor_removed_through(
    run_flare: RunFlare, built: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    (outside / "tags").mkdir(parents=True)
    planted = outside / "tags" / "latest"
    planted.write_text("kept\n")
    (built / "refs" / "gamma").symlink_to(outside)
    tagged = run_flare("registry", "tag", "alpha", "gamma:planted")
    assert tagged.returncode == INTEGRITY, tagged.stderr
    untagged = run_flare("registry", "untag", "gamma:latest")
    assert untagged.returncode != 0, untagged.stderr
    assert sorted(p.name for p in outside.rglob("*")) == ["latest", "tags"]
    assert planted.read_text() == "kept\n"
