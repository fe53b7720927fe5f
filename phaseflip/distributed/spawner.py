"""Starting rank processes: forked from a server that has torch imported already.

A rank started by `spawn` is a fresh interpreter that imports torch before it can join its
group: ~1.2 s of CPU a rank (two-core CPU box, torch 2.13), paid again by every rank of every
launch. `multiprocessing`'s forkserver is one such interpreter, started once per driver
process with torch preloaded; each rank is then a fork of it (a tp2 engine on the CPU: built
in 0.17 s instead of 1.2 s). The forkserver never touches CUDA, so its forks may.

What a fork does not get the way a spawned child does, `start_rank` hands over explicitly:
the driver's environment *now* (the forkserver's is the driver's at the forkserver's start;
ranks read switches such as `PHASEFLIP_NO_STAGE_PIPES` that a caller may set later) and the
driver's current stdout / stderr (the forkserver's are the driver's at its start: a log
redirected since would lose the ranks' lines). The target and its arguments travel pickled
inside the call, so that the modules they import see that environment (plain pickle: no
multiprocessing queues or locks among them). The working directory and `sys.path` are
multiprocessing's own preparation data, as under spawn. What stays the forkserver's, from
the driver's first rank start: what `import torch` read from the environment then
(`TORCH_DISTRIBUTED_DEBUG`, `TORCH_LOGS`, ...), `LD_*` and `PYTHON*` settings, umask, rlimits
and CPU affinity. A driver that changes those between engines wants PHASEFLIP_SPAWN_RANKS=1.
A forkserver this process already runs with other preloads is not used (spawn instead).

A rank's parent is the forkserver, not the driver, and the forkserver outlives the driver while
any rank lives: a rank that watches for its driver's death (`watchdog.PositionTracker`) reads
multiprocessing's pipe from the driver, not `os.getppid()`.
`PHASEFLIP_SPAWN_RANKS=1` starts ranks by spawn instead (for diagnosis).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
from collections.abc import Callable
from multiprocessing import forkserver, reduction
from pathlib import Path

from phaseflip.heap import freeze_for_exit

SPAWN_ENV = "PHASEFLIP_SPAWN_RANKS"
PRELOAD = ["torch"]  # ~90 % of a rank's import time; our own modules import after the env


def _context() -> mp.context.BaseContext:
    if os.environ.get(SPAWN_ENV) == "1" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    server = getattr(forkserver, "_forkserver", None)
    if getattr(server, "_forkserver_pid", None) is not None \
            and getattr(server, "_preload_modules", None) != PRELOAD:
        # a forkserver someone else started (other preloads, maybe code that touched CUDA,
        # which a fork must not inherit): not ours to fork ranks from
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # before the forkserver starts: it preloads these
    return ctx


def start_rank(target: Callable[..., object], args: tuple, name: str,
               daemon: bool = False) -> mp.Process:
    """Starts `target(*args)` in a new process (see the module docstring) and returns it."""
    ctx = _context()
    payload = pickle.dumps((target, args))
    if ctx.get_start_method() == "spawn":
        proc = ctx.Process(target=_run, name=name, daemon=daemon, args=(None, None, payload))
    else:
        proc = ctx.Process(target=_run, name=name, daemon=daemon,
                           args=(dict(os.environ), _Stdio(), payload))
    proc.start()
    return proc


class _Stdio:
    """The driver's fds 1 and 2, passed to the child by the forkserver (`DupFd` registers
    them with the starting process's popen while the process object is pickled)."""

    def __reduce__(self):
        return _Stdio._rebuild, tuple(reduction.DupFd(fd) if _is_open(fd) else None
                                      for fd in (1, 2))

    @staticmethod
    def _rebuild(*fds) -> tuple[int | None, ...]:
        return tuple(None if fd is None else fd.detach() for fd in fds)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _run(env: dict[str, str] | None, stdio: tuple[int | None, ...] | None,
         payload: bytes) -> None:
    """The child's entry: the driver's environment and stdio first, then the target. A rank
    ignores SIGINT: a Ctrl-C at the terminal reaches the whole process group, and the driver
    ends its ranks itself (a rank dying first left a traceback per rank and exit status 1)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    if stdio is not None:
        for fd, target_fd in zip(stdio, (1, 2)):
            if fd is not None and fd != target_fd:
                os.dup2(fd, target_fd)
                os.close(fd)
    target, args = pickle.loads(payload)
    target(*args)
    freeze_for_exit()  # a spawned child's exit finalises the interpreter: no heap walks


def child_pids(pid: int) -> list[int]:
    """The direct children of `pid` (Linux /proc; [] where it cannot be read)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def rank_pids(engine_pid: int) -> list[int]:
    """The worker ranks an engine process started on this host: the children of its rank
    forkserver, or its spawned children (PHASEFLIP_SPAWN_RANKS=1) — never multiprocessing's
    resource tracker or the forkserver itself. For tools that watch ranks (soak, tests)."""
    ranks = []
    for p in child_pids(engine_pid):
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            continue
        if b"forkserver" in cmd:
            ranks += child_pids(p)
        elif b"resource_tracker" not in cmd:
            ranks.append(p)
    return ranks
