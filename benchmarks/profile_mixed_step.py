"""Where a serving mixed step's time goes: one new prompt joining a running decode batch.

    python -m benchmarks.profile_mixed_step --model llama-3.1-8b --load-format dummy \
        --mem-fraction 0.6 --engine-arg quantization=fp8 --engine-arg kv_cache_dtype=fp8_e4m3 \
        --out mixed.json

Keeps `--decodes` background requests decoding (prompts of `--context` tokens), then, for each
`--mixed-decode` setting (the Triton backend's `mixed_decode`: a mixed batch's one-token rows
through the decode kernel, or through the extend kernel with the prompt) and each
`--prompt-lens` length, adds one new request at a time (a fresh random prompt: no prefix-cache
hit) and measures, `--repeats` times:

  ttft      from `add_request` to the new request's first token delivered to the step's sink
            (what a streaming client gets, minus HTTP), the steps run without syncs, so an
            overlapped engine (`overlap_schedule`) launches the next step meanwhile as it would
            when serving; `decode gap` is the longest wait between two tokens of the
            background decodes over the same steps (the inter-token gap the mixed step makes)
  mixed     the wall of the step that carries the prompt, the device synchronized before and
            after it (the step's own time, launch and kernels); `forward host` is the host
            time of its `runner.forward` call alone (kernels queued, not awaited): near the
            wall, the step is bound by launching, not by the GPU
  decode    a decode-only step's wall once the new request is done (steps back to back, one
            sync at each end, as `profile_decode`): the baseline the mixed step is against

Then one torch.profiler window over one mixed step per (setting, length) gives the kernel time
sum, the number of kernel launches (and per layer), memcpys, the host time of the engine's
phases and of the launch API calls, and the top kernels; and cProfile over 3 mixed steps at the
middle length (`mixed_decode` on) lists the Python functions by own time (`--cprofile-top`).
A backend without `mixed_decode` (the torch reference on CPU) runs once, as setting "n/a".
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.common import (
    REPO_ROOT,
    add_model_args,
    parse_engine_args,
    print_table,
    random_prompts,
    release_engine,
    step_until_decoding,
    summarize,
    write_json,
)
from benchmarks.profile_decode import per_step_times, wrap_phases
from benchmarks.profile_offline import StepLog
from phaseflip import Engine, SamplingParams

PROBE_NEW_TOKENS = 2  # the new request's output: its first token, then one decode step
BG_PREFIX, PROBE_PREFIX = "bg", "probe"
CPROFILE_STEPS = 3


def _csv_ints(v: str) -> list[int]:
    return [int(x) for x in v.split(",") if x]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--mem-fraction", type=float, default=None)
    ap.add_argument("--decodes", type=int, default=6, help="background requests decoding")
    ap.add_argument("--context", type=int, default=500, help="background prompts' length")
    ap.add_argument("--prompt-lens", type=_csv_ints, default=[32, 300, 1000])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mixed-decode", default="on,off",
                    help="settings of the backend's mixed_decode to A/B (on, off, or both)")
    ap.add_argument("--decode-steps", type=int, default=8, help="decode-only steps timed")
    ap.add_argument("--cprofile-top", type=int, default=30)
    ap.add_argument("--top", type=int, default=10, help="kernels listed per profile")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.mixed_decode = [s.strip() for s in args.mixed_decode.split(",") if s.strip()]
    if not set(args.mixed_decode) <= {"on", "off"} or not args.mixed_decode:
        ap.error("--mixed-decode takes on, off or on,off")
    return args


@dataclass
class Deliveries:
    """A step sink that timestamps what a streaming client would receive."""

    probe: str
    first_token_s: float | None = None
    bg_s: list[float] = field(default_factory=list)  # each delivery of background tokens

    def __call__(self, deltas: list) -> None:
        now, bg = time.perf_counter(), False
        for d in deltas:
            if not d.token_ids:
                continue
            if d.request_id == self.probe:
                if self.first_token_s is None:
                    self.first_token_s = now
            else:
                bg = True
        if bg:
            self.bg_s.append(now)


class ForwardTimer:
    """The host time of each `runner.forward` call (this core's runner only): on CUDA the
    forward returns once its kernels are queued, so a mixed step whose forward takes as long
    on the host as the whole step is bound by launching, not by the GPU. No profiler runs."""

    def __init__(self, runner: Any) -> None:
        self.last_ms: float | None = None
        forward = runner.forward

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return forward(*a, **kw)
            finally:
                self.last_ms = 1e3 * (time.perf_counter() - t0)

        runner.forward = timed


class MixedBench:
    """The engine core, its background decodes and the new requests ("probes") timed."""

    def __init__(self, engine: Engine, args: argparse.Namespace) -> None:
        self.engine, self.core, self.args = engine, engine.core, args
        self.vocab = engine.model_config.vocab_size
        self.cuda = self.core.runner.device.type == "cuda"
        self.sync: Callable[[], None] = torch.cuda.synchronize if self.cuda else (lambda: None)
        self.steps = StepLog(self.core)
        self.forward = ForwardTimer(self.core.runner)
        self.serial = 0  # request ids and prompt seeds: every prompt distinct
        room = self.core.max_context - args.context - 8
        if room < 16:
            raise ValueError(f"--context {args.context} leaves no room to decode in the "
                             f"model's {self.core.max_context}-token context")
        self.bg_params = SamplingParams(max_new_tokens=min(4096, room), ignore_eos=True,
                                        temperature=0.0)
        self.probe_params = SamplingParams(max_new_tokens=PROBE_NEW_TOKENS, ignore_eos=True,
                                           temperature=0.0)

    # ------------------------------------------------------------------ requests
    def _add(self, prefix: str, length: int, params: SamplingParams) -> str:
        self.serial += 1
        rid = f"{prefix}{self.serial}"
        prompt = random_prompts([length], self.vocab, self.args.seed * 100_003 + self.serial)[0]
        self.core.add_request(rid, prompt, params)
        return rid

    def keep_decoding(self) -> None:
        """Tops the background batch up to `--decodes` (one may have run out of tokens) and
        steps until every one decodes."""
        running = [r for r in self.core.scheduler.running + list(self.core.scheduler.waiting)
                   if r.rid.startswith(BG_PREFIX)]
        for _ in range(self.args.decodes - len(running)):
            self._add(BG_PREFIX, self.args.context, self.bg_params)
        step_until_decoding(self.core, self.args.decodes, warmup_steps=2)

    def settle(self, rid: str) -> None:
        """Steps until the probe `rid` has ended, then back to a steady decode batch."""
        for _ in range(PROBE_NEW_TOKENS + 16):
            if rid not in self.core.groups:
                break
            self.core.step()
        else:
            raise RuntimeError(f"request {rid} did not finish")
        self.keep_decoding()

    def probe_req(self, rid: str) -> Any:
        return self.core.groups[rid].reqs[0]

    # ------------------------------------------------------------------ measurements
    def client_pass(self, length: int) -> dict[str, Any]:
        """TTFT and the background decodes' longest token gap, as a streaming client sees
        them: no syncs between steps (an overlapped engine launches ahead as it serves)."""
        core, sink = self.core, Deliveries("")
        self.sync()
        core.step(sink)  # a delivery of background tokens before the new request
        t_add = time.perf_counter()
        sink.probe = rid = self._add(PROBE_PREFIX, length, self.probe_params)
        steps = 0
        while sink.first_token_s is None:
            if steps > 64:
                raise RuntimeError(f"no first token for {rid} after {steps} steps")
            sink(core.step(sink))
            steps += 1
        sink(core.step(sink))  # the gap after the mixed step too
        gaps = [b - a for a, b in zip(sink.bg_s, sink.bg_s[1:])]
        self.settle(rid)
        return {"ttft_ms": 1e3 * (sink.first_token_s - t_add), "steps": steps,
                "bg_gap_max_ms": 1e3 * max(gaps, default=float("nan")),
                "bg_gaps_ms": [1e3 * g for g in gaps]}

    def synced_pass(self, length: int) -> dict[str, Any]:
        """The wall of each step that carries the new prompt (one, unless chunked), the
        device synchronized before and after it."""
        rid = self._add(PROBE_PREFIX, length, self.probe_params)
        req, walls, kinds, host = self.probe_req(rid), [], [], []
        while req.kv_len < len(req.prompt_ids):
            self.sync()
            self.forward.last_ms = None
            t0 = time.perf_counter()
            self.core.step()
            self.sync()
            walls.append(1e3 * (time.perf_counter() - t0))
            kinds.append(self.steps.kind())
            host.append(self.forward.last_ms)  # None: no runner.forward (a PP/TP launch)
            if len(walls) > 64:
                raise RuntimeError(f"the prompt of {rid} never finished prefilling")
        self.settle(rid)
        fwd = float("nan") if None in host else sum(host)
        return {"mixed_ms": sum(walls), "forward_host_ms": fwd, "step_walls_ms": walls,
                "kinds": kinds}

    def decode_step_ms(self) -> float:
        """A steady decode-only step's wall (back to back, one sync at each end)."""
        n = self.args.decode_steps
        self.sync()
        t0 = time.perf_counter()
        for _ in range(n):
            self.core.step()
        self.sync()
        return 1e3 * (time.perf_counter() - t0) / n

    def profile_pass(self, length: int) -> dict[str, Any]:
        """torch.profiler over the one step that carries a new prompt."""
        rid = self._add(PROBE_PREFIX, length, self.probe_params)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.sync()
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            with record_function("phase:step"):
                self.core.step()
            self.sync()
            wall = 1e3 * (time.perf_counter() - t0)
        kind = self.steps.kind()
        self.settle(rid)
        out = {"kind": kind, "wall_ms_profiled": wall, **launch_counts(prof)}
        kernels, phases = per_step_times(prof, 1)
        layers = self.engine.model_config.num_layers
        out.update(kernel_ms=sum(kernels.values()), host_ms=phases, num_layers=layers,
                   launches_per_layer=out["kernel_launches"] / layers,
                   gpu_idle_ms=wall - sum(kernels.values()) if self.cuda else None,
                   top_kernels_ms=dict(sorted(kernels.items(),
                                              key=lambda kv: -kv[1])[: self.args.top]))
        return out

    def cprofile_pass(self, length: int) -> list[dict[str, Any]]:
        """cProfile over CPROFILE_STEPS steps that each carry a new prompt: the top
        functions by own time (ms summed over the steps)."""
        prof = cProfile.Profile()
        for _ in range(CPROFILE_STEPS):
            rid = self._add(PROBE_PREFIX, length, self.probe_params)
            self.sync()
            prof.enable()
            self.core.step()
            self.sync()
            prof.disable()
            self.settle(rid)
        return top_functions(prof, self.args.cprofile_top)


def launch_counts(prof: Any) -> dict[str, Any]:
    """Kernel launches and memcpy/memset counts on the device, and the host's launch API
    calls (runtime and driver: Triton launches through `cuLaunchKernel`) with their time."""
    kernels = copies = api_calls = 0
    api_ms = 0.0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            if ev.name.startswith("phase:"):
                continue  # the ranges' own GPU-side spans
            if ev.name.startswith(("Memcpy", "Memset")):
                copies += 1
            else:
                kernels += 1
        elif "LaunchKernel" in ev.name:
            api_calls += 1
            api_ms += ev.cpu_time_total / 1e3
    return {"kernel_launches": kernels, "memcpy_memset": copies, "launch_api_calls": api_calls,
            "launch_api_ms": api_ms}


def _where(file: str, line: int, name: str) -> str:
    """`file:line name`, the file relative to the repository or site-packages."""
    root = str(REPO_ROOT) + "/"
    if "site-packages/" in file:
        file = file.split("site-packages/", 1)[1]
    elif file.startswith(root):
        file = file[len(root):]
    return f"{file}:{line} {name}"


def top_functions(prof: cProfile.Profile, top: int) -> list[dict[str, Any]]:
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": _where(*key), "calls": nc, "tottime_ms": 1e3 * tt,
             "cumtime_ms": 1e3 * ct} for key, (_cc, nc, tt, ct, _callers) in rows]


def _settings(bench: MixedBench, wanted: list[str]) -> tuple[list[str], list[str], Any]:
    """(settings to run, settings skipped, the backend) for `--mixed-decode`."""
    backend = getattr(bench.core.runner, "backend", None)
    if hasattr(backend, "mixed_decode"):
        return wanted, [], backend
    return ["n/a"], wanted, None  # no such switch (the torch reference): one run, as it is


def _apply(backend: Any, setting: str) -> None:
    if backend is not None:
        backend.mixed_decode = setting == "on"


def measure(bench: MixedBench, settings: list[str], backend: Any) -> list[dict[str, Any]]:
    """The repeats of every (setting, length): client pass, synced pass, decode baseline."""
    args, rows = bench.args, []
    for setting in settings:
        _apply(backend, setting)
        for length in args.prompt_lens:
            print(f"[mixed_decode {setting}, prompt {length}] warm-up, then {args.repeats} "
                  "repeats", flush=True)
            bench.synced_pass(length)  # compiles / tunes whatever this shape needs first
            client, synced, decode = [], [], []
            for _ in range(args.repeats):
                client.append(bench.client_pass(length))
                synced.append(bench.synced_pass(length))
                decode.append(bench.decode_step_ms())
            rows.append({
                "mixed_decode": setting, "prompt_len": length,
                "mixed_step_ms": summarize([s["mixed_ms"] for s in synced]),
                "forward_host_ms": summarize([s["forward_host_ms"] for s in synced]),
                "ttft_ms": summarize([c["ttft_ms"] for c in client]),
                "bg_gap_max_ms": summarize([c["bg_gap_max_ms"] for c in client]),
                "decode_step_ms": summarize(decode),
                "steps_to_first_token": [c["steps"] for c in client],
                "prompt_step_kinds": [s["kinds"] for s in synced],
                "client_passes": client, "synced_passes": synced,
            })
    return rows


def profiles(bench: MixedBench, rows: list[dict[str, Any]], backend: Any) -> None:
    """One torch.profiler window per row, added to it (after every timing: the phase ranges
    are wrapped around the engine's calls from here on)."""
    wrap_phases(bench.core)
    for i, row in enumerate(rows):
        _apply(backend, row["mixed_decode"])
        print(f"[mixed_decode {row['mixed_decode']}, prompt {row['prompt_len']}] profiler",
              flush=True)
        if i == 0:
            bench.profile_pass(row["prompt_len"])  # the profiler's own first-use cost
        row["profile"] = bench.profile_pass(row["prompt_len"])


def print_results(result: dict[str, Any]) -> None:
    rows = [[r["mixed_decode"], r["prompt_len"], r["mixed_step_ms"]["p50"],
             r["mixed_step_ms"]["min"], r["forward_host_ms"]["p50"], r["ttft_ms"]["p50"],
             r["bg_gap_max_ms"]["p50"],
             r["decode_step_ms"]["p50"], r["profile"]["wall_ms_profiled"],
             r["profile"]["kernel_ms"], r["profile"]["kernel_launches"],
             r["profile"]["launches_per_layer"], r["profile"]["launch_api_ms"]]
            for r in result["rows"]]
    print_table(["mixed_decode", "prompt", "mixed p50 ms", "mixed min ms",
                 "forward host p50 ms", "TTFT p50 ms",
                 "decode gap p50 ms", "decode step ms", "profiled wall ms", "kernel ms",
                 "launches", "launches/layer", "launch API ms"], rows,
                title=f"one new prompt joining {result['decodes']} decodes (context "
                      f"{result['context']}), {result['repeats']} repeats; {result['backend']} "
                      f"backend, overlap {result['overlap_schedule']}")
    for r in result["rows"]:
        p = r["profile"]
        print(f"\n[{r['mixed_decode']}, {r['prompt_len']}] host ms: "
              + ", ".join(f"{k} {v:.2f}" for k, v in p["host_ms"].items()))
        for name, ms in p["top_kernels_ms"].items():
            print(f"{ms:8.3f} ms  {name[:110]}")
    cp = result["cprofile"]
    if cp["top"]:
        print_table(["function", "calls", "tottime ms", "cumtime ms"],
                    [[f["function"][-90:], f["calls"], f["tottime_ms"], f["cumtime_ms"]]
                     for f in cp["top"]],
                    title=f"cProfile, {cp['steps']} mixed steps, prompt {cp['prompt_len']}, "
                          f"mixed_decode {cp['mixed_decode']}: top by own time")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    opts = {"load_format": args.load_format, "device": args.device, "dtype": args.dtype,
            "seed": args.seed}
    if args.mem_fraction is not None:
        opts["mem_fraction"] = args.mem_fraction
    opts.update(parse_engine_args(args.engine_arg))
    engine = Engine(args.model, **opts)
    try:
        bench = MixedBench(engine, args)
        settings, skipped, backend = _settings(bench, args.mixed_decode)
        if skipped:
            print(f"the attention backend has no mixed_decode switch: one run as it is "
                  f"({','.join(skipped)} not run)")
        print(f"[setup] {args.decodes} background decodes, context {args.context}", flush=True)
        bench.keep_decoding()
        rows = measure(bench, settings, backend)
        mid = sorted(args.prompt_lens)[len(args.prompt_lens) // 2]
        cp_setting = "on" if "on" in settings else settings[0]
        _apply(backend, cp_setting)
        print(f"[cprofile] {CPROFILE_STEPS} mixed steps, prompt {mid}", flush=True)
        top = bench.cprofile_pass(mid) if args.cprofile_top > 0 else []
        profiles(bench, rows, backend)
        result = {
            "benchmark": "profile_mixed_step", "model": args.model, "decodes": args.decodes,
            "context": args.context, "prompt_lens": args.prompt_lens, "repeats": args.repeats,
            "backend": getattr(bench.core.runner.backend, "name", None)
            if hasattr(bench.core.runner, "backend") else None,
            "overlap_schedule": bench.core.cfg.overlap_schedule,
            "mixed_decode_settings": settings, "mixed_decode_skipped": skipped,
            "rows": rows,
            "cprofile": {"prompt_len": mid, "mixed_decode": cp_setting,
                         "steps": CPROFILE_STEPS, "top": top},
        }
    finally:
        release_engine(engine)
    print_results(result)
    return write_json(args.out, result)


if __name__ == "__main__":
    main()
