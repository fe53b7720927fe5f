"""Helpers shared by the benchmark scripts: statistics, tables, synthetic datasets, provenance.

Every result file records where its numbers came from (commit, GPU, torch, date, the exact
command line), because `docs/benchmarks.md` may only quote figures that can be reproduced.
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent

# H200 ceilings the MBU/MFU figures are relative to: the device-to-device copy bandwidth and
# the dense bf16 matmul rate measured on this workplace's H200s (see the device notes), not the
# datasheet's 4.8 TB/s and 990 TFLOP/s, which no kernel reaches.
PEAK_BANDWIDTH = 4.2e12  # bytes/s
PEAK_FLOPS = 780e12  # FLOP/s

# ShareGPT-like synthetic lengths: log-normal, parameterised by the median and the sigma of the
# underlying normal. Medians/sigmas chosen to resemble the ShareGPT V3 conversations used by
# vLLM/SGLang benchmarks (prompt median ~220 tokens with a long tail, output median ~190).
SHAREGPT_INPUT_MEDIAN, SHAREGPT_INPUT_SIGMA, SHAREGPT_INPUT_CLIP = 220, 0.9, (4, 2048)
SHAREGPT_OUTPUT_MEDIAN, SHAREGPT_OUTPUT_SIGMA, SHAREGPT_OUTPUT_CLIP = 190, 0.8, (4, 1024)


# ---------------------------------------------------------------------------------------------
# Statistics


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default); NaN for no values."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else math.nan


def summarize(values: Sequence[float], qs: Iterable[float] = (50, 90, 99)) -> dict[str, float]:
    """mean / min / max / pXX of a sample, as a JSON-friendly dict (NaNs when empty)."""
    arr = np.asarray(values, dtype=float)
    out: dict[str, float] = {"n": int(arr.size)}
    if arr.size == 0:
        out.update(mean=math.nan, min=math.nan, max=math.nan)
        out.update({f"p{q:g}": math.nan for q in qs})
        return out
    out.update(mean=float(arr.mean()), min=float(arr.min()), max=float(arr.max()))
    out.update({f"p{q:g}": float(np.percentile(arr, q)) for q in qs})
    return out


# ---------------------------------------------------------------------------------------------
# Output


def fmt(value: Any) -> str:
    """A table cell: floats rounded for reading (more digits when small), NaN/None as '-'."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:.0f}"
        if abs(value) >= 1 or value == 0:
            return f"{value:.2f}"
        return f"{value:.3g}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-markdown table (so it can be pasted into docs/benchmarks.md as printed)."""
    cells = [[str(h) for h in headers]] + [[fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |" for r in cells[1:]]
    return "\n".join(lines)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str = "") -> None:
    if title:
        print(f"\n{title}")
    print(format_table(headers, rows), flush=True)


def graph_replay_us(graph: Any, reps: int, per_replay: int = 1) -> float:
    """Median µs of one replay of a captured CUDA graph over `reps` replays, divided by
    `per_replay` (the launches or layers it holds), timed with CUDA events."""
    import torch

    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / per_replay)
    return float(np.median(times))


def git_commit() -> str:
    """$PHASEFLIP_COMMIT when set (where the tree travels without its own .git — a copy run
    inside another checkout would report that checkout's HEAD), else HEAD of the repository
    (with '-dirty' if the tree has changes), else 'unknown'."""
    if os.environ.get("PHASEFLIP_COMMIT"):
        return os.environ["PHASEFLIP_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
                               ).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment() -> dict[str, Any]:
    """Provenance of a result: commit, device, library versions, date, command line."""
    env: dict[str, Any] = {
        "commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "host_cpu": platform.processor() or platform.machine(),
    }
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["gpu_count"] = torch.cuda.device_count()
        else:
            env["gpu"] = None
    except ImportError:
        env["torch"] = None
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    return env


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None  # strict JSON has no NaN/Infinity
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return _jsonable(obj.item())
    return obj


def write_json(path: str | os.PathLike[str] | None, result: dict[str, Any]) -> dict[str, Any]:
    """Adds `env` (provenance) to `result` and writes it as strict JSON (NaN → null)."""
    result = {**result, "env": environment()}
    if path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(_jsonable(result), indent=2, allow_nan=False) + "\n")
        print(f"wrote {out}")
    return result


# ---------------------------------------------------------------------------------------------
# Synthetic workloads


@dataclass(frozen=True)
class Workload:
    """Token-id prompts and the exact number of tokens to generate for each."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def _lognormal(rng: np.random.Generator, median: float, sigma: float, n: int,
               clip: tuple[int, int]) -> np.ndarray:
    x = rng.lognormal(mean=math.log(median), sigma=sigma, size=n)
    return np.clip(np.rint(x), clip[0], clip[1]).astype(int)


def sample_lengths(dataset: str, n: int, input_len: int, output_len: int, seed: int,
                   max_context: int | None = None) -> tuple[list[int], list[int]]:
    """(input lengths, output lengths) of `n` requests.

    `fixed`: every request is input_len/output_len. `sharegpt-like`: seeded log-normal lengths
    (inputs: median SHAREGPT_INPUT_MEDIAN, sigma SHAREGPT_INPUT_SIGMA, clipped to
    SHAREGPT_INPUT_CLIP; outputs likewise). With `max_context`, an input that would not fit
    with its output is shortened (never below 1 token), so every request is valid.
    """
    rng = np.random.default_rng(seed)
    if dataset == "fixed":
        ins, outs = np.full(n, input_len), np.full(n, output_len)
    elif dataset == "sharegpt-like":
        ins = _lognormal(rng, SHAREGPT_INPUT_MEDIAN, SHAREGPT_INPUT_SIGMA, n, SHAREGPT_INPUT_CLIP)
        outs = _lognormal(rng, SHAREGPT_OUTPUT_MEDIAN, SHAREGPT_OUTPUT_SIGMA, n,
                          SHAREGPT_OUTPUT_CLIP)
    else:
        raise ValueError(f"unknown dataset {dataset!r}; expected fixed or sharegpt-like")
    in_list, out_list = [int(x) for x in ins], [int(x) for x in outs]
    if max_context is not None:
        for i in range(n):
            out_list[i] = min(out_list[i], max_context - 1)
            in_list[i] = max(1, min(in_list[i], max_context - out_list[i]))
    return in_list, out_list


def random_prompts(lengths: Sequence[int], vocab_size: int, seed: int,
                   low: int = 1) -> list[list[int]]:
    """Uniform random token ids in [low, vocab_size): distinct prompts (no accidental
    prefix-cache hits between requests or between runs with different seeds). Id 0 is left
    out because the bundled tokenizer uses it as its special token."""
    rng = np.random.default_rng(seed + 1_000_003)
    return [rng.integers(low, vocab_size, size=n).tolist() for n in lengths]


def step_until_decoding(core: Any, n: int, warmup_steps: int) -> None:
    """Steps an engine core until all `n` submitted requests are decoding (one token a step
    each, or a step of their PP decode group in flight; nothing waiting), then
    `warmup_steps` more: a steady decode batch to time."""
    for _ in range(n + 16):
        sched = core.scheduler
        if (len(sched.running) == n and not sched.waiting
                and all(r.remaining == 1 or r.launched for r in sched.running)):
            break
        core.step()
    else:
        raise RuntimeError("requests did not all reach decoding")
    for _ in range(warmup_steps):
        core.step()


def make_workload(dataset: str, n: int, input_len: int, output_len: int, vocab_size: int,
                  seed: int, max_context: int | None = None) -> Workload:
    ins, outs = sample_lengths(dataset, n, input_len, output_len, seed, max_context)
    return Workload(random_prompts(ins, vocab_size, seed), outs)


def parse_engine_args(pairs: Sequence[str]) -> dict[str, Any]:
    """`--engine-arg key=value` pairs → Engine options (ints, floats, bools parsed)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep:
            raise ValueError(f"--engine-arg expects key=value, got {pair!r}")
        value: Any = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            for conv in (int, float):
                try:
                    value = conv(raw)
                    break
                except ValueError:
                    pass
        out[key.replace("-", "_")] = value
    return out


def sized_engine(model: str | None, opts: dict[str, Any], lengths: str):
    """`Engine(model, **opts)` where the benchmark set `max_model_len` from its own length
    flags (`lengths`, e.g. "--input-len + --output-len"): the model's refusal of a context
    longer than it was trained for then names those flags, which the user set, rather than
    --max-model-len, which they did not."""
    from phaseflip import Engine
    from phaseflip.errors import InvalidRequestError

    try:
        return Engine(model, **opts)
    except InvalidRequestError as e:
        if e.param != "max_model_len":
            raise
        raise InvalidRequestError(f"{lengths} = {opts['max_model_len']} tokens: {e}",
                                  param=lengths) from None


def add_model_args(ap) -> None:
    """The model flags every engine-driving benchmark takes."""
    ap.add_argument("--model", default=None,
                    help="model dir or bundled name (llama-3.1-8b, ...); default the tiny model")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")


def add_workload_args(ap) -> None:
    """The seeded-workload flags of the offline benchmarks (`make_workload`)."""
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--dataset", default="sharegpt-like", choices=["sharegpt-like", "fixed"])
    ap.add_argument("--input-len", type=int, default=1024, help="fixed dataset only")
    ap.add_argument("--output-len", type=int, default=512, help="fixed dataset only")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mem-fraction", type=float, default=None)


def add_engine_args(ap) -> None:
    """The engine flags of the offline benchmarks beside the model's (`engine_from_args`)."""
    ap.add_argument("--max-running-requests", type=int, default=None)
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="any other Engine option, repeatable")


def engine_from_args(args, **opts: Any):
    """The Engine of the model, workload and engine flags (`add_model_args`,
    `add_workload_args`, `add_engine_args`) plus `opts`; the flags left unset are the engine's
    defaults."""
    from phaseflip import Engine

    flags = {"load_format": args.load_format, "device": args.device, "dtype": args.dtype,
             "seed": args.seed, "max_running_requests": args.max_running_requests,
             "mem_fraction": args.mem_fraction}
    opts = {k: v for k, v in flags.items() if v is not None} | opts
    opts.update(parse_engine_args(args.engine_arg))
    return Engine(args.model, **opts)


def engine_with_workload(args, arrival_order: bool = False, **opts: Any):
    """(Engine, Workload) for a benchmark that steps the core itself: `engine_from_args`, and
    the seeded workload submitted to its core, every request running to its drawn length,
    longest first as `Engine.generate` submits a batch (or in the workload's order)."""
    from phaseflip import SamplingParams
    from phaseflip.scheduler.scheduler import longest_output_first

    engine = engine_from_args(args, **opts)
    core = engine.core
    work = make_workload(args.dataset, args.num_prompts, args.input_len, args.output_len,
                         engine.model_config.vocab_size, args.seed, core.max_context)
    n = work.output_lens
    for i in range(len(n)) if arrival_order else longest_output_first(n):
        core.add_request(f"r{i}", work.prompts[i], SamplingParams(
            max_new_tokens=n[i], ignore_eos=True, temperature=args.temperature))
    return engine, work


def release_engine(engine) -> None:
    """Shuts `engine` down and returns its device memory, so the next engine or the
    transformers reference in the same process starts from an empty GPU."""
    import torch

    engine.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def join_rank_group(rank: int, spec: Any) -> Any:
    """A benchmark rank joins the default process group `spec` names (backend, init_method,
    world_size, timeout_s, device "cuda" or "cpu"); returns its torch device (GPU `rank` on
    CUDA). torch is imported here: this module is read by CPU-only tools too."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", rank) if spec.device == "cuda" else torch.device("cpu")
    extra: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        extra["device_id"] = device
    dist.init_process_group(spec.backend, init_method=spec.init_method, rank=rank,
                            world_size=spec.world_size,
                            timeout=_dt.timedelta(seconds=spec.timeout_s), **extra)
    return device


def wrap_method(obj: Any, name: str, around: Callable[[], AbstractContextManager]) -> None:
    """Replaces `obj.name` (an engine phase: the scheduler's `schedule`, the runner's
    `forward`, ...) by the same call made inside `around()` — a profiler range, a timer — so
    the benchmarks that time or profile the engine's phases share one way of hooking them."""
    fn = getattr(obj, name)

    def wrapped(*a: Any, **kw: Any) -> Any:
        with around():
            return fn(*a, **kw)

    setattr(obj, name, wrapped)


@contextmanager
def adds_seconds(totals: dict[str, float], key: str) -> Iterator[None]:
    """Adds the block's perf_counter seconds to totals[key] (a defaultdict(float))."""
    t = time.perf_counter()
    try:
        yield
    finally:
        totals[key] += time.perf_counter() - t


def pct_ms(values: list[float], q: float) -> float | None:
    """The q-quantile of `values` (seconds) in milliseconds, numpy's interpolation; None for
    no values."""
    return round(1e3 * percentile(values, 100 * q), 2) if values else None


def itl_split(run: dict) -> dict:
    """One bench_serving run's ITLs, pooled and split at the wave's last first token (send
    times are taken as equal: one wave under a concurrency limit its size)."""
    reqs = [r for r in run["requests"] if r.get("ok", True) and r["ttft"] == r["ttft"]]  # not NaN
    if not reqs:
        return {"itls": 0, "decode_p50_ms": None, "decode_p99_ms": None,
                "prefill_window_p99_ms": None}
    last_first = max(r["ttft"] for r in reqs)
    prefill, decode = [], []
    for r in reqs:
        t = r["ttft"]
        for gap in r["itls"]:
            (decode if t >= last_first else prefill).append(gap)
            t += gap
    pooled = prefill + decode
    return {"itls": len(pooled), "p99_rank": len(pooled) // 100,
            "over_30ms": sum(g > 0.03 for g in pooled), "p50_ms": pct_ms(pooled, 0.5),
            "p99_ms": pct_ms(pooled, 0.99), "prefill_window_itls": len(prefill),
            "prefill_window_p99_ms": pct_ms(prefill, 0.99), "decode_p50_ms": pct_ms(decode, 0.5),
            "decode_p99_ms": pct_ms(decode, 0.99), "decode_max_ms": pct_ms(decode, 1.0)}
