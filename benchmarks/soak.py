"""Soak: a real `phaseflip serve` under mixed load for a bounded time, then the books checked.

    python -m benchmarks.soak --duration-s 600 --out soak.json
    python -m benchmarks.soak --serve-args "--tp-size 2 --enable-flip --enable-hicache \
        --hicache-host-gb 0.05" --duration-s 600 --out soak-flip.json
    python -m benchmarks.soak --base-url http://127.0.0.1:8000 --server-pid PID ...

Without --base-url it launches `phaseflip serve --device cpu --check-accounting` (plus
--serve-args) on a free loopback port. `--concurrency` clients loop over a mix: completions
and chat, streaming or not, n > 1, lists of prompts, logprobs; streams the client drops after
a few events and non-streaming calls it hangs up on (client disconnects); `/generate` calls
cancelled by `/abort_request`; completions and chat with stop strings (short, and up to 1024
characters); a few invalid requests (each must be a 4xx). A controller meanwhile calls
/flush_cache (refused under load; every `--flush-every-s` it quiets the clients so one goes
through) and, when the server runs with flips on, flips the layout by `POST /admin/flip`
every `--flip-every-s`, under load.

At the end, with the clients stopped, it checks:
- nothing lost: the server's `phaseflip_requests_total` (every sequence that ended, by finish
  reason, aborts included) grew by exactly the sequences the clients know were admitted, plus
  at most the non-streaming calls hung up on before the server may have read them; every answer
  the clients read ended each choice exactly once; `/abort_request` aborts are counted as such;
- accounting back to idle: /server_info says no request runs or waits, `pool.balanced`, and no
  slot is held by a request (private/protected 0);
- memory flat: the private resident memory (VmRSS less RssShmem) of the front end, of the
  engine process (its child; rank 0) and of the worker ranks (`spawner.rank_pids`) at the
  end within ±`--rss-tolerance` of a sample taken after the warm-up (the first quarter of the
  run, and a flip round trip when flipping). Shared memory is reported apart: the HiCache
  host tier and the weight image are /dev/shm files the ranks map, resident as they are
  touched, up to their fixed sizes (--hicache-host-gb), so they grow by design until full.
Every `--sample-every-s` it also records, against the requests sent so far, each process's
RSS, open file descriptors and threads (`samples` in the JSON: growth with the requests
served, not with the concurrency, is a leak).
Prints a table and writes JSON (`--out`); exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shlex
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks.common import write_json
from benchmarks.proc_stats import (
    engine_pid,
    open_fds,
    private_rss_bytes,
    proc_rss_bytes,
    proc_status_count,
)
from benchmarks.soak_report import ended_counts, mib, parse_metrics, print_result
from phaseflip.distributed.spawner import rank_pids

PROMPTS = [
    "def main():", "The quick brown fox", "Return the number of items in", "class Node:",
    "Parse the arguments and", "import os\nimport sys\n", "If the file does not exist,",
    "A list of the", "Raise ValueError if", "Return a copy of",
]
SHARED_PREFIX = ("Return a new list containing the items of the iterable, sorted by key, "
                 "ignoring case, keeping the first of equal items; raise TypeError if ")
KINDS = {  # the mix: kind -> weight
    "complete": 4, "complete_list": 1, "stream": 3, "chat": 2, "chat_stream": 2,
    "drop_stream": 2, "hang_up": 1, "abort": 1, "stop_strings": 2, "invalid": 1,
}
# each must be refused with a 4xx before it reaches the engine (or by it)
INVALID = [
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}),
    ("/v1/completions", {"prompt": "x", "n": 0}),
    ("/v1/completions", {"prompt": "x", "temperature": -1}),
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * 17}),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"999999999": 1}}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 3}),
    ("/v1/completions", None),  # not JSON
]


@dataclass
class Books:
    """What the clients saw."""

    sent: Counter = field(default_factory=Counter)  # requests by kind
    admitted_seqs: int = 0  # sequences the server certainly took (it answered or streamed)
    maybe_seqs: int = 0  # hung up before any answer: the server may not have read them
    finishes: Counter = field(default_factory=Counter)  # finish reasons the clients read
    aborts_sent: int = 0  # /abort_request answered 200
    dropped: int = 0  # calls the client left before their end (streams dropped, hang-ups)
    errors: list[str] = field(default_factory=list)  # unexpected answers (a check fails)
    flushes: Counter = field(default_factory=Counter)  # "ok", "refused"
    flips: Counter = field(default_factory=Counter)  # "ok", "conflict", ...
    flip_s: list[float] = field(default_factory=list)
    refused: Counter = field(default_factory=Counter)  # invalid requests by status code

    def error(self, what: str) -> None:
        if len(self.errors) < 50:
            self.errors.append(what)


# ------------------------------------------------------------------ the clients
class Soak:
    def __init__(self, args: argparse.Namespace, base_url: str, server_pid: int | None):
        self.args, self.url, self.server_pid = args, base_url, server_pid
        self.books = Books()
        self.rng = random.Random(args.seed)
        self.stop = asyncio.Event()
        self.quiet = asyncio.Event()  # set: clients pause between requests
        self.idle_clients = 0
        self.rss: dict[str, dict[str, int | None]] = {}
        self.flips_done = 0
        self.samples: list[dict[str, Any]] = []  # periodic: requests sent, RSS, fds, threads
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.http = httpx.AsyncClient(base_url=base_url, headers=headers,
                                      timeout=httpx.Timeout(args.request_timeout_s),
                                      limits=httpx.Limits(max_connections=None))

    async def run(self) -> dict[str, Any]:
        info = (await self.http.get("/server_info")).json()
        self.model = info["model"]
        cfg = info["config"]
        self.flipping = bool(cfg.get("enable_flip")) and not self.args.no_flips
        self.layouts = [(cfg["tp_size"], cfg["pp_size"]),
                        (1, cfg["tp_size"] * cfg["pp_size"]) if cfg["pp_size"] == 1
                        else (cfg["tp_size"] * cfg["pp_size"], 1)]
        before = ended_counts(parse_metrics((await self.http.get("/metrics")).text))
        t0 = time.monotonic()
        clients = [asyncio.create_task(self.client(i)) for i in range(self.args.concurrency)]
        control = asyncio.create_task(self.controller(t0))
        sampler = asyncio.create_task(self.sampler())
        await asyncio.sleep(self.args.duration_s)
        self.stop.set()
        await control
        await asyncio.gather(*clients)
        sampler.cancel()
        load_s = time.monotonic() - t0
        idle = await self.wait_idle()
        after = ended_counts(parse_metrics((await self.http.get("/metrics")).text))
        self.rss["end"] = self.sample_rss()
        self.samples.append(self.sample_procs())
        await self.http.aclose()
        return self.verdict(before, after, idle, load_s)

    async def client(self, i: int) -> None:
        rng = random.Random(self.args.seed * 1000 + i)
        kinds, weights = zip(*KINDS.items())
        while not self.stop.is_set():
            if self.quiet.is_set():
                self.idle_clients += 1
                while self.quiet.is_set() and not self.stop.is_set():
                    await asyncio.sleep(0.05)
                self.idle_clients -= 1
                continue
            kind = rng.choices(kinds, weights)[0]
            self.books.sent[kind] += 1
            try:
                await getattr(self, kind)(rng)
            except (httpx.HTTPError, ValueError, KeyError) as e:
                self.books.error(f"{kind}: {type(e).__name__}: {e}")

    def _prompt(self, rng: random.Random) -> str:
        base = rng.choice(PROMPTS)
        return SHARED_PREFIX + base if rng.random() < 0.3 else base

    def _sampling(self, rng: random.Random) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": rng.randint(2, 24)}
        if rng.random() < 0.5:
            body |= {"temperature": 0.8, "seed": rng.randint(0, 1000)}
        else:
            body["temperature"] = 0
        return body

    def _finished(self, choices: list[dict], expect: int, kind: str) -> None:
        if len(choices) != expect:
            self.books.error(f"{kind}: {len(choices)} choices, expected {expect}")
        for c in choices:
            self.books.finishes[c["finish_reason"]] += 1

    async def complete(self, rng: random.Random, prompts: int = 1) -> None:
        n = rng.choice([1, 1, 2, 3])
        body = self._sampling(rng) | {"n": n, "prompt": self._prompt(rng) if prompts == 1
                                      else [self._prompt(rng) for _ in range(prompts)]}
        if rng.random() < 0.5:
            body["logprobs"] = rng.randint(0, 3)
        r = await self.http.post("/v1/completions", json=body)
        if r.status_code != 200:
            return self.books.error(f"completion {r.status_code}: {r.text[:200]}")
        self.books.admitted_seqs += n * prompts
        choices = r.json()["choices"]
        self._finished(choices, n * prompts, "completion")
        if "logprobs" in body and any(c["logprobs"] is None for c in choices):
            self.books.error("completion: logprobs asked for, none returned")

    async def complete_list(self, rng: random.Random) -> None:
        await self.complete(rng, prompts=2)

    async def chat(self, rng: random.Random, stream: bool = False) -> None:
        n = rng.choice([1, 2])
        body = self._sampling(rng) | {"n": n, "messages": [
            {"role": "user", "content": self._prompt(rng)}]}
        if rng.random() < 0.5:
            body |= {"logprobs": True, "top_logprobs": rng.randint(0, 3)}
        if stream:
            return await self._stream("/v1/chat/completions", body, n, rng, drop=False)
        r = await self.http.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            return self.books.error(f"chat {r.status_code}: {r.text[:200]}")
        self.books.admitted_seqs += n
        self._finished(r.json()["choices"], n, "chat")

    async def chat_stream(self, rng: random.Random) -> None:
        await self.chat(rng, stream=True)

    async def stream(self, rng: random.Random) -> None:
        n = rng.choice([1, 1, 2])
        body = self._sampling(rng) | {"n": n, "prompt": self._prompt(rng)}
        if rng.random() < 0.5:
            body["logprobs"] = rng.randint(0, 2)
        await self._stream("/v1/completions", body, n, rng, drop=False)

    async def drop_stream(self, rng: random.Random) -> None:
        body = self._sampling(rng) | {"prompt": self._prompt(rng), "max_tokens": 200,
                                      "ignore_eos": True, "n": rng.choice([1, 2])}
        await self._stream("/v1/completions", body, body["n"], rng, drop=True)

    async def _stream(self, path: str, body: dict, n: int, rng: random.Random,
                      drop: bool) -> None:
        """A streaming call read to its [DONE] (each choice must end exactly once, and usage
        come once), or, with `drop`, dropped after 1-3 events."""
        body = body | {"stream": True, "stream_options": {"include_usage": True}}
        ends: Counter = Counter()
        usage = done = events = 0
        async with self.http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return self.books.error(f"stream {path} {r.status_code}: {r.text[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if events == 0:
                    self.books.admitted_seqs += n  # the server answers once it took it
                events += 1
                if line == "data: [DONE]":
                    done += 1
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self.books.error(f"stream {path}: error event {chunk['error']}")
                    continue
                usage += chunk.get("usage") is not None
                for c in chunk["choices"]:
                    if c.get("finish_reason") is not None:
                        ends[c["index"]] += 1
                        self.books.finishes[c["finish_reason"]] += 1
                if drop and events >= rng.randint(1, 3) and not done:
                    self.books.dropped += 1
                    return  # leaving the block closes the connection: the server aborts
        if done != 1 or usage != 1 or sorted(ends) != list(range(n)) or set(ends.values()) != {1}:
            self.books.error(f"stream {path}: [DONE] x{done}, usage x{usage}, choice ends "
                             f"{dict(ends)} for n={n}")

    async def hang_up(self, rng: random.Random) -> None:
        """A non-streaming call the client gives up on after `--hang-up-s`."""
        body = self._sampling(rng) | {"prompt": self._prompt(rng), "max_tokens": 300,
                                      "ignore_eos": True}
        timeout = httpx.Timeout(self.args.request_timeout_s, read=self.args.hang_up_s)
        try:
            r = await self.http.post("/v1/completions", json=body, timeout=timeout)
        except httpx.ReadTimeout:
            self.books.maybe_seqs += 1  # aborted by the server, or never read by it
            self.books.dropped += 1
            return
        if r.status_code != 200:
            return self.books.error(f"hang_up {r.status_code}: {r.text[:200]}")
        self.books.admitted_seqs += 1  # it finished before the client gave up
        self._finished(r.json()["choices"], 1, "hang_up")

    async def stop_strings(self, rng: random.Random) -> None:
        """Completions or chat, streaming or not, with stop strings (some 1024 characters
        long: held-back text is searched for their prefixes every step)."""
        stop = [rng.choice(["\n", " the", "()", ":", ".", "\n\n", "return"])
                for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.3:
            stop += ["".join(rng.choice("abc ()\n") for _ in range(1024))
                     for _ in range(rng.randint(1, 4))]
        n = rng.choice([1, 2])
        body = self._sampling(rng) | {"n": n, "stop": stop}
        chat = rng.random() < 0.4
        if chat:
            body["messages"] = [{"role": "user", "content": self._prompt(rng)}]
        else:
            body["prompt"] = self._prompt(rng)
            if rng.random() < 0.5:
                body["logprobs"] = rng.randint(0, 2)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        if rng.random() < 0.5:
            return await self._stream(path, body, n, rng, drop=False)
        r = await self.http.post(path, json=body)
        if r.status_code != 200:
            return self.books.error(f"stop_strings {r.status_code}: {r.text[:200]}")
        self.books.admitted_seqs += n
        choices = r.json()["choices"]
        self._finished(choices, n, "stop_strings")
        for c in choices:
            text = c["message"]["content"] if chat else c["text"]
            if any(s in (text or "") for s in stop):
                self.books.error(f"stop_strings: a stop string in the output {text!r}")

    async def invalid(self, rng: random.Random) -> None:
        """A request the server must refuse with a 4xx (and admit nothing of)."""
        path, body = rng.choice(INVALID)
        if body is None:
            r = await self.http.post(path, content=b"{not json",
                                     headers={"content-type": "application/json"})
        else:
            r = await self.http.post(path, json={"model": self.model} | body)
        self.books.refused[r.status_code] += 1
        if not 400 <= r.status_code < 500:
            self.books.error(f"invalid {path} {body}: {r.status_code}: {r.text[:200]}")

    async def abort(self, rng: random.Random) -> None:
        """/generate with its own rid, cancelled by /abort_request once it is in flight."""
        rid = f"soak-{rng.getrandbits(64):016x}"
        body = {"text": self._prompt(rng), "rid": rid,
                "sampling_params": {"max_new_tokens": 300, "ignore_eos": True,
                                    "temperature": 0}}
        call = asyncio.create_task(self.http.post("/generate", json=body))
        while not call.done():
            a = await self.http.post("/abort_request", json={"rid": rid})
            if a.status_code == 200:
                self.books.aborts_sent += 1
                break
            if a.status_code != 404:  # 404: not in flight yet (or already finished)
                self.books.error(f"abort_request {a.status_code}: {a.text[:200]}")
                break
            await asyncio.sleep(0.05)
        r = await call
        if r.status_code != 200:
            return self.books.error(f"generate {r.status_code}: {r.text[:200]}")
        self.books.admitted_seqs += 1
        self.books.finishes[r.json()["meta_info"]["finish_reason"]["type"]] += 1

    # ------------------------------------------------------------------ the controller
    async def controller(self, t0: float) -> None:
        """Flushes (and flips) while the clients run; takes the warm-up RSS sample."""
        a, next_flush = self.args, t0 + self.args.flush_every_s / 2
        next_flip = t0 + min(3.0, a.flip_every_s)
        warm_at = t0 + a.duration_s * a.warmup_fraction
        while not self.stop.is_set():
            now = time.monotonic()
            if "warm" not in self.rss and now >= warm_at and (
                    not self.flipping or self.flips_done >= 2):
                self.rss["warm"] = self.sample_rss()
            if now >= next_flush:
                await self.flush_quietly()
                next_flush = time.monotonic() + a.flush_every_s
            elif self.flipping and now >= next_flip:
                await self.flip()
                next_flip = time.monotonic() + a.flip_every_s
            else:
                await self.flush("busy")  # under load: refused (or ok, if it happened idle)
                await asyncio.wait([asyncio.ensure_future(self.stop.wait())], timeout=1.0)

    async def flush(self, when: str) -> None:
        r = await self.http.post("/flush_cache")
        if r.status_code == 200:
            self.books.flushes[f"ok ({when})"] += 1
        elif r.status_code == 400 and "cannot flush" in r.text:
            self.books.flushes[f"refused ({when})"] += 1
        else:
            self.books.error(f"flush_cache {r.status_code}: {r.text[:200]}")

    async def flush_quietly(self) -> None:
        self.quiet.set()
        try:
            end = time.monotonic() + 60
            while self.idle_clients < self.args.concurrency and time.monotonic() < end:
                await asyncio.sleep(0.05)
            await self.wait_idle(30)
            await self.flush("quiet")
        finally:
            self.quiet.clear()

    async def flip(self) -> None:
        target = self.layouts[(self.flips_done + 1) % 2]
        t = time.monotonic()
        r = await self.http.post("/admin/flip", json={"tp_size": target[0],
                                                      "pp_size": target[1]})
        if r.status_code == 200:
            self.flips_done += 1
            self.books.flips["ok"] += 1
            self.books.flip_s.append(time.monotonic() - t)
        else:
            self.books.flips[str(r.status_code)] += 1
            self.books.error(f"flip to {target}: {r.status_code}: {r.text[:200]}")

    async def wait_idle(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """/server_info once nothing runs or waits (or the deadline passed)."""
        end = time.monotonic() + timeout_s
        while True:
            info = (await self.http.get("/server_info")).json()
            if info.get("flip_in_progress") is None and (
                    info["running"] == 0 and info["waiting"] == 0 or time.monotonic() > end):
                return info
            await asyncio.sleep(0.2)

    async def sampler(self) -> None:
        while True:
            self.samples.append(self.sample_procs())
            await asyncio.sleep(self.args.sample_every_s)

    def sample_procs(self) -> dict[str, Any]:
        """Requests sent so far, and each process's VmRSS, open descriptors and threads."""
        out: dict[str, Any] = {"t": time.monotonic(), "requests": sum(self.books.sent.values())}
        if self.server_pid is None:
            return out
        engine = engine_pid(self.server_pid)
        for name, pid in (("front_end", self.server_pid), ("engine", engine)):
            if pid is not None:
                out[name] = {"rss": proc_rss_bytes(pid), "fds": open_fds(pid),
                             "threads": proc_status_count(pid, "Threads")}
        return out

    def sample_rss(self) -> dict[str, int | None]:
        if self.server_pid is None:
            return {"front_end": None, "engine": None}
        engine = engine_pid(self.server_pid)
        procs = {"front_end": [self.server_pid], "engine": [engine] if engine else [],
                 "worker_ranks": rank_pids(engine) if engine else []}
        out: dict[str, int | None] = {}
        for name, pids in procs.items():  # private RSS under the name, shared under _shmem
            mem = [private_rss_bytes(pid) for pid in pids]
            ok = mem and all(None not in m for m in mem)
            out[name] = sum(m[0] for m in mem) if ok else None
            out[name + "_shmem"] = sum(m[1] for m in mem) if ok else None
        out["worker_ranks_count"] = len(procs["worker_ranks"])  # the sample is not vacuous
        return out

    # ------------------------------------------------------------------ the verdict
    def verdict(self, before: dict, after: dict, idle: dict, load_s: float) -> dict[str, Any]:
        b, tol = self.books, self.args.rss_tolerance
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        ended = sum(v for k, v in delta.items() if k.startswith("finish:"))
        checks: dict[str, tuple[bool, str]] = {}
        checks["no unexpected answers"] = (not b.errors, f"{len(b.errors)} errors")
        checks["nothing lost"] = (
            b.admitted_seqs <= ended <= b.admitted_seqs + b.maybe_seqs,
            f"server ended {ended:.0f} sequences; clients: {b.admitted_seqs} admitted + up to "
            f"{b.maybe_seqs} hung up on")
        for reason, seen in b.finishes.items():
            if reason != "abort":
                checks[f"finish '{reason}' counted"] = (
                    delta.get(f"finish:{reason}", 0) >= seen,
                    f"server {delta.get(f'finish:{reason}', 0):.0f} >= clients {seen}")
        disconnects = delta.get("aborted:client_disconnect", 0)
        checks["aborts counted"] = (
            delta.get("aborted:abort_request", 0) == b.aborts_sent
            and delta.get("finish:abort", 0) >= b.finishes.get("abort", 0)
            and disconnects <= b.dropped,
            f"abort_request: server {delta.get('aborted:abort_request', 0):.0f}, clients "
            f"{b.aborts_sent}; client_disconnect: server {disconnects:.0f} <= clients "
            f"{b.dropped}")
        pool = idle["pool"]
        checks["accounting back to idle"] = (
            idle["running"] == 0 and idle["waiting"] == 0 and pool["balanced"]
            and pool["private"] == 0 and pool["protected"] == 0,
            f"running {idle['running']}, waiting {idle['waiting']}, pool {pool}")
        if self.flipping:
            checks["flips served"] = (b.flips["ok"] >= 2, f"{b.flips['ok']} flips")
        checks["a flush went through"] = (b.flushes["ok (quiet)"] >= 1, dict(b.flushes))
        warm, end = self.rss.get("warm", {}), self.rss.get("end", {})
        growth = {}
        workers = ("worker_ranks",) if warm.get("worker_ranks") else ()  # tp/pp only
        for proc in ("front_end", "engine", *workers):
            w, e = warm.get(proc), end.get(proc)
            growth[proc] = None if not w or not e else e / w - 1
            checks[f"{proc} RSS flat"] = (
                growth[proc] is not None and abs(growth[proc]) <= tol,
                "unmeasured" if growth[proc] is None
                else f"private {w / 2**20:.0f} -> {e / 2**20:.0f} MiB ({growth[proc]:+.1%}); "
                     f"shared {mib(warm.get(proc + '_shmem'))} -> "
                     f"{mib(end.get(proc + '_shmem'))} MiB")
        return {
            "duration_s": load_s, "concurrency": self.args.concurrency,
            "sent": dict(b.sent), "requests": sum(b.sent.values()),
            "admitted_seqs": b.admitted_seqs, "maybe_seqs": b.maybe_seqs,
            "server_ended": delta, "client_finishes": dict(b.finishes),
            "aborts_sent": b.aborts_sent, "dropped": b.dropped, "flushes": dict(b.flushes),
            "flips": dict(b.flips),
            "flip_s": b.flip_s, "rss": self.rss, "rss_growth": growth,
            "refused": dict(b.refused), "samples": self.samples,
            "idle": {"running": idle["running"], "waiting": idle["waiting"], "pool": pool},
            "errors": b.errors,
            "checks": {k: {"ok": ok, "detail": d} for k, (ok, d) in checks.items()},
            "ok": all(ok for ok, _ in checks.values()),
        }


# ------------------------------------------------------------------ launching
def launch(serve_args: str, deadline_s: float) -> tuple[subprocess.Popen, str]:
    from benchmarks.bench_serving import _free_port

    port = _free_port()
    cmd = [sys.executable, "-m", "phaseflip.cli", "serve", "--port", str(port), "--device",
           "cpu", "--check-accounting", *shlex.split(serve_args)]
    print("launching:", shlex.join(cmd), file=sys.stderr)
    proc = subprocess.Popen(cmd, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"the server was not healthy within {deadline_s:.0f} s")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration-s", type=float, default=600.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--base-url", help="an already running server (default: launch one)")
    ap.add_argument("--server-pid", type=int, help="its front end's pid (for the RSS checks)")
    ap.add_argument("--serve-args", default="", help="flags for the launched phaseflip serve")
    ap.add_argument("--api-key")
    ap.add_argument("--flush-every-s", type=float, default=30.0)
    ap.add_argument("--flip-every-s", type=float, default=20.0)
    ap.add_argument("--no-flips", action="store_true", help="no flips even with flips on")
    ap.add_argument("--hang-up-s", type=float, default=1.0,
                    help="how long a hanging-up client waits for a non-streaming answer")
    ap.add_argument("--request-timeout-s", type=float, default=300.0)
    ap.add_argument("--warmup-fraction", type=float, default=0.25,
                    help="the RSS baseline is taken after this share of the run")
    ap.add_argument("--rss-tolerance", type=float, default=0.05)
    ap.add_argument("--launch-timeout-s", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample-every-s", type=float, default=15.0,
                    help="how often to record each process's RSS, descriptors and threads")
    ap.add_argument("--out", help="write the result as JSON here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    proc = None
    if args.base_url:
        url, pid = args.base_url, args.server_pid
    else:
        proc, url = launch(args.serve_args, args.launch_timeout_s)
        pid = proc.pid
    try:
        result = asyncio.run(Soak(args, url, pid).run())
    finally:
        if proc is not None:
            from benchmarks.bench_serving import stop_server

            stop_server(proc)
    result = {"serve_args": args.serve_args, "args": vars(args), **result}
    print_result(result)
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
