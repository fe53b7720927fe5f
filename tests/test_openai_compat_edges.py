"""OpenAI-compatibility edges: where the endpoints once differed from what the `openai`
client, the OpenAI API and vLLM users expect (found by a black-box audit). In-process front
end over the scripted engine (`tests/fake_engine.py`): each test takes about a second."""

from __future__ import annotations

import asyncio
import dataclasses
import json

from phaseflip.server.protocol import responses as response_models
from tests.fake_engine import fake_server
from tests.test_server_ops import asgi

USER = [{"role": "user", "content": "hi"}]
FILLS_CONTEXT = "hello " * 506 + "hi"  # 1024 tokens with the embedded model's chat template


def _events(body: str) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in body.splitlines()
            if line.startswith("data: {")]


def test_stream_chunks_share_one_created_timestamp(tmp_path, monkeypatch):
    """OpenAI: chat.completion.chunk `created` -- "Each chunk has the same timestamp". A
    stream that crosses a second boundary must not change it (here every read of the response
    models' clock moves it one second on, as a long stream does)."""
    clock = iter(range(1_700_000_000, 1_800_000_000))
    monkeypatch.setattr(response_models, "time",
                        type("FakeTime", (), {"time": staticmethod(lambda: next(clock))}))

    async def go():
        async with fake_server(tmp_path) as (_, app, _engine), asgi(app) as c:
            chat = await c.post("/v1/chat/completions", json={
                "model": "tiny", "messages": USER, "max_tokens": 4, "stream": True,
                "stream_options": {"include_usage": True}})
            cmpl = await c.post("/v1/completions", json={
                "model": "tiny", "prompt": "a", "max_tokens": 4, "stream": True})
        return _events(chat.text), _events(cmpl.text)

    chat, cmpl = asyncio.run(go())
    assert len(chat) >= 4 and len(cmpl) >= 4
    assert len({e["created"] for e in chat}) == 1, [e["created"] for e in chat]
    assert len({e["created"] for e in cmpl}) == 1, [e["created"] for e in cmpl]


ADDRESS = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"], "additionalProperties": False}


def _person_tool(name: str, address: dict) -> dict:
    """A tool whose parameters are what pydantic writes for a model with a nested model."""
    params = {"$defs": {"Address": address}, "type": "object",
              "properties": {"name": {"type": "string"}, "address": {"$ref": "#/$defs/Address"}},
              "required": ["name", "address"], "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "parameters": params}}


def test_required_tool_choice_accepts_parameters_with_defs(tmp_path):
    """`openai.pydantic_function_tool` (and any pydantic model with a nested model) gives
    `parameters` with `$defs` and `"$ref": "#/$defs/..."`. With tool_choice "required" the
    server nests every tool's parameters in one wrapper schema, where root-relative refs
    resolve only if the `$defs` move to its root (as vLLM does): chat and Responses, named
    and auto too. Two tools defining one name alike share it; differently, a clear 400."""
    tools = [_person_tool("save_person", ADDRESS), _person_tool("find_person", ADDRESS)]
    clash = [tools[0], _person_tool("other", {"type": "string"})]
    chat = {"model": "tiny", "messages": USER, "max_tokens": 2, "tools": tools}
    named = {"type": "function", "function": {"name": "save_person"}}

    async def go():
        async with fake_server(tmp_path) as (_, app, _engine), asgi(app) as c:
            post = c.post
            return [
                await post("/v1/chat/completions", json=chat | {"tool_choice": choice})
                for choice in (named, "auto", "required")
            ] + [
                await post("/v1/responses", json={
                    "model": "tiny", "input": "hi", "max_output_tokens": 2,
                    "tools": [{"type": "function", **t["function"]} for t in tools],
                    "tool_choice": "required"}),
                await post("/v1/chat/completions",
                           json=chat | {"tools": clash, "tool_choice": "required"}),
            ]

    *served, clashed = asyncio.run(go())
    for r in served:
        assert r.status_code == 200, r.text
    assert clashed.status_code == 400, clashed.text
    error = clashed.json()["error"]
    assert error["param"] == "tools" and "$defs/Address" in error["message"], error


def test_assistant_message_replayed_with_model_dump_is_accepted(tmp_path):
    """`messages.append(resp.choices[0].message.model_dump())` sends the assistant message
    with `refusal`, `audio`, `function_call` (and `annotations`) set to null: OpenAI and
    vLLM accept it (they are fields of OpenAI's assistant message). A refusal stands for the
    turn's text; a legacy `function_call` is refused, naming it (replay it as `tool_calls`)."""
    replayed = {"role": "assistant", "content": "hello", "refusal": None, "annotations": None,
                "audio": None, "function_call": None, "tool_calls": None}
    refused = replayed | {"content": None, "refusal": "I can't help with that."}
    legacy = replayed | {"function_call": {"name": "f", "arguments": "{}"}}

    async def go():
        async with fake_server(tmp_path) as (_, app, _engine), asgi(app) as c:
            return [await c.post("/v1/chat/completions", json={
                "model": "tiny", "max_tokens": 2,
                "messages": [*USER, m, {"role": "user", "content": "more"}]})
                for m in (replayed, refused, legacy)]

    replayed_r, refused_r, legacy_r = asyncio.run(go())
    assert replayed_r.status_code == 200, replayed_r.text
    assert refused_r.status_code == 200, refused_r.text
    assert legacy_r.status_code == 400, legacy_r.text
    assert legacy_r.json()["error"]["param"] == "messages.1.function_call", legacy_r.text


def test_chat_without_max_tokens_is_served_when_the_kv_pool_is_below_the_context(tmp_path):
    """Chat's default max_tokens is "whatever the context leaves". On a server whose KV pool
    holds fewer tokens than the context (`--max-total-tokens`, or a big model on a small
    GPU), the context alone would make a default beyond the pool, and every chat/Responses
    request leaving max_tokens out a 400 naming `max_tokens`, which the client never sent.
    The default is capped by what the pool holds, in whole pages as the engine admits; an
    explicit max_tokens is still checked."""

    async def go():  # (a fast fake: the answers run to the default, ~500 tokens)
        async with fake_server(tmp_path, step_s=0.0005) as (ctx, app, engine), asgi(app) as c:
            st = ctx.engine.state
            # 520 tokens in pages of 16: what a sequence may hold is 512 (32 whole pages)
            st.ready = dataclasses.replace(st.ready, kv_capacity_tokens=520, page_size=16)
            chat = await c.post("/v1/chat/completions", json={"model": "tiny", "messages": USER})
            resp = await c.post("/v1/responses", json={"model": "tiny", "input": "hi"})
            explicit = await c.post("/v1/chat/completions", json={
                "model": "tiny", "messages": USER, "max_tokens": 1000})
        return chat, resp, explicit, engine.added

    chat, resp, explicit, added = asyncio.run(go())
    assert [len(a.prompt_ids) + a.params.max_new_tokens for a in added] == [512, 512]
    assert chat.status_code == 200, chat.text
    assert resp.status_code == 200, resp.text
    assert explicit.status_code == 400, explicit.text
    assert explicit.json()["error"]["param"] == "max_tokens", explicit.text


def test_chat_prompt_that_fills_the_context_is_a_400_not_an_empty_answer(tmp_path):
    """A chat prompt of exactly the context length, max_tokens left out, leaves room for no
    token: it was answered 200 with finish_reason "length" (Responses: status "incomplete",
    reason "max_output_tokens", though none was set). vLLM refuses it (400: "... you
    requested N tokens in the messages ..."), as OpenAI refuses a prompt that leaves no room
    for output: chat names `messages`, Responses `input`."""
    messages = [{"role": "user", "content": FILLS_CONTEXT}]

    async def go():
        async with fake_server(tmp_path) as (ctx, app, _engine), asgi(app) as c:
            tok = await c.post("/tokenize", json={"messages": messages})
            assert tok.json()["count"] == ctx.max_context, tok.text
            chat = await c.post("/v1/chat/completions",
                                json={"model": "tiny", "messages": messages})
            resp = await c.post("/v1/responses", json={"model": "tiny", "input": messages})
        return chat, resp

    for r, param in zip(asyncio.run(go()), ("messages", "input")):
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == param, error


def test_chat_max_tokens_zero_is_a_400_while_completions_score_with_it(tmp_path):
    """OpenAI and vLLM require chat's max_tokens / max_completion_tokens to be at least 1;
    completions keep taking 0 with `echo` (scoring a prompt by its logprobs)."""

    async def go():
        async with fake_server(tmp_path) as (_, app, _engine), asgi(app) as c:
            chat = [await c.post("/v1/chat/completions", json={
                "model": "tiny", "messages": USER, field: 0})
                for field in ("max_tokens", "max_completion_tokens")]
            scored = await c.post("/v1/completions", json={
                "model": "tiny", "prompt": "a b", "max_tokens": 0, "echo": True,
                "logprobs": 0})
        return chat, scored

    chat, scored = asyncio.run(go())
    for r, field in zip(chat, ("max_tokens", "max_completion_tokens")):
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field, r.text
    assert scored.status_code == 200, scored.text  # (the real engine's answer: test_server)


def test_tool_function_names_must_be_unique(tmp_path):
    """Two tools of one name: a call naming it could not say which was meant (and a named
    tool_choice would pick the first). Anthropic's API refuses them; chat and Responses too."""
    tools = [_person_tool("save_person", ADDRESS), _person_tool("save_person", ADDRESS)]

    async def go():
        async with fake_server(tmp_path) as (_, app, _engine), asgi(app) as c:
            return [
                await c.post("/v1/chat/completions", json={
                    "model": "tiny", "messages": USER, "max_tokens": 2, "tools": tools}),
                await c.post("/v1/responses", json={
                    "model": "tiny", "input": "hi", "max_output_tokens": 2,
                    "tools": [{"type": "function", **t["function"]} for t in tools]}),
            ]

    for r in asyncio.run(go()):
        assert r.status_code == 400, r.text
        assert "'save_person' is given twice" in r.json()["error"]["message"], r.text
