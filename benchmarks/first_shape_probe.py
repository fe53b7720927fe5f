"""Host time of a GEMM's first call at a new row count, with the GPU idle and busy.

Why: in FP8 offline runs a mixed step's `forward` returns only after 81–126 ms of host time,
most of it inside the LM head's `aten::mm`, whose row count (the rows that sample) is new at
almost every mixed step. If cuBLAS pays a per-shape cost on the host (heuristics, a kernel
module loaded lazily) — and worse, one that waits for the GPU to drain — every mixed step
pays it and the GPU then idles while the host catches up. This probe times, for a list of new
row counts: the call's host time on an idle GPU, the same on a GPU with ~`--busy-ms` of work
queued ahead (a drain shows as host time ≈ that work), and a repeat of a seen shape.

    python -m benchmarks.first_shape_probe --out probe.json

It also times `ParallelLMHead.warm` and checks that the bucketed LM head never drains, and
probes the 8B layer's projections (bf16 and FP8) at new row counts above 1 024.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def _busy(a: torch.Tensor, ms: float, per_ms: float) -> None:
    """Queues about `ms` of GPU work (square bf16 matmuls) without waiting."""
    for _ in range(max(1, int(ms * per_ms))):
        torch.mm(a, a)


def _calibrate(a: torch.Tensor) -> float:
    torch.mm(a, a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        torch.mm(a, a)
    torch.cuda.synchronize()
    return 20 / ((time.perf_counter() - t) * 1e3)  # matmuls per ms


def _case(name: str, call, rows: list[int], a: torch.Tensor, per_ms: float, busy_ms: float
          ) -> list[dict]:
    out = []
    for m in rows:
        rec = {"case": name, "rows": m}
        torch.cuda.synchronize()
        t = time.perf_counter()
        call(m)
        rec["first_idle_ms"] = (time.perf_counter() - t) * 1e3
        torch.cuda.synchronize()
        _busy(a, busy_ms, per_ms)
        t = time.perf_counter()
        call(m)
        rec["seen_busy_ms"] = (time.perf_counter() - t) * 1e3
        torch.cuda.synchronize()
        m2 = m + 1  # a shape never called
        _busy(a, busy_ms, per_ms)
        t = time.perf_counter()
        call(m2)
        rec["first_busy_ms"] = (time.perf_counter() - t) * 1e3
        torch.cuda.synchronize()
        out.append(rec)
        print(json.dumps(rec), flush=True)
    return out


LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
            "down": (4096, 14336)}


def _gemms(dev: torch.device, rows: list[int]) -> dict:
    """The 8B layer's four projections at `rows` (bf16 and FP8 row-wise), one call each."""
    big = max(rows) + 2
    cases = {}
    for name, (n, k) in LLAMA_8B.items():
        x = torch.randn(big, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        cases[f"{name} bf16"] = (lambda m, x=x, w=w: torch.nn.functional.linear(x[:m], w))
        xq, wq = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
        sx, sw = torch.rand(big, 1, device=dev), torch.rand(1, n, device=dev)
        cases[f"{name} fp8"] = (lambda m, xq=xq, wq=wq, sx=sx, sw=sw: torch._scaled_mm(
            xq[:m], wq.t(), scale_a=sx[:m], scale_b=sw, out_dtype=torch.bfloat16))
    return cases


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--busy-ms", type=float, default=100.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    per_ms = _calibrate(a)
    gen = torch.Generator().manual_seed(args.seed)
    head_rows = sorted(torch.randint(2, 1024, (16,), generator=gen).tolist())
    w_head = torch.randn(128256, 4096, device=dev, dtype=torch.bfloat16)
    x = torch.randn(1100, 4096, device=dev, dtype=torch.bfloat16)
    results = _case("lm_head bf16", lambda m: torch.nn.functional.linear(x[:m], w_head),
                    head_rows, a, per_ms, args.busy_ms)
    from phaseflip.layout import Layout
    from phaseflip.model.lm_head import ParallelLMHead

    head = ParallelLMHead(128256, 4096, Layout(), torch.bfloat16).to(dev)
    head.weight.data.normal_()
    t = time.perf_counter()
    warmed = head.warm(1024)
    warm_s = time.perf_counter() - t
    t = time.perf_counter()
    head.warm(1024)
    rewarm_s = time.perf_counter() - t
    results += _case("lm_head bucketed (phaseflip)", lambda m: head.logits(x[:m]),
                     sorted(torch.randint(2, 1024, (16,), generator=gen).tolist()), a,
                     per_ms, args.busy_ms)
    big_rows = sorted(torch.randint(1025, 16384 + 1024, (10,), generator=gen).tolist())
    for name, call in _gemms(dev, big_rows).items():
        results += _case(name, call, big_rows, a, per_ms, args.busy_ms)
    drains = {}
    for r in results:
        d = drains.setdefault(r["case"], [0, 0])
        d[0] += r["first_busy_ms"] > args.busy_ms / 2
        d[1] += 1
    print("drains (first call of a new row count waited for the queue):", drains)
    env = {k: os.environ.get(k) for k in ("CUDA_MODULE_LOADING",)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"busy_ms": args.busy_ms, "matmuls_per_ms": per_ms, "env": env,
                       "torch": torch.__version__, "warm_buckets": warmed, "warm_s": warm_s,
                       "rewarm_s": rewarm_s, "drains": drains, "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
