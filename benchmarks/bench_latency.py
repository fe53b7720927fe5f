"""Latency of one batch: prefill time and per-step decode time, with MBU and MFU.

    python -m benchmarks.bench_latency --model llama-3.1-8b --load-format dummy \
        --batch-sizes 1,64,256 --input-len 1024 --output-len 32 [--hf] --out lat.json

Each iteration submits `batch_size` distinct random token-id prompts of `input_len` tokens
through the offline `Engine` API (greedy, ignore_eos, exactly `output_len` new tokens). The
engine is configured so the whole batch is prefilled in one step (no chunking, prefill budget
= batch × input_len) and then decodes together, so every step is either "the prefill" or "one
decode step of the whole batch". Steps are timed by wrapping `engine.core.step` (synchronising
the GPU after each) and classified from the forward plan the step ran — no engine changes.

Utilisation, per step, against the H200 ceilings in `benchmarks.common`:
  MBU = (weight bytes + KV bytes read) / step time / PEAK_BANDWIDTH
  MFU = (2 · linear params · tokens + 2 · LM-head params · logit rows
         + 4 · layers · heads · head_dim · Σ causal (query, key) pairs) / step time / PEAK_FLOPS
Weight bytes exclude an untied input embedding (only the looked-up rows are read).

`--hf` runs `transformers` `generate` (random init via `from_config`, same device and dtype,
static cache when it works) on the same prompts and prints the ratio beside each row; its
steps are timed with a StoppingCriteria that synchronises and timestamps every token.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from benchmarks.common import (
    PEAK_BANDWIDTH,
    PEAK_FLOPS,
    add_model_args,
    parse_engine_args,
    print_table,
    random_prompts,
    release_engine,
    sized_engine,
    summarize,
    write_json,
)
from benchmarks.gpu_busy import GpuBusySampler, add_gpu_busy_arg, format_busy, gpus_to_sample
from phaseflip import Engine, SamplingParams
from phaseflip.forward_batch import ForwardBatch
from phaseflip.model.config import ModelConfig
from phaseflip.model.dummy import num_parameters


@dataclass
class StepRecord:
    """One engine step: wall time and the shape of the forward it ran."""

    start: float
    end: float
    is_decode: bool = False
    batch_size: int = 0
    extend_lens: list[int] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    kv_tokens: int = 0  # context slots read by attention, over all sequences
    logit_rows: int = 0

    @property
    def seconds(self) -> float:
        return self.end - self.start


class StepRecorder:
    """Times every `engine.core.step` and notes the plan its forward ran (instance-attribute
    wrappers, removed on exit, so the engine object is left as it was).

    Steps are timed to the end of their GPU work, except overlapped decode steps: syncing
    those would serialise what overlap runs in parallel. Such a call launches step k+1 and
    returns once step k's tokens are in, so back to back the calls time the loop's period,
    which is what a decoding request sees (the first decode step after a prefill, whose
    tokens were already in, is short; the median does not see it)."""

    def __init__(self, engine: Engine) -> None:
        self.core = engine.core
        self.records: list[StepRecord] = []
        self._plan: ForwardBatch | None = None
        self._cuda = engine.core.runner.device.type == "cuda"
        self._overlap = engine.core.cfg.overlap_schedule

    # the runner's entry points a step's plan passes through: `launch` is a TP/PP runner's
    # under overlap scheduling (`EngineCore._launch`), `forward` every other step's
    ENTRIES = ("forward", "launch")

    def __enter__(self) -> StepRecorder:
        core, runner = self.core, self.core.runner
        step = core.step

        def timed_step() -> list:
            self._plan = None
            t0 = time.perf_counter()
            out = step()
            plan = self._plan
            if self._cuda and not (self._overlap and plan is not None and plan.is_decode):
                torch.cuda.synchronize()
            rec = StepRecord(t0, time.perf_counter())
            if plan is not None:
                rec.is_decode, rec.batch_size = plan.is_decode, plan.batch_size
                rec.extend_lens, rec.prefix_lens = list(plan.extend_lens), list(plan.prefix_lens)
                rec.kv_tokens = int(plan.kv_indices.numel())
                rec.logit_rows = int(plan.logits_indices.numel())
                self.records.append(rec)
            return out

        def noting(entry: Callable[..., Any]) -> Callable[..., Any]:
            def noted(plan: ForwardBatch, *a: Any, **kw: Any) -> Any:
                self._plan = plan
                return entry(plan, *a, **kw)
            return noted

        core.step = timed_step
        for name in self.ENTRIES:
            if hasattr(runner, name):
                setattr(runner, name, noting(getattr(runner, name)))
        return self

    def __exit__(self, *exc: object) -> None:
        self.core.__dict__.pop("step", None)
        for name in self.ENTRIES:
            self.core.runner.__dict__.pop(name, None)


def engine_dtype(engine: Engine) -> torch.dtype:
    return engine.core.runner.dtype  # ModelRunner and DistributedRunner (rank 0) both hold it



# ---------------------------------------------------------------------------------------------
# Cost model


@dataclass(frozen=True)
class CostModel:
    """Bytes and FLOPs of one forward of a dense Llama-family model (see module docstring)."""

    layer_linear_params: int  # q, k, v, o, gate, up, down over all layers
    lm_head_params: int
    weight_bytes: int  # read once per forward
    kv_bytes_per_token: int  # K and V over all layers
    attn_flops_per_pair: int  # 4 · layers · heads · head_dim

    @classmethod
    def of(cls, m: ModelConfig, dtype: torch.dtype, fp8_linears: bool = False,
           kv_dtype: torch.dtype | None = None) -> CostModel:
        """`fp8_linears`: the decoder projections are FP8 (one byte a weight; their row
        scales are negligible); `kv_dtype`: the KV cache's element type (default `dtype`)."""
        item = torch.empty((), dtype=dtype).element_size()
        kv_item = torch.empty((), dtype=kv_dtype or dtype).element_size()
        h, q, kv = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * m.intermediate_size
        embed = m.vocab_size * h
        read_params = num_parameters(m) - (0 if m.tie_word_embeddings else embed)
        linears = per_layer * m.num_layers
        return cls(
            layer_linear_params=linears,
            lm_head_params=embed,
            weight_bytes=(read_params - linears) * item + linears * (1 if fp8_linears else item),
            kv_bytes_per_token=2 * m.num_layers * m.num_kv_heads * m.head_dim * kv_item,
            attn_flops_per_pair=4 * m.num_layers * m.num_heads * m.head_dim,
        )

    def flops(self, rec: StepRecord) -> float:
        tokens = sum(rec.extend_lens)
        pairs = sum(e * p + e * (e + 1) // 2 for e, p in zip(rec.extend_lens, rec.prefix_lens))
        return (2.0 * self.layer_linear_params * tokens + 2.0 * self.lm_head_params * rec.logit_rows
                + float(self.attn_flops_per_pair) * pairs)

    def bytes(self, rec: StepRecord) -> float:
        return float(self.weight_bytes + self.kv_bytes_per_token * rec.kv_tokens)


# ---------------------------------------------------------------------------------------------
# phaseflip


def _run_batch(engine: Engine, prompts: list[list[int]], output_len: int,
               temperature: float) -> tuple[float, float, list[StepRecord]]:
    """Generates for one batch; returns (generate start, generate end, step records)."""
    params = SamplingParams(max_new_tokens=output_len, temperature=temperature, ignore_eos=True)
    with StepRecorder(engine) as rec:
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params, use_tqdm=False)
        t1 = time.perf_counter()
    bad = [len(o.token_ids) for o in outs if len(o.token_ids) != output_len]
    if bad:
        raise RuntimeError(f"expected {output_len} tokens per request, got {bad[:5]}")
    return t0, t1, rec.records


def bench_phaseflip(engine: Engine, batch_size: int, args: argparse.Namespace,
                    cost: CostModel, vocab: int) -> dict[str, Any]:
    for w in range(args.num_warmup):
        prompts = random_prompts([args.input_len] * batch_size, vocab, args.seed + 7919 * (w + 1))
        _run_batch(engine, prompts, min(args.output_len, 4), args.temperature)
    prefill_s, ttft_s, e2e_s, decode_s, prefill_steps = [], [], [], [], []
    mbu, mfu_decode, mfu_prefill = [], [], []
    gpus, why_not = gpus_to_sample(engine, args.gpu_busy)
    windows: list[tuple[float, float]] = []  # each iteration's decode steps (GPU busy region)
    with GpuBusySampler(gpus, note=why_not) as sampler:
        for it in tqdm(range(args.num_iters), desc=f"phaseflip bs={batch_size}", unit="iter"):
            prompts = random_prompts([args.input_len] * batch_size, vocab,
                                     args.seed + 1_000 * batch_size + it)
            t0, t1, records = _run_batch(engine, prompts, args.output_len, args.temperature)
            prefill = [r for r in records if not r.is_decode]
            decode = [r for r in records if r.is_decode]
            if decode:
                windows.append((decode[0].start, decode[-1].end))
            e2e_s.append(t1 - t0)
            prefill_steps.append(len(prefill))
            if prefill:
                p_time = sum(r.seconds for r in prefill)
                prefill_s.append(p_time)
                ttft_s.append(prefill[-1].end - t0)
                mfu_prefill.append(sum(cost.flops(r) for r in prefill) / p_time / args.peak_flops)
            for r in decode:
                decode_s.append(r.seconds)
                mbu.append(cost.bytes(r) / r.seconds / args.peak_bandwidth)
                mfu_decode.append(cost.flops(r) / r.seconds / args.peak_flops)
    step = summarize(decode_s)
    busy = sampler.summary(windows, step["p50"] if decode_s else None)
    p_med = statistics.median(prefill_s) if prefill_s else float("nan")
    return {
        "batch_size": batch_size,
        "prefill_s": p_med,
        "prefill_tokens_per_s": batch_size * args.input_len / p_med,
        "ttft_s": statistics.median(ttft_s) if ttft_s else float("nan"),
        "decode_step_s": step,
        "decode_tokens_per_s": batch_size / step["p50"] if decode_s else float("nan"),
        "e2e_s": statistics.median(e2e_s),
        "mbu_decode": statistics.median(mbu) if mbu else float("nan"),
        "mfu_decode": statistics.median(mfu_decode) if mfu_decode else float("nan"),
        "mfu_prefill": statistics.median(mfu_prefill) if mfu_prefill else float("nan"),
        "prefill_steps_per_iter": max(prefill_steps),
        "gpu_busy": busy,  # per GPU over the decode steps, NVML (see benchmarks.gpu_busy)
        "host_bubble_ms_per_step": busy["host_bubble_ms_per_step"],  # estimate, worst GPU
        "decode_step_times_s": decode_s,
    }


# ---------------------------------------------------------------------------------------------
# transformers


def _hf_model(model_dir: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        except TypeError:  # transformers 4.x spells it torch_dtype
            model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    return model.to(device=device, dtype=dtype).eval()


class _Stamps:
    """A StoppingCriteria that never stops; it timestamps each generated token."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.times = cuda, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw: Any) -> torch.Tensor:
        if self.cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _hf_generate(model, ids: torch.Tensor, output_len: int, cache: str) -> tuple[float, list]:
    from transformers import GenerationConfig, StoppingCriteriaList

    stamps = _Stamps(ids.is_cuda)
    kwargs: dict[str, Any] = {
        "attention_mask": torch.ones_like(ids), "max_new_tokens": output_len,
        "min_new_tokens": output_len, "do_sample": False, "pad_token_id": 0,
        "stopping_criteria": StoppingCriteriaList([stamps]),
    }
    if cache == "static":
        kwargs["cache_implementation"] = "static"
        # transformers auto-compiles the decode step of a static cache (minutes of inductor
        # before the first token): the side-by-side is eager against eager.
        if hasattr(GenerationConfig(), "disable_compile"):
            kwargs["disable_compile"] = True
    if ids.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, **kwargs)
    if out.shape[1] - ids.shape[1] != output_len:
        raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens")
    return t0, stamps.times


def bench_hf(model, batch_size: int, args: argparse.Namespace, vocab: int,
             device: torch.device, state: dict[str, str]) -> dict[str, Any]:
    def run(seed: int, n_out: int) -> tuple[float, list]:
        prompts = random_prompts([args.input_len] * batch_size, vocab, seed)
        ids = torch.tensor(prompts, dtype=torch.long, device=device)
        if state["cache"] == "static":
            try:
                return _hf_generate(model, ids, n_out, "static")
            except Exception as exc:  # noqa: BLE001 - an older/newer API: fall back, say so
                print(f"transformers static cache failed ({exc!r}); using the dynamic cache")
                state["cache"] = "dynamic"
        return _hf_generate(model, ids, n_out, "dynamic")

    for w in range(args.num_warmup):
        run(args.seed + 7919 * (w + 1), min(args.output_len, 4))
    prefill_s, decode_s, e2e_s = [], [], []
    for it in tqdm(range(args.num_iters), desc=f"transformers bs={batch_size}", unit="iter"):
        t0, stamps = run(args.seed + 1_000 * batch_size + it, args.output_len)
        prefill_s.append(stamps[0] - t0)
        decode_s += [b - a for a, b in zip(stamps, stamps[1:])]
        e2e_s.append(stamps[-1] - t0)
    step = summarize(decode_s)
    return {
        "batch_size": batch_size,
        "cache": state["cache"],
        "prefill_s": statistics.median(prefill_s),
        "decode_step_s": step,
        "decode_tokens_per_s": batch_size / step["p50"] if decode_s else float("nan"),
        "e2e_s": statistics.median(e2e_s),
        "decode_step_times_s": decode_s,
    }


# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--batch-sizes", default="1,64,256")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-iters", type=int, default=3)
    ap.add_argument("--num-warmup", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mem-fraction", type=float, default=None)
    ap.add_argument("--max-prefill-tokens", type=int, default=None,
                    help="default: largest batch × input-len (the batch prefills in one "
                         "step; a large one may not fit one forward's activations: a smaller "
                         "budget chunks the prefill, and the batch then decodes staggered)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="any other Engine option, repeatable")
    ap.add_argument("--peak-bandwidth", type=float, default=PEAK_BANDWIDTH,
                    help="one GPU's; a tp×pp layout is measured against tp×pp of them")
    ap.add_argument("--peak-flops", type=float, default=PEAK_FLOPS, help="one GPU's")
    ap.add_argument("--hf", action="store_true", help="also time transformers generate")
    ap.add_argument("--hf-batch-sizes", default=None, help="default: --batch-sizes")
    ap.add_argument("--hf-cache", default="static", choices=["static", "dynamic"])
    add_gpu_busy_arg(ap)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    for flag in ("num_iters", "input_len", "output_len"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.num_warmup < 0:
        ap.error("--num-warmup must be >= 0")
    return args


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_engine(args: argparse.Namespace, max_batch: int) -> Engine:
    opts: dict[str, Any] = {
        "load_format": args.load_format, "device": args.device, "dtype": args.dtype,
        "max_running_requests": max_batch, "chunked_prefill_size": 0,
        "max_prefill_tokens": args.max_prefill_tokens or max_batch * args.input_len,
        "max_model_len": args.input_len + args.output_len, "seed": args.seed,
    }
    if args.mem_fraction is not None:
        opts["mem_fraction"] = args.mem_fraction
    opts.update(parse_engine_args(args.engine_arg))
    return sized_engine(args.model, opts, "--input-len + --output-len")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    batch_sizes = _ints(args.batch_sizes)
    hf_sizes = _ints(args.hf_batch_sizes) if args.hf_batch_sizes else batch_sizes
    engine = build_engine(args, max(batch_sizes))
    m, dtype = engine.model_config, engine_dtype(engine)
    device = engine.core.runner.device
    numerics = engine.core.runner.numerics
    cost = CostModel.of(m, dtype, fp8_linears=numerics["quantization"] is not None,
                        kv_dtype=getattr(torch, numerics["kv_cache_dtype"]))
    vocab = m.vocab_size
    tp, pp = engine.config.tp_size, engine.config.pp_size
    # MBU and MFU of a multi-GPU layout are against the ceilings of all its GPUs together
    args.peak_bandwidth *= tp * pp
    args.peak_flops *= tp * pp
    rows: list[dict[str, Any]] = []
    try:
        for bs in batch_sizes:
            rows.append(bench_phaseflip(engine, bs, args, cost, vocab))
    finally:
        release_engine(engine)
    result = {
        "benchmark": "latency",
        "model": args.model or m.model_dir,
        "model_dir": m.model_dir,
        "architecture": m.architecture,
        "load_format": args.load_format,
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "tp_size": tp,
        "pp_size": pp,
        "gpus": tp * pp,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_iters": args.num_iters,
        "temperature": args.temperature,
        "num_parameters": num_parameters(m),
        "weight_bytes_per_step": cost.weight_bytes,
        "peak_bandwidth": args.peak_bandwidth,
        "peak_flops": args.peak_flops,
        "results": rows,
    }
    hf_rows: dict[int, dict[str, Any]] = {}
    if args.hf:
        write_json(args.out, result)  # phaseflip's figures survive a transformers failure
        _print(result)
        model = _hf_model(m.model_dir, dtype, device)
        state = {"cache": args.hf_cache}
        for bs in hf_sizes:
            hf_rows[bs] = bench_hf(model, bs, args, vocab, device, state)
        del model
        gc.collect()
    for row in rows:
        row["hf"] = hf_rows.get(row["batch_size"])
    _print(result)
    return write_json(args.out, result)


def _print(result: dict[str, Any]) -> None:
    def pct(x: float) -> float:
        return 100.0 * x

    headers = ["batch", "prefill s", "prefill tok/s", "TTFT s", "decode p50 ms", "decode p90 ms",
               "decode tok/s", "MBU %", "MFU prefill %", "MFU decode %", "GPU busy % (NVML)",
               "host bubble ms/step (est.)"]
    rows = [[r["batch_size"], r["prefill_s"], r["prefill_tokens_per_s"], r["ttft_s"],
             1e3 * r["decode_step_s"]["p50"], 1e3 * r["decode_step_s"]["p90"],
             r["decode_tokens_per_s"], pct(r["mbu_decode"]), pct(r["mfu_prefill"]),
             pct(r["mfu_decode"]), format_busy(r["gpu_busy"]), r["host_bubble_ms_per_step"]]
            for r in result["results"]]
    print_table(headers, rows, title=(
        f"phaseflip latency: {result['model']} ({result['load_format']}, {result['dtype']}, "
        f"{result['device']}, tp={result['tp_size']} pp={result['pp_size']}), "
        f"input {result['input_len']}, output {result['output_len']}"))
    for r in result["results"]:
        if r["gpu_busy"]["note"] and r["gpu_busy"]["devices"] is not None:  # on GPUs: say why
            print(f"GPU busy, batch {r['batch_size']}: {r['gpu_busy']['note']}")
    hf = [r for r in result["results"] if r.get("hf")]
    if hf:
        headers = ["batch", "phaseflip prefill s", "transformers prefill s", "prefill ratio",
                   "phaseflip decode p50 ms", "transformers decode p50 ms", "decode ratio",
                   "transformers cache"]
        rows = [[r["batch_size"], r["prefill_s"], r["hf"]["prefill_s"],
                 r["hf"]["prefill_s"] / r["prefill_s"], 1e3 * r["decode_step_s"]["p50"],
                 1e3 * r["hf"]["decode_step_s"]["p50"],
                 r["hf"]["decode_step_s"]["p50"] / r["decode_step_s"]["p50"], r["hf"]["cache"]]
                for r in hf]
        print_table(headers, rows, title="side by side (ratio = transformers / phaseflip; "
                                         "> 1: phaseflip is faster)")


if __name__ == "__main__":
    main()
