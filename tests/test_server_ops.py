"""Operations (issue 18): health, shutdown, limits, auth and abort accounting of the front end.

Most tests drive the real front end against a scripted engine (`tests/fake_engine.py`), so
they take milliseconds; the few that need a real `phaseflip serve` say so.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from phaseflip.server import messages as m
from tests.fake_engine import fake_server, until

ABORTED, FINISHED = "phaseflip_aborted_requests_total", "phaseflip_requests_total"


def sample(text: str, name: str, **labels: str) -> float:
    """The value of the series `name{labels}` in Prometheus text (every series of this server
    is also labelled model_name="tiny")."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == {"model_name": "tiny", **labels}:
                return s.value
    raise AssertionError(f"no series {name}{labels} in:\n{text}")


def run(coro):
    return asyncio.run(coro)


def asgi(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def test_engine_health_message_makes_the_server_unhealthy_and_back(tmp_path):
    async def go():
        async with fake_server(tmp_path) as (ctx, app, engine), asgi(app) as c:
            assert (await c.get("/health")).status_code == 200
            engine.send(m.EngineHealth(False, "rank 1 made no progress for 30 s"))
            await until(lambda: ctx.engine.state.unhealthy is not None)
            r = await c.get("/health")
            assert r.status_code == 503 and "rank 1 made no progress" in r.json()["error"][
                "message"]
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
            assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
            assert "unhealthy" in r.json()["error"]["message"] and not engine.added
            engine.send(m.EngineHealth(True, ""))
            await until(lambda: ctx.engine.state.unhealthy is None)
            assert (await c.get("/health")).status_code == 200
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": "x",
                                                      "max_tokens": 2})
            assert r.status_code == 200, r.text

    run(go())


def test_engine_health_survives_the_codec():
    msg = m.decode(m.encode(m.EngineHealth(False, "stall")))
    assert msg == m.EngineHealth(False, "stall")


# ------------------------------------------------------------------ helpers for raw ASGI calls
def scope(path: str, method: str = "POST", headers: list | None = None) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"host", b"t"),
                        *(headers or [])],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "scheme": "http"}


async def call_and_hang_up(app, path: str, body: dict, after_s: float) -> list[dict]:
    """Sends `body`, then the client disconnects after `after_s`; returns what was sent."""
    pending = [{"type": "http.request", "body": json.dumps(body).encode(),
                "more_body": False}]
    gone = asyncio.Event()
    asyncio.get_running_loop().call_later(after_s, gone.set)
    sent: list[dict] = []

    async def receive() -> dict:
        if pending:
            return pending.pop(0)
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await asyncio.wait_for(app(scope(path), receive, send), 10)
    return sent


# ------------------------------------------------------------------ 8: a client that left
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1000}),
    ("/v1/chat/completions", {"model": "tiny", "max_tokens": 1000,
                              "messages": [{"role": "user", "content": "x"}]}),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 1000}}),
])
def test_non_streaming_request_of_a_client_that_left_is_aborted(tmp_path, path, body):
    async def go():
        async with fake_server(tmp_path) as (ctx, app, engine):
            await call_and_hang_up(app, path, body, after_s=0.3)
            await until(lambda: engine.aborted, timeout_s=3)
            assert [a.rid for a in engine.added] == engine.aborted
            assert not ctx.engine.state.in_flight
            metrics = ctx.metrics.render().decode()
            assert sample(metrics, ABORTED, reason="client_disconnect") == 1.0

    run(go())


# ------------------------------------------------------------------ 1: lone surrogates
LONE = "\ud800abc"
CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "tiny", "prompt": LONE}),
    ("/v1/completions", {"model": "tiny", "prompt": ["ok", LONE]}),
    ("/v1/completions", {"model": "tiny", "prompt": "ok", "stop": [LONE]}),
    ("/v1/completions", {"model": "tiny", "prompt": "ok", "user": LONE}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": LONE}]}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "text", "text": LONE}]}]}),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT,
                              "chat_template_kwargs": {LONE: 1}}),
    ("/generate", {"text": LONE}),
    ("/generate", {"text": "ok", "sampling_params": {"stop": LONE}}),
    ("/tokenize", {"prompt": LONE}),
    ("/tokenize", {"messages": [{"role": "user", "content": LONE}]}),
])
def test_lone_surrogate_text_is_a_shaped_400(tmp_path, path, body):
    async def go():
        async with fake_server(tmp_path) as (_, app, engine), asgi(app) as c:
            raw = json.dumps(body)  # ensure_ascii writes the surrogate as \ud800, as clients do
            r = await c.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and "lone surrogate" in err["message"]
            assert err["param"]
            assert (await c.get("/health")).status_code == 200 and not engine.added

    run(go())


# ------------------------------------------------------------------ 2: huge prompts and bodies
def test_a_10mb_prompt_is_refused_before_tokenising(tmp_path, monkeypatch):
    calls = []

    async def go():
        async with fake_server(tmp_path) as (ctx, app, _), asgi(app) as c:
            monkeypatch.setattr(ctx, "in_pool", lambda *a: calls.append(a))
            for path, body in (("/v1/completions", {"model": "tiny", "prompt": "x " * 5_000_000}),
                               ("/tokenize", {"prompt": "x " * 5_000_000}),
                               ("/generate", {"text": ["ok", "x " * 5_000_000]})):
                r = await c.post(path, json=body)
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert err["code"] == "context_length_exceeded"
                assert "at most 1024 tokens" in err["message"], err

    run(go())
    assert calls == []


def test_an_oversized_body_is_413_declared_or_streamed(tmp_path):
    from phaseflip.server.context import ServerConfig

    async def go():
        cfg = ServerConfig(max_request_bytes=1000)
        async with fake_server(tmp_path, cfg) as (_, app, _e), asgi(app) as c:
            body = json.dumps({"model": "tiny", "prompt": "x" * 2000}).encode()
            r = await c.post("/v1/completions", content=body)
            assert r.status_code == 413 and "at most 1000 bytes" in r.json()["error"]["message"]

            async def chunks():  # no content-length: counted as it arrives
                for i in range(0, len(body), 100):
                    yield body[i:i + 100]

            r = await c.post("/v1/completions", content=chunks())
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": "x",
                                                      "max_tokens": 1})
            assert r.status_code == 200
            sent = []  # a declared length over the limit is refused before reading anything

            async def never() -> dict:
                await asyncio.sleep(30)

            async def send(message):
                sent.append(message)

            big = scope("/v1/completions", headers=[(b"content-length", b"1000000000")])
            await asyncio.wait_for(app(big, never, send), 2)
            assert sent[0]["status"] == 413

    run(go())


def test_health_answers_while_a_long_prompt_tokenises(tmp_path):
    async def go():
        async with fake_server(tmp_path) as (ctx, app, _), asgi(app) as c:
            real = ctx.tokenizer

            class Slow:  # a tokenizer that takes 1.5 s, as a long prompt does
                def __call__(self, text, **kw):
                    time.sleep(1.5)
                    return real(text, **kw)

                def __getattr__(self, name):
                    return getattr(real, name)

            ctx.tokenizer = Slow()
            slow = asyncio.create_task(c.post("/v1/completions", json={
                "model": "tiny", "prompt": "Return the value", "max_tokens": 1}))
            start = time.monotonic()
            await asyncio.sleep(0.2)
            assert (await c.get("/health")).status_code == 200
            assert time.monotonic() - start < 0.8  # not after the 1.5 s tokenisation
            assert not slow.done()
            assert (await slow).status_code == 200

    run(go())


# ------------------------------------------------------------------ 3 and 7: SIGTERM drains
class _Uvicorn:
    should_exit = False


def _drain(ctx):
    from phaseflip.server.launch import Drain, Outcome

    outcome = Outcome()
    drain = Drain(ctx, outcome)
    drain.server = _Uvicorn()
    return drain, outcome


def _events(body: str) -> list[str]:
    return [line.removeprefix("data: ") for line in body.splitlines() if line.startswith("data:")]


def test_sigterm_refuses_new_work_then_ends_open_streams_with_an_error_and_done(tmp_path):
    from phaseflip.server.context import ServerConfig
    from phaseflip.server.launch import EXIT_DRAIN_TIMEOUT

    async def go():
        cfg = ServerConfig(shutdown_timeout=0.5)
        async with fake_server(tmp_path, cfg) as (ctx, app, engine), asgi(app) as c:
            stream = asyncio.create_task(c.post("/v1/completions", json={
                "model": "tiny", "prompt": "x", "max_tokens": 1000, "stream": True}))
            plain = asyncio.create_task(c.post("/v1/completions", json={
                "model": "tiny", "prompt": "x", "max_tokens": 1000}))
            await until(lambda: len(ctx.engine.state.in_flight) == 2)
            drain, outcome = _drain(ctx)
            drain.on_signal(signal.SIGTERM)
            await until(lambda: ctx.shutting_down is not None)
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
            assert (await c.get("/health")).status_code == 503
            assert (await c.get("/metrics")).status_code == 200  # status still answers
            events = _events((await stream).text)
            assert events[-1] == "[DONE]" and len(events) > 3
            err = json.loads(events[-2])["error"]
            assert "shutting down" in err["message"] and "--shutdown-timeout" in err["message"]
            r = await plain
            assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
            await until(lambda: drain.server.should_exit)
            assert outcome.code == EXIT_DRAIN_TIMEOUT and "2 requests" in outcome.reason
            assert sorted(engine.aborted) == sorted(a.rid for a in engine.added)
            metrics = ctx.metrics.render().decode()
            assert sample(metrics, ABORTED, reason="shutdown") == 2.0
            assert sample(metrics, FINISHED, finish_reason="abort") == 2.0

    run(go())


def test_sigterm_lets_requests_finish_within_the_drain(tmp_path):
    from phaseflip.server.launch import EXIT_OK

    async def go():
        async with fake_server(tmp_path) as (ctx, app, engine), asgi(app) as c:
            req = asyncio.create_task(c.post("/v1/completions", json={
                "model": "tiny", "prompt": "x", "max_tokens": 30, "stream": True}))
            await until(lambda: ctx.engine.state.in_flight)
            drain, outcome = _drain(ctx)
            drain.on_signal(signal.SIGTERM)
            events = _events((await req).text)
            assert events[-1] == "[DONE]" and "error" not in events[-2]
            await until(lambda: drain.server.should_exit)
            assert outcome.code == EXIT_OK and not engine.aborted

    run(go())


# ------------------------------------------------------------------ 5: the API key
def test_api_key_guards_every_endpoint_but_health(tmp_path):
    from phaseflip.server.context import ServerConfig

    async def go():
        cfg = ServerConfig(api_key="sekret")
        async with fake_server(tmp_path, cfg) as (_, app, _e), asgi(app) as c:
            routes = [(method, r.path) for r in app.routes for method in r.methods
                      if method != "HEAD"]
            assert len(routes) >= 18
            for method, path in routes:
                r = await c.request(method, path.replace("{model_id:path}", "tiny"))
                if path == "/health":
                    assert r.status_code == 200
                else:
                    assert r.status_code == 401, (method, path)
                    assert r.json()["error"]["code"] == "invalid_api_key"
            key = {"authorization": "Bearer sekret"}
            assert (await c.get("/metrics", headers=key)).status_code == 200
            assert (await c.get("/openapi.json", headers=key)).status_code == 200
        cfg = ServerConfig(api_key="sekret", metrics_without_api_key=True)
        async with fake_server(tmp_path, cfg) as (_, app, _e), asgi(app) as c:
            assert (await c.get("/metrics")).status_code == 200
            assert (await c.get("/server_info")).status_code == 401

    run(go())


# ------------------------------------------------------------------ 5 and 7: /abort_request
def test_abort_request_unknown_is_404_known_aborts_and_is_counted(tmp_path):
    async def go():
        async with fake_server(tmp_path) as (ctx, app, engine), asgi(app) as c:
            r = await c.post("/abort_request", json={"rid": "nope"})
            assert r.status_code == 404 and r.json()["error"]["param"] == "rid"
            gen = asyncio.create_task(c.post("/generate", json={
                "text": ["a", "b"], "rid": "mine", "sampling_params": {"max_new_tokens": 1000}}))
            await until(lambda: len(ctx.engine.state.in_flight) == 2)
            for prefix in ("mi", "min"):  # ids match exactly, never as prefixes
                assert (await c.post("/abort_request", json={"rid": prefix})).status_code == 404
            again = await c.post("/generate", json={"text": ["c", "d"], "rid": "mine"})
            assert again.status_code == 400 and "already in flight" in again.text  # (and the
            # group stays its first owner's: the abort below still finds both prompts)
            r = await c.post("/abort_request", json={"rid": "mine"})
            assert r.status_code == 200 and sorted(r.json()["aborted"]) == ["mine-0", "mine-1"]
            outs = (await gen).json()
            assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort", "abort"]
            metrics = ctx.metrics.render().decode()
            assert sample(metrics, ABORTED, reason="abort_request") == 2.0
            assert sample(metrics, ABORTED, reason="client_disconnect") == 0.0

    run(go())


# ------------------------------------------------------------------ 6: prompts x n
def test_queue_bound_counts_prompts_times_n(tmp_path):
    from phaseflip.server.context import ServerConfig

    async def go():
        cfg = ServerConfig(max_queued_requests=8)
        async with fake_server(tmp_path, cfg) as (ctx, app, engine), asgi(app) as c:
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": ["x"] * 50})
            assert r.status_code == 400 and "50 sequences" in r.json()["error"]["message"]
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": ["x"] * 5,
                                                      "n": 2})
            assert r.status_code == 400 and "10 sequences" in r.json()["error"]["message"]
            first = asyncio.create_task(c.post("/v1/completions", json={
                "model": "tiny", "prompt": ["x"] * 3, "n": 2, "max_tokens": 1000}))
            await until(lambda: len(ctx.engine.state.in_flight) == 3)
            r = await c.post("/v1/chat/completions", json={"model": "tiny", "messages": CHAT,
                                                           "n": 3})
            assert r.status_code == 503 and "6 sequences in flight" in r.json()["error"][
                "message"]
            r = await c.post("/generate", json={"text": ["a", "b", "c"]})
            assert r.status_code == 503
            # only the first request's three reached the engine (its own thread: the front end
            # counts them in flight when it sends them, before the engine has read them)
            await until(lambda: len(engine.added) == 3)
            await asyncio.sleep(0.1)
            assert len(engine.added) == 3
            first.cancel()

    run(go())


def test_queue_bound_holds_for_a_concurrent_burst(tmp_path):
    """Requests arriving together are counted from admission, not from the engine's first
    sight of them: with a bound of 2 a burst of 8 runs 2 (all 8 ran before: each passed the
    check while the others were still on their way to the engine). Streams and clients that
    left give their sequences back when their answer ends."""
    from phaseflip.server.context import ServerConfig

    async def go():
        cfg = ServerConfig(max_queued_requests=2)
        async with fake_server(tmp_path, cfg) as (ctx, app, engine), asgi(app) as c:
            body = {"model": "tiny", "max_tokens": 20}
            burst = await asyncio.gather(*(
                c.post("/v1/completions", json=body | {"prompt": f"p{i}", "stream": i % 2 == 1})
                for i in range(8)))
            codes = sorted(r.status_code for r in burst)
            assert codes == [200, 200] + [503] * 6, codes
            assert len(engine.added) == 2 and ctx.admitted == 0
            await call_and_hang_up(app, "/v1/completions", body | {"prompt": "x",
                                                                   "max_tokens": 1000}, 0.3)
            assert ctx.admitted == 0
            again = await asyncio.gather(*(c.post("/v1/completions", json=body | {
                "prompt": f"q{i}"}) for i in range(2)))
            assert [r.status_code for r in again] == [200, 200]

    run(go())


# ------------------------------------------------------------------ 3: a real `phaseflip serve`
def test_sigterm_on_a_real_server_mid_stream():
    """Streams cut by the drain end with an error event and [DONE], a non-streaming call gets a
    shaped 503, new calls are refused, and the exit code says requests were ended."""
    from phaseflip.server.launch import EXIT_DRAIN_TIMEOUT
    from tests.server_process import start_server

    proc, url = start_server("--shutdown-timeout", "1")
    body = {"model": "tiny-llama", "prompt": "Return the", "max_tokens": 1000,
            "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            async def stream() -> list[str]:
                events = []
                async with c.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line.removeprefix("data: "))
                return events

            streams = [asyncio.create_task(stream()) for _ in range(3)]
            plain = asyncio.create_task(c.post("/v1/completions", json=body))
            await asyncio.sleep(2)
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            refused = await c.post("/v1/completions", json=body)
            return await asyncio.gather(*streams), await plain, refused

    try:
        streams, plain, refused = asyncio.run(main())
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = proc.stdout.read()
    for events in streams:
        assert events[-1] == "[DONE]" and len(events) > 2, events[-3:]
        assert "shutting down" in json.loads(events[-2])["error"]["message"]
    assert plain.status_code == 503 and "shutting down" in plain.json()["error"]["message"]
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "server_shutting_down"
    assert proc.returncode == EXIT_DRAIN_TIMEOUT, log[-2000:]
    last = log.strip().splitlines()[-1]
    assert "exits with code 3" in last and "4 requests" in last, last


def test_a_layout_the_model_cannot_hold_ends_serve_at_once_naming_why():
    """`serve --pp-size 8` on the 4-layer embedded model: refused before the engine process
    starts, exit code 2 (a usage error) and the reason in one line."""
    import subprocess
    import sys

    from tests.server_process import free_port

    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "phaseflip.cli", "serve", "--port", str(free_port()),
         "--device", "cpu", "--pp-size", "8"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1 and "pp_size=8 exceeds the model's 4 layers" in lines[0], lines
    assert time.monotonic() - start < 30


def test_a_step_s_deltas_survive_the_codec():
    """Deltas travel as field tuples (`StreamDelta.as_tuple`): every field comes back, the
    optional ones whether set or not, and the codec still refuses what it does not know."""
    from phaseflip.engine.outputs import StreamDelta, Usage

    plain = StreamDelta("a", 0, "hi", [5])
    full = StreamDelta("b", 1, "", [6, 7], [-0.5, -1.0], [[(6, -0.5)], [(7, -1.0)]], "stop",
                       "</s>", [None, -2.0], [None, [(3, -2.0)]], Usage(3, 2, 1), 1)
    late = StreamDelta("c", 0, "x", [8], cached_tokens=4)
    msg = m.Deltas([plain, full, late], running=3, waiting=1)
    back = m.decode(m.encode(msg))
    assert back == msg and all(type(d) is StreamDelta for d in back.deltas)
    assert plain.as_tuple() == ("a", 0, "hi", [5]) and len(late.as_tuple()) == 12
    import pickle

    with pytest.raises(pickle.UnpicklingError, match="refuses"):
        m.decode(pickle.dumps(pickle.loads))
