"""Digests and prefix references: what users type and what they get back."""

from __future__ import annotations

import pytest
from blake3 import blake3

from flare.errors import AmbiguousError, InvalidInputError, NotFoundError
from flare.store.digest import Digest, parse_prefix, resolve_prefix
from flare.store.hashing import hash_bytes

HEX = blake3(b"flare").hexdigest()


def test_digest_is_blake3_of_the_content_written_with_its_algorithm() -> None:
    digest = hash_bytes(b"flare")
    assert digest.hex == HEX
    assert str(digest) == f"blake3:{HEX}"


@pytest.mark.parametrize("text", [HEX, f"blake3:{HEX}", f"  BLAKE3:{HEX.upper()} "])
def test_parse_accepts_bare_prefixed_and_uppercase(text: str) -> None:
    assert Digest.parse(text).hex == HEX


@pytest.mark.parametrize(
    "text", [HEX[:-1], HEX + "0", f"sha256:{HEX}", HEX[:-1] + "g", "", "blake3:"]
)
def test_parse_refuses_malformed_digests(text: str) -> None:
    with pytest.raises(InvalidInputError):
        Digest.parse(text)


def test_prefix_needs_eight_hex_digits() -> None:
    assert parse_prefix(f"blake3:{HEX[:8]}") == HEX[:8]
    with pytest.raises(InvalidInputError, match="at least 8"):
        parse_prefix(HEX[:7])
    with pytest.raises(InvalidInputError):
        parse_prefix("zzzzzzzzzz")


def test_a_prefix_too_long_says_so_without_echoing_it_whole() -> None:
    with pytest.raises(InvalidInputError, match="has 65 hex digits") as info:
        parse_prefix(HEX + "0")
    assert "a digest has 64" in str(info.value)
    with pytest.raises(InvalidInputError) as info:
        parse_prefix("a" * 5000)
    assert "(5000 characters)" in str(info.value) and len(str(info.value)) < 200


def test_resolve_prefix_finds_the_one_match() -> None:
    a, b = Digest("ab" * 32), Digest("cd" * 32)
    assert resolve_prefix("abababab", [a, b], "here") == a


def test_resolve_ambiguous_prefix_lists_the_candidates() -> None:
    a, b = Digest("ab" * 32), Digest("abababab" + "0" * 56)
    with pytest.raises(AmbiguousError) as info:
        resolve_prefix("abababab", [a, b], "here")
    assert a.short(16) in str(info.value) and b.short(16) in str(info.value)


def test_resolve_unknown_prefix_is_not_found() -> None:
    with pytest.raises(NotFoundError, match="12345678"):
        resolve_prefix("12345678", [Digest("ab" * 32)], "here")
