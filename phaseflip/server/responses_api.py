"""`/v1/responses`: OpenAI's Responses API over the chat machinery.

A request becomes a chat request (`protocol/responses_api.to_chat`: the template, tools,
grammars and sampling are chat's), its one choice becomes the response's `output` items — a
`message` with one `output_text` part, then a `function_call` item per tool call — and, with
`stream`, the Responses API's typed events (`response.created` … `response.completed`, each
with a `sequence_number`; no `[DONE]`). Answers with `store` (the default) are kept in memory
for `previous_response_id`, `GET` and `DELETE /v1/responses/{id}`: `ResponseStore`
(`response_store.py`), bounded by `--responses-kept` and by bytes, oldest dropped first.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from phaseflip.errors import ContextLengthError, InvalidRequestError, PhaseflipError
from phaseflip.server import protocol as p
from phaseflip.server import tools
from phaseflip.server.context import ServerContext, renamed
from phaseflip.server.openai_api import (
    Choice,
    PromptRun,
    chat_logprobs,
    parser_delta,
    prepare_chat,
    respond,
    run_prompts,
    strippers,
)
from phaseflip.server.protocol import responses_api as rp
from phaseflip.server.response_store import Kept, ResponseStore


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class Output:
    """The response's output items as they form (whole, or event by event)."""

    items: list[dict[str, Any]] = field(default_factory=list)
    text: str = ""
    message: dict[str, Any] | None = None  # the message item, once it has text
    logprobs: list[dict[str, Any]] | None = None  # every generated token's, when asked for
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # tool-call index -> item
    done: set[str] = field(default_factory=set)  # ids of the items whose done events went

    def open_message(self) -> dict[str, Any]:
        self.message = {"id": _item_id("msg"), "type": "message", "role": "assistant",
                        "status": "in_progress", "content": []}
        self.items.append(self.message)
        return self.message

    def part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text, "annotations": [],
                "logprobs": self.logprobs or []}

    def open_call(self, index: int, call_id: str, name: str) -> dict[str, Any]:
        item = {"id": _item_id("fc"), "type": "function_call", "call_id": call_id,
                "name": name, "arguments": "", "status": "in_progress"}
        self.calls[index] = item
        self.items.append(item)
        return item

    def close(self, item: dict[str, Any], status: str) -> None:
        """`item` ends with `status` ("completed" or "incomplete", what items may be)."""
        if item is self.message:
            item["content"] = [self.part()]
        item["status"] = status
        self.done.add(item["id"])

    def assistant_message(self) -> dict[str, Any]:
        """The answer as a chat message, for a follow-up's history."""
        calls = [{"id": c["call_id"], "type": "function",
                  "function": {"name": c["name"], "arguments": c["arguments"]}}
                 for c in self.calls.values()]
        if not calls:  # (an empty answer is still a message: "" content, never None)
            return {"role": "assistant", "content": self.text}
        return {"role": "assistant", "content": self.text or None, "tool_calls": calls}


@dataclass
class Exchange:
    """One request on its way: the chat run it became and what it answers."""

    req: rp.ResponsesRequest
    run: PromptRun
    plan: tools.ToolPlan | None
    messages: list[dict[str, Any]]  # this input as chat messages (no history, instructions)
    response_id: str  # the engine request's id too
    created: float = field(default_factory=time.time)
    output: Output = field(default_factory=Output)
    previous: Kept | None = None  # the kept answer it continues

    def body(self, ctx: ServerContext, status: str, reason: str | None = None,
             error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object as it stands (`status` "in_progress" before any output)."""
        req, usage = self.req, self.run.usage if status != "in_progress" else None
        choice: Any = req.tool_choice or "auto"
        fmt = req.text.format if req.text and req.text.format else None
        return {
            "id": self.response_id, "object": "response", "created_at": int(self.created),
            "completed_at": int(time.time()) if status != "in_progress" else None,
            "status": status, "error": error, "background": False,
            "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
            "instructions": req.instructions, "metadata": req.metadata or {},
            "model": ctx.model_name, "output": self.output.items,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "max_output_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "top_logprobs": req.top_logprobs,
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump() for t in req.tools or []],
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                     else {"type": "text"}},
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                          "summary": None},
            "store": req.store, "truncation": "disabled", "service_tier": "default",
            "user": req.user, "usage": _usage(usage),
        }

    def keep(self, store: ResponseStore, body: dict[str, Any]) -> None:
        if self.req.store:
            store.put(self.response_id, Kept(
                body, [*self.messages, self.output.assistant_message()],
                rp.input_items(self.req, _item_id), self.previous))


def _usage(usage: Any) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def _status(reason: str | None) -> str:
    """The response's status by its choice's finish: "incomplete" at `max_output_tokens`,
    "cancelled" when the engine ended it (`/abort_request`, or a flip whose new pool could not
    take it back). Either ends a stream with `response.incomplete` (OpenAI has no event for a
    cancelled one), and its last item is "incomplete", an item's nearest status."""
    return {"length": "incomplete", "abort": "cancelled"}.get(reason or "", "completed")


def _item_status(status: str) -> str:
    return "completed" if status == "completed" else "incomplete"


_RENAMED = {"max_new_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
            "max_tokens": "max_output_tokens", "min_new_tokens": "min_tokens",
            "logprobs": "top_logprobs", "response_format": "text.format"}
"""Chat's (and the engine's) names of what a Responses request calls otherwise: an error met
on the chat path names the field the client sent."""


def _responses_error(e: InvalidRequestError, previous_id: str | None) -> InvalidRequestError:
    """An error of the chat path as a Responses client reads it: its fields renamed, and one
    about chat's `messages` (instructions, history and input together) about `input`, saying
    so when a kept conversation (`previous_id`) makes most of it."""
    e = renamed(e, _RENAMED)
    if not (e.param or "").startswith("messages"):  # ("messages is 2510 tokens": not sent)
        return e
    if previous_id is None:
        return type(e)(re.sub(r"\bmessages\b", "input", str(e)), "input")
    what = f"the conversation through previous_response_id {previous_id!r}, then input,"
    message = re.sub(r"\bmessages\b", what, str(e))
    if isinstance(e, ContextLengthError):
        message = message.rstrip(".") + (". A conversation cannot grow past the context: "
                                         "start a new one, or send a shortened one as input")
    return type(e)(message, "input")


def _check_calls(history: list[dict[str, Any]], req: rp.ResponsesRequest) -> None:
    """Every function call in the conversation has its own call_id, and each output answers,
    once, a call made before it (in this input or the kept conversation), as OpenAI
    requires: an error names the input item."""
    made = {c["id"] for m in history for c in m.get("tool_calls") or []}
    answered = {m["tool_call_id"] for m in history if m["role"] == "tool"}
    for i, item in enumerate([] if isinstance(req.input, str) else req.input):
        if isinstance(item, rp.MessageItem):
            continue
        param, call_id = f"input.{i}.call_id", item.call_id
        if isinstance(item, rp.FunctionCallItem):
            if call_id in made:
                raise InvalidRequestError(
                    f"input[{i}] is a second function_call with call_id {call_id!r}: each "
                    "call needs its own call_id", param)
            made.add(call_id)
        else:
            if call_id not in made:
                raise InvalidRequestError(
                    f"input[{i}]: no function_call with call_id {call_id!r} comes before this "
                    "function_call_output", param)
            if call_id in answered:
                raise InvalidRequestError(
                    f"input[{i}] is a second function_call_output for call_id {call_id!r}: "
                    "send one output per call", param)
            answered.add(call_id)


async def create_response(req: rp.ResponsesRequest, request: Request, ctx: ServerContext,
                          store: ResponseStore) -> Response:
    created = time.time()  # at arrival, as chat's `created`, not after the prompt is tokenised
    ctx.check_model(req.model)
    feature = rp.unsupported(req)
    if feature:
        raise InvalidRequestError(f"{feature} is not supported", feature)
    previous = None if req.previous_response_id is None else store.get(
        req.previous_response_id, "previous_response_id")
    history = [] if previous is None else previous.conversation("previous_response_id")
    _check_calls(history, req)
    response_id = _item_id("resp")  # also the engine's request id (/abort_request takes it)
    try:
        try:
            chat = p.ChatCompletionRequest.model_validate(rp.to_chat(req, history))
        except ValidationError as e:
            raise InvalidRequestError(*p.validation_error_to_openai(e.errors())) from None
        run, plan = await prepare_chat(ctx, chat, response_id, {})
    except InvalidRequestError as e:
        raise _responses_error(e, req.previous_response_id) from None
    exchange = Exchange(req, run, plan, rp.input_messages(req), response_id=response_id,
                        created=created, previous=previous)
    if req.stream:
        return StreamingResponse(_events(ctx, store, exchange), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await respond(request, lambda: _answer(ctx, store, exchange))


async def _answer(ctx: ServerContext, store: ResponseStore, ex: Exchange) -> dict[str, Any]:
    c, (parse,) = Choice(0), strippers(ex.plan, 1)
    async for _, d in run_prompts(ctx, [ex.run]):
        c.add(parser_delta(parse, d))
        if d.usage is not None:
            ex.run.usage = d.usage
    out, status = ex.output, _status(c.finish_reason)
    content, calls = tools.parse_output(ex.plan, c.text) if ex.plan else (c.text, [])
    if content or not calls:
        out.text = content or ""
        if ex.req.logprobs:
            out.logprobs = _logprobs(ctx, c)
        out.open_message()
    for i, (name, args) in enumerate(calls):
        out.open_call(i, tools.new_call_id(), name)["arguments"] = args
    for i, item in enumerate(out.items):  # (as a stream closes them: each before the next)
        out.close(item, _item_status(status) if i == len(out.items) - 1 else "completed")
    body = ex.body(ctx, status, c.finish_reason)
    ex.keep(store, body)
    return body


def _logprobs(ctx: ServerContext, c: Choice) -> list[dict[str, Any]]:
    return chat_logprobs(ctx, c.token_ids, c.logprobs, c.top).model_dump()["content"]


class _Events:
    """Numbered server-sent events of one stream."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **data: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"


async def _events(ctx: ServerContext, store: ResponseStore, ex: Exchange
                  ) -> AsyncIterator[str]:
    ev, out = _Events(), ex.output
    yield ev("response.created", response=ex.body(ctx, "in_progress"))
    yield ev("response.in_progress", response=ex.body(ctx, "in_progress"))
    streamer = tools.ToolStreamer(ex.plan) if ex.plan is not None else None
    (parse,) = strippers(ex.plan, 1)
    out.logprobs = [] if ex.req.logprobs else None
    held: list[dict[str, Any]] = []  # logprobs of tokens whose text the streamer holds back
    reason = None
    try:
        async for _, d in run_prompts(ctx, [ex.run]):
            d = parser_delta(parse, d)
            if d.usage is not None:
                ex.run.usage = d.usage
            reason = d.finish_reason or reason
            content, calls = d.text or None, []
            if streamer is not None:
                content, calls = streamer.feed(d.text, d.finish_reason is not None)
            if ex.req.logprobs:
                held += _logprobs(ctx, Choice(0, token_ids=d.token_ids,
                                              logprobs=d.logprobs or [],
                                              top=d.top_logprobs or []))
            if content:
                for event in _text_events(ev, out, content, held):
                    yield event
                held = []
            for call in calls:
                for event in _call_events(ev, out, call):
                    yield event
    except PhaseflipError as e:  # (the engine died or the server shuts down): failed
        param = getattr(e, "param", None)
        yield ev("error", code=None, message=str(e), param=param)
        for event in _close_events(ev, out, "incomplete"):
            yield event
        yield ev("response.failed", response=ex.body(
            ctx, "failed", error={"code": "server_error", "message": str(e)}))
        return
    if out.message is None and not out.calls:  # nothing came: still one (empty) message
        for event in _text_events(ev, out, "", held):
            yield event
    elif out.logprobs is not None and out.message is not None:
        out.logprobs += held  # (a call's tokens: the message's logprobs hold every token)
    status = _status(reason)
    for event in _close_events(ev, out, _item_status(status)):
        yield event
    body = ex.body(ctx, status, reason)
    ex.keep(store, body)
    kind = "response.completed" if status == "completed" else "response.incomplete"
    yield ev(kind, response=body)


def _text_events(ev: _Events, out: Output, text: str, lps: list[dict[str, Any]]
                 ) -> list[str]:
    events = []
    if out.message is None:
        item = out.open_message()
        index = out.items.index(item)
        events += [ev("response.output_item.added", output_index=index, item=dict(item)),
                   ev("response.content_part.added", item_id=item["id"], output_index=index,
                      content_index=0, part={"type": "output_text", "text": "",
                                             "annotations": [], "logprobs": []})]
    grown, out.text = out.text, ""  # grown in place (see `IncrementalDetokenizer._append`)
    grown += text
    out.text = grown
    if out.logprobs is not None:
        out.logprobs += lps
    if text:
        events.append(ev("response.output_text.delta", item_id=out.message["id"],
                         output_index=out.items.index(out.message), content_index=0,
                         delta=text, logprobs=[_delta_logprob(lp) for lp in lps]))
    return events


def _delta_logprob(lp: dict[str, Any]) -> dict[str, Any]:
    """A text delta's logprob: token, logprob and alternatives, without the bytes."""
    return {"token": lp["token"], "logprob": lp["logprob"], "top_logprobs": [
        {"token": t["token"], "logprob": t["logprob"]} for t in lp["top_logprobs"]]}


def _call_events(ev: _Events, out: Output, call: p.DeltaToolCall) -> list[str]:
    """A call's pieces; its first closes the items before it (they stream one by one)."""
    events = []
    fn = call.function
    if call.id is not None:  # a call's first piece names it
        events += _close_events(ev, out, "completed")
        item = out.open_call(call.index, call.id, fn.name if fn else "")
        events.append(ev("response.output_item.added", output_index=out.items.index(item),
                         item=dict(item)))
    item = out.calls[call.index]
    if fn is not None and fn.arguments:
        item["arguments"] += fn.arguments
        events.append(ev("response.function_call_arguments.delta", item_id=item["id"],
                         output_index=out.items.index(item), delta=fn.arguments))
    return events


def _close_events(ev: _Events, out: Output, status: str) -> list[str]:
    """The done events of every item not closed yet, which end with `status`."""
    events = []
    for index, item in enumerate(out.items):
        if item["id"] in out.done:
            continue
        out.close(item, status)
        if item is out.message:
            part = out.part()
            events += [
                ev("response.output_text.done", item_id=item["id"], output_index=index,
                   content_index=0, text=out.text,
                   logprobs=[_delta_logprob(lp) for lp in out.logprobs or []]),
                ev("response.content_part.done", item_id=item["id"], output_index=index,
                   content_index=0, part=part)]
        else:
            events.append(ev("response.function_call_arguments.done", item_id=item["id"],
                             output_index=index, name=item["name"],
                             arguments=item["arguments"]))
        events.append(ev("response.output_item.done", output_index=index, item=item))
    return events


def list_input_items(kept: Kept, limit: int, order: str, after: str | None) -> dict[str, Any]:
    """`GET /v1/responses/{id}/input_items`: a page of the kept input, OpenAI's list shape
    (newest first by default, `after` an item id of the previous page)."""
    items = kept.input_items if order == "asc" else kept.input_items[::-1]
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise InvalidRequestError(f"no input item {after!r} in this response", "after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "has_more": len(items) > limit,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None}
