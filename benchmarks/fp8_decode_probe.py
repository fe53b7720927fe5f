"""Probe: the CUDA FP8 decode attention kernel (`fp8_decode_cuda.cu`, NVRTC) against the
shipped Triton kernel and a float32 reference, on random paged FP8 pools.

    python -m benchmarks.fp8_decode_probe --out probe.json [--cubin F]

Each case: B sequences with random context lengths around a mean, 8 KV heads × head_dim 128,
pages of 16 slots shuffled, per-KV-head scales. Prints each kernel's µs, the pool bytes read
per µs (TB/s against 4.2) and the relative error of both against the reference.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import math

import torch

from benchmarks.common import write_json
from benchmarks.cuda_rtc import CudaKernel, compile_cubin, source
from phaseflip.kernels.attention import (
    decode_attention,
    decode_config,
    decode_order,
    decode_workspace,
    num_sms,
    orders_decode,
    plan_decode,
)

ASYNC_SHARED = 4 * 4 * 4096  # warps × stages × tile bytes
ROWS_SHARED = 3 * 2 * 16 * 8 * 128  # stages × (K, V) × keys × heads × head_dim
CASES = [(1000, 454, 4), (300, 423, 4), (128, 1024, 4), (64, 2048, 4), (256, 512, 8),
         (32, 1024, 4), (4, 4096, 4)]


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


def run_cuda(kern, q, k, v, indptr, idx, ks, vs, scale, splits, shared=0, order=None,
             rows=False):
    b, hq, d = q.shape
    kvh = k.shape[1]
    group = hq // kvh
    out = torch.empty_like(q)
    mid_o = torch.empty(b * hq * splits * d, device=q.device, dtype=torch.float32)
    mid_ml = torch.empty(b * hq * splits * 2, device=q.device, dtype=torch.float32)
    args = [q, k, v, indptr, idx, ks, vs, out, mid_o, mid_ml,
            ctypes.c_float(scale * 1.4426950408889634), ctypes.c_int(group),
            ctypes.c_int(splits), ctypes.c_longlong(q.stride(0)),
            ctypes.c_longlong(k.stride(0)), ctypes.c_longlong(v.stride(0)),
            ctypes.c_longlong(out.stride(0))]
    if shared:  # the cp.async kernel takes the launch order (a null pointer: none)
        args.append(order if order is not None else ctypes.c_void_p(0))

    def kernel_only():
        if rows:  # a CTA per (split, sequence), a warp per KV head
            kern((splits, b, 1), (32 * kvh, 1, 1), args, shared=shared)
        else:
            kern((kvh, b, splits), (128, 1, 1), args, shared=shared)

    def launch():
        kernel_only()
        if splits == 1:
            return out
        m = mid_ml.view(b, hq, splits, 2)
        o = mid_o.view(b, hq, splits, d)
        mt = m[..., 0].amax(-1, keepdim=True)
        f = torch.exp2(m[..., 0] - mt).nan_to_num(0.0)
        return ((f[..., None] * o).sum(2) / (f * m[..., 1]).sum(-1)[..., None]).to(q.dtype)

    launch.launch_only = kernel_only  # the kernel alone: a split's merge is torch here
    return launch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cubin", default=None, help="a prebuilt cubin (else NVRTC)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from triton.testing import do_bench

    if args.cubin:
        cubin = open(args.cubin, "rb").read()
    else:
        cubin = compile_cubin(source("fp8_decode_cuda.cu"), "fp8_decode",
                              options=("--use_fast_math",))
    kern = CudaKernel(cubin, "fp8_decode_kernel")
    kern_async = CudaKernel(cubin, "fp8_decode_async_kernel")
    kern_async.allow_shared(ASYNC_SHARED)
    gather = CudaKernel(compile_cubin(source("fp8_decode_cuda.cu"), "fp8_gather",
                                      options=("--use_fast_math", "-DGATHER_ONLY")),
                        "fp8_decode_async_kernel")
    gather.allow_shared(ASYNC_SHARED)
    kern_rows = CudaKernel(cubin, "fp8_decode_rows_kernel")
    kern_rows.allow_shared(ROWS_SHARED)
    dev = torch.device("cuda")
    sms = num_sms(dev)
    rows = []
    for b, mean, group in CASES:
        q, k, v, indptr, idx, ks, vs = make_case(b, mean, group)
        kvh, d = k.shape[1], k.shape[2]
        scale = d ** -0.5
        ref = reference(q, k, v, indptr, idx, ks, vs, scale)
        max_len = int((indptr[1:] - indptr[:-1]).max())
        cfg = decode_config(q.dtype, d, group, dev, kv_dtype=k.dtype)
        heads_blocks = math.ceil(group / cfg.block_m)
        plan = plan_decode(b, kvh, heads_blocks, max_len, sms)
        ws = decode_workspace(b, q.shape[1], d, plan, dev) if plan.num_splits > 1 else None
        order = decode_order(indptr) if orders_decode(b, kvh, heads_blocks, sms) else None
        tri_out = torch.empty(b, q.shape[1] * d, device=dev, dtype=q.dtype)

        tri = functools.partial(decode_attention, q, k, v, indptr, idx, scale, plan,
                                out=tri_out, workspace=ws, config=cfg, k_scale=ks,
                                v_scale=vs, order=order)

        splits = max(1, min(math.ceil(4 * sms / (b * kvh)), math.ceil(max_len / 128), 16))
        cu = run_cuda(kern, q, k, v, indptr, idx, ks, vs, scale, splits)
        e_tri = rel(tri().view_as(q), ref)
        cs = run_cuda(kern_async, q, k, v, indptr, idx, ks, vs, scale, splits,
                      shared=ASYNC_SHARED)
        csort = run_cuda(kern_async, q, k, v, indptr, idx, ks, vs, scale, splits,
                         shared=ASYNC_SHARED, order=decode_order(indptr))
        cg = run_cuda(gather, q, k, v, indptr, idx, ks, vs, scale, splits,
                      shared=ASYNC_SHARED, order=decode_order(indptr))
        e_sort = rel(csort(), ref)
        t_sort = do_bench(csort, warmup=20, rep=200) * 1e3
        t_gather = do_bench(cg, warmup=20, rep=200) * 1e3
        rsplits = max(1, min(math.ceil(2 * 2 * sms / b), math.ceil(max_len / 128), 16))
        crows = run_cuda(kern_rows, q, k, v, indptr, idx, ks, vs, scale, rsplits,
                         shared=ROWS_SHARED, order=decode_order(indptr), rows=True)
        e_rows = rel(crows(), ref)
        t_rows = do_bench(crows.launch_only, warmup=20, rep=200) * 1e3
        e_cu = rel(cu(), ref)
        e_cs = rel(cs(), ref)
        t_tri = do_bench(tri, warmup=20, rep=200) * 1e3
        t_cu = do_bench(cu, warmup=20, rep=200) * 1e3
        t_cs = do_bench(cs, warmup=20, rep=200) * 1e3
        nbytes = int(indptr[-1]) * kvh * d * 2
        row = {"batch": b, "mean_ctx": mean, "group": group, "splits_cuda": splits,
               "splits_triton": plan.num_splits, "pool_mb": nbytes / 1e6,
               "triton_us": t_tri, "cuda_us": t_cu, "triton_tbs": nbytes / t_tri / 1e6,
               "cuda_tbs": nbytes / t_cu / 1e6, "err_triton": e_tri, "err_cuda": e_cu,
               "cuda_async_us": t_cs, "cuda_async_tbs": nbytes / t_cs / 1e6,
               "err_cuda_async": e_cs, "cuda_async_sorted_us": t_sort,
               "err_cuda_async_sorted": e_sort, "gather_only_us": t_gather,
               "gather_only_tbs": nbytes / t_gather / 1e6, "rows_splits": rsplits,
               "rows_kernel_us": t_rows, "rows_tbs": nbytes / t_rows / 1e6,
               "err_rows": e_rows}
        rows.append(row)
        print(f"B={b:5d} ctx~{mean:5d} g={group} splits {splits}/{plan.num_splits}: "
              f"triton {t_tri:8.1f} µs ({row['triton_tbs']:.2f} TB/s, err {e_tri:.1e})  "
              f"cuda {t_cu:8.1f} µs ({row['cuda_tbs']:.2f} TB/s, err {e_cu:.1e})  "
              f"async {t_cs:8.1f} µs ({row['cuda_async_tbs']:.2f} TB/s, err {e_cs:.1e})  "
              f"sorted {t_sort:8.1f} µs (err {e_sort:.1e})  gather-only {t_gather:8.1f} µs "
              f"({row['gather_only_tbs']:.2f} TB/s)  rows[{rsplits}] kernel {t_rows:8.1f} µs "
              f"({row['rows_tbs']:.2f} TB/s, err {e_rows:.1e})",
              flush=True)
    write_json(args.out, {"benchmark": "fp8_decode_probe", "cases": rows})


if __name__ == "__main__":
    main()
