"""The change journal: one new, immutable file per change to a name's refs, so that a host
whose index DB is its own (a registry on a network filesystem, or at a URL) brings that index up
to date by reading what changed, not every ref and package index of the registry.

`journal/<ns>.<host>.<pid>.<random>.json` holds `{"name": NAME, "digest": "<64 hex>"}` (digest
null for a change to NAME's tags only): the ref files of NAME changed, for the package DIGEST. An
entry carries no state: applying it re-reads NAME's ref files as they are then, so entries may be
applied in any order, twice, or late, and writers need no lock and no shared counter. A writer
writes the ref files first and the entry after them. `flare registry gc` removes entries older
than KEEP_S; a host that has not looked for half that long reads every ref again instead.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from flare.atomic import temp_name
from flare.errors import InvalidInputError
from flare.store.blobs import BlobStore
from flare.store.digest import Digest
from flare.store.names import check_name

JOURNAL_DIR = "journal"
SUFFIX = ".json"
KEEP_S = 7 * 86400.0
"""Entries older than this (by their modification time and gc's clock) are removed by gc."""


@dataclass(frozen=True)
class Change:
    """What one entry announces: NAME's refs changed (for the package `digest`, if given)."""

    name: str
    digest: Digest | None


def record_change(store: BlobStore, name: str, digest: Digest | None = None) -> str:
    """Announce a change of NAME's ref files (written before this): a new file, never
    replaced, named so that no two writers on any host pick the same name."""
    key = f"{JOURNAL_DIR}/{time.time_ns()}.{temp_name().removesuffix('.part')}{SUFFIX}"
    body = {"name": name, "digest": None if digest is None else digest.hex}
    store.backend.ensure()
    store.backend.write_atomic(key, json.dumps(body, sort_keys=True).encode())
    return key


def entries(store: BlobStore) -> list[str]:
    """The names of every entry in the journal, oldest writer's clock first."""
    return [n for n in store.backend.list_dir(JOURNAL_DIR) if n.endswith(SUFFIX)]


def read_change(store: BlobStore, entry: str) -> Change | None:
    """The change an entry announces; None for one gone meanwhile, or not written by flare
    (a name no package can have, `../x` included: a host would read refs outside the
    registry for it)."""
    data = store.backend.read(f"{JOURNAL_DIR}/{entry}")
    try:
        body = json.loads(data or b"")
        digest = body.get("digest")
        name = check_name(body["name"])
        return Change(name, None if digest is None else Digest(digest))
    except (ValueError, TypeError, KeyError, AttributeError, InvalidInputError):
        return None


def drop_old(store: BlobStore, keep_s: float = KEEP_S) -> list[str]:
    """Remove entries older than `keep_s`: every host still reading the journal has applied
    them (a host away for longer reads every ref again)."""
    cutoff, dropped = time.time() - keep_s, []
    for entry in entries(store):
        key = f"{JOURNAL_DIR}/{entry}"
        stat = store.backend.stat(key)
        if stat is not None and stat[1] < cutoff:
            store.backend.remove(key)
            dropped.append(key)
    return dropped
