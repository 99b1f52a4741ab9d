"""The store as an outside reader sees it, read without flare's code: which blobs are there and
whole, which refs point where, which packages are complete. The invariants are stated on this
view, so that a bug in flare's reader cannot hide a bug in its writer.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import blake3
import zstandard

HEX = re.compile(r"[0-9a-f]{64}")
DIGEST_LINE = re.compile(r"blake3:([0-9a-f]{64})\n?")


def blob_path(root: Path, hex_digest: str) -> Path | None:
    """The file holding a blob (plain or zstd), or None."""
    folder = root / "blobs" / "blake3" / hex_digest[:2]
    for name in (hex_digest, f"{hex_digest}.zst"):
        if (folder / name).is_file():
            return folder / name
    return None


def content(path: Path) -> bytes:
    data = path.read_bytes()
    if path.suffix == ".zst":
        return zstandard.ZstdDecompressor().decompress(data)
    return data


def blob_ok(root: Path, hex_digest: str) -> str | None:
    """None when the blob is stored and hashes to its name; else what is wrong."""
    path = blob_path(root, hex_digest)
    if path is None:
        return f"blob {hex_digest[:12]} is missing"
    try:
        actual = blake3.blake3(content(path)).hexdigest()
    except zstandard.ZstdError as exc:
        return f"blob {hex_digest[:12]} does not decode: {exc}"
    return None if actual == hex_digest else f"blob {hex_digest[:12]} hashes to {actual[:12]}"


def manifest(root: Path, hex_digest: str) -> dict | None:
    """The manifest of a stored package index; None if the blob is absent or not an index."""
    path = blob_path(root, hex_digest)
    if path is None:
        return None
    try:
        data = content(path)
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + length])
        return json.loads(header["__metadata__"]["flare.manifest"])
    except (ValueError, KeyError, TypeError, struct.error, zstandard.ZstdError):
        return None


def needed(manifest_: dict) -> set[str]:
    """The hex digests of the blobs a manifest names."""
    entries = [*manifest_["payloads"], *manifest_["artifacts"]]
    return {entry["digest"].removeprefix("blake3:") for entry in entries}


def package_problem(root: Path, hex_digest: str) -> str | None:
    """None when the package is complete: its index and every blob it names are stored and
    whole; else the first thing wrong."""
    problem = blob_ok(root, hex_digest)
    if problem is not None:
        return f"package {hex_digest[:12]}: {problem}"
    found = manifest(root, hex_digest)
    if found is None:
        return f"{hex_digest[:12]} is not a package index"
    for blob in sorted(needed(found)):
        problem = blob_ok(root, blob)
        if problem is not None:
            return f"package {hex_digest[:12]}: {problem}"
    return None


@dataclass(frozen=True)
class RefFile:
    """One file under refs/: NAME, its kind (tags, packages, pins), its own name, content."""

    path: Path
    name: str
    kind: str
    entry: str
    data: bytes

    def target(self) -> str | None:
        """The package hex digest it names, or None if it names none readably."""
        if self.kind == "tags":
            match = DIGEST_LINE.fullmatch(self.data.decode("latin-1"))
            return match[1] if match else None
        return self.entry if HEX.fullmatch(self.entry) else None


def ref_files(root: Path) -> list[RefFile]:
    """Every file under refs/NAME/{tags,packages,pins}/ (and anything else found there)."""
    found = []
    for path in sorted((root / "refs").glob("*/*/*")):
        if path.is_file() and not path.name.startswith("."):
            name, kind = path.parent.parent.name, path.parent.name
            found.append(RefFile(path, name, kind, path.name, path.read_bytes()))
    return found


def protected(root: Path) -> dict[str, str]:
    """The packages tags and pins name (readably): `NAME:TAG` or `NAME!pin` -> hex digest."""
    roots = {}
    for ref in ref_files(root):
        target = ref.target()
        if target is not None and ref.kind == "tags":
            roots[f"{ref.name}:{ref.entry}"] = target
        elif target is not None and ref.kind == "pins":
            roots[f"{ref.name}!pin"] = target
    return roots


def dangling_refs(root: Path, ignore: set[Path] = frozenset()) -> list[str]:
    """Tags and pins that do not name a complete package (files in `ignore` were broken on
    purpose)."""
    problems = []
    for ref in ref_files(root):
        if ref.kind not in ("tags", "pins") or ref.path in ignore:
            continue
        target = ref.target()
        where = ref.path.relative_to(root)
        if target is None:
            problems.append(f"{where} names no package ({ref.data[:40]!r})")
        elif (problem := package_problem(root, target)) is not None:
            problems.append(f"{where}: {problem}")
    return problems


def dangling_records(root: Path, ignore: set[Path] = frozenset()) -> list[str]:
    """Package records (refs/NAME/packages/<hex>) whose package is not complete."""
    problems = []
    for ref in ref_files(root):
        if ref.kind != "packages" or ref.path in ignore:
            continue
        problem = package_problem(root, ref.entry) if HEX.fullmatch(ref.entry) else "bad name"
        if problem is not None:
            problems.append(f"{ref.path.relative_to(root)}: {problem}")
    return problems


def records(root: Path) -> set[tuple[str, str]]:
    """(name, hex digest) of every package record in the store."""
    return {(r.name, r.entry) for r in ref_files(root) if r.kind == "packages"}


def lost(root: Path, before: dict[str, str], spared: set[str] = frozenset()) -> list[str]:
    """Packages that a tag or pin protected before, that are no longer complete (packages in
    `spared` were broken on purpose)."""
    gone = []
    for ref, hex_digest in sorted(before.items()):
        if hex_digest in spared:
            continue
        problem = package_problem(root, hex_digest)
        if problem is not None:
            gone.append(f"{ref} ({hex_digest[:12]}): {problem}")
    return gone


def stored(root: Path) -> set[str]:
    """Hex digests of every stored blob."""
    folder = root / "blobs" / "blake3"
    if not folder.is_dir():
        return set()
    return {p.name.removesuffix(".zst") for p in folder.glob("*/*") if HEX.match(p.name)}
