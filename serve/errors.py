"""The OpenAI error body every refusal of the HTTP API carries.

One shape for all of them (`{"error": {"message", "type", "param", "code"}}`), whether the
route, the request validation or the body-limits middleware refuses, so a client parses one
thing. The body is written with every non-ASCII character escaped: a message that quotes what
the client sent (a lone surrogate, say) can never make the error itself fail to encode.
"""

from __future__ import annotations

import json

from starlette.responses import Response


class ApiError(Exception):
    """An OpenAI-style error: a status, a one-line message, its type, and the request field it
    concerns (`param`, dotted: `messages.0.content`) when there is one."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.param, self.code = param, code

    def body(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, headers: dict[str, str] | None = None) -> Response:
        content = json.dumps(self.body(), separators=(",", ":")).encode()
        return Response(content, self.status, headers, media_type="application/json")
