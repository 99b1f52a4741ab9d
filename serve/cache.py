"""The host cache: packages pulled to this host, as plain blobs on a local disk.

Plain, so payloads can be memory-mapped where they lie; local, so a server never reads
weights over the NAS. A package is in the cache once its index is: pull writes it last.
Its signatures come along, so the cache alone says who published what it holds.

The cache is not trusted for being local: serve hashes every blob as it loads it, and a
blob that changed here is quarantined, so that the next pull fetches it again.

Each pull also writes `packages/<hex>.json` (the name it was pulled as): its modification
time says when the package was last pulled or served, and `flare cache ls` lists these. A
server holds a lease in the cache as well as in its registry, so that `flare cache rm` and
`flare cache prune` leave alone what a live server has mapped.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from flare.errors import FlareError, IntegrityError, InvalidInputError, NotFoundError
from flare.registry.leases import drop_expired_leases, live_leases
from flare.registry.signatures import SIGNATURES_DIR, write_signature
from flare.store.blobs import BlobInfo, BlobStore
from flare.store.digest import Digest, parse_prefix, resolve_prefix
from flare.store.encoding import Encoding
from flare.store.layout import blob_key
from flare.store.package import Manifest, referenced_blobs

PACKAGES_DIR = "packages"
ORPHAN_GRACE_S = 3600.0
"""prune removes blobs no cached package names only once untouched this long: a pull in
progress writes its blobs before the index that names them."""


class InUseError(FlareError):
    """A cached package a live server on this host is serving."""

    exit_code = 9


@dataclass(frozen=True)
class CachedPackage:
    """One package in the host cache, as `flare cache ls` shows it."""

    name: str
    digest: Digest
    size: int
    last_used: float
    servers: list[str]
    """The live servers (host:pid) that hold it."""


@dataclass
class Removal:
    """What `flare cache rm` or `prune` removed."""

    packages: list[CachedPackage]
    blobs: int = 0
    bytes: int = 0


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
        record = {"name": name or "", "digest": str(digest)}
        self.store.backend.write_atomic(_record_key(digest), json.dumps(record).encode())

    def packages(self) -> list[CachedPackage]:
        """Every cached package whose index is here, the most recently used first."""
        servers = self._servers()
        found = []
        for file in self.store.backend.list_dir(PACKAGES_DIR):
            key = f"{PACKAGES_DIR}/{file}"
            data, stat = self.store.backend.read(key), self.store.backend.stat(key)
            try:
                record = json.loads(data or b"")
                digest = Digest.parse(record["digest"])
            except (ValueError, TypeError, KeyError, FlareError):
                continue  # a torn or foreign file: not a package
            if stat is None or not self.store.has(digest):
                continue
            size = sum(self._size(d) for d in {digest, *self._blobs(digest)})
            holders = servers.get(str(digest), [])
            found.append(CachedPackage(record["name"], digest, size, stat[1], holders))
        return sorted(found, key=lambda p: p.last_used, reverse=True)

    def find(self, ref: str) -> list[CachedPackage]:
        """The cached packages REF names: NAME (each of its digests), NAME@DIGEST, or a
        digest or unique prefix of one."""
        cached = self.packages()
        name, _, digest_text = ref.partition("@")
        if not digest_text:
            if named := [p for p in cached if p.name == ref]:
                return named
            name, digest_text = "", ref
        try:
            prefix = parse_prefix(digest_text)
        except InvalidInputError as exc:
            raise NotFoundError(
                f"no package {ref!r} in the host cache {self.root}",
                "see flare cache ls (the cache keeps names and digests, not tags)",
            ) from exc
        candidates = [p.digest for p in cached if not name or p.name == name]
        digest = resolve_prefix(prefix, candidates, f"the host cache {self.root}")
        return [p for p in cached if p.digest == digest]

    def remove(self, doomed: list[CachedPackage]) -> Removal:
        """Remove packages from the cache, with the blobs no other cached package names;
        a package a live server holds is refused."""
        for package in doomed:
            if package.servers:
                raise InUseError(
                    f"{package.name}@{package.digest.short()} is served by "
                    f"{', '.join(package.servers)} on this host",
                    "stop that server first (flare ps lists servers)",
                )
        removal = Removal(doomed)
        for package in doomed:
            self.store.backend.remove(_record_key(package.digest))
            for name in self.store.backend.list_dir(f"{SIGNATURES_DIR}/{package.digest.hex}"):
                self.store.backend.remove(f"{SIGNATURES_DIR}/{package.digest.hex}/{name}")
        kept = self._named_blobs()
        for package in doomed:
            for digest in {package.digest, *self._blobs(package.digest)} - kept:
                self._drop(digest, removal)
        return removal

    def prune(self) -> Removal:
        """Remove every cached package no live server holds, the blobs no cached package names
        (left by removed packages or an interrupted pull) once they are an hour old, and the
        lease files of servers that died without removing them."""
        drop_expired_leases(self.store, older_than_s=0.0)  # servers that died unannounced
        removal = self.remove([p for p in self.packages() if not p.servers])
        kept, old_before = self._named_blobs(), time.time() - ORPHAN_GRACE_S
        for info in list(self.store.iter_blobs()):
            stat = self.store.backend.stat(blob_key(info.digest, info.encoding))
            if info.digest not in kept and stat is not None and stat[1] < old_before:
                self._drop(info.digest, removal)
        return removal

    def _servers(self) -> dict[str, list[str]]:
        """Package digest text -> the live serve leases (holders) on it."""
        held: dict[str, list[str]] = {}
        for lease in live_leases(self.store):
            for package in lease.packages if lease.purpose == "serve" else []:
                held.setdefault(package, []).append(lease.holder)
        return held

    def _blobs(self, digest: Digest) -> set[Digest]:
        """The blobs a cached index names (none if it is unreadable)."""
        try:
            data = self.store.read_bytes(digest)
            return {Digest(h) for h in referenced_blobs(data, str(digest))}
        except FlareError:
            return set()

    def _named_blobs(self) -> set[Digest]:
        """Every blob a listed package needs, its index included."""
        named: set[Digest] = set()
        for package in self.packages():
            named |= {package.digest, *self._blobs(package.digest)}
        return named

    def _size(self, digest: Digest) -> int:
        info = self.store.locate(digest)
        return self.store.plain_size(info) if info else 0

    def _drop(self, digest: Digest, removal: Removal) -> None:
        info = self.store.locate(digest)
        if info is None:
            return
        removal.bytes += self.store.plain_size(info)
        removal.blobs += 1
        self.store.backend.remove(blob_key(digest, info.encoding))

    def files(self, manifest: Manifest, ranks: tuple[int, ...] | None = None) -> dict[str, Path]:
        """Every blob of the package (of `ranks`' share) as a local file, keyed by its
        digest text."""
        paths = {}
        for digest in manifest.blobs(ranks):
            self.store.require(digest)
            paths[str(digest)] = self.store.backend.local_path(blob_key(digest, Encoding.PLAIN))
        return paths  # type: ignore[return-value]

    def locate(self, digest: Digest) -> BlobInfo | None:
        """The cached blob, if a file is there to read: anything else at its path (a folder)
        is quarantined, so that the pull copies the blob again rather than finding it
        present and the load failing on it."""
        info = self.store.locate(digest)
        if info is None:
            return None
        path = self.store.backend.local_path(blob_key(digest, info.encoding))
        if path is not None and not path.is_file():
            self.quarantine_if_corrupt(digest)
            return None
        return info

    def quarantine_if_corrupt(self, digest: Digest) -> str | None:
        """Re-hash a blob and, if corrupt, move it to quarantine/ (as `flare store verify`
        does), so that it is missing and the next pull copies it again. Returns the path it
        was moved to, or None if it hashed right after all."""
        moved = self.store.verify([digest]).quarantined
        return str(self.root / moved[0]) if moved else None


def _record_key(digest: Digest) -> str:
    return f"{PACKAGES_DIR}/{digest.hex}.json"
