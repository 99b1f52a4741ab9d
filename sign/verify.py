"""Is this package signed by a publisher this host trusts? The check pull and serve run.

A signature is accepted only if its key (or keyless identity) is trusted and not revoked, its
DSSE signature verifies over the statement, and the statement's subject is the digest the
caller computed from the index bytes it holds: a changed index, or a signature copied from
another package, names another digest and is refused.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from flare.errors import InvalidInputError
from flare.sign.envelope import Signed, pae, read_bundle
from flare.sign.errors import UntrustedError
from flare.sign.keys import PublicKey, fingerprint, load_public_key, signature_valid
from flare.sign.policy import TrustPolicy
from flare.sign.statement import PAYLOAD_TYPE
from flare.store.digest import Digest
from flare.store.hashing import hash_bytes
from flare.store.package import Manifest, encode_index


@dataclass(frozen=True)
class Verdict:
    """Who vouches for a package, and whether the operator overrode the policy to accept it."""

    publisher: str
    signer: str
    """The key fingerprint (`SHA256:...`) or, for keyless Sigstore, the identity."""
    accepted_dangerously: bool = False


def check_trusted(
    signatures: list[bytes],
    digest: Digest,
    manifest: Manifest,
    policy: TrustPolicy,
    accept_publisher: str | None = None,
) -> Verdict:
    """The first signature the policy accepts, else UntrustedError for the first refused.

    `accept_publisher` also accepts a valid signature over this digest by that publisher's
    untrusted key (never a revoked one); the Verdict says so and the caller must warn.
    """
    package = f"{manifest.name}@{digest.short()}"
    if not signatures:
        raise UntrustedError(
            f"package {package} is unsigned",
            f"ask its publisher to sign it: flare sign {manifest.name}@{digest.hex}",
        )
    refusals = []
    for data in signatures:
        try:
            return _check_one(data, digest, manifest, policy, accept_publisher)
        except UntrustedError as exc:
            refusals.append(exc)
    return _refuse(refusals)


def _refuse(refusals: list[UntrustedError]) -> Verdict:
    first = refusals[0]
    if len(refusals) > 1:
        first.what += f" (and {len(refusals) - 1} more signatures refused)"
    raise first


def _check_one(
    data: bytes,
    digest: Digest,
    manifest: Manifest,
    policy: TrustPolicy,
    accept_publisher: str | None,
) -> Verdict:
    signed = read_bundle(data, f"of {manifest.name}@{digest.short()}")
    if signed.keyless:
        return _check_keyless(data, signed, digest, manifest, policy, accept_publisher)
    package = f"{manifest.name}@{digest.short()}"
    claimed = signed.claim.publisher
    if signed.signer in policy.revoked:
        raise UntrustedError(
            f"{package} is signed by {claimed} with revoked key {signed.signer}",
            "ask the publisher to re-sign it with a new key",
        )
    trusted = policy.by_fingerprint(signed.signer)
    if trusted is not None:
        verdict = Verdict(trusted.name, signed.signer)
        key = _key(trusted.public_key or "", verdict, package)
    elif policy.by_name(claimed) is not None:
        raise _impostor(package, claimed, signed.signer, policy, "--key PUBFILE")
    elif accept_publisher is not None and accept_publisher == claimed:
        verdict = Verdict(claimed, signed.signer, accepted_dangerously=True)
        key = _claimed_key(signed, verdict, package)
    else:
        raise UntrustedError(
            f"{package} is signed by {claimed} with key {signed.signer}, which this host "
            "does not trust",
            f"if you trust it, get the publisher's public key and run flare trust add "
            f"{claimed} --key PUBFILE (check its fingerprint is {signed.signer})",
        )
    if not signature_valid(key, signed.signature, pae(PAYLOAD_TYPE, signed.payload)):
        raise UntrustedError(
            f"the signature of {package} by {verdict.publisher} ({verdict.signer}) does not "
            "verify: the signed statement was altered",
            "ask the publisher to re-sign it",
        )
    _check_subject(signed, digest, verdict, package, {"blake3": digest.hex})
    return verdict


def _impostor(
    package: str, claimed: str, signer: str, policy: TrustPolicy, add_args: str
) -> UntrustedError:
    """A signature claiming a publisher this host trusts under another key or identity.

    Refused even with --dangerously-accept-publisher: that flag lets in a publisher this host
    does not know, never a second key for one it does, which is what an impostor would use."""
    trusted = policy.by_name(claimed)
    assert trusted is not None
    kind = "key" if trusted.fingerprint else "identity"
    old = trusted.fingerprint
    revoke = f" (and flare trust revoke {old} if it leaked)" if old else ""
    return UntrustedError(
        f"{package} is signed by {signer} claiming {claimed}, which this host trusts with "
        f"another {kind} ({trusted.signer})",
        f"it may be an impostor: ask {claimed} out of band; only if they did change to {signer}, "
        f"replace the old {kind}: flare trust rm {claimed}, then flare trust add {claimed} "
        f"{add_args}{revoke}",
    )


def _key(pem: str, verdict: Verdict, package: str) -> PublicKey:
    try:
        return load_public_key(pem, f"the key of {verdict.publisher}")
    except InvalidInputError as exc:
        raise UntrustedError(
            f"{package}: signer {verdict.publisher} ({verdict.signer}): {exc.what}",
            "ask the publisher to re-sign with an ed25519 or ecdsa-p256 key",
        ) from exc


def _claimed_key(signed: Signed, verdict: Verdict, package: str) -> PublicKey:
    """The public key the statement carries, which must be the key its hint names."""
    key = _key(signed.claim.public_key or "", verdict, package)
    if fingerprint(key) != signed.signer:
        raise UntrustedError(
            f"{package}: the key in the signature of {verdict.publisher} is not {verdict.signer}",
            "ask the publisher to re-sign it",
        )
    return key


def _check_subject(
    signed: Signed, digest: Digest, verdict: Verdict, package: str, subject: dict[str, str]
) -> None:
    """The signed statement must name exactly this package."""
    if signed.claim.digests != subject or signed.claim.package != str(digest):
        raise UntrustedError(
            f"the signature by {verdict.publisher} ({verdict.signer}) is for package "
            f"{signed.claim.package[7:19]}, not {package}: the index was changed or the "
            "signature belongs to another package",
            "pull the package again, or ask the publisher to sign this one",
        )


def _check_keyless(
    data: bytes,
    signed: Signed,
    digest: Digest,
    manifest: Manifest,
    policy: TrustPolicy,
    accept_publisher: str | None,
) -> Verdict:
    """A keyless bundle: Sigstore checks certificate, log entry and signature; we check who."""
    from flare.sign.keyless import verify_keyless  # sigstore's client costs 0.5 s to import

    package = f"{manifest.name}@{digest.short()}"
    trusted = policy.by_identity(signed.signer)
    claimed = signed.claim.publisher
    if trusted:
        verdict, issuer = Verdict(trusted[0].name, signed.signer), trusted[0].issuer
    elif policy.by_name(claimed) is not None:
        raise _impostor(package, claimed, signed.signer, policy, "--identity ID --issuer URL")
    elif accept_publisher is not None and accept_publisher == claimed:
        verdict, issuer = Verdict(claimed, signed.signer, accepted_dangerously=True), None
    else:
        raise UntrustedError(
            f"{package} is signed by {claimed} as {signed.signer}, which this host does not trust",
            f"if you trust it: flare trust add {claimed} --identity {signed.signer} "
            "--issuer ISSUER",
        )
    verify_keyless(data, signed.signer, issuer)
    index = encode_index(manifest)
    if hash_bytes(index) != digest:
        raise UntrustedError(f"{package}: the manifest is not the one the index digest names")
    sha256 = hashlib.sha256(index).hexdigest()
    _check_subject(signed, digest, verdict, package, {"sha256": sha256})
    return verdict
