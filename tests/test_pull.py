"""`flare pull`: the index and signatures first, then trust, compatibility, disk and memory,
and only then the blobs, linked, resumable, protected from gc while served."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoints import make_synthetic_llama
from conftest import mount_tmpfs
from helpers import CliHome

from flare.build.tiny import make_tiny_llama
from flare.store.package import MANIFEST_KEY, canonical_json
from flare.store.safetensors import encode_header

UNTRUSTED, NO_ROOM, UNREADABLE, INCOMPATIBLE = 11, 8, 6, 12


class Host(CliHome):
    """One host's environment: its own FLARE_HOME, config and package cache."""

    def cached_blobs(self, cache: Path | None = None) -> list[Path]:
        folder = (cache or self.root / "packages") / "blobs"
        return [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("checkpoints")
    make_tiny_llama(root / "tiny")
    make_synthetic_llama(root / "big", 8 << 20)
    return root


@pytest.fixture
def host(tmp_path: Path, checkpoints: Path) -> Host:
    """A host with alice's key, and tiny built and signed by her."""
    lab = Host(tmp_path / "home")
    lab.run("key", "generate", "--publisher", "alice")
    lab.run("build", str(checkpoints / "tiny"), "--name", "tiny")
    return lab


def pulled(host: Host, *args: str) -> dict:
    return json.loads(host.run("pull", *args, "--device", "cpu", "--json").stdout)


def test_pull_links_on_one_filesystem_and_resumes(host: Host) -> None:
    first = pulled(host, "tiny")
    assert first["publisher"] == "alice" and first["signer"].startswith("SHA256:")
    assert set(first["blobs"]) == {"hardlink"} and first["blobs"]["hardlink"] >= 3
    assert pulled(host, "tiny")["blobs"] == {}  # everything is there: nothing moves
    payload = max(host.cached_blobs(), key=lambda p: p.stat().st_size)
    payload.unlink()  # as if the pull had died before this blob
    assert pulled(host, "tiny")["blobs"] == {"hardlink": 1}


def test_an_unsigned_package_is_refused_and_nothing_is_copied(
    tmp_path: Path, checkpoints: Path
) -> None:
    lab = Host(tmp_path / "unsigned")
    lab.run("build", str(checkpoints / "tiny"), "--name", "tiny")
    refused = lab.run("pull", "tiny", "--device", "cpu", code=UNTRUSTED)
    assert "unsigned" in refused.stderr
    assert lab.cached_blobs() == []


def test_an_untrusted_publisher_is_refused_unless_accepted_for_this_run(host: Host) -> None:
    host.run("trust", "rm", "alice")
    refused = host.run("pull", "tiny", "--device", "cpu", code=UNTRUSTED)
    assert "alice" in refused.stderr and "SHA256:" in refused.stderr
    assert host.cached_blobs() == []
    accepted = host.run(
        "pull", "tiny", "--device", "cpu", "--dangerously-accept-publisher", "alice"
    )
    assert "warning: accepted publisher alice" in accepted.stderr
    refused = host.run(
        "pull",
        "tiny",
        "--device",
        "cpu",
        "--dangerously-accept-publisher",
        "bob",
        code=UNTRUSTED,
    )


def test_no_room_on_disk_is_refused_before_any_copy(
    host: Host, checkpoints: Path, tmp_path: Path
) -> None:
    host.run("build", str(checkpoints / "big"), "--name", "big")
    small = tmp_path / "small-cache"
    mount_tmpfs(small, "4m")
    try:
        on_small = Host(host.root, FLARE_PACKAGE_CACHE=str(small))
        refused = on_small.run("pull", "big", "--device", "cpu", code=NO_ROOM)
        stored = json.loads(on_small.run("registry", "show", "big", "--json").stdout)
        size = sum(
            p["size"] for p in stored["manifest"]["payloads"] + stored["manifest"]["artifacts"]
        )
        assert f"stores {size / 2**20:.1f} MiB under {small}, " in refused.stderr
        assert re.search(r", \d\.\d MiB are free; free space there", refused.stderr)
        assert on_small.cached_blobs(small) == []
        on_small.run("pull", "tiny", "--device", "cpu")  # a package that fits still does
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_no_memory_for_the_weights_is_refused_before_any_copy(host: Host) -> None:
    starved = Host(host.root, FLARE_MEMORY_RESERVE="100T")
    refused = starved.run("pull", "tiny", "--device", "cpu", code=NO_ROOM)
    assert "of memory (weights, KV cache and memory.reserve)" in refused.stderr
    assert starved.cached_blobs() == []


def test_a_revision_mismatch_is_refused_before_any_copy(host: Host) -> None:
    refused = host.run(
        "pull", "tiny", "--device", "cpu", "--revision", "abcdef1", code=INCOMPATIBLE
    )
    assert "not revision abcdef1" in refused.stderr
    assert host.cached_blobs() == []


def test_a_newer_package_format_asks_for_a_newer_flare(host: Host) -> None:
    index = encode_header([], {MANIFEST_KEY: canonical_json({"format": 2, "name": "future"})})
    put = host.run("store", "put", "--json", str(_write(host.root / "future.index", index)))
    digest = json.loads(put.stdout)[0]["digest"]
    refused = host.run("pull", digest, "--device", "cpu", code=UNREADABLE)
    assert "package format 2; this flare reads format 1" in refused.stderr
    assert "upgrade flare" in refused.stderr


def test_gc_leaves_a_served_package_alone_until_the_server_stops(host: Host) -> None:
    server = subprocess.Popen(
        [sys.executable, "-m", "flare", "serve", "tiny", "--port", "0", "--device", "cpu"],
        env=host.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert "http://" in (server.stdout.readline() if server.stdout else "")
        digest = json.loads(host.run("registry", "show", "tiny", "--json").stdout)["digest"]
        host.run("registry", "rm", "tiny")
        host.run("registry", "gc", "--grace", "0")
        host.run("registry", "verify", digest)  # every blob still there while it is served
    finally:
        server.terminate()
        assert server.wait(timeout=60) == 0
    swept = json.loads(host.run("registry", "gc", "--grace", "0", "--json").stdout)
    assert len(swept["deleted"]) >= 4, swept


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_a_revoked_key_is_refused_even_when_accepted_by_name(host: Host) -> None:
    fingerprint = pulled(host, "tiny")["signer"]
    host.run("trust", "revoke", fingerprint)
    for extra in ((), ("--dangerously-accept-publisher", "alice")):
        refused = host.run("pull", "tiny", "--device", "cpu", *extra, code=UNTRUSTED)
        assert "revoked" in refused.stderr and fingerprint in refused.stderr


def test_a_flipped_byte_in_the_registry_index_is_refused_before_any_copy(host: Host) -> None:
    digest = json.loads(host.run("registry", "show", "tiny", "--json").stdout)["digest"]
    hex_digest = digest.removeprefix("blake3:")
    index = host.root / "registry" / "blobs" / "blake3" / hex_digest[:2] / hex_digest
    index.chmod(0o644)
    data = bytearray(index.read_bytes())
    data[-3] ^= 0x01
    index.write_bytes(bytes(data))
    refused = host.run("pull", "tiny", "--device", "cpu", code=6)
    assert f"blob {digest} in" in refused.stderr and "is corrupt" in refused.stderr
    assert host.cached_blobs() == []


def test_a_blob_lost_or_corrupt_in_the_registry_is_named_with_its_package(host: Host) -> None:
    """The store's words name only a blob; the pull says whose, where, and what to do."""
    shown = json.loads(host.run("registry", "show", "tiny", "--json").stdout)
    index = shown["digest"].removeprefix("blake3:")
    blobs = [p for p in (host.root / "registry" / "blobs").rglob("*") if p.is_file()]
    payload = max((p for p in blobs if p.name != index), key=lambda p: p.stat().st_size)
    payload.chmod(0o644)
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0xFF
    payload.write_bytes(bytes(data))
    refused = host.run("pull", "tiny", "--device", "cpu", code=6)
    line = refused.stderr.strip().splitlines()[-1]
    assert f"tiny@{index[:12]}'s blob blake3:{payload.name}" in line, line
    assert "run `flare registry verify tiny@" in line and "then build or push" in line
    payload.unlink()
    refused = host.run("pull", "tiny", "--device", "cpu", code=3)
    line = refused.stderr.strip().splitlines()[-1]
    assert f"needs blob blake3:{payload.name}, which" in line and "lacks" in line, line


def test_a_folder_where_a_cached_blob_should_be_is_quarantined_and_copied_again(
    host: Host,
) -> None:
    """Once the pull found it present and every serve failed on `Is a directory`."""
    pulled(host, "tiny")
    payload = max(host.cached_blobs(), key=lambda p: p.stat().st_size)
    payload.chmod(0o644)
    payload.unlink()
    payload.mkdir()
    assert pulled(host, "tiny")["blobs"] == {"hardlink": 1}
    assert payload.is_file()
    quarantined = list((host.root / "packages" / "quarantine").iterdir())
    assert [q.name.split(".")[0] for q in quarantined] == [payload.name]


def test_a_registry_gone_during_a_pull_is_said_to_be_gone(host: Host) -> None:
    """A NAS unmounted mid-pull is not a blob lost from the registry: no rebuild advised."""
    from registry_helpers import stopped_at

    process = stopped_at(host.env, "pull:blob:2", "pull", "tiny", "--device", "cpu")
    registry = host.root / "registry"
    registry.rename(host.root / "registry.gone")
    process.send_signal(signal.SIGCONT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 3, stderr
    assert f"the registry {registry} went away while tiny@" in stderr
    assert "then pull again" in stderr and "build or push" not in stderr
    (host.root / "registry.gone").rename(registry)
    pulled(host, "tiny")  # what was copied is kept; the rest comes now
