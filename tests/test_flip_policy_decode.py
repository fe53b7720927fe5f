"""The flip policy's way back to the decode layout: the decode SLO, and the check that the
decode layout really decodes faster (`flip/decode_cost.py`), on a simulated clock."""

from __future__ import annotations

import pytest

from tests.test_flip_policy import PP, TP, Clock, backlog, measure, policy, req


def test_decode_slo_sends_the_prefill_layout_back_on_a_full_window():
    clock = Clock()
    pol = policy(clock=clock, flip_seed_to_pp_s=1.0, flip_seed_to_tp_s=1.0,
                 flip_decode_slo_ms=50.0, flip_min_dwell_steps=0)
    measure(pol, 1000, 2000)
    pol.observe_flip(TP, PP, 1.0)
    for _ in range(12):  # steps that also prefill a chunk are slow for their prompt: a
        pol.observe_step(PP, 512, 4, 0.3)  # backlog being served must not trip the SLO
    assert not pol.decide(backlog(20_000), [], None).flip
    for _ in range(8):
        assert not pol.decide(backlog(20_000), [], None).flip  # a window not full yet
        pol.observe_step(PP, 0, 4, 0.08)
    d = pol.decide(backlog(20_000), [], None)
    assert d.target == TP and "--flip-decode-slo-ms" in d.reason
    assert d.numbers["decode_step_ms"]["value"] == pytest.approx(80)


def test_decode_slo_counts_every_decode_group_of_a_round():
    """With PP decode groups in flight a step decodes one group, so a request's next token
    comes D steps later: 8 steps of 30 ms with 2 groups are 60 ms a token, over a 50 ms SLO
    (read per step, the SLO never tripped)."""
    clock = Clock()
    pol = policy(clock=clock, flip_seed_to_pp_s=1.0, flip_seed_to_tp_s=1.0,
                 flip_decode_slo_ms=50.0, flip_min_dwell_steps=0)
    measure(pol, 1000, 2000)
    pol.observe_flip(TP, PP, 1.0)
    for _ in range(8):
        pol.observe_step(PP, 0, 4, 0.03, decode_groups=2)
    d = pol.decide(backlog(20_000), [], None)
    assert d.target == TP and d.numbers["decode_step_ms"]["value"] == pytest.approx(60)



def test_a_served_prefill_layout_stays_when_it_decodes_faster_than_the_decode_layout():
    """Going back assumes the decode layout decodes faster. Two ranks sharing one GPU decode
    ~12x faster in pp2 than in tp2 (staged TP through the host): measured at a comparable
    batch, the prefill layout stays, busy or idle; unmeasured or not clearly faster, it goes
    back as before."""
    clock = Clock()
    pol = policy(clock=clock, flip_seed_to_pp_s=1.0, flip_seed_to_tp_s=1.0,
                 flip_min_dwell_steps=0)
    measure(pol, 1000, 2000)
    for _ in range(4):
        pol.observe_step(TP, 0, 3, 0.097)  # tp2: 97 ms a step at 3 rows
    pol.observe_flip(TP, PP, 1.0)
    assert pol.decide([], [], None).target == TP  # pp2's decode unmeasured: back
    pol.observe_flip(TP, PP, 1.0)
    for _ in range(4):
        pol.observe_step(PP, 0, 2, 0.0083)  # pp2: 8.3 ms at 2 rows (same bucket, 2-3)
    d = pol.decide([], [], None)
    assert d.target is None and "decodes faster" in d.reason
    assert d.numbers["decode_here_vs_back"] == {"here_ms": 8.3, "there_ms": 97.0,
                                                "rows": "2-3"}
    running = [req(f"r{i}", [1, 2]) for i in range(3)]
    assert pol.decide([], running, None).target is None  # busy, same answer
    many = [req(f"m{i}", [1, 2]) for i in range(64)]  # a batch neither measured: no
    assert pol.decide([], many, None).target == TP  # comparison, the premise stands
    pol.observe_step(PP, 0, 3, 0.5)  # a graph captured after a seam: the median ignores it
    assert pol.decide([], running, None).target is None
    for _ in range(16):  # pp2 only 5 % faster now: not clearly, so back
        pol.observe_step(PP, 0, 2, 0.092)
    assert pol.decide([], running, None).target == TP


def test_decode_steps_at_other_batch_sizes_bound_the_comparison():
    """On one H200 a served burst left pp2 decoding 8-15 rows (7.4 ms a step) while tp2 had
    only decoded the background's 1-7 (85 ms): no shared bucket, so auto went back to tp2
    after every burst. A step is no cheaper with more rows and no dearer than its rows run as
    smaller steps, so each layout's steps bound the other buckets: pp2 at 2-3 rows bounds its
    step at 8-15 by 8 x 7.4 = 59 ms, under tp2's 85 ms at 4-7; the bounds never claim more."""
    from phaseflip.flip.decode_cost import DecodeCosts

    clock = Clock()
    pol = policy(clock=clock, flip_seed_to_pp_s=1.0, flip_seed_to_tp_s=1.0,
                 flip_min_dwell_steps=0)
    measure(pol, 1000, 2000)
    for _ in range(4):
        pol.observe_step(TP, 0, 5, 0.085)  # tp2: 85 ms at 5 rows (bucket 4-7)
    pol.observe_flip(TP, PP, 1.0)
    for _ in range(8):
        pol.observe_step(PP, 0, 13, 0.0074)  # pp2: 7.4 ms at 13 rows (bucket 8-15)
    running = [req(f"r{i}", [1, 2]) for i in range(5)]
    for busy in (running, []):  # busy at 5 rows (monotone), and idle (at 8-15)
        d = pol.decide([], busy, None)
        assert d.target is None and "decodes faster" in d.reason
        assert d.numbers["decode_here_vs_back"]["there_rows"] == "4-7"
    costs = DecodeCosts()
    for _ in range(4):
        costs.observe(PP, 2, 7.4)  # pp2 measured only at 2-3 rows
        costs.observe(TP, 5, 85.0)
    c = costs.compare(PP, TP, 13)  # a burst of 13: pp2 <= ceil(15 / 2) x 7.4 = 59.2 ms
    assert c.here_faster and c.here_ms == pytest.approx(59.2) and c.here_rows == "2-3"
    assert not costs.compare(PP, TP, 40).here_faster  # 32-63 rows: <= 32 x 7.4, no claim
    costs = DecodeCosts()
    for _ in range(4):
        costs.observe(PP, 2, 7.4)
        costs.observe(TP, 13, 60.0)  # tp2 only at 8-15: at 2-3 it is >= 60 / ceil(15/2)
    c = costs.compare(PP, TP, 2)
    assert c.there_ms == pytest.approx(7.5) and not c.here_faster  # 7.4 is not clearly
