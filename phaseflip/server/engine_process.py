"""The engine process: owns the model and the scheduler, speaks ZeroMQ to the front end.

The loop never waits on a client: it drains whatever messages arrived, runs one step when there
is work, pushes the step's deltas, and only blocks (with a timeout, to notice SIGTERM) when
there is nothing to do — so an idle engine uses no CPU.

Health travels to the front end as it changes (`EngineHealth`): a loop that has work but
finishes no step for --watchdog-timeout-s (`StepWatchdog`), or a step that fails (a stalled or
dead rank), is reported before the process exits non-zero, so /health turns 503 at once.
Every phase-flip seam, manual (the "flip" control op) or automatic (the policy, inside a
step), is announced as it starts and ends (`FlipState`): the loop answers nothing meanwhile,
so the front end holds its flip guard and answers status calls itself.
The process runs in a session of its own, and so do the ranks it starts: signals sent to the
server's process group (`timeout`, `kill -- -PGID`, Ctrl-C; systemd with KillMode=mixed)
reach the front end only, which drains the requests in flight and then stops the engine
("shutdown"). SIGTERM
(the front end's fallback, or our own once the front end is gone) stops the loop at its
next turn and closes the engine (ranks, host tiers, the weight image in /dev/shm) the normal
way; during the model load it leaves at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from multiprocessing import connection
from pathlib import Path

import zmq

from phaseflip.config import EngineConfig
from phaseflip.distributed.symm_allreduce import all_reduce_path
from phaseflip.distributed.watchdog import StepWatchdog
from phaseflip.engine.core import EngineCore
from phaseflip.engine.warmup import warm_up
from phaseflip.errors import InvalidRequestError, PhaseflipError
from phaseflip.heap import freeze_for_exit
from phaseflip.model.config import ModelConfig
from phaseflip.model.loader import load_tokenizer
from phaseflip.scheduler.kv_cache import PoolAccounting
from phaseflip.server import messages as m
from phaseflip.server.engine_start import IPC_DIR_PREFIX
from phaseflip.threads import apply_cpu_threads

log = logging.getLogger("phaseflip.engine")
IDLE_POLL_MS = 1000
# A step this long stalls every running stream by as much: logged with what it held. With
# PHASEFLIP_SLOW_STEP_TRACE_S=<seconds>, a step running past that also dumps every thread's
# Python stack (faulthandler), so a stall with no other log line names its own cause.
SLOW_STEP_S = 1.0
TRACE_ENV = "PHASEFLIP_SLOW_STEP_TRACE_S"
EXIT_FAILED, EXIT_STALLED = 1, 3  # the engine process's exit codes besides 0


class EngineServer:
    def __init__(self, cfg: EngineConfig, requests_addr: str, outputs_addr: str) -> None:
        self.cfg = cfg
        self.outputs_addr = outputs_addr
        self.stopping = False  # set by SIGTERM; the loop ends at its next turn
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.connect(requests_addr)
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.connect(outputs_addr)
        model_cfg = ModelConfig.from_dir(cfg.model)
        self.core = EngineCore(cfg, model_cfg, load_tokenizer(cfg.model))
        # (the loop's thread: manual and automatic flips both run in it)
        self.core.seam_listener = lambda target: self.send(m.FlipState(target))
        # a grammar that failed to compile: the request's abort deltas follow
        self.core.request_failed = lambda rid, e: self._request_failed(rid, e, ends_later=True)
        self.watchdog = StepWatchdog(cfg.watchdog_timeout_s, self._on_stall)
        self.trace_after_s = float(os.environ.get(TRACE_ENV) or 0) or None
        # wall seconds inside steps and flips since launch: a workload's
        # tokens over it are its throughput per busy second, whatever the arrival rate
        self.busy_s = 0.0
        if not cfg.skip_warmup:  # the first client should not pay for the kernels' compile
            self._warm_up()
        self.send(self._ready())

    def _warm_up(self) -> None:
        """`warm_up`, watched as a step is (a wedged rank is a named stall, not a launch that
        never ends); a failure closes the engine and names the warm-up."""
        self.watchdog.beat(True)
        try:
            warm_up(self.core)
        except Exception:
            log.error("launch warm-up failed (--skip-warmup serves without it)")
            self.watchdog.close()
            self.core.close()
            raise
        finally:
            self.watchdog.beat(False)

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
        while not self.stopping:
            busy = self.core.has_work()
            self.watchdog.beat(busy)
            if busy or self.inbox.poll(IDLE_POLL_MS):
                if not self._drain():
                    return
            else:
                self.core.check_alive()
            if self.core.has_work():
                self._timed_step()
                if self.core.cfg is not self.cfg:  # the flip policy re-laid the ranks out
                    self.cfg = self.core.cfg
                    self.send(self._ready())
            elif self.cfg.check_accounting:
                self.core.kv.check(self.core.scheduler.running)

    def _timed_step(self) -> None:
        """One engine step; a slow one is logged with its prompt tokens and decode rows."""
        sched = self.core.scheduler
        stats, t0 = sched.stats, time.perf_counter()
        prompt0, decode0 = stats.prefill_tokens, stats.decode_tokens
        if self.trace_after_s:
            faulthandler.dump_traceback_later(self.trace_after_s, file=sys.stderr)
        try:
            self._send_deltas(self.core.step(sink=self._send_deltas))
        finally:
            if self.trace_after_s:
                faulthandler.cancel_dump_traceback_later()
        seconds = time.perf_counter() - t0
        self.busy_s += seconds
        if seconds >= SLOW_STEP_S:
            log.warning("slow step: %.2f s, %d prompt tokens, %d decode rows; %d running, "
                        "%d waiting (%s=<s> dumps the stack of a step that long)", seconds,
                        stats.prefill_tokens - prompt0, stats.decode_tokens - decode0,
                        len(sched.running), len(sched.waiting), TRACE_ENV)

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
                    self._request_failed(msg.rid, e)
            elif isinstance(msg, m.AbortRequest):
                self._send_deltas(self.core.abort(msg.rid))  # (with the counts: not 0/0)
            elif isinstance(msg, m.Control):
                if msg.op == "shutdown":
                    self.send(m.ControlReply(msg.call_id, True))
                    return False
                self.send(self._control(msg))

    def _request_failed(self, rid: str, e: PhaseflipError, ends_later: bool = False) -> None:
        """The client's 4xx: sent before any delta of the request."""
        self.send(m.RequestFailed(rid, "invalid_request_error", str(e),
                                  getattr(e, "param", None), ends_later))

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
            self.watchdog.beat(True)  # a seam is work, with or without requests
            t0 = time.perf_counter()
            try:
                census, _ = self.core.flip(msg.args["tp_size"], msg.args["pp_size"],
                                           sink=self._send_deltas)
            except InvalidRequestError as e:
                if self.core.dead:  # failed after the seam began: the engine is gone
                    raise
                return m.ControlReply(msg.call_id, False, message=str(e), param=e.param)
            finally:  # a manual flip's drain and seam are busy time, as an auto flip's are
                self.busy_s += time.perf_counter() - t0
            self.cfg = self.core.cfg
            self.send(self._ready())  # before the reply: the caller sees the new limits
            return m.ControlReply(msg.call_id, True, census.as_dict())
        if msg.op == "info":
            acc = pool_accounting(self.core)
            ledger = self.core.flip_ledger  # the last flips' censuses, refill and warm-up
            flips = (ledger.snapshot() if ledger is not None
                     else {"last_flip": None, "flip_censuses": []})
            return m.ControlReply(msg.call_id, True, flips | {
                "pool": dataclasses.asdict(acc) | {"balanced": acc.balanced},
                "scheduler": dataclasses.asdict(sched.stats),
                "running": len(sched.running), "waiting": len(sched.waiting),
                "busy_s": self.busy_s,
                "config": self.cfg.flat_dict(),
                "numerics": self.core.runner.numerics,
                "all_reduce": all_reduce_path(self.core.runner),
                "hicache": (dataclasses.asdict(self.core.hicache.stats)
                            if self.core.hicache else None),
                "flip_policy": (self.core.flip_policy.snapshot()
                                if self.core.flip_policy else None),
            })
        return m.ControlReply(msg.call_id, False, message=f"unknown control op {msg.op!r}")


    def report_unhealthy(self, reason: str) -> None:
        """Tells the front end the engine cannot serve, from any thread (its own socket: the
        loop's may be in use, and a ZeroMQ socket belongs to one thread)."""
        send_unhealthy(self.ctx, self.outputs_addr, reason)

    def _on_stall(self, waited_s: float) -> None:
        """The watchdog thread's report of a loop that stopped making progress: every rank's
        position and stack to the log, 503 to the front end, then exit (the ranks follow: they
        watch their parent). The wedged loop cannot close anything, so the node's shared
        files are unlinked here."""
        sched = self.core.scheduler
        reason = (f"no engine step finished in {waited_s:.0f} s while {len(sched.running)} "
                  f"requests ran and {len(sched.waiting)} waited (--watchdog-timeout-s "
                  f"{self.cfg.watchdog_timeout_s:g})")
        positions = self.core.rank_positions()
        log.error("watchdog: %s; stopping the engine\n  %s", reason,
                  "\n  ".join(positions) or "(one process: no ranks)")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        self.report_unhealthy(reason)
        time.sleep(1.0)  # the ranks' stack dumps (SIGUSR1) reach the log before we go
        for path in self.core.node_files():
            path.unlink(missing_ok=True)
        logging.shutdown()
        os._exit(EXIT_STALLED)


def pool_accounting(core: EngineCore) -> PoolAccounting:
    """The pool's accounting between steps, counting the slots of HiCache loads in flight
    (without them /server_info reported 'balanced: false' whenever loads were in flight)."""
    withheld = core.hicache.in_flight_slots if core.hicache is not None else 0
    return core.kv.accounting(core.scheduler.running, withheld)


def send_unhealthy(ctx: zmq.Context, outputs_addr: str, reason: str) -> None:
    """One EngineHealth(False) to the front end on a socket of its own (ZeroMQ sockets belong
    to one thread; the loop's may be in use)."""
    sock = ctx.socket(zmq.PUSH)
    try:
        sock.connect(outputs_addr)
        sock.send(m.encode(m.EngineHealth(False, reason)))
    finally:
        sock.close(linger=2000)


def engine_main(cfg: EngineConfig, requests_addr: str, outputs_addr: str) -> None:
    """Entry point of the engine process (spawned by the launcher, SIGINT blocked)."""
    _leave_the_launchers_session()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher stops us with a message/SIGTERM
    # SIGTERM while loading: leave at once (finalizers unlink what was made); while serving:
    # end the loop at its next turn and close normally
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # (a pending one: ignored)
    _stop_when_the_launcher_dies(_launch_ipc_dir(requests_addr))
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    apply_cpu_threads(cfg)
    server = None
    try:
        server = EngineServer(cfg, requests_addr, outputs_addr)
        signal.signal(signal.SIGTERM, lambda *_: setattr(server, "stopping", True))
        server.run()
        server.watchdog.close()
        server.core.close()
        freeze_for_exit()  # the process ends here: its exit walks no heap
    except Exception as e:
        # before the log and the teardown: /health turns 503 now, and a launch that failed
        # (no server yet) names its cause in the front end's last line
        reason = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
        if server is not None:
            server.report_unhealthy(reason)
        else:
            with contextlib.suppress(Exception):  # the traceback below matters more
                ctx = zmq.Context()
                send_unhealthy(ctx, outputs_addr, reason)
                ctx.term()
        log.error("engine process failed:\n%s", traceback.format_exc())
        raise SystemExit(EXIT_FAILED) from None


def _leave_the_launchers_session() -> None:
    """A session (so a process group) of our own, inherited by the ranks we start: a SIGTERM
    to the server's group no longer stops the engine at once, failing the requests the front
    end is draining (and leaving that front end to wait on an engine already gone)."""
    with contextlib.suppress(OSError):  # already a group leader: not started by the launcher
        os.setsid()


def _launch_ipc_dir(addr: str) -> Path | None:
    """The launcher's temporary IPC directory holding `addr`'s socket (None for any other
    address: only a directory the launcher made is ever removed)."""
    if not addr.startswith("ipc://"):
        return None
    folder = Path(addr.removeprefix("ipc://")).parent
    return folder if folder.name.startswith(IPC_DIR_PREFIX) else None


def _stop_when_the_launcher_dies(ipc_dir: Path | None) -> None:
    """SIGTERMs this process once the front end is gone (SIGKILL, the OOM killer), from the
    start, the model load included: out of its process group, nothing else would stop us.
    multiprocessing's parent sentinel (a pipe the front end holds open), not a pid read
    after the slow imports, by which time the front end may already be gone. The front
    end's IPC directory goes too: a killed front end never ran its own clean-up."""
    parent = mp.parent_process()
    if parent is None:  # not started by multiprocessing: nobody to watch
        return

    def watch() -> None:
        connection.wait([parent.sentinel])  # readable: its end closed with the process
        log.warning("front end process is gone; engine exits")
        if ipc_dir is not None:
            shutil.rmtree(ipc_dir, ignore_errors=True)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="phaseflip-front-end-watch", daemon=True).start()
