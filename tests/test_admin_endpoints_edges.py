"""Edges of the operators' endpoints: /server_info before the engine is ready or when it
does not answer, /flush_cache during a flip or when the engine does not answer, an abort asked
twice, and a manual flip to a layout outside --flip-layouts.

The front end is the real one, against the scripted engine of `tests/fake_engine.py` (or a
bare socket standing for an engine that is still loading); the flip refusal is checked where
the engine makes it (`check_target`), without starting ranks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from phaseflip.errors import InvalidRequestError
from phaseflip.server import messages as m
from phaseflip.server.app import build_app
from phaseflip.server.context import ServerConfig, ServerContext
from phaseflip.server.engine_client import EngineClient
from tests import fake_engine
from tests.fake_engine import fake_server, tokenizer, until

DEADLINE_S = 5.0  # every call here must answer well within it (none waits on the engine)
TP1PP2 = {"tp_size": 1, "pp_size": 2}


def aborted_total(ctx: ServerContext, reason: str) -> float:
    """phaseflip_aborted_requests_total{reason} as /metrics renders it."""
    for family in text_string_to_metric_families(ctx.metrics.render().decode()):
        for s in family.samples:
            if s.name == "phaseflip_aborted_requests_total" and s.labels["reason"] == reason:
                return s.value
    raise AssertionError(f"no aborted_requests_total{{reason={reason!r}}}")


def asgi(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


async def call(c: httpx.AsyncClient, method: str, path: str, **kw) -> httpx.Response:
    """One request that must answer within DEADLINE_S (a hang fails the test, not the run)."""
    return await asyncio.wait_for(c.request(method, path, **kw), DEADLINE_S)


@asynccontextmanager
async def silent_engine(tmp: Path, ready: bool) -> AsyncIterator[ServerContext]:
    """A front end whose engine is connected but never answers a control call: one still
    loading its model (`ready=False`), or one wedged after its Ready (`ready=True`)."""
    req, out = f"ipc://{tmp}/req", f"ipc://{tmp}/out"
    client = EngineClient(req, out, None)
    client.start()
    zctx = zmq.Context()
    inbox = zctx.socket(zmq.PULL)
    inbox.connect(req)  # (its queue takes the calls: a send does not wait for a reader)
    if ready:
        client.state.ready = m.Ready(model="tiny", max_context=1024, vocab_size=4096,
                                     kv_capacity_tokens=16384, device="cpu", dtype="float32")
    try:
        yield ServerContext(ServerConfig(), client, tokenizer(), "tiny")
    finally:
        inbox.close(linger=0)
        zctx.term()
        await client.close()


def test_server_info_while_the_engine_loads_is_a_prompt_503(tmp_path, monkeypatch):
    """Both names of /server_info say 503 "still loading" at once, as /get_server_info
    always did. /server_info used to send "info" to the loading engine and wait: 500
    "TimeoutError" after 30 s (a model loads for minutes), or an AttributeError on the
    missing Ready."""
    monkeypatch.setattr("phaseflip.server.context.INFO_TIMEOUT_S", 1.0)  # (a red run: 500)

    async def go():
        async with silent_engine(tmp_path, ready=False) as ctx, asgi(build_app(ctx)) as c:
            for path in ("/server_info", "/get_server_info"):
                r = await call(c, "GET", path)
                assert r.status_code == 503, (path, r.text)
                assert "still loading" in r.json()["error"]["message"]
            assert (await call(c, "GET", "/metrics")).status_code == 200  # (no engine call)

    asyncio.run(go())


def test_flush_cache_during_a_flip_is_a_prompt_409(tmp_path, monkeypatch):
    """A flush while the engine is in a seam is refused at once (409 flip_in_progress, as a
    second flip is), GET and POST; it used to queue behind the seam, which answers nothing
    until it ends (up to --flip-timeout-s): the flush waited it out, or 500 after 30 s. Once
    the seam ended the flush reaches the engine again."""
    info = fake_engine._info
    monkeypatch.setattr(fake_engine, "_info", lambda: info() | {"freed_tokens": 0})

    async def go():
        async with fake_server(tmp_path, seam_s=3.0) as (ctx, app, engine), asgi(app) as c:
            flip = asyncio.create_task(c.post("/admin/flip", json=TP1PP2))
            await until(lambda: ctx.engine.state.flipping_to is not None)
            for method in ("POST", "GET"):
                r = await call(c, method, "/flush_cache")
                assert r.status_code == 409, (method, r.text)
                assert r.json()["error"]["code"] == "flip_in_progress"
                assert "tp1×pp2" in r.json()["error"]["message"]
            assert (await asyncio.wait_for(flip, 10)).status_code == 200
            await until(lambda: ctx.flip_in_progress is None)
            r = await call(c, "POST", "/flush_cache")
            assert r.status_code == 200 and r.json() == {"freed_tokens": 0}, r.text
            assert engine.flips == [TP1PP2]

    asyncio.run(go())


@pytest.mark.parametrize(("flags", "why"), [
    ({"flip_layouts": "tp4,pp4"}, "--flip-layouts tp4,pp4"),
    ({"flip_policy": "auto"}, "the default --flip-layouts of --flip-policy auto"),
])
def test_a_flip_outside_the_flip_layouts_names_the_two(flags: dict, why: str):
    """tp4 flipping between tp4 and pp4 (named, or auto's default pair): a manual flip to
    tp2×pp2 is refused naming the layouts it may go to. The refusal used to be the config
    check's "the launch layout tp2×pp2 must be one of the two; pass --flip-layouts with it",
    which called the target the launch layout and sent the operator to a launch flag."""
    from phaseflip.config import EMBEDDED_MODEL, EngineConfig
    from phaseflip.flip.seam import check_target
    from phaseflip.model.config import ModelConfig

    cfg = EngineConfig(model=str(EMBEDDED_MODEL), tp_size=4, enable_flip=True,
                       enable_hicache=True, **flags)
    model_cfg = ModelConfig.from_dir(EMBEDDED_MODEL)
    with pytest.raises(InvalidRequestError) as e:
        check_target(cfg, model_cfg, 2, 2)
    assert str(e.value) == (f"cannot flip to tp2×pp2: this server flips only between "
                            f"tp4×pp1 and tp1×pp4 ({why})")
    assert e.value.param == "layout"
    check_target(cfg, model_cfg, 1, 4)  # (the other one of the two is taken)


@pytest.mark.parametrize(("method", "path", "words"), [
    ("POST", "/flush_cache", "0.3 s"), ("GET", "/server_info", "did not answer 'info'")])
def test_a_silent_engine_is_a_504_not_a_500(tmp_path, monkeypatch, method, path, words):
    """A ready engine that does not answer a flush or "info" in time (wedged, or in a step
    longer than the wait): 504 timeout_error naming the wait, not 500 "internal error:
    TimeoutError"; /metrics still answers, with the front end's figures as they were."""
    monkeypatch.setattr("phaseflip.server.context.INFO_TIMEOUT_S", 0.3)

    async def go():
        async with silent_engine(tmp_path, ready=True) as ctx, asgi(build_app(ctx)) as c:
            r = await call(c, method, path)
            assert r.status_code == 504, r.text
            err = r.json()["error"]
            assert err["type"] == "timeout_error" and words in err["message"], err
            scrape = await call(c, "GET", "/metrics")
            assert scrape.status_code == 200 and "phaseflip_requests_total" in scrape.text

    asyncio.run(go())


def test_a_scrape_during_a_long_step_renders_the_last_figures(tmp_path, monkeypatch):
    """/metrics waits SCRAPE_INFO_WAIT_S for the engine's figures, not INFO_TIMEOUT_S: a scrape
    during a long step (or a paused engine) answered only after 30 s, past Prometheus's 10 s
    scrape timeout."""
    monkeypatch.setattr("phaseflip.server.context.INFO_TIMEOUT_S", 20.0)
    monkeypatch.setattr("phaseflip.server.context.SCRAPE_INFO_WAIT_S", 0.3)

    async def go():
        async with silent_engine(tmp_path, ready=True) as ctx, asgi(build_app(ctx)) as c:
            start = time.monotonic()
            scrape = await asyncio.wait_for(c.get("/metrics"), 5.0)
            assert scrape.status_code == 200 and "phaseflip_requests_total" in scrape.text
            assert time.monotonic() - start < 2.0

    asyncio.run(go())


def test_an_abort_asked_twice_counts_one_aborted_request(tmp_path):
    """/abort_request twice (a retry, or abort_all beside it) before the engine's end of the
    request came back: both answer 200, the request ends once, and
    aborted_requests_total{reason="abort_request"} counts it once, as it counts engine
    requests ended early. Each call used to add the ids it sent."""
    async def go():
        async with fake_server(tmp_path) as (ctx, app, engine), asgi(app) as c:
            gen = asyncio.create_task(c.post("/generate", json={
                "text": "a", "rid": "once", "sampling_params": {"max_new_tokens": 1000}}))
            await until(lambda: "once" in ctx.engine.state.in_flight)
            release = engine.auto_flip("tp1×pp2")  # the engine answers nothing meanwhile
            await until(lambda: ctx.engine.state.flipping_to is not None)
            for body in ({"rid": "once"}, {"rid": "once"}, {"abort_all": True}):
                r = await call(c, "POST", "/abort_request", json=body)
                assert r.status_code == 200 and r.json()["aborted"] == ["once"], r.text
            release.set()
            r = await asyncio.wait_for(gen, DEADLINE_S)
            assert r.json()["meta_info"]["finish_reason"]["type"] == "abort", r.text
            assert aborted_total(ctx, "abort_request") == 1.0
            r = await call(c, "POST", "/abort_request", json={"rid": "once"})
            assert r.status_code == 404  # (ended: nothing left to abort)

    asyncio.run(go())
