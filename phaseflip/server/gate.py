"""The front door: request ids, the API key, readiness/shutdown refusals, the body limit, the
request's admitted sequences given back when its answer ends, and the request log
(--log-requests).

A plain ASGI middleware on purpose: Starlette's `BaseHTTPMiddleware` (what
`@app.middleware("http")` installs) hands the endpoint a wrapped `receive` that never reports
`http.disconnect`, so a non-streaming request whose client hung up ran to its end.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from phaseflip.server import protocol as p
from phaseflip.server.context import CURRENT_REQUEST, RequestRecord, ServerContext

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

request_log = logging.getLogger("phaseflip.requests")

OPEN_PATHS = ("/health",)
"""Answered without the API key (load balancers probe them)."""
NEEDS_ENGINE = ("/v1/", "/generate", "/health_generate", "/tokenize", "/detokenize", "/get_",
                "/server_info", "/flush_cache", "/abort_request", "/admin/")
"""Refused with 503 until the engine is ready, and after it died or reported unhealthy (an
engine still loading, or wedged, answers no "info": /server_info waited 30 s, then 500)."""
NEW_WORK = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/generate",
            "/health_generate", "/tokenize", "/detokenize", "/flush_cache", "/admin/")
"""Refused with 503 once a shutdown began (/abort_request and status endpoints still answer)."""
UNLOGGED_PATHS = ("/health", "/metrics")
"""Left out of the request log: probes and scrapes, every few seconds."""


def _json(status: int, body: dict, extra: list | None = None):
    data = json.dumps(body).encode()

    async def respond(send: Send) -> None:
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(data)).encode()), *(extra or [])]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    return respond


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   code: str | None = None):
    return _json(status, p.error_body(message, type_, param, code))


class Gate:
    """Wraps the FastAPI app; see the module docstring."""

    def __init__(self, app, ctx: ServerContext) -> None:
        self.app, self.ctx = app, ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        rid = headers.get(b"x-request-id") or uuid.uuid4().hex.encode()
        record, status, start = RequestRecord(), [None], time.perf_counter()

        async def send_seen(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        token = CURRENT_REQUEST.set(record)
        try:
            await self._handle(scope, receive, send_seen, headers, rid)
        finally:
            CURRENT_REQUEST.reset(token)
            self.ctx.admitted -= record.admitted  # its answer ended: its sequences are free
            if self.ctx.cfg.log_requests and scope["path"] not in UNLOGGED_PATHS:
                # (no status: the client left before an answer, or the app sent none)
                request_log.info(
                    "request %s %s %s %s prompt_tokens=%d completion_tokens=%d %.3f s",
                    _escaped(rid.decode("latin-1")), scope["method"],
                    _escaped(scope["path"]), status[0] or "-", record.prompt_tokens,
                    record.completion_tokens, time.perf_counter() - start)

    async def _handle(self, scope: Scope, receive: Receive, send: Send, headers: dict,
                      rid: bytes) -> None:
        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = message | {"headers": [*message.get("headers", []),
                                                 (b"x-request-id", rid)]}
            await send(message)

        refusal = self._refusal(scope["path"], headers)
        if refusal is None and scope["method"] in ("POST", "PUT", "PATCH"):
            body, refusal = await self._read_body(receive, headers)
            if refusal is None:
                receive = _replay(body, receive)
        if refusal is not None:
            return await refusal(send_with_id)
        await self.app(scope, receive, send_with_id)

    def _refusal(self, path: str, headers: dict):
        ctx, cfg = self.ctx, self.ctx.cfg
        public = path in OPEN_PATHS or (path == "/metrics" and cfg.metrics_without_api_key)
        # set or not (ServerConfig refuses ""; a truth test let "" mean "no key at all")
        if cfg.api_key is not None and not public and not _bearer_matches(
                headers.get(b"authorization", b"").decode("latin-1"), cfg.api_key):
            return error_response(401, "invalid or missing API key (send 'Authorization: "
                                  "Bearer <key>')", "authentication_error",
                                  code="invalid_api_key")
        if ctx.shutting_down and path.startswith(NEW_WORK):
            return error_response(503, ctx.shutting_down, "server_error",
                                  code="server_shutting_down")
        if not ctx.ready and path.startswith(NEEDS_ENGINE):
            return error_response(503, ctx.engine.state.problem or "the model is still loading",
                                  "server_error")
        return None

    async def _read_body(self, receive: Receive, headers: dict) -> tuple[bytes, Any]:
        """The whole body, or a 413 as soon as it is known to exceed the limit."""
        limit = self.ctx.cfg.max_request_bytes
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return b"", self._too_large(int(declared))
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", _nothing
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return b"", self._too_large(size, at_least=True)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None

    def _too_large(self, size: int, at_least: bool = False):
        limit = self.ctx.cfg.max_request_bytes
        return error_response(
            413, f"the request body is {'over ' if at_least else ''}{size} bytes; this server "
            f"accepts at most {limit} bytes (--max-request-bytes)", "invalid_request_error",
            code="request_too_large")


def _escaped(text: str) -> str:
    """`text` on one log line (an id or a percent-decoded path may hold line breaks)."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


async def _nothing(send: Send) -> None:
    """The client left while sending its body: nobody to answer."""


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the buffered body over once, then the client's own events (so a
    disconnect is still seen)."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _bearer_matches(authorization: str, key: str) -> bool:
    """`Authorization: Bearer <key>`, the scheme in any case (RFC 9110 schemes are
    case-insensitive), the key compared in constant time."""
    scheme, _, token = authorization.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              key.encode())
