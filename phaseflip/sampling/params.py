"""Per-request sampling parameters and their validation.

Validation lives here (not in the sampler) so that a bad request is rejected with a precise
`InvalidRequestError` before it reaches the batch, where one bad row would poison everyone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from phaseflip.errors import InvalidRequestError
from phaseflip.sampling.grammar import GrammarSpec

MAX_N = 128
PENALTY_RANGE = 2.0
LOGIT_BIAS_RANGE = 100.0
TOP_K_MAX = 2**31 - 1  # any k past the vocabulary keeps every token
# Sizes a request may give; each is checked by the engine every step it runs (stop strings
# against the text's end, stop ids against each token, the bias added to each row), so an
# unbounded one slowed every other request's steps, and its checks held the front end.
MAX_STOP_STRINGS = 16  # more generous than OpenAI's 4
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 4096  # OpenAI takes 300


def _is_int(x: Any) -> bool:
    # bool is a subclass of int; `max_new_tokens=True` is a client bug, not the number 1.
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _require_int(value: Any, param: str) -> int:
    if not _is_int(value):
        raise InvalidRequestError(
            f"{param} must be an integer, got {value!r} ({type(value).__name__})", param=param
        )
    return value


def _require_finite(value: Any, param: str) -> float:
    if not _is_real(value) or not math.isfinite(value):
        raise InvalidRequestError(f"{param} must be a finite number, got {value!r}", param=param)
    return float(value)


@dataclass
class SamplingParams:
    """How to pick tokens for one request. Treat as immutable; derive variants with `replace`."""

    max_new_tokens: int = 16
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    n: int = 1
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # what the output must match (JSON schema, regex, EBNF); None: unconstrained
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        # OpenAI accepts `stop: "foo"`; normalise so the rest of the engine sees one shape.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = _as_list(self.stop, "stop", "a string or a list of strings")
        self.stop_token_ids = ([] if self.stop_token_ids is None else
                               _as_list(self.stop_token_ids, "stop_token_ids",
                                        "a list of token ids"))

    @property
    def is_greedy(self) -> bool:
        """True when the choice is a deterministic argmax, so no random draw is needed."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """True when logits must be edited per row before choosing (the sampler's slow path)."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or bool(self.logit_bias)
        )

    def validate(self, vocab_size: int, max_logprobs: int = 20,
                 build_grammar: bool = True) -> None:
        """Raise `InvalidRequestError` naming the first bad field; NaN and bools are rejected.
        `build_grammar=False` (the engine loop) checks only the grammar's shape: building and
        compiling it is the `GrammarBook`'s, off the loop."""
        self._validate_lengths()
        self._validate_choice()
        self._validate_logit_bias(vocab_size)
        self._validate_stops(vocab_size)
        self._validate_grammar(build_grammar)
        self._validate_logprobs(max_logprobs)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):  # "no" would read as True
                raise InvalidRequestError(
                    f"{name} must be true or false, got {getattr(self, name)!r}", param=name)

    def _validate_lengths(self) -> None:
        max_new = _require_int(self.max_new_tokens, "max_new_tokens")
        if max_new < 0:
            raise InvalidRequestError(
                f"max_new_tokens must be >= 0, got {max_new}", param="max_new_tokens"
            )
        min_new = _require_int(self.min_new_tokens, "min_new_tokens")
        if min_new < 0:
            raise InvalidRequestError(
                f"min_new_tokens must be >= 0, got {min_new}", param="min_new_tokens"
            )
        if min_new > max_new:
            raise InvalidRequestError(
                f"min_new_tokens ({min_new}) must not exceed max_new_tokens ({max_new})",
                param="min_new_tokens",
            )

    def _validate_choice(self) -> None:
        temperature = _require_finite(self.temperature, "temperature")
        if temperature < 0:
            raise InvalidRequestError(
                f"temperature must be >= 0 (0 means greedy), got {temperature}",
                param="temperature",
            )
        top_p = _require_finite(self.top_p, "top_p")
        if not 0.0 < top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {top_p}", param="top_p")
        top_k = _require_int(self.top_k, "top_k")
        if not -1 <= top_k <= TOP_K_MAX:  # past the vocabulary it filters nothing; past
            raise InvalidRequestError(  # int32 it overflowed the sampler's tensors
                f"top_k must be -1 or 0 (disabled) or a positive integer up to {TOP_K_MAX}, "
                f"got {top_k}",
                param="top_k",
            )
        min_p = _require_finite(self.min_p, "min_p")
        if not 0.0 <= min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {min_p}", param="min_p")
        rep = _require_finite(self.repetition_penalty, "repetition_penalty")
        if rep <= 0:
            raise InvalidRequestError(
                f"repetition_penalty must be > 0 (1 disables it), got {rep}",
                param="repetition_penalty",
            )
        for name in ("frequency_penalty", "presence_penalty"):
            value = _require_finite(getattr(self, name), name)
            if not -PENALTY_RANGE <= value <= PENALTY_RANGE:
                raise InvalidRequestError(
                    f"{name} must be in [-{PENALTY_RANGE}, {PENALTY_RANGE}], got {value}",
                    param=name,
                )

    def _validate_logit_bias(self, vocab_size: int) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidRequestError(
                    "logit_bias must be a mapping of token id to bias", param="logit_bias"
                )
            _check_count(self.logit_bias, MAX_LOGIT_BIAS, "logit_bias", "entries")
            for token, bias in self.logit_bias.items():
                if not _is_int(token) or not 0 <= token < vocab_size:
                    raise InvalidRequestError(
                        f"logit_bias token id {token!r} is outside the vocabulary "
                        f"[0, {vocab_size})",
                        param="logit_bias",
                    )
                if not _is_real(bias) or not math.isfinite(bias) or abs(bias) > LOGIT_BIAS_RANGE:
                    raise InvalidRequestError(
                        f"logit_bias value for token {token} must be a finite number in "
                        f"[-{LOGIT_BIAS_RANGE}, {LOGIT_BIAS_RANGE}], got {bias!r}",
                        param="logit_bias",
                    )

    def _validate_stops(self, vocab_size: int) -> None:
        n = _require_int(self.n, "n")
        if not 1 <= n <= MAX_N:
            raise InvalidRequestError(f"n must be in [1, {MAX_N}], got {n}", param="n")
        if self.seed is not None:
            _require_int(self.seed, "seed")

        _check_count(self.stop, MAX_STOP_STRINGS, "stop", "stop strings")
        _check_count(self.stop_token_ids, MAX_STOP_TOKEN_IDS, "stop_token_ids", "entries")
        for s in self.stop:
            if isinstance(s, str) and len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(
                    f"stop strings may have at most {MAX_STOP_STRING_CHARS} characters, got "
                    f"one of {len(s)}", param="stop")
            if not isinstance(s, str) or s == "":
                raise InvalidRequestError(
                    f"stop strings must be non-empty strings, got {s!r}", param="stop"
                )
        for token in self.stop_token_ids:
            if not _is_int(token) or not 0 <= token < vocab_size:
                raise InvalidRequestError(
                    f"stop_token_ids entry {token!r} is outside the vocabulary [0, {vocab_size})",
                    param="stop_token_ids",
                )

    def _validate_grammar(self, build: bool) -> None:
        if self.grammar is not None:
            if not isinstance(self.grammar, GrammarSpec):
                raise InvalidRequestError("grammar must be a GrammarSpec", param="grammar")
            if build:
                self.grammar.check()
            else:
                self.grammar.check_shape()
            if self.min_new_tokens:  # a complete output may allow nothing but EOS
                raise InvalidRequestError(
                    "min_new_tokens cannot be combined with a grammar (response_format, tools, "
                    "regex/ebnf/json_schema): the grammar decides where the output ends",
                    param="min_new_tokens")
            if self.ignore_eos:  # a complete output allows only EOS: it would be sampled again
                raise InvalidRequestError(  # and break the grammar (the engine process died)
                    "ignore_eos cannot be combined with a grammar (response_format, tools, "
                    "regex/ebnf/json_schema): the grammar decides where the output ends",
                    param="ignore_eos")

    def _validate_logprobs(self, max_logprobs: int) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            _require_int(value, name)
            if not 0 <= value <= max_logprobs:
                raise InvalidRequestError(
                    f"{name} must be in [0, {max_logprobs}], got {value}", param=name
                )


def _check_count(items: list | dict, limit: int, param: str, what: str) -> None:
    if len(items) > limit:
        raise InvalidRequestError(f"{param} may have at most {limit} {what}, got {len(items)}",
                                  param=param)


def _as_list(value: object, name: str, what: str) -> list:
    """`value` as a list; a non-iterable (`stop: 5`, from the Python API) is the
    caller's 4xx naming the field, not list()'s TypeError."""
    if isinstance(value, list | tuple):
        return list(value)
    raise InvalidRequestError(f"{name} must be {what}, got {type(value).__name__}", param=name)
