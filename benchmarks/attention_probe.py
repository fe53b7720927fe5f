"""One default decode-attention launch per (KV dtype, case), for a profiler to read.

Nsight Compute times and counts a kernel launch by launch; this runs exactly one
`TritonAttention.forward` per case (Llama-3.1-8B's attention shape, every sequence at the same
context) so `--launch-count` maps one to one onto the cases, in the order printed:

    ncu --clock-control none --kernel-name regex:_decode_split_kernel --launch-count 4 \\
        --set full -o decode python -m benchmarks.attention_probe
    ncu --import decode.ncu-rep --print-details all
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.attention_kernels import HEAD_DIM, KV_DTYPES, make_case
from phaseflip.attention.triton_backend import TritonAttention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-dtype", nargs="+", choices=sorted(KV_DTYPES),
                    default=["fp8_e4m3", "bf16"])
    ap.add_argument("--decode-cases", nargs="+", metavar="BSxCTX",
                    default=["1000x400", "100x1200"])
    ap.add_argument("--page-size", type=int, default=16)
    args = ap.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    for kv in args.kv_dtype:
        for spec in args.decode_cases:
            bs, ctx = (int(v) for v in spec.lower().split("x"))
            batch, pool, q, k, v = make_case([(ctx - 1, 1)] * bs, KV_DTYPES[kv],
                                             args.page_size, device, gen)
            TritonAttention().forward(0, q, k, v, batch, pool, HEAD_DIM**-0.5)
            torch.cuda.synchronize()
            print(f"{kv} decode bs={bs} ctx={ctx}", flush=True)


if __name__ == "__main__":
    main()
