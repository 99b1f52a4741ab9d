"""The signature file: a DSSE envelope around the statement, kept as a Sigstore bundle.

A key signature is a v0.3 bundle whose verification material is only a public key hint (the
key's fingerprint) and no transparency log entry; a keyless one is what Sigstore returns
(a Fulcio certificate and a Rekor entry). Both are parsed with `sigstore-models`, so flare
reads and writes the same JSON every Sigstore client does.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

from cryptography import x509
from pydantic import ValidationError
from sigstore_models.bundle.v1 import Bundle

from flare.errors import InvalidInputError
from flare.sign.errors import UntrustedError
from flare.sign.keys import PrivateKey, fingerprint, public_pem, sign_bytes
from flare.sign.statement import PAYLOAD_TYPE, Claim, read_claim, statement
from flare.store.digest import Digest
from flare.store.package import Manifest

BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what is actually signed, so that the payload type
    cannot be swapped without breaking the signature."""
    kind = payload_type.encode()
    return b"DSSEv1 %d %b %d %b" % (len(kind), kind, len(payload), payload)


def sign_package(key: PrivateKey, publisher: str, digest: Digest, manifest: Manifest) -> bytes:
    """A package's signature by a key: the bundle's JSON bytes.

    The statement carries the public key too, so that an operator can accept an untrusted
    publisher for one run and still have the signature checked (see verify.check_trusted).
    """
    return key_bundle(statement(digest, manifest, publisher, public_pem(key)), key)


def key_bundle(body: bytes, key: PrivateKey) -> bytes:
    """Sign statement bytes with a key: the bundle's JSON bytes."""
    keyid = fingerprint(key)
    signature = sign_bytes(key, pae(PAYLOAD_TYPE, body))
    bundle = Bundle.from_dict(
        {
            "mediaType": BUNDLE_MEDIA_TYPE,
            "verificationMaterial": {"publicKey": {"hint": keyid}, "tlogEntries": []},
            "dsseEnvelope": {
                "payload": _b64(body),
                "payloadType": PAYLOAD_TYPE,
                "signatures": [{"sig": _b64(signature), "keyid": keyid}],
            },
        }
    )
    return bundle.to_json().encode()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@dataclass(frozen=True)
class Signed:
    """A parsed signature file, not yet verified."""

    bundle: Bundle
    claim: Claim
    payload: bytes
    signature: bytes
    signer: str
    """The key fingerprint, or for a keyless signature the certificate's identity."""
    keyless: bool


def read_bundle(data: bytes, where: str) -> Signed:
    """Parse a signature file; a malformed one is refused as untrusted."""
    try:
        bundle = Bundle.from_json(data)
    except (ValidationError, ValueError) as exc:
        raise _malformed(where, f"not a Sigstore bundle: {_first_error(exc)}") from exc
    envelope = bundle.dsse_envelope
    if envelope is None or envelope.payload_type != PAYLOAD_TYPE or len(envelope.signatures) != 1:
        raise _malformed(where, "expected a DSSE envelope with one in-toto signature")
    material = bundle.verification_material
    keyless = material.certificate is not None
    if keyless:
        signer = certificate_identity(material.certificate.raw_bytes)  # type: ignore[union-attr]
    elif material.public_key is not None and material.public_key.hint:
        signer = material.public_key.hint
    else:
        raise _malformed(where, "no key hint and no certificate")
    if not keyless and envelope.signatures[0].keyid != signer:
        raise _malformed(where, "the envelope's keyid differs from the bundle's key hint")
    try:
        claim = read_claim(envelope.payload, where)
    except InvalidInputError as exc:
        raise _malformed(where, exc.what) from exc
    return Signed(bundle, claim, envelope.payload, envelope.signatures[0].sig, signer, keyless)


def certificate_identity(der: bytes) -> str:
    """The identity (email or URI) a Fulcio certificate was issued to."""
    try:
        names = x509.load_der_x509_certificate(der).extensions.get_extension_for_class(
            x509.SubjectAlternativeName
        )
    except (ValueError, x509.ExtensionNotFound) as exc:
        raise UntrustedError(f"a keyless signature's certificate is unreadable: {exc}") from exc
    found = names.value.get_values_for_type(x509.RFC822Name)
    found += names.value.get_values_for_type(x509.UniformResourceIdentifier)
    if not found:
        raise UntrustedError("a keyless signature's certificate names no identity")
    return found[0]


def _first_error(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        return f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
    return str(exc)


def _malformed(where: str, why: str) -> UntrustedError:
    return UntrustedError(
        f"malformed signature {where}: {why}", "ask the publisher to re-sign the package"
    )
