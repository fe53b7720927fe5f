"""The flip simulator and its workload (issue 17): seeded traces, step models fitted to what
they were made from, a replay through the real scheduler that serves every token exactly once,
the real policy flipping on a burst and back, and no thrash on bursts that alternate faster
than a flip pays."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from phaseflip.config import EngineConfig
from phaseflip.flip import sim
from phaseflip.flip import workload as wl

ROOT = Path(__file__).resolve().parent.parent
TP, PP = (2, 1), (1, 2)
SMALL = wl.WorkloadSpec(duration_s=12.0, seed=3, background_rps=4.0, burst_every_s=5.0,
                        burst_requests=8, burst_prefix_tokens=256, burst_suffix_tokens=512,
                        burst_output_tokens=4, background_output_tokens=24)
# a CPU-like pair: the prefill layout prefills 3x faster, decodes 2x slower
MODELS = {TP: sim.LinearStepModel(0.004, 3e-4, 4e-4), PP: sim.LinearStepModel(0.008, 1e-4, 8e-4)}
BASE = {"page_size": 16, "max_running_requests": 64, "chunked_prefill_size": 1024}


def auto_cfg(**over) -> EngineConfig:
    return EngineConfig(**(BASE | {"tp_size": 2, "enable_flip": True, "enable_hicache": True,
                                   "flip_policy": "auto", "flip_seed_pp_speedup": 3.0,
                                   "flip_seed_to_pp_s": 0.2, "flip_seed_to_tp_s": 0.2,
                                   "flip_min_dwell_s": 0.5} | over))


def replay(trace, cfg: EngineConfig, schedule=None) -> sim.SimResult:
    return sim.simulate(trace, cfg, MODELS, kv_slots=16384, seam_s=lambda a, b: 0.2,
                        refill_s_per_token=1e-6, schedule=schedule)


def test_the_workload_is_seeded_and_shaped_like_an_agent_fleet(tmp_path):
    a, b = wl.generate(SMALL), wl.generate(SMALL)
    assert a == b and a != wl.generate(SMALL.scaled(seed=4))
    assert [x.t_s for x in a] == sorted(x.t_s for x in a)
    bursts = [x for x in a if x.kind == "burst"]
    groups = {x.group for x in bursts}
    assert len(groups) >= 1 and len(bursts) == 8 * len(groups)
    for g in groups:  # one shared prefix per burst, unique suffixes
        members = [x.prompt_ids for x in bursts if x.group == g]
        assert len({m[:256] for m in members}) == 1 and len({m[256:] for m in members}) == 8
    assert 0 < wl.prefill_share(a) < 1
    path = tmp_path / "trace.json"
    wl.save_trace(a, path)
    assert wl.load_trace(path) == a


def test_a_linear_step_model_is_fitted_back_from_its_own_steps():
    truth = sim.LinearStepModel(0.003, 2e-5, 5e-4, 1e-7)
    samples = [(p, d, c, truth.seconds(p, d, c)) for p, d, c in
               [(1024, 0, 0), (512, 4, 800), (0, 16, 9000), (0, 1, 100), (200, 30, 12000)]]
    got = sim.LinearStepModel.fit(samples)
    for a, b in zip(vars(got).values(), vars(truth).values()):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-12)
    # a negative coefficient is dropped, not kept
    neg = sim.LinearStepModel.fit([(100, 0, 0, 0.01), (200, 0, 0, 0.005), (0, 4, 0, 0.002)])
    assert min(vars(neg).values()) >= 0


def test_static_replays_serve_every_token_once_and_faster_prefill_shows():
    trace = wl.generate(SMALL)
    want = sum(a.max_new_tokens for a in trace)
    for lay in (TP, PP):
        res = replay(trace, EngineConfig(**(BASE | {"tp_size": lay[0], "pp_size": lay[1]})))
        assert sum(len(r.token_s) for r in res.requests) == want
        assert all(len(r.token_s) == r.output_tokens for r in res.requests)
        assert not res.flips and set(res.busy_s) == {sim.layout_name(lay)}
    s = replay(trace, EngineConfig(**(BASE | {"tp_size": 2}))).summary()
    json.dumps(s, allow_nan=False)


def test_the_real_policy_flips_on_a_burst_and_back_when_idle_or_served():
    trace = wl.generate(SMALL)
    res = replay(trace, auto_cfg())
    assert res.flips and res.flips[0]["target"] == "tp1×pp2"
    assert len(res.flips) % 2 == 0  # it ends where the decode traffic wants it: TP
    assert sum(len(r.token_s) for r in res.requests) == sum(a.max_new_tokens for a in trace)
    assert set(res.busy_s) == {"tp2×pp1", "tp1×pp2"}
    # a policy that is told PP is no faster never flips
    assert not replay(trace, auto_cfg(flip_seed_pp_speedup=0.9, flip_min_dwell_s=1e9)).flips


def test_alternating_bursts_faster_than_the_break_even_do_not_make_it_thrash():
    """Bursts every 1.5 s, each below the break-even once its shared prefix is cached: the
    oracle (best of static and flipping on every burst) stays put, and auto flips no more."""
    from benchmarks.flip_map import BurstSchedule

    spec = SMALL.scaled(alternate=True, burst_every_s=1.5, burst_requests=4,
                        burst_prefix_tokens=512, burst_suffix_tokens=64, duration_s=9.0)
    trace = wl.generate(spec)
    cfg = auto_cfg(flip_seed_to_pp_s=1.0, flip_seed_to_tp_s=1.0)
    static = replay(trace, EngineConfig(**(BASE | {"tp_size": 2})))
    groups = {a.group for a in trace if a.kind == "burst"}
    flipping = replay(trace, EngineConfig(**(vars(cfg) | {"flip_policy": "manual"})),
                      BurstSchedule(trace, groups, TP, PP))
    assert len(flipping.flips) >= 2 * len(groups) - 1  # the schedule did flip per burst
    best = min((static, flipping), key=lambda r: sum(r.busy_s.values()) + r.seam_s)
    assert best is static  # flipping per burst costs more than it saves
    assert len(replay(trace, cfg).flips) <= len(best.flips) == 0


def test_the_analytic_model_is_calibrated_on_the_measured_h200_steps():
    """Fitted to the tp1/tp2/pp2 bench_latency JSON of llama-3.1-8b: every measured prefill
    within 25 %, and the shape the map rests on: over a 25 GB/s link pp2 prefills faster than
    tp2, over NVLink (368 GB/s) not; tp2 decodes faster than pp2 on both."""
    names = ["latency_llama8b.json", "multi_gpu/latency_llama8b_tp2.json",
             "multi_gpu/latency_llama8b_pp2.json"]
    results = [json.loads((ROOT / "docs/results/2026-11-29" / n).read_text()) for n in names]
    ref = sim.link(368.0)
    gpu = sim.calibrate_gpu(results, sim.LLAMA_8B, ref)
    for res in results:
        tp, pp = res.get("tp_size", 1), res.get("pp_size", 1)
        model = sim.AnalyticStepModel(sim.LLAMA_8B, gpu, ref, tp, pp)
        for p, d, c, sec in sim.samples_from_json(res)[sim.layout_name((tp, pp))]:
            if p >= 65536:
                assert model.seconds(p, d, c) == pytest.approx(sec, rel=0.25), (tp, pp, p)
    for gbps, pp_faster in ((25, True), (368, False)):
        link = sim.link(gbps)
        tp2, pp2 = (sim.AnalyticStepModel(sim.LLAMA_8B, gpu, link, *lay) for lay in (TP, PP))
        assert (pp2.seconds(16384, 0, 0) < tp2.seconds(16384, 0, 0)) is pp_faster
        assert tp2.seconds(0, 64, 64 * 2048) < pp2.seconds(0, 64, 64 * 2048)


def test_the_scaled_simulator_compares_per_token_costs_like_for_like():
    """A server whose steps cost 2x per token (same fixed cost) scales the sim's prompt
    token cost 2x. X is priced at a 2048-token step (a + b·S) since the fitted policy:
    divided into the calibration's plain tokens ÷ seconds it gave 1.22 (the fixed costs mixed
    in). A result from the EMA policy (no fit in its snapshot) keeps the plain ratio."""
    from benchmarks.flip_workload_sim import calib_rate, server_scales

    a, b = 0.1, 1e-4
    calib = {"steps": {"tp2×pp1": [{"prompt_tokens": t, "decode_rows": 0, "ctx_tokens": 0,
                                    "seconds": a + b * t} for t in (256, 512, 1024, 2048)]}}
    x = 2048 / (a + 2 * b * 2048)
    pol = {"layouts": {"decode": "tp2×pp1", "prefill": "tp1×pp2"},
           "estimates": {"prefill_tps": {"X": {"value": x, "provenance": "measured"}},
                         "prefill_step_fit": {"X": {"fixed_s": a, "per_token_s": 2 * b}}}}
    run = {"run": "tp2", "policy": pol, "config": {"tp_size": 2, "pp_size": 1}}
    assert server_scales([run], calib)[(2, 1)] == pytest.approx(2.0, rel=1e-6)
    assert not server_scales([run | {"run": "auto"}], calib)  # auto is what is checked
    del pol["estimates"]["prefill_step_fit"]  # a result from before the fit
    assert server_scales([run], calib)[(2, 1)] == pytest.approx(
        calib_rate(calib, "tp2×pp1") / x)


def test_the_engine_calls_the_flip_observer_as_its_protocol_declares():
    """`EngineCore.step` passes on_step five arguments (the decode groups last): the
    protocol and its implementation both take them, by the names the engine's call uses."""
    import ast
    import inspect

    from phaseflip.engine import core
    from phaseflip.flip.host import FlipObserver
    from phaseflip.flip.telemetry import FlipTelemetry

    calls = [n for n in ast.walk(ast.parse(inspect.getsource(core)))
             if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "on_step"]
    assert calls
    for impl in (FlipObserver.on_step, FlipTelemetry.on_step):
        sig = inspect.signature(impl)
        for call in calls:
            sig.bind(None, *call.args, **{k.arg: None for k in call.keywords})
        assert list(sig.parameters)[1:] == ["layout", "prompt_tokens", "decode_tokens",
                                            "seconds", "decode_groups"]


def test_one_step_of_the_size_priced_measures_the_rate_and_a_shorter_one_does_not():
    """A burst's first full-budget step (8192 tokens) is the step its backlog runs in: it
    prices X as it ran, so the flip is not held 2 more TP steps (3 steps were asked: 8B on 4
    GPUs over 25 GB/s fell to 1.29x, 70B to 0.945 of the oracle). A 2048-token step prices a
    2048-token backlog, not an 8192-token step's (law 5: still provisional, no flip)."""
    from types import SimpleNamespace

    from phaseflip.flip.policy import MEASURED, FlipPolicy

    def backlog(tokens: int) -> list:
        return [SimpleNamespace(rid="w", kv_len=0, num_tokens=tokens, all_ids=[1] * tokens)]

    cfg = auto_cfg(chunked_prefill_size=8192, max_prefill_tokens=16384, flip_min_dwell_s=0)
    pol = FlipPolicy(cfg)
    pol.observe_step(TP, 2048, 0, 2048 / 5000)
    assert pol.throughputs(2048)[0].provenance == MEASURED
    assert pol.throughputs(8192)[0].provisional
    d = pol.decide(backlog(40_000), [], None)
    assert not d.flip and "provisional" in d.reason, d.reason
    pol.observe_step(TP, 8192, 0, 8192 / 5000)
    assert pol.decide(backlog(40_000), [], None).target == PP  # N = 3000


def test_an_auto_run_is_replayed_from_the_layout_it_launched_in():
    """`config` is read from /server_info after the run, in the layout the run ended in: an
    auto run that ended in pp2 was simulated from pp2, and its first simulated flip (to tp2 at
    0.07 s, the idle flip back) was one the server never made."""
    from benchmarks.flip_workload_sim import simulate_run
    from phaseflip.flip import workload as wl

    spec = wl.WorkloadSpec(duration_s=4.0, burst_every_s=10.0, background_rps=2.0,
                           background_prompt_tokens=8, background_output_tokens=4, seed=1)
    trace = wl.generate(spec)
    steps = {name: [{"prompt_tokens": t, "decode_rows": r, "ctx_tokens": 0,
                     "seconds": 0.01 + 1e-5 * t + 1e-3 * r}
                    for t, r in ((0, 1), (0, 4), (64, 0), (512, 2), (2048, 0))]
             for name in ("tp2×pp1", "tp1×pp2")}
    calib = {"steps": steps, "seams": [
        {"source": "tp2×pp1", "target": "tp1×pp2", "seconds": 0.1},
        {"source": "tp1×pp2", "target": "tp2×pp1", "seconds": 0.1}]}
    config = {"tp_size": 1, "pp_size": 2, "enable_flip": True, "flip_policy": "auto",
              "flip_layouts": "tp2,pp2", "enable_hicache": True}
    run = {"run": "auto", "config": config, "kv_capacity_tokens": 4096,
           "timeline": [{"t_s": 0.04, "layout": "tp2×pp1"}, {"t_s": 3.0, "layout": "tp1×pp2"}]}
    out = simulate_run(run, calib, trace)
    assert out["layout_timeline"][0][1] == "tp2×pp1"
