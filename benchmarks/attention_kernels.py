"""Microbenchmark: Triton attention kernels vs the torch reference backend on one GPU.

Decode: batch 1 / 64 / 256 at context 1024 and 4096; extend: one 8192-token prompt. Head
layout of Llama-3.1-8B (32 query heads, 8 KV heads, head_dim 128), bf16, one layer. Slots are
shuffled page by page (`--page-size`, default 16; 1 = every token scattered), as a long-running
pool fragments. Times are `triton.testing.do_bench` medians (it flushes the L2 between runs).

Reported per row: the backend's whole `forward` (KV store + kernels, batch metadata already
cached, as for layers 2..N of a model forward), the kernels alone, and the torch reference's
`forward`. Decode is memory-bound, so its figure of merit is the KV bytes the kernel must read
(every context row's K and V once) over kernel time, against the copy bandwidth measured here
(default ceiling 4.2 TB/s). Extend is compute-bound: causal FLOPs (4 * D * H * S(S+1)/2) over
kernel time, against the bf16 matmul rate measured here (~780 TFLOP/s).

    python benchmarks/attention_kernels.py --out results.json
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
DTYPE = torch.bfloat16
EXTEND_SWEEP = [
    kernels.KernelConfig(128, 64, 8, 2),
    kernels.KernelConfig(128, 64, 8, 3),
    kernels.KernelConfig(128, 128, 8, 2),
    kernels.KernelConfig(128, 32, 8, 3),
    kernels.KernelConfig(64, 64, 4, 3),
]
# decode launch shapes (head block 16 = the GQA group of 4 padded for tl.dot)
DECODE_SWEEP = [
    kernels.KernelConfig(16, 64, 4, 3),
    kernels.KernelConfig(16, 64, 4, 4),
    kernels.KernelConfig(16, 128, 4, 2),
    kernels.KernelConfig(16, 128, 8, 3),
    kernels.KernelConfig(16, 32, 4, 4),
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


def run_case(name: str, seqs: list[tuple[int, int]], args, device, gen) -> dict:
    batch, num_slots = make_batch(seqs, args.page_size, device, gen)
    pool = KVPool(num_slots, (0, 1), KV_HEADS, HEAD_DIM, DTYPE, device)
    pool.k[0].normal_()
    pool.v[0].normal_()
    t = batch.num_tokens
    q = torch.randn(t, HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    k = torch.randn(t, KV_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    v = torch.randn(t, KV_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    scale = HEAD_DIM**-0.5
    tri, ref = TritonAttention(), TorchRefAttention()

    out = tri.forward(0, q, k, v, batch, pool, scale)  # builds and caches the batch metadata
    want = ref.forward(0, q, k, v, batch, pool, scale)
    rel_err = ((out.float() - want.float()).norm() / want.float().norm()).item()

    meta = tri._meta
    assert meta is not None
    k_cache, v_cache = pool.layer(0)
    if meta.is_decode:
        plan, ws = next(iter(meta.by_layout.values()))
        splits = plan.num_splits

        def kernel() -> None:
            kernels.decode_attention(q, k_cache, v_cache, batch.kv_indptr, batch.kv_indices,
                                     scale, plan, out=out, workspace=ws)
    else:
        tiles = next(iter(meta.by_layout.values()))
        splits = 0

        def kernel() -> None:
            kernels.extend_attention(q, k_cache, v_cache, meta.qo_indptr, batch.kv_indptr,
                                     batch.kv_indices, tiles, scale, out=out)

    kv_len = sum(p + e for p, e in seqs)
    sweep = {}
    if args.sweep and meta.is_decode:  # kernel time for other split counts (tuning data)
        s = 1
        while s <= min(32, max(1, kv_len // len(seqs) // 64)):
            p = kernels.plan_decode(len(seqs), KV_HEADS, 1, kv_len // len(seqs), 0,
                                    num_splits=s, min_chunk=64)
            w = kernels.decode_workspace(len(seqs), HEADS, HEAD_DIM, p, device)
            sweep[f"splits={p.num_splits}"] = 1e3 * bench(
                lambda p=p, w=w: kernels.decode_attention(
                    q, k_cache, v_cache, batch.kv_indptr, batch.kv_indices, scale, p, out=out,
                    workspace=w),
                True)
            s *= 2
        for cfg in DECODE_SWEEP:
            name_cfg = f"n{cfg.block_n}_w{cfg.num_warps}_s{cfg.num_stages}"
            sweep[name_cfg] = 1e3 * bench(
                lambda cfg=cfg: kernels.decode_attention(
                    q, k_cache, v_cache, batch.kv_indptr, batch.kv_indices, scale, plan,
                    out=out, workspace=ws, config=cfg),
                True)
        for mc in (32, 64, 128):  # smaller minimum chunks: more splits for small batches
            p = kernels.plan_decode(len(seqs), KV_HEADS, 1, kv_len // len(seqs),
                                    kernels.num_sms(device), min_chunk=mc)
            w = kernels.decode_workspace(len(seqs), HEADS, HEAD_DIM, p, device)
            sweep[f"min_chunk={mc} (splits {p.num_splits})"] = 1e3 * bench(
                lambda p=p, w=w: kernels.decode_attention(
                    q, k_cache, v_cache, batch.kv_indptr, batch.kv_indices, scale, p, out=out,
                    workspace=w),
                True)
    elif args.sweep:  # kernel time for other extend tile shapes (tuning data)
        for cfg in EXTEND_SWEEP:
            tl_host = kernels.extend_tiles(batch.extend_lens, batch.prefix_lens,
                                           HEADS // KV_HEADS, cfg.block_m)
            t_dev = torch.tensor(tl_host, dtype=torch.int32, device=device)
            name_cfg = f"m{cfg.block_m}_n{cfg.block_n}_w{cfg.num_warps}_s{cfg.num_stages}"
            sweep[name_cfg] = 1e3 * bench(
                lambda cfg=cfg, t_dev=t_dev: kernels.extend_attention(
                    q, k_cache, v_cache, meta.qo_indptr, batch.kv_indptr, batch.kv_indices,
                    t_dev, scale, out=out, config=cfg),
                True)

    fwd_ms = bench(lambda: tri.forward(0, q, k, v, batch, pool, scale), args.quick)
    kern_ms = bench(kernel, args.quick)
    ref_ms = bench(lambda: ref.forward(0, q, k, v, batch, pool, scale), args.quick)

    row = {
        "case": name, "batch": len(seqs), "kv_tokens": kv_len, "splits": splits,
        "triton_forward_us": fwd_ms * 1e3, "triton_kernel_us": kern_ms * 1e3,
        "torch_ref_us": ref_ms * 1e3, "speedup_vs_ref": ref_ms / fwd_ms, "rel_err": rel_err,
        "sweep_kernel_us": sweep,
    }
    if meta.is_decode:
        kv_bytes = 2 * kv_len * KV_HEADS * HEAD_DIM * DTYPE.itemsize
        row["kv_read_GBps"] = kv_bytes / (kern_ms * 1e-3) / 1e9
        row["pct_of_bw_ceiling"] = 100 * row["kv_read_GBps"] / (args.bw_ceiling * 1e3)
    else:
        flops = sum(4 * HEAD_DIM * HEADS * (e * p + e * (e + 1) / 2) for p, e in seqs)
        row["TFLOPs"] = flops / (kern_ms * 1e-3) / 1e12
        row["pct_of_flops_ceiling"] = 100 * row["TFLOPs"] / args.flops_ceiling
    return row


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON results path")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--bw-ceiling", type=float, default=4.2, help="TB/s")
    ap.add_argument("--flops-ceiling", type=float, default=780.0, help="bf16 TFLOP/s")
    ap.add_argument("--quick", action="store_true", help="shorter do_bench windows")
    ap.add_argument("--sweep", action="store_true",
                    help="also time other split counts / extend tile shapes")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)

    ceilings = measure_ceilings(device, args.quick)
    rows = []
    for ctx in (1024, 4096):
        for bs in (1, 64, 256):
            rows.append(run_case(f"decode bs={bs} ctx={ctx}", [(ctx - 1, 1)] * bs, args,
                                 device, gen))
    rows.append(run_case("extend 1x8192", [(0, 8192)], args, device, gen))

    head = (f"{'case':<24}{'splits':>7}{'fwd us':>10}{'kernel us':>11}{'torch us':>11}"
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
        print(f"{r['case']:<24}{r['splits']:>7}{r['triton_forward_us']:>10.1f}"
              f"{r['triton_kernel_us']:>11.1f}{r['torch_ref_us']:>11.0f}"
              f"{r['speedup_vs_ref']:>8.1f}x{rate:>16}{pct:>7.0f}%{r['rel_err']:>10.1e}")
    for r in rows:
        if r["sweep_kernel_us"]:
            best = min(r["sweep_kernel_us"], key=r["sweep_kernel_us"].get)
            print(f"sweep {r['case']}: " + ", ".join(
                f"{k} {v:.1f}" for k, v in r["sweep_kernel_us"].items()) + f"  (best {best})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "device": torch.cuda.get_device_name(), "triton": triton.__version__,
        "torch": torch.__version__, "page_size": args.page_size, "measured": ceilings,
        "ceilings": {"bw_TBps": args.bw_ceiling, "bf16_TFLOPs": args.flops_ceiling},
        "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": str(DTYPE),
        "rows": rows,
    }, indent=2))


if __name__ == "__main__":
    main()
