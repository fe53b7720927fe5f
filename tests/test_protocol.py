"""The wire format's requests: what is accepted, what is refused with which message, and how
requests map to SamplingParams (responses: test_protocol_responses.py)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from phaseflip.server.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
    error_body,
    unsupported,
    validation_error_to_openai,
)

NAN = float("nan")
INF = float("inf")
USER = [{"role": "user", "content": "hi"}]


def comp(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "hello", **kw}


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": USER, **kw}


def gen(**kw: Any) -> dict[str, Any]:
    return {"text": "hello", **kw}


def rejected(cls: type[BaseModel], body: dict[str, Any]) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as info:
        cls.model_validate(body)
    return validation_error_to_openai(info.value)


# ---------------------------------------------------------------------------------------------
# Requests: accepted
# ---------------------------------------------------------------------------------------------

VALID_COMPLETIONS: list[tuple[dict[str, Any], Callable[[CompletionRequest], bool]]] = [
    (comp(), lambda r: r.max_tokens == 16 and r.temperature == 1.0 and r.n == 1),
    (comp(prompt=["a", "b"]), lambda r: r.prompt == ["a", "b"]),
    (comp(prompt=[1, 2, 0]), lambda r: r.prompt == [1, 2, 0]),
    (comp(prompt=[[1], [2, 3]]), lambda r: r.prompt == [[1], [2, 3]]),
    (comp(max_tokens=None), lambda r: r.max_tokens == 16),
    (comp(max_tokens=0, echo=True), lambda r: r.max_tokens == 0 and r.echo),
    (comp(temperature=0), lambda r: r.temperature == 0.0),
    (comp(temperature=2, top_p=1), lambda r: r.temperature == 2.0),
    (comp(temperature=None, n=None, stream=None, top_p=None), lambda r: r.temperature == 1.0
     and r.n == 1 and r.stream is False and r.top_p == 1.0),
    (comp(n=2, best_of=2), lambda r: r.best_of == 2),
    (comp(n=2, best_of=5), lambda r: r.best_of == 5),
    (comp(stream=True, stream_options={"include_usage": True}), lambda r: r.include_usage),
    (comp(stream=True, stream_options=None), lambda r: not r.include_usage),
    (comp(logprobs=0), lambda r: r.logprobs == 0),
    (comp(logprobs=20), lambda r: r.logprobs == 20),
    (comp(stop="x"), lambda r: r.stop == "x"),
    (comp(stop=[f"s{i}" for i in range(16)]), lambda r: len(r.stop) == 16),
    (comp(stop=[]), lambda r: r.stop == []),
    (comp(presence_penalty=-2, frequency_penalty=2), lambda r: r.presence_penalty == -2.0),
    (comp(logit_bias={"5": -100, "0": 100.0}), lambda r: r.logit_bias == {"5": -100, "0": 100}),
    (comp(seed=-1, user="u"), lambda r: r.seed == -1 and r.user == "u"),
    (comp(suffix="tail"), lambda r: r.suffix == "tail"),
    (comp(top_k=0, min_p=0.5, repetition_penalty=1.1, min_tokens=3, ignore_eos=True),
     lambda r: r.top_k == 0 and r.min_tokens == 3 and r.ignore_eos),
    (comp(top_k=-1, stop_token_ids=[1, 2], skip_special_tokens=False,
          include_stop_str_in_output=True),
     lambda r: r.stop_token_ids == [1, 2] and not r.skip_special_tokens),
    (comp(max_tokens=5, min_tokens=5), lambda r: r.min_tokens == 5),
]


@pytest.mark.parametrize(("body", "check"), VALID_COMPLETIONS)
def test_valid_completion_requests(body: dict[str, Any], check: Callable[..., bool]) -> None:
    assert check(CompletionRequest.model_validate(body))


VALID_CHATS: list[tuple[dict[str, Any], Callable[[ChatCompletionRequest], bool]]] = [
    (chat(), lambda r: r.requested_max_tokens is None and r.add_generation_prompt),
    (chat(messages=[{"role": r, "content": "x"} for r in
                    ("system", "developer", "user", "assistant", "tool")]),
     lambda r: len(r.messages) == 5),
    (chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                 {"type": "text", "text": "b"}]}]),
     lambda r: r.messages[0].text() == "a\nb"),
    (chat(messages=[{"role": "user", "content": "x", "name": "bob"}]),
     lambda r: r.messages[0].name == "bob"),
    (chat(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]),
     lambda r: r.messages[0].content is None),
    (chat(max_tokens=7), lambda r: r.requested_max_tokens == 7),
    (chat(max_completion_tokens=9), lambda r: r.requested_max_tokens == 9),
    (chat(max_tokens=7, max_completion_tokens=9), lambda r: r.requested_max_tokens == 9),
    (chat(logprobs=True), lambda r: r.logprobs and r.top_logprobs is None),
    (chat(logprobs=True, top_logprobs=20), lambda r: r.top_logprobs == 20),
    (chat(logprobs=None, top_logprobs=None), lambda r: r.logprobs is False),
    (chat(response_format={"type": "text"}), lambda r: r.response_format is not None),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     lambda r: r.response_format is not None and r.response_format.type == "json_schema"),
    (chat(tools=[{"type": "function"}], tool_choice="auto"), lambda r: r.tools is not None),
    (chat(tool_choice={"type": "function", "function": {"name": "f"}}),
     lambda r: isinstance(r.tool_choice, dict)),
    (chat(functions=[{"name": "f"}], function_call="auto"), lambda r: r.functions is not None),
    (chat(add_generation_prompt=False, chat_template_kwargs={"enable_thinking": False}),
     lambda r: not r.add_generation_prompt and r.chat_template_kwargs is not None),
    (chat(top_k=5, min_p=0.1, repetition_penalty=1.2, min_tokens=1, ignore_eos=True,
          stop_token_ids=[3], skip_special_tokens=False, include_stop_str_in_output=True),
     lambda r: r.top_k == 5 and r.stop_token_ids == [3]),
    (chat(stream=True, stream_options={"include_usage": False, "include_obfuscation": False}),
     lambda r: r.stream and not r.include_usage),
]


@pytest.mark.parametrize(("body", "check"), VALID_CHATS)
def test_valid_chat_requests(body: dict[str, Any], check: Callable[..., bool]) -> None:
    assert check(ChatCompletionRequest.model_validate(body))


VALID_OTHERS: list[tuple[type[BaseModel], dict[str, Any]]] = [
    (GenerateRequest, gen()),
    (GenerateRequest, gen(text=["a", "b"])),
    (GenerateRequest, {"input_ids": [1, 2]}),
    (GenerateRequest, {"input_ids": [[1], [2]], "stream": True, "rid": "r1"}),
    (GenerateRequest, gen(sampling_params={"max_new_tokens": 3, "temperature": 0,
                                           "stop": "x", "logit_bias": {"1": 2.0}})),
    (GenerateRequest, gen(return_logprob=True, top_logprobs_num=5, logprob_start_len=0)),
    (TokenizeRequest, {"prompt": "hi"}),
    (TokenizeRequest, {"prompt": ""}),
    (TokenizeRequest, {"model": "m", "messages": USER, "add_special_tokens": False}),
    (DetokenizeRequest, {"tokens": [1, 2, 3]}),
    (DetokenizeRequest, {"model": "m", "tokens": []}),
    (AbortRequest, {"rid": "abc"}),
    (AbortRequest, {"abort_all": True}),
    (GenerateRequest, gen(text=["a", "b"], rid=["x", "y"], sampling_params=[{}, {"n": 2}],
                          image_data=None, lora_path=None, return_hidden_states=False,
                          log_metrics=True, return_text_in_logprobs=False)),
    (GenerateRequest, gen(sampling_params={"no_stop_trim": True, "stop_regex": None,
                                           "spaces_between_special_tokens": True})),
]


@pytest.mark.parametrize(("cls", "body"), VALID_OTHERS)
def test_valid_other_requests(cls: type[BaseModel], body: dict[str, Any]) -> None:
    cls.model_validate(body)


# ---------------------------------------------------------------------------------------------
# Requests: rejected, with a message naming the field
# ---------------------------------------------------------------------------------------------

INVALID: list[tuple[type[BaseModel], dict[str, Any], str, str]] = [
    # (model, body, expected param, expected message fragment)
    (CompletionRequest, {"prompt": "x"}, "model", "Field required"),
    (CompletionRequest, {"model": "m"}, "prompt", "Field required"),
    (CompletionRequest, comp(model=None), "model", "valid string"),
    (CompletionRequest, comp(prompt=""), "prompt", "must not be empty"),
    (CompletionRequest, comp(prompt=[]), "prompt", "must not be empty"),
    (CompletionRequest, comp(prompt=["a", ""]), "prompt", "empty strings"),
    (CompletionRequest, comp(prompt=[[1], []]), "prompt", "must not be empty"),
    (CompletionRequest, comp(prompt=[1, -1]), "prompt", "non-negative"),
    (CompletionRequest, comp(prompt=[[1, -2]]), "prompt", "non-negative"),
    (CompletionRequest, comp(prompt=[1, "a"]), "prompt", "mixed"),
    (CompletionRequest, comp(prompt=[1.5]), "prompt", "non-negative integer"),
    (CompletionRequest, comp(prompt=[True]), "prompt", "non-negative integer"),
    (CompletionRequest, comp(prompt=5), "prompt", "got int"),
    (CompletionRequest, comp(temperature=2.5), "temperature", "less than or equal to 2"),
    (CompletionRequest, comp(temperature=-0.1), "temperature", "greater than or equal to 0"),
    (CompletionRequest, comp(temperature="0.5"), "temperature", "valid number"),
    (CompletionRequest, comp(temperature=True), "temperature", "valid number"),
    (CompletionRequest, comp(temperature=NAN), "temperature", "finite number"),
    (CompletionRequest, comp(top_p=0), "top_p", "greater than 0"),
    (CompletionRequest, comp(top_p=1.01), "top_p", "less than or equal to 1"),
    (CompletionRequest, comp(n=0), "n", "greater than or equal to 1"),
    (CompletionRequest, comp(n=129), "n", "less than or equal to 128"),
    (CompletionRequest, comp(n=1.0), "n", "valid integer"),
    (CompletionRequest, comp(n="2"), "n", "valid integer"),
    (CompletionRequest, comp(max_tokens=-1), "max_tokens", "greater than or equal to 0"),
    (CompletionRequest, comp(max_tokens=True), "max_tokens", "valid integer"),
    (CompletionRequest, comp(n=3, best_of=2), "best_of", "greater than or equal to n"),
    (CompletionRequest, comp(n=1, best_of=3, stream=True), "best_of", "streamed"),
    (CompletionRequest, comp(stream_options={"include_usage": True}), "stream_options",
     "only allowed when stream is true"),
    (CompletionRequest, comp(stream=True, stream_options={"include_usage": True, "x": 1}),
     "stream_options.x", "Unrecognized"),
    (CompletionRequest, comp(logprobs=21), "logprobs", "less than or equal to 20"),
    (CompletionRequest, comp(logprobs=-1), "logprobs", "greater than or equal to 0"),
    (CompletionRequest, comp(logprobs=True), "logprobs", "valid integer"),
    (CompletionRequest, comp(stop=[f"s{i}" for i in range(17)]), "stop", "at most 16"),
    (CompletionRequest, comp(stop=""), "stop", "must not be empty"),
    (CompletionRequest, comp(stop=["a", ""]), "stop", "must not be empty"),
    (CompletionRequest, comp(stop=5), "stop", "string or a list of strings"),
    (CompletionRequest, comp(presence_penalty=2.1), "presence_penalty", "less than or equal"),
    (CompletionRequest, comp(frequency_penalty=-3), "frequency_penalty", "greater than"),
    (CompletionRequest, comp(logit_bias={"abc": 1}), "logit_bias", "decimal strings"),
    (CompletionRequest, comp(logit_bias={"-1": 1}), "logit_bias", "decimal strings"),
    (CompletionRequest, comp(logit_bias={"5": 101}), "logit_bias.5", "less than or equal"),
    (CompletionRequest, comp(logit_bias={"5": NAN}), "logit_bias.5", "finite number"),
    (CompletionRequest, comp(logit_bias=[1]), "logit_bias", "valid dictionary"),
    (CompletionRequest, comp(seed=1.5), "seed", "valid integer"),
    (CompletionRequest, comp(seed=2**64), "seed", "less than or equal"),
    (CompletionRequest, comp(echo="yes"), "echo", "valid boolean"),
    (CompletionRequest, comp(top_k=-2), "top_k", "greater than or equal to -1"),
    (CompletionRequest, comp(min_p=1.5), "min_p", "less than or equal to 1"),
    (CompletionRequest, comp(repetition_penalty=0), "repetition_penalty", "greater than 0"),
    (CompletionRequest, comp(min_tokens=-1), "min_tokens", "greater than or equal to 0"),
    (CompletionRequest, comp(max_tokens=2, min_tokens=3), "min_tokens", "must not exceed"),
    (CompletionRequest, comp(stop_token_ids=[-1]), "stop_token_ids.0", "greater than or equal"),
    (CompletionRequest, comp(request_id="x"), "request_id", "Unrecognized request argument"),
    (CompletionRequest, comp(tools=[]), "tools", "Unrecognized request argument"),
    (ChatCompletionRequest, {"model": "m"}, "messages", "Field required"),
    (ChatCompletionRequest, chat(messages=[]), "messages", "at least 1 item"),
    (ChatCompletionRequest, chat(messages="hi"), "messages", "valid list"),
    (ChatCompletionRequest, chat(messages=[{"role": "bot", "content": "x"}]),
     "messages.0.role", "'system', 'user', 'assistant', 'tool' or 'developer'"),
    (ChatCompletionRequest, chat(messages=[{"role": "user"}]), "messages.0.content",
     "content is required"),
    (ChatCompletionRequest, chat(messages=[{"role": "assistant", "content": None}]),
     "messages.0.content", "content is required"),
    (ChatCompletionRequest, chat(messages=[{"role": "user", "content": 5}]),
     "messages.0.content", "string or a list of content parts"),
    (ChatCompletionRequest,
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     "messages.0.content", "only text content is supported"),
    (ChatCompletionRequest, chat(messages=[{"role": "user", "content": ["hi"]}]),
     "messages.0.content", "content parts must be objects"),
    (ChatCompletionRequest, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
     "messages.0.content", "string `text`"),
    (ChatCompletionRequest,
     chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]),
     "messages.0.content.0.x", "Unrecognized request argument"),
    (ChatCompletionRequest, chat(messages=[{"role": "user", "content": "x", "foo": 1}]),
     "messages.0.foo", "Unrecognized request argument"),
    (ChatCompletionRequest, chat(top_logprobs=2), "top_logprobs", "requires logprobs"),
    (ChatCompletionRequest, chat(logprobs=False, top_logprobs=0), "top_logprobs",
     "requires logprobs"),
    (ChatCompletionRequest, chat(logprobs=True, top_logprobs=21), "top_logprobs",
     "less than or equal to 20"),
    (ChatCompletionRequest, chat(logprobs=1), "logprobs", "valid boolean"),
    (ChatCompletionRequest, chat(stream=False, stream_options={"include_usage": True}),
     "stream_options", "only allowed when stream is true"),
    (ChatCompletionRequest, chat(max_completion_tokens=-1), "max_completion_tokens",
     "greater than or equal to 1"),
    (ChatCompletionRequest, chat(max_tokens=10, max_completion_tokens=2, min_tokens=3),
     "min_tokens", "must not exceed"),
    (ChatCompletionRequest, chat(response_format={"type": "xml"}), "response_format.type",
     "'text', 'json_object' or 'json_schema'"),
    (ChatCompletionRequest, chat(tool_choice=5), "tool_choice", "string"),
    (ChatCompletionRequest, chat(best_of=2), "best_of", "Unrecognized request argument"),
    (ChatCompletionRequest, chat(echo=True), "echo", "Unrecognized request argument"),
    (ChatCompletionRequest, chat(temperature=INF), "temperature", "finite number"),
    (ChatCompletionRequest, chat(chat_template_kwargs=[1]), "chat_template_kwargs",
     "valid dictionary"),
    (GenerateRequest, {}, "text", "exactly one of text and input_ids"),
    (GenerateRequest, gen(input_ids=[1]), "text", "exactly one of text and input_ids"),
    (GenerateRequest, gen(text=""), "text", "must not be empty"),
    (GenerateRequest, gen(text=[1, 2]), "text", "got"),
    (GenerateRequest, {"input_ids": "abc"}, "input_ids", "got str"),
    (GenerateRequest, {"input_ids": [[]]}, "input_ids", "must not be empty"),
    (GenerateRequest, {"input_ids": [0, -5]}, "input_ids", "non-negative"),
    (GenerateRequest, gen(sampling_params={"max_tokens": 3}), "sampling_params.max_tokens",
     "Unrecognized request argument"),
    (GenerateRequest, gen(sampling_params={"logprobs": 3}), "sampling_params.logprobs",
     "return_logprob"),
    (GenerateRequest, gen(sampling_params={"prompt_logprobs": 3}),
     "sampling_params.prompt_logprobs", "return_logprob"),
    (GenerateRequest, gen(sampling_params={"temperature": NAN}), "sampling_params.temperature",
     "finite number"),
    (GenerateRequest, gen(sampling_params={"max_new_tokens": "5"}),
     "sampling_params.max_new_tokens", "valid integer"),
    (GenerateRequest, gen(sampling_params={"logit_bias": {"x": 1.0}}),
     "sampling_params.logit_bias", "decimal strings"),
    (GenerateRequest, gen(sampling_params=[1]), "sampling_params.0", "valid dictionary"),
    (GenerateRequest, gen(sampling_params=[{}, {}]), "sampling_params", "given bare"),
    (GenerateRequest, gen(rid=["a"]), "rid", "given bare"),
    (GenerateRequest, gen(text=["a", "b"], rid=["x"]), "rid", "1 entries for 2 prompts"),
    (GenerateRequest, gen(text=["a", "b"], rid=["x", "x"]), "rid", "duplicate"),
    (GenerateRequest, gen(image_data="x.png"), "image_data", "not supported"),
    (GenerateRequest, gen(sampling_params={"stop_regex": "a+"}), "sampling_params.stop_regex",
     "not supported"),
    (GenerateRequest, gen(top_logprobs_num=2), "top_logprobs_num", "requires return_logprob"),
    (GenerateRequest, gen(logprob_start_len=0), "logprob_start_len", "requires return_logprob"),
    (GenerateRequest, gen(return_logprob=True, top_logprobs_num=21), "top_logprobs_num",
     "less than or equal to 20"),
    (GenerateRequest, gen(return_logprob=True, logprob_start_len=-2), "logprob_start_len",
     "greater than or equal to -1"),
    (GenerateRequest, gen(rid=""), "rid", "at least 1 character"),
    (GenerateRequest, gen(foo=1), "foo", "Unrecognized request argument"),
    (TokenizeRequest, {}, "prompt", "exactly one of prompt and messages"),
    (TokenizeRequest, {"prompt": "a", "messages": USER}, "prompt", "exactly one"),
    (TokenizeRequest, {"messages": []}, "messages", "at least 1 item"),
    (TokenizeRequest, {"prompt": 5}, "prompt", "valid string"),
    (DetokenizeRequest, {}, "tokens", "Field required"),
    (DetokenizeRequest, {"tokens": [1, -1]}, "tokens.1", "greater than or equal to 0"),
    (DetokenizeRequest, {"tokens": ["1"]}, "tokens.0", "valid integer"),
    (AbortRequest, {}, "rid", "rid is required"),
    (AbortRequest, {"rid": ""}, "rid", "rid is required"),
    (AbortRequest, {"rid": "a", "x": 1}, "x", "Unrecognized request argument"),
]


@pytest.mark.parametrize(("cls", "body", "param", "fragment"), INVALID,
                         ids=[f"{c.__name__}-{i}" for i, (c, *_) in enumerate(INVALID)])
def test_invalid_requests(cls: type[BaseModel], body: dict[str, Any], param: str,
                          fragment: str) -> None:
    message, got_param = rejected(cls, body)
    assert got_param == param, message
    assert fragment in message
    assert message.startswith(("Unrecognized", param + ":")), message


FLOAT_FIELDS = ["temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p",
                "repetition_penalty"]


@pytest.mark.parametrize("value", [NAN, INF, -INF])
@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("make", [comp, chat], ids=["completion", "chat"])
def test_non_finite_floats_rejected(make: Callable[..., dict[str, Any]], field: str,
                                    value: float) -> None:
    cls = CompletionRequest if make is comp else ChatCompletionRequest
    message, param = rejected(cls, make(**{field: value}))
    assert param == field
    assert "finite number" in message


def test_all_errors_reported_first_one_is_param() -> None:
    message, param = rejected(CompletionRequest, comp(top_p=0, n=0))
    assert param == "top_p"
    assert message == ("top_p: Input should be greater than 0; "
                       "n: Input should be greater than or equal to 1")


def test_null_means_default_also_for_completions_max_tokens() -> None:
    req = CompletionRequest.model_validate(comp(
        temperature=None, top_p=None, n=None, echo=None, top_k=None, skip_special_tokens=None,
        stop_token_ids=None, presence_penalty=None, max_tokens=None))
    assert (req.temperature, req.top_p, req.n, req.echo, req.top_k) == (1.0, 1.0, 1, False, -1)
    assert req.skip_special_tokens is True and req.stop_token_ids == []
    assert req.max_tokens == 16  # OpenAI's completions default: null is not "to the context"
    assert CompletionRequest.model_validate(comp()).max_tokens == 16


def test_json_input_with_nan_literal_rejected() -> None:
    # Python's json (what Starlette uses) accepts the non-standard NaN literal.
    body = json.loads('{"model": "m", "prompt": "x", "temperature": NaN}')
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate(body)
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate_json('{"model": "m", "prompt": "x", "top_p": NaN}')


# ---------------------------------------------------------------------------------------------
# validation_error_to_openai on FastAPI-shaped errors
# ---------------------------------------------------------------------------------------------


def test_fastapi_error_list_strips_body_and_keeps_ctx_field() -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate(comp(n=3, best_of=2, temperature=9))
    errors = [{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()]
    message, param = validation_error_to_openai(errors)
    assert param == "temperature"
    assert message == "temperature: Input should be less than or equal to 2"
    # Cross-field errors run after field validation succeeds, so alone they name their field.
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate(comp(n=3, best_of=2))
    errors = [{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()]
    assert validation_error_to_openai(errors) == (
        "best_of: best_of (2) must be greater than or equal to n (3)", "best_of")


def test_fastapi_json_and_body_errors() -> None:
    assert validation_error_to_openai([{
        "type": "json_invalid", "loc": ("body", 12), "msg": "JSON decode error",
        "ctx": {"error": "Expecting value"}}]) == ("invalid JSON body: Expecting value", None)
    assert validation_error_to_openai([{
        "type": "missing", "loc": ("body",), "msg": "Field required"}]) == (
        "request body: Field required", None)


def test_union_alternatives_merged_or_dropped() -> None:
    # A union nobody pre-checks: alternatives failing at the same place are merged, and a
    # shallow mismatch is dropped when another alternative got deeper.
    errors = [
        {"type": "string_type", "loc": ("body", "x", "str"), "msg": "Input should be a string"},
        {"type": "int_type", "loc": ("body", "x", "int"), "msg": "Input should be an int"},
    ]
    assert validation_error_to_openai(errors) == (
        "x: Input should be a string or Input should be an int", "x")
    errors = [
        {"type": "string_type", "loc": ("body", "x", "str"), "msg": "Input should be a string"},
        {"type": "int_type", "loc": ("body", "x", "list[Part]", 0, "text"), "msg": "bad text"},
    ]
    assert validation_error_to_openai(errors) == ("x.0.text: bad text", "x.0.text")


def test_with_real_fastapi_request_validation() -> None:
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from fastapi.testclient import TestClient

    app = FastAPI()

    @app.exception_handler(RequestValidationError)
    async def handler(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_error_to_openai(exc.errors())
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> dict[str, Any]:
        return {"n": req.n}

    client = TestClient(app)
    assert client.post("/v1/completions", json=comp(n=2)).json() == {"n": 2}
    r = client.post("/v1/completions", json=comp(temperature=3))
    assert r.status_code == 400
    assert r.json() == {"error": {
        "message": "temperature: Input should be less than or equal to 2",
        "type": "invalid_request_error", "param": "temperature", "code": None}}
    r = client.post("/v1/completions", json=comp(n=2, best_of=1))
    assert r.json()["error"]["param"] == "best_of"
    r = client.post("/v1/completions", content=b'{"model": "m", "prompt": "x", "top_p": NaN}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
    r = client.post("/v1/completions", content=b"{not json",
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("invalid JSON body")


# ---------------------------------------------------------------------------------------------
# unsupported()
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("cls", "body", "expected"), [
    (CompletionRequest, comp(), None),
    (CompletionRequest, comp(suffix=None), None),
    (CompletionRequest, comp(suffix=""), None),
    (CompletionRequest, comp(suffix="x"), "suffix"),
    (ChatCompletionRequest, chat(), None),
    (ChatCompletionRequest, chat(response_format={"type": "text"}), None),
    (ChatCompletionRequest, chat(tools=[]), None),
    (ChatCompletionRequest, chat(tool_choice="none"), None),
    (ChatCompletionRequest, chat(tool_choice="auto"), None),
    (ChatCompletionRequest, chat(function_call="none", functions=[]), None),
    # tools, tool_choice, response_format and replayed tool calls are served (issue 20;
    # their own checks: tests/test_structured_output.py)
    (ChatCompletionRequest, chat(tools=[{"type": "function"}]), None),
    (ChatCompletionRequest, chat(tool_choice="required"), None),
    (ChatCompletionRequest, chat(functions=[{"name": "f"}]), "functions"),
    (ChatCompletionRequest, chat(function_call={"name": "f"}), "function_call"),
    (ChatCompletionRequest, chat(response_format={"type": "json_object"}), None),
    (ChatCompletionRequest,
     chat(messages=[*USER, {"role": "assistant", "tool_calls": [{"id": "c"}]}]), None),
])
def test_unsupported(cls: type[BaseModel], body: dict[str, Any], expected: str | None) -> None:
    assert unsupported(cls.model_validate(body)) == expected  # type: ignore[arg-type]


def test_template_messages() -> None:
    req = ChatCompletionRequest.model_validate(chat(messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
         "name": "ann"},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]))
    assert req.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb", "name": "ann"},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]


def test_finite_check_is_not_vacuous() -> None:
    # Guards the NaN tests: a plain pydantic float would have accepted NaN.
    class Loose(BaseModel):
        x: float

    assert math.isnan(Loose(x=NAN).x)
