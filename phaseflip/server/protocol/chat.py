"""The `/v1/chat/completions` request body: messages, their content parts, and the bound on
how many a request holds (`/tokenize` and `/v1/responses` take the same messages)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, Strict, model_validator

from phaseflip.server.protocol.requests import (
    Bool,
    ResponseFormat,
    Str,
    Tools,
    TopLogprobsNum,
    _fail,
    _OpenAISampling,
    _Request,
)

MAX_MESSAGES = 10_000
"""Most messages, and most content parts in all, a chat request may hold: each is a model
checked on the event loop (200 000 took 5 s, stalling every stream), and five times the
2 048 messages Azure OpenAI takes is more than a real conversation or agent transcript."""


class TextContentPart(_Request):
    type: Literal["text"]
    text: Str


def _check_content(value: Any) -> Any:
    """Name the real problem (an image, audio, ...) rather than a union mismatch."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _fail("content must be a string or a list of content parts")
    for part in value:
        if not isinstance(part, dict):
            raise _fail("content parts must be objects like {\"type\": \"text\", \"text\": ...}")
        if part.get("type") != "text":
            raise _fail(f"only text content is supported (got a part of type {part.get('type')!r})")
        if not isinstance(part.get("text"), str):
            raise _fail("a text content part needs a string `text`")
    return value


def _check_choice(value: Any) -> Any:
    """`tool_choice` / `function_call`: a mode string or an object naming a function."""
    if value is None or isinstance(value, (str, dict)):
        return value
    raise _fail("must be a string (e.g. \"none\") or an object")


ToolChoice = Annotated[str | dict[str, Any] | None, BeforeValidator(_check_choice)]

Role = Literal["system", "user", "assistant", "tool", "developer"]


class ChatMessage(_Request):
    """One message of a chat request.

    An assistant message replayed as the `openai` client returned it
    (`resp.choices[0].message.model_dump()`) carries `refusal`, `annotations`, `audio` and
    `function_call`, usually null: null is ignored. Set: a `refusal` is the turn's text when
    it has no `content` (OpenAI sends one or the other); `annotations` (citations of the
    answer) are ignored; `audio` (a reference to an earlier spoken answer) and the legacy
    `function_call` are a 400 naming them, as this server produces neither (`tool_calls`
    replaces `function_call` and is served): refused rather than silently dropped from the
    transcript the model sees.
    """

    role: Role
    content: Annotated[str | list[TextContentPart] | None, BeforeValidator(_check_content)] = None
    """Required, except on an assistant message that carries `tool_calls` or a `refusal`
    (as in OpenAI)."""
    name: Str | None = None
    tool_call_id: Str | None = None
    """Accepted on `tool` messages so a replayed transcript does not fail validation."""
    tool_calls: list[dict[str, Any]] | None = None
    """An assistant turn's earlier calls, replayed (rendered by `server/tools.py`)."""
    refusal: Str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_assistant_extras(self) -> ChatMessage:
        if self.refusal is not None and self.role != "assistant":
            raise _fail("refusal is only allowed on assistant messages", "refusal")
        if self.audio is not None:
            raise _fail("audio is not supported: this server answers in text only", "audio")
        if self.function_call is not None:
            raise _fail("function_call (deprecated by OpenAI) is not supported: replay the "
                        'call as tool_calls: [{"id": ..., "type": "function", "function": '
                        '{"name": ..., "arguments": ...}}]', "function_call")
        return self

    @model_validator(mode="after")
    def _check_content_present(self) -> ChatMessage:
        said = self.tool_calls or self.refusal is not None
        if self.content is None and not (self.role == "assistant" and said):
            raise _fail("content is required", "content")
        return self

    def text(self) -> str:
        """The content as one string; text parts are joined with newlines (as vLLM does). An
        assistant turn that refused has its refusal as its text."""
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)

    def template_dict(self) -> dict[str, Any]:
        """What a Hugging Face chat template expects: string content, and `developer` as
        `system` (templates predate OpenAI's `developer` role and often reject unknown roles)."""
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text(),
        }
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def template_kwargs(continue_final_message: bool,
                    chat_template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A chat request's (or `/tokenize`'s) `chat_template_kwargs`, with `continue_final_message`
    where it is set (the renderer's own option: `apply_chat_template` takes it beside them)."""
    return ({"continue_final_message": True} if continue_final_message else {}) | (
        chat_template_kwargs or {})


def conversation_size(field: str, what: str = "messages") -> Any:
    """A model validator bounding the body's `field` (a list of messages): at most
    MAX_MESSAGES of them, and as many content parts in all. Defined on a model, it runs
    before `_Request`'s own: before the lone-surrogate check, which reads every message."""

    def check(data: Any) -> Any:
        value = data.get(field) if isinstance(data, dict) else None
        if not isinstance(value, list):
            return data
        if len(value) > MAX_MESSAGES:
            raise _fail(f"at most {MAX_MESSAGES} {what} are allowed, got {len(value)}", field)
        parts = sum(len(c) for m in value
                    if isinstance(m, dict) and isinstance(c := m.get("content"), list))
        if parts > MAX_MESSAGES:
            raise _fail(f"at most {MAX_MESSAGES} content parts are allowed in all {what}, got "
                        f"{parts}", field)
        return data

    return model_validator(mode="before")(check)


class ChatCompletionRequest(_OpenAISampling):
    """Body of `POST /v1/chat/completions`."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Strict(), Field(ge=1)] | None = None
    """Deprecated by OpenAI in favour of `max_completion_tokens`, which wins if both are set.
    At least 1, as OpenAI and vLLM require of chat (completions take 0 with `echo`, to score a
    prompt); None: as many as the context and the KV pool leave (`ServerContext`)."""
    max_completion_tokens: Annotated[int, Strict(), Field(ge=1)] | None = None
    logprobs: Bool = False
    top_logprobs: TopLogprobsNum | None = None
    tools: Tools = None
    tool_choice: ToolChoice = None
    functions: list[dict[str, Any]] | None = None
    function_call: Annotated[str | dict[str, Any] | None, BeforeValidator(_check_choice)] = None
    parallel_tool_calls: Bool | None = None
    """False: an `auto` answer's first tool call only (the constrained modes make one)."""
    response_format: ResponseFormat | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    """Handed to the chat template as `reasoning_effort` (templates of reasoning models read
    it; others ignore it)."""
    modalities: list[Str] | None = None
    """Output modalities: only ["text"] is served."""
    store: Bool | None = None
    metadata: dict[str, Str] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    """`store`, `metadata` and `service_tier` are accepted, as clients send them, and have no
    effect: nothing is stored, and every request is served alike."""
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    """vLLM's: the answer continues the last (assistant) message, left open by the template;
    needs `add_generation_prompt: false`."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template (e.g. `enable_thinking`)."""

    _conversation_size = conversation_size("messages")

    @property
    def template_kwargs(self) -> dict[str, Any]:
        return template_kwargs(self.continue_final_message, self.chat_template_kwargs)

    @property
    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens` if set, else `max_tokens`; None: as many as the context
        and the KV pool leave."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def _requested_max_tokens(self) -> int | None:
        return self.requested_max_tokens

    @model_validator(mode="after")
    def _check_top_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise _fail("top_logprobs requires logprobs to be true", "top_logprobs")
        return self

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as a chat template takes them (see `ChatMessage.template_dict`)."""
        return [m.template_dict() for m in self.messages]
