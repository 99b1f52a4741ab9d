"""References: NAME[:TAG][@DIGEST], kept as small files in the store beside the blobs.

`refs/NAME/tags/TAG` holds the digest a tag points at; `refs/NAME/packages/<hex>` records a
package published under NAME (when, by whom); `refs/NAME/pins/<hex>` pins it. The store
alone is enough to rebuild the index DB from these files.

A ref file anyone may edit by hand, so every read checks it: a file that does not say what its
path promises is a bad ref (BadRef). Readers of one name refuse with the file named; readers of
the whole registry (`scan`) collect them all, so verify can name each and reindex can skip them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from flare.errors import FlareError, InvalidInputError, NotFoundError
from flare.store.blobs import BlobStore
from flare.store.digest import Digest, parse_prefix, resolve_prefix
from flare.store.names import check_name
from flare.store.safetensors import MANIFEST_KEY, FormatError, read_header

if TYPE_CHECKING:
    from flare.store.package import Manifest

REFS_DIR = "refs"
DEFAULT_TAG = "latest"
KINDS = ("packages", "pins", "tags")
"""The folders of refs/NAME/."""
FIX = (
    "remove or rewrite it (docs/package-format.md#refs says what each ref file holds); "
    "`flare registry verify` lists every bad ref file"
)
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


class BadRefError(FlareError):
    """A ref file that does not say what its path promises, or that names no package index."""

    exit_code = 14


@dataclass(frozen=True)
class BadRef:
    """A bad ref file (or folder): its key under the store root, and what is wrong with it."""

    key: str
    problem: str

    def __str__(self) -> str:
        return f"{self.key}: {self.problem}"


def refusal(store: BlobStore, bad: Sequence[BadRef], hint: str = FIX) -> BadRefError:
    """The error naming the first bad file (and how many more there are)."""
    others = len(bad) - 1
    more = f" (and {others} other bad ref file{'s' * (others > 1)})" if others else ""
    return BadRefError(f"bad ref file {store.location}/{bad[0]}{more}", hint)


def _found(store: BlobStore, bad: list[BadRef] | None, ref: BadRef) -> None:
    """Collect a bad ref, or (no collector: a reader of one name) refuse at once."""
    if bad is None:
        raise refusal(store, [ref])
    bad.append(ref)


def _read(store: BlobStore, key: str, bad: list[BadRef] | None) -> bytes | None:
    """A ref file's bytes; None if absent (a file where a folder above it belongs included: a
    scan reports that file), or if a folder is where the file belongs (a bad ref)."""
    try:
        return store.backend.read(key)
    except (FlareError, OSError) as exc:
        cause = exc.__cause__ if isinstance(exc, FlareError) else exc
        if isinstance(cause, NotADirectoryError):
            return None
        if not isinstance(cause, IsADirectoryError):
            raise
    _found(store, bad, BadRef(key, "a folder where a file belongs"))
    return None


def _listing(store: BlobStore, key: str, bad: list[BadRef] | None) -> list[str]:
    """A ref folder's entries; a file where the folder belongs is a bad ref."""
    entries = store.backend.list_dir(key)
    if not entries and _is_file(store, key):
        _found(store, bad, BadRef(key, "a file where a folder belongs"))
    return entries


def _is_file(store: BlobStore, key: str) -> bool:
    try:
        return store.backend.read(key) is not None
    except (FlareError, OSError):
        return False  # a folder (or unreadable: the folder's listing said what it could)


def _shown(data: bytes) -> str:
    """What a bad file holds, short and printable."""
    text = data[:80].decode("ascii", "replace").strip()
    printable = data.isascii() and text.replace("\n", " ").replace("\t", " ").isprintable()
    return repr(text) if printable else f"{len(data)} bytes that are not text"


def _digest_named(store: BlobStore, key: str, bad: list[BadRef] | None) -> Digest | None:
    """The digest a file's name is (packages/<hex>, pins/<hex>), or None (a bad ref)."""
    try:
        return Digest(key.rsplit("/", 1)[-1])
    except InvalidInputError:
        _found(store, bad, BadRef(key, "its name is not a digest (64 lowercase hex digits)"))
        return None


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
    """Record NAME's package (keeping the first publication time if it was recorded before;
    a bad record of it is written again, whole)."""
    check_name(name)
    existing = read_record(store, name, digest, bad=[])
    if existing is not None and existing.publisher == publisher:
        return existing
    created = existing.created if existing else datetime.now(UTC).isoformat(timespec="seconds")
    body = {"created": created, "publisher": publisher}
    store.backend.ensure()
    store.backend.write_atomic(_package_key(name, digest), json.dumps(body).encode())
    return PackageRecord(name, digest, created, publisher)


def read_record(
    store: BlobStore, name: str, digest: Digest, bad: list[BadRef] | None = None
) -> PackageRecord | None:
    """NAME's record of a package; None if there is none (or it is bad and `bad` collects)."""
    key = _package_key(name, digest)
    data = _read(store, key, bad)
    if data is None:
        return None
    body = _record_body(data)
    if body is None:
        problem = f"holds {_shown(data)}, not a record (JSON: created, publisher)"
        _found(store, bad, BadRef(key, problem))
        return None
    return PackageRecord(name, digest, body.get("created") or "", body.get("publisher"))


def _record_body(data: bytes) -> dict[str, str | None] | None:
    """A record's fields, or None unless it is a JSON object of strings (empty: unknown)."""
    if not data.strip():
        return {}
    try:
        body = json.loads(data)
    except ValueError:  # UnicodeDecodeError included
        return None
    fields = {"created", "publisher"}
    if not isinstance(body, dict) or not set(body) <= fields:
        return None
    ok = all(v is None or isinstance(v, str) for v in body.values())
    return body if ok and isinstance(body.get("created", ""), str) else None


def tag_package(store: BlobStore, name: str, tag: str, digest: Digest) -> Digest | None:
    """Point NAME:TAG at a package, recording the package under NAME first (if it is not).

    Returns the package the tag pointed at before if that was another one (None for a new
    tag, the same package, or a bad tag file, which is rewritten): moving a tag is allowed but
    never silent, since the package it leaves may then be left for gc. Read just before the
    write, not under a lock: a tag two writers move at once is told by each as moved from
    what it read."""
    check_name(tag, "tag")
    before = read_tag(store, name, tag, bad=[])
    if read_record(store, name, digest, bad=[]) is None:
        record_package(store, name, digest)
    store.backend.write_atomic(_tag_key(name, tag), f"{digest}\n".encode())
    return before if before != digest else None


def _tag_key(name: str, tag: str) -> str:
    return f"{REFS_DIR}/{name}/tags/{tag}"


def untag(store: BlobStore, name: str, tag: str) -> None:
    store.backend.remove(_tag_key(name, tag))


def read_tag(
    store: BlobStore, name: str, tag: str, bad: list[BadRef] | None = None
) -> Digest | None:
    """The digest NAME:TAG points at; None if there is no such tag (or it is bad and `bad`
    collects)."""
    key = _tag_key(name, tag)
    data = _read(store, key, bad)
    if data is None:
        return None
    try:
        check_name(tag, "tag")
    except InvalidInputError:
        _found(store, bad, BadRef(key, "its name is not a tag name"))
        return None
    try:
        return Digest.parse(data.decode("ascii"))
    except (UnicodeDecodeError, InvalidInputError):
        _found(store, bad, BadRef(key, f"holds {_shown(data)}, not a digest (blake3:<64 hex>)"))
        return None


def names(store: BlobStore, bad: list[BadRef] | None = None) -> list[str]:
    """The names that have refs; a folder whose name is no package name is a bad ref."""
    found = []
    for name in store.backend.list_dir(REFS_DIR):
        try:
            found.append(check_name(name))
        except InvalidInputError:
            _found(store, bad, BadRef(f"{REFS_DIR}/{name}", "its name is not a package name"))
    return found


def tags_of(store: BlobStore, name: str, bad: list[BadRef] | None = None) -> dict[str, Digest]:
    found = {}
    for tag in _listing(store, f"{REFS_DIR}/{name}/tags", bad):
        digest = read_tag(store, name, tag, bad)
        if digest is not None:
            found[tag] = digest
    return found


def packages_of(store: BlobStore, name: str, bad: list[BadRef] | None = None) -> list[Digest]:
    """The packages recorded under NAME, by their files' names (read_record reads one)."""
    folder = f"{REFS_DIR}/{name}/packages"
    named = [_digest_named(store, f"{folder}/{e}", bad) for e in _listing(store, folder, bad)]
    return [digest for digest in named if digest is not None]


def _pin_key(name: str, digest: Digest) -> str:
    return f"{REFS_DIR}/{name}/pins/{digest.hex}"


def pin(store: BlobStore, name: str, digest: Digest) -> None:
    store.backend.write_atomic(_pin_key(name, digest), b"")


def unpin(store: BlobStore, name: str, digest: Digest) -> None:
    store.backend.remove(_pin_key(name, digest))


def pins_of(store: BlobStore, name: str, bad: list[BadRef] | None = None) -> list[Digest]:
    """NAME's pinned packages: the pin files' names (what a pin file holds is ignored)."""
    folder = f"{REFS_DIR}/{name}/pins"
    named = [_digest_named(store, f"{folder}/{e}", bad) for e in _listing(store, folder, bad)]
    return [digest for digest in named if digest is not None]


def tags_at(store: BlobStore, name: str, digest: Digest) -> list[str]:
    """NAME's tags that point at the package."""
    return [tag for tag, target in tags_of(store, name).items() if target == digest]


@dataclass(frozen=True)
class TagMove:
    """NAME:TAG moved from one package to another, and what of NAME still keeps the old one
    (gc keeps a package while any tag or pin names it), so the user is told whether moving
    the tag left it to gc."""

    name: str
    tag: str
    old: Digest
    new: Digest
    pinned: bool
    """NAME pins the old package."""
    tags: tuple[str, ...]
    """NAME's tags that still point at the old package."""

    def notice(self) -> str:
        """One line for stderr: what moved, and whether the old package is still kept."""
        old = f"{self.name}@{self.old.short()}"
        moved = f"moved {self.name}:{self.tag} from {self.old.short()} to {self.new.short()}"
        kept = ["pinned"] if self.pinned else []
        if self.tags:
            kept.append("tagged " + ", ".join(f"{self.name}:{tag}" for tag in self.tags))
        if kept:
            return f"{moved}; the old package {old} is still {' and '.join(kept)}"
        return (
            f"{moved}; the old package {old} keeps no tag or pin of {self.name} now, so gc may "
            f"collect it unless another name tags or pins it (flare registry pin {old} keeps it)"
        )

    def fields(self) -> dict[str, object]:
        """The move as JSON fields (for --json)."""
        return {
            "name": self.name,
            "tag": self.tag,
            "from": str(self.old),
            "to": str(self.new),
            "old_pinned": self.pinned,
            "old_tags": list(self.tags),
        }


def tag_move(store: BlobStore, name: str, tag: str, old: Digest, new: Digest) -> TagMove:
    """What a move of NAME:TAG off `old` left keeping it, read from the ref files now (after
    every tag of the command moved: a copy moves several). A bad ref file of NAME is passed
    over here: the move is done, and verify names the file."""
    pinned = old in pins_of(store, name, bad=[])
    tags = sorted(t for t, target in tags_of(store, name, bad=[]).items() if target == old)
    return TagMove(name, tag, old, new, pinned, tuple(tags))


def forget_package(store: BlobStore, name: str, digest: Digest, tags: list[str]) -> None:
    """Remove NAME's record of a package and the given tags (those pointing at it)."""
    for tag in tags:
        untag(store, name, tag)
    store.backend.remove(_package_key(name, digest))


@dataclass
class RefScan:
    """Every ref file of a store, each read once: what the good ones say, and the bad ones."""

    tags: dict[tuple[str, str], Digest] = field(default_factory=dict)
    """(NAME, TAG) -> the package it points at."""
    pins: set[tuple[str, Digest]] = field(default_factory=set)
    records: list[PackageRecord] = field(default_factory=list)
    bad: list[BadRef] = field(default_factory=list)

    def roots(self) -> set[Digest]:
        """The tagged and pinned packages (gc keeps them)."""
        return set(self.tags.values()) | {digest for _, digest in self.pins}

    def files(self) -> list[tuple[str, Digest]]:
        """Each good ref file and the package it names."""
        tags = [(_tag_key(name, tag), digest) for (name, tag), digest in self.tags.items()]
        pins = [(_pin_key(name, digest), digest) for name, digest in sorted(self.pins)]
        records = [(_package_key(r.name, r.digest), r.digest) for r in self.records]
        return tags + pins + records


def scan(store: BlobStore, records: bool = True) -> RefScan:
    """Read every ref file (without `records`, only tags and pins: the roots), collecting the
    bad ones rather than stopping at the first."""
    found = RefScan()
    for name in names(store, found.bad):
        folder = f"{REFS_DIR}/{name}"
        for entry in _listing(store, folder, found.bad):
            if entry not in KINDS:
                problem = "not a ref folder (tags/, packages/ or pins/)"
                found.bad.append(BadRef(f"{folder}/{entry}", problem))
        for tag, digest in tags_of(store, name, found.bad).items():
            found.tags[name, tag] = digest
        found.pins.update((name, digest) for digest in pins_of(store, name, found.bad))
        for digest in packages_of(store, name, found.bad) if records else []:
            record = read_record(store, name, digest, found.bad)
            if record is not None:
                found.records.append(record)
    return found


def is_package_index(store: BlobStore, digest: Digest) -> bool:
    """Whether a stored blob is shaped as a package index: a safetensors file with no tensors
    whose only metadata is the manifest (any format version). Only its header is read, unless
    that is not safetensors: then the whole blob, checked against its digest, so that a
    corrupt index raises IntegrityError rather than pass for a blob of another kind."""
    info = store.require(digest)
    try:
        with store.open(digest) as reader:
            header = read_header(reader, store.plain_size(info), f"blob {digest.short()}")
    except FormatError:
        store.read_bytes(digest)
        return False
    return not header.tensors and set(header.metadata) == {MANIFEST_KEY}


def resolve_package(store: BlobStore, text: str) -> tuple[str | None, Digest, str | None]:
    """The package a reference names in this store: its name (if given), its digest, and the
    ref file that gave the digest (None for a bare digest). NAME:TAG@DIGEST names it only
    if the tag points at that digest: a reference whose parts disagree is refused, never
    resolved by one part alone."""
    ref = parse_ref(text)
    if ref.digest is not None:
        prefix = parse_prefix(ref.digest)
        if ref.name is None:
            return None, store.resolve(ref.digest), None
        candidates = packages_of(store, ref.name)
        digest = resolve_prefix(prefix, candidates, f"{ref.name} in {store.location}")
        if ref.tag is not None:
            _check_tag_agrees(store, ref.name, ref.tag, digest)
        return ref.name, digest, _package_key(ref.name, digest)
    assert ref.name is not None
    tag = ref.tag or DEFAULT_TAG
    return ref.name, _tagged(store, ref.name, tag), _tag_key(ref.name, tag)


def _tagged(store: BlobStore, name: str, tag: str) -> Digest:
    digest = read_tag(store, name, tag)
    if digest is None:
        raise NotFoundError(f"no package {name}:{tag} in {store.location}", "check the name")
    return digest


def _check_tag_agrees(store: BlobStore, name: str, tag: str, digest: Digest) -> None:
    tagged = _tagged(store, name, tag)
    if tagged != digest:
        raise InvalidInputError(
            f"{name}:{tag} points at {tagged.short()}, not at {digest.short()}",
            f"give {name}@DIGEST for that package, or {name}:{tag} for the tagged one",
        )


def read_manifest(store: BlobStore, digest: Digest) -> Manifest:
    """A package's manifest, from an index verified against its digest."""
    from flare.store.package import decode_index  # pydantic: only for commands that read one

    return decode_index(store.read_bytes(digest), f"package {digest.short()}")
