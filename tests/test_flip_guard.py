"""The front end's flip guard (issue 18 item 11): one flip at a time, for as long as the engine
is in a seam — also after `POST /admin/flip` answered 504, and for automatic flips.

The front end is the real one, against the scripted engine of `tests/fake_engine.py`, which
announces its seams with `FlipState` as the engine process does; the last test drives a real
`phaseflip serve --tp-size 2 --enable-flip`.
"""

from __future__ import annotations

import asyncio
import os
import time

import httpx

from phaseflip.server import messages as m
from phaseflip.server.context import ServerConfig
from tests.fake_engine import fake_server, until

TP1PP2 = {"tp_size": 1, "pp_size": 2}
TP2PP1 = {"tp_size": 2, "pp_size": 1}


def asgi(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


async def get(c: httpx.AsyncClient, path: str) -> httpx.Response:
    """A status call that must answer at once, not wait behind a seam."""
    return await asyncio.wait_for(c.get(path), 5)


def test_flip_state_survives_the_codec():
    assert m.decode(m.encode(m.FlipState("tp1×pp2"))) == m.FlipState("tp1×pp2")
    assert m.decode(m.encode(m.FlipState(None))) == m.FlipState(None)


def test_a_flip_that_timed_out_holds_the_guard_until_its_seam_ends(tmp_path):
    """504 after --flip-timeout-s while the seam runs on: a second flip is 409 (it never
    reaches the engine), status calls answer from the front end, and once the engine says
    the seam ended flips are taken again. Before the fix the 504 cleared the guard: the
    second flip was sent to the engine behind the first."""
    async def go():
        cfg = ServerConfig(flip_timeout_s=0.3)
        async with fake_server(tmp_path, cfg, seam_s=2.0) as (ctx, app, engine), \
                asgi(app) as c:
            r = await c.post("/admin/flip", json=TP1PP2)
            assert r.status_code == 504, r.text
            assert r.json()["error"]["type"] == "timeout_error"
            assert ctx.engine.state.flipping_to == "tp1×pp2"  # the engine is in its seam

            r = await asyncio.wait_for(c.post("/admin/flip", json=TP2PP1), 5)
            assert r.status_code == 409, r.text
            assert r.json()["error"]["code"] == "flip_in_progress"
            assert "tp1×pp2" in r.json()["error"]["message"]
            info = await get(c, "/server_info")
            assert info.status_code == 200 and info.json()["flip_in_progress"] == "tp1×pp2"
            metrics = (await get(c, "/metrics")).text
            assert 'phaseflip_flip_in_progress{model_name="tiny",to="tp1×pp2"} 1.0' in metrics

            await until(lambda: ctx.flip_in_progress is None, timeout_s=10)
            assert engine.flips == [TP1PP2]  # the 409 never reached the engine
            info = (await get(c, "/server_info")).json()
            assert info["flip_in_progress"] is None and info["pool"]["balanced"]
            assert 'phaseflip_flip_in_progress{model_name="tiny",to=""} 0.0' in (
                await get(c, "/metrics")).text
            engine.seam_s = 0.0
            r = await asyncio.wait_for(c.post("/admin/flip", json=TP2PP1), 5)
            assert r.status_code == 200, r.text
            assert engine.flips == [TP1PP2, TP2PP1]

    asyncio.run(go())


def test_the_guard_holds_until_the_engine_answers_even_before_its_seam_starts(tmp_path):
    """A flip still queued in the engine when its caller got 504 (the engine has not said
    'seam' yet) keeps the guard too: it is held until the engine answers the call."""
    async def go():
        cfg = ServerConfig(flip_timeout_s=0.2)
        async with fake_server(tmp_path, cfg, seam_s=0.5) as (ctx, app, engine), \
                asgi(app) as c:
            busy = engine.auto_flip("tp1×pp2")  # the engine's own seam: the flip waits
            await until(lambda: ctx.engine.state.flipping_to == "tp1×pp2")
            ctx.engine.state.flipping_to = None  # as if its FlipState were not here yet
            r = await c.post("/admin/flip", json=TP2PP1)
            assert r.status_code == 504, r.text
            busy.set()
            r = await asyncio.wait_for(c.post("/admin/flip", json=TP1PP2), 5)
            assert r.status_code == 409, r.text
            await until(lambda: ctx.flip_in_progress is None, timeout_s=10)
            assert engine.flips == [TP2PP1]

    asyncio.run(go())


def test_an_automatic_seam_holds_the_guard_and_status_answers_from_the_front_end(tmp_path):
    """The flip policy's seam runs inside an engine step, with no HTTP call: the engine's
    FlipState alone makes /admin/flip 409 and /server_info and /metrics answer at once
    (before, they waited behind the seam, up to their 30 s limit)."""
    async def go():
        async with fake_server(tmp_path) as (ctx, app, engine), asgi(app) as c:
            done = engine.auto_flip("tp1×pp2")
            # A call the engine answers before its seam starts rightly says no flip: wait
            # for the engine's FlipState, then every status call must answer at once.
            await until(lambda: ctx.engine.state.flipping_to == "tp1×pp2")
            info = await get(c, "/server_info")
            assert info.status_code == 200 and info.json()["flip_in_progress"] == "tp1×pp2"
            r = await asyncio.wait_for(c.post("/admin/flip", json=TP2PP1), 5)
            assert r.status_code == 409, r.text
            metrics = await get(c, "/metrics")
            assert 'phaseflip_flip_in_progress{model_name="tiny",to="tp1×pp2"} 1.0' in (
                metrics.text)
            done.set()
            await until(lambda: ctx.flip_in_progress is None)
            info = (await get(c, "/server_info")).json()
            assert info["flip_in_progress"] is None and "pool" in info
            assert engine.flips == []

    asyncio.run(go())


def test_a_real_flip_past_its_timeout_keeps_the_guard():
    """A real `phaseflip serve` whose flip outlives --flip-timeout-s (the engine process is
    held with SIGSTOP, so the seam cannot be quicker than the test): 504, then 409 for another
    flip and /server_info says a flip is under way; once the engine goes on, its seam ends,
    the guard lifts, and the layout is the one asked for."""
    import os
    import signal

    from benchmarks.proc_stats import engine_pid
    from tests.server_process import start_server, stop_server

    proc, url = start_server("--tp-size", "2", "--enable-flip", "--enable-hicache",
                             "--hicache-host-gb", "0.01", "--flip-timeout-s", "1",
                             deadline_s=120)
    engine = engine_pid(proc.pid)
    assert engine is not None
    try:
        os.kill(engine, signal.SIGSTOP)
        try:
            r = httpx.post(url + "/admin/flip", json=TP1PP2, timeout=60)
            assert r.status_code == 504, r.text
            r = httpx.post(url + "/admin/flip", json=TP2PP1, timeout=60)
            assert r.status_code == 409, r.text
            info = httpx.get(url + "/server_info", timeout=10).json()
            assert info["flip_in_progress"] == "tp1×pp2"
        finally:
            os.kill(engine, signal.SIGCONT)
        end = time.monotonic() + 120
        while time.monotonic() < end:
            info = httpx.get(url + "/server_info", timeout=10).json()
            if info["flip_in_progress"] is None:
                break
            time.sleep(0.05)
        assert info["flip_in_progress"] is None
        assert (info["config"]["tp_size"], info["config"]["pp_size"]) == (1, 2)
        assert info["pool"]["balanced"]
        r = httpx.post(url + "/admin/flip", json=TP2PP1, timeout=60)  # taken again
        assert r.status_code in (200, 504), r.text
    finally:
        stop_server(proc)


def test_the_engine_announces_manual_and_automatic_seams(monkeypatch):
    """The engine core's seam listener (the engine process sends FlipState through it) hears
    the start and the end of every seam: a manual flip, and one the auto policy starts inside
    a step. Red if a flip path stops going through `EngineCore.flip` (the front end would then
    wait behind the seam)."""
    import pytest

    from phaseflip.config import EMBEDDED_MODEL, EngineConfig
    from phaseflip.engine.core import EngineCore
    from phaseflip.flip.policy import Decision
    from phaseflip.model.config import ModelConfig
    from phaseflip.model.loader import load_tokenizer
    from phaseflip.sampling.params import SamplingParams

    cfg = EngineConfig(model=EMBEDDED_MODEL, device="cpu", tp_size=2, enable_flip=True,
                       enable_hicache=True, hicache_host_gb=0.01, flip_policy="auto",
                       max_total_tokens=2048, check_accounting=True)
    core = EngineCore(cfg, ModelConfig.from_dir(EMBEDDED_MODEL), load_tokenizer(EMBEDDED_MODEL))
    said: list[m.FlipState] = []
    core.seam_listener = lambda target: said.append(m.FlipState(target))
    try:
        core.flip(1, 2)
        assert said == [m.FlipState("tp1×pp2"), m.FlipState(None)]
        monkeypatch.setattr(core.flip_policy, "decide",
                            lambda *_: Decision((2, 1), "test: flip back"))
        core.add_request("r", [5, 6, 7], SamplingParams(max_new_tokens=2))
        core.step()
        assert said[2:] == [m.FlipState("tp2×pp1"), m.FlipState(None)]
        assert (core.cfg.tp_size, core.cfg.pp_size) == (2, 1)
        monkeypatch.undo()
        with pytest.raises(Exception, match="already running"):
            core.flip(2, 1)  # a refused target still ends what it announced
        assert said[4:] == [m.FlipState("tp2×pp1"), m.FlipState(None)]
        # memory flat across flips: without the heap trim after each seam rank 0's RSS grew
        # ~1.3 MiB a flip (glibc kept the retired layouts' pages), +5-7 % over these 20
        for i in range(24):
            if i == 4:
                warm = _rss_bytes()
            core.add_request(f"m{i}", [5, 6, 7, 8], SamplingParams(max_new_tokens=4))
            while core.has_work():
                core.step()
            core.flip(*((1, 2) if core.cfg.tp_size == 2 else (2, 1)))
        growth = _rss_bytes() / warm - 1
        assert growth < 0.025, f"rank 0 RSS grew {growth:+.1%} over 20 flips"
    finally:
        core.close()


def _rss_bytes() -> int:
    """Private resident memory (the host tier is shared memory, resident as it fills)."""
    from benchmarks.proc_stats import private_rss_bytes

    return private_rss_bytes(os.getpid())[0]
