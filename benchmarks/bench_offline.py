"""Offline throughput: every request submitted at once to the offline `Engine` API.

    python -m benchmarks.bench_offline --model llama-3.1-8b --load-format dummy \
        --num-prompts 1000 --dataset sharegpt-like --seed 0 --out offline.json

Prompts are random token ids (distinct, so no prefix-cache hits); each request generates
exactly its target length (`ignore_eos`). Datasets (see `benchmarks.common`):
  fixed          every request --input-len / --output-len
  sharegpt-like  seeded log-normal lengths: input median 220 (sigma 0.9, clipped to [4, 2048]),
                 output median 190 (sigma 0.8, clipped to [4, 1024])
Reports requests/s, input, output and total tokens/s over the wall time of `generate`.

`--hf` also runs `transformers` `generate` (random init) on the first --hf-num-prompts
requests in left-padded batches of --hf-batch-size; each batch runs to its longest output,
and only the requested tokens are counted (the padding and overshoot are transformers' cost).
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from benchmarks.common import (
    add_engine_args,
    add_model_args,
    add_workload_args,
    engine_from_args,
    fmt,
    make_workload,
    print_table,
    release_engine,
    write_json,
)
from benchmarks.gc_pauses import GcPauses
from benchmarks.gpu_busy import GpuBusySampler, add_gpu_busy_arg, format_busy, gpus_to_sample
from phaseflip import Engine, SamplingParams
from phaseflip.engine.warmup import warm_up


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    add_workload_args(ap)
    add_engine_args(ap)
    ap.add_argument("--num-warmup", type=int, default=4,
                    help="short requests run first so one-time costs stay out of the timing "
                         "(after the server's launch warm-up; 0 runs neither)")
    ap.add_argument("--max-duration-s", type=float, default=None,
                    help="stop after this long and report the partial run (marked partial)")
    ap.add_argument("--hf", action="store_true", help="also measure transformers generate")
    ap.add_argument("--hf-num-prompts", type=int, default=64)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--hf-max-duration-s", type=float, default=None,
                    help="start no transformers batch after this long; the rates then cover "
                         "the batches done (marked partial)")
    add_gpu_busy_arg(ap)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    return ap.parse_args(argv)


def _rates(n: int, tokens_in: int, tokens_out: int, seconds: float) -> dict[str, float]:
    return {
        "num_requests": n,
        "input_tokens": tokens_in,
        "output_tokens": tokens_out,
        "duration_s": seconds,
        "requests_per_s": n / seconds,
        "input_tokens_per_s": tokens_in / seconds,
        "output_tokens_per_s": tokens_out / seconds,
        "total_tokens_per_s": (tokens_in + tokens_out) / seconds,
    }


class _DeadlineReached(Exception):
    pass


class Progress:
    """Counts what `engine.core.step` produced, and stops the run at a deadline.

    Wraps the step (an instance attribute, removed on exit) so a budget-limited run can still
    report what it did: requests finished, prompt tokens of requests that got their first
    token, output tokens. Such a run's rates cover a mostly full batch, so they overstate the
    rates of the whole run (whose tail runs with few requests): they are reported as partial.
    """

    def __init__(self, engine: Engine, deadline: float | None) -> None:
        self.core, self.deadline = engine.core, deadline
        self.prompt_lens: dict[str, int] | None = None
        self.started: set[str] = set()
        self.finished = 0
        self.output_tokens = 0
        self.steps = 0

    def __enter__(self) -> Progress:
        step = self.core.step

        def counted() -> list:
            if self.prompt_lens is None:  # every request of the run is queued by now
                self.prompt_lens = {r: len(g.prompt_ids) for r, g in self.core.groups.items()}
            if self.deadline is not None and time.perf_counter() > self.deadline:
                raise _DeadlineReached
            deltas = step()
            self.steps += 1
            for d in deltas:
                self.output_tokens += len(d.token_ids)
                if d.token_ids:
                    self.started.add(d.request_id)
                self.finished += d.usage is not None
            return deltas

        self.core.step = counted
        return self

    def __exit__(self, *exc: object) -> None:
        self.core.__dict__.pop("step", None)
        self.core = None  # the engine's memory must be free for the transformers run

    @property
    def input_tokens(self) -> int:
        lens = self.prompt_lens or {}
        return sum(lens.get(r, 0) for r in self.started)


def run_hf(model_dir: str, dtype: torch.dtype, device: torch.device, prompts: list[list[int]],
           output_lens: list[int], batch_size: int, max_duration_s: float | None = None
           ) -> dict[str, Any]:
    """transformers `generate` over `prompts` in batches; after `max_duration_s` no new batch
    starts and the rates cover the batches done (the requests are in random order, so those
    are a sample of the workload)."""
    from benchmarks.bench_latency import _hf_model

    model = _hf_model(model_dir, dtype, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    done = 0
    for i in tqdm(range(0, len(prompts), batch_size), desc="transformers", unit="batch"):
        if done and max_duration_s is not None and time.perf_counter() - t0 > max_duration_s:
            break  # (one batch always runs)
        batch, outs = prompts[i:i + batch_size], output_lens[i:i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for j, p in enumerate(batch):  # left padding, as decoder-only generation needs
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        with torch.inference_mode():
            model.generate(ids.to(device), attention_mask=mask.to(device),
                           max_new_tokens=max(outs), min_new_tokens=max(outs), do_sample=False,
                           pad_token_id=0)
        done = i + len(batch)
    sync()
    seconds = time.perf_counter() - t0
    del model
    gc.collect()
    rates = _rates(done, sum(map(len, prompts[:done])), sum(output_lens[:done]), seconds)
    rates["complete"] = done == len(prompts)
    return rates


@dataclass
class _TimedRun:
    """What the timed `generate` left: its outputs (None when the deadline cut it short)."""

    outs: list | None
    t0: float
    seconds: float
    sampler: GpuBusySampler
    progress: Progress
    pauses: GcPauses


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    engine = engine_from_args(args)
    m = engine.model_config
    max_context = engine.core.max_context
    work = make_workload(args.dataset, args.num_prompts, args.input_len, args.output_len,
                         m.vocab_size, args.seed, max_context)
    # Unseeded: a seeded row gets a generator of its own every step; the engine-wide generator
    # (seeded by --seed) keeps the run reproducible without that per-row cost.
    params = [SamplingParams(max_new_tokens=n, temperature=args.temperature, ignore_eos=True)
              for n in work.output_lens]
    dtype, device = engine.core.runner.dtype, engine.core.runner.device
    run = _timed_run(engine, args, work, params, device)
    progress, seconds = run.progress, run.seconds
    rates = _run_rates(work, run.outs, progress, seconds)
    step_s = seconds / progress.steps if progress.steps else None  # mean wall time of a step
    busy = run.sampler.summary([(run.t0, run.t0 + seconds)], step_s)
    if run.outs is None:
        print(f"stopped at --max-duration-s {args.max_duration_s}: PARTIAL run, "
              f"{progress.finished}/{len(work.prompts)} requests finished")
    result = _run_description(args, engine, work, dtype, device)
    result.update({
        "phaseflip": rates,
        "engine_steps": progress.steps,
        "submit_order": "longest_output_first",  # Engine.generate's (before 2026-12-06: given)
        "gpu_busy": busy,  # per GPU over the whole run, NVML (see benchmarks.gpu_busy)
        "host_bubble_ms_per_step": busy["host_bubble_ms_per_step"],  # estimate, worst GPU
        "gc": run.pauses.summary(),  # this process's collector passes during the run
        "hf": None,
    })
    if args.hf:  # shown and saved first: the reference run may fail on its own
        _print(result)
        write_json(args.out, result)
        n = min(args.hf_num_prompts, len(work.prompts))
        result["hf"] = run_hf(m.model_dir, dtype, device, work.prompts[:n], work.output_lens[:n],
                              args.hf_batch_size, args.hf_max_duration_s)
        result["hf"]["batch_size"] = args.hf_batch_size
    _print(result)
    return write_json(args.out, result)


def _timed_run(engine: Engine, args: argparse.Namespace, work: Any,
               params: list[SamplingParams], device: torch.device) -> _TimedRun:
    """Warms up, then times `generate` over the workload; the engine is released either way."""
    gpus, why_not = gpus_to_sample(engine, args.gpu_busy)
    try:
        if args.num_warmup:
            _warm(engine, args.num_warmup, args.seed)
        outs = None
        with GpuBusySampler(gpus, note=why_not) as sampler, \
                Progress(engine, None) as progress, GcPauses() as pauses:
            # the clock starts here: the sampler's start (an nvidia-smi child) is not the run's
            t0 = time.perf_counter()
            progress.deadline = t0 + args.max_duration_s if args.max_duration_s else None
            try:
                outs = engine.generate(work.prompts, params, use_tqdm=True)
            except _DeadlineReached:
                pass
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
    finally:
        release_engine(engine)
    return _TimedRun(outs, t0, seconds, sampler, progress, pauses)


def _run_description(args: argparse.Namespace, engine: Engine, work: Any, dtype: torch.dtype,
                     device: torch.device) -> dict[str, Any]:
    """The result's leading keys: what ran, on what, with which workload."""
    m = engine.model_config
    return {
        "benchmark": "offline",
        "model": args.model or m.model_dir,
        "model_dir": m.model_dir,
        "load_format": args.load_format,
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "tp_size": engine.config.tp_size,
        "pp_size": engine.config.pp_size,
        "dataset": args.dataset,
        "seed": args.seed,
        "temperature": args.temperature,
        "input_lens": [len(p) for p in work.prompts],
        "output_lens": work.output_lens,
        "num_prompts": len(work.prompts),
    }


def _warm(engine: Any, num_prompts: int, seed: int) -> None:
    """The server's launch warm-up, then a short batch: the batch alone never mixes an extend
    with decodes, and on the H200 the mixed route's decode kernels then compiled inside the
    timed run (one 1.5 s step, FP8 8B, cold Triton cache)."""
    warm_up(engine.core)
    max_context = engine.core.max_context
    warm = make_workload("fixed", num_prompts, min(64, max_context // 2), 4,
                         engine.model_config.vocab_size, seed + 99, max_context)
    engine.generate(warm.prompts, SamplingParams(max_new_tokens=4, ignore_eos=True),
                    use_tqdm=False)


def _run_rates(work: Any, outs: list | None, progress: Any, seconds: float) -> dict[str, Any]:
    """The run's rates: of the whole workload (every token checked in) when `outs` came
    back, else of the requests finished before the deadline (`complete` False)."""
    if outs is not None:
        produced = sum(len(o.token_ids) for o in outs)
        if produced != work.output_tokens:
            raise RuntimeError(f"expected {work.output_tokens} output tokens, got {produced}")
        rates = _rates(len(work.prompts), work.input_tokens, work.output_tokens, seconds)
    else:
        rates = _rates(progress.finished, progress.input_tokens, progress.output_tokens, seconds)
        rates["requests_started"] = len(progress.started)
    rates["complete"] = outs is not None
    return rates


def _print(result: dict[str, Any]) -> None:
    headers = ["engine", "requests", "in tokens", "out tokens", "seconds", "req/s", "in tok/s",
               "out tok/s", "total tok/s", "GPU busy % (NVML)", "host bubble ms/step (est.)"]
    busy = result.get("gpu_busy") or {}
    rows = []
    for name, key in (("phaseflip", "phaseflip"), ("transformers", "hf")):
        r = result.get(key)
        if r:
            rows.append([name + ("" if r.get("complete", True) else " (PARTIAL)"),
                         r["num_requests"], r["input_tokens"], r["output_tokens"],
                         r["duration_s"], r["requests_per_s"], r["input_tokens_per_s"],
                         r["output_tokens_per_s"], r["total_tokens_per_s"],
                         *((format_busy(busy), busy.get("host_bubble_ms_per_step"))
                           if key == "phaseflip" else ("-", None))])
    print_table(headers, rows, title=(
        f"offline throughput: {result['model']} ({result['load_format']}, {result['dtype']}, "
        f"{result['device']}, tp={result['tp_size']} pp={result['pp_size']}), "
        f"dataset {result['dataset']}"))
    gcs = result.get("gc")
    if gcs:
        print(f"garbage collector during the run: {gcs['passes']} passes, {gcs['total_ms']} ms, "
              f"longest {gcs['max_ms']} ms; full passes (ms): {gcs['oldest_generation_ms']}")
    if busy.get("devices") is not None and busy["note"]:  # on GPUs: why a figure is missing
        print(f"GPU busy (whole run, mean step {fmt(busy['step_ms'])} ms): {busy['note']}")
    ours, hf = result.get("phaseflip"), result.get("hf")
    if ours and hf and hf["output_tokens_per_s"] > 0:
        print(f"phaseflip / transformers, output tok/s: "
              f"{ours['output_tokens_per_s'] / hf['output_tokens_per_s']:.1f}x")


if __name__ == "__main__":
    main()
