"""Where a decode step's time goes: torch.profiler over a few steps of a full decode batch.

    python -m benchmarks.profile_decode --model llama-3.1-8b --load-format dummy \
        --batch-size 64 --input-len 1024 --steps 8 --out profile_bs64.json

Submits `--batch-size` requests, steps the engine until every one is decoding, then profiles
`--steps` engine steps. Prints (and writes as JSON) the wall time per step, the GPU kernel time
per step (sum of kernel durations: GPU busy time, since one stream runs them), the engine phases'
host time per step (`schedule`, `forward`, `sample`, `outputs`, from profiler ranges wrapped
around the engine's calls by this script only), and the top kernels by GPU time. `--trace`
also writes a Chrome trace.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.common import (
    add_model_args,
    parse_engine_args,
    random_prompts,
    sized_engine,
    wrap_method,
    write_json,
)
from benchmarks.gpu_gaps import gap_report, print_gaps
from phaseflip import Engine, SamplingParams

# (label, owner attribute of the core, method); an overlapped step samples on the device and
# waits for the previous step's tokens in `OutputProcessor.take_tokens` (the "tokens" range)
PHASES = [("schedule", "scheduler", "schedule"), ("forward", "runner", "forward"),
          ("sample", "sampling", "sample"), ("sample", "sampling", "sample_ahead"),
          ("tokens", "outputs", "take_tokens")]


def wrap_phases(core: Any) -> None:
    """Profiler ranges around the engine's schedule/forward/sample calls (this core only)."""
    for label, owner, name in PHASES:
        obj = core if owner is None else getattr(core, owner)
        wrap_method(obj, name, lambda label=label: record_function(f"phase:{label}"))


def per_step_times(prof: Any, steps: int) -> tuple[dict[str, float], dict[str, float]]:
    """(GPU time per kernel name, host time per phase), in ms per step, from a profile of
    `steps` engine steps each wrapped in a "phase:step" range."""
    kernels: dict[str, float] = defaultdict(float)
    phases: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.name.startswith("phase:") and ev.device_type == torch.autograd.DeviceType.CUDA:
            continue  # the ranges' own GPU-side spans, not kernels
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels[ev.name] += ev.device_time / 1e3 / steps
        elif ev.name.startswith("phase:"):
            phases[ev.name[6:]] += ev.cpu_time_total / 1e3 / steps
    if "step" in phases:  # everything the wrapped phases do not cover: outputs, detokenize
        phases["other"] = phases["step"] - sum(v for k, v in phases.items() if k != "step")
    return dict(kernels), dict(phases)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--mem-fraction", type=float, default=0.6)
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--top", type=int, default=20, help="kernels listed")
    ap.add_argument("--trace", default=None, help="write a Chrome trace here")
    ap.add_argument("--gaps", type=float, default=None, metavar="US",
                    help="list the GPU's idle gaps of at least US µs and what the host did")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    opts = {"load_format": args.load_format, "device": args.device, "dtype": args.dtype,
            "mem_fraction": args.mem_fraction, "max_running_requests": args.batch_size,
            "max_model_len": args.input_len + 4 * args.steps + 64}
    opts.update(parse_engine_args(args.engine_arg))
    engine = sized_engine(args.model, opts, "--input-len + 4 * --steps + 64")
    try:  # a failed run must not leave the engine's ranks and memory behind
        return _profile(engine, args)
    finally:
        engine.shutdown()


def _profile(engine: Engine, args: argparse.Namespace) -> dict[str, Any]:
    core = engine.core
    _fill_decode_batch(core, args, engine.model_config.vocab_size)
    cuda = core.runner.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()  # the profiler slows the host: time the same steps without it
    for _ in range(args.steps):
        core.step()
    sync()
    bare = (time.perf_counter() - t0) / args.steps
    wrap_phases(core)
    prof, wall = _profiled_steps(core, args.steps, cuda, sync)
    if args.trace:
        prof.export_chrome_trace(args.trace)
    kernels, phases = per_step_times(prof, args.steps)
    gpu_ms = sum(kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[: args.top]
    gaps = gap_report(prof, args.steps, args.gaps) if args.gaps is not None else None
    result = {
        "batch_size": args.batch_size, "input_len": args.input_len, "steps": args.steps,
        "wall_ms_per_step": bare * 1e3, "wall_ms_per_step_profiled": wall * 1e3,
        "gpu_kernel_ms_per_step": gpu_ms, "gpu_busy_fraction": gpu_ms / (bare * 1e3),
        "host_ms_per_step": dict(phases),
        "top_kernels_ms_per_step": dict(top),
        "gpu_gaps": gaps,
    }
    _print_report(args, bare, wall, gpu_ms, phases, top, gaps)
    if args.out:
        write_json(args.out, result)
    return result


def _fill_decode_batch(core: Any, args: argparse.Namespace, vocab: int) -> None:
    """Submits the batch and steps until every request is decoding, then a few steps more."""
    params = SamplingParams(max_new_tokens=4 * args.steps + 32, temperature=args.temperature,
                            ignore_eos=True)
    for i, p in enumerate(random_prompts([args.input_len] * args.batch_size, vocab, 1)):
        core.add_request(f"r{i}", p, params)
    while len(core.scheduler.running) < args.batch_size or any(
            r.kv_len < len(r.prompt_ids) for r in core.scheduler.running):
        core.step()
    for _ in range(3):  # warm: every step from here on is a full decode batch
        core.step()


def _profiled_steps(core: Any, steps: int, cuda: bool,
                    sync: Callable[[], None]) -> tuple[Any, float]:
    """(the profile, wall seconds per step under it) of `steps` steps, each a "phase:step"."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            with record_function("phase:step"):
                core.step()
        sync()
        wall = (time.perf_counter() - t0) / steps
    return prof, wall


def _print_report(args: argparse.Namespace, bare: float, wall: float, gpu_ms: float,
                  phases: dict[str, float], top: list[tuple[str, float]],
                  gaps: dict[str, Any] | None) -> None:
    print(f"batch {args.batch_size}, context ~{args.input_len}: wall {bare * 1e3:.2f} ms/step "
          f"({wall * 1e3:.2f} profiled), GPU kernels {gpu_ms:.2f} ms/step "
          f"({100 * gpu_ms / (bare * 1e3):.1f} % busy)")
    print("host time per step, profiled (ms): "
          + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
    for name, ms in top:
        print(f"{ms:8.3f} ms  {name[:110]}")
    if gaps is not None:
        print_gaps(gaps)


if __name__ == "__main__":
    main()
