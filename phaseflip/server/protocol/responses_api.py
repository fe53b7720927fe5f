"""The request body of `POST /v1/responses`, OpenAI's Responses API, and its mapping onto chat.

The Responses API is chat in another shape: `input` is a string or a list of items (messages,
the model's earlier function calls and their outputs), `instructions` a system message that
does not carry over to a follow-up, `text.format` the response format, `tools` functions
declared flat, `previous_response_id` the conversation so far (kept by the server). `to_chat`
maps a request and its history onto a `ChatCompletionRequest`, so the chat template, tools,
grammars and sampling are chat's own.

Items a client replays from an earlier answer (`input += response.output`) validate as they
come back: an output message's `id`, `status`, `annotations` and `logprobs` are accepted.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Discriminator, Field, Strict, Tag, model_validator

from phaseflip.server.protocol.chat import conversation_size
from phaseflip.server.protocol.requests import (
    MAX_LOGPROBS,
    MAX_TOOLS,
    Bool,
    Seed,
    Str,
    Temperature,
    TopP,
    _at_most,
    _fail,
    _Request,
    _SamplingExtras,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"
"""The `include` value that adds something here: the output text's token logprobs."""
Include = Literal[
    "message.output_text.logprobs", "reasoning.encrypted_content", "file_search_call.results",
    "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url",
    "code_interpreter_call.outputs"]
"""OpenAI's `include` values; all but the logprobs add data to item kinds never produced here
(reasoning, searches, images), so asking for them changes nothing (agents send them)."""
_ITEM_TYPES = ("message", "function_call", "function_call_output")


class ContentText(_Request):
    type: Literal["input_text", "output_text"]
    text: Str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


def _check_content(value: Any) -> Any:
    """A string, or text parts; an image or a file is named (the part's `type` the error's
    param), not a union mismatch."""
    if isinstance(value, str) or not isinstance(value, list):
        return value
    for j, part in enumerate(value):
        if not isinstance(part, dict):
            raise _fail(f"content part {j} must be an object, not {type(part).__name__}", f"{j}")
        if (kind := part.get("type")) not in ("input_text", "output_text"):
            raise _fail(f"only text content is supported (got a part of type {kind!r})",
                        f"{j}.type")
    return value


class MessageItem(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Annotated[str | list[ContentText], BeforeValidator(_check_content)]
    id: Str | None = None
    status: Str | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionCallItem(_Request):
    """A call the model made earlier (from an earlier answer's `output`)."""

    type: Literal["function_call"]
    call_id: Str
    name: Str
    arguments: Str
    id: Str | None = None
    status: Str | None = None
    namespace: Str | None = None
    caller: dict[str, Any] | None = None
    async_: Bool | None = Field(None, alias="async")


class FunctionCallOutputItem(_Request):
    """What the client's function returned for `call_id`."""

    type: Literal["function_call_output"]
    call_id: Str
    output: Annotated[str | list[ContentText], BeforeValidator(_check_content)]
    id: Str | None = None
    status: Str | None = None
    name: Str | None = None
    namespace: Str | None = None
    caller: dict[str, Any] | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "\n".join(part.text for part in self.output)


def _tag(by_type: dict[str, str]) -> Discriminator:
    """A union chosen by `type`, its members tagged by class name, so an error's path reads
    `input.0.role` (`protocol/errors.py` drops class-like tags), not `input.0.message.role`."""
    def kind(value: Any) -> str | None:
        t = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        return by_type.get(t)
    return Discriminator(kind, custom_error_type="invalid_union_member",
                         custom_error_message=f"type must be one of: {', '.join(by_type)}")


InputItem = Annotated[
    Annotated[MessageItem, Tag("MessageItem")]
    | Annotated[FunctionCallItem, Tag("FunctionCallItem")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutputItem")],
    _tag({"message": "MessageItem", "function_call": "FunctionCallItem",
          "function_call_output": "FunctionCallOutputItem"})]


def _check_input(value: Any) -> Any:
    """A non-empty string or list of items; a message may leave out `type` (OpenAI's
    "easy input message"); any other item kind is named."""
    if isinstance(value, str):
        if not value:
            raise _fail("input must not be empty")
        return value
    if not isinstance(value, list) or not value:
        raise _fail("input must be a non-empty string or a non-empty list of items")
    items = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise _fail(f"input[{i}] must be an object, not {type(item).__name__}", f"{i}")
        kind = item.get("type", "message")
        if kind not in _ITEM_TYPES:
            raise _fail(f"input[{i}] is of type {kind!r}; served item types: "
                        f"{', '.join(_ITEM_TYPES)}", f"{i}.type")
        items.append(item if "type" in item else {**item, "type": "message"})
    return items


class FormatText(_Request):
    type: Literal["text"]


class FormatJsonObject(_Request):
    type: Literal["json_object"]


class FormatJsonSchema(_Request):
    type: Literal["json_schema"]
    name: Str
    schema_: dict[str, Any] = Field(alias="schema")
    description: Str | None = None
    strict: Bool | None = None


class TextConfig(_Request):
    format: Annotated[
        Annotated[FormatText, Tag("FormatText")]
        | Annotated[FormatJsonObject, Tag("FormatJsonObject")]
        | Annotated[FormatJsonSchema, Tag("FormatJsonSchema")],
        _tag({"text": "FormatText", "json_object": "FormatJsonObject",
              "json_schema": "FormatJsonSchema"})] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    """Accepted; the model's own length decides."""


class FunctionTool(_Request):
    type: Literal["function"]
    name: Str
    description: Str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None


def _check_tools(value: Any) -> Any:
    if isinstance(value, list):
        for i, tool in enumerate(value):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise _fail(f"tools[{i}] is of type {kind!r}: only function tools are served")
    return value


class ToolChoiceFunction(_Request):
    type: Literal["function"]
    name: Str


class Reasoning(_Request):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    """Accepted; no reasoning summary is produced."""


class ResponsesStreamOptions(_Request):
    include_obfuscation: Bool | None = None


class ResponsesRequest(_SamplingExtras):
    """Body of `POST /v1/responses` (with chat's vLLM-style extras, `top_k` and the rest)."""

    model: Str
    input: Annotated[str | list[InputItem], BeforeValidator(_check_input)]
    _input_size = conversation_size("input", "input items")
    instructions: Str | None = None
    previous_response_id: Str | None = None
    max_output_tokens: Annotated[int, Strict(), Field(ge=1)] | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    seed: Seed | None = None
    stream: Bool = False
    stream_options: ResponsesStreamOptions | None = None
    text: TextConfig | None = None
    tools: Annotated[list[FunctionTool], BeforeValidator(_check_tools),
                     _at_most(MAX_TOOLS, "tools")] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: Bool | None = None
    include: list[Include] | None = None
    top_logprobs: Annotated[int, Strict(), Field(ge=0, le=MAX_LOGPROBS)] | None = None
    reasoning: Reasoning | None = None
    store: Bool = True
    """Keep the answer (in memory, `--responses-kept`) for `previous_response_id` and GET."""
    background: Bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, Str] | None = None
    user: Str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    safety_identifier: Str | None = None
    prompt_cache_key: Str | None = None
    """Accepted: the prefix cache needs no key."""

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])

    @model_validator(mode="after")
    def _check_stream_options(self) -> ResponsesRequest:
        if self.stream_options is not None and not self.stream:
            raise _fail("stream_options is only allowed when stream is true", "stream_options")
        return self


def unsupported(req: ResponsesRequest) -> str | None:
    """The first feature the request asks for that is not served, else None."""
    if req.background:
        return "background"
    if req.truncation == "auto":
        return "truncation"
    return None


def item_messages(items: list[MessageItem | FunctionCallItem | FunctionCallOutputItem]
                  ) -> list[dict[str, Any]]:
    """Input items as chat messages: a run of function calls becomes one assistant message's
    `tool_calls` (joined to the assistant message before it), an output a `tool` message."""
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return out


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """This request's own input as chat messages (what a follow-up inherits)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    return item_messages(req.input)


def input_items(req: ResponsesRequest, new_id: Any) -> list[dict[str, Any]]:
    """This request's input as the items `GET /v1/responses/{id}/input_items` lists, each with
    an id (`new_id(prefix)` where the client gave none) and a message's text as parts; a
    string is one user message."""
    if isinstance(req.input, str):
        return [{"id": new_id("msg"), "type": "message", "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": req.input}]}]
    out = []
    for item in req.input:
        d = item.model_dump(by_alias=True, exclude_none=True)
        if isinstance(item, MessageItem) and isinstance(item.content, str):  # as parts
            kind = "output_text" if item.role == "assistant" else "input_text"
            d["content"] = [{"type": kind, "text": item.content}]
        prefix = {"message": "msg", "function_call": "fc"}.get(item.type, "fco")
        out.append({"id": new_id(prefix), **d} if item.id is None else d)
    return out


def to_chat(req: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request body that asks the same as `req` after `history` (the messages of the
    responses before it): validate it with `ChatCompletionRequest.model_validate`."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else [])
    body: dict[str, Any] = {
        "model": req.model, "messages": messages + history + input_messages(req),
        "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
        "top_p": req.top_p, "seed": req.seed, "user": req.user,
        "parallel_tool_calls": req.parallel_tool_calls,
        "reasoning_effort": req.reasoning.effort if req.reasoning else None,
        **req.model_dump(include=set(_SamplingExtras.model_fields)),
    }
    if req.logprobs:
        body |= {"logprobs": True, "top_logprobs": req.top_logprobs or 0}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(
            include={"name", "description", "parameters"}, exclude_none=True)}
            for t in req.tools]
    if isinstance(req.tool_choice, ToolChoiceFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text else None
    if isinstance(fmt, FormatJsonSchema):
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    return body

