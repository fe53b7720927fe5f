"""Decode attention for a few sequences by split count, as a decode CUDA graph runs it.

At batch 1 the planner cuts an 8B layer's 1 024-key context into 4 chunks of 256 keys (8 KV
heads x 4 = 32 programs on 132 SMs): launch- and latency-bound. This captures `--layers`
launches over distinct pools (more K/V bytes than L2 keeps, as between a step's GEMMs) in one
CUDA graph per (case, splits, min_chunk) and prints µs per launch, medians of `--reps`
replays, with the planner's own choice marked.

    python -m benchmarks.decode_split_probe --cases 1x1024 2x1024 1x4096 --out split.json
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.attention_kernels import HEAD_DIM, KV_DTYPES, KV_HEADS, make_case
from benchmarks.common import graph_replay_us
from phaseflip.kernels import attention as kernels
from phaseflip.kernels.attention_plan import DecodePlan, decode_config, num_sms, plan_decode


def probe(bs: int, ctx: int, kv: str, args, gen: torch.Generator) -> dict:
    device = torch.device("cuda")
    cases = [make_case([(ctx - 1, 1)] * bs, KV_DTYPES[kv], args.page_size, device, gen)
             for _ in range(args.layers)]
    q = cases[0][2]
    cfg = decode_config(q.dtype, HEAD_DIM, q.shape[1] // KV_HEADS, device,
                        kv_dtype=cases[0][1].layer(0)[0].dtype)
    chosen = plan_decode(bs, KV_HEADS, 1, ctx, num_sms(device))
    row = {"batch": bs, "ctx": ctx, "kv": kv, "planner_splits": chosen.num_splits, "us": {}}
    out = torch.empty(bs, q.shape[1] * HEAD_DIM, device=device, dtype=q.dtype)
    for splits in args.splits:
        for min_chunk in args.min_chunk:
            plan = DecodePlan(num_splits=splits, min_chunk=min_chunk)
            ws = kernels.decode_workspace(bs, q.shape[1], HEAD_DIM, plan, device)

            def run(plan: DecodePlan = plan, ws: tuple = ws) -> None:
                for batch, pool, qq, _, _ in cases:
                    k_cache, v_cache = pool.layer(0)
                    k_scale, v_scale = pool.scales(0) or (None, None)
                    kernels.decode_attention(qq, k_cache, v_cache, batch.kv_indptr,
                                             batch.kv_indices, HEAD_DIM**-0.5, plan, out=out,
                                             workspace=ws, config=cfg, k_scale=k_scale,
                                             v_scale=v_scale)

            run()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
            us = graph_replay_us(graph, args.reps, len(cases))
            row["us"][f"s{splits}_c{min_chunk}"] = round(us, 2)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", default=["1x1024", "2x1024", "1x4096"])
    ap.add_argument("--kv-dtype", default="fp8_e4m3", choices=sorted(KV_DTYPES))
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--min-chunk", type=int, nargs="+", default=[256, 128])
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for spec in args.cases:
        bs, ctx = (int(v) for v in spec.lower().split("x"))
        rows.append(probe(bs, ctx, args.kv_dtype, args, gen))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
