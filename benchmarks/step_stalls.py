"""Where an offline run's slow engine steps come from: each step over `--threshold-ms`, with
the garbage collector's time inside it, the CUDA allocator's new segments and retries, and the
Triton kernels compiled during it (new entries in the Triton cache).

    python -m benchmarks.step_stalls --model llama-3.1-8b --load-format dummy --num-prompts 1000 \\
        --dataset sharegpt-like --mem-fraction 0.85 --max-running-requests 1024 \\
        [--engine-arg quantization=fp8] --runs 2 --out stalls.json

The engine is built and warmed as a server's is (`engine.warmup.warm_up`), then the seeded
workload runs `--runs` times in the same process (each run a new draw, `--seed` + run), so a
second run shows what the first one's compiles and allocations left behind. A step that is
slow with none of the three inside it is the GPU's own (a full mixed step) or the host's.
"""

from __future__ import annotations

import argparse
import glob
import os
import time
from typing import Any

import torch

from benchmarks.common import (
    add_engine_args,
    add_model_args,
    add_workload_args,
    engine_from_args,
    make_workload,
    print_table,
    release_engine,
    write_json,
)
from benchmarks.gc_pauses import GcPauses
from phaseflip import Engine, SamplingParams
from phaseflip.engine.warmup import warm_up


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    add_workload_args(ap)
    add_engine_args(ap)
    ap.add_argument("--threshold-ms", type=float, default=200.0,
                    help="steps at least this long are listed")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def triton_cache_entries() -> int:
    """Compiled kernels in the Triton cache (one JSON of metadata per kernel variant)."""
    root = os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")
    return len(glob.glob(os.path.join(root, "*", "*.json")))


class StepStalls:
    """Wraps `core.step`: the steps over the threshold, each with what happened inside it."""

    def __init__(self, core: Any, threshold_ms: float, pauses: GcPauses) -> None:
        self.core, self.threshold_ms, self.pauses = core, threshold_ms, pauses
        self.cuda = core.runner.device.type == "cuda"
        self.steps = 0
        self.slow: list[dict[str, Any]] = []
        self._step = core.step
        core.step = self._timed

    def _allocator(self) -> tuple[int, int]:
        if not self.cuda:
            return 0, 0
        stats = torch.cuda.memory_stats()
        return stats.get("segment.all.allocated", 0), stats.get("num_alloc_retries", 0)

    def _timed(self, *args: Any, **kwargs: Any) -> Any:
        running = len(self.core.scheduler.running)
        segments, retries = self._allocator()
        gc_ms, kernels = self.pauses.total_ms(), triton_cache_entries()
        t0 = time.perf_counter()
        out = self._step(*args, **kwargs)
        ms = 1e3 * (time.perf_counter() - t0)
        self.steps += 1
        if ms >= self.threshold_ms:
            now_segments, now_retries = self._allocator()
            self.slow.append({
                "step": self.steps, "ms": round(ms, 2), "running": running,
                "gc_ms": round(self.pauses.total_ms() - gc_ms, 2),
                "new_segments": now_segments - segments, "alloc_retries": now_retries - retries,
                "compiled": triton_cache_entries() - kernels})
        return out

    def close(self) -> None:
        self.core.step = self._step


def run_once(engine: Engine, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    core = engine.core
    work = make_workload(args.dataset, args.num_prompts, args.input_len, args.output_len,
                         engine.model_config.vocab_size, seed, core.max_context)
    params = [SamplingParams(max_new_tokens=n, temperature=args.temperature, ignore_eos=True)
              for n in work.output_lens]
    with GcPauses() as pauses:
        stalls = StepStalls(core, args.threshold_ms, pauses)
        try:
            t0 = time.perf_counter()
            engine.generate(work.prompts, params, use_tqdm=False)
            if stalls.cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
        finally:
            stalls.close()
    return {"seed": seed, "seconds": round(seconds, 3), "steps": stalls.steps,
            "output_tok_per_s": round(work.output_tokens / seconds, 1), "gc": pauses.summary(),
            "slow_steps": stalls.slow}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    engine = engine_from_args(args)
    try:
        warm_up(engine.core)
        runs = [run_once(engine, args, args.seed + i) for i in range(args.runs)]
    finally:
        release_engine(engine)
    for i, r in enumerate(runs, 1):
        print_table(["step", "ms", "running", "GC ms", "new segments", "retries", "compiled"],
                    [[s["step"], s["ms"], s["running"], s["gc_ms"], s["new_segments"],
                      s["alloc_retries"], s["compiled"]] for s in r["slow_steps"]],
                    title=f"run {i}: {r['seconds']} s, {r['output_tok_per_s']} output tok/s, "
                          f"{r['steps']} steps; steps >= {args.threshold_ms:g} ms")
        print(f"run {i} garbage collector: {r['gc']}")
    return write_json(args.out, {"benchmark": "step_stalls", "model": args.model,
                                 "threshold_ms": args.threshold_ms, "runs": runs})


if __name__ == "__main__":
    main()
