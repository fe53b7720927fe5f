"""The shipped decode attention (head-major, longest first) on variable-length batches; split counts."""
import json, math, os
import numpy as np, torch, triton.testing
from phaseflip.kernels import attention as A

def lengths(n, seed):
    rng = np.random.default_rng(seed)
    ins = np.clip(np.rint(rng.lognormal(math.log(220), 0.9, n)), 4, 2048)
    outs = np.clip(np.rint(rng.lognormal(math.log(190), 0.8, n)), 4, 1024)
    return [int(i + rng.uniform() * o) + 1 for i, o in zip(ins, outs)]

dev = torch.device("cuda"); torch.manual_seed(0)
H, KVH, D, PAGE, SLOTS = 32, 8, 128, 16, 1_000_000
base = torch.randn(SLOTS, KVH, D, device=dev) * 0.5
caches = {"fp8": base.to(torch.float8_e4m3fn), "bf16": base.to(torch.bfloat16)}
del base
ones = torch.ones(KVH, device=dev); out = {}
sms = A.num_sms(dev)
for bs, seed in [(1000, 4), (300, 1), (200, 7), (128, 2), (64, 5), (32, 3)]:
    lens = lengths(bs, seed)
    pages = [math.ceil(x / PAGE) for x in lens]
    perm = torch.randperm(SLOTS // PAGE)[: sum(pages)]
    idx, p0 = [], 0
    for L, n in zip(lens, pages):
        pg = perm[p0:p0 + n]; p0 += n
        idx.append((pg[:, None] * PAGE + torch.arange(PAGE)[None, :]).reshape(-1)[:L])
    kv_indices = torch.cat(idx).to(dev)
    kv_indptr = torch.tensor([0] + list(np.cumsum(lens)), device=dev)
    q = torch.randn(bs, H, D, device=dev, dtype=torch.bfloat16)
    o = torch.empty(bs, H * D, device=dev, dtype=torch.bfloat16)
    for name, c in caches.items():
        fp8 = name == "fp8"; sc = ones if fp8 else None
        byt = sum(lens) * KVH * D * 2 * c.element_size()
        res = {}
        cfg = A.decode_config(torch.bfloat16, D, 4, dev, c.dtype)
        auto = A.plan_decode(bs, KVH, 1, 8192, sms)  # a graph plans for the longest context
        order = A.decode_order(kv_indptr)
        for label, splits, use_order in [("no order", auto.num_splits, False), ("order", auto.num_splits, True)] + \
                [(f"order s{s}", s, True) for s in (1, 2, 4) if s != auto.num_splits] + [(f"no order s{s}", s, False) for s in (1, 2, 4) if s != auto.num_splits]:
            plan = A.plan_decode(bs, KVH, 1, 8192, sms, num_splits=splits)
            ws = A.decode_workspace(bs, H, D, plan, dev) if plan.num_splits > 1 else None
            od = order if use_order else None
            f = lambda: A.decode_attention(q, c, c, kv_indptr, kv_indices, 0.088, plan, out=o, workspace=ws, k_scale=sc, v_scale=sc, order=od)
            f()
            t = min(triton.testing.do_bench(f, warmup=10, rep=40) for _ in range(2)) * 1e3
            res[f"{label} (s={plan.num_splits})"] = round(t, 1)
        res["sort"] = round(triton.testing.do_bench(lambda: A.decode_order(kv_indptr), warmup=10, rep=50) * 1e3, 1)
        key = f"bs{bs} {name} meanctx={sum(lens)/bs:.0f} max={max(lens)} MB={byt/1e6:.0f}"
        out[key] = res
        print(key, " ".join(f"{k}:{v}" for k, v in res.items()), flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "attn_probe3.json"), "w"), indent=1)
