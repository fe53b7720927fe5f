"""Host (Python) overhead of one decode step, split by phase, with a full decode batch.

    python -m benchmarks.bench_scheduler --device cpu --null-forward \
        --num-requests 1,64,256 --sampling greedy,sample,penalties,logprobs --out sched.json

Builds an `EngineCore` (the bundled tiny model, or any `--model` with `--load-format dummy`),
submits N requests with short random prompts and outputs long enough never to finish
(`ignore_eos`), steps until all N are decoding, then times `--steps` decode steps. Each step
(the real `EngineCore.step`, unmodified) is split from outside by wrapping the calls it makes:

  schedule  `scheduler.schedule()`: decode-slot check, KV allocation, the ForwardBatch tensors
  forward   `runner.forward(plan)` (with `--null-forward`: precomputed logits, so ~0)
  sample    `SamplingStep.sample`: per-row inputs, `Sampler.sample`, the token lists
  text      `OutputProcessor.emit_text`, where the engine defers detokenisation to overlap
            the forward
  output    the rest of the step: prompt logprobs, `advance`, append/detokenize/stop, deltas
  total     the whole `step()` call

Wall time (`time.perf_counter`) and CPU time (`time.process_time`, all threads of the process,
so torch's intra-op threads can make it exceed wall) are reported as per-step median and p90.
`--null-forward` swaps the runner's forward for one returning rows of a precomputed random
logits matrix of the right shape: what is left is pure host overhead, the number that overlap
scheduling must hide behind the GPU's forward. With it torch runs on one thread (`--threads`):
the host work is one thread's, and on a shared machine idle intra-op threads add milliseconds
of spin and wake-up noise. On a CPU the sampler's tensor math (argmax, the top-k/top-p sort,
the noise) is real compute here that a GPU would run as kernels: compare presets knowing that.

`--profile FILE` runs cProfile over the timed steps of the last configuration and writes the
stats there (and prints the top functions by cumulative and own time).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import (
    add_model_args,
    print_table,
    random_prompts,
    step_until_decoding,
    summarize,
    write_json,
)
from phaseflip.config import EngineConfig
from phaseflip.engine.core import EngineCore
from phaseflip.model.config import ModelConfig
from phaseflip.model.loader import load_tokenizer
from phaseflip.model.resolve import resolve_model
from phaseflip.sampling.params import SamplingParams

PHASES = ("schedule", "forward", "sample", "text", "output", "total")
_TIMED = ("schedule", "forward", "sample", "text")  # wrapped calls; output is the remainder

# Sampling presets, one per sampler path: argmax only; temperature with top-k/top-p filtering
# (a [B, V] sort) and the exponential race; per-request seeded noise (no filtering, so the
# per-row generators are what is measured); repetition/frequency/presence penalties (greedy,
# so the logit edits are what is measured); logprob reporting.
SAMPLING_PRESETS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "sample": {"temperature": 0.8, "top_p": 0.9, "top_k": 50},
    "seeded": {"temperature": 0.8, "seed": 1234},
    "penalties": {"temperature": 0.0, "repetition_penalty": 1.1, "frequency_penalty": 0.5,
                  "presence_penalty": 0.3},
    "logprobs": {"temperature": 0.0, "logprobs": 5},
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--num-requests", default="256",
                    help="comma-separated decode batch sizes, e.g. 1,64,256")
    ap.add_argument("--sampling", default="greedy",
                    help=f"comma-separated presets: {', '.join(SAMPLING_PRESETS)}")
    ap.add_argument("--steps", type=int, default=100, help="timed decode steps")
    ap.add_argument("--warmup-steps", type=int, default=10,
                    help="decode steps run (untimed) after every request is decoding")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--null-forward", action="store_true",
                    help="replace the model forward by precomputed random logits")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads; default 1 with --null-forward (host overhead is "
                         "one thread's work, and idle intra-op threads spinning on a shared "
                         "machine add noise of milliseconds), else torch's default")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default=None, metavar="FILE",
                    help="cProfile the timed steps of the last configuration into FILE")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    return ap.parse_args(argv)


class StepTimer:
    """Times the phases of `EngineCore.step` by wrapping, on the instance only, the calls the
    step makes; `uninstall` restores the originals. Nothing in the engine is modified."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.current = {p: [0.0, 0.0] for p in PHASES}
        self._installed: list[tuple[Any, str]] = []

    def _wrap(self, owner: Any, attr: str, phase: str) -> None:
        fn: Callable[..., Any] = getattr(owner, attr)
        acc = self.current[phase]

        def timed(*args: Any, **kwargs: Any) -> Any:
            w0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[0] += time.perf_counter() - w0
                acc[1] += time.process_time() - c0

        setattr(owner, attr, timed)
        self._installed.append((owner, attr))

    def install(self) -> StepTimer:
        self._wrap(self.core.scheduler, "schedule", "schedule")
        self._wrap(self.core.runner, "forward", "forward")
        self._wrap(self.core.sampling, "sample", "sample")
        self._wrap(self.core.outputs, "emit_text", "text")
        return self

    def uninstall(self) -> None:
        for owner, attr in self._installed:
            owner.__dict__.pop(attr, None)
        self._installed.clear()

    def step(self) -> tuple[dict[str, tuple[float, float]], int]:
        """One engine step; returns {phase: (wall_s, cpu_s)} and the number of deltas."""
        for acc in self.current.values():
            acc[0] = acc[1] = 0.0
        w0, c0 = time.perf_counter(), time.process_time()
        deltas = self.core.step()
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        out = {p: (self.current[p][0], self.current[p][1]) for p in _TIMED}
        out["output"] = (wall - sum(v[0] for v in out.values()),
                         cpu - sum(v[1] for v in out.values()))
        out["total"] = (wall, cpu)
        return out, len(deltas)


def install_null_forward(core: EngineCore, max_rows: int, vocab: int, seed: int) -> None:
    """Replaces `core.runner.forward` by rows of a precomputed random logits matrix. The window
    moves every call so sampled tokens vary from step to step (as real decoding does)."""
    gen = torch.Generator().manual_seed(seed)
    spare = 61  # window offsets cycle through this many values
    table = torch.randn(max_rows + spare, vocab, generator=gen) * 4.0
    calls = [0]

    def null_forward(plan: Any, future: Any = None) -> torch.Tensor:
        rows = int(plan.logits_indices.numel())
        off = calls[0] % spare
        calls[0] += 1
        return table[off : off + rows]

    core.runner.forward = null_forward


def build_core(args: argparse.Namespace, num_requests: int, max_new: int) -> EngineCore:
    need_tokens = num_requests * (args.prompt_len + max_new + args.page_size + 1)
    cfg = resolve_model(EngineConfig(
        **({"model": args.model} if args.model else {}),
        load_format=args.load_format, device=args.device, dtype=args.dtype,
        max_running_requests=max(num_requests, 1), max_total_tokens=need_tokens,
        page_size=args.page_size, seed=args.seed,
    ))
    model_cfg = ModelConfig.from_dir(cfg.model)
    return EngineCore(cfg, model_cfg, load_tokenizer(cfg.model))


def run_config(args: argparse.Namespace, num_requests: int, preset: str,
               profile: cProfile.Profile | None) -> dict[str, Any]:
    max_new = args.warmup_steps + args.steps + 8  # never finishes inside the measured window
    core = build_core(args, num_requests, max_new)
    if core.max_context < args.prompt_len + max_new + 1:
        raise SystemExit(f"--prompt-len + --steps + --warmup-steps exceed the model's context "
                         f"({core.max_context}); use fewer steps")
    vocab = core.model_cfg.vocab_size
    if args.null_forward:
        install_null_forward(core, num_requests, vocab, args.seed)
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True, **SAMPLING_PRESETS[preset])
    prompts = random_prompts([args.prompt_len] * num_requests, vocab, args.seed)
    for i, ids in enumerate(prompts):
        core.add_request(f"r{i}", ids, params)

    step_until_decoding(core, num_requests, args.warmup_steps)

    timer = StepTimer(core).install()
    samples: dict[str, list[tuple[float, float]]] = {p: [] for p in PHASES}
    gc.collect()
    if profile is not None:
        profile.enable()
    for _ in range(args.steps):
        phases, n_deltas = timer.step()
        if n_deltas != num_requests:
            raise RuntimeError(f"a decode step produced {n_deltas} deltas, not {num_requests}")
        for p in PHASES:
            samples[p].append(phases[p])
    if profile is not None:
        profile.disable()
    timer.uninstall()
    if any(r.finished for r in core.scheduler.running) or core.scheduler.stats.retractions:
        raise RuntimeError("the measured window was not a steady full decode batch")

    result: dict[str, Any] = {"num_requests": num_requests, "sampling": preset,
                              "params": SAMPLING_PRESETS[preset], "phases": {}}
    for p in PHASES:
        wall = [w * 1e3 for w, _ in samples[p]]
        cpu = [c * 1e3 for _, c in samples[p]]
        result["phases"][p] = {"wall_ms": summarize(wall), "cpu_ms": summarize(cpu)}
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    threads = args.threads or (1 if args.null_forward else None)
    if threads:
        torch.set_num_threads(threads)
    sizes = [int(x) for x in args.num_requests.split(",") if x]
    presets = [x for x in args.sampling.split(",") if x]
    unknown = [p for p in presets if p not in SAMPLING_PRESETS]
    if unknown:
        raise SystemExit(f"unknown --sampling {unknown}; known: {', '.join(SAMPLING_PRESETS)}")
    configs = [(n, s) for n in sizes for s in presets]
    results = []
    for i, (n, preset) in enumerate(configs):
        profile = cProfile.Profile() if args.profile and i == len(configs) - 1 else None
        results.append(run_config(args, n, preset, profile))
        if profile is not None:
            profile.dump_stats(args.profile)
            stats = pstats.Stats(profile).strip_dirs()
            print(f"\ncProfile of {args.steps} steps (N={n}, {preset}) -> {args.profile}")
            stats.sort_stats("cumulative").print_stats(25)
            stats.sort_stats("tottime").print_stats(25)

    headers = ["N", "sampling", *(f"{p} p50/p90" for p in PHASES)]
    for unit in ("wall_ms", "cpu_ms"):
        rows = []
        for r in results:
            cells = []
            for p in PHASES:
                s = r["phases"][p][unit]
                cells.append(f"{s['p50']:.3f} / {s['p90']:.3f}")
            rows.append([r["num_requests"], r["sampling"], *cells])
        kind = "null forward" if args.null_forward else "real forward"
        print_table(headers, rows, title=f"Per decode step, {unit[:-3]} ms ({kind}, "
                                         f"{args.steps} steps, median / p90)")
    return write_json(args.out, {
        "benchmark": "scheduler_overhead",
        "null_forward": args.null_forward,
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "prompt_len": args.prompt_len,
        "page_size": args.page_size,
        "torch_threads": torch.get_num_threads(),
        "results": results,
    })


if __name__ == "__main__":
    main()
