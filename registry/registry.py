"""The registry: a store (local folder, NAS mount or fsspec URL) plus an index DB.

The store holds the truth (package indexes, signatures, ref files); every change is written
there first, then to the index, which answers queries fast and can be rebuilt from the store at
any time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Connection, Table, delete, func, insert, select, update

from flare.errors import FlareError, IntegrityError, InvalidInputError, NotFoundError
from flare.faults import crash_point
from flare.registry import journal, localindex, marks, refs, signatures
from flare.registry.database import IndexDB
from flare.registry.listings import Listing, list_packages, packages_holding, usage
from flare.registry.models import package_blobs, packages, publications, tags
from flare.registry.refs import BadRef
from flare.sign.errors import UntrustedError
from flare.store.backends import normalize_location
from flare.store.backends.filesystems import cache_window_s, filesystem_type, on_network_filesystem
from flare.store.blobs import BlobStore
from flare.store.digest import Digest
from flare.store.encoding import Encoding
from flare.store.reports import VerifyReport
from flare.store.safetensors import FormatError

if TYPE_CHECKING:
    from flare.store.package import Manifest

INDEX_FILE = "index.db"
CLOCK_SKEW_S = 120.0
"""How far apart the clocks of a shared registry's hosts (and its server) may be: lease
expiries and starts, and modification times, are compared across them."""


class PinnedError(FlareError):
    """An operation that would drop a pinned package."""

    exit_code = 9


@dataclass
class ReindexReport:
    """What `reindex` indexed, and the bad ref files it left out."""

    packages: int
    bad: list[BadRef]


def default_database(location: str, home: Path) -> str:
    """SQLite beside the blobs for a folder on a local disk; for a folder on a network
    filesystem or a URL, this host's own SQLite index under FLARE_HOME, brought up to date from
    the store on every open (registry/localindex.py): SQLite cannot be shared between hosts."""
    location = normalize_location(location)
    if "://" not in location and not on_network_filesystem(Path(location)):
        return f"sqlite:///{Path(location) / INDEX_FILE}"
    return localindex.host_index_url(location, home)


def index_database(location: str, registry: str, database: str, home: Path) -> str:
    """The index DB of the registry at `location`: `database` (registry.database) if it is
    the configured registry `registry` (paths.registry), however either is spelled; else that
    registry's own default index. A lab's PostgreSQL indexes the lab's registry; another
    registry a command names (a copy's destination, a scratch registry) keeps an index of its
    own, so that one DB never lists two stores' packages, nor does one's `reindex` empty the
    other's listing."""
    if database and normalize_location(location) == normalize_location(registry):
        return database
    return default_database(location, home)


class Registry:
    """Packages by name, tag and pin, over one store and its index DB."""

    def __init__(
        self,
        location: str,
        database: str,
        encoding: Encoding = Encoding.PLAIN,
        zstd_level: int = 3,
        create: bool = True,
        cache_window: float | None = None,
    ) -> None:
        self.store = BlobStore(location, encoding, zstd_level)
        if create:
            self.store.backend.ensure(refs.REFS_DIR)
        elif not self.store.backend.exists(refs.REFS_DIR):
            raise NotFoundError(
                f"no registry at {self.location}",
                "check --registry or paths.registry; `flare build` or `flare registry copy "
                "--to` creates one",
            )
        self.db = IndexDB(database)
        self.cache_window_s = self._cache_window(cache_window)
        """How stale this host's view of the store's listings may be (0 on a local disk)."""
        self.notes: list[str] = []
        """Things the user should hear once, said while opening (the CLI prints them)."""
        try:
            self._open_index()
        except BaseException:
            self.db.dispose()  # no connection left open on a DB that reindex may move aside
            raise

    def _open_index(self) -> None:
        """Migrate the index DB, then bring it up to the store: a host's own index catches up
        from the journal; a new one is filled."""
        localindex.check_index_place(self)
        self.db.migrate()
        if self.db.sqlite_path is not None and self.store.backend.network:
            self.notes = localindex.sync(self, self.cache_window_s)
        elif self.db.created:
            self.notes = self._fill_new_index()

    def _fill_new_index(self) -> list[str]:
        """A new index DB of a registry that holds packages already (its DB lost, or first
        opened under this spelling or URL by an older flare) is filled from the store at
        once: listing nothing until someone thinks of `reindex` would hide every package."""
        if not refs.names(self.store, []):
            return []
        indexed = self.reindex().packages
        return [
            f"note: filled the new index DB {self.db.where()} from the store ({indexed} "
            "package records)"
        ]

    def _cache_window(self, configured: float | None) -> float:
        """The configured window (registry.cache_window), else the filesystem type's."""
        if not self.store.backend.network:
            return 0.0
        if configured is not None:
            return configured
        root = self.store.backend.local_path("")
        return 0.0 if root is None else cache_window_s(filesystem_type(root))

    @property
    def gc_margin_s(self) -> float:
        """How much longer than its grace period (or than a build lease's age) gc leaves a blob
        on a shared registry: another host's touch or lease may show a cache window late, and
        times come from clocks CLOCK_SKEW_S apart. 0 on a local disk, where neither applies."""
        return self.cache_window_s + CLOCK_SKEW_S if self.store.backend.network else 0.0

    @property
    def location(self) -> str:
        return self.store.location

    # -- writing ----------------------------------------------------------------------------

    def publish(
        self, name: str, tag: str | None, digest: Digest, manifest: Manifest
    ) -> Digest | None:
        """Record a stored package under NAME (and NAME:TAG): store first, then the index.

        The publisher recorded is the one its stored signatures name (none yet: unsigned).
        Returns the package NAME:TAG pointed at before if it was another one, else None: the
        caller tells the user the tag moved (refs.tag_move says what still keeps the old one).
        """
        record = refs.record_package(self.store, name, digest, self.publisher(digest))
        moved_from = None
        if tag is not None:
            moved_from = refs.tag_package(self.store, name, tag, digest)
        journal.record_change(self.store, name, digest)
        index_size = self.store.require(digest).stored_size
        if self.store.backend.stat(marks.marks_key(digest)) is None:
            marks.write_marks(self.store, digest, {digest.hex, *(d.hex for d in manifest.blobs())})
        self.db.write(lambda c: self._index_package(c, record, manifest, index_size))
        if tag is not None:
            row = {"name": name, "tag": tag, "digest": str(digest)}
            self.db.write(lambda c: _put(c, tags, row))
        return moved_from

    def _index_package(
        self,
        connection: Connection,
        record: refs.PackageRecord,
        manifest: Manifest,
        index_size: int,
    ) -> None:
        digest = str(record.digest)
        known = select(packages.c.digest).where(packages.c.digest == digest)
        if connection.execute(known).first() is None:
            blobs = {str(record.digest): index_size}
            blobs |= {p.digest: p.size for p in manifest.payloads}
            blobs |= {a.digest: a.size for a in manifest.artifacts}
            package = {
                "digest": digest,
                "model_id": manifest.model.id,
                "revision": manifest.model.revision,
                "recipe": f"{manifest.recipe.name}/{manifest.recipe.version}",
                "ranks": manifest.ranks,
                "size": sum(blobs.values()),
            }
            connection.execute(insert(packages), package)
            rows = [{"package": digest, "blob": b, "size": n} for b, n in blobs.items()]
            connection.execute(insert(package_blobs), rows)
        pinned = record.digest in refs.pins_of(self.store, record.name, bad=[])  # verify names them
        publication = {
            "name": record.name,
            "digest": digest,
            "created": record.created,
            "publisher": record.publisher,
            "pinned": pinned,
        }
        _put(connection, publications, publication)

    def add_signature(self, digest: Digest, bundle: bytes) -> str:
        """Store a signature of a stored package and show its publisher on the package's names.

        Refused if malformed or made for another package; whether it is trusted is for the
        reader to decide (`flare verify`, pull). Returns the publisher the signature names.
        """
        from flare.sign.envelope import read_bundle  # cryptography: not for listing commands

        signed = read_bundle(bundle, f"for {digest.short()}")
        if signed.claim.package != str(digest):
            raise UntrustedError(
                f"the signature is for package {signed.claim.package}, not {digest}",
                "sign this package: flare sign NAME@DIGEST",
            )
        self.store.require(digest)
        signatures.write_signature(self.store, digest, bundle)
        publisher = self.publisher(digest)
        names = self.db.write(lambda c: _set_publisher(c, digest, publisher))
        for name in names:  # the index knows the names: no scan of every name's refs
            refs.record_package(self.store, name, digest, publisher)
            journal.record_change(self.store, name, digest)
        return signed.claim.publisher

    def signatures(self, digest: Digest) -> list[bytes]:
        """The package's stored signatures (bundle JSON bytes), unverified."""
        return signatures.read_signatures(self.store, digest)

    def publisher(self, digest: Digest) -> str | None:
        """The publisher(s) the package's signatures name, comma-separated; None if unsigned."""
        return signatures.claimed_publisher(self.signatures(digest))

    def tag(self, ref: str, name_tag: str) -> tuple[str, str, Digest, refs.TagMove | None]:
        """Point NAME:TAG at the package REF names; the move, if the tag named another one."""
        _, digest = self.resolve(ref)
        parsed = refs.parse_ref(name_tag)
        if parsed.name is None or parsed.digest is not None:
            raise InvalidInputError(f"bad tag {name_tag!r}", "use NAME:TAG")
        tag = parsed.tag or refs.DEFAULT_TAG
        old = self.publish(parsed.name, tag, digest, refs.read_manifest(self.store, digest))
        move = None if old is None else refs.tag_move(self.store, parsed.name, tag, old, digest)
        return parsed.name, tag, digest, move

    def untag(self, name_tag: str) -> tuple[str, str, Digest]:
        """Remove NAME:TAG only: the package stays under its name (and its other tags); once
        nothing tags or pins it, gc may collect it. Rows first, then the ref file, as forget."""
        parsed = refs.parse_ref(name_tag)
        if parsed.name is None or parsed.tag is None or parsed.digest is not None:
            raise InvalidInputError(f"bad tag {name_tag!r}", "use NAME:TAG")
        digest = refs.resolve_package(self.store, f"{parsed.name}:{parsed.tag}")[1]
        row = (tags.c.name == parsed.name, tags.c.tag == parsed.tag)
        self.db.write(lambda c: c.execute(delete(tags).where(*row)))
        refs.untag(self.store, parsed.name, parsed.tag)
        journal.record_change(self.store, parsed.name, digest)
        return parsed.name, parsed.tag, digest

    def pin(self, ref: str, pinned: bool = True) -> tuple[str, Digest]:
        """Pin (or unpin) a package under its name: gc never removes a pinned package."""
        name, digest = self._named(ref)
        (refs.pin if pinned else refs.unpin)(self.store, name, digest)
        journal.record_change(self.store, name, digest)
        row = {"name": name, "digest": str(digest), "pinned": pinned}
        row |= self._publication_fields(name, digest)
        self.db.write(lambda c: _put(c, publications, row))
        return name, digest

    def _publication_fields(self, name: str, digest: Digest) -> dict[str, object]:
        record = refs.read_record(self.store, name, digest)
        if record is None:
            raise NotFoundError(f"{name} has no package {digest.short()}", "check the reference")
        return {"created": record.created, "publisher": record.publisher}

    def remove(self, ref: str) -> tuple[str, Digest, list[str]]:
        """Forget NAME's package and its tags (its blobs go at the next gc); refuse if pinned."""
        name, digest = self._named(ref)
        if digest in refs.pins_of(self.store, name):
            raise PinnedError(
                f"{name}@{digest.short()} is pinned",
                f"unpin it first: flare registry unpin {name}@{digest.short()}",
            )
        return name, digest, self.forget(name, digest)

    def forget(self, name: str, digest: Digest) -> list[str]:
        """Drop NAME's record of a package and its tags: the index DB's rows first, then the
        ref files, so that a kill between leaves the index naming nothing the store lacks (the
        record stays in the store: forgetting it again, or gc, finishes the job)."""
        dropped_tags = refs.tags_at(self.store, name, digest)
        self._forget_record(name, digest, dropped_tags)
        return dropped_tags

    def forget_untagged(self, name: str, digest: Digest) -> bool:
        """Forget NAME's record of a package that no tag or pin of NAME names (for gc), as
        `forget` does; nothing if one does now (a tag made since gc read the refs), and never
        a tag. Returns whether it forgot."""
        pinned = digest in refs.pins_of(self.store, name)
        if pinned or refs.tags_at(self.store, name, digest):
            return False
        self._forget_record(name, digest, [])
        return True

    def _forget_record(self, name: str, digest: Digest, tags: list[str]) -> None:
        """Rows, then ref files, then the journal entry that tells other hosts' indexes."""
        self.db.write(lambda c: self._forget(c, name, digest))
        crash_point("forget:refs")
        refs.forget_package(self.store, name, digest, tags)
        journal.record_change(self.store, name, digest)

    def _forget(self, connection: Connection, name: str, digest: Digest) -> None:
        key = str(digest)
        connection.execute(delete(tags).where(tags.c.name == name, tags.c.digest == key))
        connection.execute(
            delete(publications).where(publications.c.name == name, publications.c.digest == key)
        )
        named = select(func.count()).select_from(publications).where(publications.c.digest == key)
        if not connection.scalar(named):
            connection.execute(delete(package_blobs).where(package_blobs.c.package == key))
            connection.execute(delete(packages).where(packages.c.digest == key))

    def drop_rows_of_gone_packages(self, keep: set[Digest]) -> list[str]:
        """Drop the index DB rows of packages whose index is gone from the store, unless `keep`
        holds them (a tag or pin still names them: verify reports them missing). Such rows are
        what an older flare's gc, killed between removing a record's file and its rows, left
        listed. Returns the NAME@DIGEST of each publication dropped."""
        listed = self.db.read(lambda c: list(c.scalars(select(packages.c.digest))))
        by_hex = {Digest.parse(d).hex: d for d in listed}
        gone = [by_hex[h] for h in self.store.absent(by_hex) if Digest(h) not in keep]
        dropped = []
        for digest in gone:
            names = self.db.write(partial(self._drop, digest=digest))
            dropped += [f"{name}@{digest}" for name in names]
        return dropped

    def _drop(self, connection: Connection, digest: str) -> list[str]:
        """Every row of one package: its publications, tags and blobs. Returns its names."""
        named = select(publications.c.name).where(publications.c.digest == digest)
        names = list(connection.scalars(named))
        for name in names:
            self._forget(connection, name, Digest.parse(digest))
        if not names:  # a package row no name publishes: only its own rows go
            connection.execute(delete(package_blobs).where(package_blobs.c.package == digest))
            connection.execute(delete(packages).where(packages.c.digest == digest))
        return names

    # -- reading ----------------------------------------------------------------------------

    def resolve(self, ref: str) -> tuple[str | None, Digest]:
        """NAME[:TAG][@DIGEST] or a digest prefix, resolved against the store's refs."""
        name, digest, key = refs.resolve_package(self.store, ref)
        if not self.store.has(digest):
            raise NotFoundError(
                f"package {digest} is not in {self.location}", "check the reference"
            )
        if key is not None and not refs.is_package_index(self.store, digest):
            not_index = BadRef(key, f"names {digest}, which is not a package index")
            raise refs.refusal(self.store, [not_index])
        return name, digest

    def _named(self, ref: str) -> tuple[str, Digest]:
        name, digest = self.resolve(ref)
        if name is None:
            self.require_index(None, digest)  # a part of a package is said to be one
            owners = self.db.read(
                lambda c: c.scalars(
                    select(publications.c.name).where(publications.c.digest == str(digest))
                ).all()
            )
            if not owners:
                raise NotFoundError(
                    f"{ref} is package {digest}, which no name publishes now",
                    "give a published package: see `flare registry ls`",
                )
            if len(owners) > 1:
                raise InvalidInputError(
                    f"{ref} is published under {len(owners)} names", "give NAME@DIGEST"
                )
            name = owners[0]
        return name, digest

    def manifest(self, ref: str) -> tuple[str | None, Digest, Manifest]:
        name, digest = self.resolve(ref)
        self.require_index(name, digest)
        return name, digest, refs.read_manifest(self.store, digest)

    def require_index(self, name: str | None, digest: Digest) -> None:
        """Refuse a bare digest that names a part of packages, or any blob but an index, as
        what it is (read as an index, a text file's first bytes claim an absurd header)."""
        if name is not None or refs.is_package_index(self.store, digest):
            return
        size = self.store.plain_size(self.store.require(digest))
        holders = self.db.read(lambda c: packages_holding(c, str(digest)))
        if not holders:
            raise InvalidInputError(
                f"{digest.short()} is a {size}-byte blob that no package names, not a package",
                "give NAME, NAME:TAG, NAME@DIGEST or a package's digest (flare registry ls)",
            )
        part = _part(refs.read_manifest(self.store, holders[0][1]), digest)
        shown = [f"{name or ''}@{package.short()}" for name, package in holders]
        more = f" and {len(shown) - 3} more" if len(shown) > 3 else ""
        raise InvalidInputError(
            f"{digest.short()} is not a package: it is {part} ({size} bytes) of "
            f"{', '.join(shown[:3])}{more}",
            f"show the package: flare registry show {shown[0]}",
        )

    def listings(self, name: str | None = None, model: str | None = None) -> list[Listing]:
        """Every published package, newest first, with the sizes and refs users ask about."""
        return self.db.read(lambda c: list_packages(c, name, model))

    def usage(self) -> dict[str, int]:
        """Bytes the packages take: in all, shared by several, held by one only."""
        return self.db.read(usage)

    def verify(
        self,
        ref: str | None = None,
        workers: int | None = None,
        dry_run: bool = False,
        restore: bool = False,
    ) -> VerifyReport:
        """Re-hash the index and blobs of one package (or of every package recorded under a
        name) in parallel; with `restore`, put back quarantined blobs that hash right first
        (BlobStore.verify). A blob is reported missing only if a package still recorded at the
        end needs it: gc forgets a package before it deletes its blobs, so the blobs of one it
        collected meanwhile are not missing from any package."""
        restored = self.store.restore() if restore and not dry_run else []
        needs = {digest: self._needs(digest) for digest in self.packages(ref)}
        wanted = set(needs).union(*needs.values())
        report = self.store.verify(sorted(wanted), workers=workers, dry_run=dry_run)
        report.restored = restored
        if report.missing and ref is None:
            recorded = set(self.packages()) & set(needs)
            still = recorded.union(*(needs[digest] for digest in recorded))
            report.missing = [digest for digest in report.missing if digest in still]
        return report

    def _needs(self, digest: Digest) -> set[Digest]:
        """The blobs a package's index names: none if its index is missing (reported missing),
        corrupt (the hashing finds it) or no package index at all (a bad ref, which
        `bad_refs` names)."""
        if not self.store.has(digest):
            return set()
        try:
            return set(refs.read_manifest(self.store, digest).blobs())
        except FormatError:
            if refs.is_package_index(self.store, digest):
                raise  # an index this flare cannot read: the error says why
            return set()
        except IntegrityError:
            return set()

    def packages(self, ref: str | None = None) -> list[Digest]:
        """The package REF names, or every package recorded under a name (bad ref files left
        out: `bad_refs` names them)."""
        if ref:
            return [self.resolve(ref)[1]]
        store = self.store
        return sorted({d for n in refs.names(store, []) for d in refs.packages_of(store, n, [])})

    def bad_refs(self) -> list[BadRef]:
        """Every bad ref file: unreadable as what its path says, or naming a stored blob that
        is no package index (a missing one is verify's to report)."""
        found = refs.scan(self.store)
        bad = list(found.bad)
        is_index: dict[Digest, bool] = {}
        for key, digest in found.files():
            if digest not in is_index:
                is_index[digest] = not self.store.has(digest) or self.holds_index(digest)
            if not is_index[digest]:
                bad.append(BadRef(key, f"names {digest}, which is not a package index"))
        return sorted(bad, key=lambda ref: ref.key)

    def holds_index(self, digest: Digest) -> bool:
        """Whether the stored blob is a package index (a corrupt blob counts: verify finds it)."""
        try:
            return refs.is_package_index(self.store, digest)
        except IntegrityError:
            return True  # a corrupt blob, which verify finds and quarantines

    # -- rebuilding the index ---------------------------------------------------------------

    def reindex(self) -> ReindexReport:
        """Rebuild the index DB from the store's ref files, package indexes and signatures;
        bad ref files (and what only they name) are left out and reported."""
        found = refs.scan(self.store)
        stored = {record.digest for record in found.records}  # a missing one raises
        stored |= {digest for _, digest in found.files() if self.store.has(digest)}
        read = {digest: self._manifest_if_index(digest) for digest in stored}
        manifests = {d: manifest for d, manifest in read.items() if manifest is not None}
        not_index = set(read) - set(manifests)
        bad = found.bad + [
            BadRef(key, f"names {digest}, which is not a package index")
            for key, digest in found.files()
            if digest in not_index
        ]
        records = [
            replace(record, publisher=self.publisher(record.digest))
            for record in found.records
            if record.digest in manifests
        ]
        sizes = {r.digest: self.store.require(r.digest).stored_size for r in records}
        tag_rows = [
            {"name": name, "tag": tag, "digest": str(digest)}
            for (name, tag), digest in found.tags.items()
            if digest not in not_index
        ]

        def rebuild(connection: Connection) -> int:
            for table in (tags, publications, package_blobs, packages):
                connection.execute(delete(table))
            for record in records:
                manifest, size = manifests[record.digest], sizes[record.digest]
                self._index_package(connection, record, manifest, size)
            if tag_rows:
                connection.execute(insert(tags), tag_rows)
            return len(records)

        return ReindexReport(self.db.write(rebuild), sorted(bad, key=lambda ref: ref.key))

    def _manifest_if_index(self, digest: Digest) -> Manifest | None:
        """The package's manifest, or None if the blob is no package index; a missing index
        raises NotFoundError (the record needs its package)."""
        try:
            return refs.read_manifest(self.store, digest)
        except FormatError:
            if refs.is_package_index(self.store, digest):
                raise
            return None


def _put(connection: Connection, table: Table, row: dict[str, object]) -> None:
    """Insert the row, replacing the one with the same primary key: portable (SQLite and
    PostgreSQL alike); a writer that races another to the same key gets an IntegrityError,
    which IndexDB.write retries."""
    key = [column == row[column.name] for column in table.primary_key.columns]
    connection.execute(delete(table).where(*key))
    connection.execute(insert(table), row)


def _set_publisher(connection: Connection, digest: Digest, publisher: str | None) -> list[str]:
    """Show the publisher on every name the package is published under; return the names
    (`reindex` rebuilds the same from the signature files)."""
    named = publications.c.digest == str(digest)
    connection.execute(update(publications).where(named).values(publisher=publisher))
    return list(connection.scalars(select(publications.c.name).where(named)))


def _part(manifest: Manifest, digest: Digest) -> str:
    """What a blob is in a package: `the payload of ranks [0]`, `the tokenizer tokenizer.json`."""
    for payload in manifest.payloads:
        if payload.digest == str(digest):
            return f"the payload of ranks {list(payload.ranks)}"
    for artifact in manifest.artifacts:
        if artifact.digest == str(digest):
            return f"the {artifact.kind} {artifact.path}"
    return "a blob"
