"""`phaseflip serve` stopped the ways operators stop it: SIGTERM to the whole process group
(`timeout`, `kill -- -PGID`), SIGTERM while the model loads, a front end SIGKILLed.

Each drives a real server of the embedded model and waits on processes with deadlines, so a
hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.server_process import alive, free_port, start_server


def _engine_pid(front_pid: int, deadline_s: float = 30) -> int:
    """The engine process of a `phaseflip serve` (its spawned child that is not
    multiprocessing's resource tracker), once it exists."""
    from phaseflip.distributed.spawner import child_pids

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        for pid in child_pids(front_pid):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
                return pid
        time.sleep(0.01)
    raise AssertionError(f"no engine process under pid {front_pid} in {deadline_s} s")


def _gone(pids: list[int], deadline_s: float) -> list[int]:
    """The pids still alive after `deadline_s` (polled)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def _kill_all(proc: subprocess.Popen, pids: list[int]) -> None:
    """Clean-up, also after a failed assertion: nothing of the server outlives the test."""
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


async def _stream(url: str, max_tokens: int, first: asyncio.Event) -> list[str]:
    """Streams one completion; `first` is set at its first event. Returns its data lines."""
    events = []
    body = {"model": "tiny-llama", "prompt": "Return the", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=60) as c, \
            c.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                first.set()
    return events


def test_group_sigterm_drains_the_request_in_flight_and_exits_0():
    """SIGTERM to the process group reaches the front end only: the engine finishes the
    stream (it does not stop at once, failing it), the exit code is 0, nothing is left."""
    proc, url = start_server("--shutdown-timeout", "20", "--skip-warmup")
    engine = _engine_pid(proc.pid)
    try:
        async def main() -> list[str]:
            first = asyncio.Event()
            stream = asyncio.create_task(_stream(url, 40, first))
            await asyncio.wait_for(first.wait(), 30)
            os.killpg(proc.pid, signal.SIGTERM)  # (start_server: its own session)
            return await stream

        events = asyncio.run(main())
        proc.wait(timeout=30)
        left = _gone([engine], 10)
    finally:
        _kill_all(proc, [engine])
    log = proc.stdout.read()
    assert events[-1] == "[DONE]" and "error" not in events[-2], (events[-3:], log[-2000:])
    assert proc.returncode == 0, log[-2000:]
    assert "exits with code 0" in log.strip().splitlines()[-1], log[-2000:]
    assert not left, f"left running: {left}"


def _serve_until_the_engine_starts(tmp: str) -> tuple[subprocess.Popen, int]:
    """A `phaseflip serve` (its own session, IPC directory under `tmp`) and its engine's pid,
    as soon as the engine process exists: the model is not loaded yet."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "phaseflip.cli", "serve", "--port", str(free_port()),
         "--device", "cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env=os.environ | {"TMPDIR": tmp})
    try:
        return proc, _engine_pid(proc.pid)
    except AssertionError:
        _kill_all(proc, [])
        raise AssertionError(proc.stdout.read()[-2000:]) from None


def test_sigterm_while_the_model_loads_leaves_no_engine_and_no_ipc_dir():
    """SIGTERM to the front end as soon as the engine process exists: the front end stops
    the engine, removes its IPC directory and exits 1 (never ready); nothing is orphaned."""
    tmp = tempfile.mkdtemp(prefix="pf-")  # short: the IPC socket paths live under it
    proc, engine = _serve_until_the_engine_starts(tmp)
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        left = _gone([engine], 10)
    finally:
        _kill_all(proc, [engine])
        leaked = list(Path(tmp).glob("phaseflip-*"))
        shutil.rmtree(tmp)
    log = proc.stdout.read()
    assert not left, f"engine {engine} orphaned; log:\n{log[-2000:]}"
    assert proc.returncode == 1, (proc.returncode, log[-2000:])
    assert "stopped before the engine was ready" in log.strip().splitlines()[-1], log[-2000:]
    assert not leaked, leaked


def test_a_front_end_sigkilled_while_the_model_loads_takes_the_engine_down():
    """The engine, in a session of its own, watches its front end from its first line on
    (not from after its imports): killed during the load, the front end leaves nothing, its
    IPC directory included (the engine removes it: the front end's clean-up never ran)."""
    tmp = tempfile.mkdtemp(prefix="pf-")
    proc, engine = _serve_until_the_engine_starts(tmp)
    try:
        # killed before the engine's entry ran (multiprocessing still handing it its
        # arguments), nothing could know the directory: wait for the entry's first act, a
        # session of its own
        end = time.monotonic() + 30
        while os.getsid(engine) != engine and time.monotonic() < end:
            time.sleep(0.005)
        proc.kill()
        proc.wait(timeout=10)
        left = _gone([engine], 20)  # (it notices once its imports are done)
    finally:
        _kill_all(proc, [engine])
        leaked = list(Path(tmp).glob("phaseflip-*"))
        shutil.rmtree(tmp)
    assert not left, f"engine {engine} outlived its front end"
    assert not leaked, leaked


def test_a_second_signal_says_it_cut_the_drain_short(tmp_path):
    """The ended stream's error and the exit line name the second signal, not a
    --shutdown-timeout that never ran out (scripted engine: milliseconds)."""
    from phaseflip.server.context import ServerConfig
    from phaseflip.server.launch import EXIT_DRAIN_TIMEOUT, Drain, Outcome
    from tests.fake_engine import fake_server, until

    class Uvicorn:
        should_exit = False

    async def go() -> None:
        async with fake_server(tmp_path, ServerConfig(shutdown_timeout=30)) as (ctx, app, _), \
                httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                  base_url="http://t") as c:
            stream = asyncio.create_task(c.post("/v1/completions", json={
                "model": "tiny", "prompt": "x", "max_tokens": 1000, "stream": True}))
            await until(lambda: ctx.engine.state.in_flight)
            outcome = Outcome()
            drain = Drain(ctx, outcome)
            drain.server = Uvicorn()
            drain.on_signal(signal.SIGTERM)
            await until(lambda: ctx.shutting_down is not None)
            drain.on_signal(signal.SIGINT)
            text = (await stream).text
            await until(lambda: drain.server.should_exit)
        assert "ended by a second signal (SIGINT)" in text and "within" not in text, text[-300:]
        assert outcome.code == EXIT_DRAIN_TIMEOUT, outcome
        assert "a second signal (SIGINT) cut the 30 s drain short, ending 1 requests" in \
            outcome.reason and "after the" not in outcome.reason, outcome.reason

    asyncio.run(go())


def test_a_control_call_with_no_engine_to_read_it_gives_up_in_time(tmp_path):
    """The front end's "shutdown" to an engine already gone: the send itself is bounded (a
    PUSH socket with no peer waited for ever, and the server with it)."""
    from phaseflip.server.engine_client import EngineClient

    async def go() -> float:
        client = EngineClient(f"ipc://{tmp_path}/req", f"ipc://{tmp_path}/out", None)
        start = time.monotonic()
        try:
            with pytest.raises(asyncio.TimeoutError):  # (the outer bound: a hang fails here)
                await asyncio.wait_for(client.control("shutdown", timeout_s=0.2), 5)
            assert client._calls == {}
            return time.monotonic() - start
        finally:
            await client.close()

    assert asyncio.run(go()) < 2
