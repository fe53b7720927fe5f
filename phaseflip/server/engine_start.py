"""The engine process, started before the front end imports anything heavy.

A spawned engine spends its first seconds importing torch, transformers and the engine, as
the front end does before it can check the flags and the model. So `phaseflip serve` spawns
the engine first thing (this module imports nothing of torch's), lets it import beside the
front end, and holds it at a gate: it touches nothing (no model, no sockets, no session of
its own) until the front end's checks pass and it says go (`EngineStart.go`). A check that
fails ends it unheard (`close`: SIGTERM, which ends a process importing or waiting at the
gate at once), so a bad flag is still a one-line error and exit code 2 with nothing of the
engine's in the log. A front end that dies first closes the gate's pipe: the engine reads
EOF and exits. On a 2-core box a server is ready ~2 s sooner (docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import shutil
import signal
import tempfile
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from pathlib import Path

from phaseflip.config import EngineConfig

IPC_DIR_PREFIX = "phaseflip-"  # the launcher's temporary IPC directory (the engine removes it too)
GATE_WAIT_S = 5.0  # how long `close` waits for an engine it ended


class EngineStart:
    """The engine process from its spawn to the front end's go: its IPC addresses, its
    process, and the gate's write end."""

    def __init__(self, cfg: EngineConfig) -> None:
        # a SIGTERM/SIGINT before the launcher's own handlers (`launch._signals_drain`) is
        # kept for it, not death with the engine and the IPC directory left behind
        self.signalled: str | None = None
        self.opened = False
        self._handlers = {sig: signal.signal(sig, self._heard)
                          for sig in (signal.SIGTERM, signal.SIGINT)}
        self.ipc_dir = tempfile.mkdtemp(prefix=IPC_DIR_PREFIX)
        self.requests_addr = f"ipc://{self.ipc_dir}/requests"
        self.outputs_addr = f"ipc://{self.ipc_dir}/outputs"
        ctx = mp.get_context("spawn")
        gate_r, self._gate = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=_engine_at_the_gate,
            args=(gate_r, cfg, self.requests_addr, self.outputs_addr),
            name="phaseflip-engine", daemon=False)  # (it spawns ranks)
        _start_shielded(self.proc)
        gate_r.close()  # the child holds it now: EOF reaches it when the front end is gone

    def _heard(self, sig: int, frame) -> None:
        self.signalled = self.signalled or signal.Signals(sig).name

    def go(self) -> None:
        """The front end's checks passed and its sockets are bound: the engine may start. An
        engine that died at its imports has closed its end: its exit is the launcher's to
        report (`_announce` names its exit code), not a broken pipe here."""
        with contextlib.suppress(OSError):
            self._gate.send(True)
        self._gate.close()
        self.opened = True

    def close(self) -> None:
        """Ends an engine that never got its go (a check failed, a signal came) and removes
        the IPC directory; an engine that got it is the launcher's to stop (`_stop_engine`)."""
        if not self.opened:
            for sig, handler in self._handlers.items():  # (the launcher's own never came)
                signal.signal(sig, handler)
            self._gate.close()
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(GATE_WAIT_S)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(GATE_WAIT_S)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def _start_shielded(proc: mp.Process) -> None:
    """Starts the engine process with SIGINT blocked, a mask it inherits: a Ctrl-C while it
    imports or waits at the gate waits in it until `engine_main` has moved it to a session
    of its own and ignores SIGINT, instead of a KeyboardInterrupt traceback. (SIGTERM stays
    deliverable: it ends an engine that made nothing yet at once. The resource tracker is
    started first: its start unblocks SIGINT.)"""
    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        proc.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _engine_at_the_gate(gate: Connection, cfg: EngineConfig, requests_addr: str,
                        outputs_addr: str) -> None:
    """The engine process: the imports, then the front end's go, then `engine_main`. EOF at
    the gate (the front end closed it or is gone) ends the process having made nothing."""
    from phaseflip.server.engine_process import engine_main  # the slow part, done waiting

    _import_the_tokenizers_modules()
    try:
        go = gate.recv()
    except (EOFError, OSError):
        go = False
    gate.close()
    if go:
        engine_main(cfg, requests_addr, outputs_addr)
    else:  # a killed front end never removes its IPC directory
        shutil.rmtree(Path(requests_addr.removeprefix("ipc://")).parent, ignore_errors=True)


# What loading a tokenizer imports (transformers 5: its tokenizer classes, and through them
# torch.distributed.tensor and sympy): ~2.7 s on a 2-core box, the engine's first work after
# its go. Imported at the gate instead, a tokenizer then loads in ~0.02 s.
TOKENIZER_MODULES = ("transformers.activations", "transformers.models.auto.tokenization_auto",
                     "transformers.tokenization_utils_tokenizers", "transformers.image_utils")


def _import_the_tokenizers_modules() -> None:
    for name in TOKENIZER_MODULES:
        with contextlib.suppress(Exception):  # another transformers: its own names
            importlib.import_module(name)
