"""A rank that dies inside a phase flip's seam (issue 15): the server says so on /health and
every process of the engine exits within 10 s, leaving no rank behind."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.server_process import alive, rank_pids, start_server, stop_server

pytestmark = pytest.mark.timeout(180, method="thread")


def test_a_rank_killed_during_a_seam_stops_the_server_within_10_s():
    """Rank 1 is frozen, a flip starts (its fence waits on rank 1), then rank 1 is killed:
    rank 0's collective fails on the closed connection, the seam marks the engine dead, /health
    turns 503 (or the server is already gone) and the engine, its ranks and the server exit."""
    proc, url = start_server("--tp-size", "2", "--enable-flip", "--enable-hicache",
                             "--hicache-host-gb", "0.01", "--dist-timeout-s", "60",
                             deadline_s=120)
    ranks = rank_pids(proc.pid)
    assert len(ranks) == 1, ranks
    answers: list[int] = []
    try:
        os.kill(ranks[0], signal.SIGSTOP)
        flip = threading.Thread(target=lambda: answers.append(httpx.post(
            url + "/admin/flip", json={"tp_size": 1, "pp_size": 2}, timeout=60).status_code),
            daemon=True)
        flip.start()
        end = time.monotonic() + 30
        while time.monotonic() < end:
            if httpx.get(url + "/server_info", timeout=5).json()["flip_in_progress"]:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the seam never started")
        time.sleep(0.3)  # inside the fence, waiting on the frozen rank
        os.kill(ranks[0], signal.SIGKILL)
        killed = time.monotonic()
        unhealthy = False
        while time.monotonic() < killed + 10 and proc.poll() is None:
            try:
                unhealthy = unhealthy or httpx.get(url + "/health", timeout=1).status_code == 503
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        assert proc.wait(timeout=max(0.1, killed + 10 - time.monotonic())) != 0
        took = time.monotonic() - killed
        out = proc.stdout.read()
        assert took <= 10, out[-3000:]
        assert "phaseflip-rank1" in out or "rank 1" in out, out[-3000:]
        assert unhealthy or answers == [] or answers[0] >= 500, (answers, out[-3000:])
    finally:
        if proc.poll() is None:
            stop_server(proc)
    assert not any(alive(p) for p in ranks), "orphaned rank"
