"""Limits on request sizes, and the HTTP edges a black-box audit of them found: what a body
may hold (each refused with a 400 naming the field and the limit, before any tokenising),
`echo` of a text prompt, /tokenize of chat messages with tools, the abort counter, and a
shutdown during a flip. In-process front end over the scripted engine (`tests/fake_engine.py`),
about a second each."""

from __future__ import annotations

import asyncio
import json
import time
import types

import pytest
from tokenizers import processors

from phaseflip.errors import InvalidRequestError
from phaseflip.sampling.grammar import MAX_GRAMMAR_CHARS, GrammarSpec
from phaseflip.sampling.params import (
    MAX_LOGIT_BIAS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from phaseflip.server import launch
from phaseflip.server import protocol as p
from phaseflip.server.context import ServerConfig
from phaseflip.server.protocol import requests as request_models
from tests.fake_engine import fake_server, tokenizer, until
from tests.test_admin_endpoints_edges import DEADLINE_S, aborted_total, call
from tests.test_server_ops import asgi

USER = [{"role": "user", "content": "hi"}]
CMPL = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": USER, "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _tools(n: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{i}"}} for i in range(n)]


def _schema_of(chars: int) -> dict:
    """An object schema whose JSON text is more than `chars` characters."""
    return {"type": "object", "properties": {f"p{i}": {"type": "string"}
                                             for i in range(chars // 20 + 1)}}


OVERSIZE = [  # (path, body, the param named, the limit the message states)
    ("/v1/completions", CMPL | {"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)},
     "stop_token_ids", MAX_STOP_TOKEN_IDS),
    ("/generate", {"text": "hi", "sampling_params": {
        "stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}},
     "sampling_params.stop_token_ids", MAX_STOP_TOKEN_IDS),
    ("/v1/completions", CMPL | {"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}},
     "logit_bias", MAX_LOGIT_BIAS),
    ("/v1/chat/completions", CHAT | {"stop": "x" * (MAX_STOP_STRING_CHARS + 1)},
     "stop", MAX_STOP_STRING_CHARS),
    ("/generate", {"text": "hi", "sampling_params": {
        "stop": ["x", "y" * (MAX_STOP_STRING_CHARS + 1)]}}, "sampling_params.stop",
     MAX_STOP_STRING_CHARS),
    ("/v1/chat/completions", CHAT | {"tools": _tools(request_models.MAX_TOOLS + 1)},
     "tools", request_models.MAX_TOOLS),
    ("/v1/responses", {"model": "tiny", "input": "hi", "tools": [
        {"type": "function", "name": f"f{i}"} for i in range(request_models.MAX_TOOLS + 1)]},
     "tools", request_models.MAX_TOOLS),
    ("/generate", {"text": "hi", "sampling_params": {"regex": "a" * (MAX_GRAMMAR_CHARS + 1)}},
     "sampling_params.regex", MAX_GRAMMAR_CHARS),
    ("/generate", {"text": "hi", "sampling_params": {"ebnf": "a" * (MAX_GRAMMAR_CHARS + 1)}},
     "sampling_params.ebnf", MAX_GRAMMAR_CHARS),
    ("/v1/completions", CMPL | {"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": _schema_of(MAX_GRAMMAR_CHARS)}}},
     "response_format.json_schema.schema", MAX_GRAMMAR_CHARS),
]


def test_oversized_fields_are_refused_naming_the_field_and_limit_before_tokenising(tmp_path):
    """Every size that costs the front end or the engine per item is bounded: a million
    stop_token_ids took seconds of the event loop (and each step of the engine checks a
    token against each); a 1 MB regex kept a grammar compile thread busy for minutes. Each is
    a 400 naming the field and stating the limit, answered before the prompt is tokenised
    (nothing goes to the tokenizer pool or the engine)."""
    async def go():
        async with fake_server(tmp_path) as (ctx, app, engine), asgi(app) as c:
            pooled = []
            real_in_pool = ctx.in_pool
            ctx.in_pool = lambda fn, *a: pooled.append(fn) or real_in_pool(fn, *a)
            out = [await call(c, "POST", path, json=body) for path, body, _, _ in OVERSIZE]
            return out, pooled, list(engine.added)

    answers, pooled, added = asyncio.run(go())
    for (path, _, param, limit), r in zip(OVERSIZE, answers):
        assert r.status_code == 400, (path, param, r.text)
        error = r.json()["error"]
        assert error["param"] == param and str(limit) in error["message"], (path, error)
    assert not pooled and not added


def test_limits_at_their_bound_are_served(tmp_path):
    """The bounds themselves are accepted (one of each at the limit; 128 tools would not
    fit the embedded model's context rendered: tool_choice none)."""
    bodies = [
        CMPL | {"stop_token_ids": [1] * MAX_STOP_TOKEN_IDS,
                "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS)},
                "stop": ["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS},
        CHAT | {"tools": _tools(request_models.MAX_TOOLS), "tool_choice": "none"},
    ]

    async def go():
        async with fake_server(tmp_path) as (_, app, _e), asgi(app) as c:
            return [await call(c, "POST", path, json=body) for path, body in zip(
                ("/v1/completions", "/v1/chat/completions"), bodies)]

    for r in asyncio.run(go()):
        assert r.status_code == 200, r.text


def test_sampling_params_bound_what_the_engine_checks_each_step():
    """The engine's own checks (offline API, and what reaches the engine process) hold the
    same bounds, naming the field."""
    cases = [
        (SamplingParams(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids"),
        (SamplingParams(logit_bias=dict.fromkeys(range(MAX_LOGIT_BIAS + 1), 1.0)),
         "logit_bias"),
        (SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1)), "stop"),
        (SamplingParams(stop=["x" * (MAX_STOP_STRING_CHARS + 1)]), "stop"),
        (SamplingParams(grammar=GrammarSpec("regex", "a" * (MAX_GRAMMAR_CHARS + 1))),
         "response_format"),
    ]
    for params, param in cases:
        with pytest.raises(InvalidRequestError) as e:
            params.validate(100_000, build_grammar=False)
        assert e.value.param == param, (param, e.value)
    with pytest.raises(InvalidRequestError, match=str(MAX_GRAMMAR_CHARS)) as e:
        GrammarSpec("regex", "a" * (MAX_GRAMMAR_CHARS + 1)).check_shape("sampling_params.regex")
    assert e.value.param == "sampling_params.regex"


def test_the_unicode_check_does_not_walk_a_list_of_numbers_item_by_item(monkeypatch):
    """The lone-surrogate check of every body walked each item of a list in Python: a
    million stop_token_ids cost 1.7 s of the event loop before any limit was checked (twice
    on /generate, once per model level). A body without one is told in C (no walk at all);
    the walk that says where one is skips lists and objects of numbers whole."""
    calls = []
    walk = request_models._find_surrogate

    def counted(value, path):
        calls.append(path)
        return walk(value, path)

    monkeypatch.setattr(request_models, "_find_surrogate", counted)
    numbers = {"stop_token_ids": list(range(100_000)),
               "logit_bias": {str(i): 1.0 for i in range(100_000)}}
    with pytest.raises(Exception, match="at most"):
        p.GenerateRequest.model_validate({"text": "hi", "sampling_params": numbers})
    assert not calls
    with pytest.raises(Exception, match="lone surrogate") as e:
        p.GenerateRequest.model_validate({"text": "hi", "sampling_params": numbers | {
            "stop": ["ok", "\ud800"]}})
    assert p.validation_error_to_openai(e.value)[1] == "sampling_params.stop.1"
    assert len(calls) < 20, len(calls)


def _bos_tokenizer():
    """The embedded tokenizer, adding a BOS token (<|endoftext|>, id 0) as Llama's do."""
    import copy

    tok = copy.deepcopy(tokenizer())
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A $B",
        special_tokens=[("<|endoftext|>", 0)])
    assert tok("Hello")["input_ids"][0] == 0
    return tok


def _stream_choice(body: str) -> tuple[str, list[str], list[int]]:
    text, tokens, offsets = "", [], []
    for line in body.splitlines():
        if line.startswith("data: {"):
            choice = json.loads(line[len("data: "):])["choices"][0]
            text += choice["text"]
            if choice["logprobs"]:
                tokens += choice["logprobs"]["tokens"]
                offsets += choice["logprobs"]["text_offset"]
    return text, tokens, offsets


def test_echo_repeats_a_text_prompt_as_sent_not_its_bos(tmp_path):
    """`echo` gave `decode(prompt_ids)`: with a tokenizer that adds a BOS token, the answer
    began with its text ("<s>", here "<|endoftext|>"), which the client never sent; vLLM
    echoes the prompt as sent. A prompt of token ids still echoes their decoding. With
    logprobs the BOS keeps its entry (lm-eval slices them by token counts), spelt "" at
    offset 0 like any token the text leaves out, so every offset indexes the text; streamed
    the same."""
    prompt = "Hello there"
    body = CMPL | {"prompt": prompt, "echo": True, "max_tokens": 2, "logprobs": 1}

    async def go():
        async with fake_server(tmp_path) as (ctx, app, _e), asgi(app) as c:
            ctx.tokenizer = _bos_tokenizer()
            whole = await call(c, "POST", "/v1/completions", json=body)
            streamed = await call(c, "POST", "/v1/completions", json=body | {"stream": True})
            ids = ctx.tokenizer(prompt)["input_ids"]
            by_ids = await call(c, "POST", "/v1/completions", json=body | {"prompt": ids})
            return (whole.json()["choices"][0], _stream_choice(streamed.text), by_ids.json(),
                    ids)

    whole, (s_text, s_tokens, s_offsets), by_ids, ids = asyncio.run(go())
    generated = "aa"  # (the scripted engine's two tokens)
    for text, tokens, offsets in ((whole["text"], whole["logprobs"]["tokens"],
                                   whole["logprobs"]["text_offset"]),
                                  (s_text, s_tokens, s_offsets)):
        assert text == prompt + generated, text
        assert len(tokens) == len(ids) + 2 and tokens[0] == "" and offsets[0] == 0, tokens
        n = len(ids)  # (the scripted engine's tokens are not spelt as its text: the prompt's)
        assert "".join(tokens[:n]) == prompt
        for token, offset in zip(tokens[:n], offsets):
            assert text[offset:offset + len(token)] == token, (token, offset)
    assert by_ids["choices"][0]["text"] == "<|endoftext|>" + prompt + generated


def test_tokenize_with_tools_counts_what_chat_renders(tmp_path):
    """/tokenize with `messages` refused `tools` (unknown field), so its count missed the
    tool listing the chat template renders: it takes `tools` and `tool_choice` as chat does
    (no listing with tool_choice "none") and counts chat's prompt_tokens."""
    async def go():
        async with fake_server(tmp_path) as (_, app, _e), asgi(app) as c:
            out = []
            for choice in ({}, {"tool_choice": "none"}, {"tool_choice": "required"}):
                extra = {"tools": [TOOL]} | choice
                # ("required" starts the grammar trial child: ~3 s, more on a loaded box)
                chat = await asyncio.wait_for(c.request(
                    "POST", "/v1/chat/completions", json=CHAT | extra), 60)
                tok = await call(c, "POST", "/tokenize", json={"messages": USER} | extra)
                assert chat.status_code == 200 and tok.status_code == 200, tok.text
                out.append((chat.json()["usage"]["prompt_tokens"], tok.json()["count"]))
            bare = await call(c, "POST", "/tokenize", json={"messages": USER})
            return out, bare.json()["count"]

    counts, bare = asyncio.run(go())
    for chat_count, tokenize_count in counts:
        assert chat_count == tokenize_count
    assert counts[0][0] > bare == counts[1][0]


def test_an_abort_that_crosses_the_requests_end_is_not_counted(tmp_path):
    """/abort_request counted aborted_requests_total{abort_request} when asked: an abort that
    reached the engine after the request ended by itself (its end on the way back) counted an
    abort no request had (no `abort` finish in requests_total). Counted now when the abort's
    end comes back."""
    async def go():
        async with fake_server(tmp_path) as (ctx, app, engine), asgi(app) as c:
            async def too_late(rid: str) -> None:  # the engine had ended it: nothing to abort
                pass

            gen = asyncio.create_task(c.post("/generate", json={
                "text": "a", "rid": "late", "sampling_params": {"max_new_tokens": 20}}))
            await until(lambda: "late" in ctx.engine.state.in_flight)
            real_abort, ctx.engine.abort = ctx.engine.abort, too_late
            r = await call(c, "POST", "/abort_request", json={"rid": "late"})
            assert r.status_code == 200, r.text
            out = (await asyncio.wait_for(gen, DEADLINE_S)).json()
            assert out["meta_info"]["finish_reason"]["type"] == "length"
            assert aborted_total(ctx, "abort_request") == 0.0
            ctx.engine.abort = real_abort  # an abort that ends its request is counted once
            gen = asyncio.create_task(c.post("/generate", json={
                "text": "a", "rid": "real", "sampling_params": {"max_new_tokens": 1000}}))
            await until(lambda: "real" in ctx.engine.state.in_flight)
            for _ in range(2):
                await call(c, "POST", "/abort_request", json={"rid": "real"})
            out = (await asyncio.wait_for(gen, DEADLINE_S)).json()
            assert out["meta_info"]["finish_reason"]["type"] == "abort"
            assert aborted_total(ctx, "abort_request") == 1.0
            assert not ctx.abort_asked

    asyncio.run(go())


def test_a_shutdown_waits_for_a_flip_whose_caller_got_504(tmp_path):
    """A flip that outlasts --flip-timeout-s answers 504 and goes on in the engine; a SIGTERM
    then drained only requests, so the engine was asked to stop mid-seam (it answers nothing
    until the seam ends: 5 s, then SIGTERM, SIGKILL). The drain waits for the seam too,
    within --shutdown-timeout."""
    cfg = ServerConfig(flip_timeout_s=0.1, shutdown_timeout=10)

    async def go():
        async with fake_server(tmp_path, cfg, seam_s=1.0) as (ctx, app, _e), asgi(app) as c:
            r = await call(c, "POST", "/admin/flip", json={"tp_size": 1, "pp_size": 2})
            assert r.status_code == 504, r.text
            assert ctx.flip_in_progress is not None
            drain = launch.Drain(ctx, launch.Outcome())
            drain.server = types.SimpleNamespace(should_exit=False)
            start = time.monotonic()
            await asyncio.wait_for(drain._drain("SIGTERM"), DEADLINE_S)
            assert drain.server.should_exit
            return ctx.flip_in_progress, time.monotonic() - start, drain.outcome.code

    in_progress, waited_s, code = asyncio.run(go())
    assert in_progress is None and waited_s > 0.5, (in_progress, waited_s)
    assert code == launch.EXIT_OK


def test_a_completions_batch_wider_than_the_server_is_refused_before_tokenising(tmp_path):
    """5000 prompts on a server of --max-queued-requests 4096 were all tokenised (a second
    of the tokenizer pool) before the 400 that no state of the server could admit them; the
    width (prompts x n, or best_of) is checked first, as /generate checks it."""
    cfg = ServerConfig(max_queued_requests=8)

    async def go():
        async with fake_server(tmp_path, cfg) as (ctx, app, _e), asgi(app) as c:
            pooled = []
            real_in_pool = ctx.in_pool
            ctx.in_pool = lambda fn, *a: pooled.append(fn) or real_in_pool(fn, *a)
            wide = await call(c, "POST", "/v1/completions", json=CMPL | {"prompt": ["a"] * 9})
            best = await call(c, "POST", "/v1/completions", json=CMPL | {
                "prompt": ["a", "b"], "n": 1, "best_of": 5})
            return wide, best, pooled

    wide, best, pooled = asyncio.run(go())
    for r in (wide, best):
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "at most 8" in r.json()["error"]["message"]
    assert not pooled
