"""HiCache page transfer throughput against the pinned host<->device copy ceiling.

Times, per page of a real model shape (default Llama-3.1-8B: 32 layers, 8 KV heads, head dim
128, bf16, 64 tokens = 8 MiB per page), the engine's own transfer path (`KVTransferEngine`
over a stacked `KVPool`, pinned host frames): the device gather alone, a store (gather + one
device->host copy), a load (one host->device copy + scatter), the same for a batch of pages,
a TP=2 rank's half-head slice, and the disk tier (seal + atomic write, read + verify) on the
disk thread's code path. Raw pinned copies of the same bytes are the ceiling rows.
Prints a table, writes JSON.

    python -m benchmarks.bench_hicache --out hicache.json
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable

import torch

from benchmarks.common import write_json
from phaseflip.cache.hicache import (
    DiskPageStore,
    HostFrames,
    KVTransferEngine,
    RankSlice,
    TransferOrders,
)
from phaseflip.cache.hicache.frames import page_geometry
from phaseflip.cache.hicache.page import PageGeometry
from phaseflip.cache.hicache.transfer import PoolPages
from phaseflip.cache.kv_pool import KVPool


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


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-tokens", type=int, default=64)
    ap.add_argument("--pool-tokens", type=int, default=16384)
    ap.add_argument("--batch-pages", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--disk-dir", default=None, help="disk tier directory (default: a tmpdir)")
    ap.add_argument("--out", default=None)
    return ap.parse_args()


def main() -> None:
    args = _args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    geo = page_geometry(args.layers, args.kv_heads, args.head_dim, dtype, args.page_tokens)
    pool = KVPool(args.pool_tokens, (0, args.layers), args.kv_heads, args.head_dim, dtype, dev)
    for t in pool.k + pool.v:
        t.copy_(torch.randn(t.shape, device=dev))
    nb = args.batch_pages
    frames = HostFrames.private(nb, geo.total_size)
    part = RankSlice(range(args.layers), range(args.kv_heads))
    engine = KVTransferEngine(pool, frames, geo, part, dev)
    perm = torch.randperm(args.pool_tokens - 1)[: nb * args.page_tokens] + 1
    pages = list(perm.view(nb, args.page_tokens))
    many_store = TransferOrders(store_frames=list(range(nb)), store_slots=pages)
    rows = _transfer_rows(args, dev, dtype, geo, pool, frames, engine, pages, many_store)
    results = {name: (n, timed(fn, args.repeat, sync)) for name, n, fn in rows}
    engine.execute(many_store).wait()
    results.update(_disk_rows(args, geo, frames, nb))
    out = _print_results(args, dev, geo.payload_len, results)
    if args.out:
        write_json(args.out, {"bench": "hicache", "args": vars(args), "device": str(dev),
                              "results": out})


def _transfer_rows(args: argparse.Namespace, dev: torch.device, dtype: torch.dtype,
                   geo: PageGeometry, pool: KVPool, frames: HostFrames,
                   engine: KVTransferEngine, pages: list[torch.Tensor], many_store: TransferOrders
                   ) -> list[tuple[str, float, Callable[[], object]]]:
    """(name, pages moved per call, call) for every in-memory transfer row and its ceiling."""
    nb = len(pages)

    def run(orders: TransferOrders) -> Callable[[], object]:
        return lambda: engine.execute(orders).wait()

    one_store = TransferOrders(store_frames=[0], store_slots=pages[:1])
    one_load = TransferOrders(load_frames=[0], load_slots=pages[:1])
    many_load = TransferOrders(load_frames=list(range(nb)), load_slots=pages)
    gather_idx = pages[0].to(dev)
    pool_pages = PoolPages(pool)

    # a TP=2 rank: half the heads of a half-head pool, strided into the canonical frame
    half = KVPool(args.pool_tokens, (0, args.layers), args.kv_heads // 2, args.head_dim, dtype,
                  dev)
    tp_part = RankSlice(range(args.layers), range(args.kv_heads // 2, args.kv_heads))
    tp_engine = KVTransferEngine(half, frames, geo, tp_part, dev)

    host = torch.empty((nb, geo.payload_len), dtype=torch.uint8, pin_memory=dev.type == "cuda")
    dev_buf = torch.empty((nb, geo.payload_len), dtype=torch.uint8, device=dev)
    return [
        ("device gather (one indexed select)", 1, lambda: pool_pages.gather(gather_idx)),
        ("store: gather + D2H", 1, run(one_store)),
        ("load: H2D + scatter", 1, run(one_load)),
        (f"store, {nb} pages per order", nb, run(many_store)),
        (f"load, {nb} pages per order", nb, run(many_load)),
        ("TP=2 rank store (half heads)", 0.5,
         lambda: tp_engine.execute(one_store).wait()),
        ("TP=2 rank load (half heads)", 0.5,
         lambda: tp_engine.execute(one_load).wait()),
        ("pinned D2H copy (ceiling)", 1, lambda: host[0].copy_(dev_buf[0], non_blocking=True)),
        ("pinned H2D copy (ceiling)", 1, lambda: dev_buf[0].copy_(host[0], non_blocking=True)),
    ]


def _print_results(args: argparse.Namespace, dev: torch.device, payload: int,
                   results: dict[str, tuple[float, float]]) -> dict[str, dict[str, float]]:
    """Prints the markdown table; returns its rows for the JSON."""
    print(f"HiCache page transfer, {dev} {args.dtype}, page {payload / 2**20:.1f} MiB "
          f"({args.layers} layers x {args.kv_heads} KV heads x {args.page_tokens} tokens)")
    print("| step | ms per page | GB/s |")
    print("|---|---|---|")
    out = {}
    for name, (n, s) in results.items():
        per_page = s / n if n >= 1 else s
        gbs = payload * n / s / 1e9
        out[name] = {"ms_per_page": per_page * 1e3, "GB/s": gbs}
        print(f"| {name} | {per_page * 1e3:.3f} | {gbs:.1f} |")
    return out


def _disk_rows(args, geo, frames: HostFrames, nb: int) -> dict[str, tuple[int, float]]:
    """Seal + atomic write of host frames, read + verify back (what the disk threads do)."""
    with tempfile.TemporaryDirectory(dir=args.disk_dir) as d:
        store = DiskPageStore(d, b"\x01" * 16, 1 << 40)
        keys = [bytes([i]) * 16 for i in range(nb)]
        views = [memoryview(frames.frame(i, geo.total_size)[geo.payload_offset :].numpy())
                 for i in range(nb)]

        def write() -> None:
            for key in keys:
                store.delete(key)
            for key, view in zip(keys, views):
                store.put_payload(key, geo, view)

        out = memoryview(bytearray(frames.stride))

        def read() -> None:
            for key in keys:
                if store.read_into(key, out) is None:
                    raise RuntimeError("disk page vanished")

        return {"disk write: seal + atomic write": (nb, timed(write, 3, lambda: None)),
                "disk read: read + verify": (nb, timed(read, 3, lambda: None))}


if __name__ == "__main__":
    main()
