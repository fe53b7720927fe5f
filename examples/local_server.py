"""`phaseflip serve` in a child process on a free loopback port, for the examples that need a
server and were not given one (`--base-url`)."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator


@contextlib.contextmanager
def local_server(*flags: str, timeout_s: float = 180) -> Iterator[str]:
    """Yields the server's base URL (`http://127.0.0.1:PORT`) once /health answers 200."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "phaseflip.cli", "serve", "--port", str(port),
                             *flags])
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"phaseflip serve exited with code {proc.returncode}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > end:
                raise SystemExit("phaseflip serve did not become ready in time")
            time.sleep(0.3)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
