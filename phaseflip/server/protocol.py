"""The OpenAI-compatible wire format (and phaseflip's native `/generate`), as pydantic models.

Why it is shaped the way it is:

* Requests reject unknown fields, as OpenAI's API does (HTTP 400), so a misspelt parameter is
  an error rather than a silently ignored knob. The `openai` client merges `extra_body` into the
  top level, so the vLLM/SGLang-style extras phaseflip honours (`top_k`, `min_p`, ...) are
  declared explicitly.
* Scalars are strict (no `"0.5"` for a float, no `true` for an int) and floats reject NaN/inf:
  a NaN temperature that slipped through would poison a whole batch on the device.
* An explicit `null` for an optional knob means "use the default", as in OpenAI's spec, except
  where `null` has a meaning of its own (`max_tokens: null` = "as many as the context allows").
* Our own validators raise errors that carry the offending field, so
  `validation_error_to_openai` can always name a `param`, even for cross-field rules.
* Response models are checked against the `openai` client's own types in the tests, so what we
  send is exactly what the official client parses.

Nothing here touches the engine: the conversion helpers map a request onto `SamplingParams`,
and the server runs `SamplingParams.validate` (vocabulary-dependent checks) afterwards.
"""

from __future__ import annotations

import math
import re
import time
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import fields as dataclass_fields
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from phaseflip.sampling.params import LOGIT_BIAS_RANGE, MAX_N, PENALTY_RANGE, SamplingParams

MAX_LOGPROBS = 20
"""Most alternatives per position a request may ask for (OpenAI's limit for chat)."""
MAX_STOP_STRINGS = 16
"""More generous than OpenAI's 4; each stop string costs a suffix check per token."""
VERY_UNLIKELY_LOGPROB = -9999.0
"""What OpenAI reports for a token outside the distribution; JSON has no -Infinity."""

_CUSTOM_ERROR = "phaseflip_invalid_value"
_TOKEN_ID_KEY = re.compile(r"[0-9]+")

# ---------------------------------------------------------------------------------------------
# Strict scalar types
# ---------------------------------------------------------------------------------------------

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]  # strict float still takes ints; NaN is refused per model
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]
TokenId = Annotated[int, Strict(), Field(ge=0)]
Temperature = Annotated[float, Strict(), Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Strict(), Field(gt=0.0, le=1.0)]
Penalty = Annotated[float, Strict(), Field(ge=-PENALTY_RANGE, le=PENALTY_RANGE)]
Seed = Annotated[int, Strict(), Field(ge=-(2**63), le=2**64 - 1)]
NumChoices = Annotated[int, Strict(), Field(ge=1, le=MAX_N)]
TopLogprobsNum = Annotated[int, Strict(), Field(ge=0, le=MAX_LOGPROBS)]


def _fail(message: str, field: str | None = None) -> PydanticCustomError:
    """An error whose text we control and which remembers its field (see module docstring).

    The message travels in `ctx` rather than as the template, so braces in it (a repr of a
    dict, say) are never taken for format fields.
    """
    ctx: dict[str, Any] = {"message": message}
    if field is not None:
        ctx["field"] = field
    return PydanticCustomError(_CUSTOM_ERROR, "{message}", ctx)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_token_ids(value: list[Any], what: str) -> None:
    if not value:
        raise _fail(f"{what} must not be empty")
    for t in value:
        if not _is_int(t) or t < 0:
            raise _fail(f"{what} must hold non-negative integer token ids, got {t!r}")


def _prompt_validator(*, strings: bool, token_ids: bool, what: str) -> BeforeValidator:
    """One clear error for a prompt-like union instead of one per union member.

    Pydantic would report e.g. `[1, -1]` as four failures (one per alternative of
    `str | list[str] | list[int] | list[list[int]]`); this check runs first and says what is
    wrong in words, after which the union itself always matches.
    """
    kinds = []
    if strings:
        kinds += ["a non-empty string", "a list of non-empty strings"]
    if token_ids:
        kinds += ["a list of token ids", "a list of token-id lists"]
    expected = f"{what} must be " + ", ".join(kinds[:-1]) + f" or {kinds[-1]}"

    def check(value: Any) -> Any:
        if strings and isinstance(value, str):
            if not value:
                raise _fail(f"{what} must not be empty")
            return value
        if not isinstance(value, list):
            raise _fail(f"{expected}, got {type(value).__name__}")
        if not value:
            raise _fail(f"{what} must not be empty")
        if strings and all(isinstance(x, str) for x in value):
            if not all(value):
                raise _fail(f"{what} must not contain empty strings")
        elif token_ids and all(isinstance(x, list) for x in value):
            for ids in value:
                _check_token_ids(ids, what)
        elif token_ids and not any(isinstance(x, (str, list)) for x in value):
            _check_token_ids(value, what)
        elif len({type(x) for x in value}) > 1:
            raise _fail(f"{expected}; mixed element types are not allowed")
        else:
            raise _fail(f"{expected}, got a list of {type(value[0]).__name__}")
        return value

    return BeforeValidator(check)


def _check_stop(value: Any) -> Any:
    if value is None or isinstance(value, str):
        if value == "":
            raise _fail("stop strings must not be empty")
        return value
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _fail("stop must be a string or a list of strings")
    if len(value) > MAX_STOP_STRINGS:
        raise _fail(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(value)}")
    if not all(value):
        raise _fail("stop strings must not be empty")
    return value


def _check_logit_bias(value: dict[str, float] | None) -> dict[str, float] | None:
    for key in value or {}:
        if not _TOKEN_ID_KEY.fullmatch(key):
            raise _fail(
                f"logit_bias keys must be token ids written as decimal strings, got {key!r}"
            )
    return value


Prompt = Annotated[
    str | list[str] | list[TokenId] | list[list[TokenId]],
    _prompt_validator(strings=True, token_ids=True, what="prompt"),
]
Stop = Annotated[str | list[str] | None, BeforeValidator(_check_stop)]
LogitBias = Annotated[
    dict[str, Annotated[float, Strict(), Field(ge=-LOGIT_BIAS_RANGE, le=LOGIT_BIAS_RANGE)]]
    | None,
    AfterValidator(_check_logit_bias),
]


def _allows_none(annotation: Any) -> bool:
    if annotation is None or annotation is type(None):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_allows_none(a) for a in typing.get_args(annotation))
    return False


class _Request(BaseModel):
    """Base of every request body: unknown fields are errors, NaN/inf are errors."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """Drop explicit nulls for optional fields that cannot hold None, so the default applies.

        OpenAI's spec marks nearly every knob nullable (`"temperature": null` is legal and means
        the default); declaring each as `X | None` would push None-handling into every consumer.
        """
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if not (
                v is None
                and k in fields
                and not fields[k].is_required()
                and not _allows_none(fields[k].annotation)
            )
        }


class StreamOptions(_Request):
    include_usage: Bool = False
    """Send a last chunk with `usage` (and `usage: null` on the others)."""
    include_obfuscation: Bool | None = None
    """Accepted for compatibility with OpenAI; phaseflip never pads chunks."""


class _SamplingExtras(_Request):
    """vLLM/SGLang-style sampling knobs beyond OpenAI's, shared by completions and chat."""

    top_k: Annotated[int, Strict(), Field(ge=-1)] = -1
    """-1 (or 0) disables top-k."""
    min_p: Annotated[float, Strict(), Field(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Strict(), Field(gt=0.0)] = 1.0
    min_tokens: Annotated[int, Strict(), Field(ge=0)] = 0
    ignore_eos: Bool = False
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    skip_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False


class _OpenAISampling(_SamplingExtras):
    """Fields completions and chat share, with OpenAI's ranges and defaults."""

    model: Str
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    n: NumChoices = 1
    stream: Bool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: LogitBias = None
    seed: Seed | None = None
    user: Str | None = None

    @property
    def include_usage(self) -> bool:
        """True when a streaming client asked for a final usage chunk."""
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def _requested_max_tokens(self) -> int | None:
        raise NotImplementedError

    @model_validator(mode="after")
    def _check_shared(self) -> _OpenAISampling:
        if self.stream_options is not None and not self.stream:
            raise _fail("stream_options is only allowed when stream is true", "stream_options")
        max_tokens = self._requested_max_tokens()
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise _fail(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({max_tokens})",
                "min_tokens",
            )
        return self


# ---------------------------------------------------------------------------------------------
# /v1/completions
# ---------------------------------------------------------------------------------------------


class CompletionRequest(_OpenAISampling):
    """Body of `POST /v1/completions`."""

    prompt: Prompt
    suffix: Str | None = None
    """Accepted so the server can say "not supported" (see `unsupported`) instead of 'unknown'."""
    max_tokens: Annotated[int, Strict(), Field(ge=0)] | None = 16
    """OpenAI's default is 16; an explicit null means "whatever the context leaves"."""
    best_of: NumChoices | None = None
    """Generate this many and return the `n` with the highest cumulative logprob."""
    logprobs: TopLogprobsNum | None = None
    """None: no logprobs; 0: the chosen token's; k: also the k most likely alternatives."""
    echo: Bool = False

    def _requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @model_validator(mode="after")
    def _check_best_of(self) -> CompletionRequest:
        if self.best_of is not None:
            if self.best_of < self.n:
                raise _fail(
                    f"best_of ({self.best_of}) must be greater than or equal to n ({self.n})",
                    "best_of",
                )
            if self.best_of > self.n and self.stream:
                raise _fail("best_of > n cannot be streamed: the best are known only at the end",
                            "best_of")
        return self


# ---------------------------------------------------------------------------------------------
# /v1/chat/completions
# ---------------------------------------------------------------------------------------------


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


Role = Literal["system", "user", "assistant", "tool", "developer"]


class ChatMessage(_Request):
    role: Role
    content: Annotated[str | list[TextContentPart] | None, BeforeValidator(_check_content)] = None
    """Required, except on an assistant message that carries `tool_calls` (as in OpenAI)."""
    name: Str | None = None
    tool_call_id: Str | None = None
    """Accepted on `tool` messages so a replayed transcript does not fail validation."""
    tool_calls: list[dict[str, Any]] | None = None
    """Accepted so `unsupported` can report tool calling rather than an unknown field."""

    @model_validator(mode="after")
    def _check_content_present(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise _fail("content is required", "content")
        return self

    def text(self) -> str:
        """The content as one string; text parts are joined with newlines (as vLLM does)."""
        if self.content is None:
            return ""
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


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(_OpenAISampling):
    """Body of `POST /v1/chat/completions`."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Strict(), Field(ge=0)] | None = None
    """Deprecated by OpenAI in favour of `max_completion_tokens`, which wins if both are set."""
    max_completion_tokens: Annotated[int, Strict(), Field(ge=0)] | None = None
    logprobs: Bool = False
    top_logprobs: TopLogprobsNum | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Annotated[str | dict[str, Any] | None, BeforeValidator(_check_choice)] = None
    functions: list[dict[str, Any]] | None = None
    function_call: Annotated[str | dict[str, Any] | None, BeforeValidator(_check_choice)] = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: Bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template (e.g. `enable_thinking`)."""

    @property
    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens` if set, else `max_tokens`; None: as the context allows."""
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


# ---------------------------------------------------------------------------------------------
# Native /generate, /tokenize, /detokenize, /abort
# ---------------------------------------------------------------------------------------------


def _reject_logprob_keys(data: Any) -> Any:
    if isinstance(data, dict):
        for key in ("logprobs", "prompt_logprobs"):
            if key in data:
                raise _fail(
                    "logprobs are requested with return_logprob / top_logprobs_num / "
                    "logprob_start_len on the request, not in sampling_params",
                    key,
                )
    return data


class NativeSamplingParams(_Request):
    """`sampling_params` of `/generate`: `SamplingParams` field names, types checked here.

    Ranges are left to `SamplingParams.validate`, which the server runs anyway (some limits
    depend on the vocabulary), so the two cannot disagree. A field left out (or null) keeps
    the `SamplingParams` default, except `max_new_tokens` (see `generate_sampling_params`).
    """

    max_new_tokens: Int | None = None
    min_new_tokens: Int | None = None
    temperature: Float | None = None
    top_k: Int | None = None
    top_p: Float | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    frequency_penalty: Float | None = None
    presence_penalty: Float | None = None
    logit_bias: LogitBias = None
    seed: Int | None = None
    n: Int | None = None
    ignore_eos: Bool | None = None
    stop: Stop = None
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: Bool | None = None
    include_stop_str_in_output: Bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_logprob_keys(cls, data: Any) -> Any:
        return _reject_logprob_keys(data)


class GenerateRequest(_Request):
    """Body of the native `POST /generate` (SGLang-like).

    Exactly one of `text` / `input_ids`; a list of prompts is a batch. With `return_logprob`,
    each output token gets its logprob and `top_logprobs_num` alternatives; prompt logprobs are
    computed too when `logprob_start_len >= 0` and are reported from that prompt position on
    (-1: none).
    """

    text: Annotated[
        str | list[str] | None, _prompt_validator(strings=True, token_ids=False, what="text")
    ] = None
    input_ids: Annotated[
        list[TokenId] | list[list[TokenId]] | None,
        _prompt_validator(strings=False, token_ids=True, what="input_ids"),
    ] = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: Bool = False
    return_logprob: Bool = False
    top_logprobs_num: TopLogprobsNum = 0
    logprob_start_len: Annotated[int, Strict(), Field(ge=-1)] = -1
    rid: Annotated[str, Strict(), Field(min_length=1)] | None = None
    """Request id to use (so the client can `/abort` it); the server makes one when None."""

    @model_validator(mode="after")
    def _check_input(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise _fail("exactly one of text and input_ids is required", "text")
        if not self.return_logprob:
            if self.top_logprobs_num:
                raise _fail("top_logprobs_num requires return_logprob", "top_logprobs_num")
            if self.logprob_start_len != -1:
                raise _fail("logprob_start_len requires return_logprob", "logprob_start_len")
        return self


class TokenizeRequest(_Request):
    """Body of `POST /tokenize`: a raw prompt, or chat messages rendered by the template."""

    model: Str | None = None
    prompt: Str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: Bool = True
    add_generation_prompt: Bool = True
    """Only for `messages`: end with the assistant turn's opening, as chat requests do."""

    @model_validator(mode="after")
    def _check_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise _fail("exactly one of prompt and messages is required", "prompt")
        return self


class DetokenizeRequest(_Request):
    model: Str | None = None
    tokens: list[TokenId]


class AbortRequest(_Request):
    rid: Annotated[str, Strict(), Field(min_length=1)]


# ---------------------------------------------------------------------------------------------
# Request -> SamplingParams
# ---------------------------------------------------------------------------------------------


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    return {int(k): v for k, v in bias.items()} if bias else None


def _common_params(req: _OpenAISampling, max_tokens: int | None,
                   default_max_tokens: int) -> dict[str, Any]:
    return {
        "max_new_tokens": default_max_tokens if max_tokens is None else max_tokens,
        "min_new_tokens": req.min_tokens,
        "temperature": req.temperature,  # 0 is greedy (SamplingParams.is_greedy)
        "top_k": -1 if req.top_k == 0 else req.top_k,
        "top_p": req.top_p,
        "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
        "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty,
        "logit_bias": _logit_bias(req.logit_bias),
        "seed": req.seed,
        "ignore_eos": req.ignore_eos,
        "stop": _stop_list(req.stop),
        "stop_token_ids": list(req.stop_token_ids),
        "skip_special_tokens": req.skip_special_tokens,
        "include_stop_str_in_output": req.include_stop_str_in_output,
    }


def completion_sampling_params(req: CompletionRequest, default_max_tokens: int) -> SamplingParams:
    """Sampling parameters for a completions request.

    `default_max_tokens` (context minus prompt length) applies when `max_tokens` is null.
    With `best_of > n` the engine samples `best_of` choices and the server keeps the `n` with
    the highest cumulative logprob; to rank them logprobs must be computed, so `logprobs` is
    at least 0 then and the server must drop them from the answer if `req.logprobs` is None.
    `echo` with `logprobs` also asks for prompt logprobs, which OpenAI returns for the echoed
    prompt.
    """
    ranking = req.best_of is not None and req.best_of > req.n
    logprobs = req.logprobs
    if ranking and logprobs is None:
        logprobs = 0
    return SamplingParams(
        **_common_params(req, req.max_tokens, default_max_tokens),
        n=req.best_of if ranking and req.best_of is not None else req.n,
        logprobs=logprobs,
        prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None,
    )


def chat_sampling_params(req: ChatCompletionRequest, default_max_tokens: int) -> SamplingParams:
    """Sampling parameters for a chat request; `logprobs: true` alone means the chosen token's
    logprob only (top_logprobs 0), as in OpenAI."""
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return SamplingParams(
        **_common_params(req, req.requested_max_tokens, default_max_tokens),
        n=req.n,
        logprobs=logprobs,
        prompt_logprobs=None,
    )


def generate_sampling_params(req: GenerateRequest, default_max_tokens: int) -> SamplingParams:
    """Sampling parameters for a native request; `default_max_tokens` applies when
    `sampling_params.max_new_tokens` is absent (the server chooses it, e.g. context left)."""
    given = req.sampling_params.model_dump(exclude_none=True)
    given.setdefault("max_new_tokens", default_max_tokens)
    if "logit_bias" in given:
        given["logit_bias"] = _logit_bias(given["logit_bias"])
    if given.get("top_k") == 0:
        given["top_k"] = -1
    if req.return_logprob:
        given["logprobs"] = req.top_logprobs_num
        if req.logprob_start_len >= 0:
            given["prompt_logprobs"] = req.top_logprobs_num
    return SamplingParams(**given)


def native_sampling_param_names() -> frozenset[str]:
    """`SamplingParams` fields settable through `sampling_params` (all but the logprob ones)."""
    return frozenset(f.name for f in dataclass_fields(SamplingParams)) - {
        "logprobs", "prompt_logprobs"}


def unsupported(req: CompletionRequest | ChatCompletionRequest) -> str | None:
    """Name of the first feature the request uses that phaseflip does not implement, else None.

    These fields are accepted by the schema on purpose: answering "tools is not supported yet"
    is more useful than "unrecognized argument". An empty `tools` list, `tool_choice` "none" or
    "auto" without tools, and `response_format` {"type": "text"} change nothing and pass.
    """
    if isinstance(req, CompletionRequest):
        return "suffix" if req.suffix else None
    if req.tools:
        return "tools"
    if req.tool_choice not in (None, "none", "auto"):
        return "tool_choice"
    if req.functions:
        return "functions"
    if req.function_call not in (None, "none", "auto"):
        return "function_call"
    if req.response_format is not None and req.response_format.type != "text":
        return "response_format"
    if any(m.tool_calls for m in req.messages):
        return "tool_calls"
    return None


# ---------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------


def _finite_logprob(x: float) -> float:
    """-inf (a token the sampler masked out) has no JSON form; OpenAI reports -9999 instead."""
    return x if math.isfinite(x) else VERY_UNLIKELY_LOGPROB


Logprob = Annotated[float, AfterValidator(_finite_logprob)]
FinishReason = Literal["stop", "length", "abort"]
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
    """The stop token id or stop string that ended the choice (vLLM's extension)."""


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


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


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


# ---------------------------------------------------------------------------------------------
# Validation errors -> one OpenAI-style message
# ---------------------------------------------------------------------------------------------

_REQUEST_PARTS = frozenset({"body", "query", "path", "header", "cookie"})
_BARE_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "bytes", "list", "dict"})


def _is_union_tag(part: str | int) -> bool:
    """Pydantic puts the union member it tried into `loc` ('list[int]', 'str',
    'function-after[...]', a model's class name); those are noise in a field path. Field names
    here are snake_case, so they never look like these."""
    if not isinstance(part, str):
        return False
    return ("[" in part or "-" in part or part in _BARE_TYPE_TAGS
            or (part[:1].isupper() and part.isidentifier()))


def _describe(err: Mapping[str, Any], from_fastapi: bool) -> tuple[list[str], str, bool]:
    """(field path, message, whether it is one failed alternative of a union) for one error."""
    loc = list(err.get("loc", ()))
    if from_fastapi and loc and loc[0] in _REQUEST_PARTS:
        loc = loc[1:]
    ctx = err.get("ctx") or {}
    kind = err.get("type", "")
    msg = str(err.get("msg", "invalid value"))
    union_member = bool(loc) and _is_union_tag(loc[-1])
    parts = [str(p) for p in loc if not _is_union_tag(p)]
    if kind == "json_invalid":
        return [], f"invalid JSON body: {ctx.get('error', msg)}", False
    if kind == _CUSTOM_ERROR:
        msg = str(ctx.get("message", msg))
        if ctx.get("field"):
            parts.append(str(ctx["field"]))
    elif msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if kind == "extra_forbidden":
        msg = "Unrecognized request argument supplied: " + ".".join(parts)
    return parts, msg, union_member


def validation_error_to_openai(
    exc: ValidationError | Sequence[Mapping[str, Any]],
) -> tuple[str, str | None]:
    """(message, param) for a pydantic `ValidationError` or FastAPI's
    `RequestValidationError.errors()` (whose locations start with "body").

    Every distinct problem is listed, each as "field.path: what is wrong"; `param` is the path
    of the first. Errors raised by our own cross-field checks carry their field in `ctx`.
    Where a union failed, pydantic reports one error per alternative: an alternative that got
    deeper into the value is the informative one, so shallow mismatches are dropped, and
    alternatives failing at the same place are merged ("... or ...").
    """
    from_fastapi = not isinstance(exc, ValidationError)
    errors = exc.errors(include_url=False) if isinstance(exc, ValidationError) else list(exc)
    described = [_describe(err, from_fastapi) for err in errors]
    paths = [tuple(parts) for parts, _, _ in described]
    merged: dict[tuple[str, ...], list[str]] = {}
    for (_, msg, union_member), path in zip(described, paths):
        if union_member and any(len(o) > len(path) and o[: len(path)] == path for o in paths):
            continue
        bucket = merged.setdefault(path, [])
        if msg not in bucket:
            bucket.append(msg)
    messages = []
    for path, msgs in merged.items():
        text = " or ".join(msgs)
        if not text.startswith(("Unrecognized request argument", "invalid JSON body")):
            text = f"{'.'.join(path) or 'request body'}: {text}"
        messages.append(text)
    param = next((".".join(p) for p in merged if p), None)
    return "; ".join(messages) or "invalid request", param
