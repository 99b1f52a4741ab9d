"""The trust policy: which publishers this host accepts, and which keys it never accepts.

It lives in `trust.toml` beside the config file (setting `trust.file`). flare rewrites that
file whole and atomically on every `flare trust` change, so it never has to edit the user's
hand-written config.toml; a lab can also hand out one trust.toml to every host.

```toml
revoked = ["SHA256:..."]

[publishers.alice]                 # a key: its fingerprint and public key (PEM, or a path)
fingerprint = "SHA256:..."
public_key = "-----BEGIN PUBLIC KEY-----\n..."

[publishers.ci]                    # keyless Sigstore: who the certificate names, and who vouched
identity = "https://github.com/lab/models/.github/workflows/build.yml@refs/heads/main"
issuer = "https://token.actions.githubusercontent.com"
```
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from flare.atomic import write_file_atomic
from flare.errors import InvalidInputError, NotFoundError
from flare.sign.errors import UntrustedError
from flare.store.names import check_name

if TYPE_CHECKING:  # cryptography: loaded by the functions that read keys, not by importers
    from flare.sign.keys import PublicKey


class Settings(Protocol):
    """The part of flare's Config the policy reads (sign/ does not import the config)."""

    def __getitem__(self, key: str) -> Any: ...


@dataclass(frozen=True)
class TrustedPublisher:
    """A publisher this host accepts: by key, or (keyless) by identity and issuer."""

    name: str
    fingerprint: str | None = None
    public_key: str | None = None
    """PEM text (a path in the file is read when the policy is loaded)."""
    identity: str | None = None
    issuer: str | None = None

    def key(self) -> PublicKey:
        from flare.sign.keys import load_public_key

        return load_public_key(self.public_key or "", f"the trusted key of {self.name}")

    @property
    def signer(self) -> str:
        """What a signature names: the fingerprint, or the keyless identity."""
        return self.fingerprint or self.identity or ""


@dataclass(frozen=True)
class TrustPolicy:
    publishers: tuple[TrustedPublisher, ...] = ()
    revoked: frozenset[str] = frozenset()
    file: Path | None = None

    def by_fingerprint(self, key_fingerprint: str) -> TrustedPublisher | None:
        return next((p for p in self.publishers if p.fingerprint == key_fingerprint), None)

    def by_identity(self, identity: str) -> list[TrustedPublisher]:
        return [p for p in self.publishers if p.identity == identity]

    def by_name(self, name: str) -> TrustedPublisher | None:
        return next((p for p in self.publishers if p.name == name), None)


def load_policy(config: Settings) -> TrustPolicy:
    """The policy in the config's trust file (an absent file trusts nobody)."""
    return read_policy(Path(config["trust.file"]))


def read_policy(path: Path) -> TrustPolicy:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        return TrustPolicy(file=path)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"{path} is not valid TOML: {exc}", "fix the file") from exc
    unknown = set(data) - {"publishers", "revoked"}
    if unknown:
        raise InvalidInputError(f"{path}: unknown keys {sorted(unknown)}", "see docs/config.md")
    publishers = tuple(
        _publisher(path, name, entry) for name, entry in data.get("publishers", {}).items()
    )
    return TrustPolicy(publishers, frozenset(data.get("revoked", [])), path)


def _publisher(path: Path, name: str, entry: dict[str, Any]) -> TrustedPublisher:
    from flare.sign.keys import fingerprint, load_public_key

    where = f"{path}: publishers.{name}"
    try:
        publisher = TrustedPublisher(name=name, **entry)
    except TypeError as exc:
        raise InvalidInputError(f"{where}: {exc}", "see docs/config.md") from exc
    if publisher.identity:
        if publisher.fingerprint or publisher.public_key:
            raise InvalidInputError(f"{where} has both a key and an identity", "keep one")
        return publisher
    pem = publisher.public_key or ""
    if pem and not pem.lstrip().startswith("-----BEGIN"):
        pem = _read_key_file(path.parent / Path(pem).expanduser())
    key = load_public_key(pem, where)
    if publisher.fingerprint and publisher.fingerprint != fingerprint(key):
        raise InvalidInputError(
            f"{where}: the fingerprint {publisher.fingerprint} is not its key's "
            f"({fingerprint(key)})",
            "fix the entry, or flare trust rm and add it again",
        )
    return replace(publisher, public_key=pem, fingerprint=fingerprint(key))


def _read_key_file(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise NotFoundError(f"cannot read public key {path}: {exc.strerror}", "fix it") from exc


def publisher_for(policy: TrustPolicy, key: PublicKey, configured: str) -> str:
    """The name a key signs as: the one configured, else the name this host trusts it under."""
    from flare.sign.keys import fingerprint

    if configured:
        return check_name(configured, "publisher name")
    trusted = policy.by_fingerprint(fingerprint(key))
    if trusted is None:
        raise InvalidInputError(
            f"no publisher name for signing key {fingerprint(key)}",
            "pass --publisher NAME or set signing.publisher",
        )
    return trusted.name


def add_key(policy: TrustPolicy, name: str, pem: str) -> TrustPolicy:
    """Trust a publisher's key (again adding the same key is a no-op)."""
    from flare.sign.keys import fingerprint, load_public_key

    key = load_public_key(pem, f"the key for {name}")
    publisher = TrustedPublisher(name, fingerprint(key), pem)
    if publisher.fingerprint in policy.revoked:
        raise UntrustedError(
            f"key {publisher.fingerprint} is revoked on this host (flare trust revoke), so it "
            f"cannot be trusted as {name} again",
            "ask the publisher for a new key",
        )
    return _add(policy, publisher)


def add_identity(policy: TrustPolicy, name: str, identity: str, issuer: str) -> TrustPolicy:
    """Trust keyless Sigstore signatures whose certificate names identity, issued via issuer."""
    return _add(policy, TrustedPublisher(name, identity=identity, issuer=issuer))


def _add(policy: TrustPolicy, publisher: TrustedPublisher) -> TrustPolicy:
    check_name(publisher.name, "publisher name")
    existing = policy.by_name(publisher.name)
    if existing == publisher:
        return policy
    if existing is not None:
        raise InvalidInputError(
            f"publisher {publisher.name} is already trusted as {existing.signer}",
            f"run flare trust rm {publisher.name} first to replace it",
        )
    return replace(policy, publishers=(*policy.publishers, publisher))


def remove(policy: TrustPolicy, name: str) -> TrustPolicy:
    if policy.by_name(name) is None:
        raise NotFoundError(f"no trusted publisher {name}", "see flare trust ls")
    return replace(policy, publishers=tuple(p for p in policy.publishers if p.name != name))


def revoke(policy: TrustPolicy, key_fingerprint: str) -> TrustPolicy:
    """Never accept this key again, trusted or not; its trust entries stay, listed as revoked."""
    if not key_fingerprint.startswith("SHA256:"):
        raise InvalidInputError(
            f"not a key fingerprint: {key_fingerprint!r}", "use SHA256:<base64> as printed"
        )
    return replace(policy, revoked=policy.revoked | {key_fingerprint})


def save_policy(policy: TrustPolicy, path: Path) -> None:
    """Write the whole policy atomically (a reader sees the old file or the new one)."""
    write_file_atomic(path, to_toml(policy).encode())


def to_toml(policy: TrustPolicy) -> str:
    """TOML for the policy; strings as JSON strings, which are valid TOML basic strings."""
    lines = [f"revoked = [{', '.join(json.dumps(f) for f in sorted(policy.revoked))}]"]
    for publisher in policy.publishers:
        lines += ["", f"[publishers.{json.dumps(publisher.name)}]"]
        for field in ("fingerprint", "public_key", "identity", "issuer"):
            value = getattr(publisher, field)
            if value is not None:
                lines.append(f"{field} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"
