"""What an operator sees (issue 21 items 4, 5): the model_name label on every metrics series,
GET /version, the request log (--log-requests), --log-level in uvicorn and the engine, and
the thread plan in the ready line.

The front-end tests drive the real app against the scripted engine (`tests/fake_engine.py`);
the log-level ones need a real `phaseflip serve` and say so.
"""

from __future__ import annotations

import asyncio
import logging
import re
import subprocess
import sys

import httpx
from prometheus_client.parser import text_string_to_metric_families

from phaseflip.config import EngineConfig
from phaseflip.server.context import ServerConfig
from phaseflip.threads import plan_for
from phaseflip.versions import version_info
from tests.fake_engine import fake_server
from tests.server_process import start_server, stop_server


def asgi(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def test_every_metrics_series_carries_the_model_name(tmp_path):
    async def go():
        async with fake_server(tmp_path) as (ctx, app, engine), asgi(app) as c:
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": ["a", "b"],
                                                      "max_tokens": 2})
            assert r.status_code == 200, r.text
            ctx.metrics.observe_hicache({  # the HiCache families too (off in the fake engine)
                "host_hit_tokens": 1, "disk_hit_tokens": 0, "bytes_written": 2,
                "bytes_loaded": 3, "bytes_stored": 0, "store_gbps": 1.5, "load_gbps": None,
                "pages_written": 1, "miss_pages": 0, "corrupt_pages": 0, "host_evictions": 0,
                "disk_evictions": 0, "disk_writes_dropped": 0, "sync_writebacks": 0,
                "disk_write_failures": 0, "disk_read_errors": 0, "foreign_pages": 0})
            return (await c.get("/metrics")).text

    text = asyncio.run(go())
    families = list(text_string_to_metric_families(text))
    samples = [s for f in families for s in f.samples]
    assert len(families) >= 17 and len(samples) > 50
    unlabelled = [s for s in samples if s.labels.get("model_name") != "tiny"]
    assert unlabelled == []
    finished = {s.labels["finish_reason"]: s.value for s in samples
                if s.name == "phaseflip_requests_total"}
    assert finished == {"length": 2.0}


def test_get_version_answers_version_info(tmp_path):
    async def go():
        async with fake_server(tmp_path) as (_, app, _engine), asgi(app) as c:
            r = await c.get("/version")
            schema = (await c.get("/openapi.json")).json()
            info = (await c.get("/server_info")).json()
            return r, schema, info

    r, schema, info = asyncio.run(go())
    assert r.status_code == 200 and r.json() == version_info()
    assert "/version" in schema["paths"]
    assert info["versions"]["phaseflip"] == version_info()["version"]


LINE = re.compile(r"request (\S+) (\w+) (\S+) (\S+) prompt_tokens=(\d+) completion_tokens=(\d+) "
                  r"(\d+\.\d+) s$")


def logged(caplog) -> list[tuple]:
    return [LINE.search(r.getMessage()).groups() for r in caplog.records
            if r.name == "phaseflip.requests"]


def test_request_log_has_one_line_per_request(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="phaseflip.requests")

    async def go():
        async with fake_server(tmp_path, ServerConfig(log_requests=True)) as (_, app, _e), \
                asgi(app) as c:
            ok = await c.post("/v1/completions", headers={"x-request-id": "r-1"},
                              json={"model": "tiny", "prompt": [[1, 2, 3], [4, 5]],
                                    "max_tokens": 3})
            assert ok.status_code == 200
            async with c.stream("POST", "/v1/chat/completions", json={
                    "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4, "stream": True}) as s:
                assert [line async for line in s.aiter_lines() if line][-1] == "data: [DONE]"
            bad = await c.post("/v1/completions", json={"model": "nope", "prompt": "x"})
            assert bad.status_code == 404
            await c.get("/health")  # probes and scrapes are left out
            await c.get("/metrics")
            await c.get("/no%0Asuch")

    asyncio.run(go())
    lines = logged(caplog)
    assert [line[:6] for line in lines] == [
        ("r-1", "POST", "/v1/completions", "200", "5", "6"),
        (lines[1][0], "POST", "/v1/chat/completions", "200", lines[1][4], "4"),
        (lines[2][0], "POST", "/v1/completions", "404", "0", "0"),
        (lines[3][0], "GET", "/no\\nsuch", "404", "0", "0"),  # one line, whatever the path
    ]
    assert int(lines[1][4]) > 0 and all(float(line[6]) < 30 for line in lines)


def test_no_request_log_unless_asked(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="phaseflip.requests")

    async def go():
        async with fake_server(tmp_path) as (_, app, _e), asgi(app) as c:
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": "a"})
            assert r.status_code == 200

    asyncio.run(go())
    assert logged(caplog) == []


# ------------------------------------------------------------------ a real server's log
def _output_after_one_request(*args: str) -> str:
    proc, url = start_server(*args)
    try:
        r = httpx.post(url + "/v1/completions", json={"model": "tiny-llama", "prompt": "Hello",
                                                      "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        stop_server(proc)
    return proc.stdout.read()


def test_log_level_info_shows_uvicorn_the_engine_and_the_thread_plan():
    out = _output_after_one_request()
    ready = next(line for line in out.splitlines() if "phaseflip ready:" in line)
    assert ready.endswith("; " + plan_for(EngineConfig()).describe() + ")"), ready
    assert "Uvicorn running on" in out  # uvicorn at --log-level info
    assert "phaseflip.model.runner KV pool:" in out  # the engine process's INFO lines
    assert "phaseflip.requests" not in out and '"POST /v1/completions' not in out


def test_log_level_warning_quiets_uvicorn_and_the_engine_but_not_the_request_log():
    out = _output_after_one_request("--log-level", "warning", "--log-requests")
    assert "Uvicorn running on" not in out and "phaseflip ready:" not in out
    assert "phaseflip.model.runner" not in out, out  # the engine process follows the flag
    assert re.search(r"phaseflip\.requests request \S+ POST /v1/completions 200 "
                     r"prompt_tokens=2 completion_tokens=2 ", out), out


def test_serve_help_lists_log_requests():
    out = subprocess.run([sys.executable, "-m", "phaseflip.cli", "serve", "--help"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    assert "--log-requests" in out and "--log-level" in out
