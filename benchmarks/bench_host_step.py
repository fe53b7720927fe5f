"""Host time of one decode step on the driver and on the worker ranks, for one process and for
TP/PP layouts, with a null forward (no model math on any rank).

    python -m benchmarks.bench_host_step --layouts tp1,tp2,pp2 --num-requests 1,256 \
        --steps 200 --out host_step.json

What a multi-rank layout adds to a step, with the model's math taken away, is what the ranks'
plumbing costs: encoding and sending the plan, the workers receiving and rebuilding it, the
hidden states and logits crossing ranks. A GPU pair pays the same host work in front of its
kernels (issue 16: ~2.2 ms of host bubble per tp2 step on the H200 pair), so this CPU number is
the target for the fast path: tp2/pp2 within 0.3 ms of one process.

Every rank runs on the CPU (gloo). One process's forward is replaced by rows of a fixed random
logits matrix (`bench_scheduler.install_null_forward`); a multi-rank layout's ranks run
`stage.NullStage` (zero hidden states, the same logits), switched on by the environment
variable `PHASEFLIP_NULL_FORWARD` that the spawned ranks inherit. The engine step itself
(`EngineCore.step`: schedule, plan, send, sample, outputs) is the real one.

Reported per decode step, median and p90 over `--steps` steps of a full batch of N decoding
requests: the driver's wall time (`step()`), the driver's CPU time (all its threads, and its
main thread alone), how often per step the driver thread lost its core (involuntary context
switches: on a shared box, wall time past CPU time is mostly this, not the code), and each
worker rank's CPU time (its whole process, from /proc in clock ticks, averaged over the window:
its host work and its spin while it waits for the next plan, since a null stage computes
nothing). With `--pp-async-decode` a step decodes one of
pp_size groups, so the table adds the wall time per decode round (every request one token:
the window's wall time over its decode tokens / N), which compares across layouts.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import time
from typing import Any

import torch

from benchmarks.bench_scheduler import install_null_forward
from benchmarks.common import (
    print_table,
    random_prompts,
    step_until_decoding,
    summarize,
    write_json,
)
from phaseflip.config import EngineConfig, parse_layout
from phaseflip.distributed.stage import NULL_FORWARD_ENV
from phaseflip.engine.core import EngineCore
from phaseflip.model.config import ModelConfig
from phaseflip.model.loader import load_tokenizer
from phaseflip.model.resolve import resolve_model
from phaseflip.sampling.params import SamplingParams


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model dir (default: the tiny bundled model)")
    ap.add_argument("--layouts", default="tp1,tp2,pp2", help="comma-separated: tp1, tp2, pp2...")
    ap.add_argument("--num-requests", default="1,256", help="comma-separated decode batch sizes")
    ap.add_argument("--steps", type=int, default=200, help="timed decode steps")
    ap.add_argument("--warmup-steps", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--no-overlap", action="store_true", help="--overlap-schedule off")
    ap.add_argument("--hicache", action="store_true", help="--enable-hicache on")
    ap.add_argument("--pp-async-decode", action="store_true",
                    help="--pp-async-decode on (PP layouts: decode groups in flight)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run every configuration this many times, round robin, and keep the "
                         "run of the lowest driver wall p50 (a shared machine's load comes "
                         "and goes; the least disturbed run is the closest to the code's cost)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time the parts of the driver's step (schedule, plan encode, "
                         "plan to the ranks, rank 0's stage, the wait for logits, sampling, "
                         "outputs): p50 per step of each; the wrappers add ~1 us a call")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    return ap.parse_args(argv)


def build_core(args: argparse.Namespace, tp: int, pp: int, n: int, max_new: int) -> EngineCore:
    cfg = resolve_model(EngineConfig(
        **({"model": args.model} if args.model else {}),
        device="cpu", dtype="float32", tp_size=tp, pp_size=pp, cpu_threads=1,
        max_running_requests=n, max_total_tokens=n * (args.prompt_len + max_new + 2) + 64,
        overlap_schedule=not args.no_overlap, enable_hicache=args.hicache, seed=args.seed,
        dist_timeout_s=120, pp_async_decode=args.pp_async_decode,
    ))
    return EngineCore(cfg, ModelConfig.from_dir(cfg.model), load_tokenizer(cfg.model))


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# The parts of the driver's step that --breakdown times: (label, the object's path from the
# core, its method). A part the layout lacks (no plan encoder in one process) is left out.
STEP_PARTS = (
    ("schedule", "scheduler", "schedule"),
    ("launch", "", "_launch"),
    ("launch: plan encode", "runner.encoder", "encode"),
    ("launch: plan to ranks", "runner.ranks", "broadcast"),
    ("launch: rank 0 stage", "runner.stage", "run"),
    ("wait for logits", "runner", "_collect"),
    ("sample", "", "_sample_oldest"),
    ("sample: choose", "sampling.sampler", "_choose"),
    ("outputs: tokens", "outputs", "take_tokens"),
    ("outputs: text", "", "_owed_text"),
)


def time_step_parts(core: EngineCore) -> dict[str, float]:
    """Wraps each of STEP_PARTS on this core's objects (instance attributes, gone with the
    core); returns the dict that each call adds its seconds to, by label."""
    spent: dict[str, float] = {}
    for label, path, name in STEP_PARTS:
        obj: Any = core
        for attr in filter(None, path.split(".")):
            obj = getattr(obj, attr, None)
        if obj is not None and hasattr(obj, name):
            setattr(obj, name, _timed(getattr(obj, name), label, spent))
    return spent


def _timed(fn: Any, label: str, spent: dict[str, float]) -> Any:
    def call(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - t
    return call


def _switches() -> tuple[int, int]:
    """The driver thread's context switches so far: involuntary (another task took its core,
    or a yield while it waited gave the core away) and voluntary (it slept). A step's wall
    time past its CPU time is one of the two: preemptions say the box, sleeps the code."""
    ru = resource.getrusage(resource.RUSAGE_THREAD)
    return ru.ru_nivcsw, ru.ru_nvcsw


def fill_decode_batch(core: EngineCore, args: argparse.Namespace, n: int,
                      max_new: int) -> None:
    """Submits N never-finishing requests and steps until all N decode (then warms up)."""
    vocab = core.model_cfg.vocab_size
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)
    for i, ids in enumerate(random_prompts([args.prompt_len] * n, vocab, args.seed)):
        core.add_request(f"r{i}", ids, params)
    step_until_decoding(core, n, args.warmup_steps)


def run_config(args: argparse.Namespace, layout: str, n: int) -> dict[str, Any]:
    tp, pp = parse_layout(layout)
    max_new = args.warmup_steps + args.steps + 8  # never finishes inside the window
    core = build_core(args, tp, pp, n, max_new)
    try:
        if tp * pp == 1:
            install_null_forward(core, n, core.model_cfg.vocab_size, args.seed)
        fill_decode_batch(core, args, n, max_new)
        workers = core._ranks.pids() if core._ranks is not None else []
        wall, cpu, thread_cpu = [], [], []
        spent = time_step_parts(core) if args.breakdown else None
        parts: dict[str, list[float]] = {}
        gc.collect()
        w_cpu0 = [cpu_s(p) for p in workers]
        tokens0 = core.scheduler.stats.decode_tokens
        switches0 = _switches()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            if spent is not None:
                spent.clear()
            w, c, tc = time.perf_counter(), time.process_time(), time.thread_time()
            core.step()
            wall.append((time.perf_counter() - w) * 1e3)
            cpu.append((time.process_time() - c) * 1e3)
            thread_cpu.append((time.thread_time() - tc) * 1e3)
            for label in spent or ():
                parts.setdefault(label, []).append(spent[label] * 1e3)
        window_s = time.perf_counter() - t0
        preempted, slept = ((b - a) / args.steps for a, b in zip(switches0, _switches()))
        rounds = (core.scheduler.stats.decode_tokens - tokens0) / n
        w_cpu = [(cpu_s(p) - c0) * 1e3 / args.steps for p, c0 in zip(workers, w_cpu0)]
        sched = core.scheduler
        if sched.stats.retractions or len(sched.running) != n:
            raise RuntimeError("the measured window was not a steady full decode batch")
    finally:
        core.close()
    return {"layout": layout, "num_requests": n, "driver_wall_ms": summarize(wall),
            "driver_cpu_ms": summarize(cpu), "driver_thread_cpu_ms": summarize(thread_cpu),
            "driver_preempted_per_step": preempted, "driver_slept_per_step": slept,
            "worker_cpu_ms_per_step": w_cpu,
            "step_parts_ms_p50": {k: _p50(v, args.steps) for k, v in parts.items()},
            "steps_per_s": args.steps / window_s, "round_ms": window_s * 1e3 / rounds}


def _p50(values: list[float], steps: int) -> float:
    """The median per step of a part that some steps did not call (those count 0)."""
    return summarize(values + [0.0] * (steps - len(values)))["p50"]


def print_parts(results: list[dict[str, Any]]) -> None:
    labels = [lab for lab, _, _ in STEP_PARTS
              if any(lab in r["step_parts_ms_p50"] for r in results)]
    rows = [[r["layout"], r["num_requests"],
             *(f"{r['step_parts_ms_p50'][lab]:.3f}" if lab in r["step_parts_ms_p50"] else "-"
               for lab in labels)] for r in results]
    print_table(["layout", "N", *labels], rows,
                title="Parts of the driver's step, p50 ms per step (--breakdown)")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(1)  # host work is one thread's; idle intra-op threads add noise
    os.environ[NULL_FORWARD_ENV] = "1"  # the spawned ranks inherit it
    layouts = [x for x in args.layouts.split(",") if x]
    sizes = [int(x) for x in args.num_requests.split(",") if x]
    configs = [(lay, n) for n in sizes for lay in layouts]
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {c: [] for c in configs}
    for _ in range(args.repeat):
        for lay, n in configs:
            runs[(lay, n)].append(run_config(args, lay, n))
    results = []
    for c in configs:
        best = min(runs[c], key=lambda r: r["driver_wall_ms"]["p50"])
        best["repeats_wall_p50_ms"] = [r["driver_wall_ms"]["p50"] for r in runs[c]]
        results.append(best)
    base = {r["num_requests"]: r["driver_wall_ms"]["p50"] for r in results
            if r["layout"] == "tp1"}
    rows = []
    for r in results:
        d, c = r["driver_wall_ms"], r["driver_cpu_ms"]
        extra = d["p50"] - base[r["num_requests"]] if r["num_requests"] in base else None
        workers = " ".join(f"{x:.3f}" for x in r["worker_cpu_ms_per_step"]) or "-"
        rows.append([r["layout"], r["num_requests"], f"{d['p50']:.3f} / {d['p90']:.3f}",
                     "-" if extra is None else f"{extra:+.3f}",
                     f"{c['p50']:.3f}", f"{r['driver_thread_cpu_ms']['p50']:.3f}",
                     f"{r['driver_preempted_per_step']:.2f}", workers,
                     f"{r['steps_per_s']:.0f}", f"{r['round_ms']:.3f}"])
    print_table(["layout", "N", "driver wall p50/p90", "vs tp1", "driver cpu p50",
                 "main thread cpu p50", "preempted/step", "worker cpu/step (mean)",
                 "steps/s", "round ms"], rows,
                title=f"Host time per decode step, ms (null forward, CPU, {args.steps} steps, "
                      f"best of {args.repeat}, overlap {'off' if args.no_overlap else 'on'}, "
                      f"HiCache {'on' if args.hicache else 'off'}, pp async decode "
                      f"{'on' if args.pp_async_decode else 'off'})")
    if args.breakdown:
        print_parts(results)
    return write_json(args.out, {
        "benchmark": "host_step", "null_forward": True, "steps": args.steps,
        "warmup_steps": args.warmup_steps, "prompt_len": args.prompt_len,
        "overlap_schedule": not args.no_overlap, "hicache": args.hicache,
        "pp_async_decode": args.pp_async_decode,
        "repeat": args.repeat, "results": results,
    })


if __name__ == "__main__":
    main()
