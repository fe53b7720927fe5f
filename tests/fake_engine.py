"""An in-process front end wired to a scripted engine over real ZeroMQ sockets.

The front end (`EngineClient`, `ServerContext`, the FastAPI app) is the real one; the engine
is a thread that answers `Ready`, control calls and requests the way `engine_process` does,
but generates a fixed token per step, so front-end behaviour (health, shutdown, aborts,
limits) is tested in milliseconds without a model.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import zmq

from phaseflip.config import EMBEDDED_MODEL
from phaseflip.engine.outputs import StreamDelta, Usage
from phaseflip.model.loader import load_tokenizer
from phaseflip.server import messages as m
from phaseflip.server.app import build_app
from phaseflip.server.context import ServerConfig, ServerContext
from phaseflip.server.engine_client import EngineClient

_TOKENIZER = None


def tokenizer():
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = load_tokenizer(EMBEDDED_MODEL)
    return _TOKENIZER


@dataclass
class FakeEngine:
    """Answers like the engine process: one token ("a", id 64) per request every `step_s`.
    A "flip" control call is a seam of `seam_s` seconds announced by `FlipState` at its start
    and end, during which nothing is answered; `seam_until` holds the loop in a seam of the
    engine's own (an automatic flip) until it is set."""

    requests_addr: str
    outputs_addr: str
    step_s: float = 0.01
    added: list[m.AddRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    flips: list[dict] = field(default_factory=list)  # the "flip" calls' arguments, in order
    seam_s: float = 0.0

    def start(self) -> None:
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.connect(self.requests_addr)
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.connect(self.outputs_addr)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._auto: list[tuple[str, threading.Event]] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def send(self, msg: m.Message) -> None:
        with self._lock:
            self.outbox.send(m.encode(msg))

    def _run(self) -> None:
        self.send(m.Ready(model="tiny", max_context=1024, vocab_size=4096,
                          kv_capacity_tokens=16384, device="cpu", dtype="float32"))
        running: dict[str, tuple[m.AddRequest, int]] = {}
        while not self._stop.is_set():
            while self._auto:
                target, done = self._auto.pop(0)
                self.seam(target, functools.partial(done.wait, 30))
            while self.inbox.poll(0):
                msg = m.decode(self.inbox.recv())
                if isinstance(msg, m.AddRequest):
                    self.added.append(msg)
                    running[msg.rid] = (msg, 0)
                elif isinstance(msg, m.AbortRequest):
                    self.aborted.append(msg.rid)
                    if running.pop(msg.rid, None) is not None:
                        self.send(m.Deltas([_delta(msg.rid, "abort", 0, 0)]))
                elif isinstance(msg, m.Control) and msg.op == "flip":
                    self.flips.append(msg.args)
                    self.seam(_layout(msg.args), lambda: time.sleep(self.seam_s))
                    self.send(m.ControlReply(msg.call_id, True, {"seam": "census"}))
                elif isinstance(msg, m.Control):
                    self.send(m.ControlReply(msg.call_id, True, _info()))
            deltas = []
            for rid, (req, done) in list(running.items()):
                done += 1
                last = done >= req.params.max_new_tokens
                deltas.append(_delta(rid, "length" if last else None, len(req.prompt_ids), done))
                if last:
                    del running[rid]
                else:
                    running[rid] = (req, done)
            if deltas:
                self.send(m.Deltas(deltas, running=len(running)))
            time.sleep(self.step_s)

    def seam(self, target: str, run) -> None:
        """`run()` as a seam to `target`, announced as the engine does."""
        self.send(m.FlipState(target))
        try:
            run()
        finally:
            self.send(m.FlipState(None))

    def auto_flip(self, target: str) -> threading.Event:
        """Makes the loop enter a seam of its own at its next turn (as the flip policy does
        inside a step); it lasts until the returned event is set."""
        done = threading.Event()
        self._auto.append((target, done))
        return done

    def stop(self) -> None:
        self._stop.set()
        self.thread.join()
        self.inbox.close(linger=0)
        self.outbox.close(linger=0)
        self.ctx.term()


def _delta(rid: str, finish: str | None, prompt_len: int, done: int) -> StreamDelta:
    usage = Usage(prompt_len, done, 0) if finish else None
    aborted = finish == "abort"
    return StreamDelta(rid, 0, "" if aborted else "a", [] if aborted else [64],
                       finish_reason=finish, usage=usage)


def _layout(args: dict) -> str:
    return f"tp{args['tp_size']}×pp{args['pp_size']}"


def _info() -> dict:
    pool = {"total": 100, "free": 100, "protected": 0, "private": 0, "evictable": 0}
    return {"pool": pool | {"balanced": True}, "running": 0, "waiting": 0, "hicache": None}


@asynccontextmanager
async def fake_server(tmp_path, cfg: ServerConfig | None = None, step_s: float = 0.01,
                      seam_s: float = 0.0):
    """(ServerContext, FastAPI app, FakeEngine) with the engine Ready."""
    req, out = f"ipc://{tmp_path}/req", f"ipc://{tmp_path}/out"
    client = EngineClient(req, out, None)
    client.start()
    engine = FakeEngine(req, out, step_s, seam_s=seam_s)
    engine.start()
    ctx = ServerContext(cfg or ServerConfig(), client, tokenizer(), "tiny")
    try:
        await client.wait_ready(timeout_s=10)
        yield ctx, build_app(ctx), engine
    finally:
        engine.stop()
        await client.close()


async def until(predicate, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)
