"""Rank processes forked from the driver's forkserver (`distributed/spawner.py`): they must get
what a spawned rank gets — the driver's environment, working directory and stdio as they are
when the rank starts — and must neither die with a live driver nor outlive a dead one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phaseflip.distributed.spawner import SPAWN_ENV, start_rank
from tests.server_process import alive

pytestmark = pytest.mark.timeout(120, method="thread")
PROBE_ENV = "PHASEFLIP_TEST_SPAWNER_PROBE"


def _report(path: str) -> None:
    Path(path).write_text(f"{os.environ.get(PROBE_ENV)}\n{os.getcwd()}\n")
    print("rank stdout line", flush=True)
    print("rank stderr line", file=sys.stderr, flush=True)


def _watch_driver(driver_pid: int) -> None:
    from phaseflip.distributed.watchdog import PositionTracker

    PositionTracker(1, None, driver_pid)
    time.sleep(60)


@pytest.mark.parametrize("spawn", [False, True], ids=["forkserver", "spawn"])
def test_a_rank_gets_the_drivers_environment_cwd_and_stdio_as_they_are_now(
        spawn, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv(SPAWN_ENV, "1" if spawn else "0")
    with capfd.disabled():  # the forkserver (if this starts it) gets the terminal's fds
        start_rank(_report, (str(tmp_path / "first"),), name="first").join(60)
    monkeypatch.setenv(PROBE_ENV, "set after the forkserver started")
    monkeypatch.chdir(tmp_path)
    proc = start_rank(_report, (str(tmp_path / "second"),), name="second")
    proc.join(60)
    assert proc.exitcode == 0
    env, cwd = (tmp_path / "second").read_text().splitlines()
    assert env == "set after the forkserver started"
    assert Path(cwd).resolve() == tmp_path.resolve()
    out, err = capfd.readouterr()
    assert "rank stdout line" in out and "rank stderr line" in err


DRIVER = """
import sys, time
from phaseflip.distributed.spawner import start_rank
from tests.test_spawner import _watch_driver
import os
if __name__ == "__main__":
    rank = start_rank(_watch_driver, (os.getpid(),), name="rank1", daemon=False)
    print(rank.pid, flush=True)
    time.sleep(120)
"""


def test_a_rank_lives_with_its_driver_and_exits_soon_after_it_dies(tmp_path):
    """The rank's parent is the forkserver, not the driver: it must not take that for the
    driver's death (it lives on), and must notice the real one (it exits within ~2 s)."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    root = Path(__file__).resolve().parents[1]
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    try:
        rank = int(driver.stdout.readline())
        time.sleep(2.5)  # two passes of the rank's driver check
        assert alive(rank), "the rank exited while its driver lives"
        driver.send_signal(signal.SIGKILL)  # not reaped below until the rank is checked:
        deadline = time.monotonic() + 10  # a dead driver still answers kill(pid, 0)
        while alive(rank) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(rank), "the rank outlived its driver"
        driver.wait(10)
    finally:
        if driver.poll() is None:
            driver.kill()


def _note_freeze_at_exit(path: str) -> None:
    import atexit
    import gc

    atexit.register(lambda: Path(path).write_text(str(gc.get_freeze_count())))


def test_a_spawned_rank_exits_with_its_heap_frozen(tmp_path, monkeypatch):
    """A spawned child finalises its interpreter (a forked one `os._exit`s): frozen first,
    its exit's collector passes walk no heap (`heap.freeze_for_exit`). The atexit hook runs
    after the target returns, before finalisation: red without the freeze (count 0)."""
    monkeypatch.setenv(SPAWN_ENV, "1")
    proc = start_rank(_note_freeze_at_exit, (str(tmp_path / "frozen"),), name="exit")
    proc.join(60)
    assert proc.exitcode == 0
    assert int((tmp_path / "frozen").read_text()) > 1000
