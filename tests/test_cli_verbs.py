"""The everyday verbs users of docker, ollama and huggingface-cli reach for, run as a user
runs them: untagging, shell completion, builds without a signature."""

from __future__ import annotations

import json
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


def test_shell_completion_is_offered_and_completes_commands(run_flare: RunFlare) -> None:
    shown = run_flare("--show-completion", "bash")
    assert shown.returncode == 0
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
