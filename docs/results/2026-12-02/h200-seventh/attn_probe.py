"""Decode attention on variable-length batches: where the bandwidth goes (probe, not shipped)."""
import json, math, os, sys
import numpy as np, torch, triton, triton.language as tl, triton.testing
from phaseflip.kernels import attention as A
from phaseflip.kernels.attention import _split_range, _fp8_query, _fp8_widen

@triton.jit
def _k(Q, K, V, KV_INDPTR, KV_INDICES, OUT, MID_O, MID_M, MID_L, K_SCALE, V_SCALE, ORDER,
       qk_scale, min_chunk, num_splits, stride_qt, stride_qh, stride_kn, stride_kh, stride_ot,
       GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
       DIRECT: tl.constexpr, KV_FP8: tl.constexpr, FP8_DOT: tl.constexpr, HEAD_FAST: tl.constexpr,
       USE_ORDER: tl.constexpr, NKVH: tl.constexpr):
    if HEAD_FAST:
        kvh = tl.program_id(0); b = tl.program_id(1)
    else:
        b = tl.program_id(0); kvh = tl.program_id(1)
    split = tl.program_id(2)
    if USE_ORDER:
        b = tl.load(ORDER + b)
    num_heads = NKVH * GROUP
    offs_g = tl.arange(0, BLOCK_H); mask_h = offs_g < GROUP; heads = kvh * GROUP + offs_g
    offs_d = tl.arange(0, HEAD_DIM); offs_n = tl.arange(0, BLOCK_N)
    kv_beg = tl.load(KV_INDPTR + b); seq_len = tl.load(KV_INDPTR + b + 1) - kv_beg
    lo, hi = _split_range(seq_len, 0, min_chunk, num_splits, split, False, BLOCK_N)
    q = tl.load(Q + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_h[:, None], other=0.0)
    if KV_FP8:
        q, qk_scale = _fp8_query(q, qk_scale * tl.load(K_SCALE + kvh), FP8_DOT)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32); l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        idx = n0 + offs_n; mask_n = idx < hi
        slots = tl.load(KV_INDICES + kv_beg + idx, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(K + slots[:, None] * stride_kn + kvh * stride_kh + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        v = tl.load(V + slots[:, None] * stride_kn + kvh * stride_kh + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        if KV_FP8:
            k, v = _fp8_widen(k, v, q, FP8_DOT)
        qk = tl.dot(q, tl.trans(k)) * qk_scale
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1)); p = tl.exp2(qk - m_new[:, None]); alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if KV_FP8:
        acc = acc * tl.load(V_SCALE + kvh)
    if DIRECT:
        tl.store(OUT + b * stride_ot + heads[:, None] * HEAD_DIM + offs_d[None, :], (acc / l_i[:, None]).to(OUT.dtype.element_ty), mask=mask_h[:, None])
    else:
        row = (b * num_heads + heads) * num_splits + split
        tl.store(MID_M + row, m_i, mask=mask_h); tl.store(MID_L + row, l_i, mask=mask_h)
        tl.store(MID_O + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=mask_h[:, None])

def lengths(n, seed):
    rng = np.random.default_rng(seed)
    ins = np.clip(np.rint(rng.lognormal(math.log(220), 0.9, n)), 4, 2048)
    outs = np.clip(np.rint(rng.lognormal(math.log(190), 0.8, n)), 4, 1024)
    return [int(i + rng.uniform() * o) + 1 for i, o in zip(ins, outs)]

def main():
    dev = torch.device("cuda"); torch.manual_seed(0)
    H, KVH, D, PAGE = 32, 8, 128, 16
    slots_total = 1_000_000
    out = {}
    base = torch.randn(slots_total, KVH, D, device=dev) * 0.5
    caches = {"fp8": (base.to(torch.float8_e4m3fn), base.flip(0).to(torch.float8_e4m3fn)),
              "bf16": (base.to(torch.bfloat16), base.flip(0).to(torch.bfloat16))}
    del base
    ones = torch.ones(KVH, device=dev)
    for bs, seed in [(1000, 4), (300, 1), (32, 3)]:
        lens = lengths(bs, seed)
        pages_needed = [math.ceil(x / PAGE) for x in lens]
        perm = torch.randperm(slots_total // PAGE, device=dev)[: sum(pages_needed)]
        idx, p0 = [], 0
        pages_cpu = perm.cpu()
        for L, np_ in zip(lens, pages_needed):
            pg = pages_cpu[p0:p0 + np_]; p0 += np_
            s = (pg[:, None] * PAGE + torch.arange(PAGE)[None, :]).reshape(-1)[:L]
            idx.append(s)
        kv_indices = torch.cat(idx).to(dev, torch.int32)
        kv_indptr = torch.tensor([0] + list(np.cumsum(lens)), device=dev, dtype=torch.int32)
        contig = torch.arange(sum(lens), device=dev, dtype=torch.int32)
        order = torch.argsort(kv_indptr[1:] - kv_indptr[:-1], descending=True).to(torch.int32)
        q = torch.randn(bs, H, D, device=dev, dtype=torch.bfloat16)
        o = torch.empty(bs, H * D, device=dev, dtype=torch.bfloat16)
        tok = sum(lens)
        for kvname, (kc, vc) in caches.items():
            byt = tok * KVH * D * 2 * kc.element_size()
            fp8 = kvname == "fp8"
            def run(bn, w, st, hf, uo, splits, minc, indices=kv_indices):
                mid = A.decode_workspace(bs, H, D, A.DecodePlan(splits, minc), dev) if splits > 1 else (o, o, o)
                grid = (KVH, bs, splits) if hf else (bs, KVH, splits)
                def f():
                    _k[grid](q, kc, vc, kv_indptr, indices, o, mid[0], mid[1], mid[2], ones, ones, order,
                             0.088 * 1.4427, minc, splits, q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), o.stride(0),
                             GROUP=4, BLOCK_H=16, BLOCK_N=bn, HEAD_DIM=D, DIRECT=splits == 1, KV_FP8=fp8,
                             FP8_DOT="fp16", HEAD_FAST=hf, USE_ORDER=uo, NKVH=KVH, num_warps=w, num_stages=st)
                    if splits > 1:
                        A._decode_reduce_kernel[(bs, H)](o, mid[0], mid[1], mid[2], splits, o.stride(0), D,
                                                         HEAD_DIM=D, BLOCK_D=D, BLOCK_S=max(2, triton.next_power_of_2(splits)), num_warps=4)
                return triton.testing.do_bench(f, warmup=10, rep=60) * 1e3
            def ship():
                plan = A.plan_decode(bs, KVH, 1, max(lens), A.num_sms(dev))
                ws = A.decode_workspace(bs, H, D, plan, dev) if plan.num_splits > 1 else None
                f = lambda: A.decode_attention(q, kc, vc, kv_indptr, kv_indices, 0.088, plan, out=o, workspace=ws, k_scale=ones if fp8 else None, v_scale=ones if fp8 else None)
                return triton.testing.do_bench(f, warmup=10, rep=60) * 1e3, plan.num_splits
            res = {}
            t, ns = ship(); res[f"shipped(splits={ns})"] = t
            bn0 = 128 if fp8 else 64
            for name, a in [
                ("base", (bn0, 4, 3, False, False, 1, 256)),
                ("contig_slots", (bn0, 4, 3, False, False, 1, 256)),
                ("head_fast", (bn0, 4, 3, True, False, 1, 256)),
                ("sorted", (bn0, 4, 3, False, True, 1, 256)),
                ("head_fast+sorted", (bn0, 4, 3, True, True, 1, 256)),
                ("hf+sorted split2", (bn0, 4, 3, True, True, 2, 256)),
                ("hf+sorted split4", (bn0, 4, 3, True, True, 4, 256)),
                ("hf+sorted split4 min128", (bn0, 4, 3, True, True, 4, 128)),
                ("hf+sorted split8 min128", (bn0, 4, 3, True, True, 8, 128)),
                ("hf+sorted bn64", (64, 4, 3, True, True, 1, 256)),
                ("hf+sorted bn64 st4", (64, 4, 4, True, True, 1, 256)),
                ("hf+sorted bn128 w8", (128, 8, 3, True, True, 1, 256)),
                ("hf+sorted bn256 w8 st2", (256, 8, 2, True, True, 1, 256)),
                ("hf+sorted bn32 st4", (32, 4, 4, True, True, 1, 256)),
                ("hf+sorted bn64 w2 st4", (64, 2, 4, True, True, 1, 256)),
            ]:
                try:
                    res[name] = run(*a, indices=contig if name == "contig_slots" else kv_indices)
                except Exception as e:  # noqa: BLE001
                    res[name] = f"error {type(e).__name__}: {str(e)[:120]}"
            key = f"bs{bs} {kvname} tok={tok} meanctx={tok/bs:.0f} maxctx={max(lens)} MB={byt/1e6:.0f}"
            out[key] = res
            print("==", key)
            for n, t in res.items():
                if isinstance(t, float):
                    print(f"  {n:28s} {t:8.1f} us  {byt / t / 1e6:6.2f} TB/s")
                else:
                    print(f"  {n:28s} {t}")
    # copy ceiling
    x = torch.empty(1 << 28, device=dev, dtype=torch.uint8); y = torch.empty_like(x)
    t = triton.testing.do_bench(lambda: y.copy_(x), warmup=10, rep=60)
    print(f"copy 256 MiB: {2 * x.numel() / t / 1e9:.2f} TB/s")
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "attn_probe.json"), "w"), indent=1)

main()
