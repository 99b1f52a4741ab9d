"""The host cache: packages pulled to this host, as plain blobs on a local disk.

Plain, so payloads can be memory-mapped where they lie; local, so a server never reads
weights over the NAS. A package is in the cache once its index is: pull writes it last.
Its signatures come along, so the cache alone says who published what it holds.

The cache is not trusted for being local: serve hashes every blob as it loads it, and a
blob that changed here is quarantined, so that the next pull fetches it again.
"""

from __future__ import annotations

import os
from pathlib import Path

from flare.errors import IntegrityError
from flare.registry.signatures import write_signature
from flare.store.blobs import BlobStore
from flare.store.digest import Digest
from flare.store.encoding import Encoding
from flare.store.layout import blob_key
from flare.store.package import Manifest


class HostCache:
    """This host's package cache (paths.package_cache)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.store = BlobStore(str(self.root), Encoding.PLAIN)
        self.store.backend.ensure()

    def links_from(self, source: BlobStore) -> bool:
        """Whether blobs from `source` arrive as links (no new space): one filesystem, plain."""
        where = source.backend.local_path("")
        if where is None or source.encoding is not Encoding.PLAIN:
            return False
        return os.stat(where).st_dev == os.stat(self.root).st_dev

    def add(self, digest: Digest, index: bytes, signatures: list[bytes], name: str | None) -> None:
        """Record a package whose blobs are all here: signatures first, the index last (a
        cached index that no longer matches its digest is quarantined and written again)."""
        for bundle in signatures:
            write_signature(self.store, digest, bundle)
        if self.store.has(digest):
            self.quarantine_if_corrupt(digest)
        stored = self.store.put_bytes(index).digest
        if stored != digest:
            raise IntegrityError(f"the index of {name or digest.short()} changed while pulled")

    def files(self, manifest: Manifest, ranks: tuple[int, ...] | None = None) -> dict[str, Path]:
        """Every blob of the package (of `ranks`' share) as a local file, keyed by its
        digest text."""
        paths = {}
        for digest in manifest.blobs(ranks):
            self.store.require(digest)
            paths[str(digest)] = self.store.backend.local_path(blob_key(digest, Encoding.PLAIN))
        return paths  # type: ignore[return-value]

    def quarantine_if_corrupt(self, digest: Digest) -> str | None:
        """Re-hash a blob and, if corrupt, move it to quarantine/ (as `flare store verify`
        does), so that it is missing and the next pull copies it again. Returns the path it
        was moved to, or None if it hashed right after all."""
        moved = self.store.verify([digest]).quarantined
        return str(self.root / moved[0]) if moved else None
