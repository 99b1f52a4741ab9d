"""The registry on SQLite and PostgreSQL: names, tags, pins, listing, reindex, gc, copy."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest
from registry_helpers import BACKENDS, build_into, database, tiny_sources
from sqlalchemy import inspect, text

from flare.build.recipes.llama import LlamaRecipe
from flare.errors import AmbiguousError, IntegrityError, InvalidInputError, NotFoundError
from flare.registry import refs
from flare.registry.database import UnusableIndexError
from flare.registry.gc import collect
from flare.registry.leases import hold_lease
from flare.registry.registry import PinnedError, Registry
from flare.store import Digest
from flare.store.hashing import hash_bytes
from flare.store.layout import blob_key


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny checkpoints, made once for the module."""
    return tiny_sources(tmp_path_factory.mktemp("sources"), 3)


@pytest.fixture(params=BACKENDS)
def registry(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Registry]:
    with database(request.param, tmp_path) as url:
        opened = Registry(str(tmp_path / "registry"), url)
        yield opened
        opened.db.dispose()


def blob_path(registry: Registry, digest: Digest) -> Path:
    """Where a stored blob's file is (the tests damage it there)."""
    info = registry.store.require(digest)
    path = registry.store.backend.local_path(blob_key(digest, info.encoding))
    assert path is not None
    return path


def fill(registry: Registry, sources: Path, tmp_path: Path) -> dict[str, object]:
    """Three packages: a (tagged latest and v1), b, and a second build of a under a:old."""
    staging = tmp_path / "staging"
    a = build_into(registry, sources / "tiny-0", "alpha", staging)
    registry.tag(f"alpha@{a.hex}", "alpha:v1")
    b = build_into(registry, sources / "tiny-1", "beta", staging)
    old = build_into(registry, sources / "tiny-2", "alpha", staging, tag="old")
    return {"a": a, "b": b, "old": old}


def marked_lines(data: bytes) -> list[str]:
    """The digests a marks file lists, if its checksum holds."""
    from flare.registry import marks

    body = marks.decode_marks(data)
    assert body is not None
    return body.decode("ascii").split()


def test_ls_shows_what_users_ask_about(registry: Registry, sources: Path, tmp_path: Path) -> None:
    made = fill(registry, sources, tmp_path)
    rows = {(r.name, r.digest): r for r in registry.listings()}
    a = rows[("alpha", str(made["a"]))]
    assert a.tags == ["latest", "v1"] and a.ranks == 1
    assert a.recipe == f"llama/{LlamaRecipe.version}"
    assert a.model == "alpha" and a.size > a.unique_size > 0 and not a.pinned
    assert a.created and a.publisher is None
    assert {r.name for r in registry.listings(name="beta")} == {"beta"}
    assert [r.name for r in registry.listings(model="beta")] == ["beta"]


def test_tags_pins_and_rm(registry: Registry, sources: Path, tmp_path: Path) -> None:
    made = fill(registry, sources, tmp_path)
    registry.pin("alpha:old")
    with pytest.raises(PinnedError, match="unpin it first"):
        registry.remove("alpha:old")
    registry.pin("alpha:old", pinned=False)
    name, digest, tags = registry.remove("alpha:old")
    assert (name, digest, tags) == ("alpha", made["old"], ["old"])
    assert all(r.digest != str(made["old"]) for r in registry.listings())
    with pytest.raises(NotFoundError):
        registry.resolve("alpha:old")
    with pytest.raises(NotFoundError):
        registry.resolve("nosuch")


def test_ambiguous_prefix_lists_the_candidates(
    registry: Registry, sources: Path, tmp_path: Path
) -> None:
    made = fill(registry, sources, tmp_path)
    twin = made["a"].hex[:8] + "f" * 56  # type: ignore[attr-defined]
    registry.store.backend.write_atomic(f"refs/alpha/packages/{twin}", b"{}")
    with pytest.raises(AmbiguousError) as info:
        registry.resolve(f"alpha@{made['a'].hex[:8]}")  # type: ignore[attr-defined]
    assert twin[:16] in str(info.value)


def test_a_reference_with_tag_and_digest_needs_both_to_agree(
    registry: Registry, sources: Path, tmp_path: Path
) -> None:
    """NAME:TAG@DIGEST names the package only when the tag points at that digest: a tag that
    moved, or that does not exist, is refused rather than silently ignored."""
    made = fill(registry, sources, tmp_path)
    a, old = made["a"].hex, made["old"].hex  # type: ignore[attr-defined]
    assert registry.resolve(f"alpha:v1@{a[:8]}") == ("alpha", made["a"])
    assert registry.resolve(f"alpha:latest@blake3:{a}") == ("alpha", made["a"])
    with pytest.raises(InvalidInputError, match=f"alpha:old points at {old[:12]}, not at {a[:12]}"):
        registry.resolve(f"alpha:old@{a[:8]}")
    with pytest.raises(NotFoundError, match="no package alpha:nosuch"):
        registry.resolve(f"alpha:nosuch@{a[:8]}")


def test_reindex_rebuilds_an_identical_index(
    registry: Registry, sources: Path, tmp_path: Path
) -> None:
    fill(registry, sources, tmp_path)
    registry.pin("beta")
    before = [asdict(r) for r in registry.listings()]
    with registry.db.engine.begin() as connection:
        for table in ("tags", "publications", "package_blobs", "packages"):
            connection.execute(text(f"DELETE FROM {table}"))
    assert registry.listings() == []
    registry.reindex()
    assert [asdict(r) for r in registry.listings()] == before


def test_a_newer_schema_is_refused(registry: Registry) -> None:
    with registry.db.engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    with pytest.raises(UnusableIndexError, match="newer than this flare"):
        registry.db.migrate()


def test_gc_keeps_tagged_and_pinned_and_sweeps_the_rest(
    registry: Registry, sources: Path, tmp_path: Path
) -> None:
    made = fill(registry, sources, tmp_path)
    registry.pin("beta")
    registry.remove("alpha:old")
    dry = collect(registry, grace_s=0, dry_run=True)
    assert str(made["old"]) in dry.deleted and registry.store.has(made["old"])  # type: ignore[arg-type]
    report = collect(registry, grace_s=0)
    assert report.deleted == dry.deleted and report.freed_bytes == dry.freed_bytes > 0
    assert not registry.store.has(made["old"])  # type: ignore[arg-type]
    for ref in ("alpha:latest", "alpha:v1", "beta"):
        assert registry.verify(ref).ok
    assert collect(registry, grace_s=0).deleted == []


def test_gc_grace_and_leases_protect_work_in_progress(
    registry: Registry, sources: Path, tmp_path: Path
) -> None:
    made = fill(registry, sources, tmp_path)
    registry.remove("alpha:old")
    assert collect(registry, grace_s=3600).deleted == []  # everything is younger than an hour
    with hold_lease(registry.store, "serve", [made["old"]]):  # type: ignore[list-item]
        assert collect(registry, grace_s=0).deleted == []
    with hold_lease(registry.store, "build", protect_new=True):
        fresh = registry.store.put_bytes(b"a payload no tag names yet").digest
        collect(registry, grace_s=0)
        assert registry.store.has(fresh)
    assert str(fresh) in collect(registry, grace_s=0).deleted


def test_copy_to_another_registry_links_verifies_and_resumes(
    registry: Registry, sources: Path, tmp_path: Path
) -> None:
    from flare.registry.copy import copy_package

    made = fill(registry, sources, tmp_path)
    registry.pin("alpha:latest")
    other = Registry(str(tmp_path / "other"), f"sqlite:///{tmp_path / 'other.db'}")
    report = copy_package(registry, other, "alpha:latest")
    assert set(report.methods) <= {"hardlink", "reflink"} and sorted(report.tags) == [
        "latest",
        "v1",
    ]
    assert other.resolve("alpha:v1")[1] == made["a"] and other.verify("alpha").ok
    assert [r.pinned for r in other.listings()] == [True]

    manifest = refs.read_manifest(other.store, made["a"])  # type: ignore[arg-type]
    payload = manifest.blobs()[0]
    blob_path(other, payload).unlink()
    again = copy_package(registry, other, "alpha:latest")
    assert sum(n for m, n in again.methods.items() if m != "existing") == 1
    assert other.verify("alpha").ok


def test_copy_of_a_corrupt_package_publishes_nothing(
    registry: Registry, sources: Path, tmp_path: Path
) -> None:
    from flare.registry.copy import copy_package

    fill(registry, sources, tmp_path)
    _, digest, manifest = registry.manifest("beta")
    victim = registry.store.backend.local_path(
        blob_key(manifest.blobs()[0], registry.store.locate(manifest.blobs()[0]).encoding)
    )  # type: ignore[union-attr]
    assert victim is not None
    victim.chmod(0o644)
    victim.write_bytes(b"rot" + victim.read_bytes()[3:])
    other = Registry(str(tmp_path / "other"), f"sqlite:///{tmp_path / 'other.db'}")
    with pytest.raises(IntegrityError):
        copy_package(registry, other, "beta")
    assert other.listings() == [] and not other.store.has(digest)


def test_verify_tells_corrupt_and_missing_apart(
    registry: Registry, sources: Path, tmp_path: Path
) -> None:
    fill(registry, sources, tmp_path)
    corrupt = Digest.parse(registry.manifest("beta")[2].payloads[0].digest)
    missing = Digest.parse(registry.manifest("alpha:old")[2].payloads[0].digest)
    path = blob_path(registry, corrupt)
    path.chmod(0o644)
    path.write_bytes(b"x" + path.read_bytes()[1:])
    blob_path(registry, missing).unlink()
    report = registry.verify()
    assert report.corrupt == [corrupt] and report.missing == [missing]
    assert registry.verify("alpha:latest").ok


def test_schema_head_constant_matches_the_migrations() -> None:
    from alembic.script import ScriptDirectory

    from flare.registry.database import SCHEMA_HEAD, alembic_config

    assert ScriptDirectory.from_config(alembic_config()).get_current_head() == SCHEMA_HEAD


def test_a_new_index_db_has_the_tables_the_migrations_make(registry: Registry) -> None:
    """A new index DB is made from the models and stamped at head; replaying every revision
    on an empty DB must give the same tables, or a lab's older DBs would upgrade elsewhere."""
    from alembic import command
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from flare.registry.database import SCHEMA_HEAD, alembic_config
    from flare.registry.models import metadata

    with registry.db.engine.begin() as connection:
        config = alembic_config()
        config.attributes["connection"] = connection
        made = sorted(inspect(connection).get_table_names())
        assert compare_metadata(MigrationContext.configure(connection), metadata) == []
        command.downgrade(config, "base")
        assert inspect(connection).get_table_names() == ["alembic_version"]
        command.upgrade(config, "head")
        assert sorted(inspect(connection).get_table_names()) == made
        assert compare_metadata(MigrationContext.configure(connection), metadata) == []
        version = connection.execute(text("SELECT version_num FROM alembic_version"))
        assert version.scalar_one() == SCHEMA_HEAD


def test_gc_forgets_records_a_killed_gc_left_behind(
    registry: Registry, sources: Path, tmp_path: Path
) -> None:
    made = fill(registry, sources, tmp_path)
    old = made["old"]
    refs.untag(registry.store, "alpha", "old")  # the record stays, as after a moved tag
    blob_path(registry, old).unlink()  # swept by a collector killed before it forgot it
    report = collect(registry, grace_s=0)
    assert f"alpha@{old}" in report.forgotten
    assert registry.verify().ok
    assert all(r.digest != str(old) for r in registry.listings())


def test_gc_reads_marks_files_and_never_trusts_a_bad_one(
    registry: Registry, sources: Path, tmp_path: Path
) -> None:
    from flare.registry import marks

    made = fill(registry, sources, tmp_path)
    a: Digest = made["a"]  # type: ignore[assignment]
    needed = {a.hex, *(d.hex for d in refs.read_manifest(registry.store, a).blobs())}
    path = registry.store.backend.local_path(marks.marks_key(a))
    assert path is not None  # written by publish:
    assert marked_lines(path.read_bytes()) == sorted(needed)
    # A marks file that lost a line, or whose checksum was recomputed without the index: the
    # collector reads the index instead and keeps every blob.
    lines = path.read_bytes().splitlines(keepends=True)
    torn = b"".join(lines[1:])
    forged = marks.encode_marks(needed - {a.hex, next(iter(needed - {a.hex}))})
    latin = "\u00e9\n".encode()  # not ASCII, yet with a checksum that matches
    foreign = latin + marks.CHECKSUM + hash_bytes(latin).hex.encode() + b"\n"
    for bad in (torn, forged, foreign, b""):
        path.write_bytes(bad)
        assert collect(registry, grace_s=0, dry_run=True).deleted == []
        assert path.read_bytes() == bad  # a dry run writes nothing, not even a cache
        assert collect(registry, grace_s=0).deleted == []
        assert marked_lines(path.read_bytes()) == sorted(needed)  # rebuilt
    assert registry.verify("alpha:latest").ok
    # Lines of uneven length (two joined, a newline moved to the end), checksum redone: the
    # sweep cuts lines by binary search at fixed offsets, so such a file is refused too.
    body = "".join(f"{d}\n" for d in sorted(needed)).replace("\n", "", 1).encode() + b"\n"
    assert len(body) % marks.LINE == 0
    assert marks.decode_marks(body + marks.CHECKSUM + hash_bytes(body).hex.encode() + b"\n") is None


def test_marked_gives_each_fan_out_folder_exactly_its_digests() -> None:
    """The sweep asks for one folder's marked digests at a time, from sorted marks lines cut
    by binary search: every folder, the first and last included, gets all of its own digests
    and no other, from every marks file and from the single (leased) digests."""
    from flare.registry import marks

    digests = [hash_bytes(str(i).encode()).hex for i in range(3000)]
    digests += ["00" * 32, "ff" * 32, "0f" + "f" * 62, "f0" + "0" * 62]
    packages = [set(digests[k::3]) for k in range(3)]
    bodies = [marks.decode_marks(marks.encode_marks(blobs)) for blobs in packages]
    assert all(body is not None for body in bodies)
    loose = {hash_bytes(b"leased").hex, "ab" * 32}
    marked = marks.Marked([b for b in bodies if b is not None], loose)
    everything = set(digests) | loose
    for folder in (f"{i:02x}" for i in range(256)):
        found = [d for names in marked.in_folder(folder) for d in names]
        assert sorted(found) == sorted(d for d in everything if d.startswith(folder))
    assert marked.in_folder("tmp") == [[], [], [], []]


def test_gc_removes_the_marks_of_swept_packages(
    registry: Registry, sources: Path, tmp_path: Path
) -> None:
    from flare.registry import marks

    made = fill(registry, sources, tmp_path)
    old: Digest = made["old"]  # type: ignore[assignment]
    registry.remove("alpha:old")
    report = collect(registry, grace_s=0)
    assert report.marks == [marks.marks_key(old)]
    assert registry.store.backend.stat(marks.marks_key(old)) is None
    assert registry.store.backend.stat(marks.marks_key(made["a"])) is not None  # type: ignore[arg-type]


def test_gc_keeps_what_a_tag_names_when_its_index_is_gone(
    registry: Registry, sources: Path, tmp_path: Path
) -> None:
    """An index deleted, or quarantined by verify: the package's marks keep its blobs, marks
    and signatures, so putting the index back restores it; with its marks gone too, gc is
    refused and deletes nothing (it once swept every blob of the tagged package)."""
    from flare.registry import marks, signatures

    made = fill(registry, sources, tmp_path)
    a: Digest = made["a"]  # type: ignore[assignment]
    needed = {d.hex for d in refs.read_manifest(registry.store, a).blobs()}
    signature = registry.store.backend.local_path(f"{signatures.SIGNATURES_DIR}/{a.hex}/lab")
    assert signature is not None
    signature.parent.mkdir(parents=True, exist_ok=True)
    signature.write_bytes(b"a signature's bytes")
    index = blob_path(registry, a)
    saved = index.read_bytes()
    index.unlink()
    report = collect(registry, grace_s=0)
    assert not needed & {d.removeprefix("blake3:") for d in report.deleted}
    assert signature.exists() and report.signatures == []
    marks_file = registry.store.backend.local_path(marks.marks_key(a))
    assert marks_file is not None and marks_file.exists()
    marks_file.unlink()
    with pytest.raises(IntegrityError, match="whose blobs are listed nowhere"):
        collect(registry, grace_s=0)
    index.write_bytes(saved)
    assert registry.verify("alpha:latest").ok
    assert collect(registry, grace_s=0).deleted == []


def test_an_index_db_at_the_first_schema_is_upgraded_on_open(
    registry: Registry, sources: Path, tmp_path: Path
) -> None:
    from alembic import command

    from flare.registry.database import SCHEMA_HEAD, alembic_config

    fill(registry, sources, tmp_path)
    before = registry.listings()
    with registry.db.engine.begin() as connection:
        config = alembic_config()
        config.attributes["connection"] = connection
        command.downgrade(config, "0001")
    reopened = Registry(registry.location, registry.db.url)
    assert reopened.db.migrate() == SCHEMA_HEAD
    assert reopened.listings() == before
    reopened.db.dispose()
