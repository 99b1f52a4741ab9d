"""Killed builds resume to the same digest; concurrent builds and full disks corrupt nothing."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from checkpoints import make_synthetic_llama
from conftest import mount_tmpfs

from flare.store import BlobStore

PAYLOAD = "1M"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-shaped checkpoint of about 20 MB: about 20 payloads of 1 MB."""
    return make_synthetic_llama(tmp_path_factory.mktemp("synthetic") / "ckpt", 24 << 20)


def build_cmd(checkpoint: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "flare",
        "build",
        str(checkpoint),
        "--name",
        "syn",
        "--ranks",
        "2",
        "--payload-size",
        PAYLOAD,
        "--json",
        *extra,
    ]


def env_for(home: Path, **extra: str) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
    env["FLARE_BUILD_TARGET"] = "none"  # eager packages: tests/test_compiled.py compiles
    return {**env, "FLARE_HOME": str(home), "XDG_CONFIG_HOME": str(home / "xdg"), **extra}


def finish(checkpoint: Path, home: Path) -> dict:
    """Run the build to completion; return its JSON summary."""
    done = subprocess.run(
        build_cmd(checkpoint), env=env_for(home), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def reference(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, float]:
    """The digest of an uninterrupted build, and how long it took."""
    started = time.perf_counter()
    summary = finish(checkpoint, tmp_path_factory.mktemp("reference"))
    return summary["digest"], time.perf_counter() - started


def assert_store_clean(home: Path) -> None:
    report = BlobStore(home / "registry").verify()
    assert report.ok, report


@pytest.mark.parametrize(
    "point", ["assemble:payload:1", "assemble:payload:7", "publish:index", "publish:ref"]
)
def test_a_build_killed_at_a_crash_point_resumes_to_the_same_digest(
    checkpoint: Path, tmp_path: Path, reference: tuple[str, float], point: str
) -> None:
    killed = subprocess.run(
        build_cmd(checkpoint),
        env=env_for(tmp_path, FLARE_CRASH_AT=point),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL
    summary = finish(checkpoint, tmp_path)
    assert summary["digest"] == reference[0]
    status = {p["name"]: p["status"] for p in summary["phases"]}
    if point.startswith("assemble"):
        assert status["assemble"] == "resumed"
    else:
        assert status["assemble"] == "reused"
    assert_store_clean(tmp_path)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_builds_killed_at_random_moments_resume_to_the_same_digest(
    checkpoint: Path, tmp_path: Path, reference: tuple[str, float], seed: int
) -> None:
    rng = random.Random(seed)
    for _ in range(3):
        process = subprocess.Popen(
            build_cmd(checkpoint),
            env=env_for(tmp_path),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(rng.uniform(0.2, 0.2 + reference[1]))
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert finish(checkpoint, tmp_path)["digest"] == reference[0]
    assert_store_clean(tmp_path)


def test_two_builds_of_the_same_inputs_at_once(
    checkpoint: Path, tmp_path: Path, reference: tuple[str, float]
) -> None:
    runs = [
        subprocess.Popen(
            build_cmd(checkpoint),
            env=env_for(tmp_path),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    outputs = [run.communicate(timeout=300) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    assert {json.loads(out)["digest"] for out, _ in outputs} == {reference[0]}
    assert_store_clean(tmp_path)


@pytest.mark.parametrize(
    ("folder", "small", "freed"), [("registry", "8m", "64m"), ("staging", "64k", "16m")]
)
def test_disk_full_then_freed_resumes(
    checkpoint: Path,
    tmp_path: Path,
    reference: tuple[str, float],
    folder: str,
    small: str,
    freed: str,
) -> None:
    """A full store or staging area: a clear error; once space is freed, the same command
    finishes with the digest of an uninterrupted build."""
    mount = tmp_path / folder
    mount_tmpfs(mount, small)
    try:
        full = subprocess.run(
            build_cmd(checkpoint),
            env=env_for(tmp_path),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert full.returncode == 8, full.stderr
        assert "No space left" in full.stderr and "Traceback" not in full.stderr
        subprocess.run(["mount", "-o", f"remount,size={freed}", str(mount)], check=True)
        summary = finish(checkpoint, tmp_path)
        assert summary["digest"] == reference[0]
        if folder == "registry":  # the payloads that fitted were kept
            assert {p["name"]: p["status"] for p in summary["phases"]}["assemble"] == "resumed"
        assert_store_clean(tmp_path)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
