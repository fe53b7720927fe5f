"""The OpenAI-compatible request bodies, as pydantic models, and the strict types and checks
every request body shares (chat's body is in `chat.py`, the native endpoints' in `native.py`).

Why it is shaped the way it is:

* Requests reject unknown fields, as OpenAI's API does (HTTP 400), so a misspelt parameter is
  an error rather than a silently ignored knob. The `openai` client merges `extra_body` into the
  top level, so the vLLM/SGLang-style extras phaseflip honours (`top_k`, `min_p`, ...) are
  declared explicitly.
* Scalars are strict (no `"0.5"` for a float, no `true` for an int) and floats reject NaN/inf:
  a NaN temperature that slipped through would poison a whole batch on the device.
* An explicit `null` for an optional knob means "use the default", as in OpenAI's spec, except
  where `null` has a meaning of its own (chat's `max_tokens: null` = "as many as the context
  and the KV pool allow"; on completions it is OpenAI's default, 16).
* Our own validators raise errors that carry the offending field, so
  `validation_error_to_openai` can always name a `param`, even for cross-field rules.
* Response models are checked against the `openai` client's own types in the tests, so what we
  send is exactly what the official client parses.

Nothing here touches the engine: the conversion helpers map a request onto `SamplingParams`,
and the server runs `SamplingParams.validate` (vocabulary-dependent checks) afterwards.
"""

from __future__ import annotations

import contextlib
import json
import re
import types
import typing
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    model_validator,
)
from pydantic_core import PydanticCustomError

from phaseflip.sampling.grammar import MAX_GRAMMAR_CHARS
from phaseflip.sampling.params import (
    LOGIT_BIAS_RANGE,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    PENALTY_RANGE,
)
from phaseflip.sampling.surrogates import find_lone_surrogate, lone_surrogate_problem

MAX_LOGPROBS = 20
"""Most alternatives per position a request may ask for (OpenAI's limit for chat)."""
MAX_TOOLS = 128
"""OpenAI's limit on a request's tools (each is rendered into the prompt and, with a required
or named tool_choice, into the grammar)."""
VERY_UNLIKELY_LOGPROB = -9999.0
"""What OpenAI reports for a token outside the distribution; JSON has no -Infinity."""

_CUSTOM_ERROR = "phaseflip_invalid_value"
_TOKEN_ID_KEY = re.compile(r"[0-9]+")
_TEXT_OR_CONTAINER = frozenset({str, dict, list})


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
    if value is None:
        return value
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _fail("stop must be a string or a list of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise _fail(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
    if not all(stops):
        raise _fail("stop strings must not be empty")
    if (longest := max(map(len, stops), default=0)) > MAX_STOP_STRING_CHARS:
        raise _fail(f"stop strings may have at most {MAX_STOP_STRING_CHARS} characters, got "
                    f"one of {longest}")
    return value


def _at_most(limit: int, what: str) -> BeforeValidator:
    """A list or object of more than `limit` items, refused before any item is checked (a
    million items took seconds of the event loop)."""

    def check(value: Any) -> Any:
        if isinstance(value, list | dict) and len(value) > limit:
            raise _fail(f"at most {limit} {what} are allowed, got {len(value)}")
        return value

    return BeforeValidator(check)


def _text_at_most(limit: int, what: str) -> BeforeValidator:
    def check(value: Any) -> Any:
        if isinstance(value, str) and len(value) > limit:
            raise _fail(f"{what} has {len(value)} characters; this server takes at most "
                        f"{limit}")
        return value

    return BeforeValidator(check)


def _check_logit_bias(value: dict[str, float] | None) -> dict[str, float] | None:
    for key in value or {}:
        if not _TOKEN_ID_KEY.fullmatch(key):
            raise _fail(
                f"logit_bias keys must be token ids written as decimal strings, got {key!r}"
            )
    return value


# the min_length constraints repeat what the validator checks, so the OpenAPI schema says it
_Text = Annotated[str, Field(min_length=1)]
_Ids = Annotated[list[TokenId], Field(min_length=1)]
Prompt = Annotated[
    _Text | Annotated[list[_Text], Field(min_length=1)] | _Ids
    | Annotated[list[_Ids], Field(min_length=1)],
    _prompt_validator(strings=True, token_ids=True, what="prompt"),
]
Stop = Annotated[str | list[str] | None, BeforeValidator(_check_stop)]
LogitBias = Annotated[
    dict[str, Annotated[float, Strict(), Field(ge=-LOGIT_BIAS_RANGE, le=LOGIT_BIAS_RANGE)]]
    | None,
    AfterValidator(_check_logit_bias), _at_most(MAX_LOGIT_BIAS, "logit_bias entries"),
]
StopTokenIds = Annotated[list[TokenId], _at_most(MAX_STOP_TOKEN_IDS, "stop_token_ids")]
Tools = Annotated[list[dict[str, Any]] | None, _at_most(MAX_TOOLS, "tools")]
GrammarText = Annotated[str, Strict(), _text_at_most(MAX_GRAMMAR_CHARS, "the grammar")]
"""A regex, EBNF grammar or JSON schema (as text): compiling one takes time that grows faster
than its length (a 100 000-character regex: 9 s of a CPU core), on the engine's compile
threads, which no client can stop once it began."""


def _allows_none(annotation: Any) -> bool:
    if annotation is None or annotation is type(None):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_allows_none(a) for a in typing.get_args(annotation))
    return False


def _surely_valid_unicode(data: Any) -> bool:
    """Whether no text in `data` holds a lone surrogate, told in C: its JSON encodes as UTF-8
    (a walk in Python, `_find_surrogate`, took seconds of the event loop for a long list, and
    runs only to say where one is). An object of text and nulls alone (a message, a content
    part) is encoded as it is, 6 times faster than as JSON."""
    if isinstance(data, dict):
        try:
            "".join(data).encode()
            "".join(filter(None, data.values())).encode()  # (no null, nor any empty value)
            return True
        except TypeError:  # (a value that is not text: as JSON below)
            pass
        except UnicodeEncodeError:
            return False
    try:
        json.dumps(data, ensure_ascii=False, default=_opaque).encode()
    except (UnicodeEncodeError, TypeError, ValueError, RecursionError):
        return False  # (or keys JSON has not: walked)
    return True


def _opaque(_: Any) -> None:
    """What `_surely_valid_unicode` makes of an object that is not JSON (a model instance): as
    `_find_surrogate`, it does not look into it."""


def _find_surrogate(value: Any, path: str) -> tuple[str, str, int] | None:
    """(field path, text, index) of the first lone surrogate in any string of `value`."""
    if isinstance(value, str):
        found = find_lone_surrogate(value)
        return None if found is None else (path, value, found)
    # numbers only (under ASCII keys), told apart in C: a walk took seconds of a long list
    if isinstance(value, list) and _TEXT_OR_CONTAINER.isdisjoint(map(type, value)):
        return None
    if isinstance(value, dict) and _TEXT_OR_CONTAINER.isdisjoint(map(type, value.values())):
        with contextlib.suppress(TypeError):  # (a key that is not text: walked below)
            if "".join(value).isascii():
                return None
    items = value.items() if isinstance(value, dict) else (
        enumerate(value) if isinstance(value, list) else ())
    for key, item in items:
        # (only text and containers are looked into)
        if (isinstance(item, str) and item.isascii() or not isinstance(item, str | dict | list)
                ) and (not isinstance(key, str) or key.isascii()):
            continue
        where = f"{path}.{key}" if path else str(key)
        hit = _find_surrogate(key, where) or _find_surrogate(item, where)
        if hit is not None:
            return hit
    return None


class _Request(BaseModel):
    """Base of every request body: unknown fields are errors, NaN/inf are errors, text with a
    lone surrogate (JSON allows "\\ud800"; no tokenizer can encode it) is an error."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    _null_is_default: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        hit = None if _surely_valid_unicode(data) else _find_surrogate(data, "")
        if hit is not None:  # (a key may hold the surrogate: the path is escaped too)
            path, text, index = hit
            path = path.encode("utf-8", "backslashreplace").decode()
            raise _fail(lone_surrogate_problem(text, index), path or None)
        return data

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """Drop explicit nulls for optional fields that cannot hold None, so the default applies.

        OpenAI's spec marks nearly every knob nullable (`"temperature": null` is legal and means
        the default); declaring each as `X | None` would push None-handling into every consumer.
        """
        if not isinstance(data, dict) or None not in data.values():
            return data
        drop = cls._null_is_default
        return {k: v for k, v in data.items() if v is not None or k not in drop}

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        """Which fields `_null_means_default` drops a null for, worked out once per class
        (per field of each message it took 24 us)."""
        super().__pydantic_init_subclass__(**kwargs)
        cls._null_is_default = frozenset(
            k for k, f in cls.__pydantic_fields__.items()
            if not f.is_required() and not _allows_none(f.annotation))


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
    stop_token_ids: StopTokenIds = Field(default_factory=list)
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


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None
    """{"name": ..., "schema": {...}, "strict": ...}: the output is JSON valid against the
    schema (grammar-constrained, always strict)."""

    @model_validator(mode="after")
    def _schema_size(self) -> ResponseFormat:
        schema = (self.json_schema or {}).get("schema")
        if self.type == "json_schema" and isinstance(schema, dict):
            chars = len(json.dumps(schema))  # (the text the grammar is compiled from)
            if chars > MAX_GRAMMAR_CHARS:
                raise _fail(f"the schema is {chars} characters as JSON; this server compiles "
                            f"grammars of at most {MAX_GRAMMAR_CHARS}", "json_schema.schema")
        return self


class CompletionRequest(_OpenAISampling):
    """Body of `POST /v1/completions`."""

    prompt: Prompt
    suffix: Str | None = None
    """Accepted so the server can say "not supported" (see `unsupported`) instead of 'unknown'."""
    max_tokens: Annotated[int, Strict(), Field(ge=0)] = 16
    """OpenAI's completions default, 16; an explicit null means the default too, as in
    OpenAI's API (chat's null, by contrast, means "whatever the context leaves")."""
    best_of: NumChoices | None = None
    """Generate this many and return the `n` with the highest logprob per token."""
    logprobs: TopLogprobsNum | None = None
    """None: no logprobs; 0: the chosen token's; k: also the k most likely alternatives."""
    echo: Bool = False
    response_format: ResponseFormat | None = None
    """As on chat: json_object / json_schema constrain the completion (vLLM/SGLang extension)."""

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
