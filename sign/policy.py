"""The trust policy: which publishers this host accepts, and which keys it never accepts.

It lives in `trust.toml` beside the config file (setting `trust.file`). flare rewrites that
file whole and atomically on every `flare trust` change, so it never has to edit the user's
hand-written config.toml; a lab can also hand out one trust.toml to every host. Each change
re-reads the file under an exclusive lock (`trust.toml.lock`, see `locked`), and a hand-edited
file is checked whole when read (a malformed entry is exit 4, never half applied).

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

import base64
import binascii
import fcntl
import json
import os
import re
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from flare.atomic import write_file_atomic
from flare.errors import InvalidInputError, NotFoundError, from_os_error
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
    """The policy in `path`, its whole structure checked: a hand-edited file with a wrong type
    or a malformed entry is refused (exit 4) rather than half applied, since a revocation or
    a publisher that silently matches nothing would leave a key trusted that should not be."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        return TrustPolicy(file=path)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"{path} is not valid TOML: {exc}", "fix the file") from exc
    unknown = set(data) - {"publishers", "revoked"}
    if unknown:
        raise InvalidInputError(f"{path}: unknown keys {sorted(unknown)}", "see docs/config.md")
    tables = data.get("publishers", {})
    if not isinstance(tables, dict):
        raise _invalid(path, "publishers", "must be a table of [publishers.NAME] tables")
    publishers = tuple(_publisher(path, name, entry) for name, entry in tables.items())
    return TrustPolicy(publishers, _revoked(path, data.get("revoked", [])), path)


def _invalid(path: Path, key: str, problem: str) -> InvalidInputError:
    """The one-line error for a malformed entry of a trust file: which file, which key."""
    return InvalidInputError(
        f"invalid trust file {path}: {key} {problem}",
        "fix that entry by hand, or move the file aside and redo it with flare trust add/revoke",
    )


def _revoked(path: Path, value: object) -> frozenset[str]:
    """The `revoked` list: only well-formed fingerprints, so every entry can match a key."""
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise _invalid(path, "revoked", 'must be a list of fingerprints: ["SHA256:...", ...]')
    try:
        return frozenset(check_fingerprint(item) for item in value)
    except InvalidInputError as exc:
        raise _invalid(path, "revoked", f"holds {exc.what}") from exc


FINGERPRINT = re.compile(r"SHA256:([A-Za-z0-9+/]{43})")
"""What sign/keys.py fingerprint() prints: 32 bytes of SHA-256 as unpadded base64."""


def check_fingerprint(text: str) -> str:
    """A key fingerprint exactly as flare prints it (surrounding whitespace dropped).

    Revocation compares fingerprints as strings, so anything else (padding, a short or
    mistyped value) would be stored, match no key, and revoke nothing without a word."""
    text = text.strip()
    match = FINGERPRINT.fullmatch(text)
    if match is None or not _canonical_base64(match[1]):
        raise InvalidInputError(
            f"malformed key fingerprint {text!r}",
            "use SHA256: and the 43 base64 characters flare prints (flare trust ls, "
            "flare key ls, or the error that named the key)",
        )
    return text


def _canonical_base64(text: str) -> bool:
    """True if `text` is the one base64 spelling of 32 bytes (its last 2 spare bits zero)."""
    try:
        raw = base64.b64decode(text + "=", validate=True)
    except binascii.Error:
        return False
    return len(raw) == 32 and base64.b64encode(raw).decode().rstrip("=") == text


_FIELDS = tuple(f.name for f in fields(TrustedPublisher) if f.name != "name")


def _publisher(path: Path, name: str, entry: object) -> TrustedPublisher:
    from flare.sign.keys import fingerprint, load_public_key

    where = f"{path}: publishers.{name}"
    _check_entry(path, name, entry)
    assert isinstance(entry, dict)
    publisher = TrustedPublisher(name=name, **entry)
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


def _check_entry(path: Path, name: str, entry: object) -> None:
    """A [publishers.NAME] table: a name `flare trust add` accepts, known keys, strings."""
    key = f"publishers.{json.dumps(name)}"
    try:
        check_name(name, "publisher name")
    except InvalidInputError as exc:
        raise _invalid(path, key, f"is not a valid publisher name ({exc.hint})") from exc
    if not isinstance(entry, dict):
        raise _invalid(path, key, "must be a table")
    unknown = sorted(set(entry) - set(_FIELDS))
    if unknown:
        raise _invalid(path, key, f"has unknown keys {unknown} (known: {', '.join(_FIELDS)})")
    for field, value in entry.items():
        if not isinstance(value, str):
            raise _invalid(path, f"{key}.{field}", f"must be a string, not {value!r}")
    if entry.get("fingerprint"):
        try:
            check_fingerprint(entry["fingerprint"])
        except InvalidInputError as exc:
            raise _invalid(path, f"{key}.fingerprint", f"is a {exc.what}") from exc


def _read_key_file(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise NotFoundError(f"cannot read public key {path}: {exc.strerror}", "fix it") from exc


def publisher_for(policy: TrustPolicy, key: PublicKey, configured: str) -> str:
    """The name a key signs as: the one configured, else the name this host trusts it under."""
    from flare.sign.keys import fingerprint

    if fingerprint(key) in policy.revoked:
        raise UntrustedError(
            f"signing key {fingerprint(key)} is revoked on this host (flare trust revoke); every "
            "host that revoked it refuses what it signs",
            "make a new key (flare key generate --publisher NAME --no-default --out FILE) and "
            "sign with it (flare sign --key FILE, or point signing.key at it)",
        )
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
    return replace(policy, revoked=policy.revoked | {check_fingerprint(key_fingerprint)})


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold the exclusive lock on `trust.toml.lock` beside the trust file `path`.

    Every change reads, changes and rewrites the whole file; two at once would each write
    their own copy and one change (a revocation, say) would be lost. The lock file is never
    removed: removing it would let a waiter lock a file a newcomer no longer sees."""
    lock = path.with_name(f"{path.name}.lock")
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise from_os_error(exc, "open the trust lock", lock) from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            raise from_os_error(exc, "lock", lock) from exc
        yield
    finally:
        os.close(fd)


def update_policy(path: Path, change: Callable[[TrustPolicy], TrustPolicy]) -> TrustPolicy:
    """Apply `change` to the trust file under its lock, re-reading it there so that no
    concurrent change is lost; returns the policy written."""
    with locked(path):
        policy = change(read_policy(path))
        save_policy(policy, path)
        return policy


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
