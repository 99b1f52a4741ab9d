"""Marks: the blobs a package needs, kept beside its index so that gc need not decode it.

`marks/<package hex>`: the hex digest of every blob the package needs (its index included),
one per line, sorted, then a line `blake3:<hex>` of the lines before it. A package's blob set
never changes (its index is content-addressed), so the file never goes stale; decoding a large
manifest costs far more than the rest of a collection (docs/performance.md). The file is a
cache, not the truth: one that is missing, torn or fails its checksum is ignored and rebuilt
from the verified index, and `reindex` needs none of them.
"""

from __future__ import annotations

from bisect import bisect_left

from flare.store.blobs import BlobStore
from flare.store.digest import Digest
from flare.store.hashing import hash_bytes

MARKS_DIR = "marks"
CHECKSUM = b"blake3:"


def marks_key(digest: Digest) -> str:
    return f"{MARKS_DIR}/{digest.hex}"


def encode_marks(blobs: set[str]) -> bytes:
    """The file's bytes: sorted lines, then the checksum of those lines."""
    body = "".join(f"{hex_digest}\n" for hex_digest in sorted(blobs)).encode("ascii")
    return body + CHECKSUM + hash_bytes(body).hex.encode("ascii") + b"\n"


def decode_marks(data: bytes) -> list[str] | None:
    """The blobs as written (sorted), or None unless the checksum matches (a torn or edited
    file). A list, not a set: gc adds every package's blobs to one set of its own."""
    body, found, checksum = data.rpartition(CHECKSUM)
    if not found or checksum != hash_bytes(body).hex.encode("ascii") + b"\n":
        return None
    try:
        return body.decode("ascii").split()
    except UnicodeDecodeError:
        return None  # not a file flare wrote


def write_marks(store: BlobStore, digest: Digest, blobs: set[str]) -> None:
    """Keep a package's blob set (index included) for later collections, atomically."""
    store.backend.ensure()
    store.backend.write_atomic(marks_key(digest), encode_marks(blobs))


def package_blobs(store: BlobStore, digest: Digest, keep: bool) -> list[str]:
    """Hex digests of every blob a stored package needs, its index included, sorted: from its
    marks file, else from its index (verified against its digest), then kept if `keep`."""
    data = store.backend.read(marks_key(digest))
    listed = decode_marks(data) if data is not None else None
    if listed is not None and _holds(listed, digest.hex):
        return listed
    from flare.store.package import referenced_blobs  # pydantic: not for listing commands

    index = store.read_bytes(digest)
    blobs = referenced_blobs(index, f"package {digest.short()}") | {digest.hex}
    if keep:
        write_marks(store, digest, blobs)
    return sorted(blobs)


def _holds(listed: list[str], hex_digest: str) -> bool:
    """Whether a sorted list holds the digest (a marks file always holds its own index)."""
    at = bisect_left(listed, hex_digest)
    return at < len(listed) and listed[at] == hex_digest


def drop_orphans(store: BlobStore) -> list[str]:
    """Remove the marks of packages whose index is gone (after gc swept it)."""
    dropped = [f"{MARKS_DIR}/{name}" for name in store.absent(store.backend.list_dir(MARKS_DIR))]
    for key in dropped:
        store.backend.remove(key)
    return dropped
