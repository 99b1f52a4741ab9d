"""Content digests: BLAKE3-256 written `blake3:<64 hex>`, and unique-prefix references."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from flare.errors import AmbiguousError, InvalidInputError, NotFoundError

ALGORITHM = "blake3"
HEX_LENGTH = 64
MIN_PREFIX = 8
_HEX = re.compile(r"^[0-9a-f]+$")


@dataclass(frozen=True, order=True)
class Digest:
    """The BLAKE3-256 of some content bytes; the only name flare trusts."""

    hex: str

    def __post_init__(self) -> None:
        if len(self.hex) != HEX_LENGTH or not _HEX.match(self.hex):
            raise InvalidInputError(
                f"not a digest: {self.hex!r}", f"expected {ALGORITHM}:<{HEX_LENGTH} hex digits>"
            )

    def __str__(self) -> str:
        return f"{ALGORITHM}:{self.hex}"

    @classmethod
    def from_checked_hex(cls, hex_digest: str) -> Digest:
        """A digest from hex the caller has already checked (64 lowercase hex digits)."""
        digest = object.__new__(cls)
        object.__setattr__(digest, "hex", hex_digest)
        return digest

    def short(self, length: int = 12) -> str:
        """The first hex digits, enough to tell digests apart in a listing."""
        return self.hex[:length]

    @classmethod
    def parse(cls, text: str) -> Digest:
        """Read a full digest, with or without the `blake3:` prefix."""
        return cls(_strip_algorithm(text))


def _strip_algorithm(text: str) -> str:
    algorithm, sep, rest = text.strip().lower().rpartition(":")
    if sep and algorithm != ALGORITHM:
        raise InvalidInputError(
            f"unsupported digest algorithm {algorithm!r} in {text!r}", f"use {ALGORITHM}:<hex>"
        )
    return rest


def parse_prefix(text: str) -> str:
    """Validate a digest reference that may be cut short; return its hex digits."""
    hex_part = _strip_algorithm(text)
    shown = repr(text) if len(text) <= 80 else f"{text[:72]!r}... ({len(text)} characters)"
    if not _HEX.match(hex_part):
        raise InvalidInputError(f"not a digest or digest prefix: {shown}", "use hex digits 0-9a-f")
    if len(hex_part) > HEX_LENGTH:
        raise InvalidInputError(
            f"digest {shown} has {len(hex_part)} hex digits", f"a digest has {HEX_LENGTH}"
        )
    if len(hex_part) < MIN_PREFIX:
        raise InvalidInputError(
            f"digest prefix {text!r} is too short", f"give at least {MIN_PREFIX} hex digits"
        )
    return hex_part


def resolve_prefix(prefix_hex: str, candidates: Iterable[Digest], where: str) -> Digest:
    """Pick the one candidate that starts with the prefix, or say why there is none."""
    matches = sorted(d for d in candidates if d.hex.startswith(prefix_hex))
    if not matches:
        raise NotFoundError(f"no blob matches {prefix_hex} in {where}", "check the digest")
    if len(matches) > 1:
        listed = ", ".join(d.short(16) for d in matches[:10])
        more = f" and {len(matches) - 10} more" if len(matches) > 10 else ""
        raise AmbiguousError(
            f"{prefix_hex} is ambiguous in {where}: {listed}{more}", "give more hex digits"
        )
    return matches[0]
