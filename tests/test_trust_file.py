"""The trust file as a tester would attack it: hand-edited wrong types and malformed
fingerprints, revocations that would match nothing, impostors of a trusted publisher, keys
that sign after being revoked, and concurrent `flare trust` / `flare key generate` runs.

Everything runs the real `flare` command on real files; every refusal is one line with the
documented exit code (4 invalid input, 11 untrusted), never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import RunFlare
from registry_helpers import tiny_sources

from flare.sign import keys

INVALID, UNTRUSTED = 4, 11
B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_sources(tmp_path_factory.mktemp("sources"), 2)


def config_dir(env: dict[str, str]) -> Path:
    return Path(env["XDG_CONFIG_HOME"]) / "flare"


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    """The single `error:` line a refusal prints (no traceback, no internal error)."""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert "internal error" not in lines[0], done.stderr
    return lines[0]


def alice(run_flare: RunFlare) -> dict[str, str]:
    """This host's default key, alice, trusted here (what `flare key generate` prints)."""
    made = run_flare("key", "generate", "--publisher", "alice", "--json")
    assert made.returncode == 0, made.stderr
    return json.loads(made.stdout)


def public_file(path: Path) -> keys.PrivateKey:
    """A fresh key whose public half is written to `path` (what a publisher hands out)."""
    key = keys.generate_key()
    path.write_text(keys.public_pem(key))
    return key


def malformed(fingerprint: str) -> list[str]:
    """Fingerprints that look like one but name no key: padded, short, non-canonical."""
    last = B64[B64.index(fingerprint[-1]) + 1]  # the spare low bits of the last char set
    return [fingerprint + "=", fingerprint + "==", "SHA256:AAAA", fingerprint[:-1] + last]


# -- 1, 2, 3: a hand-edited trust.toml --------------------------------------------------------


def hand_edits(fingerprint: str, pem: str) -> dict[str, tuple[str, str]]:
    """Trust file text, and the key its error must name, for each malformed structure."""
    table = f"[publishers.alice]\npublic_key = {json.dumps(pem)}\n"
    edits = {
        "revoked-string": (f'revoked = "{fingerprint}"\n{table}', "revoked"),
        "revoked-nested": (f'revoked = [["{fingerprint}"]]\n{table}', "revoked"),
        "revoked-number": (f"revoked = [5]\n{table}", "revoked"),
        "publishers-int": ("publishers = 5\n", "publishers"),
        "publisher-int": ("[publishers]\nalice = 5\n", 'publishers."alice"'),
        "fields-int": (
            "[publishers.alice]\nfingerprint = 5\npublic_key = 7\n",
            'publishers."alice".fingerprint',
        ),
        "bad-name": (f'[publishers."../x y"]\npublic_key = {json.dumps(pem)}\n', "../x y"),
        "upper-name": (f"[publishers.Alice]\npublic_key = {json.dumps(pem)}\n", "Alice"),
        "unknown-field": (table + 'color = "red"\n', "color"),
        "bad-fingerprint": (
            f'[publishers.alice]\nfingerprint = "SHA256:AAAA"\npublic_key = {json.dumps(pem)}\n',
            'publishers."alice".fingerprint',
        ),
    }
    for n, bad in enumerate(malformed(fingerprint)):
        edits[f"revoked-malformed-{n}"] = (f"revoked = [{json.dumps(bad)}]\n{table}", "revoked")
    return edits


def test_a_malformed_trust_file_is_refused_naming_the_file_and_key(
    run_flare: RunFlare, flare_env: dict[str, str]
) -> None:
    made = alice(run_flare)
    trust_file = config_dir(flare_env) / "trust.toml"
    for case, (text, key) in hand_edits(made["fingerprint"], made["public_key"]).items():
        trust_file.write_text(text)
        for command in (("trust", "ls"), ("trust", "add", "x", "--identity", "a", "--issuer", "b")):
            done = run_flare(*command)
            assert done.returncode == INVALID, (case, done.stderr)
            line = one_line_error(done)
            assert "invalid trust file" in line and str(trust_file) in line, (case, line)
            assert key in line, (case, line)
        assert trust_file.read_text() == text, case  # a refused change writes nothing


def test_a_hand_written_revocation_as_a_string_never_leaves_the_key_trusted(
    run_flare: RunFlare, flare_env: dict[str, str], sources: Path
) -> None:
    """The tester's case: `revoked = "SHA256:..."` read as a set of characters let the
    revoked key verify (exit 0); a list with spaces around the fingerprint still revokes."""
    made = alice(run_flare)
    assert run_flare("build", str(sources / "tiny-0"), "--name", "alpha").returncode == 0
    trust_file = config_dir(flare_env) / "trust.toml"
    entry = f"[publishers.alice]\npublic_key = {json.dumps(made['public_key'])}\n"
    trust_file.write_text(f'revoked = "{made["fingerprint"]}"\n{entry}')
    as_string = run_flare("verify", "alpha")
    assert as_string.returncode == INVALID and "revoked" in one_line_error(as_string)
    trust_file.write_text(f'revoked = [" {made["fingerprint"]}\\n"]\n{entry}')
    spaced = run_flare("verify", "alpha")
    assert spaced.returncode == UNTRUSTED and "revoked key" in one_line_error(spaced)


def test_trust_revoke_refuses_a_fingerprint_that_names_no_key(
    run_flare: RunFlare, flare_env: dict[str, str], sources: Path
) -> None:
    made = alice(run_flare)
    fingerprint = made["fingerprint"]
    trust_file = config_dir(flare_env) / "trust.toml"
    before = trust_file.read_text()
    for bad in malformed(fingerprint):
        done = run_flare("trust", "revoke", bad)
        assert done.returncode == INVALID, (bad, done.stderr)
        assert "malformed key fingerprint" in one_line_error(done)
        assert trust_file.read_text() == before
    spaced = run_flare("trust", "revoke", f"{fingerprint} ", "--json")
    assert spaced.returncode == 0 and json.loads(spaced.stdout) == {"revoked": fingerprint}
    assert json.loads(run_flare("trust", "ls", "--json").stdout)["revoked"] == [fingerprint]


# -- 4: concurrent changes --------------------------------------------------------------------


def flare_process(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "flare", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(process: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    stdout, stderr = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def host_env(flare_env: dict[str, str], root: Path) -> dict[str, str]:
    """A fresh host: its own FLARE_HOME and config folder."""
    return flare_env | {"FLARE_HOME": str(root / "home"), "XDG_CONFIG_HOME": str(root / "xdg")}


@pytest.mark.parametrize("trial", range(6))
def test_concurrent_trust_changes_are_all_kept(
    run_flare: RunFlare, flare_env: dict[str, str], tmp_path: Path, trial: int
) -> None:
    env = host_env(flare_env, tmp_path / f"host-{trial}")
    made = run_flare("key", "generate", "--publisher", "alice", "--json", env=env)
    fingerprint = json.loads(made.stdout)["fingerprint"]
    names = ["carol", "dave", "erin"]
    for name in names:
        public_file(tmp_path / f"{name}.pub")
    running = [flare_process(env, "trust", "revoke", fingerprint)]
    running += [
        flare_process(env, "trust", "add", name, "--key", str(tmp_path / f"{name}.pub"))
        for name in names
    ]
    for done in map(finish, running):
        assert done.returncode == 0, done.stderr
    listed = json.loads(run_flare("trust", "ls", "--json", env=env).stdout)
    assert listed["revoked"] == [fingerprint]
    assert sorted(p["name"] for p in listed["publishers"]) == ["alice", *names]


@pytest.mark.parametrize("trial", range(6))
def test_concurrent_key_generate_leaves_one_signing_key_trusted(
    run_flare: RunFlare, flare_env: dict[str, str], tmp_path: Path, trial: int
) -> None:
    env = host_env(flare_env, tmp_path / f"host-{trial}")
    running = {p: flare_process(env, "key", "generate", "--publisher", p) for p in ("p1", "p2")}
    done = {p: finish(process) for p, process in running.items()}
    won = [p for p, result in done.items() if result.returncode == 0]
    assert len(won) == 1, {p: r.stderr for p, r in done.items()}
    (lost,) = set(done) - set(won)
    assert done[lost].returncode == INVALID and "already" in one_line_error(done[lost])
    config = tomllib.loads((config_dir(env) / "config.toml").read_text())
    assert config["signing"]["publisher"] == won[0]
    trusted = json.loads(run_flare("trust", "ls", "--json", env=env).stdout)["publishers"]
    assert [p["name"] for p in trusted] == won
    assert not (config_dir(env) / "keys" / f"{lost}.pem").exists()


# -- 5: impostors of a trusted publisher ------------------------------------------------------


def test_a_key_claiming_a_trusted_publisher_is_refused_even_when_accepted_by_name(
    run_flare: RunFlare, sources: Path, tmp_path: Path
) -> None:
    made = alice(run_flare)
    impostor = tmp_path / "impostor.pem"
    keys.write_private_key(keys.generate_key(), impostor)
    built = run_flare("build", str(sources / "tiny-0"), "--name", "m2", "--no-sign")
    assert built.returncode == 0, built.stderr
    signed = run_flare("sign", "m2", "--key", str(impostor), "--publisher", "alice")
    assert signed.returncode == 0, signed.stderr
    for extra in ((), ("--dangerously-accept-publisher", "alice")):
        refused = run_flare("verify", "m2", *extra)
        assert refused.returncode == UNTRUSTED, (extra, refused.stderr)
        line = one_line_error(refused)
        what, hint = line.split("; ", 1)
        assert "claiming alice, which this host trusts with another key" in what
        assert made["fingerprint"] in what
        assert keys.fingerprint(keys.load_private_key(impostor)) in what
        assert "flare trust rm alice, then flare trust add alice" in hint
        assert not hint.startswith("if you trust it")


# -- 6: keys with several blocks, signing with a revoked key ----------------------------------


def test_trust_add_refuses_a_file_with_two_keys(
    run_flare: RunFlare, flare_env: dict[str, str], tmp_path: Path
) -> None:
    two = tmp_path / "two.pub"
    two.write_text(keys.public_pem(keys.generate_key()) + keys.public_pem(keys.generate_key()))
    refused = run_flare("trust", "add", "bob", "--key", str(two))
    assert refused.returncode == INVALID and "2 PEM blocks" in one_line_error(refused)
    assert not (config_dir(flare_env) / "trust.toml").exists()


def test_a_revoked_key_does_not_sign(run_flare: RunFlare, sources: Path) -> None:
    made = alice(run_flare)
    assert run_flare("trust", "revoke", made["fingerprint"]).returncode == 0
    build = run_flare("build", str(sources / "tiny-0"), "--name", "alpha")
    assert build.returncode == UNTRUSTED and "is revoked" in one_line_error(build)
    unsigned = run_flare("build", str(sources / "tiny-0"), "--name", "alpha", "--no-sign")
    assert unsigned.returncode == 0, unsigned.stderr
    for publisher in ((), ("--publisher", "alice")):
        sign = run_flare("sign", "alpha", "--key", made["private_key"], *publisher)
        assert sign.returncode == UNTRUSTED and made["fingerprint"] in one_line_error(sign)
