"""Where an offline run's time goes: every step of a whole workload, classified, plus a profile.

    python -m benchmarks.profile_offline --model llama-3.1-8b --load-format dummy \
        --num-prompts 1000 --max-running-requests 512 --profile-at 300 --out offline_prof.json

Runs the same seeded workload as `bench_offline` (ShareGPT-like by default) through the engine
core step by step, and times each step from its start to the next one's (the steps sample, so
each ends with the GPU work it queued done). Every step is classified:

  decode/graph   only one-token sequences, replayed from a captured CUDA graph
  decode/eager   only one-token sequences, run eagerly (batch above the largest graph, ...)
  mixed          prompt tokens and decodes together (always eager)
  prefill        prompt tokens only

and the totals per class (steps, seconds, output tokens, prompt tokens) say which kind of step
the run's time is spent in. `--profile-at K` also runs torch.profiler over `--profile-steps`
steps from step K on and reports GPU kernel time and host phases per step for that window, as
`profile_decode` does. `--host-clock` / `--gpu-clock` time every step's host phases and its
GPU span and idle without a profiler (`step_clocks.py`). `--plot` draws the step-time
timeline (PNG).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from tqdm.auto import tqdm

from benchmarks.bench_scheduler import install_null_forward
from benchmarks.common import (
    add_model_args,
    add_workload_args,
    engine_with_workload,
    print_table,
    release_engine,
    write_json,
)
from benchmarks.gpu_gaps import gap_report, print_gaps
from benchmarks.plot import pyplot, save
from benchmarks.profile_decode import per_step_times, wrap_phases
from benchmarks.step_clocks import GpuClock, HostClock, attach_gpu_times, summarize_bands

KINDS = ("decode/graph", "decode/eager", "mixed", "prefill")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    add_workload_args(ap)
    ap.add_argument("--max-running-requests", type=int, default=512)
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--profile-at", type=lambda v: [int(x) for x in v.split(",")], default=[],
                    help="first step of each profiled window, comma separated (e.g. the "
                         "prefill-heavy start and the decode tail: 5,600)")
    ap.add_argument("--profile-steps", type=int, default=10, help="steps per window")
    ap.add_argument("--top", type=int, default=15, help="kernels listed")
    ap.add_argument("--gaps", type=float, default=None, metavar="US",
                    help="in each profiled window, the GPU's idle gaps of at least US µs "
                         "and what the host did meanwhile")
    ap.add_argument("--host-clock", action="store_true",
                    help="time the host phases of every step with perf_counter (no profiler) "
                         "and summarize them by step kind and batch size")
    ap.add_argument("--gpu-clock", action="store_true",
                    help="CUDA events at every step's start and end (no profiler): each "
                         "step's span on the GPU and the GPU's idle time before it, by step "
                         "kind and batch size (CUDA, one-GPU layouts)")
    ap.add_argument("--null-forward", action="store_true",
                    help="precomputed logits instead of the model (host overhead only)")
    ap.add_argument("--arrival-order", action="store_true",
                    help="submit the workload in its own order, not longest output first "
                         "as Engine.generate does")
    ap.add_argument("--cprofile", default=None, help="cProfile the whole run into this file")
    ap.add_argument("--plot", default=None, help="write the step timeline PNG here")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


class StepLog:
    """Wraps the scheduler's `schedule` to see each step's plan (this core only)."""

    def __init__(self, core: Any) -> None:
        self.core, self.plan = core, None
        schedule = core.scheduler.schedule

        def logged(*a: Any, **kw: Any) -> Any:
            batch = schedule(*a, **kw)
            self.plan = batch.plan if batch is not None else None
            return batch

        core.scheduler.schedule = logged

    def kind(self) -> str | None:
        plan = self.plan
        if plan is None:
            return None
        if plan.is_decode:
            graphs = getattr(self.core.runner, "graphs", None)
            return "decode/graph" if graphs is not None and graphs.can_run(plan) else \
                "decode/eager"
        return "prefill" if all(n > 1 for n in plan.extend_lens) else "mixed"

    def counts(self) -> tuple[int, int, int]:
        """(sequences, one-token rows, prompt tokens) of the last plan."""
        ext = self.plan.extend_lens
        ones = sum(1 for n in ext if n == 1)
        return len(ext), ones, sum(n for n in ext if n > 1)


def run_steps(core: Any, args: argparse.Namespace, total_out: int) -> tuple[list, dict]:
    """Steps the core to the end; returns the per-step records and the profile windows."""
    log, records, windows = StepLog(core), [], []
    clock = HostClock(core) if args.host_clock else None
    gpu_clock = GpuClock(core) if args.gpu_clock else None
    if args.profile_at:
        wrap_phases(core)  # once: the ranges cost nothing while no profiler runs
    cuda = core.runner.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    bar = tqdm(total=total_out, unit="tok", desc="offline steps")
    sync()
    step, t_prev = 0, time.perf_counter()
    while core.has_work():
        if step in args.profile_at:
            if clock is not None:
                clock.take()
            windows.append(_profile(core, log, args, step, sync, cuda))
            if gpu_clock is not None:  # the window's own marks: not a step's
                gpu_clock.discard()
            step += args.profile_steps
            t_prev = time.perf_counter()
            continue
        deltas = core.step()
        now = time.perf_counter()
        kind = log.kind()
        if kind is not None:
            seqs, ones, prompt = log.counts()
            records.append({"step": step, "kind": kind, "seconds": now - t_prev,
                            "sequences": seqs, "decode_rows": ones, "prompt_tokens": prompt})
            if clock is not None:
                records[-1]["host_ms"] = clock.take()
            if gpu_clock is not None:
                records[-1]["gpu_pair"] = gpu_clock.take()
        bar.update(sum(len(d.token_ids) for d in deltas))
        step, t_prev = step + 1, now
    bar.close()
    if gpu_clock is not None:
        sync()
        attach_gpu_times(records, gpu_clock)
    return records, windows


def _profile(core: Any, log: StepLog, args: argparse.Namespace, first: int, sync,
             cuda: bool) -> dict:
    kinds: dict[str, int] = defaultdict(int)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # no synchronize first: the window starts with the previous step in flight, as every
    # overlapped step does (a drained pipeline would add one step's host time to the window)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(args.profile_steps):
            with record_function("phase:step"):
                core.step()
            kinds[log.kind() or "idle"] += 1
        sync()
        wall = (time.perf_counter() - t0) / args.profile_steps
    kernels, phases = per_step_times(prof, args.profile_steps)
    gpu = sum(kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[: args.top]
    gaps = gap_report(prof, args.profile_steps, args.gaps) if args.gaps is not None else None
    return {"first_step": first, "steps": args.profile_steps, "step_kinds": kinds,
            "wall_ms_per_step_profiled": wall * 1e3, "gpu_kernel_ms_per_step": gpu,
            "host_ms_per_step": phases, "top_kernels_ms_per_step": dict(top),
            "gpu_gaps": gaps}


def summarize(records: list[dict]) -> dict[str, dict[str, float]]:
    out = {}
    for kind in KINDS:
        rs = [r for r in records if r["kind"] == kind]
        if rs:
            secs = sum(r["seconds"] for r in rs)
            out[kind] = {"steps": len(rs), "seconds": secs,
                         "decode_rows": sum(r["decode_rows"] for r in rs),
                         "prompt_tokens": sum(r["prompt_tokens"] for r in rs),
                         "mean_sequences": sum(r["sequences"] for r in rs) / len(rs),
                         "ms_per_step": 1e3 * secs / len(rs)}
    return out


def _allocator_stats(device: torch.device) -> dict[str, int] | None:
    """The caching allocator's counters over the run: a retry frees cached blocks with a
    device-wide synchronize, which stalls the overlapped steps."""
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    keys = ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free")
    return {k: int(stats.get(k, 0)) for k in keys}


def plot_timeline(records: list[dict], path: str) -> None:
    fig, ax = pyplot().subplots(figsize=(10, 4))
    for kind in KINDS:
        rs = [r for r in records if r["kind"] == kind]
        if rs:
            ax.scatter([r["step"] for r in rs], [1e3 * r["seconds"] for r in rs], s=4,
                       label=kind)
    ax.set_xlabel("step")
    ax.set_ylabel("step time (ms)")
    ax.set_yscale("log")
    ax.legend()
    save(fig, Path(path))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    engine, work = engine_with_workload(args, arrival_order=args.arrival_order)
    core = engine.core
    if args.gpu_clock and core.runner.device.type != "cuda":
        release_engine(engine)
        raise SystemExit("--gpu-clock needs a CUDA device (its clock is CUDA events)")
    if args.null_forward:
        install_null_forward(core, args.max_running_requests, engine.model_config.vocab_size,
                             args.seed)
    prof = cProfile.Profile() if args.cprofile else None
    t0 = time.perf_counter()
    try:
        if prof is not None:
            prof.enable()
        records, windows = run_steps(core, args, work.output_tokens)
    finally:
        if prof is not None:
            prof.disable()
            prof.dump_stats(args.cprofile)
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        seconds = time.perf_counter() - t0
        allocator = _allocator_stats(core.runner.device)
        release_engine(engine)
    classes = summarize(records)
    result = {"benchmark": "profile_offline", "model": args.model, "dataset": args.dataset,
              "submit_order": "arrival" if args.arrival_order else "longest_output_first",
              "num_prompts": args.num_prompts, "max_running_requests": args.max_running_requests,
              "seconds": seconds, "output_tokens": work.output_tokens,
              "output_tokens_per_s": work.output_tokens / seconds, "by_step_kind": classes,
              "profiles": windows, "allocator": allocator,
              "host_clock": summarize_bands(records, "host_ms", KINDS) if args.host_clock
              else None,
              "gpu_clock": summarize_bands(records, "gpu_ms", KINDS) if args.gpu_clock
              else None,
              "steps": records}
    _print(result)
    if args.plot:
        plot_timeline(records, args.plot)
    return write_json(args.out, result)


def _print(result: dict[str, Any]) -> None:
    total = sum(c["seconds"] for c in result["by_step_kind"].values()) or 1.0
    rows = [[k, c["steps"], c["seconds"], 100 * c["seconds"] / total, c["ms_per_step"],
             c["mean_sequences"], c["decode_rows"], c["prompt_tokens"]]
            for k, c in result["by_step_kind"].items()]
    print_table(["step kind", "steps", "seconds", "% of time", "ms/step", "mean seqs",
                 "decode rows", "prompt tokens"], rows,
                title=f"offline steps: {result['output_tokens_per_s']:.0f} output tok/s over "
                      f"{result['seconds']:.1f} s (profiled window included)")
    if result.get("host_clock"):
        names = [label for label, _, _ in HostClock.PHASES]
        print_table(["kind", "seqs", "steps", "step ms", *names, "sum"],
                    [[h["kind"], h["sequences"], h["steps"], h["step_ms"],
                      *(h["host_ms"].get(n, 0.0) for n in names), sum(h["host_ms"].values())]
                     for h in result["host_clock"]],
                    title="host phases per step (perf_counter, ms)")
    if result.get("gpu_clock"):
        print_table(["kind", "seqs", "steps", "step ms", "GPU span", "GPU idle before"],
                    [[g["kind"], g["sequences"], g["steps"], g["step_ms"],
                      g["gpu_ms"].get("span", 0.0), g["gpu_ms"].get("idle_before", 0.0)]
                     for g in result["gpu_clock"]],
                    title="GPU time per step (CUDA events on the compute stream, ms)")
    if result.get("allocator"):
        print("allocator:", result["allocator"])
    for w in result["profiles"]:
        print(f"profile of steps {w['first_step']}..+{w['steps']} {dict(w['step_kinds'])}: "
              f"wall {w['wall_ms_per_step_profiled']:.2f} ms/step, GPU kernels "
              f"{w['gpu_kernel_ms_per_step']:.2f} ms/step; host (ms): "
              + ", ".join(f"{k} {v:.2f}" for k, v in w["host_ms_per_step"].items()))
        for name, ms in w["top_kernels_ms_per_step"].items():
            print(f"{ms:8.3f} ms  {name[:110]}")
        if w.get("gpu_gaps") is not None:
            print_gaps(w["gpu_gaps"])


if __name__ == "__main__":
    main()
