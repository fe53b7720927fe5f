"""Our response bodies are exactly what the official `openai` client parses, field by field
and end to end through the client with HTTP mocked in-process (the requests side is in
test_protocol.py)."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import openai
import pytest
from openai._models import construct_type
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel, ValidationError

from phaseflip.server.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    ErrorResponse,
    ModelCard,
    ModelList,
    UsageInfo,
    chat_sampling_params,
    completion_sampling_params,
    error_body,
    validation_error_to_openai,
)

NAN = float("nan")
INF = float("inf")


# ---------------------------------------------------------------------------------------------
# Responses, parsed by the openai client's own types
# ---------------------------------------------------------------------------------------------


def wire(model: BaseModel) -> dict[str, Any]:
    """What goes over HTTP: the JSON text, parsed back (so json-mode serialisation is used)."""
    return json.loads(model.model_dump_json())


def round_trip(client_type: Any, model: BaseModel, strict: bool = True) -> Any:
    """Parse our JSON with the client's type: strictly (pydantic validation) where the client's
    Literals allow, else the way the client itself parses responses (`construct_type`)."""
    data = wire(model)
    parsed = (client_type.model_validate(data) if strict
              else construct_type(type_=client_type, value=data))
    assert parsed.to_dict(exclude_unset=True) == data
    return parsed


def completion_response() -> CompletionResponse:
    return CompletionResponse(
        id="cmpl-1", created=1700000000, model="m",
        choices=[
            CompletionChoice(
                index=0, text=" world", finish_reason="length",
                logprobs=CompletionLogprobs(
                    tokens=[" wor", "ld"], token_logprobs=[-0.5, -1.25],
                    top_logprobs=[{" wor": -0.5, " w": -2.0}, {"ld": -1.25}],
                    text_offset=[5, 9])),
            CompletionChoice(index=1, text="!", finish_reason="stop", stop_reason="\n"),
        ],
        usage=UsageInfo.from_counts(5, 2, cached_tokens=4))


def test_completion_response_round_trip() -> None:
    parsed = round_trip(Completion, completion_response())
    assert parsed.object == "text_completion"
    assert parsed.choices[0].logprobs.top_logprobs[1] == {"ld": -1.25}
    assert parsed.choices[1].finish_reason == "stop"
    assert parsed.usage.total_tokens == 7
    assert parsed.usage.prompt_tokens_details.cached_tokens == 4


def test_completion_echo_logprobs_with_leading_none() -> None:
    resp = CompletionResponse(id="c", model="m", usage=UsageInfo.from_counts(2, 0), choices=[
        CompletionChoice(index=0, text="ab", finish_reason="length", logprobs=CompletionLogprobs(
            tokens=["a", "b"], token_logprobs=[None, -1.0], top_logprobs=[None, {"b": -1.0}],
            text_offset=[0, 1]))])
    parsed = round_trip(Completion, resp, strict=False)
    assert parsed.choices[0].logprobs.token_logprobs == [None, -1.0]


def test_completion_stream_chunks_round_trip() -> None:
    chunk = CompletionStreamResponse(id="c", created=1, model="m", choices=[
        CompletionChoice(index=0, text="he")])
    parsed = round_trip(Completion, chunk, strict=False)
    assert parsed.choices[0].finish_reason is None and parsed.usage is None
    last = CompletionStreamResponse(id="c", created=1, model="m", choices=[
        CompletionChoice(index=0, text="", finish_reason="stop")])
    round_trip(Completion, last)
    usage = CompletionStreamResponse(id="c", created=1, model="m", choices=[],
                                     usage=UsageInfo.from_counts(3, 4))
    assert round_trip(Completion, usage).usage.total_tokens == 7


def chat_logprobs() -> ChatChoiceLogprobs:
    return ChatChoiceLogprobs(content=[ChatTokenLogprob(
        token="Hi", logprob=-0.1, bytes=[72, 105],
        top_logprobs=[ChatTopLogprob(token="Hi", logprob=-0.1, bytes=[72, 105]),
                      ChatTopLogprob(token="Hey", logprob=-2.5, bytes=None)])])


def test_chat_response_round_trip() -> None:
    resp = ChatCompletionResponse(id="chatcmpl-1", created=2, model="m", choices=[
        ChatCompletionChoice(index=0, message=ChatResponseMessage(content="Hi"),
                             logprobs=chat_logprobs(), finish_reason="stop"),
        ChatCompletionChoice(index=1, message=ChatResponseMessage(content="Yo"),
                             finish_reason="length"),
    ], usage=UsageInfo.from_counts(10, 1))
    parsed = round_trip(ChatCompletion, resp)
    assert parsed.object == "chat.completion"
    assert parsed.choices[0].message.role == "assistant"
    assert parsed.choices[0].logprobs.content[0].top_logprobs[1].token == "Hey"
    assert parsed.choices[0].logprobs.content[0].bytes == [72, 105]


def test_chat_stream_chunks_round_trip() -> None:
    first = ChatCompletionStreamResponse(id="x", created=3, model="m", choices=[
        ChatCompletionStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))])
    assert round_trip(ChatCompletionChunk, first).choices[0].delta.role == "assistant"
    middle = ChatCompletionStreamResponse(id="x", created=3, model="m", choices=[
        ChatCompletionStreamChoice(index=0, delta=DeltaMessage(content="Hi"),
                                   logprobs=chat_logprobs())])
    parsed = round_trip(ChatCompletionChunk, middle)
    assert parsed.choices[0].delta.content == "Hi" and parsed.choices[0].finish_reason is None
    last = ChatCompletionStreamResponse(id="x", created=3, model="m", choices=[
        ChatCompletionStreamChoice(index=0, delta=DeltaMessage(), finish_reason="length")])
    assert round_trip(ChatCompletionChunk, last).choices[0].finish_reason == "length"
    usage = ChatCompletionStreamResponse(id="x", created=3, model="m", choices=[],
                                         usage=UsageInfo.from_counts(1, 2, cached_tokens=0))
    assert round_trip(ChatCompletionChunk, usage).usage.completion_tokens == 2


def test_abort_finish_reason_passes_the_clients_lenient_parsing() -> None:
    resp = ChatCompletionResponse(id="a", model="m", usage=UsageInfo.from_counts(1, 0), choices=[
        ChatCompletionChoice(index=0, message=ChatResponseMessage(content=""),
                             finish_reason="abort")])
    assert round_trip(ChatCompletion, resp, strict=False).choices[0].finish_reason == "abort"


def test_model_list_round_trip() -> None:
    card = ModelCard(id="tiny", created=5, max_model_len=2048)
    parsed = round_trip(Model, card)
    assert parsed.owned_by == "phaseflip" and parsed.object == "model"
    assert wire(ModelList(data=[card])) == {"object": "list", "data": [wire(card)]}


def test_non_finite_logprobs_become_openai_sentinel() -> None:
    lp = ChatTokenLogprob(token="a", logprob=-INF, top_logprobs=[
        ChatTopLogprob(token="a", logprob=-INF)])
    assert wire(lp)["logprob"] == -9999.0 and wire(lp)["top_logprobs"][0]["logprob"] == -9999.0
    legacy = CompletionLogprobs(tokens=["a"], token_logprobs=[-INF], top_logprobs=[{"a": NAN}],
                                text_offset=[0])
    assert wire(legacy)["token_logprobs"] == [-9999.0]
    assert wire(legacy)["top_logprobs"] == [{"a": -9999.0}]
    assert ChatTopLogprob(token="a", logprob=-1.5).logprob == -1.5


def test_response_models_refuse_unknown_fields() -> None:
    with pytest.raises(ValidationError):
        ChatResponseMessage(content="x", reasoning="y")  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        CompletionChoice(index=0, text="", finish_reason="eos")  # type: ignore[arg-type]


def test_error_body() -> None:
    assert error_body("bad n", param="n") == {"error": {
        "message": "bad n", "type": "invalid_request_error", "param": "n", "code": None}}
    body = error_body("busy", type_="server_error", code="overloaded")
    assert ErrorResponse.model_validate(body).error.code == "overloaded"


# ---------------------------------------------------------------------------------------------
# End to end through the official client (HTTP mocked in-process)
# ---------------------------------------------------------------------------------------------


def sse(*events: BaseModel) -> bytes:
    lines = [f"data: {e.model_dump_json()}\n\n" for e in events]
    return ("".join(lines) + "data: [DONE]\n\n").encode()


class FakeServer:
    """Validates what the client sends with our request models and answers canned bodies."""

    def __init__(self) -> None:
        self.requests: list[BaseModel] = []

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        path = request.url.path
        if path == "/v1/models":
            return httpx2.Response(200, json=wire(ModelList(data=[ModelCard(id="m")])))
        body = json.loads(request.content)
        cls = CompletionRequest if path == "/v1/completions" else ChatCompletionRequest
        try:
            req = cls.model_validate(body)
        except ValidationError as exc:
            message, param = validation_error_to_openai(exc)
            return httpx2.Response(400, json=error_body(message, param=param))
        self.requests.append(req)
        if isinstance(req, CompletionRequest):
            if req.stream:
                return httpx2.Response(200, content=sse(
                    CompletionStreamResponse(id="c", model="m", choices=[
                        CompletionChoice(index=0, text="a")]),
                    CompletionStreamResponse(id="c", model="m", choices=[
                        CompletionChoice(index=0, text="b", finish_reason="stop")]),
                ), headers={"content-type": "text/event-stream"})
            return httpx2.Response(200, json=wire(completion_response()))
        if req.stream:
            return httpx2.Response(200, content=sse(
                ChatCompletionStreamResponse(id="x", model="m", choices=[
                    ChatCompletionStreamChoice(index=0, delta=DeltaMessage(role="assistant",
                                                                           content=""))]),
                ChatCompletionStreamResponse(id="x", model="m", choices=[
                    ChatCompletionStreamChoice(index=0, delta=DeltaMessage(content="Hi"),
                                               finish_reason="stop")]),
                ChatCompletionStreamResponse(id="x", model="m", choices=[],
                                             usage=UsageInfo.from_counts(4, 1)),
            ), headers={"content-type": "text/event-stream"})
        return httpx2.Response(200, json=wire(ChatCompletionResponse(
            id="x", model="m", usage=UsageInfo.from_counts(4, 1), choices=[ChatCompletionChoice(
                index=0, message=ChatResponseMessage(content="Hi"), finish_reason="stop")])))


@pytest.fixture
def fake() -> tuple[openai.OpenAI, FakeServer]:
    server = FakeServer()
    client = openai.OpenAI(
        base_url="http://phaseflip.test/v1", api_key="k", max_retries=0,
        http_client=httpx2.Client(transport=httpx2.MockTransport(server)))
    return client, server


def test_client_completions(fake: tuple[openai.OpenAI, FakeServer]) -> None:
    client, server = fake
    out = client.completions.create(
        model="m", prompt=[1, 2, 3], max_tokens=4, logprobs=2, echo=True, seed=1,
        extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "ignore_eos": True})
    assert out.choices[0].text == " world" and out.usage.prompt_tokens_details.cached_tokens == 4
    req = server.requests[-1]
    assert isinstance(req, CompletionRequest)
    assert req.prompt == [1, 2, 3] and req.top_k == 5 and req.ignore_eos
    params = completion_sampling_params(req, 100)
    assert (params.logprobs, params.prompt_logprobs, params.top_k) == (2, 2, 5)

    chunks = list(client.completions.create(model="m", prompt="x", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "ab"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_client_chat(fake: tuple[openai.OpenAI, FakeServer]) -> None:
    client, server = fake
    out = client.chat.completions.create(
        model="m", messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
        max_completion_tokens=3, logprobs=True, top_logprobs=2,
        extra_body={"add_generation_prompt": True, "chat_template_kwargs": {"a": 1}})
    assert out.choices[0].message.content == "Hi"
    req = server.requests[-1]
    assert isinstance(req, ChatCompletionRequest) and req.chat_template_kwargs == {"a": 1}
    assert chat_sampling_params(req, 100).logprobs == 2

    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "u"}],
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hi"
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 5


def test_client_models_and_errors(fake: tuple[openai.OpenAI, FakeServer]) -> None:
    client, _ = fake
    assert [m.id for m in client.models.list()] == ["m"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "u"}],
                                       temperature=5)
    assert info.value.status_code == 400
    assert info.value.param == "temperature"  # type: ignore[attr-defined]
    assert "temperature: Input should be less than or equal to 2" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt="x", extra_body={"bogus": 1})
    assert "Unrecognized request argument supplied: bogus" in info.value.message
