"""References: NAME[:TAG][@DIGEST], kept as small files in the store beside the blobs.

`refs/NAME/tags/TAG` holds the digest a tag points at; `refs/NAME/packages/<hex>` marks a
package published under NAME. The store alone is enough to rebuild any index of them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from flare.store.blobs import BlobStore
from flare.store.digest import Digest, parse_prefix, resolve_prefix
from flare.store.errors import InvalidInputError, NotFoundError
from flare.store.package import Manifest, check_name, decode_index

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


def tag_package(store: BlobStore, name: str, tag: str, digest: Digest) -> None:
    """Point NAME:TAG at a package and record the package under NAME."""
    check_name(name)
    check_name(tag, "tag")
    store.backend.ensure()
    store.backend.write_atomic(f"{REFS_DIR}/{name}/packages/{digest.hex}", b"")
    store.backend.write_atomic(f"{REFS_DIR}/{name}/tags/{tag}", f"{digest}\n".encode())


def read_tag(store: BlobStore, name: str, tag: str) -> Digest | None:
    data = store.backend.read(f"{REFS_DIR}/{name}/tags/{tag}")
    return None if data is None else Digest.parse(data.decode().strip())


def packages_of(store: BlobStore, name: str) -> list[Digest]:
    return [Digest(h) for h in store.backend.list_dir(f"{REFS_DIR}/{name}/packages")]


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
    return decode_index(store.read_bytes(digest), f"package {digest.short()}")
