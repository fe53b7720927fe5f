"""`phaseflip serve`: start the engine process, then the HTTP front end, and stop both together.

The engine process is spawned first and the HTTP port opens at once, answering 503 on
/health until the engine reports Ready. SIGTERM/SIGINT stop uvicorn; on the way out the
engine is told to shut down and, failing that, terminated — no orphans.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import signal
import tempfile
from pathlib import Path

import uvicorn

from phaseflip.config import EngineConfig
from phaseflip.model.loader import load_tokenizer
from phaseflip.server.app import build_app
from phaseflip.server.context import ServerConfig, ServerContext
from phaseflip.server.engine_client import EngineClient
from phaseflip.server.engine_process import engine_main

log = logging.getLogger("phaseflip.server")


def serve(engine_cfg: EngineConfig, server_cfg: ServerConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return asyncio.run(_serve(engine_cfg, server_cfg))


async def _serve(engine_cfg: EngineConfig, server_cfg: ServerConfig) -> int:
    ipc_dir = tempfile.mkdtemp(prefix="phaseflip-")
    req_addr, out_addr = f"ipc://{ipc_dir}/requests", f"ipc://{ipc_dir}/outputs"
    spawn = mp.get_context("spawn")
    proc = spawn.Process(target=engine_main, args=(engine_cfg, req_addr, out_addr),
                         name="phaseflip-engine", daemon=False)  # it spawns ranks
    client = EngineClient(req_addr, out_addr, proc)  # binds before the engine connects
    proc.start()
    client.start()
    name = server_cfg.served_model_name or Path(engine_cfg.model).name
    ctx = ServerContext(server_cfg, client, load_tokenizer(engine_cfg.model), name)
    app = build_app(ctx)
    server = uvicorn.Server(uvicorn.Config(app, host=server_cfg.host, port=server_cfg.port,
                                           log_level="warning", timeout_graceful_shutdown=5))

    async def announce() -> None:
        try:
            ready = await client.wait_ready()
        except Exception as e:  # the engine died while loading
            log.error("engine failed to start: %s", e)
            server.should_exit = True
            return
        log.info("phaseflip ready: http://%s:%d/v1 (model %s, %s %s, KV %d tokens)",
                 server_cfg.host, server_cfg.port, name, ready.device, ready.dtype,
                 ready.kv_capacity_tokens)

    async def stop_if_engine_dies() -> None:
        while proc.is_alive():
            await asyncio.sleep(0.5)
        log.error("engine process exited (code %s); shutting down", proc.exitcode)
        server.should_exit = True

    # uvicorn handles SIGTERM/SIGINT while serving and re-raises them afterwards under the
    # handlers it found; make those no-ops so the engine shutdown below still runs.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    tasks = [asyncio.create_task(announce()), asyncio.create_task(stop_if_engine_dies())]
    try:
        await server.serve()
    finally:
        for t in tasks:
            t.cancel()
        await _stop_engine(client, proc)
        for f in ("requests", "outputs"):
            Path(ipc_dir, f).unlink(missing_ok=True)
        os.rmdir(ipc_dir)
    return 0 if client.state.ready is not None else 1


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
