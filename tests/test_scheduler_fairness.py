"""Fairness of the scheduler under mixed load (issue: scheduler audit), on the embedded model,
counted in steps: a long prompt in chunked prefill is not starved by a stream of short
requests; every step keeps `max_running_requests`, the prefill budget and every decode; a
retracted request is the newest and comes back before later arrivals with its unpressured
greedy output; aborted requests (waiting, mid-prefill, retracted) give their KV back and are
never scheduled again.
"""

from __future__ import annotations

import random

import pytest

from phaseflip import SamplingParams
from phaseflip.config import EMBEDDED_MODEL

pytestmark = pytest.mark.timeout(120, method="thread")


def greedy(max_new: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 1000) for _ in range(n)]


def spy_plans(sched) -> list[list]:
    """Records each step's items (request, start, tokens, prompt tokens) as the scheduler
    builds the plan (prompt: tokens computed before the request's next sample position)."""
    plans: list[list] = []
    build = sched._build

    def spy(items):
        plans.append([(it.req, it.start, it.extend_len,
                       it.extend_len if it.start + 1 < it.req.num_tokens else 0)
                      for it in items])
        return build(items)

    sched._build = spy
    return plans


def test_a_long_prompt_mid_prefill_is_not_starved_by_short_ones(make_engine):
    """A 100-token prompt (chunks of 32) arrives while a short request arrives every step.
    Its second chunk found the pool short, and each step the room the finished short ones
    gave back went to newer short ones admitted after it: it sat at 24 prefilled tokens for
    as long as the stream lasted (233 steps of a 250-step stream). A running request whose
    chunk does not fit now holds admission, so it takes the room as it frees."""
    engine = make_engine(EMBEDDED_MODEL, max_total_tokens=128, chunked_prefill_size=32,
                         enable_prefix_cache=False, overlap_schedule=False)
    core, rng = engine.core, random.Random(0)
    long_prompt = tokens(rng, 100)
    first: dict[str, int] = {}
    out: list[int] = []
    for step in range(90):
        if step < 80:
            core.add_request(f"s{step}", tokens(rng, 8), greedy(8))
        if step == 20:
            core.add_request("L", long_prompt, greedy(4))
        for d in core.step():
            if d.token_ids:
                first.setdefault(d.request_id, step)
            if d.request_id == "L":
                out += d.token_ids
    assert "L" in first, "the long prompt never got its prefill done"
    # 4 chunks: 8 steps with the room to wait for (it was never done before step 80)
    assert first["L"] - 20 <= 12, first["L"]
    while core.has_work():
        core.step()
    alone = engine.generate([long_prompt], [greedy(4)], use_tqdm=False)[0].token_ids
    assert out == alone


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_every_step_keeps_the_limits_and_preemption_is_fcfs(overlap, make_engine):
    """A burst of 40 mixed requests, two a step, with max_running_requests 5, chunks of 16
    under max_prefill_tokens 12, pages of 4 and a 200-token pool: at every step at most 5
    requests run, at most 12 prompt tokens are planned, and every request that was decoding
    is in the plan; each retraction takes the newest running request, and no request is
    admitted while an earlier one that was retracted waits; greedy outputs are those of an
    unpressured engine."""
    rng = random.Random(1)
    work = [(tokens(rng, rng.choice([3, 10, 30, 70])), greedy(rng.choice([1, 5, 20, 40])))
            for _ in range(40)]
    cfg = {"page_size": 4, "chunked_prefill_size": 16, "max_prefill_tokens": 12,
           "max_running_requests": 5, "overlap_schedule": overlap}

    def run(engine, check: bool) -> dict[str, list[int]]:
        core, sched = engine.core, engine.core.scheduler
        plans = spy_plans(sched)
        retract, admit = sched._retract, sched._admit

        def on_retract(req):
            assert req is sched.running[-1], "retracted a request that is not the newest"
            retract(req)

        def on_admit(items, budget, prefill):
            before = set(map(id, sched.running))
            admit(items, budget, prefill)
            for r in sched.running:
                if id(r) not in before:
                    late = [w.rid for w in sched.waiting if w.retractions
                            and w.arrival < r.arrival and not w.finished]
                    assert not late, f"{r.rid} admitted while retracted {late} wait"

        if check:
            sched._retract, sched._admit = on_retract, on_admit
        out: dict[str, list[int]] = {}
        i = step = 0
        while i < len(work) or core.has_work():
            for _ in range(2):
                if i < len(work):
                    core.add_request(f"r{i}", *work[i])
                    i += 1
            decoding = [r for r in sched.running if r.remaining == 1 and not r.pending]
            n = len(plans)
            for d in core.step():
                out.setdefault(d.request_id, []).extend(d.token_ids)
            step += 1
            assert step < 2000, "the burst did not drain"
            if not check or len(plans) == n:
                continue
            planned = plans[-1]
            assert len(sched.running) <= 5
            prompt = sum(p for _, _, _, p in planned)
            assert prompt <= 12, (step, prompt)
            ids = {id(r) for r, *_ in planned}
            skipped = [r.rid for r in decoding if r in sched.running and id(r) not in ids]
            assert not skipped, (step, skipped)
        return out

    pressured = make_engine(EMBEDDED_MODEL, max_total_tokens=200, **cfg)
    got = run(pressured, check=True)
    assert pressured.core.scheduler.stats.retractions > 0, "no pressure"
    assert got == run(make_engine(EMBEDDED_MODEL, **cfg), check=False)


def test_aborts_of_waiting_mid_prefill_and_retracted_requests_free_their_kv(make_engine):
    """A waiting request, one in the middle of its chunked prefill and every retracted one are
    aborted: the pool balances after every step, and no later plan holds any of them."""
    engine = make_engine(EMBEDDED_MODEL, max_total_tokens=160, page_size=4,
                         chunked_prefill_size=16)
    core, sched = engine.core, engine.core.scheduler
    plans = spy_plans(sched)
    rng = random.Random(3)
    for i in range(4):
        core.add_request(f"d{i}", tokens(rng, 10), greedy(60))
    core.add_request("L", tokens(rng, 100), greedy(4))
    core.add_request("W", tokens(rng, 10), greedy(4))
    aborted: dict[str, int] = {}  # request id -> plans made before its abort
    core.abort("W")
    aborted["W"] = len(plans)
    for step in range(2000):
        if not core.has_work():
            break
        long = [r for r in sched.running if r.rid == "L#0"]
        if "L" not in aborted and long and 0 < long[0].kv_len < 100:
            core.abort("L")
            aborted["L"] = len(plans)
        for r in list(sched.waiting):
            rid = r.rid.split("#")[0]
            if r.retractions and rid not in aborted:
                core.abort(rid)
                aborted[rid] = len(plans)
        core.step()
        assert sched.kv.accounting(sched.running).balanced, step
    assert not core.has_work()
    assert {"W", "L"} < set(aborted) and len(aborted) > 2, aborted  # a retracted one too
    for rid, n in aborted.items():
        later = [r.rid for plan in plans[n:] for r, *_ in plan if r.rid.startswith(rid)]
        assert not later, (rid, later)
