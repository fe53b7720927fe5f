"""HiCache page transfer throughput against the pinned host<->device copy ceiling.

Times, per page of a real model shape (default Llama-3.1-8B: 32 layers, 8 KV heads, head dim
128, bf16, 64 tokens = 8 MiB per page): the device-side gather, the device->host copy into a
pinned frame (with and without the page codec's CRCs), host->device plus scatter on load, and
a raw pinned copy of the same bytes as the ceiling. Prints a table, writes JSON.

    python -m benchmarks.bench_hicache --out hicache.json
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import write_json
from phaseflip.cache.hicache import (
    PageGeometry,
    decode_page,
    encode_page_into,
    gather_page,
    scatter_page,
)


def timed(fn, repeat: int, sync) -> float:
    """Median seconds of `fn` over `repeat` runs after one warm-up."""
    fn()
    sync()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-tokens", type=int, default=64)
    ap.add_argument("--pool-tokens", type=int, default=16384)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    shape = (args.pool_tokens, args.kv_heads, args.head_dim)
    k_layers = [torch.randn(shape, device=dev).to(dtype) for _ in range(args.layers)]
    v_layers = [torch.randn(shape, device=dev).to(dtype) for _ in range(args.layers)]
    slots = torch.randperm(args.pool_tokens, device=dev)[: args.page_tokens]
    geo = PageGeometry(dtype, args.page_tokens, args.layers, args.kv_heads, args.head_dim)
    fp = b"\x00" * 16
    frame = torch.empty(geo.total_size, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    payload = geo.payload_len
    k, v = gather_page(k_layers, v_layers, slots)
    host = torch.empty((2, *k.shape), dtype=dtype, pin_memory=dev.type == "cuda")
    dev_buf = torch.empty((2, *k.shape), dtype=dtype, device=dev)

    def gather():
        gather_page(k_layers, v_layers, slots)

    def store_raw():  # gather + one device->host copy into pinned memory, no codec
        kk, vv = gather_page(k_layers, v_layers, slots)
        host[0].copy_(kk, non_blocking=True)
        host[1].copy_(vv, non_blocking=True)

    def store_encoded():  # what HiCache.store does: gather, copy, CRCs, header
        kk, vv = gather_page(k_layers, v_layers, slots)
        encode_page_into(kk, vv, fp, frame)

    encode_page_into(k, v, fp, frame)
    page = bytes(frame.numpy())

    def load_decoded():  # what HiCache.load_prefix does: decode, host->device, scatter
        kk, vv = decode_page(page, fp)
        scatter_page(kk.to(dev), vv.to(dev), k_layers, v_layers, slots)

    def ceiling():  # the same bytes, pinned host -> device, one copy
        dev_buf.copy_(host, non_blocking=True)

    rows = {name: timed(fn, args.repeat, sync) for name, fn in (
        ("device gather", gather), ("store: gather + D2H (raw)", store_raw),
        ("store: gather + D2H + encode", store_encoded),
        ("load: decode + H2D + scatter", load_decoded), ("pinned H2D copy (ceiling)", ceiling))}
    print(f"HiCache page transfer, {dev} {args.dtype}, page {payload / 2**20:.1f} MiB "
          f"({args.layers} layers x {args.kv_heads} KV heads x {args.page_tokens} tokens)")
    print("| step | ms per page | GB/s |")
    print("|---|---|---|")
    result = {}
    for name, s in rows.items():
        gbs = payload / s / 1e9
        result[name] = {"ms": s * 1e3, "GB/s": gbs}
        print(f"| {name} | {s * 1e3:.3f} | {gbs:.1f} |")
    if args.out:
        write_json(args.out, {"bench": "hicache", "args": vars(args), "device": str(dev),
                              "results": result})


if __name__ == "__main__":
    main()
