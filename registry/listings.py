"""What `flare registry ls`, `du` and `show` read from the index DB: one row per published
package with its tags and sizes, the bytes all packages take, and the packages a blob is part
of. Queries only: the index DB's writers are in registry.py."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, Select, func, select

from flare.registry.models import package_blobs, packages, publications, tags
from flare.store.digest import Digest


@dataclass
class Listing:
    """One row of `flare registry ls` (not frozen: 10,000 frozen ones take 20 ms more)."""

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


def list_packages(connection: Connection, name: str | None, model: str | None) -> list[Listing]:
    """Three queries (unique sizes, tags, packages) joined in Python: joined in SQL, SQLite
    evaluates the grouped unique sizes once per package row (5 s for 10,000 packages)."""
    unique = dict(connection.execute(_unique_sizes()).all())
    by_tag: dict[tuple[str, str], list[str]] = {}
    for tag_name, digest, tag in connection.execute(select(tags.c.name, tags.c.digest, tags.c.tag)):
        by_tag.setdefault((tag_name, digest), []).append(tag)
    query = select(
        publications.c.name,
        publications.c.digest,
        packages.c.model_id,
        packages.c.revision,
        packages.c.recipe,
        packages.c.ranks,
        packages.c.size,
        publications.c.pinned,
        publications.c.created,
        publications.c.publisher,
    ).join(packages, packages.c.digest == publications.c.digest)
    if name:
        query = query.where(publications.c.name == name)
    if model:
        query = query.where(packages.c.model_id == model)
    order = (publications.c.created.desc(), publications.c.name, publications.c.digest)
    rows = connection.execute(query.order_by(*order))
    return [_listing(row, by_tag, unique) for row in rows]


def _unique_sizes() -> Select[tuple[str, int]]:
    """(package, size) rows: bytes of the blobs no other package needs, for packages with any.

    One pass over the covering index on (blob, package, size), in blob order: a blob with one
    package row is unique to that package."""
    single = (
        select(
            func.min(package_blobs.c.package).label("package"),
            func.min(package_blobs.c.size).label("size"),
        )
        .group_by(package_blobs.c.blob)
        .having(func.count() == 1)
        .subquery()
    )
    return select(single.c.package, func.sum(single.c.size)).group_by(single.c.package)


def _listing(row: tuple, by_tag: dict, unique: dict) -> Listing:  # type: ignore[type-arg]
    name, digest, model_id, revision, recipe, ranks, size, pinned, created, publisher = row
    return Listing(
        name=name,
        digest=digest,
        tags=sorted(by_tag.get((name, digest), [])),
        model=model_id + (f"@{revision}" if revision else ""),
        recipe=recipe,
        ranks=ranks,
        size=size,
        unique_size=int(unique.get(digest, 0)),
        pinned=bool(pinned),
        created=created,
        publisher=publisher,
    )


def usage(connection: Connection) -> dict[str, int]:
    per_blob = (
        select(
            package_blobs.c.blob,
            func.max(package_blobs.c.size).label("size"),
            func.count(func.distinct(package_blobs.c.package)).label("users"),
        )
        .group_by(package_blobs.c.blob)
        .subquery()
    )
    total = connection.scalar(select(func.coalesce(func.sum(per_blob.c.size), 0))) or 0
    shared = (
        connection.scalar(
            select(func.coalesce(func.sum(per_blob.c.size), 0)).where(per_blob.c.users > 1)
        )
        or 0
    )
    return {"total": int(total), "shared": int(shared)}


def packages_holding(connection: Connection, blob: str) -> list[tuple[str | None, Digest]]:
    """(name or None, digest) of each package a blob is part of, other than as its own
    index."""
    query = (
        select(package_blobs.c.package, publications.c.name)
        .outerjoin(publications, publications.c.digest == package_blobs.c.package)
        .where(package_blobs.c.blob == blob, package_blobs.c.package != blob)
        .order_by(publications.c.name, package_blobs.c.package)
    )
    return [(name, Digest.parse(digest)) for digest, name in connection.execute(query)]
