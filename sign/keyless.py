"""Keyless Sigstore signing: an OIDC identity instead of a key, vouched for by Fulcio (a
short-lived certificate) and Rekor (a transparency log entry).

Signing needs the network and an identity token; verifying needs Sigstore's trusted root,
which `sigstore` keeps in its TUF cache (refreshed online, used as cached offline). Sigstore
accepts only SHA-2 subject digests, so a keyless statement's subject is the SHA-256 of the
index bytes and its predicate names the package's BLAKE3 digest; the verifier checks both.
"""

from __future__ import annotations

import hashlib
import os

from sigstore.dsse import Statement
from sigstore.errors import Error as SigstoreError
from sigstore.models import Bundle, ClientTrustConfig
from sigstore.oidc import IdentityToken, detect_credential
from sigstore.sign import SigningContext
from sigstore.verify import Verifier
from sigstore.verify.policy import Identity

from flare.errors import FlareError, InvalidInputError
from flare.sign.errors import UntrustedError
from flare.sign.statement import statement
from flare.store.digest import Digest
from flare.store.package import Manifest


def identity_token(explicit: str | None) -> IdentityToken:
    """The OIDC token: given, else SIGSTORE_ID_TOKEN, else the CI's ambient credential."""
    raw = explicit or os.environ.get("SIGSTORE_ID_TOKEN") or _ambient()
    if not raw:
        raise InvalidInputError(
            "keyless signing needs an OIDC identity token",
            "pass --identity-token, set SIGSTORE_ID_TOKEN, or run where CI provides one",
        )
    try:
        return IdentityToken(raw)
    except SigstoreError as exc:
        raise InvalidInputError(f"bad identity token: {exc}", "get a fresh token") from exc


def _ambient() -> str | None:
    try:
        return detect_credential()
    except SigstoreError:
        return None


def sign_keyless(
    index: bytes, digest: Digest, manifest: Manifest, publisher: str, token: IdentityToken
) -> bytes:
    """Sign through Sigstore's public instance; the bundle's JSON bytes."""
    body = statement(
        digest, manifest, publisher, None, {"sha256": hashlib.sha256(index).hexdigest()}
    )
    try:
        context = SigningContext.from_trust_config(ClientTrustConfig.production())
        with context.signer(token) as signer:
            return signer.sign_dsse(Statement(body)).to_json().encode()
    except SigstoreError as exc:
        raise FlareError(f"keyless signing failed: {exc}", "check the network and token") from exc


def verify_keyless(data: bytes, identity: str, issuer: str | None) -> bytes:
    """Check a keyless bundle's certificate chain, log entry and signature; its payload.

    With no issuer (an operator accepting an untrusted publisher for one run), the identity is
    checked under any issuer.
    """
    policy = Identity(identity=identity, issuer=issuer)
    try:
        bundle = Bundle.from_json(data)
        _, payload = Verifier.production(offline=True).verify_dsse(bundle, policy)
    except (SigstoreError, ValueError) as exc:
        raise UntrustedError(
            f"keyless signature by {identity} does not verify: {exc}",
            "ask the publisher to re-sign",
        ) from exc
    return payload
