"""Structured output and tool calls through a real `phaseflip serve` (the embedded model, CPU)
and the official `openai` client: `chat.completions.parse` with a pydantic model, tools round
trips, streamed tool calls against whole ones, `/generate` regex/ebnf, and the 400s."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

PARSE_REQUESTS = 200  # seeded, temperature 1.0: every one must parse and validate
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 12}}, "required": ["zone"]}}}
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)


class Person(BaseModel):
    name: str = Field(max_length=10)
    admin: bool
    pets: list[Pet] = Field(max_length=2)


def test_parse_with_a_pydantic_model_always_validates(server) -> None:
    async def run() -> list:
        c = openai.AsyncOpenAI(base_url=server + "/v1", api_key="x", max_retries=0)
        calls = [c.chat.completions.parse(
            model="tiny-llama", messages=[{"role": "user", "content": f"Person {i}:"}],
            response_format=Person, temperature=1.0, seed=i, max_completion_tokens=160)
            for i in range(PARSE_REQUESTS)]
        try:
            return await asyncio.gather(*calls)
        finally:
            await c.close()

    t0 = time.perf_counter()
    answers = asyncio.run(run())
    print(f"{PARSE_REQUESTS} parse requests in {time.perf_counter() - t0:.1f} s")
    for a in answers:
        choice = a.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Person)
    assert len({a.choices[0].message.content for a in answers}) > PARSE_REQUESTS // 2


def test_json_object_on_chat_and_completions(client) -> None:
    # any object: the toy model may run out of tokens inside a string; those that end are
    # objects (greedy, it loops in its first key)
    chat = client.chat.completions.create(
        model="tiny-llama", messages=USER, response_format={"type": "json_object"},
        temperature=1.0, seed=0, n=8, max_completion_tokens=100)
    ended = [c for c in chat.choices if c.finish_reason == "stop"]
    assert ended and all(isinstance(json.loads(c.message.content), dict) for c in ended)
    assert all(c.message.content.startswith("{") for c in chat.choices)
    comp = client.completions.create(
        model="tiny-llama", prompt="Data:", max_tokens=200, temperature=1.0, seed=3, n=2,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {
            "name": "p", "schema": Person.model_json_schema()}}})
    for c in comp.choices:
        Person.model_validate_json(c.text)


@pytest.mark.parametrize(("body", "problem"), [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}},
     "strin"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema"),
])
def test_an_invalid_schema_is_a_400_naming_the_problem(client, body, problem) -> None:
    with pytest.raises(openai.BadRequestError, match=problem):
        client.chat.completions.create(model="tiny-llama", messages=USER, response_format=body)


def test_generate_regex_and_ebnf(server) -> None:
    for grammar, pattern in [({"regex": "[0-9]{3}-[a-z]{2,4}"}, r"[0-9]{3}-[a-z]{2,4}"),
                             ({"ebnf": 'root ::= ("yes" | "no") "!"'}, r"(yes|no)!")]:
        r = httpx.post(server + "/generate", json={"text": "Answer:", "sampling_params": {
            "temperature": 1.0, "seed": 1, "max_new_tokens": 20, **grammar}}, timeout=60)
        assert r.status_code == 200, r.text
        assert re.fullmatch(pattern, r.json()["text"]), r.json()
    r = httpx.post(server + "/generate", json={"text": "x", "sampling_params": {"regex": "a("}})
    assert r.status_code == 400 and "regex" in r.json()["error"]["message"]


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                  "function": {"name": "get_time"}}])
def test_tools_round_trip(client, choice) -> None:
    first = client.chat.completions.create(
        model="tiny-llama", messages=USER, tools=[WEATHER, TIME], tool_choice=choice,
        temperature=1.0, seed=7, max_completion_tokens=120)
    c = first.choices[0]
    # OpenAI's reasons: "tool_calls" for a required call, "stop" for a named one
    assert c.finish_reason == ("stop" if isinstance(choice, dict) else "tool_calls")
    assert c.message.content is None
    (call,) = c.message.tool_calls
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f")
    else:
        assert call.function.name == "get_time" and -12 <= args["zone"] <= 12
    history = [*USER, c.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "12 C, rain"}]
    second = client.chat.completions.create(
        model="tiny-llama", messages=history, tools=[WEATHER, TIME], tool_choice="none",
        temperature=0.0, max_completion_tokens=8)
    assert second.choices[0].message.tool_calls is None
    assert second.choices[0].message.content


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                  "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_assemble_to_the_whole_answer(client, choice) -> None:
    kwargs = {"model": "tiny-llama", "messages": USER, "tools": [WEATHER, TIME],
              "tool_choice": choice, "temperature": 1.0, "max_completion_tokens": 120, "n": 2}
    for seed in range(4):
        whole = client.chat.completions.create(**kwargs, seed=seed)
        parts: dict[int, dict] = {}
        reasons = {}
        for chunk in client.chat.completions.create(**kwargs, seed=seed, stream=True):
            for ch in chunk.choices:
                for d in ch.delta.tool_calls or []:
                    got = parts.setdefault(ch.index, {"name": "", "arguments": "", "ids": 0})
                    got["name"] += d.function.name or ""
                    got["arguments"] += d.function.arguments or ""
                    got["ids"] += d.id is not None
                if ch.finish_reason:
                    reasons[ch.index] = ch.finish_reason
        for c in whole.choices:
            (call,) = c.message.tool_calls
            assert parts[c.index] == {"name": call.function.name,
                                      "arguments": call.function.arguments, "ids": 1}
            want = "stop" if isinstance(choice, dict) else "tool_calls"
            assert reasons[c.index] == c.finish_reason == want


def test_a_required_call_cut_by_a_stop_string_does_not_say_tool_calls(client) -> None:
    """A user stop "}" cuts the required call inside its arguments: the reason stays "stop"
    (whole and streamed), so a client does not run a call whose arguments are not whole."""
    kwargs = {"model": "tiny-llama", "messages": USER, "tools": [WEATHER, TIME],
              "tool_choice": "required", "temperature": 1.0, "seed": 5, "stop": ["}"],
              "max_completion_tokens": 120}
    c = client.chat.completions.create(**kwargs).choices[0]
    (call,) = c.message.tool_calls
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.function.arguments)
    assert c.finish_reason == "stop"
    reasons = [ch.finish_reason for chunk in client.chat.completions.create(**kwargs, stream=True)
               for ch in chunk.choices if ch.finish_reason]
    assert reasons == ["stop"]


class GetWeather(BaseModel):
    city: str = Field(max_length=12)
    unit: Literal["c", "f"]


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                  "function": {"name": "GetWeather"}}])
def test_the_clients_stream_helper_assembles_tool_calls(client, choice) -> None:
    """`chat.completions.stream` merges deltas key by key: a later piece's `"type": null`
    would overwrite the first piece's "function" (its assembly asserted, or left the call
    untyped and unparsed)."""
    with client.chat.completions.stream(
            model="tiny-llama", messages=USER, tools=[openai.pydantic_function_tool(GetWeather)],
            tool_choice=choice, temperature=1.0, seed=3, max_completion_tokens=120) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert call.type == "function" and call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_fields_clients_send_are_accepted(client) -> None:
    """What SDKs and agent frameworks put in a chat request: `parallel_tool_calls`, `store`,
    `metadata`, `service_tier`, `reasoning_effort`, `modalities` ["text"]; other modalities
    are refused by name."""
    got = client.chat.completions.create(
        model="tiny-llama", messages=USER, tools=[WEATHER], parallel_tool_calls=False,
        store=False, metadata={"team": "a"}, service_tier="auto", reasoning_effort="low",
        modalities=["text"], max_completion_tokens=4)
    assert got.choices[0].finish_reason in ("length", "stop", "tool_calls")
    with pytest.raises(openai.BadRequestError, match="modalities is not supported"):
        client.chat.completions.create(model="tiny-llama", messages=USER,
                                       modalities=["text", "audio"], max_completion_tokens=4)
