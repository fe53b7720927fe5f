"""`phaseflip serve`: start the engine process, then the HTTP front end, and stop both together.

The engine process is spawned first and the HTTP port opens at once, answering 503 on
/health until the engine reports Ready. SIGTERM/SIGINT drain (`Drain`), then stop uvicorn; on
the way out the engine is told to shut down and, failing that, terminated — no orphans. The
exit code says how it ended (`EXIT_*`), and so does the log's last line.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import signal
import tempfile
from dataclasses import dataclass
from multiprocessing import resource_tracker
from pathlib import Path

import uvicorn

from phaseflip.config import EngineConfig
from phaseflip.model.loader import load_tokenizer
from phaseflip.server.app import build_app
from phaseflip.server.context import ServerConfig, ServerContext
from phaseflip.server.engine_client import EngineClient
from phaseflip.server.engine_process import engine_main
from phaseflip.threads import plan_for

log = logging.getLogger("phaseflip.server")


EXIT_OK = 0
"""Stopped by SIGTERM/SIGINT after every request in flight finished."""
EXIT_ENGINE_FAILED = 1
"""The engine failed to start, or died (or stopped itself as unhealthy) while serving."""
EXIT_DRAIN_TIMEOUT = 3
"""Stopped by a signal, but requests still running after --shutdown-timeout were ended."""


@dataclass
class Outcome:
    code: int = EXIT_OK
    reason: str = "stopped"


def serve(engine_cfg: EngineConfig, server_cfg: ServerConfig) -> int:
    logging.basicConfig(level=engine_cfg.log_level.upper(),
                        format="%(asctime)s %(name)s %(message)s")
    if server_cfg.log_requests:  # asked for: shown whatever --log-level says
        logging.getLogger("phaseflip.requests").setLevel(logging.INFO)
    outcome = asyncio.run(_serve(engine_cfg, server_cfg))
    # the last line of the log says how the server ended (see docs/troubleshooting.md): let
    # multiprocessing's resource tracker finish first (it warns about what a killed engine
    # left, and would otherwise print after us)
    stop_tracker = getattr(resource_tracker._resource_tracker, "_stop", None)
    if stop_tracker is not None:
        stop_tracker()
    (log.info if outcome.code == EXIT_OK else log.error)(
        "phaseflip exits with code %d: %s", outcome.code, outcome.reason)
    return outcome.code


class _Server(uvicorn.Server):
    """uvicorn, except that SIGTERM/SIGINT start a drain (see `Drain`) instead of stopping
    at once; a second signal ends the drain early."""

    def __init__(self, config: uvicorn.Config, on_signal) -> None:
        super().__init__(config)
        self.on_signal = on_signal

    def handle_exit(self, sig: int, frame) -> None:
        self.on_signal(sig)


class Drain:
    """On a signal: refuse new work (503), wait up to --shutdown-timeout for the requests in
    flight, end the rest (an error event and [DONE] on streams, a 503 otherwise), then let
    uvicorn close the connections."""

    def __init__(self, ctx: ServerContext, outcome: Outcome) -> None:
        self.ctx, self.outcome = ctx, outcome
        self.server: uvicorn.Server | None = None
        self.hurry = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        self.task: asyncio.Task | None = None

    def on_signal(self, sig: int) -> None:  # a signal handler: hand over to the loop
        self.loop.call_soon_threadsafe(self._begin, signal.Signals(sig).name)

    def _begin(self, name: str) -> None:
        if self.task is not None:
            log.warning("%s again: ending the requests in flight now", name)
            self.hurry.set()
            return
        self.outcome.reason = f"stopped by {name}"
        self.task = asyncio.create_task(self._drain(name))

    async def _drain(self, name: str) -> None:
        ctx, timeout_s = self.ctx, self.ctx.cfg.shutdown_timeout
        ctx.shutting_down = f"the server is shutting down ({name}); retry on another server"
        engine = ctx.engine
        log.info("%s: refusing new requests; draining %d in flight for up to %.0f s",
                 name, len(engine.state.in_flight), timeout_s)
        end = self.loop.time() + timeout_s
        while engine.state.in_flight and self.loop.time() < end and not self.hurry.is_set():
            await asyncio.wait([asyncio.ensure_future(self.hurry.wait())], timeout=0.1)
        if engine.state.in_flight:
            rids = await engine.end_all(
                f"the server is shutting down ({name}) and this request did not finish "
                f"within --shutdown-timeout {timeout_s:g} s")
            self.outcome.code = EXIT_DRAIN_TIMEOUT
            self.outcome.reason = (f"stopped by {name}; {len(rids)} requests still running "
                                   f"after the {timeout_s:g} s drain were ended")
            log.warning("drain: ended %d requests", len(rids))
            for _ in range(50):  # let their last events reach the clients
                if not engine.state.in_flight:
                    break
                await asyncio.sleep(0.02)
        self.server.should_exit = True


async def _serve(engine_cfg: EngineConfig, server_cfg: ServerConfig) -> Outcome:
    ipc_dir, client, proc = _start_engine(engine_cfg)
    name = server_cfg.served_model_name or Path(engine_cfg.model).name
    ctx = ServerContext(server_cfg, client, load_tokenizer(engine_cfg.model), name)
    app = build_app(ctx)
    outcome = Outcome()
    drain = Drain(ctx, outcome)
    server = _Server(uvicorn.Config(app, host=server_cfg.host, port=server_cfg.port,
                                    log_level=engine_cfg.log_level, access_log=False,
                                    timeout_graceful_shutdown=5),
                     drain.on_signal)
    drain.server = server
    _signals_drain(drain)
    tasks = [asyncio.create_task(_announce(client, server, outcome, engine_cfg, server_cfg,
                                           name)),
             asyncio.create_task(_stop_if_engine_dies(client, proc, server, outcome))]
    try:
        await server.serve()
    finally:
        for t in tasks:
            t.cancel()
        await _stop_engine(client, proc)
        for f in ("requests", "outputs"):
            Path(ipc_dir, f).unlink(missing_ok=True)
        ctx.pool.shutdown(wait=False, cancel_futures=True)
        os.rmdir(ipc_dir)
    if client.state.ready is None and outcome.code == EXIT_OK:
        outcome.code, outcome.reason = EXIT_ENGINE_FAILED, (
            f"stopped before the engine was ready ({outcome.reason})")
    return outcome


def _start_engine(engine_cfg: EngineConfig) -> tuple[str, EngineClient, mp.Process]:
    """Spawns the engine process and starts its client; returns (IPC dir, client, process)."""
    ipc_dir = tempfile.mkdtemp(prefix="phaseflip-")
    req_addr, out_addr = f"ipc://{ipc_dir}/requests", f"ipc://{ipc_dir}/outputs"
    spawn = mp.get_context("spawn")
    proc = spawn.Process(target=engine_main, args=(engine_cfg, req_addr, out_addr),
                         name="phaseflip-engine", daemon=False)  # it spawns ranks
    client = EngineClient(req_addr, out_addr, proc)  # binds before the engine connects
    proc.start()
    client.start()
    return ipc_dir, client, proc


def _signals_drain(drain: Drain) -> None:
    """uvicorn takes SIGTERM/SIGINT while serving and puts back the handlers it found: these,
    so a signal before or after (while the engine stops) is a drain request too, never death."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda sig, _: drain.on_signal(sig))


async def _announce(client: EngineClient, server: uvicorn.Server, outcome: Outcome,
                    engine_cfg: EngineConfig, server_cfg: ServerConfig, name: str) -> None:
    """Logs the ready line once the engine is up, or stops the server if it failed to start."""
    try:
        ready = await client.wait_ready()
    except Exception as e:  # the engine died while loading
        log.error("engine failed to start: %s", e)
        outcome.code, outcome.reason = EXIT_ENGINE_FAILED, f"engine failed to start: {e}"
        server.should_exit = True
        return
    log.info("phaseflip ready: http://%s:%d/v1 (model %s, %s %s, KV %d tokens; %s)",
             server_cfg.host, server_cfg.port, name, ready.device, ready.dtype,
             ready.kv_capacity_tokens, plan_for(engine_cfg).describe())


async def _stop_if_engine_dies(client: EngineClient, proc: mp.Process, server: uvicorn.Server,
                               outcome: Outcome) -> None:
    while proc.is_alive():
        await asyncio.sleep(0.5)
    if server.should_exit:  # it stopped because we asked it to
        return
    cause = _exit_cause(proc.exitcode, client.state.unhealthy)
    log.error("engine process exited (%s); shutting down", cause)
    if client.state.ready is not None:
        outcome.code, outcome.reason = EXIT_ENGINE_FAILED, f"the engine died: {cause}"
    server.should_exit = True


def _exit_cause(code: int | None, unhealthy: str | None) -> str:
    what = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
            and -code in signal.valid_signals() else f"exit code {code}")
    return what + (f", after reporting: {unhealthy}" if unhealthy else "")


async def _stop_engine(client: EngineClient, proc: mp.Process) -> None:
    if proc.is_alive():
        try:
            await client.control("shutdown", timeout_s=5)
        except Exception:  # noqa: BLE001 — already dead or stuck; terminate below
            pass
        proc.join(timeout=5)
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout=5)
    if proc.is_alive():
        proc.kill()
    await client.close()
