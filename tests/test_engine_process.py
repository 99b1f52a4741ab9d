"""`flare serve` runs a generating package's engine in a process of its own
(serve/engine_process.py). What a user relies on across that boundary:

- A terminal's Ctrl-C reaches every process of the group, the engine's too: the engine
  ignores it, the streams in flight end whole, and the server exits 0.
- An engine process that dies (killed, out of memory) fails the requests in flight at once
  with the cause, /health stops answering ok, and the server stops by itself with exit 1 and
  the cause in one line, for a supervisor to start it again.
- A load error raised in the engine process reaches the user as the one-line flare error it
  was, with its exit code (tests/test_load_verify.py: a rotten weight blob, found and
  quarantined by the engine process, exits 6 with the blob named).
- The runtime's figures (/metrics) are the engine's own, read across the boundary.
- An engine process that hangs (frozen here by SIGSTOP) is reported: /health answers 503
  `stalled` past the stall timeout, and fast, however many requests wait for the engine; the
  requests in flight are not failed, and /health answers ok again once it goes on.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from helpers import child_processes, spawned_children
from test_serve import Server, build_home, flare_env
from test_serve_faults import start_streams

STREAM_TOKENS = 480


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_home(tmp_path_factory.mktemp("engine-process"))


def engine_pid(server: Server) -> int:
    """The server's engine process: its child that multiprocessing spawned (the other one is
    multiprocessing's resource tracker)."""
    engines = spawned_children(server.process.pid)
    assert len(engines) == 1, child_processes(server.process.pid)
    return engines[0]


def test_ctrl_c_to_the_whole_group_finishes_the_streams_and_exits_0(home: Path) -> None:
    server = Server(flare_env(home), "tiny", "--kv-cache-tokens", "512", session=True)
    engine = engine_pid(server)
    threads, streams = start_streams(server, 2)
    os.killpg(server.process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    for thread in threads:
        thread.join(timeout=120)
    _, stderr = server.process.communicate(timeout=60)
    assert server.process.returncode == 0, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    assert not Path(f"/proc/{engine}").exists() or _zombie(engine)
    assert len(streams) == 2
    for stream in streams:
        assert not isinstance(stream, Exception), stream
        status, events = stream
        assert status == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == STREAM_TOKENS


def _zombie(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")


def test_a_killed_engine_fails_the_streams_in_flight_and_stops_the_server_with_exit_1(
    home: Path,
) -> None:
    server = Server(flare_env(home), "tiny", "--kv-cache-tokens", "512")
    threads, streams = start_streams(server, 2)
    killed = time.monotonic()
    os.kill(engine_pid(server), signal.SIGKILL)
    health = wait_not_ok(server.root)
    late = ask_once(server)  # a request after the engine died: not told to come again
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive(), "a stream outlived its engine"
    _, stderr = server.process.communicate(timeout=60)

    cause = "the engine process was killed by SIGKILL"
    assert time.monotonic() - killed < 30
    assert server.process.returncode == 1, stderr
    assert f"error: the server stopped: {cause}; start it again" in stderr
    assert "Traceback" not in stderr
    if health is not None:  # else the server had stopped listening before the first look
        assert health.status_code == 503
        assert health.json() in ({"status": "failed", "error": cause}, {"status": "draining"})
    for stream in streams:
        assert not isinstance(stream, Exception), stream
        status, events = stream
        assert status == 200 and events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert cause in error["message"] and error["type"] == "server_error", error
    if late is not None:  # else the server had stopped listening before it was asked
        assert late.status_code == 503 and "retry-after" not in late.headers, late.text
        error = late.json()["error"]
        assert error["code"] == "engine_failed" and cause in error["message"], error


def ask_once(server: Server) -> httpx.Response | None:
    """One small completion; None if the server no longer listens."""
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    try:
        return httpx.post(f"{server.url}/completions", json=body, timeout=30)
    except httpx.TransportError:
        return None


def wait_not_ok(root: str) -> httpx.Response | None:
    """/health's first answer that is not 200; None if the server closed its socket first."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            health = httpx.get(f"{root}/health", timeout=10)
        except httpx.ConnectError:
            return None
        if health.status_code != 200:
            return health
        time.sleep(0.01)
    raise AssertionError("/health never stopped saying ok")


def test_metrics_are_the_engines_own_figures(home: Path) -> None:
    server = Server(flare_env(home), "tiny")
    try:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 7, "temperature": 0}
        body["ignore_eos"] = True
        reply = httpx.post(f"{server.url}/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert server.metric("flare_generated_tokens_total") == 7
        assert server.metric("flare_requests_finished_total") == 1
        assert server.metric("flare_kv_blocks_used") == 0
        steps = server.metric("flare_steps_total")
        in_steps = server.metric("flare_step_seconds_total")
        waiting = server.metric("flare_device_wait_seconds_total")
        assert steps >= 7 and in_steps > 0 and 0 <= waiting <= in_steps
    finally:
        assert server.stop()[0] == 0


def health_of(root: str) -> httpx.Response:
    """/health, which must answer within 2 s whatever the engine does."""
    started = time.monotonic()
    health = httpx.get(f"{root}/health", timeout=10)
    assert time.monotonic() - started < 2, "/health waited on the engine"
    return health


def wait_health(root: str, status: str, within: float) -> httpx.Response:
    """/health's first answer whose status is `status`."""
    deadline = time.monotonic() + within
    while (health := health_of(root)).json()["status"] != status:
        assert time.monotonic() < deadline, f"/health never said {status}: {health.text}"
        time.sleep(0.1)
    return health


def post_long_prompts(url: str, count: int) -> threading.Thread:
    """`count` requests of 500-token prompts at once, on a thread: about 1 KB each to the
    engine process, more in all than the pipe to a frozen one holds (212 KB here), so that an
    API that wrote to it itself would block its event loop, /health with it."""
    body = {"model": "tiny", "prompt": [10 + i % 240 for i in range(500)], "max_tokens": 1}

    async def post_all() -> None:
        limits = httpx.Limits(max_connections=count)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            posts = [client.post(f"{url}/completions", json=body) for _ in range(count)]
            await asyncio.gather(*posts, return_exceptions=True)

    thread = threading.Thread(target=asyncio.run, args=(post_all(),))
    thread.start()
    return thread


def test_a_frozen_engine_is_reported_stalled_then_ok_and_its_streams_end_whole(
    home: Path,
) -> None:
    server = Server(flare_env(home), "tiny", "--kv-cache-tokens", "4096", "--stall-timeout", "2s")
    engine = engine_pid(server)
    try:
        threads, streams = start_streams(server, 2)
        os.kill(engine, signal.SIGSTOP)
        try:
            threads.append(post_long_prompts(server.url, 400))
            stalled = wait_health(server.root, "stalled", within=30)
            assert stalled.status_code == 503
            assert stalled.json()["error"].startswith("the engine process has not answered for")
            assert health_of(server.root).json()["status"] == "stalled"
            scraped = time.monotonic()
            assert server.metric("flare_engine_stalled_seconds") >= 2
            assert time.monotonic() - scraped < 1, "/metrics waited on a frozen engine"
            time.sleep(1.5)  # the figures go on growing while it stays frozen
            assert server.metric("flare_engine_stalled_seconds") >= 3.5
        finally:
            os.kill(engine, signal.SIGCONT)
        assert wait_health(server.root, "ok", within=30).status_code == 200
        assert server.metric("flare_engine_stalled_seconds") == 0
        for thread in threads:
            thread.join(timeout=120)
    finally:
        code, stderr = server.stop()
    assert code == 0, stderr
    assert "the engine process has not answered for" in stderr and "/health answers 503" in stderr
    assert "the engine goes on after a stall" in stderr
    for stream in streams:
        assert not isinstance(stream, Exception), stream
        status, events = stream
        assert status == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == STREAM_TOKENS


def processes_of(home: Path) -> list[int]:
    """Every live process started with this FLARE_HOME (a server, its engine process)."""
    marker = f"FLARE_HOME={home}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().split(") ")[1]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if marker in environ and not state.startswith("Z"):
            found.append(int(entry.name))
    return found


def test_an_embedding_package_is_served_without_an_engine_process(home: Path) -> None:
    server = Server(flare_env(home), "minilm")
    try:
        spawned = spawned_children(server.process.pid)
        assert spawned == [], "the engine process started early was not let go"
        body = {"model": "minilm", "input": ["blobs are named by their digest"]}
        assert httpx.post(f"{server.url}/embeddings", json=body, timeout=60).status_code == 200
    finally:
        assert server.stop()[0] == 0


def serve_refused(home: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`flare serve ARGS` run to its end, which a refused serve reaches within `timeout`
    (else subprocess.TimeoutExpired fails the test)."""
    return subprocess.run(
        [sys.executable, "-m", "flare", "serve", *args],
        env=flare_env(home),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_serve_that_fails_before_loading_leaves_no_process_behind(home: Path) -> None:
    done = serve_refused(home, "no-such-package", "--port", "0")
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr
    assert processes_of(home) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA device")
def test_a_device_the_host_lacks_is_named_once_and_leaves_no_process_behind(home: Path) -> None:
    """The engine process prepares the device `--device` asks for before it is told what to
    load; one this host lacks is left for the API process to refuse, in one line."""
    done = serve_refused(home, "tiny", "--port", "0", "--device", "cuda")
    assert done.returncode == 12, done.stderr
    assert "no usable CUDA device" in done.stderr
    assert "Traceback" not in done.stderr
    assert processes_of(home) == []


def test_a_serve_refused_by_its_options_kills_the_engine_started_early(home: Path) -> None:
    """`flare serve` starts its engine process before the CLI parses anything; a command
    the CLI refuses exits at once with the usage error, the engine (which ignores SIGTERM)
    killed rather than waited for (waited for, it would never end: the timeout fails it)."""
    done = serve_refused(home, "tiny", "--no-such-option", timeout=60)
    assert done.returncode == 2, done.stderr
    assert "No such option" in done.stderr
    assert processes_of(home) == []


def test_the_engine_started_early_is_taken_for_its_device_only() -> None:
    """`start_early` reads `--device` as the CLI will (after the root's --debug, in either
    form) and starts nothing for other commands or for --help; `engine_for` takes the early
    engine where the device matches, else ends it and starts one for the device asked."""
    from flare.serve import engine_process as ep

    for argv in (["build", "serve"], ["serve", "tiny", "--help"], ["pull", "serve"]):
        ep.start_early(argv)
        assert ep._EARLY == [], argv
    ep.start_early(["--debug", "serve", "tiny", "--device=cpu", "--port", "0"])
    early = ep._EARLY[0]
    taken = ep.engine_for("cpu")
    assert taken is early and taken.device == "cpu" and ep._EARLY == []
    taken.close()
    ep.start_early(["serve", "tiny", "--device", "cpu"])
    other = ep._EARLY[0]
    fresh = ep.engine_for(None)
    try:
        assert fresh is not other and fresh.device is None and ep._EARLY == []
        other.process.join(timeout=30)
        assert not other.process.is_alive()
    finally:
        fresh.close()
