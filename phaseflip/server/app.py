"""The FastAPI application: routes, OpenAI-shaped errors, auth and request ids."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Annotated, Literal

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from phaseflip.errors import ContextLengthError, InvalidRequestError
from phaseflip.server import context as server_context
from phaseflip.server import native_api
from phaseflip.server import protocol as p
from phaseflip.server.context import OverloadedError, ServerContext, UnknownModelError
from phaseflip.server.engine_client import EngineDeadError
from phaseflip.server.gate import Gate
from phaseflip.server.openai_api import (
    chat_prompt,
    create_chat_completion,
    create_completion,
)
from phaseflip.server.openapi import ERRORS, Aborted, FreedTokens, Health, Versions, ok, streams
from phaseflip.server.openapi import install as install_openapi
from phaseflip.server.protocol.responses_api import ResponsesRequest
from phaseflip.server.response_store import ResponseNotFoundError, ResponseStore
from phaseflip.server.responses_api import create_response, list_input_items
from phaseflip.versions import __version__, version_info

log = logging.getLogger("phaseflip.server")


def _error(status: int, message: str, type_: str, param: str | None = None,
           code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(p.error_body(message, type_, param, code), status_code=status,
                        headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if (any(tuple(e.get("loc", ())) == ("body",) for e in errors)
                and "json" not in request.headers.get("content-type", "")):
            # (`curl -d '{...}'` sends form encoding: pydantic's "valid dictionary" says not why)
            return _error(400, "the request body must be a JSON object sent with "
                          "Content-Type: application/json", "invalid_request_error")
        message, param = p.validation_error_to_openai(errors)
        return _error(400, message, "invalid_request_error", param)

    @app.exception_handler(ContextLengthError)
    async def too_long(_: Request, exc: ContextLengthError) -> JSONResponse:
        return _error(400, str(exc), "invalid_request_error", exc.param, "context_length_exceeded")

    @app.exception_handler(InvalidRequestError)
    async def bad(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return _error(400, str(exc), "invalid_request_error", exc.param)

    @app.exception_handler(ResponseNotFoundError)
    async def no_response(_: Request, exc: ResponseNotFoundError) -> JSONResponse:
        return _error(404, str(exc), "invalid_request_error", exc.param, "response_not_found")

    @app.exception_handler(UnknownModelError)
    async def unknown_model(_: Request, exc: UnknownModelError) -> JSONResponse:
        return _error(404, str(exc), "invalid_request_error", "model", "model_not_found")

    @app.exception_handler(OverloadedError)
    async def overloaded(_: Request, exc: OverloadedError) -> JSONResponse:
        return _error(503, str(exc), "server_overloaded")

    @app.exception_handler(EngineDeadError)
    async def dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return _error(503, str(exc), "server_error")

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.error("unexpected error in a request handler", exc_info=exc)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, str(exc.detail), kind, headers=exc.headers)  # (Allow)


def build_app(ctx: ServerContext) -> FastAPI:
    app = FastAPI(title="phaseflip", version=__version__, responses=ERRORS)
    install_openapi(app)
    _install_error_handlers(app)

    app.add_middleware(Gate, ctx=ctx)
    _probe_routes(app, ctx)
    _inference_routes(app, ctx)
    _responses_routes(app, ctx)
    _admin_routes(app, ctx)
    _info_routes(app, ctx)
    return app


def _probe_routes(app: FastAPI, ctx: ServerContext) -> None:
    """Liveness, version and the model list."""

    @app.get("/health", responses=ok(Health))
    async def health() -> Response:
        problem = ctx.shutting_down or ctx.engine.state.problem
        if ctx.ready and not problem:
            return JSONResponse({"status": "ok"})
        return _error(503, problem or "the model is still loading", "server_error")

    @app.get("/health_generate", responses=ok(Health))
    async def health_generate() -> Response:
        from phaseflip.sampling.params import SamplingParams

        async for _ in ctx.run(ctx.new_id("health"), [0], SamplingParams(max_new_tokens=1)):
            pass
        return JSONResponse({"status": "ok"})

    @app.get("/version", response_model=None, responses=ok(Versions))
    async def version() -> dict:
        """phaseflip's version and those of what it runs on (null: not installed)."""
        return version_info()

    @app.get("/v1/models", response_model=None, responses=ok(p.ModelList))
    async def models() -> dict:
        return p.ModelList(data=[_card(ctx)]).model_dump()

    @app.get("/v1/models/{model_id:path}", response_model=None, responses=ok(p.ModelCard))
    async def model(model_id: str) -> dict:
        ctx.check_model(model_id)
        return _card(ctx).model_dump()

    @app.get("/get_model_info", response_model=None, include_in_schema=False)
    async def model_info() -> dict:
        """SGLang's: its frontend asks for it when it connects."""
        path = ctx.engine.state.ready.model
        return {"model_path": path, "tokenizer_path": path, "is_generation": True,
                "served_model_name": ctx.model_name, "max_model_len": ctx.max_context}



def _inference_routes(app: FastAPI, ctx: ServerContext) -> None:
    """The OpenAI endpoints, the native /generate, and (de)tokenization."""

    @app.post("/v1/completions", responses=streams(p.CompletionResponse))
    async def completions(req: p.CompletionRequest, request: Request):
        return await create_completion(req, request, ctx)

    @app.post("/v1/chat/completions", responses=streams(p.ChatCompletionResponse))
    async def chat(req: p.ChatCompletionRequest, request: Request):
        return await create_chat_completion(req, request, ctx)

    @app.post("/generate", responses=streams({"anyOf": [
        {"type": "object"}, {"type": "array", "items": {"type": "object"}}]}))
    async def generate(req: p.GenerateRequest, request: Request):
        return await native_api.generate(ctx, req, request)

    @app.post("/tokenize", response_model=None, responses=ok(p.TokenizeResponse))
    async def tokenize(req: p.TokenizeRequest) -> dict:
        ctx.check_model(req.model)
        if req.messages is not None:  # (as a chat request of these fields: its count)
            ids, _ = await chat_prompt(ctx, p.ChatCompletionRequest.model_construct(
                model=ctx.model_name, **req.model_dump(include={
                    "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
                    "tools", "tool_choice"}, exclude_none=True), messages=req.messages))
        else:
            ids = await ctx.encode(req.prompt, "prompt", req.add_special_tokens)
        return p.TokenizeResponse(tokens=ids, count=len(ids),
                                  max_model_len=ctx.max_context).model_dump()

    @app.post("/detokenize", response_model=None, responses=ok(p.DetokenizeResponse))
    async def detokenize(req: p.DetokenizeRequest) -> dict:
        ctx.check_model(req.model)
        vocab = ctx.engine.state.ready.vocab_size
        if any(t >= vocab for t in req.tokens):
            raise InvalidRequestError(f"token ids must be below {vocab}", "tokens")
        return p.DetokenizeResponse(prompt=ctx.tokenizer.decode(req.tokens)).model_dump()



def _responses_routes(app: FastAPI, ctx: ServerContext) -> None:
    """/v1/responses and its kept answers (the store lives as long as the app)."""
    store = ResponseStore(ctx.cfg.responses_kept, ctx.cfg.responses_kept_bytes)

    @app.post("/v1/responses", responses=streams({"type": "object"}))
    async def responses(req: ResponsesRequest, request: Request):
        return await create_response(req, request, ctx, store)

    @app.get("/v1/responses/{response_id}", response_model=None,
             responses=ok({"type": "object"}))
    async def get_response(response_id: str) -> dict:
        return store.get(response_id).body

    @app.get("/v1/responses/{response_id}/input_items", response_model=None,
             responses=ok({"type": "object"}))
    async def input_items(response_id: str, limit: Annotated[int, Query(ge=1, le=100)] = 20,
                          order: Literal["asc", "desc"] = "desc",
                          after: str | None = None) -> dict:
        return list_input_items(store.get(response_id), limit, order, after)

    @app.delete("/v1/responses/{response_id}", response_model=None,
                responses=ok({"type": "object"}))
    async def delete_response(response_id: str) -> dict:
        store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


def _admin_routes(app: FastAPI, ctx: ServerContext) -> None:
    """What operators change: the prefix cache, the layout, requests in flight."""
    _flush_route(app, ctx)
    _flip_route(app, ctx)
    _abort_route(app, ctx)


def _flip_busy(busy: str) -> JSONResponse:
    """The 409 of a call that cannot run while a flip's seam does (the engine answers
    nothing until it ends, up to --flip-timeout-s)."""
    return _error(409, f"a flip to {busy} is in progress; retry once it has ended "
                       "(/server_info says flip_in_progress until then)",
                  "invalid_request_error", code="flip_in_progress")


def _flush_route(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/flush_cache", responses=ok(FreedTokens))
    @app.get("/flush_cache", include_in_schema=False)  # (as SGLang's)
    async def flush_cache() -> Response:
        """Drops the device prefix cache; 400 while requests run, 409 while a flip runs."""
        if (busy := ctx.flip_in_progress) is not None:
            # (without it this call would wait the seam out, or 500 "TimeoutError" after 30 s)
            return _flip_busy(busy)
        timeout_s = server_context.INFO_TIMEOUT_S  # (answered between two steps, as "info")
        try:
            reply = await ctx.engine.control("flush_cache", timeout_s=timeout_s)
        except asyncio.TimeoutError:  # (builtin TimeoutError from 3.11 on)
            return _error(504, f"the engine did not answer the flush within {timeout_s:g} s "
                               "(a long step?); it may still flush when it gets to it",
                          "timeout_error")
        if not reply.ok:
            return _error(400, reply.message, "invalid_request_error")
        return JSONResponse({"freed_tokens": reply.data["freed_tokens"]})


def _flip_route(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/admin/flip", responses=ok({"type": "object"}))
    async def admin_flip(req: p.FlipRequest) -> Response:
        """Re-lays the engine's ranks out between two steps; answers with the seam census."""
        target = f"tp{req.tp_size}×pp{req.pp_size}"
        if (busy := ctx.flip_in_progress) is not None:
            return _flip_busy(busy)
        ctx.flipping_to = target
        try:
            call = await ctx.engine.send_control("flip", {"tp_size": req.tp_size,
                                                          "pp_size": req.pp_size})
        except BaseException:
            ctx.flipping_to = None
            raise
        timeout_s = ctx.cfg.flip_timeout_s
        try:  # (shielded: the call stays open when this caller stops waiting)
            reply = await asyncio.wait_for(asyncio.shield(call), timeout_s)
        except asyncio.TimeoutError:  # (builtin TimeoutError from 3.11 on)
            return _error(504, f"the flip to {target} did not answer within {timeout_s:g} s; "
                               "the engine may still be in its seam: other flips get 409 "
                               "until it ends (see /server_info and the engine log)",
                          "timeout_error")
        finally:
            ctx.hold_flip_guard(call)  # released when the engine answers, not before
        if not reply.ok:
            return _error(400, reply.message, "invalid_request_error", reply.param)
        return JSONResponse(reply.data)


def _abort_route(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/abort_request", response_model=None, responses=ok(Aborted))
    async def abort_request(req: p.AbortRequest) -> dict | Response:
        rids = list(ctx.engine.state.in_flight) if req.abort_all else ctx.engine.matching(
            req.rid)
        if not rids and not req.abort_all:
            return _error(404, f"no request {req.rid!r} is in flight (it finished, was "
                               "aborted already, or never existed)", "not_found_error", "rid",
                          "request_not_found")
        ctx.abort_asked.intersection_update(ctx.engine.state.in_flight)  # (ended: forgotten)
        for rid in rids:  # (counted when the abort ends it: `ServerContext.abort_asked`)
            ctx.abort_asked.add(rid)
            await ctx.engine.abort(rid)
        return {"rid": req.rid, "aborted": rids}


def _info_routes(app: FastAPI, ctx: ServerContext) -> None:
    """What operators read: /server_info and /metrics."""

    @app.get("/server_info", response_model=None, responses=ok({"type": "object"}))
    @app.get("/get_server_info", response_model=None, include_in_schema=False)
    async def server_info() -> dict:
        # mid-flip the engine answers nothing until its seam ends: say so instead of waiting
        try:
            info = await ctx.engine_info()
        except asyncio.TimeoutError as e:  # a wedged engine (or a step longer than the wait)
            return _error(504, str(e), "timeout_error")
        ready = ctx.engine.state.ready
        return info | {
            "model": ctx.model_name, "max_model_len": ctx.max_context,
            "device": ready.device, "dtype": ready.dtype,
            "server_config": {k: v for k, v in vars(ctx.cfg).items() if k != "api_key"},
            "versions": _versions(),
        }

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        st = ctx.engine.state
        ctx.metrics.running.set(st.running)
        ctx.metrics.waiting.set(st.waiting)
        if st.ready is not None and not st.dead:  # exact now (none of it mid-flip)
            with contextlib.suppress(asyncio.TimeoutError):  # (a long step: as they were)
                ctx.metrics.observe_engine(await ctx.engine_info(
                    server_context.SCRAPE_INFO_WAIT_S))
        ctx.observe_flip()
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4")


def _card(ctx: ServerContext) -> p.ModelCard:
    return p.ModelCard(id=ctx.model_name, created=ctx.started, max_model_len=ctx.max_context)


def _versions() -> dict[str, str | None]:
    """`version_info()` with phaseflip's own under its name (as /server_info always said)."""
    info = version_info()
    return {"phaseflip": info.pop("version"), **info}
