"""bench_flip_workload's harness and its calibration (flip_calibration.py), issue 17: the time
budget that lets a one-shot GPU run stop cleanly with its JSON written (a run that cannot fit
is skipped, one that overruns is cut and keeps what it finished), the calibration's shape
(unrecorded warm-ups, output cap, the return to the decode layout on one batch), its child
process and seeds, and the simulator check. No server, no model: the HTTP
client, the server launch and the engine are fakes."""

from __future__ import annotations

import asyncio
import json
import math
import time
from types import SimpleNamespace

import pytest

from benchmarks import bench_flip_workload as bfw
from benchmarks import flip_calibration as fc
from benchmarks.bench_serving import RequestResult
from phaseflip.flip import workload as wl

SPEC = ["--duration-s", "6", "--alternate", "--burst-every-s", "2", "--burst-requests", "4",
        "--burst-prefix-tokens", "32", "--burst-suffix-tokens", "16", "--background-rps", "2"]


def args(*extra: str):
    return bfw.parse_args([*SPEC, *extra])


def trace_of(a) -> list[wl.Arrival]:
    return bfw.make_trace(a)


# ---------------------------------------------------------------------- the time budget
def test_a_run_that_cannot_fit_the_budget_is_skipped_without_a_launch(monkeypatch):
    def no_launch(*_a, **_k):
        raise AssertionError("launched a server the budget cannot hold")

    monkeypatch.setattr(bfw, "launch_server", no_launch)
    a = args("--launch-estimate-s", "30", "--reserve-s", "10")
    trace = trace_of(a)
    got = bfw.serve_run("tp2", a, trace, None, bfw.Budget(30.0))  # needs ~30 + 5.x + 10 s
    assert got["run"] == "tp2" and "time budget" in got["skipped"]
    # a measured launch replaces the estimate
    got = bfw.serve_run("tp2", a, trace, None, bfw.Budget(60.0), launch_s=50.0)
    assert "skipped" in got


class FakeInfo:
    """httpx.AsyncClient for /v1/models and /server_info."""

    def __init__(self, *_a, **_k) -> None:
        self.busy_s = 0.0

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    async def get(self, url: str):
        if not url.endswith("/v1/models"):
            self.busy_s += 0.5  # each /server_info finds the engine 0.5 s busier
        body = ({"data": [{"id": "m"}]} if url.endswith("/v1/models") else
                {"running": 0, "waiting": 0, "flip_policy": {"flips": 2, "layout": "tp2×pp1"},
                 "config": {"tp_size": 2, "pp_size": 1}, "pool": {"total": 4096},
                 "busy_s": self.busy_s})
        return SimpleNamespace(json=lambda: body)


class NullClient:
    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False


def fake_http(monkeypatch, slow_after_s: float) -> None:
    """Requests sent before `slow_after_s` finish at once; later ones hang."""
    import httpx

    async def one_request(_client, _url, _model, prompt, max_tokens, _temp):
        if time.perf_counter() - t0 > slow_after_s:
            await asyncio.sleep(3600)
        return RequestResult(prompt_len=len(prompt), target_len=max_tokens, ok=True,
                             output_tokens=max_tokens, ttft=0.001, e2e=0.002)

    t0 = time.perf_counter()
    monkeypatch.setattr(httpx, "AsyncClient", FakeInfo)
    monkeypatch.setattr(bfw, "make_client", lambda *_a: NullClient())
    monkeypatch.setattr(bfw, "one_request", one_request)


def test_a_replay_past_its_limit_is_cut_and_keeps_what_finished(monkeypatch):
    a = args()
    trace = [replace_t(x, 0.0) for x in trace_of(a)[:3]] + [replace_t(x, 0.2)
                                                             for x in trace_of(a)[3:6]]
    fake_http(monkeypatch, slow_after_s=0.1)
    t0 = time.monotonic()
    got = asyncio.run(asyncio.wait_for(  # the test's own deadline: a hang fails
        bfw.replay("http://x", trace, poll_s=0.05, timeout_s=0.5), 10))
    assert time.monotonic() - t0 < 5  # the hanging requests were cancelled, not awaited
    assert got["cut"] is True
    run = bfw.summarize_run("tp2", got)
    assert run["cut"] is True and run["ok"] == 3 and run["requests"] == 6
    assert run["flips"] == 2
    finished = sum(len(x.prompt_ids) + x.max_new_tokens for x in trace[:3])
    assert run["throughput_tps"] == pytest.approx(finished / run["seconds"])  # only finished
    polls = len(got["timeline"]) + 1  # the samples and the final /server_info after busy0
    assert run["busy_s"] == pytest.approx(0.5 * polls)
    assert run["busy_tps"] == pytest.approx(finished / run["busy_s"])
    assert any("cut" in e for e in run["errors"])


def replace_t(a: wl.Arrival, t: float) -> wl.Arrival:
    from dataclasses import replace

    return replace(a, t_s=t)


def test_a_clean_replay_is_not_cut(monkeypatch):
    trace = [replace_t(x, 0.0) for x in trace_of(args())[:4]]
    fake_http(monkeypatch, slow_after_s=60)
    got = asyncio.run(asyncio.wait_for(bfw.replay("http://x", trace, poll_s=0.05), 10))
    assert got["cut"] is False and all(r.ok for _, r in got["results"])


def test_main_writes_the_json_after_every_run_and_simulates_no_cut_run(monkeypatch, tmp_path):
    out = tmp_path / "r.json"
    seen: list[int] = []

    def serve_run(run, a, trace, calib, budget, launch_s):
        if out.exists():
            seen.append(len(json.loads(out.read_text())["runs"]))
        if run == "pp2":
            return {"run": run, "skipped": "time budget: 1 s left"}
        return {"run": run, "requests": 1, "ok": 1, "cut": True, "seconds": 1.0,
                "throughput_tps": 10.0, "e2e_mean_s": 1.0, "ttft_p50_s": 0.1,
                "ttft_p99_s": 0.1, "itl_p50_s": 0.1, "itl_p99_s": 0.1, "flips": 0,
                "seam_s_recent": 0.0, "timeline": [], "policy": {}, "config": {},
                "timing": {"launch_s": 5.0, "replay_s": 1.0, "stop_s": 1.0}}

    monkeypatch.setattr(bfw, "serve_run", serve_run)
    monkeypatch.setattr(fc, "calibrate_isolated", lambda argv, limit: {
        "steps": {"tp2×pp1": []}, "seams": []})
    res = bfw.main([*SPEC, "--runs", "tp2,pp2,tp2", "--out", str(out),
                    "--time-budget-s", "100"])
    assert seen == [0, 1, 2]  # written after the calibration and after each run
    assert [r.get("sim_skipped") for r in bfw.served(res)] == ["run cut", "run cut"]
    assert res["sim_check"] == [] and res["timing"]["total_s"] < 100
    assert json.loads(out.read_text())["runs"][1]["skipped"].startswith("time budget")


def test_a_failed_calibration_is_recorded_and_the_runs_go_on(monkeypatch, tmp_path):
    def broken(*_a):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(fc, "calibrate_isolated", broken)
    monkeypatch.setattr(bfw, "serve_run", lambda run, a, t, calib, b, ls: {
        "run": run, "error": f"calib {calib}"})
    res = bfw.main([*SPEC, "--runs", "tp2", "--out", str(tmp_path / "r.json")])
    assert "out of memory" in res["calibration_error"]
    assert res["runs"] == [{"run": "tp2", "error": "calib None"}]
    assert "calibration_s" in json.loads((tmp_path / "r.json").read_text())["timing"]


def test_the_calibration_child_is_killed_past_its_limit_with_what_it_spawned(tmp_path):
    import os
    import sys

    pid_file = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(120)']); open(sys.argv[1], 'w').write(str(p.pid)); "
            "time.sleep(120)")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        fc.run_child([sys.executable, "-c", code, str(pid_file)], tmp_path / "none.json", 2.0)
    assert time.monotonic() - t0 < 30
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10  # a rank the calibration spawned goes with it
    while time.monotonic() < deadline:
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the child's own child outlived the kill")


def test_the_calibration_child_hands_back_its_json_or_its_failure(tmp_path):
    import sys

    out = tmp_path / "c.json"
    code = f"import json; json.dump({{'steps': {{}}, 'seams': []}}, open({str(out)!r}, 'w'))"
    assert fc.run_child([sys.executable, "-c", code], out, 30) == {"steps": {}, "seams": []}
    with pytest.raises(RuntimeError, match="code 3"):
        fc.run_child([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "x.json", 30)


def test_the_calibration_module_does_not_import_the_benchmark():
    """The dependency goes one way (the benchmark imports its calibration): the child runs
    the benchmark by name, never an import of it."""
    import subprocess
    import sys

    code = ("import sys, benchmarks.flip_calibration; "
            "print('benchmarks.bench_flip_workload' in sys.modules)")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert got.stdout.strip() == "False"


def test_calibrate_only_writes_the_calibration_and_nothing_else(monkeypatch, tmp_path):
    # main looks `calibrate` up in its own module's names (imported from flip_calibration)
    monkeypatch.setattr(bfw, "calibrate", lambda a, t: {"steps": {"tp2×pp1": []},
                                                          "seams": []})
    monkeypatch.setattr(bfw, "serve_run", lambda *a: pytest.fail("served in calibrate-only"))
    bfw.main([*SPEC, "--out", str(tmp_path / "r.json"), "--calibrate-only",
              str(tmp_path / "c.json")])
    assert json.loads((tmp_path / "c.json").read_text())["seams"] == []
    assert not (tmp_path / "r.json").exists()


# ---------------------------------------------------------------------- calibration
class FakeCore:
    """Steps every queued request to its end in one step; records what it was given."""

    def __init__(self) -> None:
        self.cfg = SimpleNamespace(tp_size=2, pp_size=1)
        self.scheduler = SimpleNamespace(stats=SimpleNamespace(prefill_tokens=0,
                                                               decode_tokens=0), running=[])
        self.queued: list[tuple[str, int, int]] = []
        self.log: list[tuple] = []

    def add_request(self, rid, ids, params):
        self.queued.append((rid, len(ids), params.max_new_tokens))
        self.log.append(("add", rid, tuple(ids[:4]), params.max_new_tokens))

    def has_work(self):
        return bool(self.queued)

    def step(self):
        s = self.scheduler.stats
        s.prefill_tokens += sum(n for _, n, _ in self.queued)
        s.decode_tokens += len(self.queued)
        self.queued.clear()

    def flip(self, tp, pp):
        src = fc.layout_name((self.cfg.tp_size, self.cfg.pp_size))
        self.cfg.tp_size, self.cfg.pp_size = tp, pp
        self.log.append(("flip", tp, pp))
        census = SimpleNamespace(total_s=0.1, as_dict=lambda: {
            "source": src, "target": fc.layout_name((tp, pp))})
        return census, []


def test_calibration_warms_each_layout_unrecorded_caps_outputs_and_returns_on_one_batch(
        monkeypatch):
    import phaseflip

    core = FakeCore()

    opened = []

    class FakeEngine:  # Engine's own signature: the model comes once, by position or name
        def __init__(self, model=None, **config):
            opened.append((model, config))
            self.core = core

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(phaseflip, "Engine", FakeEngine)
    a = args("--calib-bursts", "6", "--calib-background", "6", "--calib-max-new-tokens", "3",
             "--background-output-tokens", "20",
             "--serve-args", "--model llama-3.1-8b --load-format dummy --page-size 16")
    trace = trace_of(a)
    calib = fc.calibrate(a, trace)
    (model, config), = opened  # the server's --model is the engine's model
    assert model == "llama-3.1-8b" and config["load_format"] == "dummy"
    flips = [e[1:] for e in core.log if e[0] == "flip"]
    assert flips == [(1, 2), (2, 1), (1, 2), (2, 1)]  # warm pp2, warm tp2, the two recorded
    adds = [e for e in core.log if e[0] == "add"]
    warm = [e for e in adds if e[1].startswith("warm")]
    assert len(warm) == 6 and all(e[3] == 2 for e in warm)
    starts = {tuple(x.prompt_ids[:4]) for x in trace}
    assert not starts & {e[2] for e in warm}  # warm-up ids share no prefix with the trace
    assert len({e[2] for e in warm if e[1].endswith("-0")}) == 2  # nor with each other
    batches = {e[1].rsplit("-", 1)[0] for e in adds if not e[1].startswith("warm")}
    assert batches == {"c0-0", "c0-1", "c0-2", "c1-0", "c1-1", "c1-2", "c2-0"}
    assert max(e[3] for e in adds) <= 3  # capped (the trace's background asks 20)
    starts_of = {}  # each visit prefills its own ids; a burst's shared prefix stays shared
    for e in adds:
        starts_of.setdefault(e[1].rsplit("-", 1)[0], []).append(e[2])
    assert len(set(starts_of["c0-1"][:4])) == 1 == len(set(starts_of["c1-1"][:4]))
    assert not set(starts_of["c0-1"]) & set(starts_of["c1-1"])
    assert not set(starts_of["c0-0"]) & (set(starts_of["c1-0"]) | set(starts_of["c2-0"]))
    assert len(starts_of["c0-0"]) == 6 and len(starts_of["c0-1"]) == 4 + 2  # bursts: 2/3
    recorded = sum(len(v) for v in calib["steps"].values())
    assert recorded == 7  # one step a batch; the warm-ups are not recorded
    assert [(s["source"], s["target"]) for s in calib["seams"]] == [
        ("tp2×pp1", "tp1×pp2"), ("tp1×pp2", "tp2×pp1")]


# ---------------------------------------------------------------------- the check
def run_with(flips: int, sim_flips: int, tps: float, sim_tps: float) -> dict:
    return {"run": "auto", "ok": 1, "requests": 1, "seconds": 1.0, "ttft_p50_s": 0.1,
            "ttft_p99_s": 0.1, "itl_p50_s": 0.1, "itl_p99_s": 0.1, "seam_s_recent": 0.0,
            "flips": flips, "throughput_tps": tps, "e2e_mean_s": 1.0,
            "sim": {"flips": sim_flips, "throughput_tps": sim_tps, "e2e_mean_s": 1.1},
            "sim_scaled": None}



def test_the_seed_speedup_is_taken_at_the_servers_prefill_step():
    """The policy prices X and P at the server's step S from a fitted a + b·tokens: the seed
    ratio is taken there too. tp2: 0.1 s + 1 ms a token, pp2: 0.03 s + 0.1 ms; at S = 2048
    P/X is 2.148/0.2348 = 9.15, where plain tokens ÷ seconds over the steps give 8.58."""
    def steps(a: float, b: float) -> list[dict]:
        return [{"prompt_tokens": n, "decode_rows": 0, "ctx_tokens": 0, "seconds": a + b * n}
                for n in (256, 1024, 2048)]

    calib = {"steps": {"tp2×pp1": steps(0.1, 1e-3), "tp1×pp2": steps(0.03, 1e-4)},
             "seams": []}
    want = (2048 / (0.1 + 2.048)) / (2048 / (0.03 + 0.2048))
    flags = fc.seeds(calib, "tp2×pp1", "tp1×pp2", 2048)
    assert flags == f"--flip-seed-pp-speedup {1 / want:.4f}"
    assert fc.prefill_step_tokens("--chunked-prefill-size 2048 --max-prefill-tokens 4096") \
        == 2048
    assert fc.prefill_step_tokens("--chunked-prefill-size 0 --max-prefill-tokens 4096") == 4096

@pytest.mark.parametrize("flips, sim_flips, tps, sim_tps, ok", [
    (0, 0, 100.0, 114.0, True),
    (0, 1, 100.0, 100.0, False),  # a measured 0 asks for 0
    (8, 7, 100.0, 100.0, True),  # 12.5 %
    (6, 5, 100.0, 100.0, False),  # 16.7 %
    (4, 4, 100.0, 84.0, False),  # throughput 16 % low
])
def test_the_simulator_check_is_within_tolerance_on_throughput_and_flips(
        flips, sim_flips, tps, sim_tps, ok):
    rows = bfw.sim_check({"runs": [run_with(flips, sim_flips, tps, sim_tps),
                                   {"run": "pp2", "skipped": "budget"}]}, 0.15)
    assert len(rows) == 1 and rows[0]["ok"] is ok
    assert rows[0]["e2e_err"] == pytest.approx(0.1)
    assert math.isclose(rows[0]["throughput_err"], sim_tps / tps - 1)


def test_seeds_leave_out_what_the_calibration_could_not_measure():
    step = {"prompt_tokens": 512, "decode_rows": 0, "ctx_tokens": 0, "seconds": 0.1}
    seam = {"target": "tp1×pp2", "seconds": 0.2, "refill_tokens_prefilled": 0}
    calib = {"steps": {"tp2×pp1": [step], "tp1×pp2": [step | {"seconds": 0.05}]},
             "seams": [seam]}
    flags = fc.seeds(calib, "tp2×pp1", "tp1×pp2")
    assert flags == "--flip-seed-pp-speedup 2.0000 --flip-seed-to-pp-s 0.2000"  # no seam back
    calib["steps"]["tp1×pp2"] = [step | {"prompt_tokens": 8}]  # no prefill step measured
    assert fc.seeds(calib, "tp2×pp1", "tp1×pp2") == "--flip-seed-to-pp-s 0.2000"


def test_after_a_cut_the_runs_that_finished_are_still_simulated(monkeypatch):
    """A cut run leaves less than the reserve; the others' simulation (~0.1 s each) runs
    while any budget is left, so the check still covers them."""
    monkeypatch.setattr(bfw, "server_scales", lambda runs, calib: {})
    monkeypatch.setattr(bfw, "simulate_run", lambda run, calib, trace, scales=None: {
        "flips": run["flips"], "throughput_tps": run["throughput_tps"], "e2e_mean_s": 1.0})
    clean = run_with(8, 8, 100.0, 100.0) | {"run": "auto", "cut": False}
    cut = run_with(0, 0, 50.0, 50.0) | {"run": "tp2", "cut": True}
    result = {"runs": [clean, cut], "workload": {}}
    a = args("--reserve-s", "25")
    res = bfw.finish(result, trace_of(a), {"steps": {}, "seams": []}, a, bfw.Budget(5.0))
    assert [c["run"] for c in res["sim_check"]] == ["auto"] and res["sim_check"][0]["ok"]
    assert cut["sim_skipped"] == "run cut"


def test_auto_is_compared_with_the_best_static_run_by_throughput_and_busy_seconds():
    """Below saturation every layout serves what arrives (throughput ratio ~1): tokens per
    busy second still tell the layouts apart, measured and simulated."""
    def run(name: str, tps: float, busy: float | None, sim_busy: float | None) -> dict:
        return {"run": name, "ok": 1, "throughput_tps": tps, "busy_tps": busy,
                "sim": None if sim_busy is None else {"busy_tps": sim_busy}}

    result = {"runs": [run("tp2", 100.0, 400.0, 410.0), run("pp2", 101.0, 500.0, 480.0),
                       run("auto", 100.5, 650.0, 600.0), {"run": "tp2xpp2", "skipped": "x"}]}
    (cmp,) = bfw.auto_vs_static(result)
    assert cmp["best_static"] == "pp2"
    assert cmp["throughput"] == pytest.approx(100.5 / 101.0)
    assert cmp["busy"] == pytest.approx(1.3) and cmp["sim_busy"] == pytest.approx(1.25)
    result["runs"][1]["busy_tps"] = math.nan  # a server without busy_s: that side is NaN
    (cmp,) = bfw.auto_vs_static(result)
    assert cmp["best_static"] == "tp2" and cmp["busy"] == pytest.approx(650 / 400)
    assert bfw.auto_vs_static({"runs": [run("auto", 1.0, 1.0, 1.0)]}) == []
    for r in result["runs"][:2]:  # servers that report no busy_s: no best static by it
        r["busy_tps"] = None
    (cmp,) = bfw.auto_vs_static(result)
    assert cmp["best_static"] is None and math.isnan(cmp["busy"])
    assert cmp["throughput"] == pytest.approx(100.5 / 101.0)
