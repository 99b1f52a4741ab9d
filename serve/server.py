"""Run the API with uvicorn: say the URL once listening, drain on SIGINT/SIGTERM, exit 0.

Readiness is the socket, not the import: /health answers 200 only after the runtime is
loaded and the server listens, and 503 again once a shutdown has begun. The shutdown drains
first, the socket still open (serve/drain.py): the admitted requests finish while new ones are
answered 503; then uvicorn closes the socket and the connections, and the engine stops.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

import uvicorn
from fastapi import FastAPI

from flare.errors import FlareError
from flare.serve.heap import freeze_heap
from flare.serve.http_head import limited_head
from flare.serve.runtime import Runtime

DRAIN_TIMEOUT_S = 60
"""How long in-flight requests may take to finish after a stop signal; past it, uvicorn
cancels them as it closes the connections."""


class _Server(uvicorn.Server):
    """uvicorn's server, with readiness, a ready callback and a clean exit on a signal."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, on_ready: Callable[[str], None]):
        super().__init__(config)
        self.app = app
        self.on_ready = on_ready

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.app.state.ready = True
            self.on_ready(url_of(self.servers[0].sockets[0]))

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Drain, then uvicorn's shutdown, within DRAIN_TIMEOUT_S together (a second signal
        cuts both short)."""
        started = time.monotonic()
        await self.app.state.drain.settle(DRAIN_TIMEOUT_S, lambda: self.force_exit)
        self.app.state.ready = False
        left = DRAIN_TIMEOUT_S - (time.monotonic() - started)
        self.config.timeout_graceful_shutdown = max(0.0, left)
        await super().shutdown(sockets)

    def stop_soon(self) -> None:
        """From any thread: begin the graceful shutdown a stop signal begins (uvicorn's main
        loop looks at should_exit every tenth of a second)."""
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Begin a graceful shutdown; unlike uvicorn, do not re-raise the signal afterwards,
        so a drained server exits 0."""
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True


def url_of(sock: socket.socket) -> str:
    """The API's base URL on a bound socket."""
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


def listen(host: str, port: int) -> socket.socket:
    """Bind the server's socket and listen on it up front, so a taken port fails at once with
    flare's error (before a model is loaded) rather than in uvicorn's log. Listening is what
    holds the port: with SO_REUSEADDR, two sockets that only bound it may both bind it, and
    two servers started at once both passed this check."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        raise FlareError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}",
            "pick another --port or --host, or stop what holds it",
        ) from exc
    return sock


def _config(app: FastAPI) -> uvicorn.Config:
    """uvicorn with its C HTTP parser and uvloop (not h11 and asyncio's loop, its fallbacks):
    each streamed token is an event the loop writes, under the GIL the engine thread needs
    too, so the loop's cost per event counts against every stream's tokens a second. The
    parser's protocol holds each request's head to a size and a time (serve/http_head.py)."""
    return uvicorn.Config(
        app,
        http=limited_head(app.state.limits.timeout_s),
        loop="uvloop",
        log_level="warning",
        timeout_graceful_shutdown=DRAIN_TIMEOUT_S,
        lifespan="off",
    )


def run_server(
    app: FastAPI, runtime: Runtime, sock: socket.socket, on_ready: Callable[[str], None]
) -> None:
    """Serve on a bound socket until a stop signal, then finish in-flight requests and stop
    the engine. A runtime that can serve no more (its engine process died) stops the server
    as a signal would, and the server then fails with its cause (exit 1), for a supervisor
    to start it again."""
    server = _Server(_config(app), app, on_ready)
    runtime.on_lost = server.stop_soon
    runtime.start()
    freeze_heap()
    try:
        server.run(sockets=[sock])
    finally:
        runtime.stop(drain=True)
    if runtime.failure is not None:
        raise FlareError(f"the server stopped: {runtime.failure}", "start it again")


@contextmanager
def background_server(app: FastAPI, runtime: Runtime, host: str = "127.0.0.1") -> Iterator[str]:
    """Serve on a free port from a thread for the length of the block (the demo's server);
    yields the base URL once it listens, then drains and stops."""
    ready = threading.Event()
    urls: list[str] = []

    def on_ready(url: str) -> None:
        urls.append(url)
        ready.set()

    server = _Server(_config(app), app, on_ready)
    sock = listen(host, 0)
    runtime.start()
    thread = threading.Thread(target=server.run, args=([sock],), name="flare-api", daemon=True)
    thread.start()
    try:
        while not ready.wait(0.05):
            if not thread.is_alive():
                raise RuntimeError("the API server stopped before it listened")
        yield urls[0]
    finally:
        server.should_exit = True
        thread.join()
        runtime.stop(drain=True)
