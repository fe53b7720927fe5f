"""Grammar builds and compiles that can be stopped: each new grammar is first tried in a child
process, within a wall-clock budget, and the child is killed when the budget runs out or when
nobody waits for the grammar any more.

xgrammar cannot interrupt a build or a compile, and a thread cannot be killed. Under the
64 KiB cap a schema of 2 600 optional integer properties compiled for 580 s (one CPU core,
a 4 096-token vocabulary), and the 43-character schema {"type": "string", "pattern":
"[a-z]{0,8000}"} builds for 12 s, growing with the square of the count: either held a compile
thread (or the front end's check thread) to its end, long after its client gave up.

What the child compiled does not come back: `CompiledGrammar.serialize_json` writes every
rule's own copy of the grammar's whole automaton (a 1 000-property schema: 357 MB, 64 s to
write and 32 s to read for a 1 s compile; a 10 ms compile: 0.9 MB, 115 ms + 65 ms; a small
schema with a 64k vocabulary: 26 ms against a 24 ms compile, with the same masks). So the
child is a trial run: the caller compiles again in its own thread once the child succeeded,
which then ends within about the budget. A child serves one trial at a time and lives on
between trials (its start, importing xgrammar and torch, takes seconds); a killed one is
replaced at the next trial. Children die with the thread that started them (Linux's parent
death signal), so one thread of the `GrammarProbes` starts them all and lives until it closes:
the process ending, however it ends, takes its children with it.

A child's memory is bounded too (RLIMIT_DATA, set once it has started): a grammar whose
compile would take the host's RAM before the budget runs out fails an allocation instead, and
its request gets the same 400 as one past the budget. The limit is headroom over what the
started child holds (xgrammar, torch and the vocabulary: ~0.2 GiB on the CPU, more where
torch is a CUDA build), and counts the heap and anonymous mappings but not the shared
libraries' code, which RLIMIT_AS would.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

from phaseflip.errors import InvalidRequestError

if TYPE_CHECKING:
    from phaseflip.sampling.grammar import GrammarSpec

COMPILE_BUDGET_S = 30.0
"""Longest a grammar's trial (build and compile) may take before its request gets a 400: a
real schema compiles in milliseconds; one that needs more than this is a mistake or an
attack, and would hold a compile thread as long again when compiled for use."""
TRIAL_MEMORY_BYTES = 4 * 2**30
"""Most memory a grammar's trial may take on top of what its started child holds: a large
real schema takes tens of MB (1 500 optional properties, a 32k vocabulary: 50 MB)."""
START_TIMEOUT_S = 300.0  # a child that has not imported xgrammar by then is stuck: a 400
_POLL_S = 0.05  # how often a waiting trial looks whether it is still wanted
_OUTCOMES = 256  # finished trials remembered per `GrammarProbes` (LRU)
_PR_SET_PDEATHSIG = 1
_OUT_OF_MEMORY_EXIT = 3  # a child's exit code when a trial ran out of its memory
_SIMPLER = "(fewer optional properties or alternatives, smaller repetition counts)"


class GrammarTooComplexError(InvalidRequestError):
    """A grammar whose build and compile outlasted the budget or the memory limit (its
    trial was killed, or its child ran out of memory or died)."""


class CompileCancelled(Exception):  # noqa: N818 — a stop, not a failure
    """The trial was stopped: no request waits for it any more, or the probes were closed."""


class _ChildDied(Exception):  # noqa: N818
    """The child ended during a trial (a crash, the OOM killer) or before it started one."""


class _Child:
    """One trial process and the parent's end of its pipe. One thread at a time uses it and
    alone closes the pipe (`close`); any thread may kill the process (`stop`), which the
    user sees as the pipe's end (a pipe closed under it could be another's by then)."""

    def __init__(self, memory_bytes: int) -> None:
        """A fresh interpreter (a fork of a threaded CUDA process is not safe; multiprocessing's
        spawn would run the parent's main script again, unguarded in user scripts). It starts
        in the directory `phaseflip` came from: `python -m` puts its working directory first
        on the path, so another checkout in the server's would have been the child's code."""
        ours, theirs = socket.socketpair()
        root = str(Path(__file__).resolve().parents[2])  # where `phaseflip` is imported from
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        self.memory_bytes = memory_bytes
        with theirs:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno()), str(os.getpid()),
                 str(memory_bytes)],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, cwd=root,
                env={**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"})
        self.conn = Connection(ours.detach())
        self.told = False  # its tokenizer sent
        self.ready = False

    def start(self, tokenizer_json: Callable[[], str | None],
              cancelled: Callable[[], bool]) -> None:
        """Hands the child its tokenizer (None: builds only) and waits for it to be ready. A
        request that stops waiting leaves the child starting, for the next trial."""
        try:
            if not self.told:
                self.conn.send(tokenizer_json())
                self.told = True
            deadline = time.monotonic() + START_TIMEOUT_S
            while not self.conn.poll(_POLL_S):
                if cancelled():
                    raise CompileCancelled
                if time.monotonic() > deadline:
                    self.stop()
                    raise InvalidRequestError(
                        f"structured output is unavailable: the grammar compile process did "
                        f"not start within {START_TIMEOUT_S:g} s", "response_format")
            problem = self.conn.recv()
        except (EOFError, OSError):
            raise _ChildDied from None
        if problem is not None:  # (xgrammar could not be imported there)
            self.stop()
            raise InvalidRequestError(problem, "response_format")
        self.ready = True

    def attempt(self, spec: GrammarSpec, budget_s: float, cancelled: Callable[[], bool],
                param: str) -> str | None:
        """The child's verdict on `spec` (None: it built and compiled), or the child killed
        and `GrammarTooComplexError` / `CompileCancelled` raised."""
        try:
            self.conn.send(spec)
        except OSError:
            raise _ChildDied from None  # (before the trial: not the grammar's fault)
        deadline = time.monotonic() + budget_s
        try:
            while not self.conn.poll(_POLL_S):
                if cancelled():
                    self.stop()
                    raise CompileCancelled
                if time.monotonic() > deadline:
                    self.stop()
                    raise GrammarTooComplexError(
                        f"grammar too complex to compile within {budget_s:g} s: simplify the "
                        f"{spec.kind} {_SIMPLER}", param)
            return self.conn.recv()
        except (EOFError, OSError):
            self.stop()
            if cancelled():
                raise CompileCancelled from None
            raise self._died(spec, param) from None

    def _died(self, spec: GrammarSpec, param: str) -> GrammarTooComplexError:
        """The 400 of a trial that ended its child: out of its memory (an allocation failed),
        or killed by the system (the OOM killer) or crashed, which is told by the exit code."""
        code = self.proc.returncode
        how = "" if code == _OUT_OF_MEMORY_EXIT else (
            f" (compiling it ended the compile process, exit code {code})")
        return GrammarTooComplexError(
            f"grammar too complex to compile within {_size(self.memory_bytes)} of memory"
            f"{how}: simplify the {spec.kind} {_SIMPLER}", param)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(1.0)  # (reaped: a SIGKILL ends it at once)

    def close(self) -> None:
        self.stop()
        self.conn.close()


def _size(n: int) -> str:
    """`n` bytes as the error words it: 4 GiB, 16 MiB."""
    return f"{n / 2**30:g} GiB" if n >= 2**30 else f"{n / 2**20:g} MiB"


class GrammarProbes:
    """Trial runs of grammars in at most `processes` children (started when first needed),
    each within `budget_s` and `memory_bytes` (over what the started child holds).
    `tokenizer_json`: what the children compile against (`TokenizerInfo.serialize_json`),
    asked for once per child; None: they build only (the front end's check). Thread-safe:
    each trial takes a child of its own."""

    def __init__(self, budget_s: float = COMPILE_BUDGET_S, processes: int = 2,
                 tokenizer_json: Callable[[], str | None] | None = None,
                 memory_bytes: int = TRIAL_MEMORY_BYTES) -> None:
        if budget_s <= 0 or processes < 1 or memory_bytes <= 0:
            raise ValueError("GrammarProbes needs budget_s > 0, processes >= 1 and "
                             "memory_bytes > 0")
        self.budget_s, self.processes, self.memory_bytes = budget_s, processes, memory_bytes
        self._tokenizer_json = tokenizer_json or (lambda: None)
        self._lock = threading.Condition()
        self._idle: list[_Child] = []
        self._children: set[_Child] = set()
        self._starting = 0  # children being started (outside the lock)
        self._outcomes: OrderedDict[GrammarSpec, str | None] = OrderedDict()
        self._closed = False
        # starts every child: a child dies with the thread that started it (no thread here)
        self._starter = ThreadPoolExecutor(1, thread_name_prefix="phaseflip-grammar-start")

    @property
    def pids(self) -> list[int]:
        """The children's process ids (for tests and operators)."""
        with self._lock:
            return [c.proc.pid for c in self._children]

    def problem(self, spec: GrammarSpec, cancelled: Callable[[], bool] | None = None,
                param: str = "response_format") -> str | None:
        """What is wrong with `spec` (None: it builds, and compiles where the children have a
        tokenizer) as a child found within the budget. Raises `GrammarTooComplexError` (the
        client's 400) when the budget ran out, `CompileCancelled` once `cancelled()` is true."""
        with self._lock:
            if spec in self._outcomes:
                self._outcomes.move_to_end(spec)
                return self._outcomes[spec]
        stop = cancelled or (lambda: False)
        for _ in range(3):  # a child that died between trials is replaced, twice at most
            with self._lease(stop) as child:
                try:
                    if not child.ready:
                        child.start(self._tokenizer_json, lambda: self._closed or stop())
                    problem = child.attempt(spec, self.budget_s,
                                            lambda: self._closed or stop(), param)
                except _ChildDied:
                    child.stop()
                    continue
            self._remember(spec, problem)
            return problem
        raise InvalidRequestError("structured output is unavailable: the grammar compile "
                                  "process keeps dying; see the server log", param)

    def _remember(self, spec: GrammarSpec, problem: str | None) -> None:
        with self._lock:
            self._outcomes[spec] = problem
            if len(self._outcomes) > _OUTCOMES:
                self._outcomes.popitem(last=False)

    @contextlib.contextmanager
    def _lease(self, cancelled: Callable[[], bool]) -> Iterator[_Child]:
        """A child of this caller's own until the block ends: an idle one, a new one, or
        the first to come free. One found dead at the end is closed and forgotten."""
        with self._lock:
            while not self._idle and len(self._children) + self._starting >= self.processes:
                if self._closed or cancelled():
                    raise CompileCancelled
                self._lock.wait(_POLL_S)
            if self._closed:
                raise CompileCancelled
            child = self._idle.pop() if self._idle else None
            self._starting += child is None
        if child is None:
            child = self._start()
        try:
            yield child
        finally:
            with self._lock:
                keep = child.alive() and not self._closed
                if keep:
                    self._idle.append(child)
                else:
                    self._children.discard(child)
                self._lock.notify()
            if not keep:
                child.close()

    def _start(self) -> _Child:
        """A new child, started by the starter thread, outside the lock (a start takes a
        while); `CompileCancelled` if the probes closed meanwhile."""
        try:
            child = self._starter.submit(_Child, self.memory_bytes).result()
        except RuntimeError:  # (the starter is shut down: closed)
            raise CompileCancelled from None
        except OSError as e:
            raise InvalidRequestError(f"structured output is unavailable: the grammar compile "
                                      f"process could not start ({e})", "response_format") from e
        finally:
            with self._lock:
                self._starting -= 1
        with self._lock:
            if not self._closed:
                self._children.add(child)
                return child
        child.close()
        raise CompileCancelled

    def close(self) -> None:
        """Kills every child, a trial's too (it ends with `CompileCancelled`). Idempotent."""
        with self._lock:
            self._closed = True
            idle, busy = self._idle, [c for c in self._children if c not in self._idle]
            self._idle, self._children = [], set()
            self._lock.notify_all()
        for child in idle:
            child.close()
        for child in busy:  # (its user closes the pipe)
            child.stop()
        self._starter.shutdown(wait=False)


# ------------------------------------------------------------------ the child


def _serve(conn: Connection, parent_pid: int, memory_bytes: int) -> None:
    """A child's life: dies with its parent, imports xgrammar (while the parent reads its
    vocabulary), takes its tokenizer, bounds its memory, then answers each spec with its
    problem or None; a trial out of memory ends it (`_OUT_OF_MEMORY_EXIT`: answering could
    need memory, and a restart gives the next trial a clean heap)."""
    _die_with_parent(parent_pid)
    from phaseflip.sampling import grammar  # (not above: grammar imports this module)

    try:
        compiler = grammar.trial_compiler(conn.recv)
    except Exception as e:  # noqa: BLE001 — told to the parent, which refuses the request
        conn.send(grammar.problem_text(e))
        return
    _limit_memory(memory_bytes)
    conn.send(None)
    while True:
        try:
            spec = conn.recv()
        except EOFError:  # the parent closed its end: nothing more to do
            return
        try:
            problem = grammar.trial(spec, compiler)
        except MemoryError:
            os._exit(_OUT_OF_MEMORY_EXIT)
        conn.send(problem)


def _limit_memory(headroom: int) -> None:
    """Lets this process's heap and anonymous mappings (RLIMIT_DATA, Linux 4.7 on) grow by
    `headroom` bytes at most, so a compile fails an allocation before it takes the host's
    RAM; a no-op where there is no /proc (there RLIMIT_DATA leaves mmap unbounded)."""
    import resource

    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return
    held = next((int(line.split()[1]) * 1024 for line in status.splitlines()
                 if line.startswith("VmData:")), None)
    if held is None:
        return
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    soft = held + headroom if hard == resource.RLIM_INFINITY else min(held + headroom, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL when the thread that started this process ends (Linux), even inside a compile
    that never returns to Python; gone at once if that happened already."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)


if __name__ == "__main__":  # a child: python -m ...grammar_worker FD PARENT_PID MEMORY_BYTES
    _serve(Connection(int(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3]))
