"""The HTTP front end's CPU cost per streamed token and chunk: a real `phaseflip serve` (its engine
decodes a batch of concurrent streams), and the front end's and the engine's CPU seconds over
the run (/proc), divided by the chunks the clients received. The front end is one Python
process: at the decode batches of a GPU server (hundreds of streams, a chunk each per step) its
per-chunk cost bounds the tokens a second it can deliver at all.

    python -m benchmarks.front_end_cost --concurrency 64 --output-len 256 --out fe.json
    python -m benchmarks.front_end_cost --endpoint chat --null-forward

(The CPU seconds are the processes' own, so they hold on a box the clients share; the chunk
rate is the whole box's.) `--null-forward`: the engine's model forward returns precomputed
random logits (`bench_scheduler.install_null_forward`, put in the engine process by a
`sitecustomize` on its PYTHONPATH), so on a CPU box the engine steps about as fast as a GPU
server's and the front end is the part under load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_serving import _free_port, launch_server, make_client, stop_server
from benchmarks.common import environment, write_json
from benchmarks.proc_stats import engine_pid
from phaseflip.config import EMBEDDED_MODEL

NULL_FORWARD_HOOK = """
import os
if os.environ.get("PHASEFLIP_BENCH_NULL_FORWARD"):
    from phaseflip.engine import core as _core
    _init = _core.EngineCore.__init__

    def _init_null(self, *a, **kw):
        _init(self, *a, **kw)
        from benchmarks.bench_scheduler import install_null_forward
        install_null_forward(self, 4096, self.model_cfg.vocab_size, 0)

    _core.EngineCore.__init__ = _init_null
"""


def null_forward_env(hook_dir: str) -> None:
    """Makes every Python process started from here on (the server's engine among them) load
    `NULL_FORWARD_HOOK` as its sitecustomize."""
    Path(hook_dir, "sitecustomize.py").write_text(NULL_FORWARD_HOOK)
    root = str(Path(__file__).resolve().parent.parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [hook_dir, root, *filter(None, [os.environ.get("PYTHONPATH")])])
    os.environ["PHASEFLIP_BENCH_NULL_FORWARD"] = "1"


def cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` (its threads included), from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _stream(client: Any, url: str, payload: dict[str, Any]) -> tuple[int, int]:
    """(chunks with a choice, completion tokens by the usage) of one stream."""
    chunks = tokens = 0
    async for data in client.lines(url, payload):
        if data == "[DONE]":
            break
        msg = json.loads(data)
        if "error" in msg:
            raise RuntimeError(f"stream error: {msg['error']}")
        chunks += bool(msg.get("choices"))
        if msg.get("usage"):
            tokens = msg["usage"]["completion_tokens"]
    return chunks, tokens


async def load(base: str, endpoint: str, concurrency: int, rounds: int, output_len: int,
               client_kind: str) -> tuple[int, int]:
    """(chunks, tokens) of `rounds` waves of `concurrency` streams of `output_len` tokens."""
    url = f"{base}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}"
    chunks = tokens = 0
    async with make_client(client_kind, 3600.0, {}) as client:
        for r in range(rounds):
            payloads = []
            for i in range(concurrency):
                body: dict[str, Any] = {"model": "default", "max_tokens": output_len,
                                        "stream": True, "ignore_eos": True,
                                        "temperature": 0.0,
                                        "stream_options": {"include_usage": True}}
                words = f"request {r} {i}: tell me a long story"
                if endpoint == "chat":
                    body["messages"] = [{"role": "user", "content": words}]
                else:
                    body["prompt"] = words
                payloads.append(body)
            for c, t in await asyncio.gather(*(_stream(client, url, b) for b in payloads)):
                chunks, tokens = chunks + c, tokens + t
    return chunks, tokens


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--serve-args", default="--device cpu",
                    help="flags for phaseflip serve (the embedded model unless --model is here)")
    ap.add_argument("--client", default="auto", choices=["auto", "aiohttp", "httpx"])
    ap.add_argument("--null-forward", action="store_true",
                    help="the engine's forward returns random logits (see above)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.null_forward:
        null_forward_env(tempfile.mkdtemp(prefix="pf-null-"))

    serve_args = args.serve_args
    if "--model" not in serve_args:
        serve_args += f" --model {EMBEDDED_MODEL}"
    serve_args += f" --served-model-name default --max-running-requests {args.concurrency}"
    port = _free_port()
    proc = launch_server(serve_args, port, 600.0)
    try:
        engine = engine_pid(proc.pid)
        base = f"http://127.0.0.1:{port}"
        asyncio.run(load(base, args.endpoint, args.concurrency, 1, 8, args.client))  # warm-up
        fe0, en0, t0 = cpu_seconds(proc.pid), cpu_seconds(engine), time.perf_counter()
        chunks, tokens = asyncio.run(load(base, args.endpoint, args.concurrency, args.rounds,
                                          args.output_len, args.client))
        wall = time.perf_counter() - t0
        fe, en = cpu_seconds(proc.pid) - fe0, cpu_seconds(engine) - en0
    finally:
        stop_server(proc)
    result = {
        "endpoint": args.endpoint, "concurrency": args.concurrency, "rounds": args.rounds,
        "output_len": args.output_len, "tokens": tokens,
        "tokens_expected": args.concurrency * args.rounds * args.output_len, "chunks": chunks,
        "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
        "front_end_cpu_s": round(fe, 3), "engine_cpu_s": round(en, 3),
        "front_end_us_per_token": round(1e6 * fe / max(tokens, 1), 1),
        "front_end_us_per_chunk": round(1e6 * fe / max(chunks, 1), 1),
        "engine_us_per_token": round(1e6 * en / max(tokens, 1), 1),
        "null_forward": args.null_forward, "serve_args": serve_args,
        "server_ready_s": proc.ready_s,
        "python": sys.version.split()[0], "environment": environment(),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=1))
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
