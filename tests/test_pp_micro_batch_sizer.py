"""The PP prompt step's part count: the token rule until rank 0's own part times are fitted,
then the count that minimizes (m + p - 1) * (a + b * T / m)."""

from __future__ import annotations

import pytest

from phaseflip.distributed.micro_batch import (
    MIN_PARTS,
    MicroBatchSizer,
    pipeline_s,
    token_rule,
)


def feed(sizer: MicroBatchSizer, a: float, b: float, sizes=(256, 512, 1024, 2048)) -> None:
    for i in range(2 * MIN_PARTS):
        t = sizes[i % len(sizes)]
        sizer.observe(t, a + b * t)


def test_the_token_rule_stands_until_the_parts_are_measured():
    s = MicroBatchSizer(pp_size=2, min_tokens=1024)
    assert s.parts(4096) == token_rule(4096, 2, 1024) == 4
    assert s.parts(100) == 2 and s.parts(100_000) == 8
    for _ in range(MIN_PARTS - 1):
        s.observe(512, 0.01)
    assert s.fit() is None and s.snapshot()["rule"] == "tokens"


def test_a_large_fixed_cost_makes_fewer_larger_parts():
    """Ranks staging through the host: 50 ms a part, 10 us a token. A 4 096-token step the
    token rule cuts in 4 (5 part-times of 60 ms = 0.30 s) runs whole: 2 x 91 ms = 0.18 s."""
    s = MicroBatchSizer(pp_size=2, min_tokens=1024)
    feed(s, 0.05, 1e-5)
    a, b = s.fit()
    assert a == pytest.approx(0.05) and b == pytest.approx(1e-5)
    assert s.parts(4096) == 1
    assert pipeline_s(1, 4096, 2, a, b) < 0.65 * pipeline_s(4, 4096, 2, a, b)
    assert s.snapshot()["rule"] == "stage time"


def test_a_small_fixed_cost_cuts_as_finely_as_allowed():
    """Large matmuls on a GPU: 1 ms a part, 25 us a token: the optimum (~14 parts for 8 192
    tokens) is past the cap, so 4p, as the token rule says; a 200-token step in 2 (3 part-times
    of 3.5 ms against 4 of 2.7); and never parts under 64 tokens."""
    s = MicroBatchSizer(pp_size=2, min_tokens=1024)
    feed(s, 0.001, 2.5e-5)
    assert s.parts(8192) == 8 and s.parts(200) == 2
    s = MicroBatchSizer(pp_size=2, min_tokens=1024)
    feed(s, 1e-6, 2.5e-5)
    assert s.parts(200) == 3  # 200 // 64: the largest count with parts of 64+ tokens
    assert s.parts(103) == 2  # a mixed step's few tokens: still pp_size parts, as before
    assert s.parts(1) == 1


def test_a_window_that_is_no_cost_line_is_not_used_and_a_kept_fit_survives():
    s = MicroBatchSizer(pp_size=2, min_tokens=1024)
    for _ in range(2 * MIN_PARTS):
        s.observe(1000, 0.02)  # one size only: no line
    assert s.fit() is None
    s = MicroBatchSizer(pp_size=2, min_tokens=1024)
    feed(s, 0.5, -1e-4)  # cheaper with more tokens: not a cost
    assert s.fit() is None
    s = MicroBatchSizer(pp_size=2, min_tokens=1024)
    feed(s, 0.05, 1e-5)
    for _ in range(64):
        s.observe(4096, 0.05 + 1e-5 * 4096)  # the chosen size fills the window
    assert s.fit() == pytest.approx((0.05, 1e-5))


def test_the_part_count_rides_the_step_frame():
    import dataclasses

    from phaseflip.distributed.plan_codec import decode_frame
    from tests.test_plan_codec import _decode_step, _frame_bytes

    msg = dataclasses.replace(_decode_step(False), parts=5)
    assert decode_frame(_frame_bytes(msg)).parts == 5
    assert decode_frame(_frame_bytes(_decode_step(False))).parts == 0  # the token rule


def test_one_stall_does_not_poison_the_fit():
    """A compile or a preempted host (2 s on the H200) in one part: plain least squares over
    the window made every later 1 500-token step run whole (a = 55 ms); the stall is left out
    and the cut stays the best one (~sqrt(b T / a) = 6 parts)."""
    s = MicroBatchSizer(pp_size=2, min_tokens=1024)
    feed(s, 0.001, 2.5e-5, sizes=(375, 750, 1500))
    s.observe(750, 2.0)
    for _ in range(64):
        s.observe(1500, 0.001 + 2.5e-5 * 1500)
    assert s.parts(1500) == 6 and s.outliers == 1
    a, b = s.fit()
    assert a == pytest.approx(0.001) and b == pytest.approx(2.5e-5)


def test_stalls_in_a_row_are_new_costs_and_a_stale_fit_is_forgotten():
    s = MicroBatchSizer(pp_size=2, min_tokens=1024)
    feed(s, 0.001, 2.5e-5)
    for i in range(16):  # every part 10x dearer from now on (another tenant, a slower link)
        t = (256, 1024)[i % 2]
        s.observe(t, 10 * (0.001 + 2.5e-5 * t))
    assert s.fit() == pytest.approx((0.01, 2.5e-4))
    s.forget()
    assert s.fit() is None and s.parts(4096) == token_rule(4096, 2, 1024)


def test_a_negative_intercept_is_clamped_not_refused():
    """Prefill attention grows with the square of the prompt: the line's intercept can fall
    below zero; the fit goes through the origin instead of leaving the token rule for good."""
    s = MicroBatchSizer(pp_size=2, min_tokens=1024)
    for i in range(16):
        t = (512, 1024, 2048, 4096)[i % 4]
        s.observe(t, 1e-5 * t + 2e-9 * t * t)
    a, b = s.fit()
    assert a == 0.0 and b > 0
