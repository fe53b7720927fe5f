"""The flip policy's prefill rates as a fitted step cost, seconds = a + b·tokens (issue 17,
policy risk): a lone short step whose time is mostly fixed cost must not "measure" X and flip
the engine on background traffic; the fit recovers a and b; a rate from too little is
provisional (law 5) and no flip is decided on it."""

from __future__ import annotations

import pytest

from phaseflip.config import EngineConfig
from phaseflip.flip.policy import HALF, MEASURED, FlipPolicy
from phaseflip.flip.prefill_fit import EXTRAPOLATE, MIN_SAMPLES, MIN_TOKENS, fit_steps
from tests.test_flip_policy import AUTO, PP, TP, Clock, backlog, feed, measure, no_refill

# a staged tp2 on one shared GPU: seeds say pp2 prefills 4x faster, a seam costs 0.2 s
SEEDED = {"flip_seed_pp_speedup": 4.0, "flip_seed_to_pp_s": 0.2, "flip_seed_to_tp_s": 0.2,
          "max_prefill_tokens": 4096}


def policy(**over) -> FlipPolicy:
    return FlipPolicy(EngineConfig(**(AUTO | SEEDED | over)), None, Clock())


def test_a_lone_short_step_measures_no_rate_and_flips_nothing():
    """One 40-token prompt in a 0.4 s step (a step's fixed cost): as tokens ÷ seconds it was X
    = 100 tokens/s, `measured`, P = 400 by the seed, N = 0.4 / (1/100 - 1/400) = 53 tokens,
    and a 200-token background backlog flipped (red before the fit). Now X is provisional
    (half-measured, its note says what is missing) and nothing flips."""
    pol = policy()
    pol.observe_step(TP, 40, 0, 0.4)
    d = pol.decide(backlog(200), [], None)
    assert not d.flip and "not measured yet" in d.reason, d.reason
    x = pol.throughputs()[0]
    assert x.provenance == HALF and x.provenance != MEASURED and "provisional" in x.note
    assert d.numbers["X_tps"]["provenance"] == HALF
    snap = pol.snapshot()["estimates"]
    assert set(snap["prefill_tps"]["X"]) == {"value", "provenance", "samples", "note"}
    # a long run of such steps is still no price for a backlog's steps: 40 of them (1 600
    # tokens) with decode steps of 0.38 s between (the fixed cost a)
    for _ in range(40):
        pol.observe_step(TP, 40, 0, 0.4)
        pol.observe_step(TP, 0, 2, 0.38)
    d = pol.decide(backlog(3000), [], None)
    assert not d.flip and "past 4x" in d.reason, d.reason
    assert pol.rates[TP].describe()["how"] == "a from small steps"
    # the backlog's own first step (3 000 tokens, 1.88 s) prices it: a = 0.38 s, b = 500
    # µs/token, a 2000-token step X = 1449, P = 5797 (seed), N = 0.4 / (1/X - 1/P) = 773
    pol.observe_step(TP, 3000, 0, 0.38 + 3000 * 5e-4)
    d = pol.decide(backlog(2000), [], None)
    assert d.target == PP and d.numbers["X_tps"]["provenance"] == MEASURED, d.reason


def test_the_fit_recovers_fixed_and_per_token_cost():
    """Noiseless steps of 40 tokens in 0.4 s and 2000 in 0.6 s (a third on the same line):
    a = 0.3959 s, b = 102 µs/token, so a 4096-token step runs X = 4096 / (a + 4096 b) =
    5033 tokens/s. The EMA ratio made it 1 569 (every step's fixed cost charged per token)."""
    b = 0.2 / 1960
    a = 0.4 - 40 * b
    pol = policy(max_prefill_tokens=8192)
    for tokens in (40, 2000, 1000):
        pol.observe_step(TP, tokens, 0, a + b * tokens)
    fit = pol.rates[TP].fit()
    assert fit.fixed_s == pytest.approx(a, rel=0.1) and fit.per_token_s == pytest.approx(b,
                                                                                       rel=0.1)
    x = pol.throughputs(4096)[0]
    assert x.provenance == MEASURED and x.value == pytest.approx(4096 / (a + 4096 * b),
                                                                 rel=0.01)
    pol.decide(backlog(4096), [], None)  # a decision prices at the backlog's step
    assert pol.last.numbers["X_tps"]["value"] == pytest.approx(5033, rel=0.01)
    assert pol.snapshot()["estimates"]["prefill_step_tokens"] == 4096
    pol.decide(backlog(100_000), [], None)  # at most the scheduler's budget a step
    assert pol.step_tokens == 8192


def test_fit_constraints_and_fallbacks():
    """a ≥ 0 and b > 0: a line through negative a is refitted through 0; sizes that do not
    span a range take a from small steps (below their mean) or are a plain rate."""
    fit = fit_steps([(1000, 0.9), (3000, 3.1)])  # unconstrained a = -0.2
    assert fit.fixed_s == 0.0 and fit.per_token_s > 0 and fit.how == "fit through 0"
    fit = fit_steps([(100, 0.5), (400, 0.4)])  # b < 0: noise over the fixed cost
    assert fit.how == "rate" and fit.per_token_s == pytest.approx(0.9 / 500)
    fit = fit_steps([(100, 0.5), (120, 0.52)], fixed_s=0.3)
    assert fit.how == "a from small steps" and fit.seconds(110) == pytest.approx(0.51)
    assert fit_steps([(100, 0.5), (120, 0.52)], fixed_s=0.6).how == "rate"  # a above a step


def test_provisional_until_enough_steps_and_tokens():
    """MIN_SAMPLES steps and MIN_TOKENS tokens make a rate measured; not before, whatever
    the steps say, and a provisional P flips nothing either (no seed to stand in)."""
    assert (MIN_SAMPLES, MIN_TOKENS, EXTRAPOLATE) == (3, 1024, 4.0)
    pol = policy(flip_seed_pp_speedup=None, max_prefill_tokens=2048)
    feed(pol, TP, 1000)
    for tokens in (600, 600):
        pol.observe_step(PP, tokens, 0, tokens / 5000)
    p = pol.throughputs()[1]
    assert p.provenance == HALF and "2 of 3 steps" in p.note and "of 1024" not in p.note
    d = pol.decide(backlog(50_000), [], None)
    assert not d.flip and "P of tp1×pp2 provisional" in d.reason, d.reason
    pol.observe_step(PP, 100, 0, 100 / 5000)  # 3 steps, 1300 tokens
    assert pol.throughputs()[1].provenance == MEASURED
    assert pol.decide(backlog(50_000), [], None).target == PP
    # a step budget of 64 tokens (chunked prefill) runs a backlog in 64-token steps: three
    # of them price it as they ran (192 tokens, not 1024: a 576-token run would never have)
    small = policy(chunked_prefill_size=64)
    for _ in range(3):
        small.observe_step(TP, 64, 0, 0.02)
    x = small.throughputs()[0]
    assert x.provenance == MEASURED and x.value == pytest.approx(3200)
    assert small.decide(backlog(2000), [], None).target == PP  # N = 1707


def test_a_refill_is_not_priced_at_a_provisional_rate():
    """C is 'measured' once a refill is: not from re-prefilled tokens at a provisional rate
    (it stays the seam alone, half-measured)."""
    pol = policy(flip_seed_pp_speedup=None)
    feed(pol, TP, 1000)
    pol.observe_step(PP, 64, 0, 0.3)
    pol.observe_flip(TP, PP, 1.0)
    census = no_refill(TP, PP)
    census.refill_tokens_prefilled = 500
    pol.observe_refill(census)
    assert pol.flip_costs()[0].provenance == HALF
    measure(pol, 1000, 2000)
    pol.observe_refill(census)
    assert pol.flip_costs()[0].provenance == MEASURED


def run_ahead_steps(lag: int) -> list[tuple[int, int, float]]:
    """Lone prefill steps of 200-3000 tokens (a = 0.05 s, b = 100 µs/token) among decode steps
    (20 ms) and an idle step at the end, each step's wall time its own cost (lag 0) or, run
    ahead on a GPU, the cost of the step before (lag 1: the idle step waits out the last)."""
    steps = []
    for tokens in (200, 1000, 3000, 600, 2000):
        steps += [(0, 8)] * 5 + [(tokens, 0)]
    steps.append((0, 0))
    cost = [0.02 if p == 0 else 0.05 + 1e-4 * p for p, _ in steps]
    cost[-1] = 0.0  # (idle)
    secs = cost if lag == 0 else [0.02] + cost[:-1]
    return [(p, d, s + 1e-4) for (p, d), s in zip(steps, secs)]  # + the host's own time


@pytest.mark.parametrize("lag", [0, 1])
def test_run_ahead_charges_each_step_its_own_time(lag):
    """With overlap scheduling on a GPU a step's wall time is mostly the step before's, so a
    lone prefill step "took" a decode step's 20 ms (X ~100 000 tokens/s from 2 000 tokens) and
    the decode step after it the prefill's. The lag that explains the steps' times is found
    (0 on a synchronous device, 1 run ahead) and the fit recovers a and b either way."""
    pol = policy(max_prefill_tokens=4096)
    for p, d, s in run_ahead_steps(lag):
        pol.observe_step(TP, p, d, s)
    model = pol.rates[TP]
    assert model.lag() == lag and model.describe()["lag"] == lag
    fit = model.fit()
    assert fit.fixed_s == pytest.approx(0.05, rel=0.1)
    assert fit.per_token_s == pytest.approx(1e-4, rel=0.1)
    x = pol.throughputs(4096)[0]
    assert x.provenance == MEASURED and x.value == pytest.approx(4096 / 0.4596, rel=0.05)
    if lag:  # charged to itself, each lone prefill step looks almost free
        wrong = fit_steps(model.windows[0][0])
        assert wrong.rate_at(4096) > 3 * x.value
    pol.observe_flip(TP, PP, 0.2)  # a seam drains every step: the next pairs with none
    assert pol.rates[TP].prev is None
