"""The trash: gc deletes a blob in two phases, so that it can take a decision back.

Between gc's last look at a blob (old, unreached) and its removal, a writer may find the blob
stored and take it as stored: it touches the blob and never writes it again. A plain unlink
would then remove a blob that a package being published needs. So the sweep moves the blob to
`trash/<2 hex>/<64 hex>[.zst].<TRASHED>.<SEEN>` instead (a rename: the same inode, its times
kept), where TRASHED is when it moved it and SEEN the modification time its last look found,
both in nanoseconds. Emptying the trash looks again: an entry whose modification time is no
longer SEEN was touched by a writer before the move, and one that a root reaches now (a tag
or lease that showed meanwhile) is needed; both are put back. The rest are deleted. A writer
that finds a blob of its new package gone puts it back from here itself (`missing`).

On an fsspec URL a move is a copy with a new time, and a touch changes no time: there the
sweep deletes at once (leases alone protect what writers reuse).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from flare.store.blobs import TRASH_DIR, BlobStore, blob_key
from flare.store.digest import HEX_LENGTH, Digest
from flare.store.encoding import Encoding
from flare.store.errors import NotFoundError, from_os_error

_ENTRY = re.compile(
    rf"([0-9a-f]{{{HEX_LENGTH}}})({re.escape(Encoding.ZSTD.suffix)})?\.([0-9]+)\.([0-9]+)"
)


@dataclass(frozen=True)
class Trashed:
    """One blob in the trash."""

    key: str
    digest: Digest
    encoding: Encoding
    trashed: float
    """When the sweep moved it (seconds, the collecting host's clock)."""
    seen_ns: int
    """Its modification time as the sweep's last look found it."""
    size: int


def _ns(modified: float) -> int:
    """A modification time as a whole number, the same for the same float."""
    return round(modified * 1e9)


def discard(store: BlobStore, key: str, modified: float) -> bool:
    """Sweep the blob at key, last seen with modification time `modified`: into the trash
    (deleted at once where moves copy). False if it was gone already (another collector).
    The rename is not made durable: after a power loss the blob is back where it was, and
    the next gc sweeps it again."""
    source = store.backend.local_path(key)
    if source is None:
        store.backend.remove(key)
        return True
    name = f"{source.name}.{time.time_ns()}.{_ns(modified)}"
    dest = store.backend.local_path(f"{TRASH_DIR}/{source.name[:2]}/{name}")
    assert dest is not None
    try:
        _rename(source, dest)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise from_os_error(exc, "move to the trash", source) from exc
    return True


def _rename(source: Path, dest: Path) -> None:
    try:
        os.rename(source, dest)
    except FileNotFoundError:
        if dest.parent.is_dir() or not source.exists():
            raise
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.rename(source, dest)


def entries(store: BlobStore, folder: str = "") -> Iterator[Trashed]:
    """Every blob in the trash (or in one fan-out folder of it); other files are left out."""
    prefix = f"{TRASH_DIR}/{folder}" if folder else TRASH_DIR
    for stored in store.backend.iter_files(prefix):
        match = _ENTRY.fullmatch(stored.key.rsplit("/", 1)[-1])
        if match is None:
            continue
        encoding = Encoding.ZSTD if match[2] else Encoding.PLAIN
        digest = Digest.from_checked_hex(match[1])
        yield Trashed(stored.key, digest, encoding, int(match[3]) / 1e9, int(match[4]), stored.size)


def touched(store: BlobStore, entry: Trashed) -> bool:
    """Whether a writer touched the blob after the sweep's last look (False if it is gone)."""
    stat = store.backend.stat(entry.key)
    return stat is not None and _ns(stat[1]) != entry.seen_ns


def put_back(store: BlobStore, entry: Trashed) -> None:
    """The entry back under its blob name; dropped if the blob was stored again meanwhile (the
    same bytes). Never replaces a stored blob."""
    if not store.backend.move_no_clobber(entry.key, blob_key(entry.digest, entry.encoding)):
        store.backend.remove(entry.key)


def delete(store: BlobStore, entry: Trashed) -> None:
    store.backend.remove(entry.key)


def recover(store: BlobStore, digest: Digest) -> bool:
    """Put a blob back from the trash, if it is there; whether it is stored now."""
    found = [e for e in entries(store, digest.hex[:2]) if e.digest == digest]
    for entry in found:
        try:
            put_back(store, entry)
        except NotFoundError:
            continue  # put back, or emptied, by a collector meanwhile
    return store.confirm(digest) if found else False


def missing(store: BlobStore, digests: Iterable[Digest]) -> list[Digest]:
    """The blobs not stored, asked of the server (a fresh open), after putting back any that a
    collector moved to the trash after the writer found them stored: a writer's last check
    that its new package is whole."""
    return [d for d in digests if not store.confirm(d) and not recover(store, d)]
