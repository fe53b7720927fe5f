"""A real `phaseflip serve` subprocess on a loopback port, for the tests that drive one."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*args: str, deadline_s: float = 60, device: str = "cpu"
                 ) -> tuple[subprocess.Popen, str]:
    """`phaseflip serve` on a free loopback port with the accounting checks on; returns once
    /health answers 200 (raises with the server's output if it exits or the deadline passes)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "phaseflip.cli", "serve", "--port", str(port), "--device", device,
         "--check-accounting", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_server(proc)
    raise RuntimeError("server did not become healthy in time")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise



def rank_pids(server_pid: int) -> list[int]:
    """The worker ranks of a `phaseflip serve` process (those of each engine child)."""
    from phaseflip.distributed.spawner import child_pids
    from phaseflip.distributed.spawner import rank_pids as engine_ranks

    return [r for engine in child_pids(server_pid) for r in engine_ranks(engine)]


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
