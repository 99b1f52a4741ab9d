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

from flare.errors import NotFoundError, from_os_error
from flare.store.blobs import BlobStore
from flare.store.digest import HEX_LENGTH, Digest
from flare.store.encoding import Encoding
from flare.store.layout import TRASH_DIR, blob_key

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
    modified: float
    """Its modification time as listed in the trash."""

    @property
    def touched(self) -> bool:
        """Whether a writer touched the blob after the sweep's last look: before the move (the
        inode keeps the time), or, on a network filesystem, through a stale view of the old
        name up to a cache window after it (entries are decided only once that is over)."""
        return _ns(self.modified) != self.seen_ns


def _ns(modified: float) -> int:
    """A modification time as a whole number, the same for the same float."""
    return round(modified * 1e9)


def discard(store: BlobStore, key: str, modified: float) -> bool:
    """Sweep the blob at key, last seen with modification time `modified`: into the trash
    (deleted at once where moves copy). False if it was gone already (another collector).
    The rename is not made durable: after a power loss the blob is back where it was, and
    the next gc sweeps it again."""
    root = store.backend.local_path("")
    if root is None:
        store.backend.remove(key)
        return True
    name = key.rsplit("/", 1)[-1]
    source = f"{root}/{key}"
    folder = f"{root}/{TRASH_DIR}/{name[:2]}"
    dest = f"{folder}/{name}.{time.time_ns()}.{_ns(modified)}"
    try:
        try:
            os.rename(source, dest)
        except FileNotFoundError:
            if os.path.isdir(folder) or not os.path.exists(source):
                return False
            os.makedirs(folder, exist_ok=True)
            os.rename(source, dest)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise from_os_error(exc, "move to the trash", source) from exc
    return True


def entries(store: BlobStore, folder: str | None = None) -> Iterator[Trashed]:
    """Every blob in the trash (or in one fan-out folder of it), as one listing with a stat of
    each file gives it; other files are left out."""
    folders = store.backend.list_dir(TRASH_DIR) if folder is None else [folder]
    for name in folders:
        _, files = store.backend.stat_folder(f"{TRASH_DIR}/{name}", [])
        for file, size, modified in files:
            match = _ENTRY.fullmatch(file)
            if match is None:
                continue
            encoding = Encoding.ZSTD if match[2] else Encoding.PLAIN
            digest = Digest.from_checked_hex(match[1])
            key = f"{TRASH_DIR}/{name}/{file}"
            moved, seen = int(match[3]) / 1e9, int(match[4])
            yield Trashed(key, digest, encoding, moved, seen, size, modified)


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
