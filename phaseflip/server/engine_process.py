"""The engine process: owns the model and the scheduler, speaks ZeroMQ to the front end.

The loop never waits on a client: it drains whatever messages arrived, runs one step when there
is work, pushes the step's deltas, and only blocks (with a timeout, to notice a dead parent)
when there is nothing to do — so an idle engine uses no CPU.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import traceback

import zmq

from phaseflip.config import EngineConfig
from phaseflip.engine.core import EngineCore
from phaseflip.errors import InvalidRequestError, PhaseflipError
from phaseflip.model.config import ModelConfig
from phaseflip.model.loader import load_tokenizer
from phaseflip.server import messages as m
from phaseflip.threads import apply_cpu_threads

log = logging.getLogger("phaseflip.engine")
IDLE_POLL_MS = 1000


class EngineServer:
    def __init__(self, cfg: EngineConfig, requests_addr: str, outputs_addr: str) -> None:
        self.cfg = cfg
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.connect(requests_addr)
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.connect(outputs_addr)
        self.parent = os.getppid()
        model_cfg = ModelConfig.from_dir(cfg.model)
        self.core = EngineCore(cfg, model_cfg, load_tokenizer(cfg.model))
        self.send(self._ready())

    def _ready(self) -> m.Ready:
        """What the front end validates requests against; sent again after a flip, whose new
        layout may hold a different number of KV tokens."""
        core, runner = self.core, self.core.runner
        return m.Ready(
            model=self.cfg.model, max_context=core.max_context,
            vocab_size=core.model_cfg.vocab_size, kv_capacity_tokens=core.kv.capacity_tokens,
            device=str(runner.device), dtype=str(runner.dtype).removeprefix("torch."),
            page_size=self.cfg.page_size, max_logprobs=self.cfg.max_logprobs,
        )

    def send(self, msg: m.Message) -> None:
        self.outbox.send(m.encode(msg))

    def run(self) -> None:
        while True:
            busy = self.core.has_work()
            if busy or self.inbox.poll(IDLE_POLL_MS):
                if not self._drain():
                    return
            elif os.getppid() != self.parent:
                log.warning("front end process is gone; engine exits")
                return
            else:
                self.core.check_alive()
            if self.core.has_work():
                self._send_deltas(self.core.step(sink=self._send_deltas))
                if self.core.cfg is not self.cfg:  # the flip policy re-laid the ranks out
                    self.cfg = self.core.cfg
                    self.send(self._ready())
            elif self.cfg.check_accounting:
                self.core.kv.check(self.core.scheduler.running)

    def _send_deltas(self, deltas: list) -> None:
        if deltas:
            sched = self.core.scheduler
            self.send(m.Deltas(deltas, len(sched.running), len(sched.waiting)))

    def _drain(self) -> bool:
        """Handles every queued message; False when told to shut down."""
        while True:
            try:
                msg = m.decode(self.inbox.recv(zmq.NOBLOCK))
            except zmq.Again:
                return True
            if isinstance(msg, m.AddRequest):
                try:
                    self.core.add_request(msg.rid, msg.prompt_ids, msg.params)
                except PhaseflipError as e:
                    self.send(m.RequestFailed(msg.rid, "invalid_request_error", str(e),
                                              getattr(e, "param", None)))
            elif isinstance(msg, m.AbortRequest):
                deltas = self.core.abort(msg.rid)
                if deltas:
                    self.send(m.Deltas(deltas))
            elif isinstance(msg, m.Control):
                if msg.op == "shutdown":
                    self.send(m.ControlReply(msg.call_id, True))
                    return False
                self.send(self._control(msg))

    def _control(self, msg: m.Control) -> m.ControlReply:
        sched, kv = self.core.scheduler, self.core.kv
        if msg.op == "flush_cache":
            if sched.running or sched.waiting:
                return m.ControlReply(msg.call_id, False, message=(
                    f"cannot flush the cache while {len(sched.running)} requests run and "
                    f"{len(sched.waiting)} wait"))
            if self.core.hicache is not None:  # in-flight copies lock tree nodes until done
                self.core.hicache.quiesce()
            freed = kv.tree.evict_all_and_reset()
            return m.ControlReply(msg.call_id, True, {"freed_tokens": freed})
        if msg.op == "flip":
            try:
                census, _ = self.core.flip(msg.args["tp_size"], msg.args["pp_size"],
                                           sink=self._send_deltas)
            except InvalidRequestError as e:
                if self.core.dead:  # failed after the seam began: the engine is gone
                    raise
                return m.ControlReply(msg.call_id, False, message=str(e))
            self.cfg = self.core.cfg
            self.send(self._ready())  # before the reply: the caller sees the new limits
            return m.ControlReply(msg.call_id, True, census.as_dict())
        if msg.op == "info":
            acc = kv.accounting(sched.running)
            ledger = self.core.flip_ledger  # the last flips' censuses, refill and warm-up
            flips = (ledger.snapshot() if ledger is not None
                     else {"last_flip": None, "flip_censuses": []})
            return m.ControlReply(msg.call_id, True, flips | {
                "pool": dataclasses.asdict(acc) | {"balanced": acc.balanced},
                "scheduler": dataclasses.asdict(sched.stats),
                "running": len(sched.running), "waiting": len(sched.waiting),
                "config": dataclasses.asdict(self.cfg),
                "hicache": (dataclasses.asdict(self.core.hicache.stats)
                            if self.core.hicache else None),
                "flip_policy": (self.core.flip_policy.snapshot()
                                if self.core.flip_policy else None),
            })
        return m.ControlReply(msg.call_id, False, message=f"unknown control op {msg.op!r}")


def engine_main(cfg: EngineConfig, requests_addr: str, outputs_addr: str) -> None:
    """Entry point of the engine process (spawned by the launcher)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher stops us with a message/SIGTERM
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    apply_cpu_threads(cfg)
    server = None
    try:
        server = EngineServer(cfg, requests_addr, outputs_addr)
        server.run()
        server.core.close()
    except Exception:
        log.error("engine process failed:\n%s", traceback.format_exc())
        raise SystemExit(1) from None
