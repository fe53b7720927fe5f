"""Where the flip pays (issue 17 item 3): auto vs the best static layout and an oracle, in
simulation, across link bandwidth and prefill share, for 8B- and 70B-shaped models on 2 and 4
GPUs.

    python -m benchmarks.flip_map --out docs/results/2026-12-02/flip-map/map.json \\
        --figs docs/figs

Every point replays one agent-fleet trace (`flip/workload.py`) through `flip/sim.py`: the real
scheduler and policy, step times from `AnalyticStepModel` with the GPU calibrated on the
measured H200 one-batch latencies (tp1, tp2, pp2 of llama-3.1-8b, `--calib`), collectives over
a link of the point's bandwidth, seams of 0.2 s + the weight bytes a GPU receives ÷ the link,
refills of the retracted KV from pinned host memory at 50 GB/s per GPU.

The trace's arrivals are scaled so the decode layout runs at `--load` utilisation; the figure
of merit is throughput on busy time: prompt + output tokens per second the GPUs were busy
(steps and seams), what a saturated server would deliver. Per point: each static layout
(tpN, ppN, and tp2xpp2 on 4 GPUs), auto (between tpN and ppN, seeded with the model's own
prefill speedup and seam cost, as an operator would seed it from bench_latency/bench_flip),
and the oracle: the best of the static layouts and of the burst schedules (flip to ppN when a
chosen burst arrives, back when its prompts are all prefilled), bursts chosen greedily.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import print_table, write_json
from benchmarks.plot import pyplot, save
from phaseflip.config import EngineConfig
from phaseflip.flip import sim
from phaseflip.flip import workload as wl
from phaseflip.flip.policy import layout_name

CALIB = ("docs/results/2026-11-29/latency_llama8b.json",
         "docs/results/2026-11-29/multi_gpu/latency_llama8b_tp2.json",
         "docs/results/2026-11-29/multi_gpu/latency_llama8b_pp2.json")
REF_LINK = sim.link(368.0)  # the H200 pair the calibration ran on (measured send, comm.json)
HOST_BPS = 50e9  # pinned host → device, per GPU (issue 15)
SEAM_FIXED_S = 0.2  # the live seam on one H200 without moving bytes (docs/benchmarks.md)
HBM_BYTES = 141e9
SHAPES = {"8B": sim.LLAMA_8B, "70B": sim.LLAMA_70B}

# prefill shares: (burst suffix tokens, background rps) of the GPU-scale trace
SHARES = {"low": (512, 6.0), "mid": (2048, 3.0), "high": (6144, 1.5), "max": (6144, 0.4)}


def gpu_spec(share: str, seed: int = 0, alternate: bool = False,
             burst_every_s: float = 12.0) -> wl.WorkloadSpec:
    """The GPU-scale agent fleet: 32-request bursts on 4k-token shared prefixes."""
    suffix, rps = SHARES[share]
    return wl.WorkloadSpec(duration_s=36.0, seed=seed, vocab_size=32000, background_rps=rps,
                           background_prompt_tokens=256, background_output_tokens=256,
                           burst_every_s=burst_every_s, burst_requests=32,
                           burst_prefix_tokens=4096, burst_suffix_tokens=suffix,
                           burst_output_tokens=64, burst_spread_s=1.0, prefixes=2,
                           alternate=alternate)


@dataclass(frozen=True)
class Point:
    model: str
    gpus: int
    gbps: float
    share: str

    @property
    def decode(self) -> tuple[int, int]:
        return (self.gpus, 1)

    @property
    def prefill(self) -> tuple[int, int]:
        return (1, self.gpus)

    def layouts(self) -> list[tuple[int, int]]:
        return [self.decode, self.prefill] + ([(2, 2)] if self.gpus == 4 else [])


class Bench:
    """Everything one point needs: step models, seams, config, KV pool."""

    def __init__(self, pt: Point, gpu: sim.GpuCalib) -> None:
        self.pt, self.shape = pt, SHAPES[pt.model]
        self.link = sim.link(pt.gbps)
        self.models = {lay: sim.AnalyticStepModel(self.shape, gpu, self.link, *lay)
                       for lay in pt.layouts()}
        n = pt.gpus
        self.kv_slots = int(min(2_000_000, (0.85 * n * HBM_BYTES - self.shape.weight_bytes)
                                / self.shape.kv_bytes_per_token))
        self.refill_s_per_token = self.shape.kv_bytes_per_token / n / HOST_BPS

    def seam_s(self, a: tuple[int, int], b: tuple[int, int]) -> float:
        n = self.pt.gpus
        return SEAM_FIXED_S + self.shape.weight_bytes * (n - 1) / n / n / self.link.bandwidth_Bps

    def speedup(self) -> float:
        """P / X on a 16k-token prefill: what bench_latency of the two layouts would say."""
        d, p = self.models[self.pt.decode], self.models[self.pt.prefill]
        return d.seconds(16384, 0, 0) / p.seconds(16384, 0, 0)

    def cfg(self, layout: tuple[int, int] | None) -> EngineConfig:
        """A static layout, or (None) auto between the point's pair."""
        base = {"page_size": 16, "max_running_requests": 256, "chunked_prefill_size": 8192,
                "max_prefill_tokens": 16384}
        if layout is not None:
            return EngineConfig(tp_size=layout[0], pp_size=layout[1], **base)
        c = self.seam_s(self.pt.decode, self.pt.prefill)
        return EngineConfig(tp_size=self.pt.gpus, enable_flip=True, enable_hicache=True,
                            flip_policy="auto",
                            flip_layouts=f"tp{self.pt.gpus},pp{self.pt.gpus}",
                            flip_seed_pp_speedup=self.speedup(), flip_seed_to_pp_s=c,
                            flip_seed_to_tp_s=c, flip_min_dwell_s=2.0, **base)

    def run(self, trace: list[wl.Arrival], layout: tuple[int, int] | None,
            schedule: Any = None) -> sim.SimResult:
        cfg = self.cfg(layout if schedule is None else None)
        if schedule is not None:  # flips by the schedule, not by a policy
            cfg = EngineConfig(**(vars(cfg) | {"flip_policy": "manual"}))
        return sim.simulate(trace, cfg, self.models, kv_slots=self.kv_slots,
                            seam_s=self.seam_s, refill_s_per_token=self.refill_s_per_token,
                            schedule=schedule)


class BurstSchedule:
    """The oracle's family: the prefill layout from a chosen burst's first arrival until every
    request of it has its first token; the decode layout otherwise."""

    def __init__(self, trace: list[wl.Arrival], chosen: set[int], decode: tuple[int, int],
                 prefill: tuple[int, int]) -> None:
        self.decode, self.prefill, self.chosen = decode, prefill, chosen
        self.start = {}
        self.rids: dict[int, list[str]] = {}
        for i, a in enumerate(trace):
            if a.kind == "burst":
                self.start.setdefault(a.group, a.t_s)
                self.rids.setdefault(a.group, []).append(f"r{i}")

    def target(self, t: float, s: sim.Simulator) -> tuple[int, int]:
        for g in self.chosen:
            if t >= self.start[g] and any(
                    r not in s.records or not s.records[r].token_s for r in self.rids[g]):
                return self.prefill
        return self.decode


def scaled(trace: list[wl.Arrival], k: float) -> list[wl.Arrival]:
    return [wl.Arrival(a.t_s * k, a.prompt_ids, a.max_new_tokens, a.kind, a.group)
            for a in trace]


def oracle(b: Bench, trace: list[wl.Arrival], statics: dict[str, float]
           ) -> tuple[float, str, int]:
    """(busy tok/s, what, flips) of the best schedule found: a static layout, or a burst
    schedule with bursts chosen greedily (all first, then each toggled if it does better)."""
    best_name = max(statics, key=statics.__getitem__)
    best = (statics[best_name], best_name, 0)
    groups = sorted({a.group for a in trace if a.kind == "burst"})
    chosen = set(groups)

    def score(ch: set[int]) -> tuple[float, int]:
        r = b.run(trace, None, BurstSchedule(trace, ch, b.pt.decode, b.pt.prefill))
        return r.busy_tps, len(r.flips)

    cur = score(chosen)
    for g in groups:
        trial = chosen ^ {g}
        got = score(trial) if trial else (statics[layout_name(b.pt.decode)], 0)
        if got[0] > cur[0]:
            chosen, cur = trial, got
    if cur[0] > best[0]:
        best = (cur[0], f"bursts {sorted(chosen)}", cur[1])
    return best


def run_point(pt: Point, gpu: sim.GpuCalib, load: float, seed: int,
              alternate: bool = False) -> dict[str, Any]:
    b = Bench(pt, gpu)
    base = wl.generate(gpu_spec(pt.share, seed, alternate, 4.0 if alternate else 12.0))
    probe = b.run(base, pt.decode)  # the decode layout's busy time sets the time scale
    trace = scaled(base, sum(probe.busy_s.values()) / (load * base[-1].t_s))
    statics, extra = {}, {}
    for lay in pt.layouts():
        r = b.run(trace, lay)
        statics[layout_name(lay)] = r.busy_tps
        extra[layout_name(lay)] = r.summary()
    auto = b.run(trace, None)
    best_static = max(statics.values())
    o_tps, o_what, o_flips = oracle(b, trace, statics)
    return {"model": pt.model, "gpus": pt.gpus, "gbps": pt.gbps, "share": pt.share,
            "prefill_share": wl.prefill_share(trace), "statics": statics,
            "best_static": max(statics, key=statics.__getitem__),
            "auto_tps": auto.busy_tps, "auto_flips": len(auto.flips),
            "auto_vs_static": auto.busy_tps / best_static,
            "oracle_tps": o_tps, "oracle": o_what, "oracle_flips": o_flips,
            "auto_vs_oracle": auto.busy_tps / o_tps, "seed_pp_speedup": b.speedup(),
            "seam_s": b.seam_s(pt.decode, pt.prefill), "auto": auto.summary(),
            "static_runs": extra}


def plot_map(rows: list[dict[str, Any]], figs: Path) -> list[Path]:
    """One panel per (model, GPUs): auto / best static vs link bandwidth, a line per share;
    the oracle dashed."""
    plt = pyplot()
    keys = sorted({(r["model"], r["gpus"]) for r in rows}, key=lambda k: (k[0] != "8B", k[1]))
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
    for ax, (model, gpus) in zip(axes[0], keys):
        for share, colour in zip(SHARES, ("tab:blue", "tab:orange", "tab:green", "tab:red")):
            pts = sorted((r for r in rows if (r["model"], r["gpus"], r["share"]) ==
                          (model, gpus, share)), key=lambda r: r["gbps"])
            if not pts:
                continue
            x = [r["gbps"] for r in pts]
            best = [max(r["statics"].values()) for r in pts]
            ax.plot(x, [r["auto_tps"] / s for r, s in zip(pts, best)], "o-", color=colour,
                    label=f"auto, {share} ({pts[0]['prefill_share']:.2f})")
            ax.plot(x, [r["oracle_tps"] / s for r, s in zip(pts, best)], "--", color=colour,
                    lw=0.8)
        ax.axhline(1.0, color="grey", lw=0.6)
        ax.axhline(1.3, color="tab:red", lw=0.6, ls=":")
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks([25, 50, 100, 200, 400], ["25", "50", "100", "200", "400"])
        ax.set_title(f"{model}, {gpus} GPUs")
        ax.set_xlabel("link GB/s")
    axes[0, 0].set_ylabel("throughput / best static\n(dashed: oracle)")
    axes[0, 0].legend(fontsize=7)
    return [save(fig, figs / "flip_map.png")]


def plot_timeline(pt: Point, gpu: sim.GpuCalib, load: float, seed: int, path: Path) -> Path:
    """One point's replays over time: tokens served (cumulative, steps' prompt tokens and
    decode rows) by each static layout, auto and the all-bursts schedule, with the layout of
    auto and of the schedule as strips below."""
    plt = pyplot()
    b = Bench(pt, gpu)
    base = wl.generate(gpu_spec(pt.share, seed))
    probe = b.run(base, pt.decode)
    trace = scaled(base, sum(probe.busy_s.values()) / (load * base[-1].t_s))
    groups = {a.group for a in trace if a.kind == "burst"}
    runs = {layout_name(lay): b.run(trace, lay) for lay in pt.layouts()}
    runs["auto"] = b.run(trace, None)
    runs["burst schedule"] = b.run(trace, None, BurstSchedule(trace, groups, pt.decode,
                                                                pt.prefill))
    fig, (ax, strip) = plt.subplots(2, 1, figsize=(10, 4.6), sharex=True,
                                    gridspec_kw={"height_ratios": [4, 1]})
    for name, r in runs.items():
        t = [s[0] for s in r.steps]
        done = np.cumsum([s[3] + s[4] for s in r.steps]) / 1e6
        ax.plot(t, done, label=f"{name} ({r.busy_tps:.0f} tok/s busy)",
                lw=2 if name == "auto" else 1)
    for a in trace:
        if a.kind == "burst":
            ax.axvline(a.t_s, color="grey", lw=0.2)
    colours = {layout_name(pt.decode): "tab:blue", layout_name(pt.prefill): "tab:orange"}
    for y, name in ((1, "auto"), (0, "burst schedule")):
        for t, dt, lay, _, _ in runs[name].steps:
            strip.barh(y, dt, left=t - dt, color=colours.get(lay, "grey"), lw=0)
    strip.set_yticks([0, 1], ["schedule", "auto"])
    ax.set_ylabel("M tokens served")
    ax.legend(fontsize=7)
    ax.set_title(f"{pt.model}, {pt.gpus} GPUs, {pt.gbps:g} GB/s, share {pt.share} "
                 f"(grey: burst arrivals; strips: blue {layout_name(pt.decode)}, orange "
                 f"{layout_name(pt.prefill)})", fontsize=9)
    strip.set_xlabel("simulated seconds")
    return save(fig, path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="8B,70B")
    ap.add_argument("--gpus", default="2,4")
    ap.add_argument("--gbps", default="25,50,100,200,400")
    ap.add_argument("--shares", default="low,mid,high")
    ap.add_argument("--load", type=float, default=0.7, help="decode layout's utilisation")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calib", default=",".join(CALIB))
    ap.add_argument("--out", default=None)
    ap.add_argument("--figs", default=None, help="write flip_map.png here")
    ap.add_argument("--merge", default=None, metavar="JSON,JSON",
                    help="no simulation: report and plot these results' points together")
    ap.add_argument("--timeline", default=None, metavar="MODEL,GPUS,GBPS,SHARE",
                    help="only plot this point's replays over time (flip_map_timeline.png)")
    args = ap.parse_args(argv)
    if args.timeline:
        m, g, bw, share = args.timeline.split(",")
        measured = [json.loads(Path(p).read_text()) for p in args.calib.split(",")]
        gpu = sim.calibrate_gpu(measured, sim.LLAMA_8B, REF_LINK)
        plot_timeline(Point(m, int(g), float(bw), share), gpu, args.load, args.seed,
                      Path(args.figs or ".") / "flip_map_timeline.png")
        return {}
    if args.merge:
        parts = [json.loads(Path(p).read_text()) for p in args.merge.split(",")]
        rows = [r for d in parts for r in d["points"]]
        result = parts[0] | {"points": rows, "targets": targets(rows),
                             "alternating": [r for d in parts for r in d["alternating"]]}
        _report(result)
        if args.figs:
            plot_map(rows, Path(args.figs))
        return write_json(args.out, result)
    measured = [json.loads(Path(p).read_text()) for p in args.calib.split(",")]
    gpu = sim.calibrate_gpu(measured, sim.LLAMA_8B, REF_LINK)
    rows, t0 = [], time.perf_counter()
    for model in args.models.split(","):
        for gpus in (int(g) for g in args.gpus.split(",")):
            for gbps in (float(x) for x in args.gbps.split(",")):
                for share in args.shares.split(","):
                    rows.append(run_point(Point(model, gpus, gbps, share), gpu, args.load,
                                          args.seed))
                    print(_line(rows[-1]), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    alternating = [run_point(Point(m, 2, 25.0, "mid"), gpu, args.load, args.seed, True)
                   for m in args.models.split(",")]
    result = {"benchmark": "flip_map", "gpu_calibration": vars(gpu), "load": args.load,
              "points": rows, "alternating": alternating, "targets": targets(rows)}
    _report(result)
    if args.figs:
        plot_map(rows, Path(args.figs))
    return write_json(args.out, result)


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def gain(r: dict[str, Any]) -> float:
        return r["oracle_tps"] / max(r["statics"].values())

    pays = [r for r in rows if gain(r) >= 1.3]
    helps = [r for r in rows if gain(r) >= 1.05]
    return {"points": len(rows),
            "min_auto_vs_oracle": min(r["auto_vs_oracle"] for r in rows),
            "min_auto_vs_static": min(r["auto_vs_static"] for r in rows),
            "max_oracle_vs_static": max(gain(r) for r in rows),
            "max_auto_vs_static": max(r["auto_vs_static"] for r in rows),
            "points_where_flip_pays_1.3x": len(pays),
            "min_auto_vs_static_where_it_pays": min((r["auto_vs_static"] for r in pays),
                                                    default=None),
            "points_where_oracle_gains_5pct": len(helps),
            "min_auto_vs_static_there": min((r["auto_vs_static"] for r in helps),
                                            default=None)}


def _line(r: dict[str, Any]) -> str:
    return (f"{r['model']} x{r['gpus']} {r['gbps']:>5g} GB/s {r['share']:>4} "
            f"({r['prefill_share']:.2f}): best static {r['best_static']} "
            f"auto/static {r['auto_vs_static']:.3f} auto/oracle {r['auto_vs_oracle']:.3f} "
            f"flips auto {r['auto_flips']} oracle {r['oracle_flips']} ({r['oracle']})")


def _report(result: dict[str, Any]) -> None:
    rows = [[r["model"], r["gpus"], r["gbps"], r["share"], r["best_static"],
             r["auto_vs_static"], r["oracle_tps"] / max(r["statics"].values()),
             r["auto_vs_oracle"], r["auto_flips"], r["oracle_flips"]]
            for r in result["points"] + result["alternating"]]
    print_table(["model", "GPUs", "GB/s", "share", "best static", "auto/static",
                 "oracle/static", "auto/oracle", "auto flips", "oracle flips"], rows,
                title="flip map (last rows: alternating bursts every 4 s)")
    print("targets:", result["targets"])


if __name__ == "__main__":
    main()
