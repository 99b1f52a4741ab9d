"""The `flare` command as users and scripts meet it: output, JSON, errors and exit codes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import RunFlare, mount_tmpfs
from helpers import write_random

NOT_FOUND, INVALID, AMBIGUOUS, CORRUPT, DENIED = 3, 4, 5, 6, 7
NOBODY = 65534


def one_line_error(result: object) -> str:
    """The error a command printed, checked to be one line with no traceback."""
    stderr = result.stderr  # type: ignore[attr-defined]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ") and "Traceback" not in stderr
    return lines[0]


def test_help_lists_the_components(run_flare: RunFlare) -> None:
    result = run_flare("--help")
    assert result.returncode == 0
    for component in ("store", "config"):
        assert component in result.stdout
    assert run_flare("store", "put", "--help").returncode == 0


def test_store_put_ls_get_du_verify_round_trip(run_flare: RunFlare, tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    data = write_random(folder / "model.safetensors", 200_000)
    (folder / "config.json").write_text("{}")
    put = run_flare("store", "put", str(folder), "--json")
    assert put.returncode == 0, put.stderr
    entries = {Path(e["path"]).name: e for e in json.loads(put.stdout)}
    digest = entries["model.safetensors"]["digest"]
    assert entries["model.safetensors"]["size"] == len(data)

    listed = json.loads(run_flare("store", "ls", "--json").stdout)
    assert sorted(e["digest"] for e in listed) == sorted(e["digest"] for e in entries.values())

    out = tmp_path / "out.bin"
    got = run_flare("store", "get", digest.split(":")[1][:10], str(out))
    assert got.returncode == 0, got.stderr
    assert out.read_bytes() == data

    usage = json.loads(run_flare("store", "du", "--json").stdout)
    assert usage["blobs"] == 2 and usage["stored_bytes"] == len(data) + 2

    verified = run_flare("store", "verify", "--json")
    assert verified.returncode == 0 and json.loads(verified.stdout)["ok"] is True


def test_default_store_lives_under_flare_home(run_flare: RunFlare, tmp_path: Path) -> None:
    source = tmp_path / "a.txt"
    source.write_text("hello")
    assert run_flare("store", "put", str(source)).returncode == 0
    assert list((tmp_path / "home" / "registry" / "blobs").rglob("*"))


def test_exit_codes_tell_errors_apart(run_flare: RunFlare, tmp_path: Path) -> None:
    missing = run_flare("store", "put", str(tmp_path / "absent"))
    assert missing.returncode == NOT_FOUND
    assert "absent" in one_line_error(missing)

    bad = run_flare("store", "get", "xyz123456", str(tmp_path / "out"))
    assert bad.returncode == INVALID and "hex" in one_line_error(bad)

    short = run_flare("store", "get", "abc", str(tmp_path / "out"))
    assert short.returncode == INVALID and "at least 8" in one_line_error(short)

    unknown = run_flare("store", "get", "12345678", str(tmp_path / "out"))
    assert unknown.returncode == NOT_FOUND


def test_ambiguous_prefix_lists_candidates(run_flare: RunFlare, tmp_path: Path) -> None:
    folder = tmp_path / "home" / "registry" / "blobs" / "blake3" / "ab"
    folder.mkdir(parents=True)
    names = ["abcdef01" + "1" * 56, "abcdef01" + "2" * 56]
    for name in names:
        (folder / name).write_bytes(b"x")
    result = run_flare("store", "get", "abcdef01", str(tmp_path / "out"))
    assert result.returncode == AMBIGUOUS
    line = one_line_error(result)
    assert names[0][:16] in line and names[1][:16] in line


def test_corrupt_blob_is_refused_then_quarantined(run_flare: RunFlare, tmp_path: Path) -> None:
    source = tmp_path / "w.bin"
    write_random(source, 50_000)
    digest = json.loads(run_flare("store", "put", str(source), "--no-link", "--json").stdout)[0][
        "digest"
    ]
    hex_digest = digest.split(":")[1]
    blob = tmp_path / "home/registry/blobs/blake3" / hex_digest[:2] / hex_digest
    blob.chmod(0o644)
    blob.write_bytes(b"bit rot" + blob.read_bytes()[7:])

    got = run_flare("store", "get", digest, str(tmp_path / "out"))
    assert got.returncode == CORRUPT and "corrupt" in one_line_error(got)
    assert not (tmp_path / "out").exists()

    verified = run_flare("store", "verify", "--json")
    report = json.loads(verified.stdout)
    assert verified.returncode == CORRUPT and report["corrupt"] == [digest]
    assert not blob.exists() and (tmp_path / "home/registry" / report["quarantined"][0]).exists()

    missing = run_flare("store", "verify", digest)
    assert missing.returncode == NOT_FOUND and "missing" in missing.stdout


def run_as_nobody(*args: str) -> subprocess.CompletedProcess[str]:
    """Run flare as an unprivileged user (root bypasses permission checks)."""
    env = {"PATH": os.environ["PATH"], "HOME": "/tmp", "PYTHONPATH": ":".join(sys.path)}
    return subprocess.run(
        [sys.executable, "-m", "flare", *args],
        capture_output=True,
        text=True,
        user=NOBODY,
        group=NOBODY,
        env=env,
        timeout=60,
    )


def test_permission_denied_as_an_unprivileged_user(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to an unprivileged user")
    try:
        usable = run_as_nobody("--help").returncode == 0
    except PermissionError:
        usable = False
    if not usable:
        pytest.skip("this Python installation is not usable by other users")
    shared = Path(tempfile.mkdtemp(prefix="flare-perm-"))
    try:
        shared.chmod(0o755)
        store = shared / "root-only"
        store.mkdir(mode=0o755)
        source = shared / "f.txt"
        source.write_text("data")
        result = run_as_nobody("store", "put", str(source), "--store", str(store))
        assert result.returncode == DENIED, result.stderr
        assert str(store) in one_line_error(result)
    finally:
        shutil.rmtree(shared)


def test_read_only_store_is_permission_denied(run_flare: RunFlare, tmp_path: Path) -> None:
    mount = tmp_path / "ro"
    mount_tmpfs(mount, "1m", "ro")
    try:
        source = tmp_path / "f.txt"
        source.write_text("data")
        result = run_flare("store", "put", str(source), "--store", str(mount / "store"))
        assert result.returncode == DENIED
        assert "Read-only file system" in one_line_error(result)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_debug_shows_the_traceback(run_flare: RunFlare, tmp_path: Path) -> None:
    result = run_flare("--debug", "store", "put", str(tmp_path / "absent"))
    assert result.returncode == NOT_FOUND and "Traceback" in result.stderr


def test_config_show_says_where_each_value_comes_from(run_flare: RunFlare, tmp_path: Path) -> None:
    config = tmp_path / "xdg" / "flare" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text('[paths]\nregistry = "lab-registry"\n[memory]\nreserve = "8G"\n')
    result = run_flare("config", "show", "--json", env={"FLARE_KERNEL_CACHE": "/fast/kernels"})
    assert result.returncode == 0, result.stderr
    settings = json.loads(result.stdout)["settings"]
    assert settings["paths.registry"] == {
        "value": str(config.parent / "lab-registry"),
        "source": f"file {config}",
    }
    assert settings["memory.reserve"]["value"] == 8 << 30
    assert settings["paths.kernel_cache"] == {
        "value": "/fast/kernels",
        "source": "env FLARE_KERNEL_CACHE",
    }
    assert settings["paths.package_cache"]["value"] == str(tmp_path / "home" / "packages")
    assert run_flare("config", "show").returncode == 0


def test_bad_config_is_one_clear_line(run_flare: RunFlare, tmp_path: Path) -> None:
    config = tmp_path / "flare.toml"
    config.write_text("[paths]\nregistyr = '/x'\n")
    typo = run_flare("config", "show", env={"FLARE_CONFIG": str(config)})
    assert typo.returncode == INVALID and "registyr" in one_line_error(typo)

    config.write_text("[paths\n")
    broken = run_flare("config", "show", env={"FLARE_CONFIG": str(config)})
    assert broken.returncode == INVALID and "not valid TOML" in one_line_error(broken)

    bad_size = run_flare("config", "show", env={"FLARE_MEMORY_RESERVE": "lots"})
    assert bad_size.returncode == INVALID and "memory.reserve" in one_line_error(bad_size)

    absent = run_flare("config", "show", env={"FLARE_CONFIG": str(tmp_path / "nope.toml")})
    assert absent.returncode == NOT_FOUND
