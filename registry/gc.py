"""Garbage collection: keep what pins, tags and live leases reach; sweep the rest.

Mark: roots are every tag and pin in the store's ref files and every package a live lease
names; each root keeps its index and every blob its manifest names. A bad ref file stops the
collection before it deletes anything: what the file was meant to name could be swept.
Forget: name records of the packages the sweep will delete (unrooted, index old enough) go
first, index DB rows then ref files, so a package a reader finds recorded is never half swept.
Sweep: a blob nobody reaches is swept only if it was not touched within the grace period, nor
since the start of a live build lease, checked again just before it goes; roots are read again
every REREAD_ROOTS_S of the sweep. It goes to the trash first (store/trash.py): with the roots
read once more, a swept blob that a root now reaches, or that a writer touched between the last
check and the move, is put back, and the others are deleted (on a shared registry, by a later
gc, once every host's view of the move has settled). Moving or deleting one blob file is
atomic, so a collector killed at any point leaves a store whose every remaining blob is intact.
Then index DB rows of packages whose index is gone are dropped (a collector of an older flare,
killed between removing a record's file and its rows, left them listed), and the signatures and
marks files of swept packages are removed (registry/marks.py). docs/package-format.md
("Garbage collection") says what a reader sees at each step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from flare.errors import IntegrityError, NotFoundError
from flare.faults import crash_point
from flare.registry import journal, marks, refs, signatures
from flare.registry.leases import drop_expired_leases, live_leases
from flare.registry.marks import Marked
from flare.registry.refs import BadRef, RefScan
from flare.registry.registry import Registry
from flare.store import trash
from flare.store.digest import Digest
from flare.store.layout import blob_key
from flare.store.safetensors import FormatError
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
    """NAME@DIGEST records dropped because the sweep deletes (or deleted) their package."""
    temp_files: list[str] = field(default_factory=list)
    signatures: list[str] = field(default_factory=list)
    """Signature files of swept packages, removed."""
    marks: list[str] = field(default_factory=list)
    """Marks files of swept packages, removed."""
    put_back: list[str] = field(default_factory=list)
    """Blobs taken back from the trash: a root reaches them now, or a writer touched them
    between the sweep's last look and the move (store/trash.py)."""
    in_trash: int = 0
    """Bytes of swept blobs left in the trash for a later gc (a shared registry's window)."""


@dataclass(frozen=True)
class Roots:
    """What must stay, read from the store's refs and its live leases (read once each)."""

    packages: set[Digest]
    """Tagged, pinned and leased packages."""
    blobs: set[str]
    """Single blobs live leases hold, as hex digests."""
    build_start: float | None
    """The earliest start of a live build lease: blobs touched since then stay."""
    refs: RefScan
    """The ref files the roots were read from (every one good)."""

    def old_before(self, grace_cutoff: float) -> float:
        """The time a blob must be untouched since to go: the grace period's start, or the
        start of the earliest live build lease if that is earlier (the build may need it)."""
        return grace_cutoff if self.build_start is None else min(grace_cutoff, self.build_start)


REFUSED = (
    "gc deletes nothing while a ref file is bad (what it was meant to name could be swept): "
    f"{refs.FIX}; then run gc again"
)


def roots(registry: Registry, records: bool = False, hint: str = REFUSED) -> Roots:
    """The roots as they are now (with `records`, the name records read too); refused, with
    the hint, if any ref file is bad."""
    store = registry.store
    found = refs.scan(store, records)
    if found.bad:
        raise refs.refusal(store, found.bad, hint)
    margin = registry.gc_margin_s  # clocks apart, caches late: see Registry.gc_margin_s
    leases = live_leases(store, slack_s=margin)
    packages = found.roots() | {Digest.parse(d) for lease in leases for d in lease.packages}
    blobs = {Digest.parse(d).hex for lease in leases for d in lease.blobs}
    starts = [lease.since - margin for lease in leases if lease.since is not None]
    return Roots(packages, blobs, min(starts) if starts else None, found)


def mark(registry: Registry, found: Roots, keep: bool) -> list[bytes]:
    """Every blob the root packages need, indexes included, as the sorted lines of their
    marks files or of their verified indexes; `keep` writes the marks files that were missing.
    A lease's package not stored yet (a build's, still writing) marks nothing; a tagged or
    pinned one whose index is gone (deleted, or quarantined by verify) marks what its marks
    file lists, and without one gc is refused: what it needs is unknown, and sweeping would
    take every blob of a package a tag still names."""
    store, tagged = registry.store, found.refs.roots()
    return [
        _package_marks(registry, found, digest, keep)
        for digest in found.packages
        if digest in tagged or store.has(digest)
    ]


def _package_marks(registry: Registry, found: Roots, digest: Digest, keep: bool) -> bytes:
    """One root's marks; a ref file naming a blob that is no package index is refused, and so
    is a root whose index and marks file are both gone."""
    if not registry.store.has(digest):
        listed = marks.listed(registry.store, digest)
        if listed is None:
            raise _unknown_root(found, digest)
        return listed
    try:
        return marks.package_blobs(registry.store, digest, keep)
    except FormatError:
        key = next((k for k, d in found.refs.files() if d == digest), None)
        if key is None or refs.is_package_index(registry.store, digest):
            raise  # a lease's package, or an index this flare cannot read: as it says
        bad = BadRef(key, f"names {digest}, which is not a package index")
        raise refs.refusal(registry.store, [bad], REFUSED) from None


def _unknown_root(found: Roots, digest: Digest) -> IntegrityError:
    names = [key for key, named in found.refs.files() if named == digest]
    return IntegrityError(
        f"{', '.join(names)} names package {digest}, whose index is not in the store and "
        "whose blobs are listed nowhere; gc deletes nothing while a root's blobs are unknown",
        "build or push the package again (or put back the index that `flare registry verify` "
        "quarantined), or remove the tag or pin, then run gc again",
    )


def collect(registry: Registry, grace_s: float, dry_run: bool = False) -> GcReport:
    """Mark from the roots, forget the packages the sweep will delete, then sweep unreachable
    blobs older than the grace period."""
    started = time.time() - registry.gc_margin_s  # grace counts from here
    report = GcReport(dry_run=dry_run)
    found = roots(registry, records=True, hint=refs.FIX if dry_run else REFUSED)
    marked = Marked(mark(registry, found, keep=not dry_run), found.blobs)
    since: set[str] = set()  # reached by roots that came during the sweep
    old_before = found.old_before(started - grace_s)
    checked_at = time.monotonic()  # the roots are read again once forgetting took that long
    if not dry_run:
        report.forgotten = _forget_doomed(registry, found, old_before)
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
            if not dry_run:
                crash_point("gc:doomed")
                if not trash.discard(registry.store, key, modified):
                    continue
                crash_point("gc:sweep")
            report.deleted.append(f"blake3:{hex_digest}")
            report.freed_bytes += size
    report.roots = len(found.packages)
    if not dry_run:
        found = _empty_trash(registry, report, found, Reached(marked, since))
        report.forgotten += registry.drop_rows_of_gone_packages(keep=found.packages)
        report.signatures = signatures.drop_orphans(registry.store, keep=found.packages)
        report.marks = marks.drop_orphans(registry.store, keep=found.packages)
        report.temp_files = registry.store.sweep_temps()
        drop_expired_leases(registry.store)
        journal.drop_old(registry.store)
    return report


def _forget_doomed(registry: Registry, found: Roots, old_before: float) -> list[str]:
    """Forget the name records of the packages the sweep will delete: unrooted, with an index
    untouched since `old_before`, or already gone. Before the sweep, so that a package still
    recorded is one the sweep leaves whole, however the collector ends. A record whose name
    tagged or pinned the package since the refs were read stays (its blobs are kept too: the
    sweep reads the roots again)."""
    store, forgotten = registry.store, []
    for record in found.refs.records:
        digest = record.digest
        if digest in found.packages or digest.hex in found.blobs:
            continue
        info = store.locate(digest)
        stat = None if info is None else store.backend.stat(blob_key(digest, info.encoding))
        doomed = stat is None or stat[1] < old_before
        if doomed and registry.forget_untagged(record.name, digest):
            forgotten.append(f"{record.name}@{digest}")
    return forgotten


def _reread(registry: Registry, found: Roots, since: set[str], keep: bool) -> Roots:
    """Roots added since the mark (a new tag, a new lease) protect their blobs too: they join
    `since`. The result holds every root seen so far."""
    fresh = roots(registry)
    added = replace(fresh, packages=fresh.packages - found.packages)
    for body in mark(registry, added, keep):
        since.update(body.decode("ascii").split())
    since.update(fresh.blobs)
    packages, blobs = found.packages | fresh.packages, found.blobs | fresh.blobs
    return replace(found, packages=packages, blobs=blobs, build_start=fresh.build_start)


class Reached:
    """What the roots reach: the mark's, and those of the roots read again since (leases'
    single blobs included); the mark's decoded one fan-out folder at a time, once."""

    def __init__(self, marked: Marked, since: set[str]) -> None:
        self.marked = marked
        self.since = since
        self._folders: dict[str, set[str]] = {}

    def __contains__(self, hex_digest: str) -> bool:
        if hex_digest in self.since:
            return True
        folder = hex_digest[:2]
        if folder not in self._folders:
            self._folders[folder] = set().union(*self.marked.in_folder(folder))
        return hex_digest in self._folders[folder]


def trash_window_s(registry: Registry) -> float:
    """How long a swept blob stays in the trash before a gc may delete it: on a shared
    registry, a writer's touch through a client's stale view can land on it up to a cache
    window after the move, and shows to this host a cache window later; the time of the move
    is another host's clock. 0 on a local disk: the same gc empties it."""
    return registry.gc_margin_s + registry.cache_window_s


def _empty_trash(registry: Registry, report: GcReport, found: Roots, reached: Reached) -> Roots:
    """The sweep's second phase, with the roots read again: each blob in the trash for the
    window is put back if a root reaches it now or a writer touched it before the move, else
    deleted. Returns the roots as read."""
    store, cutoff = registry.store, time.time() - trash_window_s(registry)
    due = []
    for entry in trash.entries(store):
        if entry.trashed > cutoff:
            report.in_trash += entry.size
        else:
            due.append(entry)
    if due:  # read after the listing: a lease written before any listed move is seen
        found = _reread(registry, found, reached.since, keep=True)
    for entry in due:
        crash_point("gc:empty")
        try:
            if entry.touched or entry.digest.hex in reached:
                trash.put_back(store, entry)
                _taken_back(report, entry)
            else:
                trash.delete(store, entry)
        except NotFoundError:
            continue  # put back or deleted by another collector meanwhile
    return found


def _taken_back(report: GcReport, entry: trash.Trashed) -> None:
    """Report a blob put back: not deleted, if this gc swept it."""
    name = str(entry.digest)
    report.put_back.append(name)
    if name in report.deleted:
        report.deleted.remove(name)
        report.freed_bytes -= entry.size
