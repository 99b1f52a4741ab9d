"""The OpenAI-compatible HTTP API over one loaded package (fastapi).

The routes translate; the runtime schedules. A request is validated whole (body size and
arrival time, body, model name, sampling values, prompt and max_tokens against the context)
before it reaches the engine, so bad input costs the running batch nothing. Request-sized work
(chat rendering, tokenizing, embedding) runs on worker threads, never on the event loop, so
/health and the streams of other requests are answered meanwhile. A client that goes away
mid-stream cancels its request, which frees its KV pages at the engine's next step.

Whatever fails answers with an OpenAI error body: a request the engine fails, a fault in this
module's own code for one request (serve/errors.py, `AnswerFaults`), a request that comes
while the server drains (serve/drain.py); a stream whose 200 went out ends with the error as
an event, then `[DONE]`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import secrets
import struct
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from flare import __version__
from flare.serve.drain import AdmitRequests, Drain, refusal
from flare.serve.errors import AnswerFaults, ApiError, internal_error
from flare.serve.limits import BodyLimits, LimitBodies
from flare.serve.metrics import render_metrics
from flare.serve.openapi import event_stream, openapi_document
from flare.serve.prompts import Prompts
from flare.serve.runtime import (
    Delta,
    EngineStopping,
    RequestFailed,
    RequestHandle,
    Runtime,
    SamplingParams,
)
from flare.serve.schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatRequest,
    Completion,
    CompletionChunk,
    CompletionRequest,
    EmbeddingList,
    EmbeddingRequest,
    ErrorResponse,
    Health,
    ModelEntry,
    ModelList,
    Sampling,
    VersionInfo,
)
from flare.store.package import versions

SAMPLING_RANGES = {
    "temperature": [0.0, 2.0],
    "top_p": [0.0, 1.0],
    "top_k": [-1, None],
    "max_tokens": [1, None],
}
"""What a request may ask for; the package's defaults are advertised beside them."""
DEFAULT_COMPLETION_TOKENS = 16
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "the request is not one this server takes"},
    401: {"model": ErrorResponse, "description": "missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "the model is not the one served here"},
    408: {"model": ErrorResponse, "description": "the body did not arrive in time"},
    413: {"model": ErrorResponse, "description": "the body is over the size limit"},
    415: {"model": ErrorResponse, "description": "the body was not sent as JSON"},
    500: {"model": ErrorResponse, "description": "the server failed this request"},
    503: {"model": ErrorResponse, "description": "the server is shutting down (Retry-After)"},
}
"""What every /v1/ route may answer besides its result."""


@dataclass(frozen=True)
class ServedPackage:
    """What the server says about the package it runs."""

    name: str
    digest: str
    publisher: str | None
    created: int


def _failed(exc: RequestFailed) -> ApiError:
    """A request the engine ended with an error: the server's fault, and this request's only."""
    return ApiError(500, str(exc), "server_error")


def _stream_failed(exc: Exception, stream: str) -> ApiError:
    """What ends a stream that failed: the engine's error (logged by the engine), or a fault
    of the server's own code (logged here, with its traceback)."""
    if isinstance(exc, RequestFailed):
        return _failed(exc)
    return internal_error(exc, f"stream {stream}")


def create_app(
    runtime: Runtime,
    package: ServedPackage,
    api_key: str | None = None,
    limits: BodyLimits | None = None,
) -> FastAPI:
    """The app for one runtime: health, metrics, version, models, completions, chat,
    embeddings, and its OpenAPI document (with Swagger UI at /docs). A request's body is held
    to `limits` (serve/limits.py), then the request is admitted unless the server drains
    (`app.state.drain`, serve/drain.py), then handled; a fault anywhere in that is answered
    (serve/errors.py)."""
    app = FastAPI(
        title="flare",
        version=__version__,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        redirect_slashes=False,  # a path with a trailing slash is not ours: 404, not 307
    )
    app.state.ready = False
    app.state.drain = Drain()
    app.add_middleware(AdmitRequests, drain=app.state.drain, failure=lambda: runtime.failure)
    app.state.limits = limits or BodyLimits()
    app.add_middleware(LimitBodies, limits=app.state.limits)
    app.add_middleware(AnswerFaults)  # the last added is the outermost: it sees every fault
    _add_error_handlers(app)
    routes = _Routes(runtime, package)
    unready = {
        "model": Health,
        "description": "starting, draining after a stop signal, stalled or failed",
    }
    health = {200: {"model": Health}, 503: unready}
    app.get("/health", response_model=None, responses=health)(routes.health)
    app.head("/health", include_in_schema=False)(routes.health)  # load balancers' probes
    text = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}}}
    app.get("/metrics", response_class=PlainTextResponse, responses=text)(routes.metrics)
    app.get("/version", response_model=None, responses={200: {"model": VersionInfo}})(
        routes.version
    )
    v1 = _V1(api_key)
    generates = runtime.kind == "generate"
    app.get("/v1/models", **v1.route(ModelList))(routes.models)
    app.get("/v1/models/{model_id:path}", **v1.route(ModelEntry))(routes.model)
    completions = v1.route(Completion, generates, CompletionChunk)
    app.post("/v1/completions", **completions)(routes.completions)
    chat = v1.route(ChatCompletion, generates, ChatCompletionChunk)
    app.post("/v1/chat/completions", **chat)(routes.chat)
    app.post("/v1/embeddings", **v1.route(EmbeddingList, not generates))(routes.embeddings)
    chunks = (CompletionChunk, ChatCompletionChunk) if generates else ()
    document = openapi_document(app, package.name, api_key is not None, chunks)
    app.get("/openapi.json", include_in_schema=False)(lambda: JSONResponse(document))
    app.get("/docs", include_in_schema=False)(lambda: _swagger_ui(package.name))
    return app


def _swagger_ui(name: str) -> HTMLResponse:
    """FastAPI's Swagger UI page on /openapi.json (the browser loads its script and style
    from jsDelivr, FastAPI's default: the server ships no copy of Swagger UI)."""
    return get_swagger_ui_html(openapi_url="/openapi.json", title=f"flare: {name}")


@dataclass(frozen=True)
class _V1:
    """How every /v1/ route is declared: behind the key, with its documented answers (the
    handlers build their bodies as dicts; the models document them, unchecked). A route the
    served model cannot answer (embeddings of a generating model) stays, to say so in a 400,
    but is left out of the OpenAPI document, which lists what this server does."""

    api_key: str | None

    def route(
        self, answer: type, serves: bool = True, chunk: type[BaseModel] | None = None
    ) -> dict[str, Any]:
        """`answer`: the body of a 200; `chunk`: the events of one with `stream: true`."""
        ok: dict[str, Any] = {"model": answer}
        if chunk is not None:
            ok["content"] = event_stream(chunk)
        return {
            "dependencies": [Depends(_bearer(self.api_key))],
            "response_model": None,
            "responses": ERRORS | {200: ok},
            "include_in_schema": serves,
        }


def _bearer(api_key: str | None):  # type: ignore[no-untyped-def]
    """A dependency that refuses requests without `Authorization: Bearer <api_key>`."""

    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        key_matches = secrets.compare_digest(given.strip().encode(), api_key.encode())
        if scheme.lower() != "bearer" or not key_matches:  # a scheme's name has no case
            raise ApiError(401, "missing or wrong API key", code="invalid_api_key")

    return check


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        param, message = _describe(exc)
        if message != EMPTY_BODY and not _sent_as_json(request):
            message = "send the request body as JSON, with Content-Type: application/json"
            return ApiError(415, message, code="unsupported_media_type").response()
        return ApiError(400, message, param=param).response()

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = str(exc.detail)
        if exc.status_code == 400 and message == UNPARSED_BODY:
            message = f"{NOT_JSON}: send it as UTF-8 text, not compressed or in another encoding"
        return ApiError(exc.status_code, message, kind).response(exc.headers)


UNPARSED_BODY = "There was an error parsing the body"
"""FastAPI's words for a body its JSON parser could not even read (bytes that are not UTF-8,
a compressed body, numbers or nesting past Python's limits)."""
NOT_JSON = "the request body is not valid JSON"
EMPTY_BODY = "the request body is empty: send a JSON object"


def _sent_as_json(request: Request) -> bool:
    """Whether the body came as JSON. One without a Content-Type is not parsed as JSON by
    FastAPI (0.13x on): it is told to say it is JSON, not that it is not an object."""
    given = request.headers.get("content-type", "")
    kind = given.split(";")[0].strip().lower()
    maintype, _, subtype = kind.partition("/")
    return maintype == "application" and (subtype == "json" or subtype.endswith("+json"))


def _describe(exc: RequestValidationError) -> tuple[str | None, str]:
    """The field and the first problem with a request body, as one line."""
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        return None, NOT_JSON
    if first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):
        return None, EMPTY_BODY
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
    return where or None, message


class _Routes:
    """Route handlers bound to one runtime and package."""

    def __init__(self, runtime: Runtime, package: ServedPackage) -> None:
        self.runtime = runtime
        self.package = package
        self.prompts = Prompts(runtime)
        self.versions = versions()
        self.build = {k: str(v) for k, v in self.versions.items()}
        self.build |= {"name": package.name, "digest": package.digest}
        """flare_build_info's labels."""

    async def health(self, request: Request) -> JSONResponse:
        if self.runtime.failure is not None:
            return JSONResponse({"status": "failed", "error": self.runtime.failure}, 503)
        if self.runtime.stall is not None:
            return JSONResponse({"status": "stalled", "error": self.runtime.stall}, 503)
        if request.app.state.drain.begun:
            return JSONResponse({"status": "draining"}, 503)
        ready = bool(request.app.state.ready)
        return JSONResponse({"status": "ok" if ready else "starting"}, 200 if ready else 503)

    def metrics(self) -> PlainTextResponse:
        """Run in a worker thread (a plain def): the figures are asked of the engine process,
        which may take a while to answer, and the event loop must not wait for it."""
        text, content_type = render_metrics(self.runtime, self.build)
        return PlainTextResponse(text, media_type=content_type)

    async def version(self) -> dict[str, Any]:
        package = {"name": self.package.name, "digest": self.package.digest}
        return self.versions | {"package": package}

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._model_entry()]}

    async def model(self, model_id: str) -> dict[str, Any]:
        """The official clients' `models.retrieve(id)`: the served model, else a 404."""
        if model_id != self.package.name:
            raise self._not_served(model_id)
        return self._model_entry()

    def _model_entry(self) -> dict[str, Any]:
        defaults = self.runtime.text.sampling_defaults
        return {
            "id": self.package.name,
            "object": "model",
            "created": self.package.created,
            "owned_by": self.package.publisher or "unsigned",
            "digest": self.package.digest,
            "context_length": self.runtime.context_length,
            "sampling": {"defaults": defaults, "ranges": SAMPLING_RANGES},
        }

    def _not_served(self, model: str) -> ApiError:
        return ApiError(
            404,
            f"model {model!r} is not served here; this server runs {self.package.name!r}",
            param="model",
            code="model_not_found",
        )

    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        self._check_model(body.model, "generate")
        ids = await asyncio.to_thread(self.prompts.completion_ids, body.prompt_value())
        params = self._params(body, ids, body.max_tokens or DEFAULT_COMPLETION_TOKENS, "prompt")
        params.logprobs = body.logprobs
        reply = _Reply("text_completion", self.package.name, self.runtime, len(ids))
        return await self._answer(body, reply, self._submit(ids, params), request)

    async def chat(self, body: ChatRequest, request: Request) -> Any:
        self._check_model(body.model, "generate")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        ids = await asyncio.to_thread(self.prompts.chat_ids, messages)
        params = self._params(body, ids, body.limit(), "messages")
        params.logprobs = (body.top_logprobs or 0) if body.logprobs else None
        reply = _Reply("chat.completion", self.package.name, self.runtime, len(ids))
        return await self._answer(body, reply, self._submit(ids, params), request)

    async def embeddings(self, body: EmbeddingRequest) -> dict[str, Any]:
        self._check_model(body.model, "embed")
        embedded = await asyncio.to_thread(self.runtime.embed, body.texts())
        data = [
            {"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
            for i, v in enumerate(embedded.vectors)
        ]
        tokens = sum(embedded.token_counts)  # as the model saw them: cut to the context
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return {"object": "list", "model": self.package.name, "data": data, "usage": usage}

    def _check_model(self, model: str, kind: str) -> None:
        if model != self.package.name:
            raise self._not_served(model)
        if self.runtime.kind != kind:
            route = "/v1/embeddings" if self.runtime.kind == "embed" else "/v1/completions or chat"
            raise ApiError(
                400,
                f"{model} is a {self.runtime.kind} model, which this route does not serve; "
                f"send it to {route}",
            )

    def _params(
        self, body: Sampling, ids: list[int], max_tokens: int | None, prompt: str
    ) -> SamplingParams:
        """The request's sampling, falling back to the package's advertised defaults; `prompt`
        names the field the prompt came in."""
        context = self.runtime.context_length
        if not ids:
            raise ApiError(400, "the prompt is empty", param=prompt)
        if len(ids) >= context:
            raise ApiError(
                400, f"the prompt is {len(ids)} tokens; the context is {context}", param=prompt
            )
        limit = max_tokens if max_tokens is not None else context - len(ids)
        if len(ids) + limit > context:
            raise ApiError(
                400,
                f"max_tokens {limit} + prompt {len(ids)} tokens exceed the context of "
                f"{context}; ask for at most {context - len(ids)}",
                param="max_tokens",
            )
        defaults = self.runtime.text.sampling_defaults
        return SamplingParams(
            max_tokens=limit,
            temperature=_pick(body.temperature, defaults.get("temperature"), 1.0),
            top_p=_pick(body.top_p, defaults.get("top_p"), 1.0),
            top_k=_pick(body.top_k, defaults.get("top_k"), -1),
            seed=body.seed,
            stop=body.stop_list(),
            ignore_eos=bool(body.ignore_eos),
        )

    def _submit(self, ids: list[int], params: SamplingParams) -> RequestHandle:
        try:
            return self.runtime.submit(ids, params)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc
        except EngineStopping as exc:
            raise refusal(self.runtime.failure) from exc

    async def _answer(
        self, body: Sampling, reply: _Reply, handle: RequestHandle, request: Request
    ) -> Any:
        """The reply: streamed (a client that leaves cancels the stream, and so its request),
        or whole, once generated; a client that leaves first cancels it too (499)."""
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(reply.stream(handle, usage), media_type="text/event-stream")
        try:
            if not await _unless_gone(_gather(reply, handle), request):
                return Response(status_code=CLIENT_GONE)
        except RequestFailed as exc:
            raise _failed(exc) from exc
        finally:
            handle.cancel()
        return reply.whole()


def _pick(asked: Any, default: Any, fallback: Any) -> Any:
    if asked is not None:
        return asked
    return default if default is not None else fallback


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


class _Reply:
    """One response being assembled, whole or as server-sent events."""

    def __init__(self, kind: str, model: str, runtime: Runtime, prompt_tokens: int) -> None:
        self.kind, self.model, self.runtime = kind, model, runtime
        self.id = f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.text: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self.finish_reason: str | None = None
        chunk = "chat.completion.chunk" if self.chat else "text_completion"
        self._head = f"data: {_json(self._envelope(chunk, []))[:-2]}"
        """A chunk event up to its choices (`...,"choices":[`): the same for every token."""

    @property
    def chat(self) -> bool:
        return self.kind == "chat.completion"

    def add(self, delta: Delta) -> None:
        self.completion_tokens += len(delta.token_ids)
        self.text.append(delta.text)
        self.logprobs += self._logprob_entries(delta)
        self.finish_reason = delta.finish_reason or self.finish_reason

    def usage(self) -> dict[str, int]:
        total = self.prompt_tokens + self.completion_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": total,
        }

    def whole(self) -> dict[str, Any]:
        text = "".join(self.text)
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
            choice["logprobs"] = {"content": self.logprobs} if self.logprobs else None
        else:
            choice["text"] = text
            choice["logprobs"] = _legacy_logprobs(self.logprobs) if self.logprobs else None
        return self._envelope(self.kind, [choice]) | {"usage": self.usage()}

    async def stream(self, handle: RequestHandle, with_usage: bool) -> AsyncIterator[str]:
        """Server-sent events; cancelling this generator (a client gone) cancels the request.
        A request that fails, in the engine or in this code, ends with an error event (the
        status was sent already) and `[DONE]`; cancellation is no failure and passes."""
        try:
            if self.chat:
                yield self._event(
                    [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "finish_reason": None,
                        }
                    ]
                )
            try:
                async for delta in handle.stream():
                    self.completion_tokens += len(delta.token_ids)
                    if delta.logprobs is not None:
                        yield self._event([self._chunk_choice(delta)])
                    elif delta.text or delta.finish_reason:  # not half a character
                        yield self._text_event(delta)
            except Exception as exc:
                yield _stream_failed(exc, self.id).event()
            else:
                if with_usage:
                    yield self._event([], usage=self.usage())
            yield "data: [DONE]\n\n"
        finally:
            handle.cancel()

    def _text_event(self, delta: Delta) -> str:
        """`_event([_chunk_choice(delta)])`, byte for byte, for a delta without logprobs (a
        streamed token's usual event) from the stream's fixed head: a token's event is the
        event loop's work a token a stream, and at 64 streams that loop bounds the server."""
        reason = "null" if delta.finish_reason is None else _json(delta.finish_reason)
        text = _json(delta.text)
        if self.chat:
            body = f'"delta":{{"content":{text}}}' if delta.text else '"delta":{}'
        else:
            body = f'"text":{text}'
        return f'{self._head}{{"index":0,"finish_reason":{reason},{body},"logprobs":null}}]}}\n\n'

    def _chunk_choice(self, delta: Delta) -> dict[str, Any]:
        entries = self._logprob_entries(delta)
        choice: dict[str, Any] = {"index": 0, "finish_reason": delta.finish_reason}
        if self.chat:
            choice["delta"] = {"content": delta.text} if delta.text else {}
            choice["logprobs"] = {"content": entries} if entries else None
        else:
            choice["text"] = delta.text
            choice["logprobs"] = _legacy_logprobs(entries) if entries else None
        return choice

    def _event(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return f"data: {_json(self._envelope(kind, choices) | extra)}\n\n"

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _logprob_entries(self, delta: Delta) -> list[dict[str, Any]]:
        """Chat-style entries: each chosen token, its logprob and the top alternatives."""
        if delta.logprobs is None:
            return []
        decode, raw = self.runtime.token_text, self.runtime.token_bytes
        return [
            {
                "token": decode(item.token_id),
                "logprob": item.logprob,
                "bytes": list(raw(item.token_id)),
                "top_logprobs": [
                    {"token": decode(t), "logprob": lp, "bytes": list(raw(t))} for t, lp in item.top
                ],
            }
            for item in delta.logprobs
        ]


CLIENT_GONE = 499
"""The status logged for a request whose client left before its answer (nginx's)."""


async def _gather(reply: _Reply, handle: RequestHandle) -> None:
    """A request's deltas into its whole reply."""
    async for delta in handle.stream():
        reply.add(delta)


async def _unless_gone(work: Coroutine[Any, Any, None], request: Request) -> bool:
    """Run `work` unless the client leaves first (then it is cancelled): whether it ran to
    its end. Generating for nobody would hold KV pages and a batch slot to max_tokens."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if task not in done:
        return False
    task.result()  # its failure, raised here
    return True


async def _client_gone(request: Request) -> None:
    """Return once the client has closed its connection (its body is read by then, so the
    next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _legacy_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The completions API's column layout of the same entries."""
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [_by_text(e["top_logprobs"]) for e in entries],
    }


def _by_text(tops: list[dict[str, Any]]) -> dict[str, float]:
    """Alternatives keyed by their text, as the completions API has them: tokens whose texts
    are alike (byte tokens that each decode to U+FFFD) keep the likeliest one's logprob, so the
    chosen token's stays (the last written, the least likely, used to win)."""
    best: dict[str, float] = {}
    for top in tops:
        best[top["token"]] = max(best.get(top["token"], -math.inf), top["logprob"])
    return best


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
