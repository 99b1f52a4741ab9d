"""References: NAME[:TAG][@DIGEST], kept as small files in the store beside the blobs.

`refs/NAME/tags/TAG` holds the digest a tag points at; `refs/NAME/packages/<hex>` records a
package published under NAME (when, by whom); `refs/NAME/pins/<hex>` pins it. The store
alone is enough to rebuild the index DB from these files.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from flare.store.blobs import BlobStore
from flare.store.digest import Digest, parse_prefix, resolve_prefix
from flare.store.errors import InvalidInputError, NotFoundError
from flare.store.names import check_name

if TYPE_CHECKING:
    from flare.store.package import Manifest

REFS_DIR = "refs"
DEFAULT_TAG = "latest"
_REF = re.compile(r"^(?P<name>[^:@]+)(?::(?P<tag>[^:@]+))?(?:@(?P<digest>.+))?$")


@dataclass(frozen=True)
class Ref:
    """A parsed reference; at least a name or a digest."""

    name: str | None
    tag: str | None
    digest: str | None


def parse_ref(text: str) -> Ref:
    """Read NAME[:TAG][@DIGEST], or a bare digest (prefix)."""
    if text.startswith("blake3:") or (":" not in text and "@" not in text and _is_hex(text)):
        return Ref(None, None, text)
    match = _REF.match(text.strip())
    if not match:
        raise InvalidInputError(f"bad reference {text!r}", "use NAME[:TAG][@DIGEST]")
    check_name(match["name"])
    if match["tag"]:
        check_name(match["tag"], "tag")
    return Ref(match["name"], match["tag"], match["digest"])


def _is_hex(text: str) -> bool:
    return len(text) >= 8 and all(c in "0123456789abcdef" for c in text.lower())


@dataclass(frozen=True)
class PackageRecord:
    """A package published under a name: when, and by which publisher (once signed)."""

    name: str
    digest: Digest
    created: str
    publisher: str | None


def _package_key(name: str, digest: Digest) -> str:
    return f"{REFS_DIR}/{name}/packages/{digest.hex}"


def record_package(
    store: BlobStore, name: str, digest: Digest, publisher: str | None = None
) -> PackageRecord:
    """Record NAME's package (keeping the first publication time if it was recorded before)."""
    check_name(name)
    existing = read_record(store, name, digest)
    if existing is not None and existing.publisher == publisher:
        return existing
    created = existing.created if existing else datetime.now(UTC).isoformat(timespec="seconds")
    body = {"created": created, "publisher": publisher}
    store.backend.ensure()
    store.backend.write_atomic(_package_key(name, digest), json.dumps(body).encode())
    return PackageRecord(name, digest, created, publisher)


def read_record(store: BlobStore, name: str, digest: Digest) -> PackageRecord | None:
    data = store.backend.read(_package_key(name, digest))
    if data is None:
        return None
    try:
        body = json.loads(data) if data.strip() else {}
    except ValueError:
        body = {}
    return PackageRecord(name, digest, body.get("created") or "", body.get("publisher"))


def tag_package(store: BlobStore, name: str, tag: str, digest: Digest) -> None:
    """Point NAME:TAG at a package, recording the package under NAME first (if it is not)."""
    check_name(tag, "tag")
    if read_record(store, name, digest) is None:
        record_package(store, name, digest)
    store.backend.write_atomic(f"{REFS_DIR}/{name}/tags/{tag}", f"{digest}\n".encode())


def untag(store: BlobStore, name: str, tag: str) -> None:
    store.backend.remove(f"{REFS_DIR}/{name}/tags/{tag}")


def read_tag(store: BlobStore, name: str, tag: str) -> Digest | None:
    data = store.backend.read(f"{REFS_DIR}/{name}/tags/{tag}")
    return None if data is None else Digest.parse(data.decode().strip())


def names(store: BlobStore) -> list[str]:
    return store.backend.list_dir(REFS_DIR)


def tags_of(store: BlobStore, name: str) -> dict[str, Digest]:
    found = {}
    for tag in store.backend.list_dir(f"{REFS_DIR}/{name}/tags"):
        digest = read_tag(store, name, tag)
        if digest is not None:
            found[tag] = digest
    return found


def packages_of(store: BlobStore, name: str) -> list[Digest]:
    return [Digest(h) for h in store.backend.list_dir(f"{REFS_DIR}/{name}/packages")]


def pin(store: BlobStore, name: str, digest: Digest) -> None:
    store.backend.write_atomic(f"{REFS_DIR}/{name}/pins/{digest.hex}", b"")


def unpin(store: BlobStore, name: str, digest: Digest) -> None:
    store.backend.remove(f"{REFS_DIR}/{name}/pins/{digest.hex}")


def pins_of(store: BlobStore, name: str) -> list[Digest]:
    return [Digest(h) for h in store.backend.list_dir(f"{REFS_DIR}/{name}/pins")]


def forget_package(store: BlobStore, name: str, digest: Digest) -> list[str]:
    """Remove NAME's record of a package and the tags pointing at it; return those tags."""
    removed = [tag for tag, target in tags_of(store, name).items() if target == digest]
    for tag in removed:
        untag(store, name, tag)
    store.backend.remove(_package_key(name, digest))
    return removed


def resolve_package(store: BlobStore, text: str) -> tuple[str | None, Digest]:
    """The package a reference names in this store: its name (if given) and digest."""
    ref = parse_ref(text)
    if ref.digest is not None:
        prefix = parse_prefix(ref.digest)
        candidates = packages_of(store, ref.name) if ref.name else None
        if candidates is None:
            return None, store.resolve(ref.digest)
        return ref.name, resolve_prefix(prefix, candidates, f"{ref.name} in {store.location}")
    assert ref.name is not None
    tag = ref.tag or DEFAULT_TAG
    digest = read_tag(store, ref.name, tag)
    if digest is None:
        raise NotFoundError(f"no package {ref.name}:{tag} in {store.location}", "check the name")
    return ref.name, digest


def read_manifest(store: BlobStore, digest: Digest) -> Manifest:
    """A package's manifest, from an index verified against its digest."""
    from flare.store.package import decode_index  # pydantic: only for commands that read one

    return decode_index(store.read_bytes(digest), f"package {digest.short()}")
