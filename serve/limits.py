"""Limits on what a client may send: how big a request body may be, and how long it may take
to arrive.

A small ASGI middleware in front of the whole app. It reads each request's body itself, as it
arrives, counting the bytes, and hands the app the body only when it is whole and within the
limit (the app would read it whole anyway before parsing its JSON). So the middleware, not the
framework, decides and answers:

- a body over the limit gets 413 with an OpenAI error body. A `Content-Length` over the limit
  is refused before a byte is kept; past the limit nothing more is kept (a chunked body is
  counted as it comes). The rest of the body is still read and thrown away, up to as much
  again as the limit and within the time limit, before answering: a server that answers and
  closes while the client is still sending resets the connection, and the client may never
  see the 413. A client that sent `Expect: 100-continue` has sent nothing yet and is answered
  at once.
- a body that has not arrived whole within the time limit (a client trickling it a byte at a
  time, or stalled) gets 408.

Both answers close the connection, so a refused client holds nothing after it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from flare.serve.errors import ApiError

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
"""4 MiB: a request filling a 128k-token context takes about 0.9 MB as token ids, 0.5 MB as
English text, and text JSON-escaped at 12 bytes a token still fits; docs/config.md says more.
The same as the serve.max_body_size setting's default, for apps made without the config."""
DEFAULT_BODY_TIMEOUT_S = 30.0
"""A whole 4 MiB body arrives in 30 s at 1.1 Mbit/s; serve.body_timeout's default too."""


@dataclass(frozen=True)
class BodyLimits:
    """The largest request body taken, in bytes, and the seconds it may take to arrive."""

    max_bytes: int = DEFAULT_MAX_BODY_BYTES
    timeout_s: float = DEFAULT_BODY_TIMEOUT_S


class _Disconnected(Exception):
    """The client went away before its body was whole: there is nobody to answer."""


class LimitBodies:
    """ASGI middleware enforcing `BodyLimits` on every HTTP request."""

    def __init__(self, app: App, limits: BodyLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = await self._body(scope, receive, send)
        if body is not None:
            await self.app(scope, _replay(body, receive), send)

    async def _body(
        self, scope: MutableMapping[str, Any], receive: Receive, send: Send
    ) -> bytes | None:
        """The request's whole body, or None when it was refused (answered here) or the
        client went away."""
        too_big = _content_length(scope) > self.limits.max_bytes
        if too_big and _expects_continue(scope):
            await self._refuse_size(scope, send)
            return None
        try:
            body = await self._read(receive, keep=not too_big)
        except _Disconnected:
            return None
        except TimeoutError:
            await self._refuse_time(scope, send)
            return None
        if body is None:
            await self._refuse_size(scope, send)
        return body

    async def _read(self, receive: Receive, keep: bool) -> bytes | None:
        """The whole body, or None when it is over the limit (it is then read on, to its end
        or to twice the limit, and thrown away); raises TimeoutError past the time limit,
        unless the body is already known to be too big, when it stops reading and returns
        None."""
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.limits.timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise _Disconnected
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    keep = keep and size <= self.limits.max_bytes
                    if keep:
                        chunks.append(chunk)
                    else:
                        chunks.clear()
                    if not message.get("more_body", False) or size > 2 * self.limits.max_bytes:
                        break
        except TimeoutError:
            if keep:
                raise
        return b"".join(chunks) if keep else None

    async def _refuse_size(self, scope: MutableMapping[str, Any], send: Send) -> None:
        await self._refuse(
            scope,
            send,
            413,
            f"the request body is over this server's limit of {self.limits.max_bytes} bytes; "
            "send a smaller request (the server's serve.max_body_size sets the limit)",
            "request_too_large",
        )

    async def _refuse_time(self, scope: MutableMapping[str, Any], send: Send) -> None:
        await self._refuse(
            scope,
            send,
            408,
            f"the request body did not arrive within {self.limits.timeout_s:g} s; "
            "send it whole, at once",
            "request_timeout",
        )

    @staticmethod
    async def _refuse(
        scope: MutableMapping[str, Any],
        send: Send,
        status: int,
        message: str,
        code: str | None = None,
    ) -> None:
        response = ApiError(status, message, code=code).response({"connection": "close"})
        await response(scope, _nothing_more, send)


def _content_length(scope: MutableMapping[str, Any]) -> int:
    """The declared body size; 0 when none is declared (the HTTP server refuses one that is
    not a number; if one came through, counting the bytes still holds the limit)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0


def _expects_continue(scope: MutableMapping[str, Any]) -> bool:
    return any(
        name == b"expect" and value.lower() == b"100-continue" for name, value in scope["headers"]
    )


def _replay(body: bytes, receive: Receive) -> Receive:
    """The app's `receive`: the whole body once, then the client's own messages (a
    disconnect, which a streaming response listens for)."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def _nothing_more() -> Message:
    return {"type": "http.disconnect"}
