"""Multi-rank builds as separate processes: `flare build --rendezvous` plus `flare join` peers.

Every rank is a real `python -m flare` process with its own FLARE_HOME (its own staging area);
the ranks share a store when the peers are given rank zero's registry folder, and do not when
each keeps its own. Whatever the arrangement, the package must have the digest of the
single-process `--ranks N` build of the same checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoints import make_synthetic_llama

PAYLOAD = "1M"
TIMEOUT = "5"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-shaped checkpoint of about 12 MB: a dozen 1 MB payloads per rank."""
    return make_synthetic_llama(tmp_path_factory.mktemp("synthetic") / "ckpt", 12 << 20)


def env_for(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
    env["FLARE_BUILD_TARGET"] = "none"  # eager packages: tests/test_compiled.py compiles
    return {**env, "FLARE_HOME": str(home), "XDG_CONFIG_HOME": str(home / "xdg"), **extra}


def flare(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "flare", *map(str, args)]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def reference(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """The digest of the single-process build, for 2 and 4 ranks."""
    home = tmp_path_factory.mktemp("reference")
    digests = {}
    for ranks in (2, 4):
        args = ("build", checkpoint, "--name", "syn", "--ranks", ranks, "--payload-size", PAYLOAD)
        done = subprocess.run(
            flare(*args, "--json"), env=env_for(home), capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        digests[ranks] = json.loads(done.stdout)["digest"]
    return digests


class Ranks:
    """N processes of one build: rank zero and its peers, started together."""

    def __init__(self, checkpoint: Path, root: Path, ranks: int, shared: bool) -> None:
        self.checkpoint, self.root, self.ranks, self.shared = checkpoint, root, ranks, shared
        self.address = f"127.0.0.1:{free_port()}"

    def home(self, rank: int) -> Path:
        return self.root / f"rank{rank}"

    def command(self, rank: int, local: str | None = None) -> list[str]:
        if rank == 0:
            return flare(
                "build", self.checkpoint, "--name", "syn", "--ranks", self.ranks,
                "--payload-size", PAYLOAD, "--rendezvous", self.address,
                "--timeout", TIMEOUT, "--json",
            )  # fmt: skip
        registry = self.home(0 if self.shared else rank) / "registry"
        extra = ["--local-checkpoint", local] if local else []
        return flare(
            "join", self.address, "--rank", rank, "--registry", registry,
            "--timeout", TIMEOUT, "--json", *extra,
        )  # fmt: skip

    def start(
        self, rank: int, local: str | None = None, wrap: list[str] | None = None, **env: str
    ) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [*(wrap or []), *self.command(rank, local)],
            env=env_for(self.home(rank), **env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def run(
        self, local: str | None = None, crash: dict[int, str] | None = None
    ) -> list[tuple[int, str, str]]:
        """Start every rank (peers first, to show the order does not matter); wait for all."""
        crash = crash or {}
        procs = [self.start(r, local, **_crash(crash.get(r))) for r in range(1, self.ranks)]
        procs.insert(0, self.start(0, **_crash(crash.get(0))))
        return [collect(p) for p in procs]


def collect(process: subprocess.Popen[str], within: float = 120) -> tuple[int, str, str]:
    """Wait for a process: its exit code, stdout and stderr (TimeoutExpired: it hung)."""
    out, err = process.communicate(timeout=within)
    return process.returncode, out, err


def _crash(point: str | None) -> dict[str, str]:
    return {"FLARE_CRASH_AT": point} if point else {}


def finished(results: list[tuple[int, str, str]]) -> list[dict]:
    for rank, (code, _, stderr) in enumerate(results):
        assert code == 0, f"rank {rank}: {stderr}"
    return [json.loads(out) for _, out, _ in results]


@pytest.mark.parametrize(
    ("ranks", "shared", "local"),
    [(2, True, None), (2, False, None), (4, True, "require"), (4, False, "prefer")],
    ids=["2-shared", "2-apart", "4-shared-local", "4-apart-local"],
)
def test_ranks_as_processes_build_the_single_process_package(
    checkpoint: Path,
    tmp_path: Path,
    reference: dict[int, str],
    ranks: int,
    shared: bool,
    local: str | None,
) -> None:
    group = Ranks(checkpoint, tmp_path, ranks, shared)
    summaries = finished(group.run(local))
    assert {s["digest"] for s in summaries} == {reference[ranks]}
    for peer in summaries[1:]:
        assert peer["written"] > 0
        assert peer["store"] == ("shared store" if shared else "rank 0")
        assert peer["source"] == ("local checkpoint" if local else "rank 0")
    if not shared:  # peers kept nothing: every payload went to rank zero's store
        assert not any((group.home(r) / "registry").exists() for r in range(1, ranks))


def test_a_peer_that_never_arrives_is_named_within_the_timeout(
    checkpoint: Path, tmp_path: Path
) -> None:
    group = Ranks(checkpoint, tmp_path, 4, shared=True)
    peers = [group.start(1), group.start(3)]
    code, _, stderr = collect(group.start(0), within=float(TIMEOUT) + 10)  # gives up, no hang
    assert code == 13, stderr
    assert "rank 2 did not join" in stderr and "Traceback" not in stderr
    for peer in peers:
        peer_code, _, peer_err = collect(peer)
        assert peer_code == 13 and "rank 2 did not join" in peer_err, peer_err


def test_joining_an_unreachable_rank_zero_is_one_line(tmp_path: Path) -> None:
    """No C++ stack from torch's store client, and no retries past --timeout."""
    joining = subprocess.Popen(
        flare("join", f"127.0.0.1:{free_port()}", "--rank", "1", "--timeout", "2"),
        env=env_for(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    code, _, stderr = collect(joining, within=30)
    assert code == 13, stderr
    assert "frame #" not in stderr and "c10d" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "could not reach rank 0" in errors[0] and "within 2 s" in errors[0]


def test_a_required_local_checkpoint_that_differs_is_refused(
    checkpoint: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(checkpoint, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rope_theta": 1.0}))
    group = Ranks(checkpoint, tmp_path, 2, shared=True)
    peer = subprocess.Popen(
        [*group.command(1, "require"), "--checkpoint", str(copy)],
        env=env_for(group.home(1)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    leader = group.start(0)
    _, leader_err = leader.communicate(timeout=60)
    _, peer_err = peer.communicate(timeout=60)
    assert peer.returncode == 6, peer_err
    assert "differs from rank 0's in config.json" in peer_err
    assert leader.returncode == 13 and "rank 1:" in leader_err and "differs" in leader_err


@pytest.mark.parametrize(
    ("shared", "crash"),
    [(True, {1: "join:payload:4"}), (False, {0: "assemble:payload:6"})],
    ids=["peer-killed", "rank-zero-killed"],
)
def test_a_killed_rank_resumes_with_every_rank_rerun(
    checkpoint: Path,
    tmp_path: Path,
    reference: dict[int, str],
    shared: bool,
    crash: dict[int, str],
) -> None:
    group = Ranks(checkpoint, tmp_path, 2, shared)
    killed = group.run(crash=crash)
    (victim,) = crash
    assert killed[victim][0] == -signal.SIGKILL
    survivor = killed[1 - victim]
    assert survivor[0] == 13 and f"rank {victim}" in survivor[2], survivor[2]
    group.address = f"127.0.0.1:{free_port()}"
    summaries = finished(group.run())
    assert {s["digest"] for s in summaries} == {reference[2]}
    assemble = {p["name"]: p["status"] for p in summaries[0]["phases"]}["assemble"]
    assert assemble == "resumed"
    if shared:  # the payload the peer stored but never reported was not written again
        assert summaries[1]["reused"] >= 1


def test_ranks_in_network_namespaces_over_a_veth_pair(
    checkpoint: Path, tmp_path: Path, reference: dict[int, str]
) -> None:
    """Two "hosts" (network namespaces joined by a veth pair) sharing a store folder."""
    names = [f"flare{os.getpid()}a", f"flare{os.getpid()}b"]
    if not _make_namespaces(names):
        pytest.skip("network namespaces and veth pairs are not available here")
    try:
        group = Ranks(checkpoint, tmp_path, 2, shared=True)
        group.address = "10.213.0.1:29500"
        peer = group.start(1, wrap=["ip", "netns", "exec", names[1]])
        leader = group.start(0, wrap=["ip", "netns", "exec", names[0]])
        results = [collect(leader), collect(peer)]
        assert {s["digest"] for s in finished(results)} == {reference[2]}
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _make_namespaces(names: list[str]) -> bool:
    """Two namespaces, 10.213.0.1 and 10.213.0.2 on the ends of one veth pair."""
    a, b = names
    steps = [
        ["ip", "netns", "add", a],
        ["ip", "netns", "add", b],
        ["ip", "link", "add", f"{a}v", "netns", a, "type", "veth", "peer", f"{b}v", "netns", b],
        ["ip", "-n", a, "addr", "add", "10.213.0.1/24", "dev", f"{a}v"],
        ["ip", "-n", b, "addr", "add", "10.213.0.2/24", "dev", f"{b}v"],
        *(["ip", "-n", n, "link", "set", dev, "up"] for n in names for dev in ("lo", f"{n}v")),
    ]
    for step in steps:
        if subprocess.run(step, capture_output=True).returncode != 0:
            for name in names:
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
            return False
    return True
