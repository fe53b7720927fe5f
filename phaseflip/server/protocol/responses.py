"""Response bodies, shaped exactly as the `openai` client parses them, and errors."""

from __future__ import annotations

import math
import time
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)

from phaseflip.server.protocol.requests import (
    VERY_UNLIKELY_LOGPROB,
)

# ---------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------


def _finite_logprob(x: float) -> float:
    """-inf (a token the sampler masked out) has no JSON form; OpenAI reports -9999 instead."""
    return x if math.isfinite(x) else VERY_UNLIKELY_LOGPROB


Logprob = Annotated[float, AfterValidator(_finite_logprob)]
FinishReason = Literal["stop", "length", "abort", "tool_calls"]
""""abort" (the request was aborted) is phaseflip's; the `openai` client's Literal lacks it but
its default, non-strict parsing passes it through."""


class _Response(BaseModel):
    """Base of response bodies: extra fields are a server bug, so they are refused."""

    model_config = ConfigDict(extra="forbid")


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class UsageInfo(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def from_counts(cls, prompt_tokens: int, completion_tokens: int,
                    cached_tokens: int | None = None) -> UsageInfo:
        """Usage with the total filled in; `cached_tokens` (prefix-cache hits) when known."""
        details = (
            None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens)
        )
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=details)


class CompletionLogprobs(_Response):
    """Legacy completions logprobs: parallel lists, one entry per token.

    Entries are None where nothing is known: the first echoed prompt token has no logprob.
    """

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Logprob | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, Logprob] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    """The stop string or `stop_token_ids` entry that ended the choice; null for any other
    end, the end-of-sequence token included (vLLM's extension)."""


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(_Response):
    """One server-sent event of a streamed completion (same shape as the whole response, as
    in OpenAI, but `usage` only on the last chunk when `include_usage`)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatTopLogprob(_Response):
    token: str
    logprob: Logprob
    bytes: list[int] | None = None


class ChatTokenLogprob(_Response):
    token: str
    logprob: Logprob
    bytes: list[int] | None = None
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str
    """The arguments as JSON text (as OpenAI sends them)."""


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _Sparse(_Response):
    """A streamed piece whose unset fields are left out, not sent as null: the `openai`
    client's stream helper merges pieces key by key, and a `"type": null` overwrites the
    `"function"` of the first piece (its tool-call assembly then fails)."""

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler):  # (unannotated: the
        # serialization schema stays the model's own, not "any object")
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_Sparse):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Sparse):
    """A piece of a streamed tool call: the first names it (id, type, function name), the
    others carry only `index` and fragments of its arguments, which concatenate to the whole
    JSON text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    """Set on each choice's first chunk only."""
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "phaseflip"
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeResponse(_Response):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(_Response):
    prompt: str


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error envelope, which the `openai` client turns into `APIStatusError`s."""
    return ErrorResponse(
        error=ErrorInfo(message=message, type=type_, param=param, code=code)
    ).model_dump()
