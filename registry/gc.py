"""Garbage collection: keep what pins, tags and live leases reach; sweep the rest.

Mark: roots are every tag and pin in the store's ref files and every package a live lease
names; each root keeps its index and every blob its manifest names. Sweep: a blob nobody
reaches is deleted only if it was not touched within the grace period, nor since the start
of a live build lease, checked again just before it goes; roots are read again every
REREAD_ROOTS_S of the sweep. Deleting one blob file is atomic, so a collector killed at any
point leaves a store whose every remaining blob is intact; the next one forgets the records of
packages it had swept. Signatures of a package go with its index: once the index is swept,
its `signatures/<hex>/` files and its `marks/<hex>` file are removed too (registry/marks.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from flare.registry import journal, marks, refs, signatures
from flare.registry.leases import drop_expired_leases, live_leases
from flare.registry.marks import Marked
from flare.registry.registry import Registry
from flare.store.digest import Digest
from flare.store.sweep import unmarked

REREAD_ROOTS_S = 0.2


@dataclass
class GcReport:
    """What a collection kept and freed (or, with dry_run, would free)."""

    dry_run: bool
    roots: int = 0
    marked: int = 0
    kept_recent: int = 0
    deleted: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    forgotten: list[str] = field(default_factory=list)
    """NAME@DIGEST records dropped because their package was swept."""
    temp_files: list[str] = field(default_factory=list)
    signatures: list[str] = field(default_factory=list)
    """Signature files of swept packages, removed."""
    marks: list[str] = field(default_factory=list)
    """Marks files of swept packages, removed."""


@dataclass(frozen=True)
class Roots:
    """What must stay, read from the store's refs and its live leases (read once each)."""

    packages: set[Digest]
    """Tagged, pinned and leased packages."""
    blobs: set[str]
    """Single blobs live leases hold, as hex digests."""
    build_start: float | None
    """The earliest start of a live build lease: blobs touched since then stay."""

    def old_before(self, grace_cutoff: float) -> float:
        """The time a blob must be untouched since to go: the grace period's start, or the
        start of the earliest live build lease if that is earlier (the build may need it)."""
        return grace_cutoff if self.build_start is None else min(grace_cutoff, self.build_start)


def roots(registry: Registry) -> Roots:
    """The roots as they are now."""
    store = registry.store
    packages: set[Digest] = set()
    for name in refs.names(store):
        packages.update(refs.tags_of(store, name).values())
        packages.update(refs.pins_of(store, name))
    margin = registry.gc_margin_s  # clocks apart, caches late: see Registry.gc_margin_s
    leases = live_leases(store, slack_s=margin)
    packages.update(Digest.parse(d) for lease in leases for d in lease.packages)
    blobs = {Digest.parse(d).hex for lease in leases for d in lease.blobs}
    starts = [lease.since - margin for lease in leases if lease.since is not None]
    return Roots(packages, blobs, min(starts) if starts else None)


def mark(registry: Registry, packages: set[Digest], keep: bool) -> list[bytes]:
    """Every blob the packages need, indexes included (missing packages mark nothing), as the
    sorted lines of their marks files or of their verified indexes; `keep` writes the marks
    files that were missing."""
    store = registry.store
    return [marks.package_blobs(store, d, keep) for d in packages if store.has(d)]


def collect(registry: Registry, grace_s: float, dry_run: bool = False) -> GcReport:
    """Mark from the roots, then sweep unreachable blobs older than the grace period."""
    started = time.time() - registry.gc_margin_s  # grace counts from here
    report = GcReport(dry_run=dry_run)
    found = roots(registry)
    marked = Marked(mark(registry, found.packages, keep=not dry_run), found.blobs)
    since: set[str] = set()  # reached by roots that came during the sweep
    old_before = found.old_before(started - grace_s)
    checked_at = time.monotonic()
    for share in unmarked(registry.store, marked.in_folder):
        report.marked += share.marked
        for hex_digest, key, size, modified in share.unmarked:
            if time.monotonic() - checked_at > REREAD_ROOTS_S:
                found = _reread(registry, found, since, not dry_run)
                old_before, checked_at = found.old_before(started - grace_s), time.monotonic()
            if hex_digest in since:
                continue
            if modified < old_before and not dry_run:
                stat = registry.store.backend.stat(key)  # again, just before the delete
                if stat is None:
                    continue  # another collector got there first
                size, modified = stat
            if modified >= old_before:
                report.kept_recent += 1
                continue
            report.deleted.append(f"blake3:{hex_digest}")
            report.freed_bytes += size
            if not dry_run:
                registry.store.backend.remove(key)
    report.roots = len(found.packages)
    if not dry_run:
        report.forgotten = _forget_swept(registry, set(report.deleted))
        report.signatures = signatures.drop_orphans(registry.store)
        report.marks = marks.drop_orphans(registry.store)
        report.temp_files = registry.store.sweep_temps()
        drop_expired_leases(registry.store)
        journal.drop_old(registry.store)
    return report


def _reread(registry: Registry, found: Roots, since: set[str], keep: bool) -> Roots:
    """Roots added since the mark (a new tag, a new lease) protect their blobs too: they join
    `since`. The result holds every root seen so far."""
    fresh = roots(registry)
    for body in mark(registry, fresh.packages - found.packages, keep):
        since.update(body.decode("ascii").split())
    since.update(fresh.blobs)
    return Roots(found.packages | fresh.packages, found.blobs | fresh.blobs, fresh.build_start)


def _forget_swept(registry: Registry, deleted: set[str]) -> list[str]:
    """Drop name records (and index rows) of untagged, unpinned packages whose index is gone:
    swept now, or by an earlier collector killed before it could forget them."""
    store, forgotten = registry.store, []
    for name in refs.names(store):
        kept = set(refs.tags_of(store, name).values()) | set(refs.pins_of(store, name))
        for digest in refs.packages_of(store, name):
            gone = str(digest) in deleted or not store.has(digest)
            if gone and digest not in kept:
                registry.forget(name, digest)
                forgotten.append(f"{name}@{digest}")
    return forgotten
