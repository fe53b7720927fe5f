"""The OpenAPI document, made to describe what the server really answers.

FastAPI documents a 422 that we never send (validation errors are 400 in OpenAI's shape) and
nothing of our 400/401/404/413/503; the 200 bodies of routes that return a `Response` are `{}`.
Routes declare their 200 bodies (`ok`, `streams`) and every operation gets the error bodies.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from phaseflip.server import protocol as p

ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": p.ErrorResponse, "description": "Invalid request (OpenAI's error shape)"},
    401: {"model": p.ErrorResponse, "description": "Missing or wrong API key (--api-key)"},
    404: {"model": p.ErrorResponse, "description": "Unknown model, request id or path"},
    405: {"model": p.ErrorResponse, "description": "Method not allowed (see `Allow`)"},
    413: {"model": p.ErrorResponse, "description": "Body over --max-request-bytes"},
    500: {"model": p.ErrorResponse, "description": "Internal error (a bug: report it)"},
    503: {"model": p.ErrorResponse,
          "description": "Loading, overloaded, unhealthy or shutting down; retry later"},
}


class Health(BaseModel):
    status: str = "ok"


class FreedTokens(BaseModel):
    freed_tokens: int


class Versions(BaseModel):
    version: str
    torch: str | None
    transformers: str | None
    triton: str | None
    python: str


class Aborted(BaseModel):
    rid: str
    aborted: list[str]


def ok(model: type[BaseModel] | dict) -> dict[int | str, dict[str, Any]]:
    """`responses=` of a route whose 200 body is `model` (a pydantic model or a JSON schema)."""
    if isinstance(model, dict):
        return {200: {"content": {"application/json": {"schema": model}}}}
    return {200: {"model": model}}


def streams(model: type[BaseModel] | dict) -> dict[int | str, dict[str, Any]]:
    """`responses=` of a route that answers `model`, or server-sent events with `stream`."""
    out = ok(model)
    out[200]["content"] = out[200].get("content", {}) | {
        "text/event-stream": {"schema": {  # one server-sent event: a JSON chunk or [DONE]
            "type": "object", "properties": {"data": {"type": "string"}}}}}
    return out


def install(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
