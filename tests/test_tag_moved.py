"""Moving a tag off a package is allowed but never silent: `flare build`, `flare registry
tag` and `flare registry copy` say, on stderr, which tag moved from which package, and
whether that package is still kept (pinned, or tagged otherwise) or now left to gc; --json
carries the same. Real builds, real registries and the real `flare` command."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import RunFlare
from registry_helpers import build_into, tiny_sources

from flare.registry import refs
from flare.registry.copy import copy_package
from flare.registry.registry import Registry
from flare.store import Digest


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_sources(tmp_path_factory.mktemp("sources"), 2)


def build(run_flare: RunFlare, source: Path, name: str, *extra: str) -> Digest:
    """Build with the real command; the package's digest."""
    built = run_flare("build", str(source), "--name", name, "--json", *extra)
    assert built.returncode == 0, built.stderr
    return Digest.parse(json.loads(built.stdout)["digest"])


def moves(done: subprocess.CompletedProcess[str]) -> list[str]:
    """The `moved ...` notices a command printed on stderr (a progress line may sit beside)."""
    return [line for line in done.stderr.splitlines() if line.startswith("moved ")]


def listed(run_flare: RunFlare, *registry: str) -> dict[str, dict[str, object]]:
    rows = json.loads(run_flare("registry", "ls", "--json", *registry).stdout)
    return {row["digest"]: row for row in rows}


# -- the registry API -------------------------------------------------------------------------


def test_publish_returns_the_package_a_tag_left_and_none_otherwise(
    sources: Path, tmp_path: Path
) -> None:
    registry = Registry(str(tmp_path / "registry"), f"sqlite:///{tmp_path / 'index.db'}")
    staging = tmp_path / "staging"
    a = build_into(registry, sources / "tiny-0", "alpha", staging)
    b = build_into(registry, sources / "tiny-1", "alpha", staging, tag="v2")
    manifest = refs.read_manifest(registry.store, a)
    assert registry.publish("alpha", "latest", a, manifest) is None  # the same package
    assert registry.publish("alpha", "new", a, manifest) is None  # a new tag
    assert registry.publish("alpha", None, a, manifest) is None  # no tag at all
    assert registry.publish("alpha", "new", b, refs.read_manifest(registry.store, b)) == a

    name, tag, digest, move = registry.tag("alpha:v2", "alpha:latest")
    assert (name, tag, digest) == ("alpha", "latest", b)
    assert move == refs.TagMove("alpha", "latest", a, b, pinned=False, tags=())
    assert registry.tag("alpha:v2", "alpha:latest")[3] is None
    registry.db.dispose()


def test_copy_reports_each_tag_it_moved_after_every_tag_moved(
    sources: Path, tmp_path: Path
) -> None:
    staging = tmp_path / "staging"
    source = Registry(str(tmp_path / "source"), f"sqlite:///{tmp_path / 'source.db'}")
    a = build_into(source, sources / "tiny-0", "alpha", staging)
    source.tag("alpha", "alpha:v1")
    dest = Registry(str(tmp_path / "dest"), f"sqlite:///{tmp_path / 'dest.db'}")
    b = build_into(dest, sources / "tiny-1", "alpha", staging)
    dest.tag("alpha", "alpha:v1")
    report = copy_package(source, dest, "alpha")
    assert sorted(report.tags) == ["latest", "v1"]
    # read once both tags moved: neither still keeps b, though one did after the first move
    assert sorted(report.moved, key=lambda m: m.tag) == [
        refs.TagMove("alpha", "latest", b, a, pinned=False, tags=()),
        refs.TagMove("alpha", "v1", b, a, pinned=False, tags=()),
    ]
    assert copy_package(source, dest, "alpha").moved == []
    source.db.dispose()
    dest.db.dispose()


# -- flare registry copy ----------------------------------------------------------------------


def test_copy_onto_a_pinned_package_moves_the_tag_and_says_the_old_one_is_still_pinned(
    run_flare: RunFlare, sources: Path, tmp_path: Path
) -> None:
    dest = str(tmp_path / "dest")
    a = build(run_flare, sources / "tiny-0", "alpha")
    old = build(run_flare, sources / "tiny-1", "alpha", "--registry", dest)
    assert run_flare("registry", "pin", "alpha", "--registry", dest).returncode == 0

    copied = run_flare("registry", "copy", "alpha", "--to", dest)
    assert copied.returncode == 0, copied.stderr
    assert moves(copied) == [
        f"moved alpha:latest from {old.short()} to {a.short()}; the old package "
        f"alpha@{old.short()} is still pinned"
    ]
    assert copied.stdout.startswith(f"copied alpha@{a} to ")
    rows = listed(run_flare, "--registry", dest)
    assert rows[str(old)]["pinned"] is True and rows[str(old)]["tags"] == []
    assert rows[str(a)]["tags"] == ["latest"]
    assert run_flare("registry", "show", f"alpha@{old.hex}", "--registry", dest).returncode == 0

    again = run_flare("registry", "copy", "alpha", "--to", dest, "--json")
    assert again.returncode == 0, again.stderr
    assert moves(again) == [] and json.loads(again.stdout)["moved"] == []


def test_copy_json_carries_the_move_and_says_when_the_old_package_is_left_to_gc(
    run_flare: RunFlare, sources: Path, tmp_path: Path
) -> None:
    dest = str(tmp_path / "dest")
    a = build(run_flare, sources / "tiny-0", "alpha")
    old = build(run_flare, sources / "tiny-1", "alpha", "--registry", dest)

    copied = run_flare("registry", "copy", "alpha", "--to", dest, "--json")
    assert copied.returncode == 0, copied.stderr
    assert json.loads(copied.stdout)["moved"] == [
        {
            "name": "alpha",
            "tag": "latest",
            "from": str(old),
            "to": str(a),
            "old_pinned": False,
            "old_tags": [],
        }
    ]
    (notice,) = moves(copied)
    assert notice == (
        f"moved alpha:latest from {old.short()} to {a.short()}; the old package "
        f"alpha@{old.short()} keeps no tag or pin of alpha now, so gc may collect it unless "
        f"another name tags or pins it (flare registry pin alpha@{old.short()} keeps it)"
    )
    assert str(old) in listed(run_flare, "--registry", dest)  # told, not removed


# -- flare registry tag -----------------------------------------------------------------------


def test_tag_says_when_it_moves_a_tag_and_nothing_when_it_does_not(
    run_flare: RunFlare, sources: Path
) -> None:
    a = build(run_flare, sources / "tiny-0", "alpha")
    b = build(run_flare, sources / "tiny-1", "alpha", "--tag", "v2")
    assert run_flare("registry", "tag", "alpha", "alpha:v1").returncode == 0

    moved = run_flare("registry", "tag", "alpha:v2", "alpha:latest")
    assert moved.returncode == 0, moved.stderr
    assert moves(moved) == [
        f"moved alpha:latest from {a.short()} to {b.short()}; the old package "
        f"alpha@{a.short()} is still tagged alpha:v1"
    ]
    assert moved.stdout.strip() == f"alpha:latest -> {b}"

    same = run_flare("registry", "tag", "alpha:v2", "alpha:latest")
    assert same.returncode == 0 and same.stderr == ""
    fresh = run_flare("registry", "tag", "alpha:v2", "alpha:v3", "--json")
    assert fresh.returncode == 0 and fresh.stderr == ""
    assert json.loads(fresh.stdout)["moved"] == []

    assert run_flare("registry", "pin", f"alpha@{a.hex}").returncode == 0
    back = run_flare("registry", "tag", f"alpha@{a.hex}", "alpha:v2", "--json")
    assert back.returncode == 0, back.stderr
    assert moves(back) == [
        f"moved alpha:v2 from {b.short()} to {a.short()}; the old package "
        f"alpha@{b.short()} is still tagged alpha:latest, alpha:v3"
    ]
    (field,) = json.loads(back.stdout)["moved"]
    assert field["from"] == str(b) and field["old_tags"] == ["latest", "v3"]

    again = run_flare("registry", "tag", "alpha:v3", "alpha:v1")
    assert moves(again) == [
        f"moved alpha:v1 from {a.short()} to {b.short()}; the old package "
        f"alpha@{a.short()} is still pinned and tagged alpha:v2"
    ]


def test_a_build_that_moves_its_tag_says_so(run_flare: RunFlare, sources: Path) -> None:
    first = build(run_flare, sources / "tiny-0", "alpha")
    built = run_flare("build", str(sources / "tiny-1"), "--name", "alpha")
    assert built.returncode == 0, built.stderr
    notice = " ".join(" ".join(built.stderr.split()).split("moved ")[1:])
    assert notice.startswith(f"alpha:latest from {first.short()} to "), built.stderr
    assert "keeps no tag or pin of alpha now" in notice
    again = run_flare("build", str(sources / "tiny-1"), "--name", "alpha")
    assert again.returncode == 0 and "moved " not in again.stderr, again.stderr
