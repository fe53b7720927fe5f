"""Turns a stalled rank into a named error that carries every rank's position.

Each rank records where it is (`tracker.at("recv hidden mb 2 from rank 0")`); a daemon thread
publishes that position to a file in the group's run directory once a second. Blocking
collectives carry the process-group timeout, so a rank waiting on a send that never comes gets
an exception instead of hanging; `stall_error` then reads every rank's last position so the
error says who waited for what, and who was where.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path


class DistributedStallError(RuntimeError):
    """A rank waited on a peer past the timeout; the message names every rank's position."""


class PositionTracker:
    def __init__(self, rank: int, run_dir: str | None, parent_pid: int | None = None) -> None:
        self.rank, self.run_dir = rank, Path(run_dir) if run_dir else None
        self.step, self.label, self.since = -1, "starting", time.time()
        self._stop = threading.Event()
        self._parent = parent_pid  # the driver's pid (not always ours: see `_driver_gone`)
        self._ppid = os.getppid()
        self._thread = threading.Thread(target=self._publish_loop, daemon=True,
                                        name=f"phaseflip-watchdog-{rank}")
        self._thread.start()

    @contextmanager
    def at(self, label: str, step: int | None = None):
        if step is not None:
            self.step = step
        prev = self.label
        self.label, self.since = label, time.time()
        yield  # no finally: after an exception the position stays where the rank failed
        self.label, self.since = prev, time.time()

    def set(self, label: str) -> None:
        self.label, self.since = label, time.time()

    def _publish_loop(self) -> None:
        while not self._stop.wait(1.0):
            if self._driver_gone():
                sys.stderr.write(f"rank {self.rank}: parent process is gone; exiting\n")
                os._exit(1)  # the driver died: nothing left to serve, do not linger
            self.publish()

    def _driver_gone(self) -> bool:
        """Whether the driver that started this rank has died. A rank forked by the driver's
        forkserver (`spawner.py`) has the forkserver as its parent, which outlives the driver
        while any rank lives, and a dead driver not yet reaped still answers `kill(pid, 0)`:
        the pipe multiprocessing keeps from the driver (`parent_process().sentinel`, closed
        when the driver dies, reaped or not) is what tells; the pid and the parent are the
        fallbacks."""
        if self._parent is None:
            return False
        parent = multiprocessing.parent_process()
        if parent is not None and parent.sentinel is not None:
            with contextlib.suppress(OSError, ValueError):
                if multiprocessing.connection.wait([parent.sentinel], 0):
                    return True
        if os.getppid() != self._ppid:
            return True
        try:
            os.kill(self._parent, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # alive, another user's
        return False

    def publish(self) -> None:
        if self.run_dir is None:
            return
        pos = {"rank": self.rank, "step": self.step, "label": self.label,
               "waiting_s": round(time.time() - self.since, 1), "pid": os.getpid()}
        tmp = self.run_dir / f".rank{self.rank}.tmp"
        try:
            tmp.write_text(json.dumps(pos))
            os.replace(tmp, self.run_dir / f"rank{self.rank}.json")
        except OSError:
            pass  # the run directory is gone: the group is shutting down

    def positions(self, world_size: int) -> list[str]:
        self.publish()
        out = []
        for r in range(world_size):
            f = self.run_dir / f"rank{r}.json" if self.run_dir else None
            try:
                p = json.loads(f.read_text())
                out.append(f"rank {r}: step {p['step']}, {p['label']} ({p['waiting_s']} s)")
            except (OSError, ValueError, AttributeError):
                out.append(f"rank {r}: position unknown (another host, or not started)")
        return out

    def stall_error(self, exc: BaseException, world_size: int) -> DistributedStallError:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        lines = "\n  ".join(self.positions(world_size))
        return DistributedStallError(
            f"rank {self.rank} stalled at step {self.step} while '{self.label}': {exc}\n"
            f"  {lines}")

    def close(self) -> None:
        self._stop.set()


class StepWatchdog:
    """Notices an engine loop that makes no progress while it has work.

    The loop calls `beat(busy)` once per iteration (two attribute writes). A daemon thread
    wakes once a second; when the loop has had work for `timeout_s` without coming round
    again, it calls `on_stall(waited_s)` once. Idle time never counts: an idle server is not a
    stalled one. Collectives inside a step carry the group timeout; this is what catches a
    driver that wedges outside them (host code, a lock, a plan broadcast that never returns),
    which its ranks, waiting for plans without a deadline, cannot see.
    """

    def __init__(self, timeout_s: float, on_stall: Callable[[float], None],
                 poll_s: float = 1.0) -> None:
        self.timeout_s, self.on_stall = timeout_s, on_stall
        self._busy_since: float | None = None  # monotonic time of the last beat with work
        self._fired = False
        self._stop = threading.Event()
        self._poll_s = min(poll_s, timeout_s / 4)
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name="phaseflip-step-watchdog")
        self._thread.start()

    def beat(self, busy: bool) -> None:
        self._busy_since = time.monotonic() if busy else None

    def _loop(self) -> None:
        while not self._stop.wait(self._poll_s):
            since = self._busy_since
            if since is None or self._fired:
                continue
            waited = time.monotonic() - since
            if waited >= self.timeout_s:
                self._fired = True
                self.on_stall(waited)

    def close(self) -> None:
        self._stop.set()
