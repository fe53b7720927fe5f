"""/metrics against what was sent (issue: metrics audit): the HiCache page events under their
documented labels, the engine's own figures (running/waiting, KV usage, preemptions) mirrored
from its "info" answer, latency buckets that keep long requests out of +Inf, and the request
and token counters of a front end driven through every outcome.

The counter checks drive the real app against the scripted engine (`tests/fake_engine.py`);
the rest are unit checks of `ServerMetrics`. Milliseconds each.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from phaseflip.server.metrics import ServerMetrics
from tests.fake_engine import fake_server

pytestmark = pytest.mark.timeout(60, method="thread")

HICACHE_STATS = {
    "host_hit_tokens": 64, "disk_hit_tokens": 0, "bytes_written": 0, "bytes_loaded": 4096,
    "bytes_stored": 8192, "store_gbps": None, "load_gbps": None, "pages_written": 5,
    "miss_pages": 2, "corrupt_pages": 3, "host_evictions": 4, "disk_evictions": 6,
    "disk_writes_dropped": 7, "sync_writebacks": 8, "disk_write_failures": 9,
    "disk_read_errors": 10, "foreign_pages": 11,
}


def series(text: str, name: str) -> dict[tuple, float]:
    """`name`'s samples by their labels other than model_name (which must be "tiny")."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                assert s.labels.pop("model_name") == "tiny"
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def one(text: str, name: str, **labels: str) -> float | None:
    return series(text, name).get(tuple(sorted(labels.items())))


def test_hicache_page_events_carry_the_documented_labels():
    """`pages_written` was exported as event="pages_written" and `miss_pages` as "mis". Every
    page counter of the engine's `HiCacheStats` is exported."""
    from dataclasses import fields

    from phaseflip.scheduler.hicache_state import HiCacheStats

    assert {f.name for f in fields(HiCacheStats)} <= HICACHE_STATS.keys() | {
        "stores_in_flight", "loads_in_flight", "store_seconds", "load_seconds"}
    m = ServerMetrics("tiny")
    m.observe_hicache(HICACHE_STATS)
    pages = {dict(k)["event"]: v for k, v in series(m.render().decode(),
                                                     "phaseflip_hicache_pages_total").items()}
    assert pages == {"written": 5, "miss": 2, "corrupt": 3, "host_eviction": 4,
                     "disk_eviction": 6, "disk_writes_dropped": 7, "sync_writeback": 8,
                     "disk_write_failure": 9, "disk_read_error": 10, "foreign": 11}


def test_engine_info_sets_gauges_and_preemptions():
    """The engine's "info" answer is exact at the scrape: running/waiting, KV usage and its
    retraction count (as vLLM's num_preemptions_total); a mid-flip answer changes nothing."""
    m = ServerMetrics("tiny")
    assert one(m.render().decode(), "phaseflip_num_preemptions_total") is None  # unmeasured
    info = {"running": 3, "waiting": 2, "scheduler": {"retractions": 7},
            "pool": {"total": 100, "free": 50, "evictable": 10, "protected": 15,
                     "private": 25, "withheld": 0}, "hicache": HICACHE_STATS}
    m.observe_engine(info)
    m.observe_engine({"flip_in_progress": "tp1×pp2"})
    text = m.render().decode()
    assert one(text, "phaseflip_num_requests_running") == 3
    assert one(text, "phaseflip_num_requests_waiting") == 2
    assert one(text, "phaseflip_token_usage") == pytest.approx(0.4)
    assert one(text, "phaseflip_num_preemptions_total") == 7
    assert one(text, "phaseflip_hicache_hit_tokens_total", tier="host") == 64
    m.observe_engine(info | {"running": 0, "waiting": 0})
    text = m.render().decode()
    assert one(text, "phaseflip_num_requests_running") == 0
    assert one(text, "phaseflip_num_requests_waiting") == 0


@pytest.mark.parametrize("seconds", [0.0015, 300.0, 1800.0])
def test_latency_buckets_resolve_fast_tokens_and_long_requests(seconds):
    """A 1.5 ms token (a small model's decode on a GPU) and a 5 or 30 minute request (a long
    output) each land in a finite bucket of their own, not with everything below 5 ms or in
    +Inf."""
    m = ServerMetrics("tiny")
    m.e2e.observe(seconds)
    buckets = {float(dict(k)["le"]): v for k, v in series(
        m.render().decode(), "phaseflip_e2e_request_latency_seconds_bucket").items()}
    finite = sorted(le for le in buckets if le != float("inf"))
    holding = [le for le in finite if buckets[le] == 1]
    assert holding, f"{seconds} s is in +Inf only (largest bucket {finite[-1]})"
    lower = [le for le in finite if le < holding[0]]
    assert lower and lower[-1] >= seconds / 4, (seconds, holding[0], lower[-1:])


def asgi(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def test_counters_match_what_was_sent(tmp_path):
    """Finished and rejected requests: sequences by finish reason, prompt and generated
    tokens, one TTFT and e2e per engine request, and nothing for a 400. (The scripted engine
    has no n > 1; `/metrics` of n > 1 was checked by hand against a real server.)"""
    body = {"model": "tiny", "max_tokens": 3}

    async def go() -> str:
        async with fake_server(tmp_path) as (ctx, app, _engine), asgi(app) as c:
            ok = await c.post("/v1/completions", json=body | {"prompt": [[1, 2, 3], [4, 5]]})
            assert ok.status_code == 200, ok.text
            one_more = await c.post("/v1/completions", json=body | {"prompt": [7, 8]})
            assert one_more.status_code == 200, one_more.text
            bad = await c.post("/v1/completions", json=body | {"prompt": "x", "max_tokens": -1})
            assert bad.status_code == 400
            return ctx.metrics.render().decode()

    text = asyncio.run(go())
    assert series(text, "phaseflip_requests_total") == {(("finish_reason", "length"),): 3}
    assert one(text, "phaseflip_prompt_tokens_total") == 3 + 2 + 2
    assert one(text, "phaseflip_generation_tokens_total") == 3 * 3
    assert one(text, "phaseflip_time_to_first_token_seconds_count") == 3
    assert one(text, "phaseflip_e2e_request_latency_seconds_count") == 3
    assert one(text, "phaseflip_inter_token_latency_seconds_count") == 3 * 2
    assert all(v == 0 for v in series(text, "phaseflip_aborted_requests_total").values())


def _scripted(ctx, deltas_by_step: list[list], gap_s: float) -> None:
    """`ctx.engine.generate` replaced by one yielding `deltas_by_step`, `gap_s` apart."""
    async def generate(rid, prompt_ids, params):
        for step in deltas_by_step:
            await asyncio.sleep(gap_s)
            for d in step:
                yield d

    ctx.engine.generate = generate


def test_inter_token_latency_is_per_sample(tmp_path):
    """With n > 1 the samples' tokens of one step come one after the other: a "last token"
    time shared by the samples measured the microseconds between them (n=4: 150 of 199
    observations under 1 ms), not the steps' gaps."""
    from phaseflip.engine.outputs import StreamDelta, Usage
    from phaseflip.sampling.params import SamplingParams

    steps = [[StreamDelta("r", i, "a", [64]) for i in range(4)] for _ in range(4)]
    steps[-1] = [StreamDelta("r", i, "a", [64], finish_reason="length") for i in range(4)]
    steps[-1][-1].usage = Usage(2, 16, 0)

    async def go() -> list[float]:
        async with fake_server(tmp_path) as (ctx, _app, _engine):
            _scripted(ctx, steps, 0.02)
            async for _ in ctx.run("r", [1, 2], SamplingParams(n=4, max_new_tokens=4)):
                pass
            return [s.value for s in ctx.metrics.itl.collect()[0].samples
                    if s.name.endswith("_bucket") and s.labels["le"] == "0.005"]

    assert asyncio.run(go()) == [0.0]  # every gap is a step's (20 ms), none between samples


def test_a_joined_delta_is_one_gap_then_none(tmp_path):
    """A stream that fell behind gets its waiting deltas as one (`StreamDelta.joined`): the
    histogram still counts one observation a token after the first, as delivered — the gap
    before the delta, then 0 for each further token. Red before: one observation a delta (the
    gap divided by its tokens), so the count hung on the front end's lag (a loaded CI box made
    `test_counters_match_what_was_sent` count 0 instead of 6)."""
    from phaseflip.engine.outputs import StreamDelta, Usage
    from phaseflip.sampling.params import SamplingParams

    steps = [[StreamDelta("r", 0, "aa", [64, 64])],
             [StreamDelta("r", 0, "aaa", [64] * 3, finish_reason="length",
                          usage=Usage(2, 5, 0))]]

    async def go() -> tuple[float, float, float]:
        async with fake_server(tmp_path) as (ctx, _app, _engine):
            _scripted(ctx, steps, 0.02)
            async for _ in ctx.run("r", [1, 2], SamplingParams(max_new_tokens=5)):
                pass
            samples = ctx.metrics.itl.collect()[0].samples
            fast = next(s.value for s in samples
                        if s.name.endswith("_bucket") and s.labels["le"] == "0.005")
            count = next(s.value for s in samples if s.name.endswith("_count"))
            total = next(s.value for s in samples if s.name.endswith("_sum"))
            return count, fast, total

    count, fast, total = asyncio.run(go())
    assert count == 5 - 1 and fast == 3  # the 20 ms gap, then three tokens delivered with it
    assert 0.015 < total < 1.0


def test_a_request_left_after_its_prefill_counts_its_prompt(tmp_path):
    """A client gone before the last delta (disconnect, shutdown) counted the tokens it was
    sent but never its prompt: prompt_tokens_total only moved with the usage message."""
    from phaseflip.engine.outputs import StreamDelta
    from phaseflip.sampling.params import SamplingParams

    steps = [[StreamDelta("r", 0, "a", [64], cached_tokens=16)], [StreamDelta("r", 0, "a", [64])]]

    async def go() -> str:
        async with fake_server(tmp_path) as (ctx, _app, _engine):
            _scripted(ctx, steps, 0.0)
            stream = ctx.run("r", list(range(40)), SamplingParams(max_new_tokens=8))
            await stream.__anext__()
            await stream.aclose()  # the client went away
            return ctx.metrics.render().decode()

    text = asyncio.run(go())
    assert one(text, "phaseflip_prompt_tokens_total") == 40
    assert one(text, "phaseflip_generation_tokens_total") == 1


def _gc_pauses(text: str) -> dict[str, float]:
    return {s.labels["generation"]: s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "phaseflip_frontend_gc_pause_seconds_count"}


def test_collector_passes_are_timed_while_watched_and_the_heap_frozen():
    import gc

    metrics = ServerMetrics("tiny")
    assert _gc_pauses(metrics.render().decode()) == {"0": 0, "1": 0, "2": 0}
    with metrics.collector_watched():
        assert gc.get_freeze_count() > 0
        gc.collect()
    assert gc.get_freeze_count() == 0  # thawed on the way out
    gc.collect()  # not counted: the hook is gone
    assert _gc_pauses(metrics.render().decode())["2"] == 1


def test_a_collector_pass_under_a_metrics_lock_does_not_deadlock():
    """A pass can start while this thread holds a prometheus_client lock (not reentrant):
    its scrape copies a family's children under the family's lock. A hook that observed a
    prometheus histogram took such a lock and hung there; ours takes none."""
    import gc
    import threading

    metrics = ServerMetrics("tiny")
    locks = [c._lock for c in metrics.registry._collector_to_names if hasattr(c, "_lock")]
    assert locks
    done = threading.Event()

    def pass_under_locks() -> None:
        for lock in locks:
            lock.acquire()
        try:
            gc.collect()
        finally:
            for lock in locks:
                lock.release()
        done.set()

    with metrics.collector_watched():
        threading.Thread(target=pass_under_locks, daemon=True).start()
        assert done.wait(10), "a collector pass under the metrics' locks hung"
    assert _gc_pauses(metrics.render().decode())["2"] >= 1
