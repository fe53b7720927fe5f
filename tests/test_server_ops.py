"""Operations (issue 18): health, shutdown, limits, auth and abort accounting of the front end.

Most tests drive the real front end against a scripted engine (`tests/fake_engine.py`), so
they take milliseconds; the few that need a real `phaseflip serve` say so.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from phaseflip.server import messages as m
from tests.fake_engine import fake_server, until


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
            assert 'phaseflip_aborted_requests_total{reason="client_disconnect"} 1.0' in metrics

    run(go())
