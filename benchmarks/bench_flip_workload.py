"""When the flip pays (issue 17): an agent-fleet workload served through the real server with
static layouts and with `--flip-policy auto`, and the simulator checked against it.

    python -m benchmarks.bench_flip_workload --runs tp2,pp2,auto --duration 60 \\
        --out flip_workload.json --plot flip_workload.png

The workload (`phaseflip/flip/workload.py`, seeded, or `--trace FILE`): bursts of long
prompts on shared prefixes over a Poisson background of short-prompt decode traffic. Each run
launches `phaseflip serve` (the embedded tiny model on CPU unless `--serve-args` says
otherwise), replays the trace's arrivals as streaming `/v1/completions` (token-id prompts,
`ignore_eos`), polls `/server_info` for the timeline (layout, queue, flips), and reports
throughput (prompt + output tokens over first send to last token), TTFT and ITL p50/p99,
flips and seam seconds. A run is a layout (`tp2`, `pp2`, `tp2xpp2` ...) or `auto` (between
`--flip-layouts`), or `auto-prior` (auto told a wrong prior: `--prior-speedup`).

`--calibrate` (default on; `benchmarks/flip_calibration.py`) first steps an engine (in a
process of its own, this command with `--calibrate-only`) through the trace's request shapes
in each layout of `--flip-layouts` and records every step (prompt tokens, decode rows,
context tokens, seconds) and both seams: the JSON's `calibration`, what `flip/sim.py` fits
its step models to. The auto run is seeded with what calibration measured (the prefill
speedup, each direction's seam), as an operator would from bench_latency and bench_flip.
`--simulate` (default on) then replays the same trace through the simulator with those
models and the server's own scheduler settings, and reports simulated vs measured: `sim`
with the calibration's models as they are, `sim*` with each layout's model scaled by its
calibration prefill rate over the one its static server run measured (its per-prompt-token
cost only; static runs of the pair carry the manual policy's telemetry for it; the auto runs
stay out of the fit), and the check: throughput and flips within `--tolerance`.

For one-shot runs on a lent GPU, `--time-budget-s` skips a run that cannot fit and cuts one
that overruns; the JSON is written after every phase (docs/flip.md has the H200 command).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.bench_serving import (
    RequestResult,
    _free_port,
    launch_server,
    make_client,
    one_request,
    stop_server,
)
from benchmarks.common import percentile, print_table, write_json
from benchmarks.flip_calibration import (
    calibrate,
    prefill_step_tokens,
    run_calibration,
    seeds,
)
from benchmarks.flip_workload_sim import (
    served,
    server_scales,
    sim_check,
    simulate_run,
)
from benchmarks.plot import pyplot, save
from phaseflip.config import parse_layout
from phaseflip.flip import workload as wl
from phaseflip.flip.policy import layout_name

BASE_SERVE = ("--device cpu --dtype float32 --enable-hicache --hicache-host-gb 0.05 "
              "--max-total-tokens 32768 --page-size 16 --max-running-requests 64 "
              "--chunked-prefill-size 1024 --dist-timeout-s 120")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default="tp2,pp2,auto",
                    help="comma-separated layouts (tp2, pp2, tp2xpp2...) and/or auto")
    ap.add_argument("--flip-layouts", default="tp2,pp2", help="auto's pair: decode,prefill")
    ap.add_argument("--serve-args", default=BASE_SERVE)
    ap.add_argument("--auto-args", default="--flip-min-dwell-s 1 --flip-min-dwell-steps 4",
                    help="extra flags of the auto run")
    ap.add_argument("--prior-speedup", type=float, default=2.0,
                    help="the auto-prior run's --flip-seed-pp-speedup (a wrong prior the "
                         "policy must unlearn where PP is not faster)")
    ap.add_argument("--trace", default=None, help="replay this trace JSON (workload.py)")
    spec = wl.WorkloadSpec()
    for name, default in vars(spec).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            ap.add_argument(flag, type=type(default), default=default)
    ap.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--calib-timeout-s", type=float, default=900.0,
                    help="the calibration runs in a process group of its own: past this (or "
                         "the budget's reserve) it is killed, and the runs go on without it")
    ap.add_argument("--calibrate-only", default=None, metavar="JSON",
                    help="only calibrate, into this file (how the command runs its "
                         "calibration: a crash there, a CUDA abort, ends only that process)")
    ap.add_argument("--calib-bursts", type=int, default=12,
                    help="burst requests of the trace the calibration steps through")
    ap.add_argument("--calib-background", type=int, default=24,
                    help="background requests of the trace the calibration steps through")
    ap.add_argument("--calib-max-new-tokens", type=int, default=0,
                    help="caps the calibration requests' output (0: the trace's); fewer "
                         "decode steps where they are slow (tp2 staged over gloo on a GPU)")
    ap.add_argument("--simulate", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--resimulate", default=None, metavar="JSON",
                    help="no server: simulate again the runs of this result (its trace from "
                         "its spec; a --trace result needs its --trace again)")
    ap.add_argument("--poll-s", type=float, default=0.25)
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="wall-clock budget of the whole command: a run that would not fit "
                         "is skipped, one that overruns is cut (its finished requests kept), "
                         "the simulation is skipped once it is spent; the JSON is written "
                         "after every phase either way")
    ap.add_argument("--launch-estimate-s", type=float, default=45.0,
                    help="a server launch + stop, for the budget until one is measured")
    ap.add_argument("--reserve-s", type=float, default=15.0,
                    help="budget kept for stopping the last server and writing the result")
    ap.add_argument("--tolerance", type=float, default=0.15,
                    help="the simulator's check: throughput and flips within this of measured")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None, help="write the timeline PNG here")
    return ap.parse_args(argv)


def make_trace(args: argparse.Namespace) -> list[wl.Arrival]:
    if args.trace:
        return wl.load_trace(args.trace)
    fields = vars(wl.WorkloadSpec())
    return wl.generate(wl.WorkloadSpec(**{k: getattr(args, k) for k in fields}))


# ---------------------------------------------------------------------- one server run
def serve_flags(run: str, args: argparse.Namespace, calib: dict[str, Any] | None) -> str:
    if run in ("auto", "auto-prior"):
        decode, prefill = (parse_layout(x) for x in args.flip_layouts.split(","))
        extra = (f" --tp-size {decode[0]} --pp-size {decode[1]} --enable-flip --flip-policy auto"
                 f" --flip-layouts {args.flip_layouts} {args.auto_args}")
        if calib is not None:
            extra += " " + seeds(calib, layout_name(decode), layout_name(prefill),
                                 prefill_step_tokens(args.serve_args))
        if run == "auto-prior":  # the last --flip-seed-pp-speedup wins
            extra += f" --flip-seed-pp-speedup {args.prior_speedup}"
        return args.serve_args + extra
    tp, pp = parse_layout(run)
    pair = [parse_layout(x) for x in args.flip_layouts.split(",")]
    # a layout of the pair runs with the manual policy's telemetry (no flips): its measured
    # prefill rate scales the simulator's step models to this server (`server_scales`)
    watch = (f" --enable-flip --flip-policy manual --flip-layouts {args.flip_layouts}"
             if (tp, pp) in pair else "")
    return args.serve_args + f" --tp-size {tp} --pp-size {pp}" + watch


async def replay(base: str, trace: list[wl.Arrival], poll_s: float,
                 timeout_s: float = math.inf) -> dict[str, Any]:
    """Sends each arrival at its time; polls /server_info meanwhile for the timeline. Past
    `timeout_s` the requests still out are cancelled: `cut` is set and they count as failed
    (the finished ones are kept)."""
    import httpx

    url = base + "/v1/completions"
    timeline: list[dict[str, Any]] = []
    done = asyncio.Event()
    async with httpx.AsyncClient(timeout=60) as info_client:
        model = (await info_client.get(base + "/v1/models")).json()["data"][0]["id"]
        busy0 = (await info_client.get(base + "/server_info")).json().get("busy_s")
        start = time.perf_counter()

        async def poll() -> None:
            while not done.is_set():
                try:
                    info = (await info_client.get(base + "/server_info")).json()
                    timeline.append(_sample(info, time.perf_counter() - start))
                except (httpx.HTTPError, ValueError):
                    pass
                await asyncio.sleep(poll_s)

        poller = asyncio.create_task(poll())
        async with make_client("httpx", 3600, {}) as client:
            async def fire(a: wl.Arrival) -> Any:
                await asyncio.sleep(max(0.0, a.t_s - (time.perf_counter() - start)))
                sent = time.perf_counter() - start
                res = await one_request(client, url, model, list(a.prompt_ids),
                                        a.max_new_tokens, 0.0)
                return sent, res

            tasks = [asyncio.create_task(fire(a)) for a in trace]
            _, pending = await asyncio.wait(tasks, timeout=timeout_s)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        done.set()
        await poller
        final = (await info_client.get(base + "/server_info")).json()
    results = [t.result() if t not in pending else (a.t_s, _cut(a))
               for t, a in zip(tasks, trace)]
    return {"results": results, "timeline": timeline, "final": final, "cut": bool(pending),
            "busy0_s": busy0}


def _cut(a: wl.Arrival) -> RequestResult:
    return RequestResult(prompt_len=len(a.prompt_ids), target_len=a.max_new_tokens,
                         error="cut: past the run's time limit")


def _sample(info: dict[str, Any], t: float) -> dict[str, Any]:
    pol = info.get("flip_policy") or {}
    cfg = info.get("config") or info.get("server_config") or {}
    return {"t_s": round(t, 3), "running": info.get("running"), "waiting": info.get("waiting"),
            "layout": pol.get("layout") or layout_name((cfg.get("tp_size", 1),
                                                        cfg.get("pp_size", 1))),
            "flips": pol.get("flips", 0),
            "prefill_tokens": (info.get("scheduler") or {}).get("prefill_tokens"),
            "decode_tokens": (info.get("scheduler") or {}).get("decode_tokens")}


def summarize_run(run: str, got: dict[str, Any]) -> dict[str, Any]:
    """Throughput counts the finished requests' tokens (all of the trace's in a clean run)."""
    results = got["results"]
    ok = [r for _, r in results if r.ok]
    ends = [s + r.e2e for s, r in results if r.ok]
    first = min(s for s, _ in results)
    seconds = max(ends) - first if ends else math.nan
    tokens = sum(r.prompt_len + r.output_tokens for r in ok)
    ttft = [r.ttft for r in ok]
    itl = [x for r in ok for x in r.itls]
    pol = got["final"].get("flip_policy") or {}
    censuses = got["final"].get("flip_censuses") or []
    busy = (got["final"]["busy_s"] - got["busy0_s"]
            if got["final"].get("busy_s") is not None and got.get("busy0_s") is not None
            else math.nan)
    return {"run": run, "requests": len(results), "ok": len(ok), "cut": got.get("cut", False),
            "errors": sorted({r.error for _, r in results if r.error})[:3],
            "seconds": seconds, "throughput_tps": tokens / seconds if ok else math.nan,
            "busy_s": busy, "busy_tps": tokens / busy if ok and busy > 0 else math.nan,
            "e2e_mean_s": statistics.fmean(r.e2e for r in ok) if ok else math.nan,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
            "flips": pol.get("flips", 0), "auto_flips": pol.get("auto_flips", 0),
            "seam_s_recent": sum(c.get("total_s") or 0.0 for c in censuses),
            "censuses": censuses, "policy": pol, "timeline": got["timeline"],
            "kv_capacity_tokens": (got["final"].get("pool") or {}).get("total"),
            "config": got["final"].get("config")}


class Budget:
    """The command's wall clock (`--time-budget-s`; None: unlimited): what is left of it."""

    def __init__(self, seconds: float | None) -> None:
        self.start = time.monotonic()
        self.end = None if seconds is None else self.start + seconds

    def left(self) -> float:
        return math.inf if self.end is None else self.end - time.monotonic()


def serve_run(run: str, args: argparse.Namespace, trace: list[wl.Arrival],
              calib: dict[str, Any] | None, budget: Budget | None = None,
              launch_s: float | None = None) -> dict[str, Any]:
    """One server run, or a `skipped` record when what is left of the budget cannot hold a
    launch (`launch_s`: the last one's, measured) and the trace's arrivals; a run that
    reaches the budget's reserve is cut."""
    budget = budget or Budget(None)
    need = (launch_s or args.launch_estimate_s) + trace[-1].t_s + args.reserve_s
    if budget.left() < need:
        return {"run": run, "skipped": f"time budget: {budget.left():.0f} s left, the run "
                                       f"needs ~{need:.0f} s"}
    port, t0 = _free_port(), time.monotonic()
    flags = serve_flags(run, args, calib)
    try:  # a run that fails is recorded; the others go on
        proc = launch_server(flags, port, deadline_s=min(300.0, budget.left() - args.reserve_s))
    except RuntimeError as e:
        return {"run": run, "error": str(e), "serve_args": flags}
    t1 = t2 = time.monotonic()
    try:
        limit = min(args.timeout_s, budget.left() - args.reserve_s)
        got = asyncio.run(replay(f"http://127.0.0.1:{port}", trace, args.poll_s, limit))
    except Exception as e:  # noqa: BLE001 - the server died or would not answer
        return {"run": run, "error": f"{type(e).__name__}: {e}", "serve_args": flags}
    finally:
        t2 = time.monotonic()
        stop_server(proc)
    timing = {"launch_s": t1 - t0, "replay_s": t2 - t1, "stop_s": time.monotonic() - t2}
    return summarize_run(run, got) | {"serve_args": flags, "timing": timing}


# ---------------------------------------------------------------------- report
def print_check(rows: list[dict[str, Any]], tolerance: float) -> None:
    print(f"\nsimulator check (throughput and flips within {tolerance:.0%} of measured):")
    for c in rows:
        e2e = "" if c["e2e_err"] is None else f", E2E mean {c['e2e_err']:+.1%}"
        print(f"  {c['run']:>10} {c['sim']:<4} tok/s {c['throughput_err']:+.1%}, flips "
              f"{c['sim_flips']} vs {c['flips']}{e2e}: {'ok' if c['ok'] else 'MISSED'}")
    if not rows:
        print("  nothing simulated")


def print_report(result: dict[str, Any]) -> None:
    for r in result["runs"]:
        if "ok" not in r:
            print(f"run {r['run']}: {r.get('skipped') or r.get('error')}")
    rows = []
    for r in served(result):
        sims = []
        for sim in (r.get("sim") or {}, r.get("sim_scaled") or {}):
            sims += [sim.get("throughput_tps"),
                     None if sim.get("e2e_mean_s") is None else 1e3 * sim["e2e_mean_s"],
                     sim.get("flips")]
        rows.append([r["run"], f"{r['ok']}/{r['requests']}", r["seconds"], r["throughput_tps"],
                     r.get("busy_tps"), (r.get("sim") or {}).get("busy_tps"),
                     1e3 * r["ttft_p50_s"], 1e3 * r["ttft_p99_s"], 1e3 * r["itl_p50_s"],
                     1e3 * r["itl_p99_s"], 1e3 * r["e2e_mean_s"], r["flips"],
                     r["seam_s_recent"], *sims])
    print_table(["run", "ok", "s", "tok/s", "busy tok/s", "sim busy tok/s", "TTFT p50 ms",
                 "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "E2E mean ms", "flips",
                 "seam s (last 4)", "sim tok/s", "sim E2E ms", "sim flips", "sim* tok/s",
                 "sim* E2E ms", "sim* flips"], rows,
                title=f"flip workload: {result['workload']} (sim*: step models scaled to "
                      f"the static runs' measured prefill rates {result.get('server_scales')})")
    for a in result.get("auto_vs_static") or []:
        print(f"{a['run']} / best static: throughput {a['throughput']:.3f}, busy tok/s "
              f"{a['busy']:.3f} ({a['best_static']}), sim busy tok/s {a['sim_busy']:.3f}")


def auto_vs_static(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each auto run over the best static run, by throughput (first send to last token:
    ~1.0 whenever every layout keeps up with the arrivals) and by tokens per busy second
    (the flip map's figure of merit), measured and simulated; each measure's best static
    run is its own (`best_static`: the busy one's, None when no static run has it), NaN
    where a side is missing."""
    runs = served(result)
    static = [r for r in runs if not r["run"].startswith("auto") and not r.get("cut")]
    if not static:
        return []
    measures = {"throughput": lambda r: r.get("throughput_tps"),
                "busy": lambda r: r.get("busy_tps"),
                "sim_busy": lambda r: (r.get("sim") or {}).get("busy_tps")}

    def best(key: Callable[[dict[str, Any]], float | None]) -> dict[str, Any] | None:
        ok = [r for r in static if _positive(key(r))]
        return max(ok, key=key) if ok else None

    tops = {name: best(key) for name, key in measures.items()}
    out = []
    for r in runs:
        if not r["run"].startswith("auto") or r.get("cut"):
            continue
        row: dict[str, Any] = {"run": r["run"], "best_static": (tops["busy"] or {}).get("run")}
        for name, key in measures.items():
            top, mine = tops[name], key(r)
            row[name] = mine / key(top) if top is not None and _positive(mine) else math.nan
        out.append(row)
    return out


def _positive(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and x > 0


def plot(result: dict[str, Any], path: str) -> None:
    """One row per run: queued + running requests over time, the layout as the background
    colour, flips as lines; the simulated auto run's layouts as a strip on top."""
    plt = pyplot()
    runs = served(result)
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 2.4 * len(runs)), sharex=True,
                             squeeze=False)
    names = sorted({s["layout"] for r in runs for s in r["timeline"]})
    colours = dict(zip(names, ("tab:blue", "tab:orange", "tab:green", "tab:purple")))
    for ax, r in zip(axes[:, 0], runs):
        tl = r["timeline"]
        t = [s["t_s"] for s in tl]
        ax.plot(t, [(s["waiting"] or 0) + (s["running"] or 0) for s in tl], "k-", lw=1,
                label="requests in the engine")
        for a, b in zip(tl, tl[1:]):
            ax.axvspan(a["t_s"], b["t_s"], color=colours.get(a["layout"], "grey"), alpha=0.15,
                       lw=0)
        for a, b in zip(tl, tl[1:]):
            if b["flips"] != a["flips"]:
                ax.axvline(b["t_s"], color="tab:red", lw=0.8)
        sim = (r.get("sim_scaled") or r.get("sim") or {}).get("layout_timeline") or []
        top = ax.get_ylim()[1]
        for (ta, la), (tb, _) in zip(sim, sim[1:] + [(r["seconds"], "")]):
            ax.plot([ta, tb], [top, top], color=colours.get(la, "grey"), lw=4)
        ax.set_ylabel(r["run"])
        ax.text(0.01, 0.85, f"{r['throughput_tps']:.0f} tok/s, {r['flips']} flips",
                transform=ax.transAxes, fontsize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c, alpha=0.4) for c in colours.values()]
    axes[0, 0].legend(handles, list(colours), loc="upper right", fontsize=7)
    axes[-1, 0].set_xlabel("seconds (background: layout; red: flips; top strip: simulated)")
    save(fig, Path(path))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    budget = Budget(args.time_budget_s)
    if args.calibrate_only:
        return write_json(args.calibrate_only, calibrate(args, make_trace(args)))
    if args.resimulate:  # the simulator again over a result's own runs and calibration
        result = json.loads(Path(args.resimulate).read_text())
        spec = result.get("spec")  # the result's own trace (a --trace result: give it again)
        trace = wl.generate(wl.WorkloadSpec(**spec)) if spec else make_trace(args)
        calib = ({"steps": result["calibration"], "seams": result["seams"]}
                 if result.get("calibration") else None)
        result["resimulated"] = True
        return finish(result, trace, calib, args, budget)
    trace = make_trace(args)
    print("workload:", wl.summary(trace))
    result: dict[str, Any] = {
        "benchmark": "flip_workload", "workload": wl.summary(trace),
        "spec": None if args.trace else vars(wl.WorkloadSpec(
            **{k: getattr(args, k) for k in vars(wl.WorkloadSpec())})),
        "runs": [], "calibration": None, "seams": None, "timing": {}}
    calib = run_calibration(args, argv, result, budget) if args.calibrate else None
    launch_s = None
    for run in args.runs.split(","):
        result["runs"].append(serve_run(run, args, trace, calib, budget, launch_s))
        r = result["runs"][-1]
        timing = r.get("timing")
        launch_s = timing["launch_s"] + timing["stop_s"] if timing else launch_s
        print(f"run {run}: " + (r.get("skipped") or r.get("error") or (
            f"{r['ok']}/{r['requests']} ok{' (cut)' if r['cut'] else ''}, {r['flips']} flips, "
            + ", ".join(f"{k} {v:.1f}" for k, v in timing.items()))), flush=True)
        write_json(args.out, result)  # the measured runs are kept whatever comes next
    return finish(result, trace, calib, args, budget)


def finish(result: dict[str, Any], trace: list[wl.Arrival], calib: dict[str, Any] | None,
           args: argparse.Namespace, budget: Budget) -> dict[str, Any]:
    """The simulator over each served run that was not cut (while the budget lasts: a
    result left unsimulated is simulated later with --resimulate), the report, the check."""
    if calib is not None and args.simulate:
        scales = server_scales(served(result), calib)
        result["server_scales"] = {layout_name(k): v for k, v in scales.items()}
        for r in served(result):
            if r.get("cut") or budget.left() <= 0:  # a replay takes ~0.1 s
                r["sim"] = r["sim_scaled"] = None
                r["sim_skipped"] = "run cut" if r.get("cut") else "time budget spent"
                continue
            r["sim"] = simulate_run(r, calib, trace)
            r["sim_scaled"] = simulate_run(r, calib, trace, scales) if scales else None
    result["auto_vs_static"] = auto_vs_static(result)
    print_report(result)
    result["sim_check"] = sim_check(result, args.tolerance)
    print_check(result["sim_check"], args.tolerance)
    if not result.get("resimulated"):  # a resimulation keeps the measured run's total
        result.setdefault("timing", {})["total_s"] = time.monotonic() - budget.start
    written = write_json(args.out, result)  # before the plot: a failed plot keeps the figures
    if args.plot and served(result):
        plot(result, args.plot)
    return written


if __name__ == "__main__":
    main()
