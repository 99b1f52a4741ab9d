"""What a publisher signs: an in-toto Statement v1 whose subject is the package digest.

The predicate says who published the package and what it was built from, so a verifier can
show more than "some key signed these bytes". The statement is canonical JSON, so signing the
same package twice with the same key signs the same bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from flare.errors import InvalidInputError
from flare.store.digest import Digest
from flare.store.package import Manifest, canonical_json

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://flare.dev/attestation/package/v1"
PAYLOAD_TYPE = "application/vnd.in-toto+json"


@dataclass(frozen=True)
class Claim:
    """What a statement says: the package it names and the publisher that signed it."""

    name: str
    digests: dict[str, str]
    """The subject's digest set: `blake3` for key signatures, `sha256` for keyless ones."""
    publisher: str
    package: str
    """The package digest, `blake3:<hex>` (repeated in the predicate for keyless subjects)."""
    public_key: str | None
    """The signer's public key PEM, as the signer claims it (trusted only through a policy)."""


def statement(
    digest: Digest,
    manifest: Manifest,
    publisher: str,
    public_key: str | None,
    subject_digests: dict[str, str] | None = None,
) -> bytes:
    """The canonical statement bytes for a package (subject digest blake3 unless given)."""
    predicate: dict[str, Any] = {
        "publisher": publisher,
        "package": str(digest),
        "inputs": manifest.inputs,
        "model": {"id": manifest.model.id, "revision": manifest.model.revision},
    }
    if public_key is not None:
        predicate["publicKey"] = public_key
    body = {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": manifest.name, "digest": subject_digests or {"blake3": digest.hex}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": predicate,
    }
    return canonical_json(body).encode()


def read_claim(payload: bytes, where: str) -> Claim:
    """Parse a statement; anything not shaped like flare's is malformed."""
    try:
        body = json.loads(payload)
        subject = body["subject"]
        predicate = body["predicate"]
        if body["_type"] != STATEMENT_TYPE or body["predicateType"] != PREDICATE_TYPE:
            raise ValueError(f"type {body['_type']} / {body['predicateType']}")
        if not isinstance(subject, list) or len(subject) != 1:
            raise ValueError("expected exactly one subject")
        return Claim(
            name=str(subject[0]["name"]),
            digests={str(k): str(v) for k, v in subject[0]["digest"].items()},
            publisher=str(predicate["publisher"]),
            package=str(predicate["package"]),
            public_key=predicate.get("publicKey"),
        )
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise InvalidInputError(f"{where}: not a flare in-toto statement ({exc})") from exc
