"""Request bodies → SamplingParams, and which requested features are unsupported."""

from __future__ import annotations

from dataclasses import fields as dataclass_fields
from typing import Any

from phaseflip.errors import InvalidRequestError
from phaseflip.sampling.grammar import GrammarSpec
from phaseflip.sampling.params import SamplingParams
from phaseflip.server.protocol.chat import ChatCompletionRequest
from phaseflip.server.protocol.native import (
    GenerateRequest,
)
from phaseflip.server.protocol.requests import (
    CompletionRequest,
    ResponseFormat,
    _OpenAISampling,
)

NATIVE_GRAMMARS = ("regex", "ebnf", "json_schema")

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


def response_format_grammar(fmt: ResponseFormat | None) -> GrammarSpec | None:
    """The grammar a `response_format` asks for (None for text). Only its shape is checked
    here: whether it compiles is `GrammarSpec.check`'s (xgrammar loads torch: the server runs
    it off its event loop)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        spec = GrammarSpec("json_object")
    else:
        body = fmt.json_schema
        if not isinstance(body, dict) or not isinstance(body.get("schema"), dict):
            raise InvalidRequestError(
                "response_format json_schema needs json_schema.schema, a JSON schema object "
                '(e.g. {"name": "answer", "schema": {"type": "object", ...}})',
                "response_format.json_schema.schema")
        spec = GrammarSpec.json_schema(body["schema"])
    return spec


def completion_sampling_params(req: CompletionRequest, default_max_tokens: int) -> SamplingParams:
    """Sampling parameters for a completions request.

    `max_tokens` is always set (null means OpenAI's default, 16), so `default_max_tokens` is
    unused here; the argument keeps the three builders alike. With `best_of > n` the engine
    samples `best_of` choices and the server keeps the `n` with the highest logprob per token;
    to rank them logprobs must be computed, so `logprobs` is at least 0 then and the server
    must drop them from the answer if `req.logprobs` is None.
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
        grammar=response_format_grammar(req.response_format),
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
        grammar=response_format_grammar(req.response_format),
    )


def generate_sampling_params(req: GenerateRequest, default_max_tokens: int,
                             prompt: int = 0) -> SamplingParams:
    """Sampling parameters for prompt `prompt` of a native request; `default_max_tokens`
    applies when `sampling_params.max_new_tokens` is absent (the server chooses it)."""
    given = req.params_of(prompt).model_dump(exclude_none=True)
    given.setdefault("max_new_tokens", default_max_tokens)
    given.pop("spaces_between_special_tokens", None)
    if "no_stop_trim" in given:
        given.setdefault("include_stop_str_in_output", given.pop("no_stop_trim"))
    if "logit_bias" in given:
        given["logit_bias"] = _logit_bias(given["logit_bias"])
    if given.get("top_k") == 0:
        given["top_k"] = -1
    for kind in NATIVE_GRAMMARS:  # (at most one: NativeSamplingParams checks)
        if kind in given:
            given["grammar"] = GrammarSpec(kind, given.pop(kind))  # (checked by the caller)
    if req.return_logprob:
        given["logprobs"] = req.top_logprobs_num
        if req.logprob_start_len >= 0:
            given["prompt_logprobs"] = req.top_logprobs_num
    return SamplingParams(**given)


def native_sampling_param_names() -> frozenset[str]:
    """`SamplingParams` fields settable through `sampling_params` (all but the logprob ones;
    the grammar as one of `regex`, `ebnf`, `json_schema`)."""
    return frozenset(f.name for f in dataclass_fields(SamplingParams)) - {
        "logprobs", "prompt_logprobs", "grammar"} | set(NATIVE_GRAMMARS)


def unsupported(req: CompletionRequest | ChatCompletionRequest) -> str | None:
    """Name of the first feature the request uses that phaseflip does not implement, else None.

    These fields are accepted by the schema on purpose: answering "functions is not supported"
    is more useful than "unrecognized argument" (`tools` is their successor, and served).
    """
    if isinstance(req, CompletionRequest):
        return "suffix" if req.suffix else None
    if req.functions:
        return "functions"
    if req.function_call not in (None, "none", "auto"):
        return "function_call"
    if req.modalities is not None and set(req.modalities) - {"text"}:
        return "modalities"
    return None
