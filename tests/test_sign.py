"""Publisher signing and trust, with real keys, real files and the real `flare` command.

Every way a package can fail the trust check is refused with one line naming the publisher,
the key and what to do: unsigned, unknown key, revoked key, a changed index, a signature made
for another package, a swapped or altered bundle, a malformed envelope, an unknown key type.
"""

from __future__ import annotations

import base64
import json
import os
import stat
from dataclasses import asdict
from pathlib import Path

import pytest
from conftest import RunFlare
from cryptography.hazmat.primitives.asymmetric import ed448, rsa
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from registry_helpers import Quiet, tiny_sources
from sqlalchemy import text

from flare.build.pipeline import Build, BuildRequest
from flare.registry.copy import copy_package
from flare.registry.gc import collect
from flare.registry.registry import Registry
from flare.sign import keys
from flare.sign import policy as trust
from flare.sign.envelope import key_bundle, sign_package
from flare.sign.errors import UntrustedError
from flare.sign.statement import statement
from flare.sign.verify import check_trusted
from flare.store import Digest
from flare.store.hashing import hash_bytes
from flare.store.package import Manifest

UNTRUSTED, INVALID, CORRUPT = 11, 4, 6


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_sources(tmp_path_factory.mktemp("sources"), 2)


@pytest.fixture
def registry(tmp_path: Path) -> Registry:
    return Registry(str(tmp_path / "registry"), f"sqlite:///{tmp_path / 'index.db'}")


def build(
    registry: Registry,
    source: Path,
    name: str,
    key: keys.PrivateKey | None = None,
    publisher: str = "alice",
) -> tuple[Digest, Manifest]:
    """Build a package, signed through the build's sign hook when a key is given."""

    def sign(target: Registry, digest: Digest, manifest: Manifest) -> None:
        target.add_signature(digest, sign_package(key, publisher, digest, manifest))  # type: ignore[arg-type]

    staging = Path(registry.location).parent / "staging"
    request = BuildRequest(source=str(source), name=name, staging=staging, hub_cache=staging)
    result = Build(request, registry, Quiet(), sign=sign if key else None).run()
    return result.digest, result.manifest


def trusting(*named: tuple[str, keys.PrivateKey]) -> trust.TrustPolicy:
    policy = trust.TrustPolicy()
    for name, key in named:
        policy = trust.add_key(policy, name, keys.public_pem(key))
    return policy


def refused(match: str, *args: object, **kwargs: object) -> str:
    with pytest.raises(UntrustedError, match=match) as info:
        check_trusted(*args, **kwargs)  # type: ignore[arg-type]
    assert info.value.exit_code == UNTRUSTED
    return str(info.value)


# -- keys -------------------------------------------------------------------------------------


@pytest.mark.parametrize("key_type", list(keys.KeyType))
def test_keys_are_written_0600_never_overwritten_and_keep_their_fingerprint(
    tmp_path: Path, key_type: keys.KeyType
) -> None:
    key = keys.generate_key(key_type)
    path = tmp_path / "keys" / "k.pem"
    keys.write_private_key(key, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    before = path.read_bytes()
    with pytest.raises(Exception, match="already exists"):
        keys.write_private_key(keys.generate_key(key_type), path)
    assert path.read_bytes() == before
    loaded = keys.load_private_key(path)
    assert keys.key_type_of(loaded) is key_type
    assert keys.fingerprint(loaded) == keys.fingerprint(key).strip()
    public = keys.load_public_key(keys.public_pem(key), "pub")
    assert keys.fingerprint(public) == keys.fingerprint(key)
    assert keys.fingerprint(key).startswith("SHA256:") and len(keys.fingerprint(key)) == 50


def test_keys_of_other_types_or_not_pem_are_refused(tmp_path: Path) -> None:
    rsa_pem = (
        rsa.generate_private_key(65537, 2048)
        .public_key()
        .public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
    )
    with pytest.raises(keys.UnknownKeyTypeError, match="unknown key type"):
        keys.load_public_key(rsa_pem, "rsa.pub")
    (tmp_path / "junk.pem").write_text("not a key")
    with pytest.raises(Exception, match="not a PEM private key"):
        keys.load_private_key(tmp_path / "junk.pem")
    with pytest.raises(Exception, match="no signing key"):
        keys.load_private_key(tmp_path / "absent.pem")


# -- the trust check --------------------------------------------------------------------------


def test_a_trusted_signature_is_accepted(registry: Registry, sources: Path) -> None:
    alice = keys.generate_key(keys.KeyType.ECDSA_P256)
    digest, manifest = build(registry, sources / "tiny-0", "alpha", alice)
    verdict = check_trusted(registry.signatures(digest), digest, manifest, trusting(("a", alice)))
    assert verdict.publisher == "a" and verdict.signer == keys.fingerprint(alice)
    assert not verdict.accepted_dangerously
    assert [r.publisher for r in registry.listings()] == ["alice"]


def test_a_folder_among_the_signatures_blocks_nothing(registry: Registry, sources: Path) -> None:
    """A folder named as a signature file (anyone who writes to a shared registry can make
    one) is passed over like a garbage file; it once made every verify fail (exit 1)."""
    from flare.registry.signatures import SIGNATURES_DIR, SUFFIX

    alice = keys.generate_key(keys.KeyType.ECDSA_P256)
    digest, manifest = build(registry, sources / "tiny-0", "alpha", alice)
    folder = registry.store.backend.local_path(f"{SIGNATURES_DIR}/{digest.hex}/bbbb{SUFFIX}")
    assert folder is not None
    folder.mkdir()
    verdict = check_trusted(registry.signatures(digest), digest, manifest, trusting(("a", alice)))
    assert verdict.publisher == "a"


def test_unsigned_and_unknown_keys_are_refused_naming_the_key(
    registry: Registry, sources: Path
) -> None:
    alice, bob = keys.generate_key(), keys.generate_key()
    digest, manifest = build(registry, sources / "tiny-0", "alpha")
    refused("unsigned.*flare sign alpha@", [], digest, manifest, trusting(("alice", alice)))
    registry.add_signature(digest, sign_package(bob, "bob", digest, manifest))
    message = refused(
        "signed by bob with key .* does not trust",
        registry.signatures(digest),
        digest,
        manifest,
        trusting(("alice", alice)),
    )
    assert keys.fingerprint(bob) in message and "flare trust add bob" in message


def test_dangerously_accept_accepts_only_that_publisher_and_never_a_revoked_key(
    registry: Registry, sources: Path
) -> None:
    bob = keys.generate_key()
    digest, manifest = build(registry, sources / "tiny-0", "alpha", bob, publisher="bob")
    signatures, nobody = registry.signatures(digest), trust.TrustPolicy()
    verdict = check_trusted(signatures, digest, manifest, nobody, accept_publisher="bob")
    assert verdict.accepted_dangerously and verdict.publisher == "bob"
    refused("does not trust", signatures, digest, manifest, nobody, accept_publisher="eve")
    revoked = trust.revoke(nobody, keys.fingerprint(bob))
    refused("revoked key", signatures, digest, manifest, revoked, accept_publisher="bob")
    refused(
        "revoked key",
        signatures,
        digest,
        manifest,
        trust.revoke(trusting(("bob", bob)), keys.fingerprint(bob)),
    )


def test_a_flipped_byte_in_the_index_is_refused(registry: Registry, sources: Path) -> None:
    alice = keys.generate_key()
    digest, manifest = build(registry, sources / "tiny-0", "alpha", alice)
    index = bytearray(registry.store.read_bytes(digest))
    index[-3] ^= 0x01
    tampered = hash_bytes(bytes(index))
    message = refused(
        "index was changed",
        registry.signatures(digest),
        tampered,
        manifest,
        trusting(("alice", alice)),
    )
    assert "alice" in message and keys.fingerprint(alice) in message


def test_a_signature_of_another_package_or_a_swapped_bundle_is_refused(
    registry: Registry, sources: Path
) -> None:
    alice, bob = keys.generate_key(), keys.generate_key()
    a, manifest_a = build(registry, sources / "tiny-0", "alpha", alice)
    b, manifest_b = build(registry, sources / "tiny-1", "beta", bob, publisher="bob")
    policy = trusting(("alice", alice), ("bob", bob))
    refused("is for package", registry.signatures(b), a, manifest_a, policy)
    with pytest.raises(UntrustedError, match="is for package"):
        registry.add_signature(a, registry.signatures(b)[0])  # the registry refuses it too
    # A bundle whose signed statement is swapped for another package's: the signature breaks.
    bundle = json.loads(registry.signatures(a)[0])
    other = json.loads(registry.signatures(b)[0])
    bundle["dsseEnvelope"]["payload"] = other["dsseEnvelope"]["payload"]
    refused("does not verify", [json.dumps(bundle).encode()], b, manifest_b, policy)


def test_an_altered_statement_does_not_verify(registry: Registry, sources: Path) -> None:
    alice = keys.generate_key()
    digest, manifest = build(registry, sources / "tiny-0", "alpha", alice)
    bundle = json.loads(registry.signatures(digest)[0])
    payload = base64.b64decode(bundle["dsseEnvelope"]["payload"]).replace(b"alice", b"alicf")
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(payload).decode()
    refused(
        "does not verify",
        [json.dumps(bundle).encode()],
        digest,
        manifest,
        trusting(("alice", alice)),
    )


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b"{not json",
        lambda b: json.dumps({**json.loads(b), "dsseEnvelope": None}).encode(),
        lambda b: b.replace(b"application/vnd.in-toto+json", b"text/plain"),
        lambda b: b.replace(b'"payload":"', b'"payload":"A'),
        lambda b: json.dumps({**json.loads(b), "mediaType": "x"}).encode(),
    ],
    ids=["not-json", "no-envelope", "payload-type", "bad-base64", "media-type"],
)
def test_a_malformed_envelope_is_refused(registry: Registry, sources: Path, damage) -> None:  # type: ignore[no-untyped-def]
    alice = keys.generate_key()
    digest, manifest = build(registry, sources / "tiny-0", "alpha", alice)
    bundle = damage(registry.signatures(digest)[0])
    refused("malformed signature", [bundle], digest, manifest, trusting(("alice", alice)))


def test_an_unknown_key_type_is_refused(registry: Registry, sources: Path) -> None:
    digest, manifest = build(registry, sources / "tiny-0", "alpha")
    odd = ed448.Ed448PrivateKey.generate()
    bundle = key_bundle(statement(digest, manifest, "odd", keys.public_pem(odd)), odd)
    registry.add_signature(digest, bundle)
    refused(
        "unknown key type",
        registry.signatures(digest),
        digest,
        manifest,
        trust.TrustPolicy(),
        accept_publisher="odd",
    )
    trusted_odd = trust.TrustPolicy(
        (trust.TrustedPublisher("odd", keys.fingerprint(odd), keys.public_pem(odd)),)
    )
    refused("unknown key type", registry.signatures(digest), digest, manifest, trusted_odd)


# -- the registry -----------------------------------------------------------------------------


def test_reindex_keeps_publishers(registry: Registry, sources: Path) -> None:
    alice = keys.generate_key()
    build(registry, sources / "tiny-0", "alpha", alice)
    build(registry, sources / "tiny-1", "beta")
    registry.tag("alpha", "alpha:v1")
    before = [asdict(r) for r in registry.listings()]
    assert {r["name"]: r["publisher"] for r in before} == {"alpha": "alice", "beta": None}
    with registry.db.engine.begin() as connection:
        for table in ("tags", "publications", "package_blobs", "packages"):
            connection.execute(text(f"DELETE FROM {table}"))
    registry.reindex()
    assert [asdict(r) for r in registry.listings()] == before


def test_copy_carries_signatures(registry: Registry, sources: Path, tmp_path: Path) -> None:
    alice = keys.generate_key()
    digest, manifest = build(registry, sources / "tiny-0", "alpha", alice)
    other = Registry(str(tmp_path / "other"), f"sqlite:///{tmp_path / 'other.db'}")
    copy_package(registry, other, "alpha")
    assert other.signatures(digest) == registry.signatures(digest)
    assert [r.publisher for r in other.listings()] == ["alice"]
    check_trusted(other.signatures(digest), digest, manifest, trusting(("alice", alice)))


def test_gc_keeps_signatures_of_live_packages_and_drops_the_swept(
    registry: Registry, sources: Path
) -> None:
    alice = keys.generate_key()
    kept, _ = build(registry, sources / "tiny-0", "alpha", alice)
    swept, _ = build(registry, sources / "tiny-1", "beta", alice)
    registry.remove("beta")
    report = collect(registry, grace_s=0)
    assert str(swept) in report.deleted and len(report.signatures) == 1
    assert registry.signatures(swept) == [] and len(registry.signatures(kept)) == 1


# -- the command ------------------------------------------------------------------------------


def one_line_error(result: object) -> str:
    stderr = result.stderr  # type: ignore[attr-defined]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def test_key_generate_signs_builds_and_trusts_them(
    run_flare: RunFlare, sources: Path, flare_env: dict[str, str]
) -> None:
    config = Path(flare_env["XDG_CONFIG_HOME"]) / "flare" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text("# mine\n[store]\nzstd_level = 5\n")
    rsa = run_flare("key", "generate", "--publisher", "alice", "--type", "rsa")
    assert rsa.returncode == 4 and "unknown key type 'rsa'" in one_line_error(rsa)
    assert config.read_text() == "# mine\n[store]\nzstd_level = 5\n"
    made = run_flare("key", "generate", "--publisher", "alice", "--json", "--type", "ed25519")
    assert made.returncode == 0, made.stderr
    key = json.loads(made.stdout)
    assert stat.S_IMODE(os.stat(key["private_key"]).st_mode) == 0o600
    assert config.read_text().startswith("# mine\n[store]\nzstd_level = 5\n")
    again = run_flare("key", "generate", "--publisher", "alice")
    assert again.returncode != 0 and "already" in one_line_error(again)
    listed = json.loads(run_flare("key", "ls", "--json").stdout)
    assert listed == [
        {
            **{k: key[k] for k in ("fingerprint", "type")},
            "path": key["private_key"],
            "default": True,
        }
    ]

    built = run_flare("build", str(sources / "tiny-0"), "--name", "alpha")
    assert built.returncode == 0, built.stderr
    verified = run_flare("verify", "alpha")
    assert verified.returncode == 0, verified.stderr
    assert f"signed by alice ({key['fingerprint']})" in verified.stdout
    assert json.loads(run_flare("registry", "ls", "--json").stdout)[0]["publisher"] == "alice"
    assert run_flare("registry", "verify", "--signatures").returncode == 0

    revoked = run_flare("trust", "revoke", key["fingerprint"])
    assert revoked.returncode == 0
    refused = run_flare("verify", "alpha")
    assert refused.returncode == UNTRUSTED
    assert "revoked key" in one_line_error(refused) and key["fingerprint"] in refused.stderr
    assert run_flare("registry", "verify", "--signatures").returncode == UNTRUSTED


def test_unsigned_and_untrusted_packages_exit_11(
    run_flare: RunFlare, sources: Path, tmp_path: Path
) -> None:
    assert run_flare("build", str(sources / "tiny-0"), "--name", "alpha").returncode == 0
    unsigned = run_flare("verify", "alpha")
    assert unsigned.returncode == UNTRUSTED and "unsigned" in one_line_error(unsigned)
    assert run_flare("registry", "verify").returncode == 0  # blobs only, as before

    bob = tmp_path / "bob.pem"
    made = run_flare("key", "generate", "--publisher", "bob", "--out", str(bob), "--no-default")
    assert made.returncode == 0, made.stderr
    assert run_flare("sign", "alpha", "--key", str(bob), "--publisher", "bob").returncode == 0
    untrusted = run_flare("verify", "alpha")
    assert untrusted.returncode == UNTRUSTED
    assert "flare trust add bob" in one_line_error(untrusted)
    accepted = run_flare("verify", "alpha", "--dangerously-accept-publisher", "bob")
    assert accepted.returncode == 0 and "warning: accepted publisher bob" in accepted.stderr
    assert (
        run_flare("verify", "alpha", "--dangerously-accept-publisher", "eve").returncode
        == UNTRUSTED
    )

    public = tmp_path / "bob.pub"
    public.write_text(keys.public_pem(keys.load_private_key(bob)))
    assert run_flare("trust", "add", "bob", "--key", str(public)).returncode == 0
    assert run_flare("verify", "alpha").returncode == 0
    listed = json.loads(run_flare("trust", "ls", "--json").stdout)
    assert [p["name"] for p in listed["publishers"]] == ["bob"]
    assert run_flare("trust", "rm", "bob").returncode == 0
    assert run_flare("verify", "alpha").returncode == UNTRUSTED


def test_trust_add_refuses_bad_keys_in_one_line(run_flare: RunFlare, tmp_path: Path) -> None:
    rsa_pub = tmp_path / "rsa.pub"
    rsa_pub.write_bytes(
        rsa.generate_private_key(65537, 2048)
        .public_key()
        .public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
    )
    odd = run_flare("trust", "add", "rsa", "--key", str(rsa_pub))
    assert odd.returncode == INVALID and "unknown key type" in one_line_error(odd)
    (tmp_path / "junk.pub").write_text("junk")
    junk = run_flare("trust", "add", "junk", "--key", str(tmp_path / "junk.pub"))
    assert junk.returncode == INVALID and "not a PEM public key" in one_line_error(junk)
    neither = run_flare("trust", "add", "x")
    assert neither.returncode == INVALID
    keyless = run_flare(
        "trust", "add", "ci", "--identity", "me@lab.org", "--issuer", "https://issuer.example"
    )
    assert keyless.returncode == 0
    listed = json.loads(run_flare("trust", "ls", "--json").stdout)["publishers"]
    assert listed[0]["identity"] == "me@lab.org" and listed[0]["issuer"] == "https://issuer.example"


def test_demo_signs_with_a_development_key_and_leaves_the_users_key(
    run_flare: RunFlare, flare_env: dict[str, str], tmp_path: Path
) -> None:
    made = run_flare("key", "generate", "--publisher", "alice", "--json")
    mine = json.loads(made.stdout)
    before = Path(mine["private_key"]).read_bytes()
    demo = run_flare("demo")
    assert demo.returncode == 0, demo.stderr
    assert (Path(flare_env["FLARE_HOME"]) / "demo" / "signing-key.pem").exists()
    assert Path(mine["private_key"]).read_bytes() == before
    verified = run_flare("verify", "tiny-llama")
    assert verified.returncode == 0 and "signed by flare-demo" in verified.stdout
