"""Edges of the native `/generate` and of `/v1/responses` found by a black-box audit: bad
input is a 4xx that names the field the client sent, and no request, however large, stalls
the event loop that every other stream shares. In-process front end over the scripted
engine (`tests/fake_engine.py`)."""

from __future__ import annotations

import asyncio
import threading
import time

from phaseflip.sampling import grammar
from phaseflip.server.context import ServerConfig
from tests.fake_engine import fake_server
from tests.test_server_ops import asgi


def test_generate_builds_its_grammar_off_the_event_loop(tmp_path, monkeypatch):
    """Chat builds a `response_format` grammar in the tokenizer pool (the first build loads
    xgrammar, a large one takes seconds); `/generate` built `regex`/`ebnf`/`json_schema` on
    the event loop, stalling every stream for as long (1.5 s for a 300 kB regex)."""
    first: dict[str, str] = {}  # grammar kind -> the thread that built it first

    def problem(spec: grammar.GrammarSpec) -> None:
        first.setdefault(spec.kind, threading.current_thread().name)

    monkeypatch.setattr(grammar, "_grammar_problem", problem)

    async def go():
        async with fake_server(tmp_path) as (_, app, _engine), asgi(app) as c:
            return await c.post("/generate", json={
                "text": ["a", "b"], "sampling_params": [
                    {"regex": "[0-9]+", "max_new_tokens": 2},
                    {"ebnf": 'root ::= "x"', "max_new_tokens": 2}]})

    r = asyncio.run(go())
    assert r.status_code == 200, r.text
    assert set(first) == {"regex", "ebnf"}, first
    assert all(name.startswith("phaseflip-tokenize") for name in first.values()), first


def test_a_batch_wider_than_the_server_is_refused_before_tokenising(tmp_path):
    """`--max-queued-requests` bounds prompts x n; a batch past it was tokenised and checked
    prompt by prompt before `admit` refused it (for 10^5 prompts: minutes)."""
    async def go():
        cfg = ServerConfig(max_queued_requests=8)
        async with fake_server(tmp_path, cfg) as (ctx, app, engine), asgi(app) as c:
            async def never(*_a, **_k):
                raise AssertionError("tokenised a batch that cannot be admitted")

            ctx.encode_all = never
            wide = await c.post("/generate", json={"text": ["a"] * 9})
            samples = await c.post("/generate", json={
                "text": ["a", "b", "c"], "sampling_params": {"n": 3}})
            bad_n = await c.post("/generate", json={  # (its own error, not the width's)
                "input_ids": [1], "sampling_params": {"n": 10**6}})
            return wide, samples, bad_n, engine.added

    wide, samples, bad_n, added = asyncio.run(go())
    for r, width in ((wide, 9), (samples, 9)):
        assert r.status_code == 400, r.text
        assert f"runs {width} sequences" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "text", r.text  # (the field sent, not `prompt`)
    assert bad_n.status_code == 400 and bad_n.json()["error"]["param"] == "sampling_params.n"
    assert not added


def test_a_large_batch_costs_time_linear_in_its_prompts(tmp_path):
    """Each prompt's first choice index was a sum over the prompts before it (quadratic: 20k
    prompts blocked the event loop for 10 s, 10^5 for minutes). Here 40k prompts, the last
    one bad, must be refused in seconds, naming that prompt."""
    n = 40_000
    body = {"input_ids": [[1, 2]] * (n - 1) + [[5000]], "sampling_params": {"max_new_tokens": 1}}

    async def go():
        cfg = ServerConfig(max_queued_requests=10 * n)
        async with fake_server(tmp_path, cfg) as (_, app, engine), asgi(app) as c:
            start = time.perf_counter()
            r = await c.post("/generate", json=body)
            return r, time.perf_counter() - start, engine.added

    r, took, added = asyncio.run(go())
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == f"input_ids.{n - 1}", r.text
    assert took < 15, f"{n} prompts took {took:.1f} s"
    assert not added


def test_a_finished_batch_is_assembled_in_linear_time(tmp_path):
    """The answer of a batch sorted every choice once per prompt (quadratic: seconds of a
    blocked event loop at the end of a few thousand prompts). The loop must stay live."""
    n = 3000
    gaps: list[float] = []

    async def ticker(stop: asyncio.Event) -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async def go():
        async with fake_server(tmp_path, step_s=0.001) as (_, app, _e), asgi(app) as c:
            body = {"input_ids": [[1, 2]] * n, "sampling_params": {"max_new_tokens": 1}}
            stop = asyncio.Event()
            tick = asyncio.create_task(ticker(stop))
            await asyncio.sleep(0.05)
            gaps.clear()
            r = await c.post("/generate", json=body)
            await asyncio.sleep(0.05)  # (a stall shows as a gap once the loop is back)
            stop.set()
            await tick
            return r, gaps

    r, seen = asyncio.run(go())
    assert r.status_code == 200, r.text[:300]
    out = r.json()
    assert [o["index"] for o in out] == list(range(n))
    assert max(seen) < 2.5, f"the event loop stalled {max(seen):.2f} s"


def test_generate_errors_name_the_field_sent(tmp_path):
    """Engine-side checks named `SamplingParams` fields (`max_new_tokens`, `prompt`); the
    client sent `sampling_params.max_new_tokens` (or `sampling_params.<i>.…`) and
    `input_ids`, and a prompt too long by itself was blamed on `max_new_tokens`."""
    cases = [
        ({"text": "a", "sampling_params": {"max_new_tokens": -1}},
         "sampling_params.max_new_tokens", "sampling_params.max_new_tokens must be >= 0"),
        ({"text": ["a", "b"], "sampling_params": [{}, {"temperature": -1.0}]},
         "sampling_params.1.temperature", "sampling_params.1.temperature must be >= 0"),
        ({"text": "a", "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 2}},
         "sampling_params.min_new_tokens", "must not exceed sampling_params.max_new_tokens"),
        ({"input_ids": [1, 5000]}, "input_ids", "[5000]"),
        ({"input_ids": [[1], [1, 5000]]}, "input_ids.1", "[5000]"),
        ({"input_ids": [1] * 2000}, "input_ids", "2000 tokens"),
        ({"input_ids": [1] * 1000, "sampling_params": {"max_new_tokens": 100}},
         "sampling_params.max_new_tokens", "lower sampling_params.max_new_tokens"),
        ({"text": "a", "sampling_params": {"seed": 2**64}}, "sampling_params.seed", "seed"),
        ({"text": "a", "sampling_params": {"seed": -(2**63) - 1}},
         "sampling_params.seed", "seed"),
    ]

    async def go():
        async with fake_server(tmp_path) as (_, app, engine), asgi(app) as c:
            return [await c.post("/generate", json=body) for body, _, _ in cases], engine.added

    answers, added = asyncio.run(go())
    for r, (body, param, words) in zip(answers, cases):
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], (str(body)[:80], error)
    assert not added


def test_responses_context_error_names_input_not_messages(tmp_path):
    """A Responses client sends `input`, never `messages`: an over-long conversation's error
    said "messages is 2211 tokens" (param `input`)."""
    async def go():
        async with fake_server(tmp_path) as (_, app, engine), asgi(app) as c:
            r = await c.post("/v1/responses", json={
                "model": "tiny", "input": "hello " * 1100, "max_output_tokens": 2})
            return r, engine.added

    r, added = asyncio.run(go())
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "input" and error["code"] == "context_length_exceeded", error
    assert "messages" not in error["message"] and error["message"].startswith("input"), error
    assert not added


def test_a_body_sent_as_a_form_says_it_must_be_json(tmp_path):
    """`curl -d '{...}'` without `-H content-type: application/json` sends a form: the 400
    said pydantic's "Input should be a valid dictionary", not what to change."""
    async def go():
        async with fake_server(tmp_path) as (_, app, _engine), asgi(app) as c:
            form = await c.post("/v1/completions", content=b'{"prompt": "a"}', headers={
                "content-type": "application/x-www-form-urlencoded"})
            json_list = await c.post("/v1/completions", json=["a"])
            return form, json_list

    form, json_list = asyncio.run(go())
    assert form.status_code == 400 and "Content-Type: application/json" in \
        form.json()["error"]["message"], form.text
    assert json_list.status_code == 400 and "Content-Type" not in json_list.text, json_list.text
