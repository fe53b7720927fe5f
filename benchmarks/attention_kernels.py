"""Microbenchmark: Triton attention kernels vs the torch reference backend on one GPU.

Decode: batch 1 / 64 / 256 at context 1024 and 4096; extend: one 8192-token prompt. Head
layout of Llama-3.1-8B (32 query heads, 8 KV heads, head_dim 128), bf16 q, one layer. Slots are
shuffled page by page (`--page-size`, default 16; 1 = every token scattered), as a long-running
pool fragments. Times are `triton.testing.do_bench` medians (it flushes the L2 between runs).

`--kv-dtype bf16 fp8_e4m3` runs every case on a bf16 pool and again on an FP8 pool (per-KV-head
K and V scales calibrated to the random rows' max, rows written by `KVPool.store` as the engine
writes them); the FP8 rows' bandwidth counts the FP8 bytes. With `--sweep`, FP8 decode also
times the FP8 launch shapes and dot modes of `DECODE_SWEEP_FP8` (`KernelConfig.fp8_dot`).

Reported per row: the backend's whole `forward` (KV store + kernels, batch metadata already
cached, as for layers 2..N of a model forward), the kernels alone, and the torch reference's
`forward`. Decode is memory-bound, so its figure of merit is the KV bytes the kernel must read
(every context row's K and V once) over kernel time, against the copy bandwidth measured here
(default ceiling 4.2 TB/s). Extend is compute-bound: causal FLOPs (4 * D * H * S(S+1)/2) over
kernel time, against the bf16 matmul rate measured here (~780 TFLOP/s).

    python benchmarks/attention_kernels.py --out results.json
    python benchmarks/attention_kernels.py --kv-dtype bf16 fp8_e4m3 --sweep --quick \
        --decode-only --out sweep.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import triton.testing  # noqa: E402

from phaseflip.attention.torch_ref import TorchRefAttention  # noqa: E402
from phaseflip.attention.triton_backend import TritonAttention  # noqa: E402
from phaseflip.cache.kv_pool import KVPool  # noqa: E402
from phaseflip.forward_batch import ForwardBatch  # noqa: E402
from phaseflip.kernels import attention as kernels  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16  # q, new K/V rows and the float pool
KV_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
EXTEND_SWEEP = [
    kernels.KernelConfig(128, 64, 8, 2),
    kernels.KernelConfig(128, 64, 8, 3),
    kernels.KernelConfig(128, 128, 8, 2),
    kernels.KernelConfig(128, 32, 8, 3),
    kernels.KernelConfig(64, 64, 4, 3),
]
# FP8 extend: today's shape in each dot mode, then the two runners-up of the bf16 sweep
EXTEND_SWEEP_FP8 = [
    kernels.KernelConfig(64, 64, 4, 3, "q"),
    kernels.KernelConfig(64, 64, 4, 3, "fp16_pv"),
    kernels.KernelConfig(64, 64, 4, 3, "fp16"),
    kernels.KernelConfig(128, 64, 8, 3, "fp16"),
    kernels.KernelConfig(128, 128, 8, 2, "fp16"),
]
# decode launch shapes (head block 16 = the GQA group of 4 padded for tl.dot)
DECODE_SWEEP = [
    kernels.KernelConfig(16, 64, 4, 3),
    kernels.KernelConfig(16, 64, 4, 4),
    kernels.KernelConfig(16, 128, 4, 2),
    kernels.KernelConfig(16, 128, 8, 3),
    kernels.KernelConfig(16, 32, 4, 4),
    kernels.KernelConfig(64, 64, 4, 3),
]
# FP8 decode: the bf16 shape with each dot mode (the first = FP8's shape before it had its own),
# then 8 warps (fewer registers a thread), larger key blocks and deeper pipelines (an FP8 tile
# is half a bf16 tile's bytes)
DECODE_SWEEP_FP8 = [
    kernels.KernelConfig(16, 64, 4, 3, "q"),
    kernels.KernelConfig(16, 64, 4, 3, "fp16_pv"),
    kernels.KernelConfig(16, 64, 4, 3, "fp16"),
    kernels.KernelConfig(16, 64, 4, 4, "fp16"),
    kernels.KernelConfig(16, 32, 4, 4, "fp16"),
    kernels.KernelConfig(16, 64, 8, 3, "q"),
    kernels.KernelConfig(16, 64, 8, 3, "fp16"),
    kernels.KernelConfig(16, 64, 8, 4, "fp16"),
    kernels.KernelConfig(16, 128, 4, 3, "fp16"),
    kernels.KernelConfig(16, 128, 8, 3, "fp16"),
    kernels.KernelConfig(16, 128, 8, 4, "fp16"),
    kernels.KernelConfig(16, 256, 8, 2, "fp16"),
    # 64 query rows (60 of them padding): Hopper's warpgroup MMA reads V from shared memory as
    # fp16, so the FP8 tile is widened once into shared memory instead of gathered byte-wise
    kernels.KernelConfig(64, 64, 4, 3, "fp16"),
    kernels.KernelConfig(64, 128, 4, 2, "fp16"),
]


def bench(fn, quick: bool) -> float:
    """Median milliseconds."""
    return triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 100,
                                   return_mode="median")


def make_batch(seqs: list[tuple[int, int]], page: int, device: torch.device, gen: torch.Generator
               ) -> tuple[ForwardBatch, int]:
    """Batch of (prefix, extend) sequences over page-shuffled slots; returns it and num_slots."""
    pages = [math.ceil((p + e) / page) for p, e in seqs]
    num_pages = sum(pages) + 1  # page 0 reserved
    order = torch.randperm(num_pages - 1, generator=gen) + 1
    indices, indptr, out_loc, positions = [], [0], [], []
    used = 0
    for (p, e), n in zip(seqs, pages):
        pg = order[used : used + n]
        used += n
        slots = (pg[:, None] * page + torch.arange(page)[None, :]).reshape(-1)[: p + e]
        indices.append(slots)
        out_loc.append(slots[p:])
        positions.extend(range(p, p + e))
        indptr.append(indptr[-1] + p + e)
    t = len(positions)
    batch = ForwardBatch(
        input_ids=torch.zeros(t, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        out_cache_loc=torch.cat(out_loc),
        extend_lens=[e for _, e in seqs],
        prefix_lens=[p for p, _ in seqs],
        kv_indptr=torch.tensor(indptr, dtype=torch.int64),
        kv_indices=torch.cat(indices),
        logits_indices=torch.arange(t, dtype=torch.int64),
        max_position=max(positions),
    ).to(device)
    return batch, num_pages * page


def make_pool(num_slots: int, kv_dtype: torch.dtype, device: torch.device) -> KVPool:
    """One layer's pool of random rows; FP8: per-KV-head scales from the rows' max (what a
    calibrated checkpoint's scales do), rows quantized by `KVPool.store` as the engine's are."""
    pool = KVPool(num_slots, (0, 1), KV_HEADS, HEAD_DIM, kv_dtype, device)
    if pool.k_scale is None:
        pool.k[0].normal_()
        pool.v[0].normal_()
        return pool
    slots = torch.arange(num_slots, device=device)
    for chunk in slots.split(1 << 18):
        rows = torch.randn(2, len(chunk), KV_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
        if chunk[0] == 0:  # N(0, 1) rows: the scales put each head's ~5-sigma max at 448
            pool.k_scale[0] = rows[0].float().abs().amax((0, 2)) / pool.fp8_max
            pool.v_scale[0] = rows[1].float().abs().amax((0, 2)) / pool.fp8_max
        pool.store(0, chunk, rows[0], rows[1])
    return pool


def config_name(cfg: kernels.KernelConfig, fp8: bool, usual_m: int = 16) -> str:
    """n{keys}_w{warps}_s{stages}[_{FP8 dot mode}], led by m{rows} when rows != usual_m."""
    name = f"n{cfg.block_n}_w{cfg.num_warps}_s{cfg.num_stages}"
    if cfg.block_m != usual_m:
        name = f"m{cfg.block_m}_{name}"
    return f"{name}_{cfg.fp8_dot}" if fp8 else name


def decode_sweep(run, seqs: list[tuple[int, int]], plan, ws, fp8: bool, device
                 ) -> tuple[dict, dict]:
    """Kernel us (and relative error) for other split counts, launch shapes (FP8: and dot
    modes), minimum chunks. `run(plan, workspace, config)` times one decode launch."""
    bs, ctx = len(seqs), sum(p + e for p, e in seqs) // len(seqs)
    runs = {}
    s = 1
    while s <= min(32, max(1, ctx // 64)):
        p = kernels.plan_decode(bs, KV_HEADS, 1, ctx, 0, num_splits=s, min_chunk=64)
        w = kernels.decode_workspace(bs, HEADS, HEAD_DIM, p, device)
        runs[f"splits={p.num_splits}"] = run(p, w, None)
        s *= 2
    for cfg in DECODE_SWEEP_FP8 if fp8 else DECODE_SWEEP:
        runs[config_name(cfg, fp8)] = run(plan, ws, cfg)
    for mc in (32, 64, 128):  # smaller minimum chunks: more splits for small batches
        p = kernels.plan_decode(bs, KV_HEADS, 1, ctx, kernels.num_sms(device), min_chunk=mc)
        w = kernels.decode_workspace(bs, HEADS, HEAD_DIM, p, device)
        runs[f"min_chunk={mc} (splits {p.num_splits})"] = run(p, w, None)
    return {n: r[0] for n, r in runs.items()}, {n: r[1] for n, r in runs.items()}


def extend_sweep(run, batch: ForwardBatch, fp8: bool, device) -> tuple[dict, dict]:
    """Kernel us (and relative error) of the extend tile shapes in EXTEND_SWEEP (FP8:
    EXTEND_SWEEP_FP8, dot modes too); `run(config, tiles)` times one."""
    runs = {}
    for cfg in EXTEND_SWEEP_FP8 if fp8 else EXTEND_SWEEP:
        host = kernels.extend_tiles(batch.extend_lens, batch.prefix_lens, HEADS // KV_HEADS,
                                    cfg.block_m)
        runs[config_name(cfg, fp8, usual_m=0)] = run(
            cfg, torch.tensor(host, dtype=torch.int32, device=device))
    return {n: r[0] for n, r in runs.items()}, {n: r[1] for n, r in runs.items()}


def make_case(seqs: list[tuple[int, int]], kv_dtype: torch.dtype, page: int,
              device: torch.device, gen: torch.Generator) -> tuple:
    """(batch, pool, q, k, v) for `seqs` at the 8B attention shape: the new rows random."""
    batch, num_slots = make_batch(seqs, page, device, gen)
    pool = make_pool(num_slots, kv_dtype, device)
    t = batch.num_tokens
    q = torch.randn(t, HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    k = torch.randn(t, KV_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    v = torch.randn(t, KV_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    return batch, pool, q, k, v


def run_case(name: str, seqs: list[tuple[int, int]], kv_dtype: torch.dtype, args, device,
             gen) -> dict:
    batch, pool, q, k, v = make_case(seqs, kv_dtype, args.page_size, device, gen)
    scale = HEAD_DIM**-0.5
    tri, ref = TritonAttention(), TorchRefAttention()

    out = tri.forward(0, q, k, v, batch, pool, scale)  # builds and caches the batch metadata
    want = ref.forward(0, q, k, v, batch, pool, scale).float()

    def rel(got: torch.Tensor) -> float:
        return ((got.float() - want).norm() / want.norm()).item()

    rel_err = rel(out)

    meta = tri._meta
    assert meta is not None
    k_cache, v_cache = pool.layer(0)
    k_scale, v_scale = pool.scales(0) or (None, None)
    fp8 = pool.k_scale is not None
    sweep: dict[str, float] = {}
    sweep_err: dict[str, float] = {}  # each candidate's last output against the reference
    if meta.is_decode:
        plan, ws = next(iter(meta.by_layout.values()))
        splits = plan.num_splits

        def run(p, w, cfg, quick: bool = True) -> tuple[float, float]:
            us = 1e3 * bench(lambda: kernels.decode_attention(
                q, k_cache, v_cache, batch.kv_indptr, batch.kv_indices, scale, p, out=out,
                workspace=w, config=cfg, k_scale=k_scale, v_scale=v_scale), quick)
            return us, rel(out)

        kern_ms = run(plan, ws, None, args.quick)[0] / 1e3
        if args.sweep:
            sweep, sweep_err = decode_sweep(run, seqs, plan, ws, fp8, device)
    else:
        tiles = next(v for k, v in meta.by_layout.items() if k[0] == "tiles")
        splits = 0

        def run_extend(cfg, t_dev, quick: bool = True) -> tuple[float, float]:
            us = 1e3 * bench(lambda: kernels.extend_attention(
                q, k_cache, v_cache, meta.qo_indptr, batch.kv_indptr, batch.kv_indices, t_dev,
                scale, out=out, config=cfg, k_scale=k_scale, v_scale=v_scale), quick)
            return us, rel(out)

        kern_ms = run_extend(None, tiles, args.quick)[0] / 1e3
        if args.sweep:
            sweep, sweep_err = extend_sweep(run_extend, batch, fp8, device)

    fwd_ms = bench(lambda: tri.forward(0, q, k, v, batch, pool, scale), args.quick)
    ref_ms = bench(lambda: ref.forward(0, q, k, v, batch, pool, scale), args.quick)
    kv_len = sum(p + e for p, e in seqs)
    default = kernels.decode_config(DTYPE, HEAD_DIM, HEADS // KV_HEADS, device, kv_dtype)
    row = {
        "case": name, "kv_dtype": str(kv_dtype).removeprefix("torch."), "batch": len(seqs),
        "kv_tokens": kv_len, "splits": splits,
        "decode_config": config_name(default, fp8) if meta.is_decode else None,
        "triton_forward_us": fwd_ms * 1e3, "triton_kernel_us": kern_ms * 1e3,
        "torch_ref_us": ref_ms * 1e3, "speedup_vs_ref": ref_ms / fwd_ms, "rel_err": rel_err,
        "sweep_kernel_us": sweep, "sweep_rel_err": sweep_err,
    }
    return row | rates(seqs, kv_dtype, meta.is_decode, kern_ms, sweep, args)


def rates(seqs: list[tuple[int, int]], kv_dtype: torch.dtype, is_decode: bool,
          kern_ms: float, sweep: dict[str, float], args) -> dict:
    """A case's kernel time against its ceiling: decode reads every context row's K and V
    once (bytes / s, of the bandwidth ceiling), extend does its causal FLOPs (of the bf16
    matmul ceiling)."""
    if is_decode:
        kv_bytes = 2 * sum(p + e for p, e in seqs) * KV_HEADS * HEAD_DIM * kv_dtype.itemsize
        gbps = kv_bytes / (kern_ms * 1e-3) / 1e9
        return {"kv_read_GBps": gbps, "pct_of_bw_ceiling": 100 * gbps / (args.bw_ceiling * 1e3),
                "sweep_TBps": {n: kv_bytes / (us * 1e-6) / 1e12 for n, us in sweep.items()}}
    flops = sum(4 * HEAD_DIM * HEADS * (e * p + e * (e + 1) / 2) for p, e in seqs)
    tflops = flops / (kern_ms * 1e-3) / 1e12
    return {"TFLOPs": tflops, "pct_of_flops_ceiling": 100 * tflops / args.flops_ceiling}


def measure_ceilings(device: torch.device, quick: bool) -> dict:
    """Copy bandwidth (read + write bytes) and bf16 matmul rate on random data, for context."""
    a = torch.empty(1024**3, dtype=DTYPE, device=device).normal_()  # 2 GiB
    b = torch.empty_like(a)
    copy_ms = bench(lambda: b.copy_(a), quick)
    copy_bytes = 2 * a.numel() * a.element_size()
    n = 8192
    x = torch.randn(n, n, device=device, dtype=DTYPE)
    y = torch.randn(n, n, device=device, dtype=DTYPE)
    mm_ms = bench(lambda: x @ y, quick)
    return {"copy_TBps": copy_bytes / (copy_ms * 1e-3) / 1e12,
            "bf16_matmul_TFLOPs": 2 * n**3 / (mm_ms * 1e-3) / 1e12}


def print_rows(rows: list[dict], args, ceilings: dict) -> None:
    head = (f"{'case':<24}{'kv':>9}{'splits':>7}{'fwd us':>10}{'kernel us':>11}{'torch us':>11}"
            f"{'speedup':>9}{'rate':>16}{'% ceil':>8}{'rel err':>10}")
    print(f"\n{torch.cuda.get_device_name()}  triton {triton.__version__}  torch "
          f"{torch.__version__}  page_size={args.page_size}")
    print(f"measured: copy {ceilings['copy_TBps']:.2f} TB/s, bf16 matmul "
          f"{ceilings['bf16_matmul_TFLOPs']:.0f} TFLOP/s (ceilings used: {args.bw_ceiling} TB/s,"
          f" {args.flops_ceiling} TFLOP/s)")
    print(head)
    for r in rows:
        if "kv_read_GBps" in r:
            rate, pct = f"{r['kv_read_GBps']:.0f} GB/s", r["pct_of_bw_ceiling"]
        else:
            rate, pct = f"{r['TFLOPs']:.0f} TFLOP/s", r["pct_of_flops_ceiling"]
        print(f"{r['case']:<24}{r['kv_dtype']:>9.9}{r['splits']:>7}{r['triton_forward_us']:>10.1f}"
              f"{r['triton_kernel_us']:>11.1f}{r['torch_ref_us']:>11.0f}"
              f"{r['speedup_vs_ref']:>8.1f}x{rate:>16}{pct:>7.0f}%{r['rel_err']:>10.1e}")
    for r in rows:
        if r["sweep_kernel_us"]:
            best = min(r["sweep_kernel_us"], key=r["sweep_kernel_us"].get)
            print(f"sweep {r['case']} {r['kv_dtype']}: " + ", ".join(
                f"{k} {v:.1f}" for k, v in r["sweep_kernel_us"].items()) + f"  (best {best})")
            wrong = {k: e for k, e in r["sweep_rel_err"].items() if not e < 2e-2}
            if wrong:
                print(f"  WRONG OUTPUT (rel err vs reference): {wrong}")


def print_fp8_summary(rows: list[dict]) -> None:
    """Per case: bf16's kernel, FP8's (default shape) and FP8's best launch-shape candidate."""
    by_case: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_case.setdefault(r["case"], {})[r["kv_dtype"]] = r
    for case, pair in by_case.items():
        bf, f8 = pair.get("bfloat16"), pair.get("float8_e4m3fn")
        if bf is None or f8 is None:
            continue
        shapes = {k: v for k, v in f8["sweep_kernel_us"].items()
                  if not k.startswith(("splits", "min_chunk"))}
        best = min(shapes, key=shapes.get) if shapes else None
        line = (f"{case:<24} bf16 {bf['triton_kernel_us']:8.1f} us   fp8 "
                f"{f8['triton_kernel_us']:8.1f} us ({f8['decode_config'] or 'extend default'}, "
                f"{f8['triton_kernel_us'] / bf['triton_kernel_us']:.2f}x bf16)")
        if best is not None:
            line += (f"   best fp8 {best} {shapes[best]:.1f} us "
                     f"({shapes[best] / bf['triton_kernel_us']:.2f}x)")
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True,
                    help="JSON results path (rewritten after every case)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--bw-ceiling", type=float, default=4.2, help="TB/s")
    ap.add_argument("--flops-ceiling", type=float, default=780.0, help="bf16 TFLOP/s")
    ap.add_argument("--quick", action="store_true", help="shorter do_bench windows")
    ap.add_argument("--sweep", action="store_true",
                    help="also time other split counts / launch shapes / extend tile shapes")
    ap.add_argument("--kv-dtype", nargs="+", choices=sorted(KV_DTYPES), default=["bf16"],
                    help="KV pool dtype(s); every case runs once per dtype")
    ap.add_argument("--decode-only", action="store_true", help="skip the extend case")
    ap.add_argument("--decode-cases", nargs="+", metavar="BSxCTX",
                    default=[f"{bs}x{ctx}" for ctx in (1024, 4096) for bs in (1, 64, 256)],
                    help="decode batches: sequences x context (e.g. 32x1536 for an offline "
                         "run's long tail)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)

    ceilings = measure_ceilings(device, args.quick)
    cases = []
    for spec in args.decode_cases:
        bs, ctx = (int(v) for v in spec.lower().split("x"))
        cases.append((f"decode bs={bs} ctx={ctx}", [(ctx - 1, 1)] * bs))
    if not args.decode_only:
        cases.append(("extend 1x8192", [(0, 8192)]))
    meta = {
        "device": torch.cuda.get_device_name(), "triton": triton.__version__,
        "torch": torch.__version__, "page_size": args.page_size, "measured": ceilings,
        "ceilings": {"bw_TBps": args.bw_ceiling, "bf16_TFLOPs": args.flops_ceiling},
        "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": str(DTYPE),
        "kv_dtypes": args.kv_dtype, "rows": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name, seqs in cases:  # each case on every pool dtype before the next case
        for kv in args.kv_dtype:
            meta["rows"].append(run_case(name, seqs, KV_DTYPES[kv], args, device, gen))
            args.out.write_text(json.dumps(meta, indent=2))  # a cut-short run keeps its rows
            torch.cuda.empty_cache()
    print_rows(meta["rows"], args, ceilings)
    if len(args.kv_dtype) > 1:
        print("\nFP8 against bf16 (kernel us; 'best' = fastest FP8 launch shape of the sweep)")
        print_fp8_summary(meta["rows"])


if __name__ == "__main__":
    main()
