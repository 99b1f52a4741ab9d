"""Multi-rank serving when ranks fail, and across hosts: a real SIGKILL or SIGSTOP of a rank,
rank zero killed, `flare serve --rendezvous` with `flare join` from another FLARE_HOME (its own
host cache, its own trust and admission), and a joining host that refuses the package.

Nothing may hang: every wait here is bounded, and every process must be gone at the end."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from multirank_serving import TIMEOUT, Server, alive, build_home, flare, flare_env, package
from test_multirank import _make_namespaces as make_namespaces

from flare.serve.runtime import GenerateRuntime, SamplingParams, load_runtime

EXIT_RANK = 13
"""RankError: the serving group lost a rank."""


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_home(tmp_path_factory.mktemp("tp-faults"))


@pytest.fixture
def server(home: Path) -> Iterator[Server]:
    running = Server(flare_env(home), "llama:r2", "--timeout", TIMEOUT)
    yield running
    if running.process.poll() is None:
        running.process.kill()
        running.process.communicate()


def watch_health(server: Server, seconds: float) -> list[tuple[int, dict]]:
    """Every /health answer until the server stops answering (or `seconds` pass)."""
    seen: list[tuple[int, dict]] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            reply = httpx.get(f"{server.root}/health", timeout=2)
        except httpx.HTTPError:
            break
        seen.append((reply.status_code, reply.json()))
        time.sleep(0.05)
    return seen


def test_a_killed_rank_is_named_fails_requests_and_stops_every_rank(server: Server) -> None:
    (rank1,) = server.ranks()
    errors: list[BaseException] = []
    started = threading.Event()

    def ask() -> None:
        try:
            stream = server.client().completions.create(
                model="llama", prompt="the registry", max_tokens=220, temperature=0, stream=True
            )
            for _ in stream:
                started.set()
        except openai.APIError as exc:
            errors.append(exc)
        started.set()

    asking = threading.Thread(target=ask)
    asking.start()
    assert started.wait(30)
    rank1_killed = time.monotonic()
    os.kill(rank1, signal.SIGKILL)
    health = watch_health(server, 30)
    asking.join(30)
    _, stderr = server.process.communicate(timeout=30)
    assert time.monotonic() - rank1_killed < 30
    failed = [body for code, body in health if code == 503 and body.get("status") == "failed"]
    assert failed and "rank 1" in failed[0]["error"], health
    assert errors, "the request in flight should end with an error"
    assert "rank 1" in str(errors[0]), errors
    assert server.process.returncode == EXIT_RANK
    assert f"rank 1 (process {rank1}) was killed by signal 9" in stderr


def test_a_rank_that_stops_answering_is_named_within_the_timeout(server: Server) -> None:
    (rank1,) = server.ranks()
    os.kill(rank1, signal.SIGSTOP)
    stopped = time.monotonic()
    _, stderr = server.process.communicate(timeout=60)
    assert server.process.returncode == EXIT_RANK
    assert "rank 1 stopped answering" in stderr, stderr
    assert time.monotonic() - stopped < 2 * float(TIMEOUT) + 15
    assert not alive(rank1)


def test_a_killed_rank_zero_leaves_no_rank_behind(server: Server) -> None:
    (rank1,) = server.ranks()
    server.process.kill()
    server.process.communicate()
    deadline = time.monotonic() + 2 * float(TIMEOUT) + 5
    while alive(rank1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(rank1)


# -- across hosts ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def other_host(root: Path, home: Path, trust: bool) -> dict[str, str]:
    """A second host: its own FLARE_HOME (host cache, trust), the first host's registry."""
    env = flare_env(root)
    if trust:
        flare(env, "trust", "add", "alice", "--key", home / "alice.pub")
    return env


def start_rank_zero(
    home: Path, address: str, wrap: list[str] | None = None
) -> subprocess.Popen[str]:
    command = [*(wrap or []), sys.executable, "-m", "flare", "serve", "llama:r2", "--port", "0"]
    command += ["--device", "cpu", "--ranks", "2", "--rendezvous", address, "--timeout", TIMEOUT]
    return subprocess.Popen(
        command, env=flare_env(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def join(
    env: dict[str, str], home: Path, address: str, wrap: list[str] | None = None
) -> subprocess.Popen[str]:
    command = [*(wrap or []), sys.executable, "-m", "flare", "join", address, "--rank", "1"]
    command += ["--registry", str(home / "registry")]
    return subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)


def test_rendezvous_and_join_serve_across_two_homes(
    home: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    manifest, files = package(home, "llama:r1", tmp_path / "r1")
    one = load_runtime(manifest, files)
    assert isinstance(one, GenerateRuntime)
    one.start()
    want = "".join(
        d.text for d in one.submit([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=24))
    )
    one.stop()

    joiner_root = tmp_path_factory.mktemp("host-b")
    address = f"127.0.0.1:{free_port()}"
    zero = start_rank_zero(home, address)
    peer = join(other_host(joiner_root, home, trust=True), home, address)
    try:
        line = zero.stdout.readline() if zero.stdout else ""
        assert "http://" in line, zero.stderr.read() if zero.stderr else ""
        url = line[line.index("http://") :].split()[0]
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        got = client.completions.create(
            model="llama", prompt=[5, 6, 7, 8], max_tokens=24, temperature=0
        )
        assert got.choices[0].text == want
        r2 = package(home, "llama:r2", tmp_path / "r2")[0]
        cached = {p.name for p in (joiner_root / "packages").rglob("*") if p.is_file()}
        for payload in r2.payloads:
            assert (payload.digest.split(":")[1] in cached) == (1 in payload.ranks), payload.ranks
        drain_and_stop(zero, peer)
    finally:
        reap(zero, peer)


def test_rendezvous_and_join_across_two_network_namespaces(
    home: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Two "hosts" (network namespaces joined by a veth pair, as the build test makes them):
    rank zero serves at 10.213.0.1, the joiner pulls into its own FLARE_HOME; a client in
    rank zero's namespace is answered."""
    names = [f"flare{os.getpid()}sa", f"flare{os.getpid()}sb"]
    if not make_namespaces(names):
        pytest.skip("network namespaces and veth pairs are not available here")
    address = "10.213.0.1:29511"
    zero = start_rank_zero(home, address, wrap=["ip", "netns", "exec", names[0]])
    env = other_host(tmp_path_factory.mktemp("host-ns"), home, trust=True)
    peer = join(env, home, address, wrap=["ip", "netns", "exec", names[1]])
    try:
        line = zero.stdout.readline() if zero.stdout else ""
        assert "http://" in line, zero.stderr.read() if zero.stderr else ""
        url = line[line.index("http://") :].split()[0]
        body = '{"model": "llama", "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0}'
        ask = ["ip", "netns", "exec", names[0], "curl", "-sf", f"{url}/completions"]
        answer = subprocess.run(
            [*ask, "-H", "content-type: application/json", "-d", body],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert answer.returncode == 0 and '"completion_tokens":8' in answer.stdout, answer
        drain_and_stop(zero, peer)
    finally:
        reap(zero, peer)
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_a_joining_host_that_refuses_the_package_stops_every_rank(
    home: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The joining host trusts no one: its admission refuses the signature, and rank zero
    stops with that rank's reason."""
    address = f"127.0.0.1:{free_port()}"
    zero = start_rank_zero(home, address)
    peer = join(other_host(tmp_path_factory.mktemp("host-c"), home, trust=False), home, address)
    try:
        _, zero_err = zero.communicate(timeout=60)
        _, peer_err = peer.communicate(timeout=60)
    finally:
        for process in (zero, peer):
            if process.poll() is None:
                process.kill()
                process.communicate()
    assert peer.returncode not in (0, EXIT_RANK), peer_err
    assert zero.returncode == EXIT_RANK, zero_err
    assert "the server stopped: rank 1: refused the package" in zero_err
    assert "which this host does not trust" in zero_err and "flare trust add alice" in zero_err
    assert "which this host does not trust" in peer_err


def test_sigterm_on_rank_zero_drains_then_stops_every_rank_with_exit_0(server: Server) -> None:
    (rank1,) = server.ranks()
    chunks: list[str] = []
    finish: list[str | None] = []
    first = threading.Event()

    def ask() -> None:
        stream = server.client().completions.create(
            model="llama", prompt="the registry", max_tokens=120, temperature=0, stream=True
        )
        for chunk in stream:
            chunks.append(chunk.choices[0].text)
            finish.append(chunk.choices[0].finish_reason)
            first.set()

    asking = threading.Thread(target=ask)
    asking.start()
    assert first.wait(30)
    server.process.send_signal(signal.SIGTERM)
    asking.join(60)
    _, stderr = server.process.communicate(timeout=60)
    assert server.process.returncode == 0, stderr
    assert finish[-1] == "length" and len(chunks) > 1
    deadline = time.monotonic() + 10
    while alive(rank1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(rank1)


def drain_and_stop(zero: subprocess.Popen[str], peer: subprocess.Popen[str]) -> None:
    """SIGTERM on rank zero drains and stops the group: both processes exit 0."""
    zero.send_signal(signal.SIGTERM)
    assert zero.wait(60) == 0
    assert peer.wait(30) == 0


def reap(*processes: subprocess.Popen[str]) -> None:
    """Kill what is still running and collect its output, whatever the test did."""
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.communicate()
