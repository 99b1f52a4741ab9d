"""The OpenAI error body every refusal and failure of the HTTP API carries.

One shape for all of them (`{"error": {"message", "type", "param", "code"}}`), whether the
route, the request validation or the body-limits middleware refuses, or the server fails, so
a client parses one thing. The body is written with every non-ASCII character escaped: a
message that quotes what the client sent (a lone surrogate, say) can never make the error
itself fail to encode.

An exception that nothing else answered (a fault in the server's own code for one request) is
caught by `AnswerFaults`, around the whole app: its traceback is logged once, here, and the
client gets a 500 with the same body; uvicorn does not see it, so does not log it again. A
stream whose 200 has gone out ends with the error as its last event instead (serve/api.py).
Cancellation (a server stopping without waiting for its requests) is not an exception of this
kind: it ends the request with one line logged rather than uvicorn's traceback for each.
"""

from __future__ import annotations

import asyncio
import json
import logging

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An OpenAI-style error: a status, a one-line message, its type, and the request field it
    concerns (`param`, dotted: `messages.0.content`) when there is one; `headers` go with it
    (`Retry-After`)."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        message = _clipped(message)
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }

    def event(self) -> str:
        """The error as a server-sent event, to end a stream whose status has gone out."""
        return f"data: {self.text()}\n\n"

    def text(self) -> str:
        return json.dumps(self.body(), separators=(",", ":"))

    def response(self, headers: dict[str, str] | None = None) -> Response:
        every = self.headers | (headers or {})
        return Response(self.text().encode(), self.status, every, media_type="application/json")


MESSAGE_MAX_CHARS = 1000
"""The longest message an error carries: one that quotes what the client sent (a model name of
megabytes, an integer of thousands of digits) is cut in its middle, its end (what to do) kept."""


def _clipped(message: str) -> str:
    if len(message) <= MESSAGE_MAX_CHARS:
        return message
    half = MESSAGE_MAX_CHARS // 2
    left_out = len(message) - 2 * half
    return f"{message[:half]} ... ({left_out} characters left out) ... {message[-half:]}"


def internal_error(exc: Exception, where: str) -> ApiError:
    """A fault of the server's own in `where` (a request's method and path, a stream's id):
    logged here with its traceback, once; answered as a 500 naming the exception."""
    problem = " ".join(f"{type(exc).__name__}: {exc}".split())
    log.error("%s failed: %s", where, problem, exc_info=exc)
    return ApiError(500, f"internal error: {problem}", "server_error")


class AnswerFaults:
    """ASGI middleware: a request whose handling raised gets a 500 with an OpenAI error body
    (when nothing of its response was sent yet; else its connection is closed)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            error = internal_error(exc, f"{scope['method']} {scope['path']}")
            if not started:
                await error.response()(scope, receive, send)
        except asyncio.CancelledError:
            # uvicorn cancels a request only when it stops without waiting (a second stop
            # signal, or the drain's time up), and would log a traceback for each: one line
            where = f"{scope['method']} {scope['path']}"
            log.warning("%s cut short: the server stopped at once", where)
