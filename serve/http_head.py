"""Limits on a request's head (its request line and headers): how big, and how long to arrive.

The body's limits are an ASGI middleware (serve/limits.py), but the head is parsed before any
ASGI app sees the request, by uvicorn's protocol with httptools, which sets neither limit: a
client could send a header of hundreds of MB (httptools gathers a header's value whole
before handing it on, so the event loop of every stream stalls as it grows), or keep a
connection open for ever by sending a head a line at a time, or nothing at all.

`LimitedHead` is uvicorn's httptools protocol with both limits, as nginx and Apache have:
once a head passes `HEAD_MAX_BYTES` it is answered 431, and once it has taken the server's
time limit for a request's parts (`serve.body_timeout`, which the body then has again) since
its first byte (for a new connection, since it was made) 408; either answer closes the
connection, with the OpenAI error body of every refusal. The close lingers, as nginx's does:
the answer is followed by the end of what the server sends, and what the client still sends
is read and dropped for a moment, so that a client still writing its head gets the answer
rather than a reset that would discard it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from flare.serve.errors import ApiError
from flare.serve.limits import DEFAULT_BODY_TIMEOUT_S

LINGER_S = 2.0
"""How long a refused connection is held, reading and dropping, before it is closed."""
LINGER_MAX_BYTES = 1024 * 1024
"""The most a refused connection reads and drops before it is closed."""
HEAD_MAX_BYTES = 64 * 1024
"""64 KiB for the request line and every header together: four times what Node and uvicorn's
h11 take by default, room for long cookies and tokens. Counted up to the head's end (its blank
line) in the read that carries it, before the parser sees that read."""


def limited_head(timeout_s: float) -> type[LimitedHead]:
    """The protocol class for a server whose heads must arrive within `timeout_s`."""
    return type("LimitedHead", (LimitedHead,), {"timeout_s": timeout_s})


class LimitedHead(HttpToolsProtocol):
    """uvicorn's httptools protocol, with a size and a time limit on each request's head."""

    timeout_s: float = DEFAULT_BODY_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_open = True
        """Between requests or inside a head: the bytes that come are a head's."""
        self.head_bytes = 0
        self.head_timer: asyncio.TimerHandle | None = None
        self.lingered: int | None = None
        """Bytes read and dropped since the head was refused; None before."""
        self.linger_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_head_timer()  # a connection that sends nothing is held no longer

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        if self.linger_timer is not None:
            self.linger_timer.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.lingered is not None:
            self.lingered += len(data)
            if self.lingered > LINGER_MAX_BYTES:
                self.transport.close()
            return
        if self.head_open:
            end = data.find(b"\r\n\r\n")  # a read may carry the head's end, and a body
            self.head_bytes += len(data) if end < 0 else end + 4
            if self.head_bytes > HEAD_MAX_BYTES:  # refused before the parser gathers it
                message = (
                    f"the request's line and headers are over {HEAD_MAX_BYTES // 1024} KiB; "
                    "send smaller headers"
                )
                self._refuse(ApiError(431, message, code="headers_too_large"))
                return
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.head_timer is None:  # a request after another on the connection
            self._start_head_timer()

    def on_headers_complete(self) -> None:
        self.head_open = False
        self._stop_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.head_open, self.head_bytes = True, 0  # the next request's head, when it comes

    def _start_head_timer(self) -> None:
        """Between requests the timer waits for a head's first byte: an idle keep-alive
        connection is uvicorn's keep-alive timeout's to close, and a connection busy with a
        long answer may stay quiet."""
        self.head_timer = self.loop.call_later(self.timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timed_out(self) -> None:
        self.head_timer = None
        message = (
            f"the request's line and headers did not arrive within {self.timeout_s:g} s; "
            "send the whole request at once"
        )
        self._refuse(ApiError(408, message, code="request_timeout"))

    def _refuse(self, error: ApiError) -> None:
        """Answer `error`, end what the server sends, and close the connection once the
        client has closed its end, has sent LINGER_MAX_BYTES more, or LINGER_S has passed."""
        self._stop_head_timer()
        self.head_open = False
        if self.transport.is_closing():
            return
        body = error.text().encode()
        head = [
            STATUS_LINE[error.status],
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
        ]
        self.transport.write(b"".join(head) + body)
        self.lingered = 0
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.linger_timer = self.loop.call_later(LINGER_S, self.transport.close)
