"""Online serving benchmark: Poisson arrivals of streaming completions against a live server.

    python -m benchmarks.bench_serving --base-url http://127.0.0.1:8000 --request-rate 4 \
        --num-prompts 200 --dataset sharegpt-like --out serving.json
    python -m benchmarks.bench_serving --launch --serve-args "--model llama-3.1-8b \
        --load-format dummy" --request-rate 8 --num-prompts 200

Each request is `POST /v1/completions` with a token-id prompt, `stream: true`, `ignore_eos` and
`max_tokens` = its target length, `stream_options.include_usage`. Arrival gaps are exponential
with mean 1/rate (seeded), the first request sent at once and each later one at its scheduled
time since then; `--request-rate inf` sends everything at once. Measured per request:
TTFT (send → first token event), ITL (gaps between token events), E2E (send → last event);
reported as mean/p50/p90/p99, with request and token throughput over the run's wall time.

`--json-schema FILE` sends every request with `response_format` json_schema (strict) instead of
`ignore_eos` (the grammar decides where an answer ends; the server refuses both at once), after
one warm-up request that compiles the grammar (its time is `structured.warmup_s`). Finished
answers are parsed and checked against the schema (benchmarks/schema_check.py); answers cut at
`max_tokens` are counted under their finish reason, not checked. `--compare-unconstrained` runs
the same workload without, then with the schema against one server and reports the ratios.

aiohttp is used where installed (the GPU image has it), httpx otherwise: the same protocol, so
the figures are comparable, but record which one ran (`client` in the JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from benchmarks import schema_check
from benchmarks.common import itl_split, make_workload, print_table, summarize, write_json


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
    finish_reason: str | None = None
    text: str | None = None  # constrained requests only (its JSON is checked)
    schema_problems: list[str] | None = None  # None: not checked (unconstrained, or cut short)


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
                      temperature: float, response_format: dict[str, Any] | None = None
                      ) -> RequestResult:
    """Streams one completion; a token event is any chunk with a choice (the engine emits one
    per sampled token, with empty text when the token decodes to nothing; a stream whose
    front end fell behind gets the tokens of several steps in one chunk, so ITLs are per
    chunk and the token count comes from the usage). Unconstrained, it
    must produce exactly `max_tokens` (`ignore_eos`); with a `response_format` it must finish
    ("stop", or "length" when the budget cut the answer) and its text is kept."""
    res = RequestResult(prompt_len=len(prompt), target_len=max_tokens)
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
               "temperature": temperature, "stream_options": {"include_usage": True}}
    if response_format is None:
        payload["ignore_eos"] = True
    else:
        payload["response_format"] = response_format
    t0 = time.perf_counter()
    last = t0
    events, parts = 0, []
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
            choice = msg["choices"][0]
            parts.append(choice.get("text") or "")
            res.finish_reason = choice.get("finish_reason") or res.finish_reason
            if events == 0:
                res.ttft = now - t0
            else:
                res.itls.append(now - last)
            last, events = now, events + 1
        res.e2e = last - t0
        res.output_tokens = res.output_tokens or events
        _judge(res, max_tokens, response_format is not None, "".join(parts))
    except Exception as exc:  # noqa: BLE001 - recorded per request, the run goes on
        res.error = f"{type(exc).__name__}: {exc}"
    return res


def _judge(res: RequestResult, max_tokens: int, constrained: bool, text: str) -> None:
    if not constrained:
        res.ok = res.output_tokens == max_tokens
        if not res.ok:
            res.error = f"got {res.output_tokens} tokens, expected {max_tokens}"
        return
    res.text = text
    res.ok = res.finish_reason in ("stop", "length")
    if not res.ok:
        res.error = f"finish_reason {res.finish_reason!r}"


def response_format_of(path: str) -> dict[str, Any]:
    """The `response_format` body for the schema in `path` (its name: the file's stem)."""
    with open(path) as f:
        schema = json.load(f)
    if not isinstance(schema, dict):
        raise SystemExit(f"{path}: a JSON schema must be a JSON object")
    return {"type": "json_schema", "json_schema": {
        "name": os.path.splitext(os.path.basename(path))[0], "schema": schema, "strict": True}}


async def run_benchmark(args: argparse.Namespace, base_url: str,
                        response_format: dict[str, Any] | None = None) -> dict[str, Any]:
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

    async with make_client(args.client, args.timeout, headers) as client:
        warmup = None
        if args.json_schema:  # compiles the grammar (when constrained) outside the measured run
            prompt = [1 + (7 * i) % (args.vocab_size - 1) for i in range(8)]  # in no workload
            warmup = await one_request(client, url, model, prompt, 1, args.temperature,
                                       response_format)
        bar = tqdm(total=len(work.prompts), desc="requests", unit="req")

        async def fire(i: int) -> RequestResult:
            async with limit or contextlib.nullcontext():
                res = await one_request(client, url, model, work.prompts[i],
                                        work.output_lens[i], args.temperature, response_format)
            bar.update(1)
            return res

        tasks = []
        # request i is sent at the sum of the gaps before it (the first at once: the run's
        # duration starts with it), each against the one clock: sleeping gap after gap would
        # add every wake-up's lateness (the loop busy with streams) to all later arrivals
        arrivals = np.cumsum([0.0, *gaps[1:]])[:len(gaps)]
        start = time.perf_counter()
        for i, at in enumerate(arrivals):
            if (wait := start + at - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(fire(i)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    result = _metrics(args, model, client.name, results, duration)
    if warmup is not None:
        result["warmup_s"] = warmup.e2e if warmup.ok else None
        result["warmup_error"] = warmup.error
    if response_format is not None:
        result["structured"] = structured_summary(args.json_schema, response_format, results)
    result.update(await _server_info(base_url, headers))
    return result


def structured_summary(path: str, response_format: dict[str, Any],
                       results: list[RequestResult]) -> dict[str, Any]:
    """Checks each answer that finished ("stop") against the schema: it must parse as JSON and
    validate. Answers cut by `max_tokens` are prefixes: counted, not checked."""
    schema = response_format["json_schema"]["schema"]
    parsed = valid = 0
    for r in results:
        if r.finish_reason != "stop" or r.text is None:
            continue
        try:
            value = json.loads(r.text)
        except json.JSONDecodeError as e:
            r.schema_problems = [f"not JSON: {e}"]
            continue
        parsed += 1
        r.schema_problems = schema_check.problems(value, schema)
        valid += not r.schema_problems
    reasons = Counter(r.finish_reason or "none" for r in results)
    return {
        "schema": path, "schema_name": response_format["json_schema"]["name"],
        "finish_reasons": dict(sorted(reasons.items())), "finished": reasons.get("stop", 0),
        "parsed": parsed, "valid": valid,
        "unchecked_keywords": schema_check.unchecked_keywords(schema),
        "problems": sorted({p for r in results for p in r.schema_problems or ()})[:10],
    }


async def run_compare(args: argparse.Namespace, base_url: str,
                      response_format: dict[str, Any]) -> dict[str, Any]:
    """The same workload without, then with the schema, each on a flushed prefix cache (the
    second run would otherwise find every prompt cached); ratios are constrained/unconstrained.
    `itl_split` and `decode_itl_p50_ratio` only for one wave (every request sent at once, no
    concurrency limit below --num-prompts); otherwise empty and None."""
    runs = {}
    for name, fmt in (("unconstrained", None), ("constrained", response_format)):
        flushed = await _flush_cache(base_url, args.api_key)
        runs[name] = await run_benchmark(args, base_url, fmt)
        runs[name]["flushed_tokens"] = flushed
    u, c = runs["unconstrained"], runs["constrained"]

    def ratio(a: float, b: float) -> float | None:
        return a / b if b and math.isfinite(a) and math.isfinite(b) else None

    # the split takes every request as sent at once (one wave): under arrivals spread in time
    # or a concurrency limit below --num-prompts, prompts keep prefilling past any cut
    one_wave = math.isinf(args.request_rate) and (
        not args.max_concurrency or args.max_concurrency >= args.num_prompts)
    split = {name: itl_split(run) for name, run in runs.items() if run["requests"] and one_wave}
    decode = [split.get(n, {}).get("decode_p50_ms") for n in ("constrained", "unconstrained")]
    return {
        "benchmark": "serving-structured-compare", "model": c["model"],
        "schema": args.json_schema, **runs, "itl_split": split,
        # ITLs after the wave's last first token: no prefill joins these steps (one wave)
        "decode_itl_p50_ratio": ratio(*decode) if None not in decode else None,
        "itl_p50_ratio": ratio(c["itl_s"]["p50"], u["itl_s"]["p50"]),
        "itl_p99_ratio": ratio(c["itl_s"]["p99"], u["itl_s"]["p99"]),
        "tpot_p50_ratio": ratio(c["tpot_s"]["p50"], u["tpot_s"]["p50"]),
        "output_tokens_per_s_ratio": ratio(c["output_tokens_per_s"], u["output_tokens_per_s"]),
    }


async def _flush_cache(base_url: str, api_key: str | None) -> int | None:
    """Empties the server's prefix cache; None if it refused (the figures then say so)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(headers=headers, timeout=60) as c:
            r = await c.post(base_url.rstrip("/") + "/flush_cache")
        return r.json()["freed_tokens"] if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError):
        return None


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
    /health; its output goes to this process's stderr so a failed start explains itself.
    The process's `ready_s`: seconds from the launch to the first healthy answer."""
    import httpx

    cmd = [sys.executable, "-m", "phaseflip.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), *shlex.split(serve_args)]
    print("launching:", " ".join(shlex.quote(c) for c in cmd), file=sys.stderr)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr, start_new_session=True)
    end = t0 + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"phaseflip serve exited with code {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                proc.ready_s = round(time.monotonic() - t0, 2)
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
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
    ap.add_argument("--json-schema", default=None, metavar="FILE",
                    help="constrain every answer to this JSON schema (response_format "
                         "json_schema, strict); finished answers are validated against it")
    ap.add_argument("--compare-unconstrained", action="store_true",
                    help="with --json-schema: run the workload without, then with the schema, "
                         "and report both and the ITL p50 ratio")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.compare_unconstrained and not args.json_schema:
        ap.error("--compare-unconstrained needs --json-schema")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    proc = None
    if args.launch:
        port = _free_port()
        args.base_url = f"http://127.0.0.1:{port}"
        proc = launch_server(args.serve_args, port, args.launch_timeout)
    fmt = response_format_of(args.json_schema) if args.json_schema else None
    try:
        if args.compare_unconstrained:
            result = asyncio.run(run_compare(args, args.base_url, fmt))
        else:
            result = asyncio.run(run_benchmark(args, args.base_url, fmt))
    finally:
        if proc is not None:
            stop_server(proc)
    if args.launch:
        result["serve_args"], result["server_ready_s"] = args.serve_args, proc.ready_s
    if args.compare_unconstrained:
        _print_compare(result)
    else:
        _print(result)
    return write_json(args.out, result)


def _print_compare(r: dict[str, Any]) -> None:
    rows = []
    for name in ("unconstrained", "constrained"):
        x = r[name]
        rows.append([name, x["completed"], x["output_tokens"] / max(x["completed"], 1),
                     x["output_tokens_per_s"], *(1e3 * x[k]["p50"] for k in
                                                 ("ttft_s", "itl_s", "e2e_s")),
                     1e3 * x["itl_s"]["p99"]])
    print_table(["run", "requests", "out tok/req", "out tok/s", "TTFT p50 ms", "ITL p50 ms",
                 "E2E p50 ms", "ITL p99 ms"], rows,
                title=f"structured output cost: {r['model']}, schema {r['schema']}")
    ratio = r["itl_p50_ratio"]
    print(f"ITL p50 constrained/unconstrained: {'n/a' if ratio is None else f'{ratio:.3f}'}")
    for name, sp in r.get("itl_split", {}).items():
        print(f"{name}: after the last first token ITL p50 {sp['decode_p50_ms']} ms, p99 "
              f"{sp['decode_p99_ms']} ms; before it p99 {sp['prefill_window_p99_ms']} ms")
    dr = r.get("decode_itl_p50_ratio")
    if dr is not None:
        print(f"decode-only ITL p50 constrained/unconstrained: {dr:.3f}")
    for name in ("unconstrained", "constrained"):
        for err in r[name]["errors"]:
            print(f"error ({name}):", err)
    _print_structured(r["constrained"])


def _print_structured(r: dict[str, Any]) -> None:
    s = r["structured"]
    print(f"schema {s['schema']}: finish reasons {s['finish_reasons']}; of {s['finished']} "
          f"finished, {s['parsed']} parsed as JSON, {s['valid']} valid against the schema"
          + (f" (unchecked keywords: {', '.join(s['unchecked_keywords'])})"
             if s["unchecked_keywords"] else ""))
    for problem in s["problems"]:
        print("schema problem:", problem)


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
    if "structured" in r:
        _print_structured(r)


if __name__ == "__main__":
    main()
