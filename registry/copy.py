"""Copying a package between registries: its index, blobs, signatures and refs; linked on one
filesystem, verified always, resumable (blobs already there are kept), in parallel."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flare.errors import IntegrityError
from flare.faults import crash_point
from flare.registry import refs
from flare.registry.leases import hold_lease, outlast_caches
from flare.registry.registry import Registry
from flare.registry.signatures import write_signature
from flare.store import trash
from flare.store.blobs import PutResult
from flare.store.digest import Digest
from flare.store.hashing import Progress, parallel_map

if TYPE_CHECKING:
    from flare.store.package import Manifest


@dataclass
class CopyReport:
    name: str | None
    digest: Digest
    tags: list[str] = field(default_factory=list)
    methods: dict[str, int] = field(default_factory=dict)
    """How many blobs were copied, linked or already there."""
    bytes: int = 0
    moved: list[refs.TagMove] = field(default_factory=list)
    """The destination's tags the copy moved off another package."""


def copy_package(
    source: Registry,
    dest: Registry,
    ref: str,
    workers: int | None = None,
    progress: Progress | None = None,
) -> CopyReport:
    """Copy REF's blobs (index last, so a partial copy never looks like a package), then its
    signatures (before the refs, so the destination lists the publisher), then refs."""
    name, digest, manifest = source.manifest(ref)
    report = CopyReport(name, digest)
    with hold_lease(dest.store, "copy", protect_new=True):
        results = parallel_map(
            lambda d: source.store.copy_to(dest.store, d, progress), manifest.blobs(), workers
        )
        results.append(source.store.copy_to(dest.store, digest, progress))
        crash_point("copy:publish")
        report.methods = _count(results)
        report.bytes = sum(r.size for r in results)
        for bundle in source.signatures(digest):
            write_signature(dest.store, digest, bundle)
        if name is not None:
            _copy_refs(source, dest, name, manifest, report)
        outlast_caches(dest.cache_window_s)
        _check_copied(dest, digest, manifest.blobs())
    return report


def _copy_refs(
    source: Registry, dest: Registry, name: str, manifest: Manifest, report: CopyReport
) -> None:
    """Publish the package under NAME and each of NAME's tags that points at it in the source,
    and pin it if the source does. A destination tag on another package is moved, as the copy
    was asked to, and reported (with what still keeps the package it left, read once every
    tag has moved): it may have been the tag that kept that package from gc."""
    digest = report.digest
    report.tags = [t for t, d in refs.tags_of(source.store, name).items() if d == digest]
    moved_from: dict[str, Digest] = {}
    for tag in report.tags or [None]:  # type: ignore[list-item]
        old = dest.publish(name, tag, digest, manifest)
        if old is not None:
            moved_from[tag] = old
    if digest in refs.pins_of(source.store, name):
        dest.pin(f"{name}@{digest.hex}")
    report.moved = [
        refs.tag_move(dest.store, name, tag, old, digest) for tag, old in moved_from.items()
    ]


def _check_copied(dest: Registry, digest: Digest, blobs: list[Digest]) -> None:
    """Every blob of the package is stored in the destination, asked of its server, once every
    host's gc can see the new refs; one that a gc moved to its trash after the copy found it
    stored is put back (store/trash.py)."""
    missing = trash.missing(dest.store, [*blobs, digest])
    if missing:
        raise IntegrityError(
            f"blob {missing[0]} of the copied package is gone from {dest.location}",
            "a concurrent gc removed it; run the same copy again to restore it",
        )


def _count(results: list[PutResult]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for result in results:
        counts[result.method] = counts.get(result.method, 0) + 1
    return counts
