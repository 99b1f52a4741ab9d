"""`flare key` (this host's signing keys) and `flare trust` (the publishers it accepts).

cryptography is imported inside the commands that read or make keys (sign/keys.py), so that
`flare trust ls` and every other listing command start without it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from flare.cli_common import (
    JsonOption,
    NoTruncOption,
    err,
    out,
    print_done,
    print_json,
    print_table,
)
from flare.config import Config, check_signing_unset, load_config, record_signing_key
from flare.errors import InvalidInputError
from flare.sign import policy as trust

if TYPE_CHECKING:
    from flare.sign.keys import PrivateKey
    from flare.sign.verify import Verdict

key_app = typer.Typer(help="Publisher keys: make one, list them.", no_args_is_help=True)
trust_app = typer.Typer(
    help="The trust policy: publishers this host accepts, keys it refuses.", no_args_is_help=True
)


def warn_accepted(verdict: Verdict) -> None:
    """Say, on stderr, that --dangerously-accept-publisher let an untrusted publisher in."""
    err.print(
        f"warning: accepted publisher {verdict.publisher} ({verdict.signer}), which this host "
        "does not trust, for this run only (--dangerously-accept-publisher)",
        markup=False,
    )


# -- flare key --------------------------------------------------------------------------------


@key_app.command("generate")
def key_generate(
    publisher: Annotated[str, typer.Option(help="The publisher name this key signs as.")],
    key_type: Annotated[
        str, typer.Option("--type", help="Key algorithm: ed25519 or ecdsa-p256.")
    ] = "ed25519",
    out_file: Annotated[
        Path | None,
        typer.Option("--out", help="Where to write the private key (default: keys/NAME.pem)."),
    ] = None,
    no_default: Annotated[
        bool,
        typer.Option("--no-default", help="Do not make it this host's signing key nor trust it."),
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Make a signing key (mode 600); by default sign builds with it and trust it here."""
    from flare.sign import keys

    config = load_config()
    path = (out_file or config.file.parent / "keys" / f"{publisher}.pem").absolute()
    key = keys.generate_key(keys.parse_key_type(key_type))
    pem = keys.public_pem(key)
    if no_default:
        trust.load_policy(config)  # a malformed trust file is reported before a key is made
        keys.write_private_key(key, path)
    else:
        _make_default(config, key, path, publisher)
    data = {
        "publisher": publisher,
        "type": keys.key_type_of(key).value,
        "private_key": str(path),
        "fingerprint": keys.fingerprint(key),
        "public_key": pem,
        "default": not no_default,
    }
    if as_json:
        print_json(data)
        return
    out.print(pem.rstrip(), markup=False)
    out.print(f"fingerprint {data['fingerprint']}\nprivate key {path}", markup=False)
    if not no_default:
        out.print(f"builds on this host are now signed as {publisher}, and {publisher} is trusted")


def _make_default(config: Config, key: PrivateKey, path: Path, publisher: str) -> None:
    """Write the key, make it the config's [signing] key and trust it, all under the trust
    file's lock: a second `key generate` running at once then sees the first's [signing] and
    is refused, instead of leaving [signing] naming one key and trust.toml trusting another."""
    from flare.sign import keys

    trust_file = config["trust.file"]
    with trust.locked(trust_file):
        # both refused before anything is written; the config first: its hint works,
        # `trust rm` would not be enough
        check_signing_unset(config.file)
        policy = trust.add_key(trust.read_policy(trust_file), publisher, keys.public_pem(key))
        keys.write_private_key(key, path)
        record_signing_key(config.file, path, publisher)
        trust.save_policy(policy, trust_file)


@key_app.command("ls")
def key_ls(as_json: JsonOption = False, _no_trunc: NoTruncOption = False) -> None:
    """This host's signing keys: the configured one and those under the config's keys/."""
    config = load_config()
    default = config["signing.key"]
    paths = sorted((config.file.parent / "keys").glob("*.pem"))
    paths += [default] if default is not None and default not in paths else []
    rows = [_key_row(path, path == default) for path in paths]
    if as_json:
        print_json(rows)
        return
    print_table(
        "",
        ("default", "type", "fingerprint", "path"),
        [("yes" if r["default"] else "", r["type"], r["fingerprint"], r["path"]) for r in rows],
    )


def _key_row(path: Path, default: bool) -> dict[str, Any]:
    from flare.sign import keys

    key = keys.load_private_key(path, signing=False)
    problem = keys.open_mode_problem(path, path.stat().st_mode)
    if problem is not None:  # listed, since it is there; no command signs with it
        err.print(f"warning: {problem}; nothing signs with it until chmod 600 {path}", markup=False)
    return {
        "path": str(path),
        "type": keys.key_type_of(key).value,
        "fingerprint": keys.fingerprint(key),
        "default": default,
    }


# -- flare trust ------------------------------------------------------------------------------


@trust_app.command("add")
def trust_add(
    name: Annotated[str, typer.Argument(help="The publisher's name.")],
    key_file: Annotated[
        Path | None, typer.Option("--key", help="The publisher's public key (PEM).")
    ] = None,
    identity: Annotated[
        str | None, typer.Option(help="Keyless: the identity (email or URI) Sigstore certifies.")
    ] = None,
    issuer: Annotated[str | None, typer.Option(help="Keyless: the OIDC issuer URL.")] = None,
    as_json: JsonOption = False,
) -> None:
    """Trust a publisher: by public key, or for keyless Sigstore by identity and issuer."""
    config = load_config()
    if key_file is not None and identity is None:
        pem = _read_text(key_file)
        policy = trust.update_policy(config["trust.file"], lambda p: trust.add_key(p, name, pem))
    elif identity is not None and issuer is not None and key_file is None:
        policy = trust.update_policy(
            config["trust.file"], lambda p: trust.add_identity(p, name, identity, issuer)
        )
    else:
        raise InvalidInputError(
            "flare trust add needs --key PUBFILE, or --identity ID and --issuer URL",
            "see flare trust add --help",
        )
    added = policy.by_name(name)
    assert added is not None
    print_done(as_json, _trust_row(added, policy), f"trusted {name} ({added.signer})")


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except UnicodeDecodeError as exc:
        raise InvalidInputError(f"{path} is not a PEM public key", "pass the .pub file") from exc


@trust_app.command("ls")
def trust_ls(as_json: JsonOption = False, _no_trunc: NoTruncOption = False) -> None:
    """Trusted publishers, and revoked keys."""
    policy = trust.load_policy(load_config())
    rows = [_trust_row(p, policy) for p in policy.publishers]
    if as_json:
        print_json({"publishers": rows, "revoked": sorted(policy.revoked)})
        return
    print_table(
        f"trust policy {policy.file}",
        ("publisher", "signer", "issuer", "revoked"),
        [
            (r["name"], r["signer"], r["issuer"] or "", "REVOKED" if r["revoked"] else "")
            for r in rows
        ],
    )
    for revoked in sorted(policy.revoked):
        out.print(f"revoked: {revoked}", markup=False)


def _trust_row(publisher: trust.TrustedPublisher, policy: trust.TrustPolicy) -> dict[str, Any]:
    return {
        "name": publisher.name,
        "signer": publisher.signer,
        "fingerprint": publisher.fingerprint,
        "identity": publisher.identity,
        "issuer": publisher.issuer,
        "revoked": publisher.fingerprint in policy.revoked,
    }


@trust_app.command("rm")
def trust_rm(name: str, as_json: JsonOption = False) -> None:
    """Stop trusting a publisher (its key is not revoked: see flare trust revoke)."""
    trust.update_policy(load_config()["trust.file"], lambda p: trust.remove(p, name))
    print_done(as_json, {"removed": name}, f"no longer trusting {name}")


@trust_app.command("revoke")
def trust_revoke(
    fingerprint: Annotated[str, typer.Argument(help="The key's fingerprint, SHA256:...")],
    as_json: JsonOption = False,
) -> None:
    """Refuse a key from now on, even with --dangerously-accept-publisher."""
    fingerprint = trust.check_fingerprint(fingerprint)
    trust.update_policy(load_config()["trust.file"], lambda p: trust.revoke(p, fingerprint))
    print_done(as_json, {"revoked": fingerprint}, f"revoked {fingerprint}")
