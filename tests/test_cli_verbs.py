"""The everyday verbs users of docker, ollama and huggingface-cli reach for, run as a user
runs them: untagging, shell completion, builds without a signature."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import RunFlare
from registry_helpers import tiny_source

NOT_FOUND, INVALID, UNTRUSTED = 3, 4, 11


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_source(tmp_path_factory.mktemp("sources"), 0)


def tags(run_flare: RunFlare) -> dict[str, list[str]]:
    listed = json.loads(run_flare("registry", "ls", "--json").stdout)
    return {row["name"]: row["tags"] for row in listed}


def test_untag_removes_one_tag_and_keeps_the_package(run_flare: RunFlare, source: Path) -> None:
    assert run_flare("build", str(source), "--name", "tiny").returncode == 0
    assert run_flare("registry", "tag", "tiny", "tiny:old").returncode == 0
    assert tags(run_flare) == {"tiny": ["latest", "old"]}

    done = run_flare("registry", "untag", "tiny:old")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("untagged tiny:old (was blake3:")
    assert tags(run_flare) == {"tiny": ["latest"]}
    assert run_flare("registry", "show", "tiny:old").returncode == NOT_FOUND
    assert run_flare("registry", "show", "tiny").returncode == 0

    assert run_flare("registry", "untag", "tiny:old").returncode == NOT_FOUND
    bare = run_flare("registry", "untag", "tiny")
    assert bare.returncode == INVALID and "use NAME:TAG" in bare.stderr
    assert run_flare("registry", "untag", "tiny:latest", "--json").returncode == 0
    assert tags(run_flare) == {"tiny": []}  # still listed: gc may collect it now


def test_shell_completion_is_offered_and_completes_commands(
    run_flare: RunFlare, flare_env: dict[str, str]
) -> None:
    in_bash = f"{sys.executable} -m flare --show-completion; exit $?"  # the shell it is for
    shown = subprocess.run(
        ["bash", "-c", in_bash], env=flare_env, capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0, shown.stderr
    assert "complete -o default -F _flare_completion flare" in shown.stdout
    asked = run_flare(
        env={
            "_FLARE_COMPLETE": "complete_bash",
            "COMP_WORDS": "flare registry un",
            "COMP_CWORD": "2",
        }
    )
    assert asked.stdout.split() == ["untag", "unpin"]


def test_no_sign_publishes_unsigned_with_a_key_configured(
    run_flare: RunFlare, source: Path
) -> None:
    assert run_flare("key", "generate", "--publisher", "alice").returncode == 0
    unsigned = run_flare("build", str(source), "--name", "plain", "--no-sign")
    assert unsigned.returncode == 0, unsigned.stderr
    assert run_flare("build", str(source), "--name", "signed").returncode == 0
    listed = json.loads(run_flare("registry", "ls", "--json").stdout)
    assert {row["name"]: row["publisher"] for row in listed} == {"plain": None, "signed": "alice"}
    assert run_flare("verify", "plain").returncode == UNTRUSTED


def last_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def test_a_part_of_a_package_is_shown_as_what_it_is(run_flare: RunFlare, source: Path) -> None:
    assert run_flare("build", str(source), "--name", "tiny").returncode == 0
    manifest = json.loads(run_flare("registry", "show", "tiny", "--json").stdout)["manifest"]
    for part, what in (
        (manifest["artifacts"][0], f"the {manifest['artifacts'][0]['kind']} "),
        (manifest["payloads"][0], "the payload of ranks [0]"),
    ):
        for command in (("registry", "show"), ("pull", "--device", "cpu"), ("registry", "pin")):
            shown = run_flare(*command, part["digest"][7:19])
            message = last_line(shown.stderr)
            assert shown.returncode == INVALID, message
            assert f"is not a package: it is {what}" in message and " of tiny@" in message
            assert "byte header" not in message


def test_a_second_key_generate_gives_a_hint_that_works(run_flare: RunFlare, tmp_path: Path) -> None:
    assert run_flare("key", "generate", "--publisher", "alice").returncode == 0
    again = run_flare("key", "generate", "--publisher", "alice")
    message = last_line(again.stderr)
    assert again.returncode == INVALID and "trust rm" not in message
    hint = message.split("; ", 1)[1]
    assert "flare key generate --publisher NAME --no-default --out FILE" in hint
    other = tmp_path / "alice-2.pem"
    followed = run_flare(
        "key", "generate", "--publisher", "alice", "--no-default", "--out", str(other)
    )
    assert followed.returncode == 0, followed.stderr


def test_trusting_a_revoked_key_is_refused_as_untrusted(
    run_flare: RunFlare, tmp_path: Path
) -> None:
    made = json.loads(
        run_flare("key", "generate", "--publisher", "bob", "--no-default", "--json").stdout
    )
    public = tmp_path / "bob.pub"
    public.write_text(made["public_key"])
    assert run_flare("trust", "revoke", made["fingerprint"]).returncode == 0
    refused = run_flare("trust", "add", "bob", "--key", str(public))
    message = last_line(refused.stderr)
    assert refused.returncode == UNTRUSTED and "is revoked on this host" in message


def test_store_get_dash_writes_to_stdout(
    run_flare: RunFlare, flare_env: dict[str, str], tmp_path: Path
) -> None:
    data = b"\x00binary\xffcontent\n" * 1000
    (tmp_path / "blob.bin").write_bytes(data)
    digest = json.loads(run_flare("store", "put", str(tmp_path / "blob.bin"), "--json").stdout)
    command = [sys.executable, "-m", "flare", "store", "get", digest[0]["digest"][7:19], "-"]
    got = subprocess.run(command, env=flare_env, cwd=tmp_path, capture_output=True, timeout=60)
    assert got.returncode == 0, got.stderr
    assert got.stdout == data and not (tmp_path / "-").exists()


def test_tables_cut_long_cells_to_the_width_and_no_trunc_shows_them(run_flare: RunFlare) -> None:
    settings = json.loads(run_flare("config", "show", "--json").stdout)["settings"]
    for width in (80, 120):
        shown = run_flare("config", "show", env={"COLUMNS": str(width)}).stdout.splitlines()
        assert len(shown) == len(settings) + 2  # the file line, the header, one line a setting
        assert all(len(line.rstrip()) <= width for line in shown[1:]) and "…" in "".join(shown)
    whole = run_flare("config", "show", "--no-trunc", env={"COLUMNS": "80"}).stdout
    assert "Hugging Face hub cache that ORG/NAME sources resolve in" in whole and "…" not in whole


def test_listing_a_name_no_package_can_have_is_refused(run_flare: RunFlare) -> None:
    """`ls --name ../x` once listed nothing and exited 0, where every other command refuses
    the name."""
    listed = run_flare("registry", "ls", "--name", "../x")
    assert listed.returncode == INVALID and "bad package name '../x'" in last_line(listed.stderr)
