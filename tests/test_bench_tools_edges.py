"""The figures of benchmarks/bench_serving.py and bench_offline.py against an independent count:
a scripted stream (no server) whose every send and receive time is recorded, so TTFT, ITL,
TPOT, E2E, the run's duration and the arrival schedule can be recomputed from the raw times."""

from __future__ import annotations

import asyncio
import json
import math
import time

import numpy as np
import pytest

from benchmarks import bench_offline, bench_serving
from benchmarks.common import percentile, summarize

REAL_SLEEP = asyncio.sleep  # the fake server's own waits (some tests make the client's late)


def _token(text: str = "x", finish: str | None = None) -> str:
    return json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": finish}]})


def _usage(n: int) -> str:
    return json.dumps({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": n}})


class FakeClient(bench_serving._Client):
    """Streams `script(i, payload)` for the i-th request: (delay s, SSE data) pairs, or an
    exception to raise; logs when each request was sent and each line came back."""

    name = "fake"

    def __init__(self, script) -> None:
        self.script, self.log = script, []

    async def lines(self, url, payload):
        rec = {"max_tokens": payload["max_tokens"], "sent": time.perf_counter(), "recv": []}
        self.log.append(rec)
        for delay, data in self.script(len(self.log) - 1, payload):
            if delay:
                await REAL_SLEEP(delay)
            if isinstance(data, Exception):
                raise data
            rec["recv"].append(time.perf_counter())
            yield data


def _plain(n: int, gap_s: float = 0.002):
    """n one-token chunks `gap_s` apart, the usage, [DONE]."""
    return [(gap_s, _token()) for _ in range(n)] + [(0, _usage(n)), (0, "[DONE]")]


def _run(monkeypatch, client: FakeClient, argv: list[str]) -> dict:
    monkeypatch.setattr(bench_serving, "make_client", lambda *a: client)

    async def no_info(*a):
        return {}

    monkeypatch.setattr(bench_serving, "_server_info", no_info)
    args = bench_serving.parse_args(["--served-model-name", "m", "--base-url", "http://fake",
                                     "--dataset", "fixed", "--input-len", "4", *argv])
    return asyncio.run(asyncio.wait_for(bench_serving.run_benchmark(args, args.base_url), 30))


def _gaps(seed: int, rate: float, n: int) -> np.ndarray:
    """The seeded inter-arrival draws run_benchmark makes."""
    return np.random.default_rng(seed + 17).exponential(1.0 / rate, size=n)


@pytest.mark.timeout(30, method="thread")
def test_duration_runs_from_the_first_send_to_the_last_receive(monkeypatch) -> None:
    """The first request goes at once: no idle lead-in (the first draw, 0.39 s at 4 req/s,
    seed 0) inside `duration_s`, which every throughput figure divides by."""
    client = FakeClient(lambda i, p: _plain(p["max_tokens"]))
    data = _run(monkeypatch, client, ["--request-rate", "4", "--num-prompts", "3",
                                      "--output-len", "2"])
    assert data["completed"] == 3
    first_send = min(r["sent"] for r in client.log)
    last_recv = max(r["recv"][-1] for r in client.log)
    assert data["duration_s"] == pytest.approx(last_recv - first_send, abs=0.03)
    sends = np.diff(sorted(r["sent"] for r in client.log))
    assert sends == pytest.approx(_gaps(0, 4, 3)[1:], abs=0.03)  # the drawn gaps between sends


@pytest.mark.timeout(30, method="thread")
def test_arrivals_keep_the_asked_rate_when_wake_ups_are_late(monkeypatch) -> None:
    """A loop busy with streams wakes each sleep late (here 8 ms): the schedule must not
    push every later arrival back by the sum of those delays (39 × 8 ms over a 0.8 s run)."""
    async def late_sleep(delay, *a, **kw):
        return await REAL_SLEEP(delay + 0.008, *a, **kw)

    monkeypatch.setattr(asyncio, "sleep", late_sleep)
    client = FakeClient(lambda i, p: _plain(1, 0))
    data = _run(monkeypatch, client, ["--request-rate", "50", "--num-prompts", "40",
                                      "--output-len", "1"])
    assert data["completed"] == 40
    sends = sorted(r["sent"] for r in client.log)
    intended = _gaps(0, 50, 40)[1:].sum()
    assert sends[-1] - sends[0] == pytest.approx(intended, abs=0.04)


@pytest.mark.timeout(30, method="thread")
def test_infinite_rate_sends_everything_at_once(monkeypatch) -> None:
    client = FakeClient(lambda i, p: _plain(2, 0.05))
    data = _run(monkeypatch, client, ["--num-prompts", "8", "--output-len", "2"])
    sends = sorted(r["sent"] for r in client.log)
    assert data["request_rate"] == "inf" and data["completed"] == 8
    assert sends[-1] - sends[0] < 0.04  # all out before the first answer's first token


@pytest.mark.timeout(30, method="thread")
def test_latencies_match_the_raw_times(monkeypatch) -> None:
    """TTFT, ITL, TPOT and E2E recomputed from the recorded times. Request 0: 4 chunks, one
    with empty text (half of a split character still is a token event); request 1: one token
    (TPOT undefined: left out, not 0); request 2: usage says 6 tokens in 4 chunks (TPOT per
    token from usage, ITL one per chunk); request 3: no usage chunk (chunks counted); request
    4: HTTP error; request 5: broken mid-stream; request 6: short of its max_tokens. Failures
    count under `failed`, out of every latency and throughput figure."""
    chunks4 = [(0.004, _token("a")), (0.003, _token("")), (0.006, _token("é")),
               (0.002, _token("b", "length"))]
    scripts = {
        0: (4, chunks4 + [(0, _usage(4)), (0, "[DONE]")]),
        1: (1, [(0.003, _token("z", "length")), (0, _usage(1)), (0, "[DONE]")]),
        2: (6, chunks4 + [(0, _usage(6)), (0, "[DONE]")]),
        3: (4, chunks4 + [(0, "[DONE]")]),
        4: (4, [(0.001, RuntimeError("HTTP 500: boom"))]),
        5: (4, chunks4[:2] + [(0.001, ConnectionResetError("gone"))]),
        6: (4, chunks4[:3] + [(0, _usage(3)), (0, "[DONE]")]),
    }
    client = FakeClient(lambda i, p: scripts[i][1])

    async def run_all() -> list:
        out = []
        for i in range(len(scripts)):  # one at a time: the gaps are the script's
            out.append(await bench_serving.one_request(
                client, "http://fake/v1/completions", "m", [1, 2, 3, 4], scripts[i][0], 0.0))
        return out

    results = asyncio.run(asyncio.wait_for(run_all(), 20))
    args = bench_serving.parse_args(["--served-model-name", "m", "--request-rate", "inf"])
    data = bench_serving._metrics(args, "m", "fake", results, duration=2.0)
    assert [r.ok for r in results] == [True] * 4 + [False] * 3
    assert (data["completed"], data["failed"], data["output_tokens"]) == (4, 3, 4 + 1 + 6 + 4)
    assert data["requests_per_s"] == 4 / 2.0 and data["output_tokens_per_s"] == 15 / 2.0
    assert "RuntimeError: HTTP 500: boom" in data["errors"]

    ttft, itl, tpot, e2e = [], [], [], []
    for i in range(4):
        rec = client.log[i]
        events = [t for t, (_, d) in zip(rec["recv"], scripts[i][1]) if '"text"' in d]
        ttft.append(events[0] - rec["sent"])
        e2e.append(events[-1] - rec["sent"])
        itl += list(np.diff(events))
        tokens = scripts[i][0]
        if tokens > 1:
            tpot.append((e2e[-1] - ttft[-1]) / (tokens - 1))
    for key, raw in (("ttft_s", ttft), ("itl_s", itl), ("tpot_s", tpot), ("e2e_s", e2e)):
        s = data[key]
        assert s["n"] == len(raw), key
        for q in ("mean", "p50", "p90", "p99"):  # 1 ms: the client reads its clock after ours
            ref = float(np.mean(raw)) if q == "mean" else percentile(raw, float(q[1:]))
            assert s[q] == pytest.approx(ref, abs=1e-3), (key, q)
    assert data["tpot_s"]["n"] == 3 and data["itl_s"]["n"] == 3 * 3


def test_percentiles_are_numpys_linear_and_empty_is_nan() -> None:
    xs = [0.004, 0.001, 0.010, 0.002, 0.0035]
    s = summarize(xs)
    for q in (50, 90, 99):
        assert s[f"p{q}"] == pytest.approx(float(np.percentile(xs, q, method="linear")))
    assert s["p50"] == 0.0035 and s["n"] == 5
    empty = summarize([])
    assert empty["n"] == 0 and all(math.isnan(empty[k]) for k in ("mean", "p50", "p99"))
    assert math.isnan(percentile([], 50))


@pytest.mark.timeout(120, method="thread")
def test_offline_clock_leaves_the_samplers_start_out(monkeypatch, tmp_path) -> None:
    """`duration_s` times `generate` only: a GPU-busy sampler that takes 0.5 s to start (its
    nvidia-smi child) must not be in it."""
    from phaseflip import Engine
    from phaseflip.config import EMBEDDED_MODEL

    class SlowStart(bench_offline.GpuBusySampler):
        def __enter__(self):
            time.sleep(0.5)
            return super().__enter__()

    spans = []
    generate = Engine.generate

    def timed(self, *a, **kw):
        t = time.perf_counter()
        try:
            return generate(self, *a, **kw)
        finally:
            spans.append(time.perf_counter() - t)

    monkeypatch.setattr(bench_offline, "GpuBusySampler", SlowStart)
    monkeypatch.setattr(Engine, "generate", timed)
    data = bench_offline.main(["--model", str(EMBEDDED_MODEL), "--device", "cpu",
                               "--num-prompts", "2", "--dataset", "fixed", "--input-len", "4",
                               "--output-len", "2", "--num-warmup", "0"])
    r = data["phaseflip"]
    assert r["complete"] is True and r["output_tokens"] == 4 and len(spans) == 1
    assert spans[0] <= r["duration_s"] < spans[0] + 0.1


@pytest.mark.timeout(30, method="thread")
@pytest.mark.parametrize("extra, one_wave", [
    ([], True), (["--max-concurrency", "2"], False), (["--request-rate", "100"], False)])
def test_compare_splits_itls_at_the_last_first_token_only_for_one_wave(monkeypatch, extra,
                                                                        one_wave) -> None:
    """`itl_split` cuts each request's gaps at the latest TTFT, taking every request as sent
    at once: with later waves (a concurrency limit below --num-prompts) or spread arrivals,
    prompts keep prefilling past that cut, so its "decode-only" rows would be no such thing."""
    from pathlib import Path

    async def flushed(*a):
        return 0

    monkeypatch.setattr(bench_serving, "_flush_cache", flushed)
    monkeypatch.setattr(bench_serving, "make_client", lambda *a: FakeClient(
        lambda i, p: [(0.002, _token("{}")), (0.002, _token("", "stop")), (0, _usage(2)),
                      (0, "[DONE]")]))

    async def no_info(*a):
        return {}

    monkeypatch.setattr(bench_serving, "_server_info", no_info)
    schema = str(Path(bench_serving.__file__).parent / "schemas" / "flat.json")
    args = bench_serving.parse_args([
        "--served-model-name", "m", "--base-url", "http://fake", "--dataset", "fixed",
        "--input-len", "4", "--output-len", "2", "--num-prompts", "4", "--json-schema", schema,
        "--compare-unconstrained", *extra])
    data = asyncio.run(asyncio.wait_for(bench_serving.run_compare(
        args, args.base_url, bench_serving.response_format_of(schema)), 20))
    assert data["unconstrained"]["completed"] == data["constrained"]["completed"] == 4
    assert bool(data["itl_split"]) is one_wave
    assert (data["decode_itl_p50_ratio"] is not None) is one_wave
    assert data["itl_p50_ratio"] is not None  # the pooled ratio stands either way
