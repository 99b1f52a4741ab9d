"""Signatures, kept in the store beside the packages they sign, never inside them.

`signatures/<package hex>/<blake3 hex of the file>.sigstore.json`: one file per signature,
named by its own content, so writers never replace each other's files, copying one twice is
harmless, and adding a signature never changes a package digest. The index DB's publisher
column is rebuilt from these files.
"""

from __future__ import annotations

from flare.errors import FlareError
from flare.sign.errors import UntrustedError
from flare.store.blobs import BlobStore
from flare.store.digest import Digest
from flare.store.hashing import hash_bytes

SIGNATURES_DIR = "signatures"
SUFFIX = ".sigstore.json"


def signature_key(digest: Digest, bundle: bytes) -> str:
    return f"{SIGNATURES_DIR}/{digest.hex}/{hash_bytes(bundle).hex}{SUFFIX}"


def write_signature(store: BlobStore, digest: Digest, bundle: bytes) -> str:
    """Store a signature of a package, atomically; returns its key."""
    key = signature_key(digest, bundle)
    store.backend.ensure()
    store.backend.write_atomic(key, bundle)
    return key


def read_signatures(store: BlobStore, digest: Digest) -> list[bytes]:
    """Every signature stored for a package (none: an empty list), unverified."""
    folder = f"{SIGNATURES_DIR}/{digest.hex}"
    found = []
    for name in store.backend.list_dir(folder):
        data = _read_file(store, f"{folder}/{name}") if name.endswith(SUFFIX) else None
        if data is not None:
            found.append(data)
    return found


def _read_file(store: BlobStore, key: str) -> bytes | None:
    """A signature file's bytes; None for a folder of that name, which holds no signature
    (as a file of garbage is passed over): anyone who may write to a shared registry could
    otherwise block every pull of a validly signed package with one `mkdir`."""
    try:
        return store.backend.read(key)
    except FlareError as exc:
        if isinstance(exc.__cause__, IsADirectoryError):
            return None
        raise


def claimed_publisher(signatures: list[bytes]) -> str | None:
    """The publishers the signatures name, for listings (checked only by `flare verify`)."""
    if not signatures:
        return None
    from flare.sign.envelope import read_bundle  # cryptography: only when there are some

    names = set()
    for data in signatures:
        try:
            names.add(read_bundle(data, "").claim.publisher)
        except UntrustedError:
            continue  # a malformed file names nobody; verify reports it
    return ",".join(sorted(names)) or None


def drop_orphans(store: BlobStore, keep: set[Digest]) -> list[str]:
    """Remove the signatures of packages whose index is gone (after gc swept it), but a
    root's in `keep`: its index may be put back, and its signatures still hold for it."""
    dropped = []
    kept = {digest.hex for digest in keep}
    for hex_digest in store.absent(store.backend.list_dir(SIGNATURES_DIR)):
        if hex_digest in kept:
            continue
        folder = f"{SIGNATURES_DIR}/{hex_digest}"
        for name in store.backend.list_dir(folder):
            store.backend.remove(f"{folder}/{name}")
            dropped.append(f"{folder}/{name}")
    return dropped
