"""`flare sign` and `flare verify`: a package's signatures in a registry, made with this host's
key (or keyless through Sigstore) and checked against its trust policy.

Top-level commands, not a group: cli.py registers them on the root app."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from flare.cli_common import (
    MAX_WORKERS,
    AcceptOption,
    JsonOption,
    RegistryOption,
    out,
    print_done,
    print_json,
)
from flare.config import load_config
from flare.errors import InvalidInputError, NotFoundError
from flare.registry.commands import open_registry, signature_verdict
from flare.registry.registry import Registry
from flare.sign import policy as trust
from flare.sign.errors import UntrustedError
from flare.store.commands import exit_for, print_verify
from flare.store.digest import Digest

if TYPE_CHECKING:
    from flare.store.package import Manifest


def sign_command(
    ref: str,
    key_file: Annotated[
        Path | None, typer.Option("--key", help="Private key (default: signing.key).")
    ] = None,
    publisher: Annotated[
        str | None, typer.Option(help="Publisher name (default: signing.publisher).")
    ] = None,
    keyless: Annotated[
        bool, typer.Option("--keyless", help="Sign through Sigstore with an OIDC identity.")
    ] = False,
    identity_token: Annotated[
        str | None, typer.Option(help="OIDC token for --keyless (else SIGSTORE_ID_TOKEN).")
    ] = None,
    registry: RegistryOption = None,
    as_json: JsonOption = False,
) -> None:
    """Sign a package and store the signature beside it in the registry."""
    from flare.sign import keys

    config = load_config()
    target = open_registry(registry)
    name, digest, manifest = target.manifest(ref)
    if keyless:
        bundle = _keyless_bundle(target, digest, manifest, publisher, identity_token)
    else:
        path = key_file or config["signing.key"]
        if path is None:
            raise NotFoundError(
                "no signing key", "pass --key FILE, or run flare key generate --publisher NAME"
            )
        key = keys.load_private_key(path)
        name_as = trust.publisher_for(
            trust.load_policy(config), key, publisher or config["signing.publisher"]
        )
        from flare.sign.envelope import sign_package

        bundle = sign_package(key, name_as, digest, manifest)
    signed_as = target.add_signature(digest, bundle)
    data = {"name": name, "digest": str(digest), "publisher": signed_as}
    print_done(as_json, data, f"signed {name or ''}@{digest} as {signed_as}")


def _keyless_bundle(
    registry: Registry,
    digest: Digest,
    manifest: Manifest,
    publisher: str | None,
    token: str | None,
) -> bytes:
    from flare.sign.keyless import identity_token, sign_keyless  # sigstore: 0.5 s to import

    if not publisher:
        raise InvalidInputError("--keyless needs --publisher NAME", "name who signs")
    index = registry.store.read_bytes(digest)
    return sign_keyless(index, digest, manifest, publisher, identity_token(token))


def verify_command(
    ref: str,
    accept: AcceptOption = None,
    workers: Annotated[
        int | None, typer.Option(min=1, max=MAX_WORKERS, help="Blobs hashed at once.")
    ] = None,
    registry: RegistryOption = None,
    as_json: JsonOption = False,
) -> None:
    """Check a package's signature against the trust policy and re-hash its blobs.

    Exit 11 if unsigned or untrusted, 6 if a blob is corrupt, 3 if one is missing.
    """
    target = open_registry(registry)
    name, digest, manifest = target.manifest(ref)
    policy = trust.load_policy(load_config())
    report = target.verify(f"{name}@{digest.hex}" if name else digest.hex, workers)
    verdict = signature_verdict(target, digest, manifest, policy, accept)
    if as_json:
        refused = isinstance(verdict, UntrustedError)
        signature = {"refused": str(verdict)} if refused else asdict(verdict)
        print_json({"name": name, "digest": str(digest), "signature": signature, "ok": report.ok})
    else:
        print_verify(report, "flare registry verify --restore")
        if not isinstance(verdict, UntrustedError):
            out.print(f"signed by {verdict.publisher} ({verdict.signer})", markup=False)
    exit_for(report)
    if isinstance(verdict, UntrustedError):
        raise verdict
