"""Where a store keeps what it keeps, under its root: blobs in `blobs/blake3/<2 hex>/`, named by
their digest (plus `.zst` when kept compressed); corrupt ones in `quarantine/`, swept ones in
`trash/` (temp files: `backends/base.py`). The names are parsed here and nowhere else."""

from __future__ import annotations

import re
import time

from flare.store.digest import HEX_LENGTH, Digest
from flare.store.encoding import Encoding

BLOB_DIR = "blobs/blake3"
_BLOB_FILE = re.compile(rf"([0-9a-f]{{{HEX_LENGTH}}})({re.escape(Encoding.ZSTD.suffix)})?")
QUARANTINE_DIR = "quarantine"
_QUARANTINED = re.compile(
    rf"([0-9a-f]{{{HEX_LENGTH}}})({re.escape(Encoding.ZSTD.suffix)})?\.[0-9]+"
)
TRASH_DIR = "trash"
"""Where gc's sweep moves blobs before it deletes them (store/trash.py)."""


def blob_key(digest: Digest, encoding: Encoding) -> str:
    """Where a blob lives under the store root."""
    return f"{BLOB_DIR}/{digest.hex[:2]}/{digest.hex}{encoding.suffix}"


def parse_blob_key(key: str) -> tuple[Digest, Encoding] | None:
    """The digest and encoding a blob file name stands for, or None for a stray file."""
    parsed = blob_name(key)
    return None if parsed is None else (Digest.from_checked_hex(parsed[0]), parsed[1])


def blob_name(key: str) -> tuple[str, Encoding] | None:
    """The hex digest and encoding of a blob file name, as strings (gc compares 100,000s)."""
    parts = key.split("/")
    if len(parts) != 4 or parts[0] != "blobs" or parts[1] != "blake3":
        return None
    return blob_file(parts[2], parts[3])


def blob_file(folder: str, name: str) -> tuple[str, Encoding] | None:
    """The hex digest and encoding of a file `name` in the fan-out folder `folder`, or None
    for a stray file (one regex: gc's sweep parses every unreachable blob's name)."""
    match = _BLOB_FILE.fullmatch(name)
    if match is None or not match[1].startswith(folder) or len(folder) != 2:
        return None
    return match[1], Encoding.ZSTD if match[2] else Encoding.PLAIN


def quarantine_key(digest: Digest, encoding: Encoding) -> str:
    """Where verify moves a corrupt blob: its name, and when, so no two moves collide."""
    return f"{QUARANTINE_DIR}/{digest.hex}{encoding.suffix}.{time.time_ns()}"


def parse_quarantined(name: str) -> tuple[Digest, Encoding] | None:
    """The digest and encoding of a file verify put in quarantine/, or None for another."""
    match = _QUARANTINED.fullmatch(name)
    if match is None:
        return None
    return Digest.from_checked_hex(match[1]), Encoding.ZSTD if match[2] else Encoding.PLAIN
