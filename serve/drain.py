"""The drain: what the server does between a stop signal and its exit.

A stopped server should leave no client guessing. So on SIGTERM (or SIGINT) the server keeps
its socket open while the `/v1/` requests it admitted finish, streams included; meanwhile
`/health` answers 503 `{"status": "draining"}` (a load balancer takes the server out) and a
new `/v1/` request gets 503 with an OpenAI error body and `Retry-After`, which clients that
retry (the `openai` client does) honour, reaching another server or this one's successor.
Only then does the server close its socket and connections, stop the engine and exit 0.

A request is admitted once its body is whole (the body limits run first), so one still
arriving when the drain begins is refused when it has arrived, not cut off.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from flare.serve.errors import ApiError

RETRY_AFTER_S = 5
"""What a refused client is told to wait: long enough for a balancer to notice /health."""
POLL_S = 0.05


class Drain:
    """Whether the drain has begun, and the admitted `/v1/` requests still in flight (both
    touched on the event loop only)."""

    def __init__(self) -> None:
        self.begun = False
        self.in_flight = 0

    async def settle(self, timeout_s: float, give_up: Callable[[], bool]) -> None:
        """Begin, and wait until no admitted request is left, `timeout_s` at most, or until
        `give_up()` (a second signal)."""
        self.begun = True
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline and not give_up():
            await asyncio.sleep(POLL_S)


def refusal(failure: str | None = None) -> ApiError:
    """What a request the server will not start now is answered: to come again, unless the
    server stops because its engine failed (`failure`), which a retry here cannot mend."""
    if failure is not None:
        return ApiError(
            503,
            f"the server's engine failed ({failure}); it is stopping",
            "server_error",
            code="engine_failed",
        )
    return ApiError(
        503,
        "the server is shutting down; send the request again",
        "server_error",
        code="service_unavailable",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


class AdmitRequests:
    """ASGI middleware: counts the `/v1/` requests in flight; once the drain has begun,
    refuses new ones."""

    def __init__(
        self, app: ASGIApp, drain: Drain, failure: Callable[[], str | None] = lambda: None
    ) -> None:
        self.app = app
        self.drain = drain
        self.failure = failure
        """Why the engine failed, if it did (the runtime's `failure`)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        if self.drain.begun:
            await refusal(self.failure()).response()(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1
