"""The registry: a store (local folder, NAS mount or fsspec URL) plus an index DB.

The store holds the truth (package indexes, signatures, ref files); every change is written
there first, then to the index, which answers queries fast and can be rebuilt from the store at
any time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from flare.registry import marks, refs, signatures
from flare.registry.database import IndexDB
from flare.registry.models import Blob, Package, Publication, Tag
from flare.sign.errors import UntrustedError
from flare.store.blobs import BlobStore, VerifyReport
from flare.store.digest import Digest
from flare.store.encoding import Encoding
from flare.store.errors import FlareError, InvalidInputError, NotFoundError
from flare.store.hashing import hash_bytes

if TYPE_CHECKING:
    from flare.store.package import Manifest

INDEX_FILE = "index.db"


class PinnedError(FlareError):
    """An operation that would drop a pinned package."""

    exit_code = 9


@dataclass(frozen=True)
class Listing:
    """One row of `flare registry ls`."""

    name: str
    digest: str
    tags: list[str]
    model: str
    recipe: str
    ranks: int
    size: int
    unique_size: int
    pinned: bool
    created: str
    publisher: str | None


def default_database(location: str, home: Path) -> str:
    """SQLite beside the blobs for a folder registry; under FLARE_HOME for a URL registry."""
    if "://" not in location:
        return f"sqlite:///{Path(location) / INDEX_FILE}"
    return f"sqlite:///{home / 'indexes' / hash_bytes(location.encode()).hex[:16]}.db"


class Registry:
    """Packages by name, tag and pin, over one store and its index DB."""

    def __init__(
        self,
        location: str,
        database: str,
        encoding: Encoding = Encoding.PLAIN,
        zstd_level: int = 3,
        create: bool = True,
    ) -> None:
        self.store = BlobStore(location, encoding, zstd_level)
        if not create and not self.store.backend.list_dir(""):
            raise NotFoundError(
                f"no registry at {location}",
                "check --registry or paths.registry; `flare build` creates one",
            )
        self.db = IndexDB(database)
        self.db.migrate()

    @property
    def location(self) -> str:
        return self.store.location

    # -- writing ----------------------------------------------------------------------------

    def publish(self, name: str, tag: str | None, digest: Digest, manifest: Manifest) -> None:
        """Record a stored package under NAME (and NAME:TAG): store first, then the index.

        The publisher recorded is the one its stored signatures name (none yet: unsigned).
        """
        record = refs.record_package(self.store, name, digest, self.publisher(digest))
        if tag is not None:
            refs.tag_package(self.store, name, tag, digest)
        index_size = self.store.require(digest).stored_size
        if self.store.backend.stat(marks.marks_key(digest)) is None:
            marks.write_marks(self.store, digest, {digest.hex, *(d.hex for d in manifest.blobs())})
        self.db.write(lambda s: self._index_package(s, record, manifest, index_size))
        if tag is not None:
            self.db.write(lambda s: s.merge(Tag(name=name, tag=tag, digest=str(digest))))

    def _index_package(
        self, session: Session, record: refs.PackageRecord, manifest: Manifest, index_size: int
    ) -> None:
        digest = str(record.digest)
        if session.get(Package, digest) is None:
            blobs = {str(record.digest): index_size}
            blobs |= {p.digest: p.size for p in manifest.payloads}
            blobs |= {a.digest: a.size for a in manifest.artifacts}
            session.add(
                Package(
                    digest=digest,
                    model_id=manifest.model.id,
                    revision=manifest.model.revision,
                    recipe=f"{manifest.recipe.name}/{manifest.recipe.version}",
                    ranks=manifest.ranks,
                    size=sum(blobs.values()),
                )
            )
            session.flush()
            session.add_all(Blob(package=digest, blob=b, size=n) for b, n in blobs.items())
        pinned = record.digest in refs.pins_of(self.store, record.name)
        session.merge(
            Publication(
                name=record.name,
                digest=digest,
                created=record.created,
                publisher=record.publisher,
                pinned=pinned,
            )
        )

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
        names = self.db.write(lambda session: _set_publisher(session, digest, publisher))
        for name in names:  # the index knows the names: no scan of every name's refs
            refs.record_package(self.store, name, digest, publisher)
        return signed.claim.publisher

    def signatures(self, digest: Digest) -> list[bytes]:
        """The package's stored signatures (bundle JSON bytes), unverified."""
        return signatures.read_signatures(self.store, digest)

    def publisher(self, digest: Digest) -> str | None:
        """The publisher(s) the package's signatures name, comma-separated; None if unsigned."""
        return signatures.claimed_publisher(self.signatures(digest))

    def tag(self, ref: str, name_tag: str) -> tuple[str, str, Digest]:
        """Point NAME:TAG at the package REF names."""
        _, digest = self.resolve(ref)
        parsed = refs.parse_ref(name_tag)
        if parsed.name is None or parsed.digest is not None:
            raise InvalidInputError(f"bad tag {name_tag!r}", "use NAME:TAG")
        tag = parsed.tag or refs.DEFAULT_TAG
        self.publish(parsed.name, tag, digest, refs.read_manifest(self.store, digest))
        return parsed.name, tag, digest

    def pin(self, ref: str, pinned: bool = True) -> tuple[str, Digest]:
        """Pin (or unpin) a package under its name: gc never removes a pinned package."""
        name, digest = self._named(ref)
        (refs.pin if pinned else refs.unpin)(self.store, name, digest)
        self.db.write(
            lambda s: s.merge(
                Publication(
                    name=name,
                    digest=str(digest),
                    pinned=pinned,
                    **self._publication_fields(name, digest),
                )
            )
        )
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
        """Drop NAME's record of a package and its tags, in the store and the index."""
        tags = refs.forget_package(self.store, name, digest)
        self.db.write(lambda s: self._forget(s, name, digest))
        return tags

    def _forget(self, session: Session, name: str, digest: Digest) -> None:
        session.execute(delete(Tag).where(Tag.name == name, Tag.digest == str(digest)))
        session.execute(
            delete(Publication).where(Publication.name == name, Publication.digest == str(digest))
        )
        still_named = session.scalar(
            select(func.count()).select_from(Publication).where(Publication.digest == str(digest))
        )
        if not still_named:
            session.execute(delete(Blob).where(Blob.package == str(digest)))
            session.execute(delete(Package).where(Package.digest == str(digest)))

    # -- reading ----------------------------------------------------------------------------

    def resolve(self, ref: str) -> tuple[str | None, Digest]:
        """NAME[:TAG][@DIGEST] or a digest prefix, resolved against the store's refs."""
        name, digest = refs.resolve_package(self.store, ref)
        if not self.store.has(digest):
            raise NotFoundError(
                f"package {digest} is not in {self.location}", "check the reference"
            )
        return name, digest

    def _named(self, ref: str) -> tuple[str, Digest]:
        name, digest = self.resolve(ref)
        if name is None:
            owners = self.db.read(
                lambda s: s.scalars(
                    select(Publication.name).where(Publication.digest == str(digest))
                ).all()
            )
            if len(owners) != 1:
                raise InvalidInputError(
                    f"{ref} is published under {len(owners)} names", "give NAME@DIGEST"
                )
            name = owners[0]
        return name, digest

    def manifest(self, ref: str) -> tuple[str | None, Digest, Manifest]:
        name, digest = self.resolve(ref)
        return name, digest, refs.read_manifest(self.store, digest)

    def listings(self, name: str | None = None, model: str | None = None) -> list[Listing]:
        """Every published package, newest first, with the sizes and refs users ask about."""
        return self.db.read(lambda s: _listings(s, name, model))

    def usage(self) -> dict[str, int]:
        """Bytes the packages take: in all, shared by several, held by one only."""
        return self.db.read(_usage)

    def verify(self, ref: str | None = None, workers: int | None = None) -> VerifyReport:
        """Re-hash the index and blobs of one package (or every package) in parallel."""
        wanted: set[Digest] = set()
        for digest in self.packages(ref):
            wanted.add(digest)
            if self.store.has(digest):
                wanted.update(refs.read_manifest(self.store, digest).blobs())
        return self.store.verify(sorted(wanted), workers=workers)

    def packages(self, ref: str | None = None) -> list[Digest]:
        """The package REF names, or every package recorded under a name."""
        if ref:
            return [self.resolve(ref)[1]]
        return sorted({d for n in refs.names(self.store) for d in refs.packages_of(self.store, n)})

    # -- rebuilding the index ---------------------------------------------------------------

    def reindex(self) -> int:
        """Rebuild the index DB from the store's ref files, package indexes and signatures."""
        records = [
            replace(record, publisher=self.publisher(record.digest))
            for n in refs.names(self.store)
            for d in refs.packages_of(self.store, n)
            if (record := refs.read_record(self.store, n, d)) is not None
        ]
        manifests = {r.digest: refs.read_manifest(self.store, r.digest) for r in records}
        sizes = {d: self.store.require(d).stored_size for d in manifests}
        tags = [
            (n, t, d)
            for n in refs.names(self.store)
            for t, d in refs.tags_of(self.store, n).items()
        ]

        def rebuild(session: Session) -> int:
            for table in (Tag, Publication, Blob, Package):
                session.execute(delete(table))
            for record in records:
                self._index_package(session, record, manifests[record.digest], sizes[record.digest])
                session.flush()
            session.add_all(Tag(name=n, tag=t, digest=str(d)) for n, t, d in tags)
            return len(records)

        return self.db.write(rebuild)


def _set_publisher(session: Session, digest: Digest, publisher: str | None) -> list[str]:
    """Show the publisher on every name the package is published under; return the names
    (`reindex` rebuilds the same from the signature files)."""
    rows = session.scalars(select(Publication).where(Publication.digest == str(digest))).all()
    for row in rows:
        row.publisher = publisher
    return [row.name for row in rows]


def _listings(session: Session, name: str | None, model: str | None) -> list[Listing]:
    """Columns through Core, not ORM objects or ORM result processing: building 10,000s of
    entities costs more than the queries."""
    connection = session.connection()
    single = select(Blob.blob).group_by(Blob.blob).having(func.count() == 1).subquery()
    unique_query = (
        select(Blob.package, func.sum(Blob.size))
        .join(single, single.c.blob == Blob.blob)
        .group_by(Blob.package)
    )
    unique = dict(connection.execute(unique_query).all())
    tags: dict[tuple[str, str], list[str]] = {}
    for tag_name, digest, tag in connection.execute(select(Tag.name, Tag.digest, Tag.tag)):
        tags.setdefault((tag_name, digest), []).append(tag)
    query = select(
        Publication.name,
        Publication.digest,
        Package.model_id,
        Package.revision,
        Package.recipe,
        Package.ranks,
        Package.size,
        Publication.pinned,
        Publication.created,
        Publication.publisher,
    ).join(Package, Package.digest == Publication.digest)
    if name:
        query = query.where(Publication.name == name)
    if model:
        query = query.where(Package.model_id == model)
    order = (Publication.created.desc(), Publication.name, Publication.digest)
    rows = connection.execute(query.order_by(*order))
    return [_listing(row, tags, unique) for row in rows]


def _listing(row: tuple, tags: dict, unique: dict) -> Listing:  # type: ignore[type-arg]
    name, digest, model_id, revision, recipe, ranks, size, pinned, created, publisher = row
    return Listing(
        name=name,
        digest=digest,
        tags=sorted(tags.get((name, digest), [])),
        model=model_id + (f"@{revision}" if revision else ""),
        recipe=recipe,
        ranks=ranks,
        size=size,
        unique_size=int(unique.get(digest, 0)),
        pinned=bool(pinned),
        created=created,
        publisher=publisher,
    )


def _usage(session: Session) -> dict[str, int]:
    per_blob = (
        select(
            Blob.blob,
            func.max(Blob.size).label("size"),
            func.count(func.distinct(Blob.package)).label("users"),
        )
        .group_by(Blob.blob)
        .subquery()
    )
    total = session.scalar(select(func.coalesce(func.sum(per_blob.c.size), 0))) or 0
    shared = (
        session.scalar(
            select(func.coalesce(func.sum(per_blob.c.size), 0)).where(per_blob.c.users > 1)
        )
        or 0
    )
    return {"total": int(total), "shared": int(shared)}
