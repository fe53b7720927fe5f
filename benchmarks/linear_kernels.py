"""Microbenchmark: skinny-GEMM Triton kernel vs cuBLAS (`F.linear`) for decode linears, one GPU.

Shapes: every linear of Llama-3.1-8B and Qwen3-8B (qkv, o, gate_up, down, lm_head) and their
TP=2 halves (column-parallel layers halve N, row-parallel o/down halve K), bf16, M = 1..32 rows.
Decode at small M is weight streaming, so the figure of merit is weight bytes read (N*K*2) over
time, against the read bandwidth measured here (and the 4.2 TB/s house ceiling).

Two timings per (shape, M):
* graph (the headline): `calls` back-to-back calls captured in one CUDA graph and replayed,
  cycling through enough distinct weight copies (>= 4x the L2) that every call streams from
  HBM — what a captured decode step pays, without host launch overhead;
* eager: `triton.testing.do_bench` median of one call (L2 flushed between runs), which includes
  the host launch cost (Triton's launcher is slower than cuBLAS' at this scale).

Also printed: the largest M at which the kernel still beats cuBLAS per shape (the cut-over for
`should_use_skinny`), the sum over one Llama-3.1-8B decode step (32 x (qkv+o+gate_up+down) +
lm_head) per M, and a measured "model pass": all those 129 linears with distinct weights (15 GB)
replayed from one graph, against 16.06e9 bytes / 4.2 TB/s.

    python -m benchmarks.linear_kernels --out results/linear_kernels.json
    python -m benchmarks.linear_kernels --tune --out results/linear_tuned.json   # sweep configs
    python -m benchmarks.linear_kernels --fp8-weights --tune --no-model-pass \
        --out results/linear_fp8.json     # FP8 weights: skinny vs the _scaled_mm path

With `--fp8-weights --w8a8` x is quantized per token first (the model's path on a GPU with FP8
MMAs; the timing excludes that quantization, which the model fuses into the norm before).
With `--fp8-weights` alone the weights are FP8 with row scales and x stays `--dtype`; the cuBLAS
columns are then `model.quant.fp8.scaled_mm_linear` (per-token quantization + `_scaled_mm`),
bytes count one per weight (the LM head included, which the model keeps in bf16), and the
printed cut-over is `FP8_SKINNY_MAX_M`'s.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import triton.testing  # noqa: E402

from benchmarks.common import PEAK_BANDWIDTH, print_table, write_json  # noqa: E402
from phaseflip.kernels import linear, linear_configs, linear_tune  # noqa: E402
from phaseflip.model.quant import fp8  # noqa: E402

MODEL_SHAPES = {  # name -> (N, K) of y[M, N] = x[M, K] @ W[N, K]^T
    "llama.qkv": (6144, 4096), "llama.o": (4096, 4096), "llama.gate_up": (28672, 4096),
    "llama.down": (4096, 14336), "llama.lm_head": (128256, 4096),
    "qwen3.qkv": (8192, 4096), "qwen3.o": (4096, 4096), "qwen3.gate_up": (24576, 4096),
    "qwen3.down": (4096, 12288), "qwen3.lm_head": (151936, 4096),
}
ROW_PARALLEL = ("o", "down")
SHAPES = {**MODEL_SHAPES, **{
    f"{name}.tp2": (n, k // 2) if name.split(".")[1] in ROW_PARALLEL else (n // 2, k)
    for name, (n, k) in MODEL_SHAPES.items()
}}
LLAMA_LAYER = ("llama.qkv", "llama.o", "llama.gate_up", "llama.down")
LLAMA_LAYERS = 32
# Llama-3.1-8B's whole bf16 checkpoint (with the embedding, which decode does not stream).
CHECKPOINT_BYTES = 16.06e9


def bench_us(fn, quick: bool) -> float:
    """do_bench median, µs."""
    return 1e3 * triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 100,
                                         return_mode="median")


def measure_read_bandwidth(device: torch.device, quick: bool) -> dict:
    """Read-only (a 2 GiB sum) and copy (read + write) bandwidth, TB/s, for context."""
    a = torch.empty(1024**3, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    nbytes = a.numel() * a.element_size()
    read_us = bench_us(lambda: a.sum(dtype=torch.float32), quick)
    copy_us = bench_us(lambda: b.copy_(a), quick)
    return {"read_TBps": nbytes / read_us / 1e6, "copy_TBps": 2 * nbytes / copy_us / 1e6}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


def run_shape(n: int, k: int, ms: list[int], args, device: torch.device) -> list[dict]:
    """All M for one (N, K): graph and eager timings of cuBLAS, the picked config (tuned when
    --tune/--tuned-json filled the table) and, if different, the heuristic default."""
    dtype = args.dtype
    wdtype = torch.float8_e4m3fn if args.fp8_weights else dtype
    copies = linear_tune.weight_copies(n, k, wdtype, device)
    if args.fp8_weights:  # (weight, row scales); the baseline is the _scaled_mm path
        ws = linear_tune.fp8_weights(n, k, copies, device)
        base = fp8.scaled_mm_linear
    else:
        ws = [((torch.randn(n, k, device=device) * k**-0.5).to(dtype), None)
              for _ in range(copies)]
        base = F.linear
    weight_bytes = n * k * wdtype.itemsize
    rows = []
    w8a8 = args.w8a8
    for m in ms:
        x = torch.randn(m, k, device=device).to(dtype)
        y = torch.empty(m, n, dtype=dtype, device=device)
        picked = linear_configs.pick_config(m, n, k, wdtype, device, w8a8=w8a8)
        default = linear_configs.default_config(m, n, k, wdtype, device, w8a8=w8a8)
        x_in, xs = fp8.quantize_tokens(x) if w8a8 else (x, None)  # W8A8: the rows' FP8 form

        def skinny(w, cfg, x=x_in, xs=xs, y=y):
            return partial(linear.skinny_linear, x, w[0], None, y, weight_scale=w[1],
                           x_scale=xs, out_dtype=dtype if xs is not None else None,
                           config=cfg)

        cycle = [ws[i % copies] for i in range(args.calls)]
        cublas_us = linear_tune.graph_time_us([partial(base, x, *(t for t in w if t is not None))
                                               for w in cycle])
        skinny_us = linear_tune.graph_time_us([skinny(w, picked) for w in cycle])
        default_us = skinny_us if default == picked else linear_tune.graph_time_us(
            [skinny(w, default) for w in cycle])
        w0 = ws[0][0].float() if ws[0][1] is None else ws[0][0].float() * ws[0][1][:, None]
        want = F.linear(x.float(), w0)
        row = {
            "n": n, "k": k, "m": m, "weight_MB": weight_bytes / 1e6,
            "cublas_graph_us": cublas_us, "skinny_graph_us": skinny_us,
            "skinny_default_graph_us": default_us,
            "cublas_TBps": weight_bytes / cublas_us / 1e6,
            "skinny_TBps": weight_bytes / skinny_us / 1e6,
            "speedup": cublas_us / skinny_us,
            "config": asdict(picked), "config_label": picked.label(),
            "default_config_label": default.label(),
            "skinny_rel_err": rel_err(skinny(ws[0], picked)(), want),
            "cublas_rel_err": rel_err(base(x, *(t for t in ws[0] if t is not None)), want),
        }
        if not args.no_eager:
            row["cublas_eager_us"] = bench_us(
                partial(base, x, *(t for t in ws[0] if t is not None)), args.quick)
            row["skinny_eager_us"] = bench_us(skinny(ws[0], picked), args.quick)
        rows.append(row)
    return rows


def cutover(rows: list[dict]) -> int:
    """Largest M of the sweep up to which the kernel beats cuBLAS at every M (0: never)."""
    best = 0
    for r in sorted(rows, key=lambda r: r["m"]):
        if r["skinny_graph_us"] >= r["cublas_graph_us"]:
            break
        best = r["m"]
    return best


def model_pass(ms: list[int], args, device: torch.device) -> list[dict]:
    """Time all of one Llama-3.1-8B decode step's linears with distinct weights from one graph."""
    dtype = args.dtype
    layers = [[(torch.randn(*SHAPES[name], device=device) * SHAPES[name][1] ** -0.5).to(dtype)
               for name in LLAMA_LAYER] for _ in range(LLAMA_LAYERS)]
    head = (torch.randn(*SHAPES["llama.lm_head"], device=device) * 4096**-0.5).to(dtype)
    weights = [w for layer in layers for w in layer] + [head]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    out = []
    for m in ms:
        xs = {k: torch.randn(m, k, device=device).to(dtype) for k in {w.shape[1] for w in weights}}
        times_ms = {}
        for label, fn in (("cublas", F.linear), ("skinny", linear.skinny_linear),
                          ("dispatch", dispatch_linear)):
            calls = [partial(fn, xs[w.shape[1]], w) for w in weights]
            times_ms[label] = linear_tune.graph_time_us(calls, replays=5) * len(calls) / 1e3
        cublas_ms, skinny_ms, dispatch_ms = times_ms["cublas"], times_ms["skinny"], times_ms[
            "dispatch"]
        out.append({"m": m, "linear_bytes": nbytes, "cublas_ms": cublas_ms,
                    "skinny_ms": skinny_ms, "dispatch_ms": dispatch_ms,
                    "skinny_TBps": nbytes / skinny_ms / 1e9,
                    "cublas_TBps": nbytes / cublas_ms / 1e9})
    return out


def dispatch_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What a layer wired to should_use_skinny would run."""
    n, k = w.shape
    use = linear_configs.should_use_skinny(x.shape[0], n, k)
    return linear.skinny_linear(x, w) if use else F.linear(x, w)


def _sm90_consts(cfg, m: int, dtype: torch.dtype) -> dict:
    """The skinny kernel's constexprs for a plain launch of `cfg` (no split, fold or bias)."""
    return {"BLOCK_M": cfg.block_m(m), "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
            "LOOP": cfg.loop, "SPLIT": False, "HAS_BIAS": False, "EVEN_K": True,
            "VEC": 16 // dtype.itemsize, "DOT_PREC": linear._dot_precision(dtype),
            "HAS_SCALE": False, "HAS_XSCALE": False, "PDL": False, "PF_LINE": 64,
            "NORM": False, "SILU": False, "HAS_RES": False, "LIBDEVICE": linear.USE_LIBDEVICE,
            "ROPE": False, "FP8_KV": False}


def _sm90_usage(source, cfg, cuobjdump: Path) -> tuple[int, int, int]:
    """(registers, spill stack bytes, shared memory bytes) of `source` compiled for sm_90."""
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget

    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(cuobjdump), "-res-usage", f.name], check=True,
                               capture_output=True, text=True).stdout
    return (int(re.search(r"REG:(\d+)", usage).group(1)),
            int(re.search(r"STACK:(\d+)", usage).group(1)), compiled.metadata.shared)


def sm90_report(ms: list[int], dtype: torch.dtype) -> list[dict]:
    """Compile every candidate launch shape for sm_90 on this machine (no GPU needed) and read
    registers, spill stack and shared memory from the cubin (`cuobjdump -res-usage`); estimate
    resident programs per SM and weight bytes in flight per SM (ew: one tile per program, dot:
    num_stages - 1 tiles). Splits and ragged K compile separate variants, not reported."""
    import os

    import triton.backends.nvidia as nvidia_backend
    from triton.compiler.compiler import ASTSource

    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET for --sm90-report")
    cuobjdump = Path(nvidia_backend.__file__).parent / "bin" / "cuobjdump"
    kernel = linear._skinny_kernel
    ptr = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]
    signature = dict.fromkeys(kernel.arg_names, "i32")
    signature.update(X=ptr, W=ptr, B=ptr, G=ptr, R=ptr, Y=ptr, S="*fp32", XS="*fp32",
                     PARTIALS="*fp32", COUNTERS="*i32", eps="fp32",
                     RP=(ptr,) * 8, RI=("i32",) * 7 + ("fp32",))  # the rotary fold's tuples
    aligned = {"X", "W", "B", "Y", "PARTIALS", "COUNTERS", "N", "K", "stride_xm", "stride_wn",
               "stride_ym", "k_per_split"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if name in aligned}
    rows, seen = [], set()
    for m in ms:
        for cfg in linear_configs.candidate_configs(m, 4096, 4096, dtype, torch.device("cuda"),
                                                    sms=132):
            cfg = replace(cfg, split_k=1)
            if (key := (cfg.block_m(m), cfg)) in seen:
                continue
            seen.add(key)
            consts = _sm90_consts(cfg, m, dtype)
            sig = {**signature, **dict.fromkeys(consts, "constexpr")}
            regs, stack, smem = _sm90_usage(ASTSource(kernel, sig, consts, attrs), cfg, cuobjdump)
            per_sm = min(65536 // (regs * 32 * cfg.num_warps), 64 // cfg.num_warps,
                         (227 << 10) // max(smem + 1024, 1))
            tiles = cfg.num_stages - 1 if cfg.loop == "dot" else 1
            rows.append({"m_bucket": linear_configs.m_bucket(m), "block_m": cfg.block_m(m),
                         "config": cfg.label(), "regs": regs,
                         "spill_stack": stack, "smem": smem, "programs_per_sm": per_sm,
                         "inflight_KB_per_sm": per_sm * tiles * cfg.block_n * cfg.block_k
                         * dtype.itemsize / 1024})
    print_table(["M bucket", "BLOCK_M", "config", "regs", "stack", "smem B", "programs/SM",
                 "KB in flight/SM"], [list(r.values()) for r in rows],
                title=f"sm_90 compile report ({dtype}, no split, K a multiple of BLOCK_K; "
                      f"each compiled variant once, under the first M bucket that uses it)")
    return rows


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="JSON results path (required for the GPU run)")
    ap.add_argument("--m", default="1,2,4,8,16,32", help="comma-separated row counts")
    ap.add_argument("--shapes", default="all",
                    help=f"comma-separated names (or 'all'): {', '.join(SHAPES)}")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--calls", type=int, default=16, help="calls per captured graph")
    ap.add_argument("--bw-ceiling", type=float, default=PEAK_BANDWIDTH / 1e12, help="TB/s")
    ap.add_argument("--fp8-weights", action="store_true",
                    help="FP8 weights with row scales (x stays --dtype); the baseline column "
                         "is then the _scaled_mm path (per-token quantization + cuBLASLt)")
    ap.add_argument("--w8a8", action="store_true",
                    help="with --fp8-weights: the skinny kernel takes x quantized per token "
                         "(FP8 MMAs; the model's path on GPUs with them) instead of 16-bit x")
    ap.add_argument("--tune", action="store_true",
                    help="sweep candidate_configs first (minutes: ~100 compiles) and time the "
                         "winners; the table is written next to --out as *.tuned.json")
    ap.add_argument("--tuned-json", type=Path, help="load a table written by an earlier --tune")
    ap.add_argument("--quick", action="store_true", help="shorter do_bench windows")
    ap.add_argument("--no-eager", action="store_true", help="skip the do_bench (eager) timings")
    ap.add_argument("--no-model-pass", action="store_true",
                    help="skip the 15 GB all-layers graph (per-shape sums are still printed)")
    ap.add_argument("--sm90-report", action="store_true",
                    help="no GPU needed: compile every candidate config for sm_90 and print "
                         "registers / spills / shared memory, then exit")
    args = ap.parse_args()
    if args.w8a8 and not args.fp8_weights:
        ap.error("--w8a8 needs --fp8-weights")
    args.dtype = getattr(torch, args.dtype)
    return args


def _shapes_by_nk(spec: str) -> dict[tuple[int, int], list[str]]:
    names = list(SHAPES) if spec == "all" else spec.split(",")
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        sys.exit(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    by_nk: dict[tuple[int, int], list[str]] = {}
    for name in names:
        by_nk.setdefault(SHAPES[name], []).append(name)
    return by_nk


def _tune(args: argparse.Namespace, by_nk: dict, ms: list[int], device: torch.device) -> dict:
    """--tuned-json / --tune: the table the timed runs then pick from (written beside --out)."""
    if args.tuned_json:
        linear_configs.TUNED.load(args.tuned_json)
    if not args.tune:
        return {}
    best = linear_tune.tune(list(by_nk), args.dtype, device, m_values=ms,
                            weight_dtype=torch.float8_e4m3fn if args.fp8_weights else None,
                            w8a8=args.w8a8)
    table_path = args.out.with_suffix(".tuned.json")
    table_path.parent.mkdir(parents=True, exist_ok=True)
    linear_configs.TUNED.save(table_path)
    print(f"wrote {table_path} (load with linear_configs.TUNED.load or --tuned-json)")
    return {f"{n}x{k} m={m}": {"config": c.label(), "us": us}
            for (m, n, k), (c, us) in best.items()}


def _print_rows(rows: list[dict], bw_ceiling: float) -> None:
    table = [["/".join(r["shapes"]), r["n"], r["k"], r["m"], r["cublas_graph_us"],
              r["cublas_TBps"], r["skinny_graph_us"], r["skinny_TBps"],
              100 * r["skinny_TBps"] / bw_ceiling, f"{r['speedup']:.2f}x",
              r.get("cublas_eager_us"), r.get("skinny_eager_us"),
              r["skinny_default_graph_us"], r["config_label"], r["skinny_rel_err"]]
             for r in rows]
    print_table(["shape", "N", "K", "M", "cuBLAS us", "TB/s", "skinny us", "TB/s", "% ceil",
                 "speedup", "eager cuBLAS us", "eager skinny us", "default cfg us", "config",
                 "rel err"], table, title="graph-replayed µs per call (weights stream from HBM)")


def _cutovers(by_nk: dict, rows: list[dict], fp8: bool) -> tuple[dict, int, dict]:
    """Per shape the largest swept M where the kernel wins at every M below it; printed."""
    thresholds = {}
    for (n, k), shape_names in by_nk.items():
        thresholds["/".join(shape_names)] = {
            "n": n, "k": k, "max_m": cutover([r for r in rows if (r["n"], r["k"]) == (n, k)])}
    print("\nrecommended M cut-over (largest swept M where the kernel wins at every M <= it):")
    for name, t in thresholds.items():
        print(f"  {name:<48} N={t['n']:<7} K={t['k']:<6} max_m={t['max_m']}")
    overall = min(t["max_m"] for t in thresholds.values())
    overrides = {(t["n"], t["k"]): t["max_m"] for t in thresholds.values()
                 if t["max_m"] != overall}
    if fp8:  # the cut-over against _scaled_mm: model/quant/fp8.py
        print(f"  -> FP8_SKINNY_MAX_M = {overall} (per shape: {overrides})")
    else:
        print(f"  -> SKINNY_MAX_M = {overall}; MAX_M_BY_SHAPE = {overrides}")
    return thresholds, overall, overrides


def _llama_step(rows: list[dict], ms: list[int], by_nk: dict,
                args: argparse.Namespace) -> dict:
    """The Llama-3.1-8B decode step's linears summed from the per-shape rows, per M."""
    if not all(name in SHAPES and SHAPES[name] in by_nk
               for name in (*LLAMA_LAYER, "llama.lm_head")):
        return {}
    linear_bytes = (LLAMA_LAYERS * sum(math.prod(SHAPES[s]) for s in LLAMA_LAYER)
                    + math.prod(SHAPES["llama.lm_head"])) * (
                       1 if args.fp8_weights else args.dtype.itemsize)
    step = {}
    for m in ms:
        by = {(r["n"], r["k"]): r for r in rows if r["m"] == m}

        def total(us, by=by) -> float:
            layer = sum(us(by[SHAPES[name]]) for name in LLAMA_LAYER)
            return LLAMA_LAYERS * layer + us(by[SHAPES["llama.lm_head"]])

        step[m] = {
            "cublas_us": total(lambda r: r["cublas_graph_us"]),
            "skinny_us": total(lambda r: r["skinny_graph_us"]),
            "best_of_us": total(lambda r: min(r["cublas_graph_us"], r["skinny_graph_us"])),
        }
    target_us = CHECKPOINT_BYTES / (args.bw_ceiling * 1e12) * 1e6
    print(f"\nLlama-3.1-8B decode step, linears only (sum of per-call graph times): "
          f"{linear_bytes / 1e9:.2f} GB of weights; {linear_bytes / 1e9:.2f} GB / "
          f"{args.bw_ceiling} TB/s = {linear_bytes / args.bw_ceiling / 1e6:.0f} µs; "
          f"16.06e9 B / {args.bw_ceiling} TB/s = {target_us:.0f} µs")
    print_table(["M", "cuBLAS us", "skinny us", "best-of us", "skinny TB/s",
                 "skinny / 16.06e9-target"],
                [[m, v["cublas_us"], v["skinny_us"], v["best_of_us"],
                  linear_bytes / v["skinny_us"] / 1e6, v["skinny_us"] / target_us]
                 for m, v in step.items()])
    return step


def _model_passes(ms: list[int], args: argparse.Namespace, device: torch.device) -> list:
    if args.no_model_pass:
        return []
    if args.fp8_weights:
        print("model pass: bf16 weights only (skipped with --fp8-weights)")
        return []
    passes = model_pass(ms, args, device)
    torch.cuda.empty_cache()
    target_ms = CHECKPOINT_BYTES / (args.bw_ceiling * 1e12) * 1e3
    print_table(["M", "cuBLAS ms", "skinny ms", "dispatch ms", "skinny TB/s",
                 "cuBLAS TB/s", "skinny / target"],
                [[p["m"], p["cublas_ms"], p["skinny_ms"], p["dispatch_ms"],
                  p["skinny_TBps"], p["cublas_TBps"], p["skinny_ms"] / target_ms]
                 for p in passes],
                title=f"measured model pass: 129 Llama-3.1-8B linears, distinct weights, one "
                      f"graph (target 16.06e9 B / {args.bw_ceiling} TB/s = {target_ms:.2f} "
                      f"ms; dispatch = should_use_skinny per call)")
    return passes


def main() -> None:
    args = _parse_args()
    ms = [int(m) for m in args.m.split(",")]
    if args.sm90_report:
        rows = sm90_report(ms, args.dtype)
        if args.out:
            write_json(args.out, {"sm90_report": rows, "dtype": str(args.dtype)})
        return
    if args.out is None:
        sys.exit("--out is required")
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    by_nk = _shapes_by_nk(args.shapes)
    bandwidth = measure_read_bandwidth(device, args.quick)
    print(f"\n{torch.cuda.get_device_name()}  triton {triton.__version__}  torch "
          f"{torch.__version__}  {args.dtype}  {linear_configs.num_sms(device)} SMs")
    print(f"measured: read {bandwidth['read_TBps']:.2f} TB/s, copy {bandwidth['copy_TBps']:.2f}"
          f" TB/s (ceiling used: {args.bw_ceiling} TB/s)")
    tuned = _tune(args, by_nk, ms, device)
    rows = []
    for (n, k), shape_names in by_nk.items():
        for r in run_shape(n, k, ms, args, device):
            rows.append({"shapes": shape_names, **r})
        torch.cuda.empty_cache()
    _print_rows(rows, args.bw_ceiling)
    thresholds, overall, overrides = _cutovers(by_nk, rows, args.fp8_weights)
    step = _llama_step(rows, ms, by_nk, args)
    passes = _model_passes(ms, args, device)
    write_json(args.out, {
        "device": torch.cuda.get_device_name(), "triton": triton.__version__,
        "torch": torch.__version__, "dtype": str(args.dtype), "m": ms, "calls": args.calls,
        "measured": bandwidth, "bw_ceiling_TBps": args.bw_ceiling, "rows": rows,
        "thresholds": thresholds, "recommended": {
            "SKINNY_MAX_M": overall,
            "MAX_M_BY_SHAPE": {f"{n},{k}": v for (n, k), v in overrides.items()}},
        "llama_step_sum": step, "model_pass": passes, "tuned": tuned,
        "tuned_table": linear_configs.TUNED.to_json(), "args": {
            k: str(v) for k, v in vars(args).items()},
    })


if __name__ == "__main__":
    main()
