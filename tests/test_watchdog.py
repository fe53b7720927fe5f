"""The engine watchdog: a loop with work that finishes no step is reported and stopped; an idle
one never is."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from phaseflip.distributed.watchdog import StepWatchdog
from tests.server_process import rank_pids

pytestmark = pytest.mark.timeout(120, method="thread")


def watch(timeout_s: float = 0.3) -> tuple[StepWatchdog, list[float]]:
    fired: list[float] = []
    return StepWatchdog(timeout_s, fired.append, poll_s=0.05), fired


def test_busy_loop_without_progress_fires_once():
    dog, fired = watch()
    dog.beat(True)
    time.sleep(1.0)
    dog.close()
    assert len(fired) == 1 and fired[0] >= 0.3


def test_idle_and_progressing_loops_never_fire():
    dog, fired = watch()
    dog.beat(False)  # idle: no deadline, however long
    time.sleep(0.8)
    for _ in range(16):  # busy, but a step finishes every 0.05 s
        dog.beat(True)
        time.sleep(0.05)
    dog.beat(False)
    time.sleep(0.5)
    dog.close()
    assert fired == []


def test_wedged_rank_with_work_is_reported_and_the_server_exits():
    """Rank 1 frozen mid-request: rank 0 waits in an all-reduce whose group timeout (60 s) is
    far away; the watchdog (2 s) reports every rank's position, /health turns 503 and the
    engine exits with its stall code, the server non-zero with it, leaving no rank behind."""
    import httpx

    from tests.server_process import start_server, stop_server

    proc, url = start_server("--tp-size", "2", "--watchdog-timeout-s", "2",
                             "--dist-timeout-s", "60")
    ranks = rank_pids(proc.pid)
    try:
        assert len(ranks) == 1, ranks
        body = {"model": "tiny-llama", "prompt": "Return the", "max_tokens": 1000,
                "ignore_eos": True, "stream": True}
        started = threading.Event()

        def client() -> None:
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                    for _ in r.iter_lines():
                        started.set()
            except httpx.HTTPError:
                pass

        threading.Thread(target=client, daemon=True).start()
        assert started.wait(30)
        os.kill(ranks[0], signal.SIGSTOP)
        health = None
        end = time.monotonic() + 20
        while time.monotonic() < end and proc.poll() is None:
            try:
                r = httpx.get(url + "/health", timeout=1)
                if r.status_code == 503:
                    health = r
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        assert health is not None, "/health never answered 503"
        # the watchdog has fired: the engine goes whatever the rank does now. A stopped rank
        # would keep the log pipe and the front end's resource tracker open; a wedged one
        # exits on its own when it sees its parent gone.
        _resume(ranks)
        assert proc.wait(timeout=30) != 0
        out = proc.stdout.read()
        assert "exit code 3" in out, out[-3000:]
        assert "watchdog: no engine step finished" in out, out[-3000:]
        assert "rank 0: step" in out and "rank 1: " in out, out[-3000:]
    finally:
        _resume(ranks)
        if proc.poll() is None:
            stop_server(proc)
    end = time.monotonic() + 15
    while time.monotonic() < end and any(os.path.exists(f"/proc/{p}") for p in ranks):
        time.sleep(0.2)
    assert not any(os.path.exists(f"/proc/{p}") for p in ranks), "orphaned rank"


def _resume(pids: list[int]) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGCONT)
        except ProcessLookupError:
            pass
