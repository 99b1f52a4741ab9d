"""Copying a package between registries: its index, blobs, signatures and refs; linked on one
filesystem, verified always, resumable (blobs already there are kept), in parallel."""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass
class CopyReport:
    name: str | None
    digest: Digest
    tags: list[str] = field(default_factory=list)
    methods: dict[str, int] = field(default_factory=dict)
    """How many blobs were copied, linked or already there."""
    bytes: int = 0


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
            tags = [t for t, d in refs.tags_of(source.store, name).items() if d == digest]
            report.tags = tags
            for tag in tags or [None]:  # type: ignore[list-item]
                dest.publish(name, tag, digest, manifest)
            for pinned in refs.pins_of(source.store, name):
                if pinned == digest:
                    dest.pin(f"{name}@{digest.hex}")
        outlast_caches(dest.cache_window_s)
        _check_copied(dest, digest, manifest.blobs())
    return report


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
