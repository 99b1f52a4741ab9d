"""The API's OpenAPI document, served at /openapi.json.

FastAPI writes it from the routes and the request models (serve/schemas.py); this makes it
say what this server does rather than what FastAPI does by default: a request that does not
validate gets 400 with an OpenAI error body (not FastAPI's 422 and its own body), `model` is
the one package served, a streamed generation's events are described, and the `/v1/` routes
want the bearer key when one is set.

Events: OpenAPI 3.1 has no keyword for the items of a stream (3.2 adds `itemSchema`, which a
3.1 document may not hold), so the `text/event-stream` schema describes one event, as
schemathesis reads it: its `data` is a JSON chunk, an OpenAI error body (a request the server
fails mid-stream, after the 200 went out), or `[DONE]` at the end.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

REQUESTS_NAMING_THE_MODEL = ("CompletionRequest", "ChatRequest", "EmbeddingRequest")
FASTAPI_VALIDATION_SCHEMAS = ("HTTPValidationError", "ValidationError")
REFS = "#/components/schemas/{model}"


def event_stream(chunk: type[BaseModel]) -> dict[str, Any]:
    """The `text/event-stream` content of a route that streams `chunk`s (add `chunk` to the
    document's models)."""
    json_data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {
            "anyOf": [{"$ref": REFS.format(model=m)} for m in (chunk.__name__, "ErrorResponse")]
        },
    }
    data = {"anyOf": [json_data, {"const": "[DONE]"}]}
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    return {"text/event-stream": {"schema": event}}


def openapi_document(
    app: FastAPI, model: str, with_key: bool, models: tuple[type[BaseModel], ...] = ()
) -> dict[str, Any]:
    """The document for `app` serving `model`; `with_key` when the /v1/ routes need one;
    `models`: schemas the routes refer to that FastAPI does not see (event chunks)."""
    document = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for extra in models:
        schema = extra.model_json_schema(ref_template=REFS)
        schemas |= schema.pop("$defs", {}) | {extra.__name__: schema}
    for name in FASTAPI_VALIDATION_SCHEMAS:
        schemas.pop(name, None)
    for name in REQUESTS_NAMING_THE_MODEL:
        if name in schemas:
            schemas[name]["properties"]["model"] = {
                "type": "string",
                "enum": [model],
                "title": "Model",
                "description": "the name of the package this server runs (GET /v1/models)",
            }
    for path, operations in document["paths"].items():
        for operation in operations.values():
            operation["responses"].pop("422", None)
            if with_key and path.startswith("/v1/"):
                operation["security"] = [{"bearer": []}]
    if with_key:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return document
