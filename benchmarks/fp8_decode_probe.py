"""The CUDA FP8 decode attention kernel (`kernels/csrc/fp8_decode.cu`) against the Triton
kernel and a float32 reference, on random paged FP8 pools, unsplit and (the decode tail's
few long sequences) split as the backend plans them and at the split counts of
`SWEEP_SPLITS`; and the kernel built with -DGATHER_ONLY (the same loads, no math: the access
pattern's ceiling).

    python -m benchmarks.fp8_decode_probe --out probe.json
    python -m benchmarks.fp8_decode_probe --layout-sweep   # token- vs head-major pools
    python -m benchmarks.fp8_decode_probe --stage-sweep    # the CUDA kernel's build options

Each case: B sequences with random context lengths around a mean, 8 KV heads × head_dim 128,
pages of 16 slots shuffled, per-KV-head scales. Prints each kernel's µs, the pool bytes read
per µs (TB/s against 4.2) and the relative error of both against the reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math

import torch

from benchmarks.common import write_json
from phaseflip.kernels.attention import (
    MIN_CHUNK,
    DecodePlan,
    decode_attention,
    decode_config,
    decode_order,
    decode_workspace,
    num_sms,
    orders_decode,
    plan_decode,
)
from phaseflip.kernels.attention_cuda import CudaFp8Decode

# (sequences, mean context, group): unsplit launches (the CUDA kernel's share), then the
# decode tail's few long sequences, split as the backend plans them (`SPLIT_CASES`; row 0
# of every case holds one key, so a case of 2 is one long sequence)
CASES = [(1000, 454, 4), (600, 450, 4), (300, 423, 4), (160, 600, 4), (128, 1024, 4),
         (66, 2048, 4), (256, 512, 8)]
SPLIT_CASES = [(50, 1500, 4), (37, 1500, 4), (22, 1500, 4), (8, 2000, 4), (2, 3000, 4)]


def make_case(b: int, mean: int, group: int, kvh: int = 8, d: int = 128, seed: int = 0,
              device: str = "cuda"):
    gen = torch.Generator(device=device).manual_seed(seed)
    lens = torch.randint(max(1, mean // 4), 2 * mean - mean // 4 + 1, (b,), generator=gen,
                         device=device)
    lens[0] = 1  # a one-key sequence
    total = int(lens.sum())
    pages = math.ceil(total / 16) + 8
    perm = torch.randperm(pages, generator=gen, device=device)
    slots = (perm[:, None] * 16 + torch.arange(16, device=device)).reshape(-1)[:total]
    indptr = torch.zeros(b + 1, dtype=torch.int64, device=device)
    indptr[1:] = torch.cumsum(lens, 0)
    k = (torch.randn(pages * 16, kvh, d, generator=gen, device=device) * 40).to(
        torch.float8_e4m3fn)
    v = (torch.randn(pages * 16, kvh, d, generator=gen, device=device) * 40).to(
        torch.float8_e4m3fn)
    ks = torch.rand(kvh, generator=gen, device=device) * 0.02 + 0.005
    vs = torch.rand(kvh, generator=gen, device=device) * 0.02 + 0.005
    q = torch.randn(b, kvh * group, d, generator=gen, device=device).to(torch.bfloat16)
    return q, k, v, indptr, slots.to(torch.int64), ks, vs


def reference(q, k, v, indptr, idx, ks, vs, scale):
    b, hq, d = q.shape
    kvh = k.shape[1]
    group = hq // kvh
    out = torch.empty(b, hq, d, device=q.device, dtype=torch.float32)
    kf = k.float() * ks[None, :, None]
    vf = v.float() * vs[None, :, None]
    ip = indptr.tolist()
    for i in range(b):
        sl = idx[ip[i]:ip[i + 1]]
        kk = kf[sl].repeat_interleave(group, dim=1)  # [n, hq, d]
        vv = vf[sl].repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].float(), kk) * scale
        out[i] = torch.einsum("hn,nhd->hd", s.softmax(-1), vv)
    return out


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref).norm() / ref.norm())


def probe_case(b: int, mean: int, group: int, split: bool, cuda: CudaFp8Decode,
               gather: CudaFp8Decode, sms: int) -> dict:
    """One case: Triton, CUDA, CUDA in row order and gather-only µs, TB/s and errors."""
    from triton.testing import do_bench

    q, k, v, indptr, idx, ks, vs = make_case(b, mean, group)
    dev, kvh, d = q.device, k.shape[1], k.shape[2]
    scale = d ** -0.5
    ref = reference(q, k, v, indptr, idx, ks, vs, scale)
    max_len = int((indptr[1:] - indptr[:-1]).max())
    cfg = decode_config(q.dtype, d, group, dev, kv_dtype=k.dtype)
    heads_blocks = math.ceil(group / cfg.block_m)
    plan = plan_decode(b, kvh, heads_blocks, max_len, sms, num_splits=None if split else 1)
    ws = decode_workspace(b, q.shape[1], d, plan, dev) if plan.num_splits > 1 else None
    order = decode_order(indptr) if orders_decode(b, kvh, heads_blocks, sms) else None
    tri_out = torch.empty(b, q.shape[1] * d, device=dev, dtype=q.dtype)
    cu_out = torch.empty_like(tri_out)
    tri = functools.partial(decode_attention, q, k, v, indptr, idx, scale, plan, out=tri_out,
                            workspace=ws, config=cfg, k_scale=ks, v_scale=vs, order=order)
    args = (q, k, v, indptr, idx, ks, vs, scale, cu_out)
    cu = functools.partial(cuda, *args, order, plan, ws)
    gat = functools.partial(gather, *args, order, plan, ws)
    plain = functools.partial(cuda, *args, None, plan, ws)  # launch order ignored
    assert CudaFp8Decode.accepts(q, k, v, cu_out, indptr, idx, ks, vs, order, None)
    e_tri, e_cu = rel(tri().view_as(q), ref), rel(cu().view_as(q), ref)
    t_tri, t_cu, t_gat, t_plain = (do_bench(f, warmup=20, rep=200) * 1e3
                                   for f in (tri, cu, gat, plain))
    nbytes = int(indptr[-1]) * kvh * d * 2
    by_splits = split_sweep(cuda, args, order, cfg, ks, vs) if split else {}
    return {"batch": b, "mean_ctx": mean, "group": group, "splits": plan.num_splits,
            "us_by_splits": by_splits,
            "ordered": order is not None, "pool_mb": nbytes / 1e6, "triton_us": t_tri,
            "cuda_us": t_cu, "gather_only_us": t_gat, "triton_tbs": nbytes / t_tri / 1e6,
            "cuda_tbs": nbytes / t_cu / 1e6, "gather_only_tbs": nbytes / t_gat / 1e6,
            "err_triton": e_tri, "err_cuda": e_cu, "cuda_in_row_order_us": t_plain}


# split counts the sweep times both kernels at (the planner aims at ~4 programs an SM, which
# suits Triton; the CUDA kernel holds 3 CTAs an SM, so its waves fall elsewhere)
SWEEP_SPLITS = (1, 2, 3, 4, 6, 9)


def split_sweep(cuda: CudaFp8Decode, args: tuple, order, cfg, ks, vs) -> dict:
    """{splits: (Triton µs, CUDA µs)} for one case at each of `SWEEP_SPLITS`."""

    q, k, v, indptr, idx, _, _, scale, out = args
    times = {}
    for n in SWEEP_SPLITS:
        plan = DecodePlan(num_splits=n, min_chunk=MIN_CHUNK)
        ws = decode_workspace(q.shape[0], q.shape[1], q.shape[2], plan, q.device)
        tri = functools.partial(decode_attention, q, k, v, indptr, idx, scale, plan, out=out,
                                workspace=ws, config=cfg, k_scale=ks, v_scale=vs, order=order)
        cu = functools.partial(cuda, *args, order, plan, ws)
        times[n] = tuple(_us(f, 100) for f in (tri, cu))
    return times


def _us(fn, rep: int) -> float:
    """`fn`'s do_bench median in µs, to 0.1."""
    from triton.testing import do_bench

    return round(do_bench(fn, warmup=10, rep=rep) * 1e3, 1)


# the decode tail's shapes for `--tail-sweep` (sequences, mean context, group), and the
# Triton launch shapes (keys a step, warps, stages) and split counts it times them at: the
# planner's ~4 programs an SM and the FP8 shape (128 keys, 4 warps, 3 stages: 96 KB of shared
# memory, two programs an SM) were chosen on large batches, never on the tail's
TAIL_CASES = [(64, 1200, 4), (50, 1500, 4), (37, 1500, 4), (22, 1500, 4), (12, 1800, 4),
              (4, 2500, 4)]
TAIL_SHAPES = ((128, 4, 3), (128, 4, 2), (64, 4, 3), (64, 4, 2), (64, 2, 3), (32, 2, 3))
TAIL_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)


def tail_sweep(b: int, mean: int, group: int, cuda: CudaFp8Decode, gather: CudaFp8Decode,
               sms: int) -> dict:
    """One tail case: µs of Triton at every (shape, splits), of CUDA and of its gather-only
    build at every split count; the planner's pick and the fastest of each."""

    q, k, v, indptr, idx, ks, vs = make_case(b, mean, group)
    dev, kvh, d = q.device, k.shape[1], k.shape[2]
    scale = d ** -0.5
    ref = reference(q, k, v, indptr, idx, ks, vs, scale)
    base = decode_config(q.dtype, d, group, dev, kv_dtype=k.dtype)
    planned = plan_decode(b, kvh, math.ceil(group / base.block_m), int(
        (indptr[1:] - indptr[:-1]).max()), sms).num_splits
    order = decode_order(indptr) if orders_decode(b, kvh, 1, sms) else None
    out = torch.empty(b, q.shape[1] * d, device=dev, dtype=q.dtype)
    args = (q, k, v, indptr, idx, ks, vs, scale, out)
    nbytes = int(indptr[-1]) * kvh * d * 2
    triton_us: dict[str, float] = {}
    cuda_us: dict[int, float] = {}
    gather_us: dict[int, float] = {}
    worst = 0.0
    for n in TAIL_SPLITS:
        plan = DecodePlan(num_splits=n, min_chunk=MIN_CHUNK)
        ws = decode_workspace(b, q.shape[1], d, plan, dev) if n > 1 else None
        for bn, w, st in TAIL_SHAPES:
            cfg = dataclasses.replace(base, block_n=bn, num_warps=w, num_stages=st)
            f = functools.partial(decode_attention, q, k, v, indptr, idx, scale, plan,
                                  out=out, workspace=ws, config=cfg, k_scale=ks, v_scale=vs,
                                  order=order)
            worst = max(worst, rel(f().view_as(q), ref))
            triton_us[f"{bn}x{w}x{st}/{n}"] = _us(f, 60)
        cu = functools.partial(cuda, *args, order, plan, ws)
        worst = max(worst, rel(cu().view_as(q), ref))
        cuda_us[n] = _us(cu, 60)
        gat = functools.partial(gather, *args, order, plan, ws)
        gather_us[n] = _us(gat, 60)
    best_t = min(triton_us, key=triton_us.get)
    best_c = min(cuda_us, key=cuda_us.get)
    shipped = triton_us[f"{base.block_n}x{base.num_warps}x{base.num_stages}/{planned}"]
    return {"batch": b, "mean_ctx": mean, "group": group, "pool_mb": nbytes / 1e6,
            "planned_splits": planned, "shipped_us": shipped, "best_triton": best_t,
            "best_triton_us": triton_us[best_t], "best_cuda_splits": best_c,
            "best_cuda_us": cuda_us[best_c], "best_gather_us": min(gather_us.values()),
            "shipped_tbs": nbytes / shipped / 1e6, "max_rel_err": worst,
            "triton_us": triton_us, "cuda_us": cuda_us, "gather_only_us": gather_us}


# `--layout-sweep`: the unsplit large batches and the tail's shapes, each read from the pool
# as stored now (token-major: a slot's KV heads side by side, 128 B a head in FP8) and
# head-major ([KV heads, slots, D] viewed as [slots, KV heads, D]: a 16-slot page of one
# head is 2 KB contiguous), FP8 and bf16, Triton at the shipped plan
LAYOUT_CASES = CASES[:6] + TAIL_CASES


def head_major(x: torch.Tensor) -> torch.Tensor:
    """The same rows stored [KV heads, slots, D], viewed as [slots, KV heads, D]."""
    return x.transpose(0, 1).contiguous().transpose(0, 1)


def layout_sweep(b: int, mean: int, group: int, sms: int, cuda: CudaFp8Decode,
                 gather: CudaFp8Decode) -> dict:
    """One case: Triton's µs and TB/s on a token-major and a head-major pool, FP8 and bf16,
    and FP8 the CUDA kernel's and its gather-only build's; the two layouts' outputs must be
    equal bit for bit (the same math on the same rows)."""

    q, k8, v8, indptr, idx, ks, vs = make_case(b, mean, group)
    dev, kvh, d = q.device, k8.shape[1], k8.shape[2]
    scale = d ** -0.5
    max_len = int((indptr[1:] - indptr[:-1]).max())
    row: dict = {"batch": b, "mean_ctx": mean, "group": group}
    for name, k, v in (("fp8", k8, v8), ("bf16", (k8.float() * 0.01).to(torch.bfloat16),
                                          (v8.float() * 0.01).to(torch.bfloat16))):
        cfg = decode_config(q.dtype, d, group, dev, kv_dtype=k.dtype)
        hb = math.ceil(group / cfg.block_m)
        plan = plan_decode(b, kvh, hb, max_len, sms)
        ws = decode_workspace(b, q.shape[1], d, plan, dev) if plan.num_splits > 1 else None
        order = decode_order(indptr) if orders_decode(b, kvh, hb, sms) else None
        scales = (ks, vs) if name == "fp8" else (None, None)
        outs, us = [], []
        for kk, vv in ((k, v), (head_major(k), head_major(v))):
            out = torch.empty(b, q.shape[1] * d, device=dev, dtype=q.dtype)
            f = functools.partial(decode_attention, q, kk, vv, indptr, idx, scale, plan,
                                  out=out, workspace=ws, config=cfg, k_scale=scales[0],
                                  v_scale=scales[1], order=order)
            outs.append(f().clone())
            us.append(_us(f, 100))
            if name == "fp8":  # the CUDA kernel and its gather-only build, same plan
                args = (q, kk, vv, indptr, idx, ks, vs, scale, out, order, plan, ws)
                outs.append(cuda(*args).clone())
                us += [_us(functools.partial(cuda, *args), 100),
                       _us(functools.partial(gather, *args), 100)]
        nbytes = int(indptr[-1]) * kvh * d * 2 * k.element_size()
        n = len(us) // 2
        row[name] = {"splits": plan.num_splits, "token_major_us": us[0],
                     "head_major_us": us[n], "token_major_tbs": nbytes / us[0] / 1e6,
                     "head_major_tbs": nbytes / us[n] / 1e6,
                     "equal": all(torch.equal(outs[i], outs[i + len(outs) // 2])
                                  for i in range(len(outs) // 2))}
        if n > 1:
            row[name].update(cuda_us=(us[1], us[n + 1]), gather_only_us=(us[2], us[n + 2]))
    return row


# `--stage-sweep`: the CUDA kernel's build options on the unsplit cases, (tiles a warp
# stages, CTAs an SM the registers must allow); (4, 1) is the shipped build: 64 KB of shared
# memory and ~126-130 registers, three CTAs an SM
STAGE_BUILDS = ((4, 1), (3, 1), (3, 4), (2, 4), (2, 5), (6, 1))


def stage_sweep(dev: torch.device) -> list[dict]:
    """µs, TB/s and error of each build (and its gather-only build) on `CASES`."""
    builds = {sb: (CudaFp8Decode(dev, stages=sb[0], min_blocks=sb[1]),
                   CudaFp8Decode(dev, ("-DGATHER_ONLY",), stages=sb[0], min_blocks=sb[1]))
              for sb in STAGE_BUILDS}
    for (st, mb), (k, _) in builds.items():
        print(f"build stages {st} min blocks {mb}: {k.registers} registers, "
              f"{k.shared // 1024} KB shared", flush=True)
    rows = []
    for b, mean, group in CASES:
        q, k, v, indptr, idx, ks, vs = make_case(b, mean, group)
        scale = q.shape[2] ** -0.5
        ref = reference(q, k, v, indptr, idx, ks, vs, scale)
        order = decode_order(indptr) if orders_decode(b, k.shape[1], 1, num_sms(dev)) else None
        out = torch.empty(b, q.shape[1] * q.shape[2], device=dev, dtype=q.dtype)
        args = (q, k, v, indptr, idx, ks, vs, scale, out, order)
        nbytes = int(indptr[-1]) * k.shape[1] * k.shape[2] * 2
        row = {"batch": b, "mean_ctx": mean, "group": group, "builds": {}}
        for (st, mb), (kern, gat) in builds.items():
            err = rel(kern(*args).view_as(q), ref)
            us, g_us = _us(functools.partial(kern, *args), 200), _us(
                functools.partial(gat, *args), 200)
            row["builds"][f"{st}x{mb}"] = {"us": us, "tbs": nbytes / us / 1e6,
                                           "gather_only_us": g_us, "err": err,
                                           "registers": kern.registers}
        rows.append(row)
        print(f"B={b:5d} ctx~{mean:5d} g={group}: " + "  ".join(
            f"{n} {r['us']:.1f} ({r['tbs']:.2f} TB/s, gather {r['gather_only_us']:.1f})"
            for n, r in row["builds"].items()), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--split-only", action="store_true", help="only the split cases")
    ap.add_argument("--tail-sweep", action="store_true",
                    help="the decode tail's shapes at every Triton shape and split count")
    ap.add_argument("--layout-sweep", action="store_true",
                    help="Triton on token-major against head-major pools, FP8 and bf16")
    ap.add_argument("--stage-sweep", action="store_true",
                    help="the CUDA kernel's stage and CTAs-an-SM build options, unsplit cases")
    args = ap.parse_args()
    dev = torch.device("cuda")
    if args.stage_sweep:
        write_json(args.out, {"benchmark": "fp8_decode_probe_stages", "cases": stage_sweep(dev)})
        return
    if args.layout_sweep:
        cuda = CudaFp8Decode(dev)
        gather = CudaFp8Decode(dev, options=("-DGATHER_ONLY",))
        rows = []
        for b, mean, group in LAYOUT_CASES:
            r = layout_sweep(b, mean, group, num_sms(dev), cuda, gather)
            rows.append(r)
            print(f"B={r['batch']:5d} ctx~{r['mean_ctx']:5d} " + "  ".join(
                f"{n}: {r[n]['token_major_us']:.1f} -> {r[n]['head_major_us']:.1f} µs "
                f"({r[n]['token_major_tbs']:.2f} -> {r[n]['head_major_tbs']:.2f} TB/s, "
                f"splits {r[n]['splits']}, equal {r[n]['equal']})" for n in ("fp8", "bf16"))
                + "  CUDA {:.1f} -> {:.1f}, gather-only {:.1f} -> {:.1f}".format(
                    *r["fp8"]["cuda_us"], *r["fp8"]["gather_only_us"]), flush=True)
        write_json(args.out, {"benchmark": "fp8_decode_probe_layout", "cases": rows})
        return
    cuda = CudaFp8Decode(dev)
    gather = CudaFp8Decode(dev, options=("-DGATHER_ONLY",))
    if args.tail_sweep:
        rows = []
        for b, mean, group in TAIL_CASES:
            r = tail_sweep(b, mean, group, cuda, gather, num_sms(dev))
            rows.append(r)
            print(f"B={b:3d} ctx~{mean:5d} ({r['pool_mb']:.0f} MB): shipped "
                  f"{r['shipped_us']:.1f} µs (splits {r['planned_splits']}, "
                  f"{r['shipped_tbs']:.2f} TB/s); best Triton {r['best_triton_us']:.1f} "
                  f"({r['best_triton']}); best CUDA {r['best_cuda_us']:.1f} (splits "
                  f"{r['best_cuda_splits']}); gather-only {r['best_gather_us']:.1f}; "
                  f"max rel err {r['max_rel_err']:.1e}", flush=True)
        write_json(args.out, {"benchmark": "fp8_decode_probe_tail", "cases": rows})
        return
    cases = [] if args.split_only else [(*c, False) for c in CASES]
    rows = []
    for b, mean, group, split in cases + [(*c, True) for c in SPLIT_CASES]:
        r = probe_case(b, mean, group, split, cuda, gather, num_sms(dev))
        rows.append(r)
        print(f"B={b:5d} ctx~{mean:5d} g={group} splits {r['splits']:2d}: triton "
              f"{r['triton_us']:7.1f} µs ({r['triton_tbs']:.2f} TB/s, err "
              f"{r['err_triton']:.1e})  cuda {r['cuda_us']:7.1f} µs ({r['cuda_tbs']:.2f} TB/s, "
              f"err {r['err_cuda']:.1e})  gather-only {r['gather_only_us']:7.1f} µs "
              f"({r['gather_only_tbs']:.2f} TB/s)  cuda in row order "
              f"{r['cuda_in_row_order_us']:7.1f} µs", flush=True)
        if r["us_by_splits"]:
            print("  (Triton, CUDA) µs by splits:", r["us_by_splits"], flush=True)
    write_json(args.out, {"benchmark": "fp8_decode_probe", "cases": rows})


if __name__ == "__main__":
    main()
