"""Online serving benchmark: Poisson arrivals of streaming completions against a live server.

    python -m benchmarks.bench_serving --base-url http://127.0.0.1:8000 --request-rate 4 \
        --num-prompts 200 --dataset sharegpt-like --out serving.json
    python -m benchmarks.bench_serving --launch --serve-args "--model llama-3.1-8b \
        --load-format dummy" --request-rate 8 --num-prompts 200

Each request is `POST /v1/completions` with a token-id prompt, `stream: true`, `ignore_eos` and
`max_tokens` = its target length, `stream_options.include_usage`. Arrival gaps are exponential
with mean 1/rate (seeded); `--request-rate inf` sends everything at once. Measured per request:
TTFT (send → first token event), ITL (gaps between token events), E2E (send → last event);
reported as mean/p50/p90/p99, with request and token throughput over the run's wall time.

aiohttp is used where installed (the GPU image has it), httpx otherwise: the same protocol, so
the figures are comparable, but record which one ran (`client` in the JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from benchmarks.common import make_workload, print_table, summarize, write_json


@dataclass
class RequestResult:
    prompt_len: int
    target_len: int
    ok: bool = False
    output_tokens: int = 0
    ttft: float = math.nan
    e2e: float = math.nan
    itls: list[float] = field(default_factory=list)
    error: str | None = None


# ---------------------------------------------------------------------------------------------
# HTTP clients: one interface, two libraries


class _Client:
    """`lines(url, payload)` yields the SSE `data:` payloads of one streaming POST."""

    name = "?"

    async def __aenter__(self) -> _Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    def lines(self, url: str, payload: dict[str, Any]) -> AsyncIterator[str]:
        raise NotImplementedError


class _AiohttpClient(_Client):
    name = "aiohttp"

    def __init__(self, timeout_s: float, headers: dict[str, str]) -> None:
        import aiohttp

        self._aiohttp = aiohttp
        self._timeout, self._headers = timeout_s, headers

    async def __aenter__(self) -> _AiohttpClient:
        aiohttp = self._aiohttp
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self._timeout), headers=self._headers,
            connector=aiohttp.TCPConnector(limit=0),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._session.close()

    async def lines(self, url: str, payload: dict[str, Any]) -> AsyncIterator[str]:
        async with self._session.post(url, json=payload) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    line = line.strip()
                    if line.startswith(b"data:"):
                        yield line[5:].strip().decode()


class _HttpxClient(_Client):
    name = "httpx"

    def __init__(self, timeout_s: float, headers: dict[str, str]) -> None:
        import httpx

        self._httpx = httpx
        self._timeout, self._headers = timeout_s, headers

    async def __aenter__(self) -> _HttpxClient:
        httpx = self._httpx
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(self._timeout), headers=self._headers,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._client.aclose()

    async def lines(self, url: str, payload: dict[str, Any]) -> AsyncIterator[str]:
        async with self._client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
            async for line in resp.aiter_lines():
                if line.startswith("data:"):
                    yield line[5:].strip()


def make_client(kind: str, timeout_s: float, headers: dict[str, str]) -> _Client:
    if kind in ("auto", "aiohttp"):
        try:
            return _AiohttpClient(timeout_s, headers)
        except ImportError:
            if kind == "aiohttp":
                raise
    return _HttpxClient(timeout_s, headers)


# ---------------------------------------------------------------------------------------------
# One request


async def one_request(client: _Client, url: str, model: str, prompt: list[int], max_tokens: int,
                      temperature: float) -> RequestResult:
    """Streams one completion; a token event is any chunk with a choice (the engine emits one
    per sampled token, with empty text when the token decodes to nothing)."""
    res = RequestResult(prompt_len=len(prompt), target_len=max_tokens)
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
               "temperature": temperature, "ignore_eos": True,
               "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    last = t0
    events = 0
    try:
        async for data in client.lines(url, payload):
            if data == "[DONE]":
                break
            now = time.perf_counter()
            msg = json.loads(data)
            if "error" in msg:
                raise RuntimeError(f"stream error: {msg['error']}")
            if msg.get("usage"):
                res.output_tokens = msg["usage"]["completion_tokens"]
            if not msg.get("choices"):
                continue
            if events == 0:
                res.ttft = now - t0
            else:
                res.itls.append(now - last)
            last, events = now, events + 1
        res.e2e = last - t0
        res.output_tokens = res.output_tokens or events
        res.ok = res.output_tokens == max_tokens
        if not res.ok:
            res.error = f"got {res.output_tokens} tokens, expected {max_tokens}"
    except Exception as exc:  # noqa: BLE001 - recorded per request, the run goes on
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def run_benchmark(args: argparse.Namespace, base_url: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.served_model_name or await _model_name(base_url, headers)
    work = make_workload(args.dataset, args.num_prompts, args.input_len, args.output_len,
                         args.vocab_size, args.seed, args.max_context)
    rng = np.random.default_rng(args.seed + 17)
    rate = args.request_rate
    gaps = ([0.0] * len(work.prompts) if math.isinf(rate)
            else rng.exponential(1.0 / rate, size=len(work.prompts)).tolist())
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    url = base_url.rstrip("/") + "/v1/completions"
    bar = tqdm(total=len(work.prompts), desc="requests", unit="req")

    async with make_client(args.client, args.timeout, headers) as client:
        async def fire(i: int) -> RequestResult:
            if limit is None:
                res = await one_request(client, url, model, work.prompts[i],
                                        work.output_lens[i], args.temperature)
            else:
                async with limit:
                    res = await one_request(client, url, model, work.prompts[i],
                                            work.output_lens[i], args.temperature)
            bar.update(1)
            return res

        tasks = []
        start = time.perf_counter()
        for i, gap in enumerate(gaps):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(fire(i)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    result = _metrics(args, model, client.name, results, duration)
    result.update(await _server_info(base_url, headers))
    return result


async def _model_name(base_url: str, headers: dict[str, str]) -> str:
    import httpx

    async with httpx.AsyncClient(headers=headers, timeout=30) as c:
        r = await c.get(base_url.rstrip("/") + "/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]


async def _server_info(base_url: str, headers: dict[str, str]) -> dict[str, Any]:
    """The server's device, dtype and config, for provenance (the client's own `env` says
    nothing about the GPU the server ran on). Empty when the endpoint is unavailable."""
    import httpx

    try:
        async with httpx.AsyncClient(headers=headers, timeout=30) as c:
            info = (await c.get(base_url.rstrip("/") + "/server_info")).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return {"device": info.get("device"), "dtype": info.get("dtype"),
            "server_config": info.get("server_config"), "server_versions": info.get("versions")}


def _metrics(args: argparse.Namespace, model: str, client: str, results: list[RequestResult],
             duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    itls = [x for r in ok for x in r.itls]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "benchmark": "serving",
        "model": model,
        "base_url": args.base_url,
        "client": client,
        "dataset": args.dataset,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency,
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:10],
        "duration_s": duration,
        "requests_per_s": len(ok) / duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / duration,
        "total_tokens_per_s": (in_tokens + out_tokens) / duration,
        "ttft_s": summarize([r.ttft for r in ok]),
        "itl_s": summarize(itls),
        "tpot_s": summarize(tpot),
        "e2e_s": summarize([r.e2e for r in ok]),
        "requests": [asdict(r) for r in results],
    }


# ---------------------------------------------------------------------------------------------
# --launch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(serve_args: str, port: int, deadline_s: float) -> subprocess.Popen:
    """Starts `phaseflip serve` on 127.0.0.1:port in its own process group and waits for
    /health; its output goes to this process's stderr so a failed start explains itself."""
    import httpx

    cmd = [sys.executable, "-m", "phaseflip.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), *shlex.split(serve_args)]
    print("launching:", " ".join(shlex.quote(c) for c in cmd), file=sys.stderr)
    proc = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr, start_new_session=True)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"phaseflip serve exited with code {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"phaseflip serve was not healthy after {deadline_s:.0f} s")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (the server's graceful path), then SIGKILL to the group after 30 s."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--served-model-name", default=None, help="default: the first of /v1/models")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--request-rate", type=float, default=float("inf"),
                    help="requests/s (Poisson); inf sends all at once")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--dataset", default="sharegpt-like", choices=["sharegpt-like", "fixed"])
    ap.add_argument("--input-len", type=int, default=1024, help="fixed dataset only")
    ap.add_argument("--output-len", type=int, default=128, help="fixed dataset only")
    ap.add_argument("--max-context", type=int, default=None,
                    help="shorten prompts so prompt + output fits (the model's context)")
    ap.add_argument("--vocab-size", type=int, default=4096,
                    help="prompt ids are drawn below this (4096 is valid for every bundled "
                         "model and the tiny one)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=3600.0, help="per request, seconds")
    ap.add_argument("--client", default="auto", choices=["auto", "aiohttp", "httpx"])
    ap.add_argument("--launch", action="store_true",
                    help="start `phaseflip serve --serve-args ...` on a free port, stop it after")
    ap.add_argument("--serve-args", default="", help="flags for phaseflip serve (with --launch)")
    ap.add_argument("--launch-timeout", type=float, default=900.0)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    proc = None
    if args.launch:
        port = _free_port()
        args.base_url = f"http://127.0.0.1:{port}"
        proc = launch_server(args.serve_args, port, args.launch_timeout)
    try:
        result = asyncio.run(run_benchmark(args, args.base_url))
    finally:
        if proc is not None:
            stop_server(proc)
    if args.launch:
        result["serve_args"] = args.serve_args
    _print(result)
    return write_json(args.out, result)


def _print(r: dict[str, Any]) -> None:
    print_table(
        ["requests", "failed", "seconds", "req/s", "out tok/s", "total tok/s"],
        [[r["completed"], r["failed"], r["duration_s"], r["requests_per_s"],
          r["output_tokens_per_s"], r["total_tokens_per_s"]]],
        title=f"serving: {r['model']} at {r['request_rate']} req/s ({r['dataset']}, "
              f"{r['client']})")
    rows = [[name, 1e3 * r[key]["mean"], 1e3 * r[key]["p50"], 1e3 * r[key]["p90"],
             1e3 * r[key]["p99"]] for name, key in
            (("TTFT", "ttft_s"), ("ITL", "itl_s"), ("TPOT", "tpot_s"), ("E2E", "e2e_s"))]
    print_table(["ms", "mean", "p50", "p90", "p99"], rows)
    for err in r["errors"]:
        print("error:", err)


if __name__ == "__main__":
    main()
