"""A host's own index of a shared registry, kept up to date from the store's change journal.

SQLite cannot be shared over a network filesystem: its locks do not reach other hosts (sshfs
has none at all), and two hosts writing one DB file corrupt it. The store is the truth and the
index only a cache of it, so a registry on a network filesystem (or at a URL) keeps its SQLite
index on each host, under `$FLARE_HOME/indexes/`, and each host brings its own index up to date
when it opens the registry:

- a new index (or one not brought up to date for half the journal's life) is filled by reading
  every name's ref files and the index of each package not indexed yet;
- otherwise the host lists `journal/` and applies the entries it has not seen: applying re-reads
  the named refs as they are now (registry/journal.py), so order and repeats do not matter;
- a network client may show a listing or a file's attributes as they were up to a *cache window*
  ago (NFS `acdirmax`, sshfs `dcache_timeout`), so the first reading of a change may miss part of
  it: each entry is applied again once the host has known it for a cache window.

The bookkeeping (which entries this host has applied, and when it last looked) lives in two
tables of the host's index DB that are not part of the shared schema.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import (
    Boolean,
    Column,
    Connection,
    Float,
    MetaData,
    String,
    Table,
    delete,
    insert,
    select,
    update,
)
from sqlalchemy.engine import make_url

from flare.errors import FlareError, InvalidInputError
from flare.registry import journal, refs
from flare.registry.models import packages, publications, tags
from flare.store.backends.filesystems import filesystem_type
from flare.store.digest import Digest
from flare.store.hashing import hash_bytes

if TYPE_CHECKING:
    from flare.registry.registry import Registry
    from flare.store.package import Manifest

INDEXES_DIR = "indexes"
SHARED_INDEX_FILE = "index.db"
"""The SQLite index that older flare kept in the registry folder, on the NAS too."""

bookkeeping = MetaData()
seen_entries = Table(
    "host_journal_seen",
    bookkeeping,
    Column("entry", String(160), primary_key=True),
    Column("first_seen", Float, nullable=False),
    Column("settled", Boolean, nullable=False),
)
"""Journal entries this host has applied: once when first seen, again (settled) a cache window
later."""
sync_times = Table(
    "host_sync",
    bookkeeping,
    Column("key", String(32), primary_key=True),
    Column("value", Float, nullable=False),
)
"""`synced`: when this host last brought its index up to date (its own clock)."""


def host_index_url(location: str, home: Path) -> str:
    """This host's SQLite index of a shared registry: named by the registry's location (the
    first 16 hex of the BLAKE3 of the path or URL as given) and by the host, so that a
    FLARE_HOME on a shared home folder still gives every host a file of its own."""
    host = socket.gethostname().replace("/", "_") or "host"
    key = hash_bytes(location.encode()).hex[:16]
    return f"sqlite:///{home / INDEXES_DIR / f'{key}.{host}.db'}"


def check_index_place(registry: Registry) -> None:
    """Refuse a SQLite index configured inside a registry folder on a network filesystem:
    every host would write that one file."""
    path = registry.db.sqlite_path
    root = registry.store.backend.local_path("")
    if path is None or root is None or not registry.store.backend.network:
        return
    if path.resolve().is_relative_to(root.resolve()):
        raise InvalidInputError(
            f"the SQLite index DB {path} is inside the registry on a network filesystem "
            f"({filesystem_type(root)}), where SQLite's locks cannot be trusted",
            "leave registry.database empty (each host keeps its own index) or use PostgreSQL",
        )


def sync(registry: Registry, window_s: float) -> list[str]:
    """Bring this host's index up to date with the store; return notes for the user."""
    assert registry.db.sqlite_path is not None
    registry.db.write(bookkeeping.create_all)  # a full disk is exit 8, as every DB write
    with _host_lock(registry.db.sqlite_path):
        now = time.time()
        synced = registry.db.read(_synced_at)
        listed = journal.entries(registry.store)
        if synced is None or now - synced > journal.KEEP_S / 2:
            notes = _rebuild(registry, listed, now, window_s)
        else:
            notes = []
            _catch_up(registry, listed, now, window_s)
        registry.db.write(lambda c: _set_synced(c, now))
    return notes


def _synced_at(connection: Connection) -> float | None:
    return connection.scalar(select(sync_times.c.value).where(sync_times.c.key == "synced"))


def _set_synced(connection: Connection, now: float) -> None:
    connection.execute(delete(sync_times).where(sync_times.c.key == "synced"))
    connection.execute(insert(sync_times), {"key": "synced", "value": now})


@contextmanager
def _host_lock(index: Path) -> Iterator[None]:
    """One process of this host brings the index up to date at a time; the others then find
    nothing left to do. (The index is on this host's own disk, where flock works.)"""
    index.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(f"{index}.sync.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _rebuild(registry: Registry, listed: list[str], now: float, window_s: float) -> list[str]:
    """Index every name from its ref files; remember the journal as it is (each entry is
    applied once more a cache window from now, in case a listing was stale)."""
    store = registry.store
    indexed = set(registry.db.read(_indexed_names))
    for name in sorted(set(refs.names(store, [])) | indexed):
        refresh_name(registry, name, None)
    registry.db.write(_forget_seen)
    read = time.time()
    registry.db.write(lambda c: _mark_seen(c, listed, read, settled=window_s <= 0))
    return _shared_index_note(registry)


def _shared_index_note(registry: Registry) -> list[str]:
    """Say once (when this host's index is made) that an index.db in the registry is unused."""
    old = registry.store.backend.local_path(SHARED_INDEX_FILE)
    if old is None or not old.exists():
        return []
    where = registry.db.sqlite_path
    return [
        f"note: {old} is no longer used: SQLite cannot be shared over a network filesystem "
        f"({filesystem_type(old.parent)}), so this host keeps its own index at {where}, "
        "filled from the store; delete index.db once no host runs a flare older than this one"
    ]


def _catch_up(registry: Registry, listed: list[str], now: float, window_s: float) -> None:
    """Apply the entries not seen yet, and again those first seen a cache window ago."""
    rows = registry.db.read(lambda c: c.execute(select(seen_entries)).all())
    seen = {entry: (first, settled) for entry, first, settled in rows}
    new = [e for e in listed if e not in seen]
    due = [e for e in listed if e in seen and not seen[e][1] and now - seen[e][0] >= window_s]
    changes: dict[str, set[Digest | None]] = {}
    for entry in new + due:
        change = journal.read_change(registry.store, entry)
        if change is not None:
            changes.setdefault(change.name, set()).add(change.digest)
    for name, digests in sorted(changes.items()):
        refresh_name(registry, name, digests)
    read = time.time()
    registry.db.write(lambda c: _mark_seen(c, new, read, settled=window_s <= 0))
    registry.db.write(lambda c: _settle(c, due))
    still = set(listed)
    gone = [e for e, (first, _) in seen.items() if e not in still and now - first > journal.KEEP_S]
    registry.db.write(lambda c: _drop_seen(c, gone))


def _mark_seen(connection: Connection, listed: list[str], read: float, settled: bool) -> None:
    """Remember entries as first seen at `read`, the time the refs they announce were last
    read (after the reads, not before them: the second reading, a cache window later, must
    come a whole window after the first, however long the first took)."""
    rows = [{"entry": e, "first_seen": read, "settled": settled} for e in listed]
    if rows:
        connection.execute(insert(seen_entries), rows)


def _settle(connection: Connection, due: list[str]) -> None:
    if due:
        done = update(seen_entries).where(seen_entries.c.entry.in_(due)).values(settled=True)
        connection.execute(done)


def _drop_seen(connection: Connection, gone: list[str]) -> None:
    if gone:
        connection.execute(delete(seen_entries).where(seen_entries.c.entry.in_(gone)))


def _forget_seen(connection: Connection) -> None:
    connection.execute(delete(seen_entries))


def _indexed_names(connection: Connection) -> list[str]:
    named = select(publications.c.name).union(select(tags.c.name))
    return list(connection.scalars(named))


def refresh_name(registry: Registry, name: str, digests: set[Digest | None] | None) -> None:
    """Make the index's rows for NAME what its ref files say now: its tags, and its records of
    the given packages (None: of every package recorded or indexed under NAME), pins included.
    A package whose index cannot be read yet is left as it is, for a later pass to index."""
    store = registry.store
    tag_rows = [
        {"name": name, "tag": t, "digest": str(d)} for t, d in refs.tags_of(store, name, []).items()
    ]
    pins = set(refs.pins_of(store, name, []))
    if digests is None:
        indexed = registry.db.read(lambda c: _indexed_digests(c, name))
        wanted = set(refs.packages_of(store, name, [])) | indexed
    else:
        wanted = {d for d in digests if d is not None}
    records: dict[Digest, _Found | None] = {}
    for digest in sorted(wanted):
        try:
            records[digest] = _record(registry, name, digest)
        except FlareError:
            continue  # its index is not readable through this host yet

    def apply(connection: Connection) -> None:
        for digest, found in records.items():
            if found is None:
                registry._forget(connection, name, digest)
            else:
                _put_publication(connection, registry, found, pins)
        connection.execute(delete(tags).where(tags.c.name == name))
        if tag_rows:
            connection.execute(insert(tags), tag_rows)

    registry.db.write(apply)


def _indexed_digests(connection: Connection, name: str) -> set[Digest]:
    query = select(publications.c.digest).where(publications.c.name == name)
    return {Digest.parse(d) for d in connection.scalars(query)}


@dataclass(frozen=True)
class _Found:
    """A package recorded under a name, with its manifest if the index lacks the package."""

    record: refs.PackageRecord
    manifest: Manifest | None
    index_size: int


def _record(registry: Registry, name: str, digest: Digest) -> _Found | None:
    """What the store says of NAME's package now; None if it is not recorded under NAME."""
    record = refs.read_record(registry.store, name, digest)
    if record is None:
        return None
    record = refs.PackageRecord(name, digest, record.created, registry.publisher(digest))
    known = packages.c.digest == str(digest)
    if registry.db.read(lambda c: c.scalar(select(packages.c.digest).where(known))) is not None:
        return _Found(record, None, 0)
    manifest = refs.read_manifest(registry.store, digest)
    return _Found(record, manifest, registry.store.require(digest).stored_size)


def _put_publication(
    connection: Connection, registry: Registry, found: _Found, pins: set[Digest]
) -> None:
    """Index the package if new, and NAME's publication of it (pinned or not)."""
    if found.manifest is not None:
        registry._index_package(connection, found.record, found.manifest, found.index_size)
        return
    record = found.record
    key = publications.c.name == record.name, publications.c.digest == str(record.digest)
    connection.execute(delete(publications).where(*key))
    row = {
        "name": record.name,
        "digest": str(record.digest),
        "created": record.created,
        "publisher": record.publisher,
        "pinned": record.digest in pins,
    }
    connection.execute(insert(publications), row)


def is_sqlite(database: str) -> bool:
    """True for a SQLite index DB URL."""
    return make_url(database).get_backend_name() == "sqlite"
