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
from flare.store.digest import HEX_LENGTH, Digest
from flare.store.hashing import hash_bytes

MARKS_DIR = "marks"
CHECKSUM = b"blake3:"
LINE = HEX_LENGTH + 1
"""A line of a marks file: a hex digest and a newline."""


def marks_key(digest: Digest) -> str:
    return f"{MARKS_DIR}/{digest.hex}"


def encode_marks(blobs: set[str]) -> bytes:
    """The file's bytes: sorted lines, then the checksum of those lines."""
    body = _body(blobs)
    return body + CHECKSUM + hash_bytes(body).hex.encode("ascii") + b"\n"


def decode_marks(data: bytes) -> bytes | None:
    """The sorted lines as written (LINE bytes each), or None unless the checksum matches (a
    torn or edited file) and every line has one length (the sweep cuts the lines by binary
    search). Bytes, not strings: a sweep share decodes only its own folders' lines
    (Marked.in_folder)."""
    body, found, checksum = data.rpartition(CHECKSUM)
    if not found or checksum != hash_bytes(body).hex.encode("ascii") + b"\n":
        return None
    lines = len(body) // LINE
    if len(body) % LINE or body[HEX_LENGTH::LINE] != b"\n" * lines or not body.isascii():
        return None  # not lines of one length: not a file flare wrote
    return body


def write_marks(store: BlobStore, digest: Digest, blobs: set[str]) -> None:
    """Keep a package's blob set (index included) for later collections, atomically."""
    store.backend.ensure()
    store.backend.write_atomic(marks_key(digest), encode_marks(blobs))


def listed(store: BlobStore, digest: Digest) -> bytes | None:
    """The sorted marks lines of a package's marks file, if it has a sound one."""
    data = store.backend.read(marks_key(digest))
    lines = decode_marks(data) if data is not None else None
    return lines if lines is not None and _line(lines, digest.hex) is not None else None


def package_blobs(store: BlobStore, digest: Digest, keep: bool) -> bytes:
    """The sorted marks lines of every blob a stored package needs, its index included: from
    its marks file, else from its index (verified against its digest), then kept if `keep`."""
    lines = listed(store, digest)
    if lines is not None:
        return lines
    from flare.store.package import referenced_blobs  # pydantic: not for listing commands

    index = store.read_bytes(digest)
    blobs = referenced_blobs(index, f"package {digest.short()}") | {digest.hex}
    if keep:
        write_marks(store, digest, blobs)
    return _body(blobs)


class Marked:
    """The blobs a collection's roots reach: the sorted marks lines of each package, kept as
    bytes and decoded one fan-out folder at a time by the sweep share that lists that folder
    (store/sweep.py), and single digests (blobs that leases hold)."""

    def __init__(self, bodies: list[bytes], loose: set[str]) -> None:
        self.bodies = bodies
        self.loose: dict[str, list[str]] = {}
        for hex_digest in loose:
            self.loose.setdefault(hex_digest[:2], []).append(hex_digest)

    def in_folder(self, folder: str) -> list[list[str]]:
        """The marked digests in one fan-out folder: one list per marks file, and the single
        digests there. Hex digits sort before "g", so `folder + "g"` ends the folder's lines."""
        found = [self.loose.get(folder, [])]
        for body in self.bodies:
            start, end = _first_line(body, folder), _first_line(body, f"{folder}g")
            found.append(body[start:end].decode("ascii").split())
        return found


def _body(blobs: set[str]) -> bytes:
    return "".join(f"{hex_digest}\n" for hex_digest in sorted(blobs)).encode("ascii")


def _first_line(body: bytes, prefix: str) -> int:
    """The offset of the first line not sorted before `prefix`."""
    wanted = prefix.encode("ascii")
    lines = range(len(body) // LINE)
    at = bisect_left(lines, wanted, key=lambda i: body[i * LINE : i * LINE + len(wanted)])
    return at * LINE


def _line(body: bytes, hex_digest: str) -> int | None:
    """The offset of the line holding the digest, or None (a marks file holds its own index)."""
    at = _first_line(body, hex_digest)
    return at if body[at : at + LINE - 1] == hex_digest.encode("ascii") else None


def drop_orphans(store: BlobStore, keep: set[Digest]) -> list[str]:
    """Remove the marks of packages whose index is gone (after gc swept it), but a root's in
    `keep`: its index may be put back, and its marks are what kept its blobs."""
    kept = {digest.hex for digest in keep}
    gone = store.absent(store.backend.list_dir(MARKS_DIR))
    dropped = [f"{MARKS_DIR}/{name}" for name in gone if name not in kept]
    for key in dropped:
        store.backend.remove(key)
    return dropped
