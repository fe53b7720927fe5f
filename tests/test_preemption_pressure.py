"""The scheduler under KV pressure (issue: preemption audit), on the embedded model: a burst of
mixed requests in a pool too small for them, some aborted mid-flight, retracts requests and
still gives every one its unpressured greedy output, ends each exactly once, and hands the
whole pool back; the figures it reports (HiCache misses, retractions as /metrics'
preemptions) count admissions, not attempts.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from phaseflip import SamplingParams
from phaseflip.config import EMBEDDED_MODEL
from phaseflip.server.metrics import ServerMetrics

pytestmark = pytest.mark.timeout(120, method="thread")

HICACHE = {"enable_hicache": True, "hicache_host_gb": 0.01, "hicache_page_size": 16}


def greedy(max_new: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 1000) for _ in range(n)]


def test_a_request_waiting_for_room_counts_one_hicache_miss(make_engine):
    """B waits ~20 steps for A's room. Each step tried to admit it, found the pool short and
    put it back: every try counted a miss (23 for two admissions)."""
    engine = make_engine(EMBEDDED_MODEL, max_total_tokens=128, page_size=4, **HICACHE)
    rng = random.Random(0)
    a, b = tokens(rng, 100), tokens(rng, 40)
    engine.generate([a, b], [greedy(20), greedy(5)], use_tqdm=False)
    assert engine.core.scheduler.stats.retractions == 0
    assert engine.core.scheduler.stats.steps > 20  # (B did wait)
    assert engine.core.hicache.stats.miss_pages == 2  # one for each admission


def burst(seed: int, n: int) -> list[tuple[list[int], SamplingParams, int | None]]:
    """(prompt, params, abort after this many steps or None): greedy, seeded n > 1, stop ids
    and logprobs, prompts of 3 to 90 tokens."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = {"temperature": 0.0, "max_new_tokens": rng.choice([1, 8, 30, 60]),
             "ignore_eos": True}
        kind = i % 4
        if kind == 1:
            p.update(n=2, temperature=0.8, seed=100 + i)
        elif kind == 2:
            p.update(logprobs=1, stop_token_ids=[rng.randrange(10, 1000)])
        abort = rng.randrange(2, 20) if i % 5 == 3 else None
        out.append((tokens(rng, rng.choice([3, 20, 50, 90])), SamplingParams(**p), abort))
    return out


def run_burst(engine, work) -> dict[tuple[str, int], tuple[list[int], str]]:
    """Adds three requests a step, aborts those due; returns each sample's (tokens, finish
    reason), checking each request ended once, with its usage."""
    core, ends, usages = engine.core, {}, set()
    streamed: dict[tuple[str, int], list[int]] = {}
    pending, aborts, step = list(enumerate(work)), {}, 0

    def take(deltas) -> None:
        for d in deltas:
            key = (d.request_id, d.index)
            streamed.setdefault(key, []).extend(d.token_ids)
            if d.finish_reason is not None:
                assert key not in ends, f"{key} ended twice"
                ends[key] = d.finish_reason
            if d.usage is not None:
                assert d.request_id not in usages, f"{d.request_id}: two usages"
                usages.add(d.request_id)

    while pending or core.has_work():
        for i, (prompt, params, abort) in pending[:3]:
            core.add_request(f"r{i}", prompt, params)
            if abort is not None:
                aborts[f"r{i}"] = step + abort
        del pending[:3]
        for rid in [r for r, at in aborts.items() if at <= step]:
            take(core.abort(rid))
            del aborts[rid]
        take(core.step())
        step += 1
        assert step < 5000, "the burst did not drain"
    assert usages == {f"r{i}" for i in range(len(work))}
    assert set(ends) == {(f"r{i}", k) for i, (_, p, _) in enumerate(work) for k in range(p.n)}
    return {k: (streamed[k], ends[k]) for k in ends}


@pytest.mark.parametrize("cfg", [
    pytest.param({"max_total_tokens": 192, "page_size": 4, "chunked_prefill_size": 16,
                  **HICACHE}, id="hicache-page4-chunked"),
    pytest.param({"max_total_tokens": 160, "overlap_schedule": False}, id="page1-sync"),
])
def test_burst_under_pressure_loses_nothing_and_returns_the_pool(cfg, make_engine):
    work = burst(seed=1, n=14)
    reference = run_burst(make_engine(EMBEDDED_MODEL), [(p, s, None) for p, s, _ in work])
    engine = make_engine(EMBEDDED_MODEL, **cfg)
    got = run_burst(engine, work)
    stats = engine.core.scheduler.stats
    assert stats.retractions > 0, "the pool is too large to force preemption"
    for key, (ids, finish) in got.items():
        want_ids, want_finish = reference[key]
        if finish == "abort":  # cut short: what it produced is the start of its answer
            assert ids == want_ids[: len(ids)], key
        else:
            assert (ids, finish) == (want_ids, want_finish), key
    acc = engine.pool_accounting()
    assert acc.free + acc.evictable == acc.total and acc.private == acc.protected == 0, acc
    metrics = ServerMetrics("tiny")  # the engine's figure, under /metrics' name
    metrics.observe_engine({"scheduler": dataclasses.asdict(stats)})
    assert f'phaseflip_num_preemptions_total{{model_name="tiny"}} {stats.retractions:.1f}' in (
        metrics.render().decode())
