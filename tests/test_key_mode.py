"""A signing key others may read or write is refused, as ssh refuses one, with real key files
and the real `flare` command: nothing is signed or published with it, and `chmod 600` (the
hint) is enough to use it again."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import RunFlare
from registry_helpers import tiny_source

from flare.errors import InvalidInputError, PermissionDeniedError
from flare.sign import keys

PERMISSION, UNTRUSTED = 7, 11


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_source(tmp_path_factory.mktemp("sources"), 0)


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    """The single `error:` line a refusal prints (no traceback, no internal error)."""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert "internal error" not in lines[0], done.stderr
    return lines[0]


def key_file(path: Path, mode: int) -> Path:
    """A fresh key written as flare writes one (0600), then given `mode`."""
    keys.write_private_key(keys.generate_key(), path)
    path.chmod(mode)
    return path


@pytest.mark.parametrize(
    ("mode", "said"),
    [
        (0o644, "readable by its group and others (mode 0644)"),
        (0o640, "readable by its group (mode 0640)"),
        (0o604, "readable by others (mode 0604)"),
        (0o620, "writable by its group (mode 0620)"),
        (0o666, "readable by its group and others, writable by its group and others (mode 0666)"),
        (0o710, "executable by its group (mode 0710)"),
    ],
)
def test_a_key_open_to_others_is_refused_naming_the_path_and_mode(
    tmp_path: Path, mode: int, said: str
) -> None:
    path = key_file(tmp_path / "key.pem", mode)
    with pytest.raises(PermissionDeniedError) as info:
        keys.load_private_key(path)
    assert info.value.exit_code == PERMISSION
    assert info.value.what == f"the signing key {path} is {said}"
    assert info.value.hint == f"chmod 600 {path}"


@pytest.mark.parametrize("mode", [0o600, 0o400, 0o700])
def test_a_key_only_its_owner_can_use_is_loaded(tmp_path: Path, mode: int) -> None:
    key = keys.generate_key()
    path = tmp_path / "key.pem"
    keys.write_private_key(key, path)
    path.chmod(mode)
    assert keys.fingerprint(keys.load_private_key(path)) == keys.fingerprint(key)


def test_a_file_that_is_no_key_is_refused_as_such_whatever_its_mode(tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a key")
    junk.chmod(0o644)
    with pytest.raises(InvalidInputError, match="not a PEM private key"):
        keys.load_private_key(junk)


@pytest.mark.parametrize(
    ("mode", "said"),
    [(0o644, "readable by its group and others"), (0o640, "readable by its group")],
)
def test_flare_sign_refuses_an_open_key_and_signs_nothing(
    run_flare: RunFlare, source: Path, tmp_path: Path, mode: int, said: str
) -> None:
    assert run_flare("build", str(source), "--name", "alpha").returncode == 0
    path = key_file(tmp_path / "bob.pem", mode)
    refused = run_flare("sign", "alpha", "--key", str(path), "--publisher", "bob")
    assert refused.returncode == PERMISSION
    line = one_line_error(refused)
    assert line == f"error: the signing key {path} is {said} (mode {mode:04o}); chmod 600 {path}"
    unsigned = run_flare("verify", "alpha")
    assert unsigned.returncode == UNTRUSTED and "unsigned" in one_line_error(unsigned)
    listed = json.loads(run_flare("registry", "ls", "--json").stdout)
    assert [row["publisher"] for row in listed] == [None]


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_flare_sign_uses_a_key_only_its_owner_can_read(
    run_flare: RunFlare, source: Path, tmp_path: Path, mode: int
) -> None:
    assert run_flare("build", str(source), "--name", "alpha").returncode == 0
    path = key_file(tmp_path / "bob.pem", mode)
    signed = run_flare("sign", "alpha", "--key", str(path), "--publisher", "bob")
    assert signed.returncode == 0, signed.stderr
    listed = json.loads(run_flare("registry", "ls", "--json").stdout)
    assert [row["publisher"] for row in listed] == ["bob"]


def test_flare_build_with_an_open_signing_key_publishes_nothing_until_chmod_600(
    run_flare: RunFlare, source: Path
) -> None:
    made = run_flare("key", "generate", "--publisher", "alice", "--json")
    assert made.returncode == 0, made.stderr
    path = Path(json.loads(made.stdout)["private_key"])
    path.chmod(0o644)
    refused = run_flare("build", str(source), "--name", "alpha")
    assert refused.returncode == PERMISSION
    line = one_line_error(refused)
    assert f"the signing key {path} is readable by its group and others (mode 0644)" in line
    assert line.endswith(f"; chmod 600 {path}")
    assert json.loads(run_flare("registry", "ls", "--json").stdout) == []

    path.chmod(0o600)  # the hint, followed
    built = run_flare("build", str(source), "--name", "alpha")
    assert built.returncode == 0, built.stderr
    assert run_flare("verify", "alpha").returncode == 0


def test_key_ls_lists_a_key_open_to_others_and_warns(run_flare: RunFlare) -> None:
    """Listing reads no secret out: the key is listed, and the warning says nothing signs
    with it until its mode is fixed."""
    assert run_flare("key", "generate", "--publisher", "alice").returncode == 0
    listed = json.loads(run_flare("key", "ls", "--json").stdout)
    key = Path(listed[0]["path"])
    key.chmod(0o644)
    done = run_flare("key", "ls", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == listed
    warning = f"warning: the signing key {key} is readable by its group and others (mode 0644)"
    assert warning in done.stderr


def test_a_folder_given_as_the_key_is_refused_as_such(run_flare: RunFlare, tmp_path: Path) -> None:
    assert (
        run_flare("build", str(tiny_source(tmp_path / "src", 0)), "--name", "alpha").returncode == 0
    )
    done = run_flare("sign", "alpha", "--key", str(tmp_path), "--publisher", "bob")
    assert done.returncode == 4, done.stderr
    assert one_line_error(done) == (
        f"error: {tmp_path} is a folder, not a key file; pass the PEM file flare key generate wrote"
    )
