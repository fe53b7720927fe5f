"""`phaseflip serve`: check the flags and the model, bind the port, start the engine process,
then the HTTP front end, and stop both together.

What a flag or the model gets wrong is found before the engine process, spawned first and
held at its gate (`engine_start`), may start (`preflight`, `bind`): a one-line error and exit
code 2, not a traceback seconds into the model load. The engine is let go with SIGTERM/SIGINT
handled here already and runs in a session of its own (`engine_main`), so a signal to the
server's process group reaches only this process: the port answers 503 on /health until the
engine reports Ready, SIGTERM/SIGINT drain (`Drain`), then stop uvicorn; on the way out the
engine is told to shut down and, failing that, terminated — no orphans, and the IPC
directory goes too. The exit code says how it ended (`EXIT_*`), and so does the log's last
line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import signal
import socket
from dataclasses import dataclass
from multiprocessing import resource_tracker
from pathlib import Path

import uvicorn

from phaseflip.config import EngineConfig
from phaseflip.distributed.group import check_layouts
from phaseflip.engine.context_limit import context_limit
from phaseflip.errors import InvalidRequestError
from phaseflip.model.config import ModelConfig
from phaseflip.model.loader import load_tokenizer, tokenizer_dir
from phaseflip.model.quant import engine_quantization
from phaseflip.server.app import build_app
from phaseflip.server.context import ServerConfig, ServerContext
from phaseflip.server.engine_client import EngineClient
from phaseflip.server.engine_start import EngineStart
from phaseflip.threads import plan_for

log = logging.getLogger("phaseflip.server")


EXIT_OK = 0
"""Stopped by SIGTERM/SIGINT after every request in flight finished."""
EXIT_ENGINE_FAILED = 1
"""The engine failed to start, or died (or stopped itself as unhealthy) while serving."""
EXIT_USAGE = 2
"""A flag, the model or the listening address is unusable: found before the engine starts
(`cli.main` prints the one-line error of the `PhaseflipError` raised)."""
EXIT_DRAIN_TIMEOUT = 3
"""Stopped by a signal, but requests still running after --shutdown-timeout were ended (or
by a second signal)."""
STOP_WAIT_S = 5.0
"""How long stopping the engine waits on each step: the "shutdown" call's answer, then the
process's exit after it, after SIGTERM, after SIGKILL."""


@dataclass
class Outcome:
    code: int = EXIT_OK
    reason: str = "stopped"


def serve(engine_cfg: EngineConfig, server_cfg: ServerConfig,
          start: EngineStart | None = None) -> int:
    """Serves until stopped; `start`: the engine process the command spawned before its own
    imports (`engine_start`), closed here whatever happens (else one is spawned here)."""
    logging.basicConfig(level=engine_cfg.log_level.upper(),
                        format="%(asctime)s %(name)s %(message)s")
    if server_cfg.log_requests:  # asked for: shown whatever --log-level says
        logging.getLogger("phaseflip.requests").setLevel(logging.INFO)
    try:
        if start is None:
            start = EngineStart(engine_cfg)
        outcome = asyncio.run(_serve(engine_cfg, server_cfg, start))
    finally:
        if start is not None:
            start.close()
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

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and sockets:  # uvicorn says it only of the sockets it binds itself
            logging.getLogger("uvicorn.error").info(
                "Uvicorn running on %s (Press CTRL+C to quit)",
                _origin(self.config.host, sockets[0].getsockname()[1]))


class Drain:
    """On a signal: refuse new work (503), wait up to --shutdown-timeout for the requests in
    flight, end the rest (an error event and [DONE] on streams, a 503 otherwise), then let
    uvicorn close the connections."""

    def __init__(self, ctx: ServerContext | None, outcome: Outcome) -> None:
        self.ctx, self.outcome = ctx, outcome  # ctx None: the front end is still being made
        self.server: uvicorn.Server | None = None
        self.hurry = asyncio.Event()
        self.early = asyncio.Event()  # a signal came before the front end was made
        self.cut_by: str | None = None  # the second signal, which ends the drain early
        self.loop = asyncio.get_running_loop()
        self.task: asyncio.Task | None = None

    def on_signal(self, sig: int) -> None:  # a signal handler: hand over to the loop
        self.loop.call_soon_threadsafe(self._begin, signal.Signals(sig).name)

    def _begin(self, name: str) -> None:
        if self.task is not None or self.early.is_set():
            log.warning("%s again: ending the requests in flight now", name)
            self.cut_by = self.cut_by or name
            self.hurry.set()
            return
        self.outcome.reason = f"stopped by {name}"
        if self.ctx is None:  # nothing to drain: the start is given up
            self.early.set()
            return
        self.task = asyncio.create_task(self._drain(name))

    async def _drain(self, name: str) -> None:
        ctx, timeout_s = self.ctx, self.ctx.cfg.shutdown_timeout
        ctx.shutting_down = f"the server is shutting down ({name}); retry on another server"
        engine = ctx.engine
        log.info("%s: refusing new requests; draining %d in flight for up to %.0f s",
                 name, len(engine.state.in_flight), timeout_s)
        end = self.loop.time() + timeout_s
        # a flip in its seam is work in flight too (also one whose caller got its 504): the
        # engine answers no "shutdown" until the seam ends, and one stopped mid-seam is killed
        while ((engine.state.in_flight or ctx.flip_in_progress) and self.loop.time() < end
               and not self.hurry.is_set()):
            await asyncio.wait([asyncio.ensure_future(self.hurry.wait())], timeout=0.1)
        if (target := ctx.flip_in_progress) is not None:
            log.warning("drain: the flip to %s is still in its seam; the engine is stopped "
                        "in it", target)
        if engine.state.in_flight:
            why, self.outcome.reason = self._why_ended(name, timeout_s,
                                                       len(engine.state.in_flight))
            rids = await engine.end_all(
                f"the server is shutting down ({name}) and this request {why}")
            self.outcome.code = EXIT_DRAIN_TIMEOUT
            log.warning("drain: ended %d requests", len(rids))
            for _ in range(50):  # let their last events reach the clients
                if not engine.state.in_flight:
                    break
                await asyncio.sleep(0.02)
        self.server.should_exit = True

    def _why_ended(self, name: str, timeout_s: float, n: int) -> tuple[str, str]:
        """Why the `n` requests still in flight are ended, as their error and the exit line
        say it: the drain ran out, or a second signal cut it short."""
        if self.cut_by is None:
            return (f"did not finish within --shutdown-timeout {timeout_s:g} s",
                    f"stopped by {name}; {n} requests still running after the {timeout_s:g} s "
                    "drain were ended")
        return (f"was ended by a second signal ({self.cut_by}) before --shutdown-timeout "
                f"{timeout_s:g} s ran out",
                f"stopped by {name}; a second signal ({self.cut_by}) cut the {timeout_s:g} s "
                f"drain short, ending {n} requests still running")


async def _serve(engine_cfg: EngineConfig, server_cfg: ServerConfig,
                 start: EngineStart) -> Outcome:
    preflight(engine_cfg)
    with bind(server_cfg) as sock:  # (uvicorn closes it too; closed here if we fail first)
        tokenizer_dir(engine_cfg.model)  # a missing model or tokenizer: before the engine
        return await _run(engine_cfg, server_cfg, sock, start)


async def _run(engine_cfg: EngineConfig, server_cfg: ServerConfig, sock: socket.socket,
               start: EngineStart) -> Outcome:
    """Serves until a signal or the engine's end. The engine process, spawned before the
    front end's imports and waiting at its gate, gets its go here and loads while the front
    end loads its tokenizer. Signals drain from before the go (one before the front end is
    made ends the start), and whatever happens after it, the engine is stopped on the way
    out."""
    proc = start.proc
    client = EngineClient(start.requests_addr, start.outputs_addr, proc)  # binds first
    outcome = Outcome()
    drain = Drain(None, outcome)
    _signals_drain(drain)
    tasks: list[asyncio.Task] = []
    ctx: ServerContext | None = None
    try:
        if start.signalled is not None:  # (while this process imported: no go)
            drain._begin(start.signalled)
            return outcome
        start.go()
        client.start()
        tokenizer = await _tokenizer_unless_stopped(engine_cfg.model, drain)
        if tokenizer is None:
            return outcome
        name = server_cfg.served_model_name or Path(engine_cfg.model).name
        ctx = ServerContext(server_cfg, client, tokenizer, name)
        server = _Server(uvicorn.Config(build_app(ctx), host=server_cfg.host,
                                        port=server_cfg.port, log_level=engine_cfg.log_level,
                                        access_log=False, timeout_graceful_shutdown=5),
                         drain.on_signal)
        drain.ctx, drain.server = ctx, server
        url = _origin(server_cfg.host, sock.getsockname()[1]) + "/v1"  # (--port 0: the real one)
        tasks = [asyncio.create_task(_announce(client, server, outcome, engine_cfg, url, name)),
                 asyncio.create_task(_stop_if_engine_dies(client, proc, server, outcome))]
        with ctx.metrics.collector_watched():  # (the heap frozen: short full passes)
            await server.serve(sockets=[sock])
    finally:
        for t in tasks:
            t.cancel()
        await _stop_engine(client, proc)
        if ctx is not None:
            ctx.pool.shutdown(wait=False, cancel_futures=True)
        if client.state.ready is None and outcome.code == EXIT_OK:
            outcome.code, outcome.reason = EXIT_ENGINE_FAILED, (
                f"stopped before the engine was ready ({outcome.reason})")
    return outcome


async def _tokenizer_unless_stopped(model: str, drain: Drain) -> object | None:
    """The front end's tokenizer, loaded in a thread so that a signal meanwhile is heard:
    None if one came first (the load goes on to its end in its thread, unused)."""
    load = asyncio.ensure_future(asyncio.to_thread(load_tokenizer, model))
    stopped = asyncio.ensure_future(drain.early.wait())
    await asyncio.wait([load, stopped], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if drain.early.is_set():
        load.add_done_callback(lambda f: f.cancelled() or f.exception())  # (no "never retrieved")
        return None
    return load.result()


def preflight(cfg: EngineConfig) -> None:
    """What the engine process would find wrong only seconds into its start (with a
    traceback, exit code 1), found before it starts: a typed one-line error (exit code 2)."""
    model_cfg = ModelConfig.from_dir(cfg.model)  # no or a bad config.json: ModelLoadError
    check_layouts(cfg, model_cfg)  # -tp 3 of 4 heads, -pp 8 of 4 layers, --flip-layouts
    engine_quantization(cfg, model_cfg.model_dir)  # --fp8-lm-head without FP8 weights
    context_limit(cfg, model_cfg)  # --max-model-len past the model's trained positions
    if cfg.enable_hicache:
        _check_hicache(cfg)


def _check_hicache(cfg: EngineConfig) -> None:
    """--hicache-dir must be (or be creatable as) a directory; --hicache-host-gb must fit the
    host's memory (the tier is allocated at start: the allocator's own error said neither)."""
    if cfg.hicache_dir is not None:
        wanted = Path(cfg.hicache_dir).absolute()
        existing = next(p for p in (wanted, *wanted.parents) if p.exists())
        if not existing.is_dir():
            raise InvalidRequestError(
                f"--hicache-dir {cfg.hicache_dir}: {existing} is a file, not a directory; "
                "give a directory for the disk tier (it is created if missing)", "hicache_dir")
        try:
            wanted.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidRequestError(
                f"--hicache-dir {cfg.hicache_dir}: cannot create it ({exc.strerror}); give a "
                "directory this user can create and write", "hicache_dir") from exc
    available = _available_memory_bytes()
    if available is not None and cfg.hicache_host_gb * 2**30 > available:
        raise InvalidRequestError(
            f"--hicache-host-gb {cfg.hicache_host_gb:g} is more than this host's "
            f"{available / 2**30:.1f} GiB of available memory; give a smaller host tier",
            "hicache_host_gb")


def _available_memory_bytes() -> int | None:
    """The host memory a new allocation can take: MemAvailable on Linux, else the physical
    memory (a looser bound), None where neither is known."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return None


def bind(cfg: ServerConfig) -> socket.socket:
    """The listening socket, bound before the engine starts (uvicorn serves on it): a port in
    use or an address not of this host is a one-line error naming the flag before any model
    loads, not uvicorn's exit code 3 (our drain timeout's) after it loaded."""
    sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET,
                         socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's own bind
        sock.bind((cfg.host, cfg.port))
    except OSError as e:
        sock.close()
        raise InvalidRequestError(f"cannot listen on --host {cfg.host} --port {cfg.port}: "
                                  f"{e.strerror or e}", "port") from None
    return sock


def _origin(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _signals_drain(drain: Drain) -> None:
    """uvicorn takes SIGTERM/SIGINT while serving and puts back the handlers it found: these,
    so a signal before (from before the engine starts) or after (while the engine stops) is
    a drain request too, never death with the engine left behind."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda sig, _: drain.on_signal(sig))


async def _announce(client: EngineClient, server: uvicorn.Server, outcome: Outcome,
                    engine_cfg: EngineConfig, url: str, name: str) -> None:
    """Logs the ready line once the engine is up, or stops the server if it failed to start."""
    try:
        ready = await client.wait_ready()
    except Exception as e:  # the engine died while loading
        log.error("engine failed to start: %s", e)
        outcome.code, outcome.reason = EXIT_ENGINE_FAILED, f"engine failed to start: {e}"
        server.should_exit = True
        return
    log.info("phaseflip ready: %s (model %s, %s %s, KV %d tokens; %s)", url, name,
             ready.device, ready.dtype, ready.kv_capacity_tokens, plan_for(engine_cfg).describe())


async def _stop_if_engine_dies(client: EngineClient, proc: mp.Process, server: uvicorn.Server,
                               outcome: Outcome) -> None:
    """Stops the server once the client has seen the engine exit: the client reads the
    engine's last messages (why it failed) first, so the exit line can name the reason
    whichever of this and `_announce` hears of a failed start first."""
    while client.state.dead is None:
        await asyncio.sleep(0.5)
    if server.should_exit:  # it stopped because we asked it to
        return
    cause = _exit_cause(proc.exitcode, client.state.unhealthy)
    log.error("engine process exited (%s); shutting down", cause)
    outcome.code, outcome.reason = EXIT_ENGINE_FAILED, (
        f"the engine died: {cause}" if client.state.ready is not None
        else f"engine failed to start: {client.state.unhealthy or cause}")
    server.should_exit = True


def _exit_cause(code: int | None, unhealthy: str | None) -> str:
    what = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
            and -code in signal.valid_signals() else f"exit code {code}")
    return what + (f", after reporting: {unhealthy}" if unhealthy else "")


async def _stop_engine(client: EngineClient, proc: mp.Process) -> None:
    """Stops the engine process, each step bounded: "shutdown" to an engine that serves (it
    answers, then closes its ranks and host tiers), SIGTERM to one still loading (it leaves at
    once) or that did not stop, SIGKILL last. No call to an engine known dead: with no reader,
    a send on the request socket would wait for ever."""
    if proc.is_alive() and client.state.ready is not None and client.state.dead is None:
        with contextlib.suppress(Exception):  # gone or wedged meanwhile: SIGTERM below
            await client.control("shutdown", timeout_s=STOP_WAIT_S)
        proc.join(timeout=STOP_WAIT_S)
    for stop in (proc.terminate, proc.kill):
        if proc.is_alive():
            stop()
            proc.join(timeout=STOP_WAIT_S)
    await client.close()
