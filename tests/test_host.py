"""What a host holds, as `flare cache` and `flare ps` show it: the packages pulled here and the
servers running, with a real server process on loopback."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from registry_helpers import flare
from test_serve import Server, flare_env

from flare.build.tiny import make_tiny_llama

IN_USE = 9


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A host with two tiny packages built, signed and pulled into its cache."""
    env = flare_env(tmp_path)
    flare(env, "key", "generate", "--publisher", "alice")
    for seed, name in enumerate(("tiny", "other")):
        flare(env, "build", str(make_tiny_llama(tmp_path / name, seed=seed)), "--name", name)
        flare(env, "pull", name, "--device", "cpu")
    return tmp_path


def cached(env: dict[str, str]) -> dict[str, dict]:
    return {p["name"]: p for p in json.loads(flare(env, "cache", "ls", "--json").stdout)}


def test_cache_lists_removes_and_prunes_but_keeps_what_a_server_serves(home: Path) -> None:
    env = flare_env(home)
    listed = cached(env)
    assert sorted(listed) == ["other", "tiny"]
    assert all(p["size"] > 100_000 and not p["servers"] for p in listed.values())
    table = flare(env, "cache", "ls").stdout
    assert "last used" in table and listed["tiny"]["digest"][7:19] in table

    server = Server(env, "tiny")
    try:
        serving = cached(env)["tiny"]["servers"]
        assert serving == [f"{os.uname().nodename}:{server.process.pid}"]
        refused = flare(env, "cache", "rm", "tiny", check=False)
        assert refused.returncode == IN_USE and "flare ps" in refused.stderr
        dead = {"id": "dead", "holder": "gone:1", "purpose": "serve", "expires": 1.0}
        (home / "packages" / "leases" / "dead.json").write_text(json.dumps(dead))
        pruned = json.loads(flare(env, "cache", "prune", "--json").stdout)
        assert not (home / "packages" / "leases" / "dead.json").exists()
        assert [p["name"] for p in pruned["packages"]] == ["other"] and pruned["bytes"] > 0
        assert sorted(cached(env)) == ["tiny"]
    finally:
        assert server.stop()[0] == 0
    removed = flare(env, "cache", "rm", "tiny").stdout
    assert removed.startswith("removed tiny@blake3:") and "freed" in removed
    assert cached(env) == {}
    assert not [p for p in (home / "packages" / "blobs").rglob("*") if p.is_file()]


def test_ps_lists_live_servers_and_gc_prunes_dead_ones(home: Path) -> None:
    env = flare_env(home)
    leases = home / "registry" / "leases"
    dead = {
        "id": "dead",
        "holder": "gone:1",
        "purpose": "serve",
        "packages": [],
        "expires": time.time() - 7200,
        "started": 0.0,
        "url": "http://x/v1",
        "what": "x@y",
    }
    (leases / "dead.json").write_text(json.dumps(dead))
    server = Server(env, "tiny")
    try:
        shown = json.loads(flare(env, "ps", "--json").stdout)
        assert len(shown) == 1, shown
        assert shown[0]["host"] == os.uname().nodename
        assert shown[0]["pid"] == server.process.pid and shown[0]["url"] == server.url
        assert shown[0]["package"].startswith("tiny@blake3:")
        table = flare(env, "ps").stdout
        assert "tiny@" in table and server.url in table and " s ago" in table
    finally:
        assert server.stop()[0] == 0
    assert json.loads(flare(env, "ps", "--json").stdout) == []
    flare(env, "registry", "gc")
    assert not (leases / "dead.json").exists()


def test_serve_builds_a_checkpoint_folder_or_hub_id_then_serves_it(tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = hub / "models--acme--Tiny_Chat"
    make_tiny_llama(repo / "snapshots" / commit, seed=3)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = flare_env(tmp_path, HF_HUB_CACHE=str(hub))
    flare(env, "key", "generate", "--publisher", "alice")
    folder = make_tiny_llama(tmp_path / "My Llama", seed=2)
    for source, name in ((str(folder), "my-llama"), ("acme/Tiny_Chat", "tiny_chat")):
        for _ in range(2):  # the second time, the build is taken from the first
            server = Server(env, source)
            assert server.process.stderr is not None
            built = server.process.stderr.readline()
            while not built.startswith("built "):
                built = server.process.stderr.readline()
            running = json.loads(flare(env, "ps", "--json").stdout)
            assert server.stop()[0] == 0
            assert built.startswith(f"built {name}:latest@blake3:") and f"as {name}@" in built
            digest = built.split("@", 1)[1].split()[0]
            assert [s["package"] for s in running] == [f"{name}@{digest}"]
    pulled = flare(env, "pull", str(folder), check=False)
    assert (
        pulled.returncode == 4 and f"build it first: flare build {folder} --name" in pulled.stderr
    )
    listed = json.loads(flare(env, "registry", "ls", "--json").stdout)
    assert {row["name"]: row["publisher"] for row in listed} == {
        "my-llama": "alice",
        "tiny_chat": "alice",
    }
