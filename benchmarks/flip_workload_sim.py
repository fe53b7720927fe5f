"""The simulator's view of a bench_flip_workload result (issue 17): each measured run
replayed by `flip/sim.py` with step models fitted to the result's calibration, and the check
of simulated against measured (throughput and flip count within a tolerance)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from phaseflip.config import EngineConfig
from phaseflip.flip import workload as wl
from phaseflip.flip.policy import layout_name


def served(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs that served the trace (not skipped, not failed to launch)."""
    return [r for r in result["runs"] if "ok" in r]


def calib_rate(calib: dict[str, Any], name: str) -> float:
    """Prefill tokens/s of a layout's calibration steps that are mostly prefill (as the
    policy measures it); NaN if it has none."""
    s = [x for x in calib["steps"].get(name, []) if x["prompt_tokens"] >= 64
         and x["prompt_tokens"] >= 0.9 * (x["prompt_tokens"] + x["decode_rows"])]
    seconds = sum(x["seconds"] for x in s)
    return sum(x["prompt_tokens"] for x in s) / seconds if seconds > 0 else math.nan


def _parse_name(name: str) -> tuple[int, int]:
    tp, pp = name.removeprefix("tp").split("×pp")
    return int(tp), int(pp)


def calib_per_token_s(calib: dict[str, Any], name: str) -> float:
    """A layout's per-prompt-token step cost b of seconds = a + b·tokens, fitted to its
    calibration steps exactly as the policy fits a server's (`PrefillCostModel`); NaN if it
    has no prefill step."""
    from phaseflip.flip.prefill_fit import PrefillCostModel

    model = PrefillCostModel(1 << 30)
    for x in calib["steps"].get(name, []):
        model.observe(x["prompt_tokens"], x["decode_rows"], x["seconds"])
    fit = model.fit()
    return fit.per_token_s if fit is not None and fit.per_token_s > 0 else math.nan



def calib_rate_at(calib: dict[str, Any], name: str, step_tokens: int) -> float:
    """Prefill tokens/s of a layout's calibration steps priced at a step of `step_tokens`,
    from the fit the policy makes (a + b·S: the rate its X and P are); the plain rate when
    the steps give no fit; NaN if it has no prefill step."""
    from phaseflip.flip.prefill_fit import PrefillCostModel

    model = PrefillCostModel(1 << 30)
    for x in calib["steps"].get(name, []):
        model.observe(x["prompt_tokens"], x["decode_rows"], x["seconds"])
    fit = model.fit()
    return fit.rate_at(step_tokens) if fit is not None else calib_rate(calib, name)

def server_scales(runs: list[dict[str, Any]], calib: dict[str, Any]
                  ) -> dict[tuple[int, int], float]:
    """Per layout: how much slower its *static* server run's steps were than the
    calibration's (its front end shares the cores): the per-token cost b its policy fitted
    (`prefill_step_fit`) over the one the same fit gives the calibration steps. (X and P are
    priced at a step of S tokens, a + b·S: divided by a plain tokens ÷ seconds they mixed
    the fixed cost into the scale.) A result from before the fit (no `prefill_step_fit`):
    the calibration's plain rate over X or P, which were plain rates then. The auto runs are
    not used: they are what the simulator is checked against."""
    out = {}
    for r in runs:
        pol, cfg = r.get("policy") or {}, r.get("config") or {}
        if r["run"].startswith("auto") or not pol.get("layouts"):
            continue
        lay = (cfg["tp_size"], cfg["pp_size"])
        which = "X" if pol["layouts"]["decode"] == layout_name(lay) else "P"
        est = pol["estimates"]["prefill_tps"][which]
        if est["provenance"] != "measured" or not est["value"]:
            continue
        fits = pol["estimates"].get("prefill_step_fit")
        if fits is None:  # the EMA policy's X, P: tokens ÷ seconds
            k = calib_rate(calib, layout_name(lay)) / est["value"]
        else:
            b = (fits.get(which) or {}).get("per_token_s")
            k = b / calib_per_token_s(calib, layout_name(lay)) if b else math.nan
        if math.isfinite(k) and k > 0:
            out[lay] = k
    return out


def simulate_run(run: dict[str, Any], calib: dict[str, Any], trace: list[wl.Arrival],
                 scales: dict[tuple[int, int], float] | None = None) -> dict[str, Any] | None:
    """The measured run replayed by `flip/sim.py`: step models fitted to the calibration
    (each scaled by `scales`, if given), seams at the calibration's median per direction,
    the server's own config and pool."""
    from phaseflip.flip.sim import LinearStepModel, simulate

    models = {_parse_name(n): LinearStepModel.fit(
        [(s["prompt_tokens"], s["decode_rows"], s["ctx_tokens"], s["seconds"]) for s in st])
        for n, st in calib["steps"].items()}
    for lay, k in (scales or {}).items():  # the prefill coefficient: what X and P measure
        models[lay] = replace(models[lay], prompt_token_s=k * models[lay].prompt_token_s)
    known = set(EngineConfig.field_names())
    cfg = EngineConfig(**{k: v for k, v in (run["config"] or {}).items() if k in known})
    if run.get("timeline"):  # the config is read after the run, in its last layout; the
        cfg = cfg.with_layout(*_parse_name(run["timeline"][0]["layout"]))  # first sample's is
    if (cfg.tp_size, cfg.pp_size) not in models:
        return None
    seam = {(_parse_name(s["source"]), _parse_name(s["target"])): s["seconds"]
            for s in calib["seams"]}
    res = simulate(trace, cfg, models, kv_slots=run["kv_capacity_tokens"],
                   seam_s=lambda a, b: seam[(a, b)],
                   refill_s_per_token=refill_per_token(calib["seams"], models))
    out = res.summary()
    out["models"] = {layout_name(k): vars(m) for k, m in models.items()}
    out["flip_times_s"] = [round(f["at_s"], 3) for f in res.flips]
    out["layout_timeline"] = _sim_timeline(res)
    return out


def refill_per_token(seams: list[dict[str, Any]], models: dict[tuple[int, int], Any]
                     ) -> float:
    """Seconds per retracted token of the calibration seams' refills, priced as the policy
    prices them: re-prefilled tokens at the target's fitted per-token cost, plus the loads'
    seconds bounded by the window's wall time."""
    cost = held = 0.0
    for s in seams:
        if s.get("refill_state") != "done" or not s.get("retracted_tokens"):
            continue
        load = 0.0
        if s.get("refill_bytes") and s.get("refill_rate_gbps"):
            load = min(s["refill_bytes"] / (s["refill_rate_gbps"] * 1e9), s["refill_s"])
        step = models[_parse_name(s["target"])]
        cost += s["refill_tokens_prefilled"] * step.prompt_token_s + load
        held += s["retracted_tokens"]
    return cost / held if held else 0.0


def _sim_timeline(res: Any) -> list[tuple[float, str]]:
    """(time, layout) at each change of the simulated run (the first step's layout first)."""
    out: list[tuple[float, str]] = []
    for t, dt, name, _, _ in res.steps:
        if not out or out[-1][1] != name:
            out.append((round(t - dt, 3), name))
    return out


def sim_check(result: dict[str, Any], tolerance: float) -> list[dict[str, Any]]:
    """The simulator against each simulated run (issue 17: throughput and flip count within
    `tolerance` of measured; a measured 0 flips asks for 0), for `sim` and `sim*`."""
    out = []
    for r in served(result):
        for key in ("sim", "sim_scaled"):
            sim = r.get(key)
            if not sim:
                continue
            tps = sim["throughput_tps"] / r["throughput_tps"] - 1.0
            flips = (abs(sim["flips"] - r["flips"]) / r["flips"] if r["flips"]
                     else float(sim["flips"] != 0))
            e2e = (sim["e2e_mean_s"] / r["e2e_mean_s"] - 1.0
                   if sim.get("e2e_mean_s") and r["e2e_mean_s"] else None)
            out.append({"run": r["run"], "sim": "sim*" if key == "sim_scaled" else "sim",
                        "throughput_err": tps, "flips": r["flips"], "sim_flips": sim["flips"],
                        "flips_err": flips, "e2e_err": e2e,
                        "ok": abs(tps) <= tolerance and flips <= tolerance})
    return out
