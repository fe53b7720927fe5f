"""Operations (issue 18): health, shutdown, limits, auth and abort accounting of the front end.

Most tests drive the real front end against a scripted engine (`tests/fake_engine.py`), so
they take milliseconds; the few that need a real `phaseflip serve` say so.
"""

from __future__ import annotations

import asyncio

import httpx

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
