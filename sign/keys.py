"""Publisher keys: Ed25519 (the default) or ECDSA P-256, kept as PEM files.

A key is named by its fingerprint, `SHA256:` and the unpadded base64 of the SHA-256 of its
DER SubjectPublicKeyInfo (the form OpenSSH prints), so the same key has the same name whatever
PEM text, comment or file it came from.
"""

from __future__ import annotations

import base64
import hashlib
import os
import stat
from enum import StrEnum
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from flare.atomic import fsync_dir, temp_name
from flare.errors import (
    FlareError,
    InvalidInputError,
    NotFoundError,
    PermissionDeniedError,
    from_os_error,
)
from flare.store.backends.local import publish_no_clobber

PrivateKey = ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey
PublicKey = ed25519.Ed25519PublicKey | ec.EllipticCurvePublicKey


class KeyType(StrEnum):
    ED25519 = "ed25519"
    ECDSA_P256 = "ecdsa-p256"


class UnknownKeyTypeError(InvalidInputError):
    """A well-formed key of a type flare does not sign with (RSA, another curve, ...)."""


def parse_key_type(text: str) -> KeyType:
    """The key type a user named, or an error that lists the ones flare signs with."""
    try:
        return KeyType(text)
    except ValueError:
        choices = ", ".join(KeyType)
        raise InvalidInputError(f"unknown key type {text!r}", f"use one of: {choices}") from None


def generate_key(key_type: KeyType = KeyType.ED25519) -> PrivateKey:
    if key_type is KeyType.ECDSA_P256:
        return ec.generate_private_key(ec.SECP256R1())
    return ed25519.Ed25519PrivateKey.generate()


def key_type_of(key: PrivateKey | PublicKey) -> KeyType:
    """The type of a key flare accepts; anything else is refused by name."""
    if isinstance(key, ed25519.Ed25519PrivateKey | ed25519.Ed25519PublicKey):
        return KeyType.ED25519
    if isinstance(key, ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey):
        if isinstance(key.curve, ec.SECP256R1):
            return KeyType.ECDSA_P256
        raise UnknownKeyTypeError(
            f"unknown key type ECDSA {key.curve.name}", "use an ed25519 or ecdsa-p256 key"
        )
    raise UnknownKeyTypeError(
        f"unknown key type {type(key).__name__.removeprefix('_')}",
        "use an ed25519 or ecdsa-p256 key",
    )


def _public(key: PrivateKey | PublicKey) -> PublicKey:
    """The public half (of any type: a refused key is still named by its fingerprint)."""
    return key.public_key() if hasattr(key, "public_key") else key


def public_pem(key: PrivateKey | PublicKey) -> str:
    return (
        _public(key)
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )


def fingerprint(key: PrivateKey | PublicKey) -> str:
    """`SHA256:<base64>` of the DER SubjectPublicKeyInfo."""
    der = _public(key).public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return "SHA256:" + base64.b64encode(hashlib.sha256(der).digest()).decode().rstrip("=")


def write_private_key(key: PrivateKey, path: Path) -> None:
    """Write the key as unencrypted PKCS#8 PEM, mode 0600, atomically; never overwrite a key."""
    if path.exists():
        raise FlareError(
            f"a key already exists at {path}", "pass --out with a new path, or remove it first"
        )
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    partial = path.with_name(f".{path.name}.{temp_name()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if not publish_no_clobber(partial, path):
            raise FlareError(f"a key already exists at {path}", "pass --out with a new path")
        fsync_dir(path.parent)
    except OSError as exc:
        raise from_os_error(exc, "write the key", path) from exc
    finally:
        partial.unlink(missing_ok=True)


def load_private_key(path: Path, signing: bool = True) -> PrivateKey:
    """A signing key from a PEM file, refused clearly if it is missing, not a private key PEM,
    of a type flare does not sign with, or open to other users (as ssh refuses one): a key
    others could read may already be theirs to sign with, and one they could write, theirs
    to swap. `signing=False` (listing the keys) reads one open to others all the same."""
    try:
        with path.open("rb") as handle:
            mode = os.fstat(handle.fileno()).st_mode  # the mode of the file read, not a later one
            data = handle.read()
    except FileNotFoundError:
        raise NotFoundError(
            f"no signing key at {path}", "run flare key generate --publisher NAME"
        ) from None
    except IsADirectoryError:
        raise InvalidInputError(
            f"{path} is a folder, not a key file", "pass the PEM file flare key generate wrote"
        ) from None
    except OSError as exc:
        raise from_os_error(exc, "read the key", path) from exc
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError as exc:
        raise InvalidInputError(f"{path} is encrypted", "use an unencrypted key") from exc
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise InvalidInputError(
            f"{path} is not a PEM private key", "pass the private key flare key generate wrote"
        ) from exc
    key_type_of(key)  # type: ignore[arg-type]
    if signing:  # after the parse: a file that is no key is refused as such
        _refuse_open_mode(path, mode)
    return key  # type: ignore[return-value]


def _refuse_open_mode(path: Path, mode: int) -> None:
    """Refuse a private key file its group or others may read, write or run (mode & 0o077),
    as ssh does: write_private_key makes it 0600, so any other mode was set since."""
    problem = open_mode_problem(path, mode)
    if problem is not None:
        raise PermissionDeniedError(problem, f"chmod 600 {path}")


def open_mode_problem(path: Path, mode: int) -> str | None:
    """What is wrong with a private key file's mode, if its group or others have any right."""
    if not stat.S_IMODE(mode) & 0o077:
        return None
    return f"the signing key {path} is {_open_to(mode)} (mode {stat.S_IMODE(mode):04o})"


def _open_to(mode: int) -> str:
    """Who may do what to the file besides its owner: `readable by its group and others`."""
    parts = []
    for verb, group_bit, other_bit in (
        ("readable", stat.S_IRGRP, stat.S_IROTH),
        ("writable", stat.S_IWGRP, stat.S_IWOTH),
        ("executable", stat.S_IXGRP, stat.S_IXOTH),
    ):
        who = [w for w, bit in (("its group", group_bit), ("others", other_bit)) if mode & bit]
        if who:
            parts.append(f"{verb} by {' and '.join(who)}")
    return ", ".join(parts)


def load_public_key(pem: str | bytes, where: str) -> PublicKey:
    """A public key from PEM text (a private key's PEM is refused: it must not be shared).

    Exactly one key: cryptography would read the first of several blocks, and a trust entry
    would then show one fingerprint while its stored text carries other keys."""
    data = pem.encode() if isinstance(pem, str) else pem
    blocks = data.count(b"-----BEGIN ")
    if blocks > 1:
        raise InvalidInputError(
            f"{where} holds {blocks} PEM blocks, not one public key",
            "pass a file with just the publisher's one public key",
        )
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise InvalidInputError(
            f"{where} is not a PEM public key", "pass the public key flare key generate printed"
        ) from exc
    key_type_of(key)  # type: ignore[arg-type]
    return key  # type: ignore[return-value]


def sign_bytes(key: PrivateKey, data: bytes) -> bytes:
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(data, ec.ECDSA(hashes.SHA256()))
    return key.sign(data)


def signature_valid(key: PublicKey, signature: bytes, data: bytes) -> bool:
    try:
        if isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        else:
            key.verify(signature, data)
    except InvalidSignature:
        return False
    return True
