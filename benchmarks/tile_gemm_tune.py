"""Tunes the tile GEMM (`kernels/tile_gemm.py`) against cuBLAS, per row bucket and dtype.

For each projection of the model shapes (`--shapes`: Llama-3.1-8B's and Qwen3-8B's qkv, o,
gate_up, down), each `--dtype` (FP8 with row-wise scales against `torch._scaled_mm`, bf16
against `F.linear`) and each row bucket from 48 to 1024 rows (the decode graphs' capture
sizes), times cuBLAS (up to 128 rows also the skinny kernel, where it takes the rows) and
every candidate launch shape (up to 256 rows also split-K ones) as `--copies` calls over
distinct weights in one CUDA graph (so each call reads its weight from HBM, as a decode step
does), checks each candidate against cuBLAS's product, and keeps the fastest where it beats
both by `--margin`. `--table` merges the winners into the shipped table
(`phaseflip/assets/kernel_configs/tile_gemm_<gpu>.json`), the buckets as rows without a
config where the baseline won; `--out` writes every timing.

    python -m benchmarks.tile_gemm_tune --dtype fp8 bf16 --table auto --out tile_gemm_tune.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from benchmarks.common import graph_replay_us, print_table, write_json
from phaseflip.kernels.linear import skinny_linear
from phaseflip.kernels.linear_configs import load_bundled_configs
from phaseflip.kernels.tile_gemm import (
    TileGemmConfig,
    buckets,
    dtype_name,
    table_path,
    tile_gemm,
    to_rows,
)
from phaseflip.model.quant.fp8 import skinny_rows

SHAPES = {
    "llama.qkv": (6144, 4096), "llama.o": (4096, 4096), "llama.gate_up": (28672, 4096),
    "llama.down": (4096, 14336), "qwen3.gate_up": (24576, 4096), "qwen3.down": (4096, 12288),
    "llama.lm_head": (128256, 4096),  # the FP8 LM head (--fp8-lm-head)
}
DTYPES = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}
# (block_m, block_n, num_warps): 64-row tiles waste the least at ragged M, 128 x 256 with 8
# warps feeds the MMA best at large M; each at 3 and 4 stages of 128 bytes of K a row.
_TILES = [(64, 64, 4), (64, 128, 4), (64, 256, 4), (64, 256, 8), (128, 64, 4), (128, 128, 4),
          (128, 128, 8), (128, 256, 8)]


# Up to 256 rows an o/down/qkv shape has too few tiles to fill the GPU (down at 160 rows in
# 64 x 64 tiles: 192 programs, 1.45 waves on 132 SMs, each looping over K = 14 336): these
# also split K in 2 or 4 chunks, summed by each tile's last arrival.
_SPLIT_TILES = [(64, 64, 4), (64, 128, 4), (128, 64, 4)]
SPLIT_MAX_M = 256


def candidates(dtype: torch.dtype, m: int = 0) -> list[TileGemmConfig]:
    block_k = 128 // dtype.itemsize
    out = [TileGemmConfig(bm, bn, block_k, w, st) for (bm, bn, w), st
           in itertools.product(_TILES, (3, 4))]
    if m <= SPLIT_MAX_M:
        out += [TileGemmConfig(bm, bn, block_k, w, 4, split_k=sk) for (bm, bn, w), sk
                in itertools.product(_SPLIT_TILES, (2, 3, 4))]
    return out


def _graph_us(fn, calls: int, reps: int) -> float:
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph_replay_us(graph, reps, calls)


def sweep_shape(n: int, k: int, dtype: torch.dtype, ms: list[int], copies: int, reps: int,
                bar: tqdm) -> dict:
    """{m: {"cublas": us, label: [us, rel_err], ...}} for one weight shape and dtype."""
    dev = torch.device("cuda")
    scaled = dtype.itemsize == 1
    ws = [((torch.randn(n, k, device=dev) * 0.05).to(dtype),
           torch.rand(n, device=dev) * 0.01 + 1e-3 if scaled else None) for _ in range(copies)]
    out = {}
    for m in ms:
        out[m] = _sweep_rows(m, ws, reps)
        bar.update()
    return out


def _cublas(x: torch.Tensor, sx: torch.Tensor | None, w: torch.Tensor,
            sw: torch.Tensor | None) -> torch.Tensor:
    if sx is None:
        return F.linear(x, w)
    return torch._scaled_mm(x, w.t(), scale_a=sx, scale_b=sw.view(1, -1),
                            out_dtype=torch.bfloat16)


def _sweep_rows(m: int, ws: list[tuple[torch.Tensor, torch.Tensor | None]], reps: int) -> dict:
    n, k = ws[0][0].shape
    dev, dtype = ws[0][0].device, ws[0][0].dtype
    scaled = dtype.itemsize == 1
    x = torch.randn(m, k, device=dev).to(dtype)
    sx = torch.rand(m, 1, device=dev) * 0.01 + 1e-3 if scaled else None
    ys = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in ws]

    def cublas() -> None:
        for w, s in ws:
            _cublas(x, sx, w, s)

    row: dict = {"cublas": round(_graph_us(cublas, len(ws), reps), 2)}
    if scaled and skinny_rows(x, ws[0][0]):  # these rows' other contender: the skinny kernel

        def skinny() -> None:
            for w, s in ws:
                skinny_linear(x, w, weight_scale=s, x_scale=sx, out_dtype=torch.bfloat16)

        row["skinny"] = round(_graph_us(skinny, len(ws), reps), 2)
    ref = _cublas(x, sx, *ws[0]).float()
    for cfg in candidates(dtype, m):
        if not cfg.fits(n, k):
            continue

        def triton_gemm(cfg: TileGemmConfig = cfg) -> None:
            for (w, s), y in zip(ws, ys):
                tile_gemm(x, w, cfg, sx, s, out=y)

        try:
            us = _graph_us(triton_gemm, len(ws), reps)
        except Exception as e:  # noqa: BLE001 - a shape the GPU cannot hold is a result
            row[cfg.label()] = f"error {type(e).__name__}: {str(e)[:100]}"
            continue
        err = ((ys[0].float() - ref).norm() / ref.norm()).item()
        row[cfg.label()] = [round(us, 2), round(err, 5)]
    return row


def winners(results: dict, margin: float) -> tuple[dict, dict]:
    """(entries, timings): per (bucket, n, k, dtype) the fastest correct config beating
    cuBLAS and the skinny kernel (where timed) by `margin`, else None; and the times for the
    record."""
    entries, timings = {}, {}
    for (shape, dname), rows in results.items():
        n, k = SHAPES[shape]
        dtype = DTYPES[dname]
        for m, row in rows.items():
            by_label = {c.label(): c for c in candidates(dtype, m)}
            ok = [(v[0], lab) for lab, v in row.items()
                  if isinstance(v, list) and v[1] < 1e-2]
            best = min(ok) if ok else None
            baseline = min(row["cublas"], row.get("skinny", row["cublas"]))
            win = best is not None and best[0] < baseline * (1 - margin)
            key = (m, n, k, dtype_name(dtype))
            entries[key] = by_label[best[1]] if win else None
            timings[key] = {"us": best[0] if best else None, "cublas_us": row["cublas"]}
            if "skinny" in row:
                timings[key]["skinny_us"] = row["skinny"]
    return entries, timings


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--dtype", nargs="+", default=["fp8"], choices=list(DTYPES))
    ap.add_argument("--m", default=None, help="comma-separated row counts (default: buckets)")
    ap.add_argument("--copies", type=int, default=8, help="weight copies a graph cycles through")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--margin", type=float, default=0.02,
                    help="how much faster than cuBLAS a config must be to ship")
    ap.add_argument("--table", default=None,
                    help="write the winners here ('auto': the shipped table for this GPU)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    ms = [int(m) for m in args.m.split(",")] if args.m else buckets()
    if not set(ms) <= set(buckets()):  # a row never looked up by `pick` would ship
        ap.error(f"--m takes row buckets only: {sorted(set(ms) - set(buckets()))} are not "
                 f"among {buckets()}")
    torch.manual_seed(0)
    load_bundled_configs(torch.device("cuda"))  # the skinny kernel's tuned W8A8 entries
    results = {}
    cases = len(ms) * len(args.shapes) * len(args.dtype)
    with tqdm(total=cases, desc="tile gemm tune", unit="case") as bar:
        for dname in args.dtype:
            for name in args.shapes:
                results[(name, dname)] = sweep_shape(*SHAPES[name], DTYPES[dname], ms,
                                                     args.copies, args.reps, bar)
    entries, timings = winners(results, args.margin)
    rows = []
    for (m, n, k, d), cfg in sorted(entries.items()):
        t = timings[(m, n, k, d)]
        base = min(t["cublas_us"], t.get("skinny_us", t["cublas_us"]))
        rows.append([d, n, k, m, t["cublas_us"], t.get("skinny_us", "-"), t["us"],
                     cfg.label() if cfg else "baseline", base / min(t["us"] or base, base)])
    print_table(["dtype", "N", "K", "M", "cuBLAS us", "skinny us", "best tile us", "ships",
                 "speed-up"],
                rows, title="tile GEMM per row bucket (weights cold)")
    if args.table:
        path = table_path(torch.cuda.get_device_name()) if args.table == "auto" else Path(
            args.table)
        key = ("m_bucket", "n", "k", "dtype")
        merged = {tuple(r[f] for f in key): r for r in
                  (json.loads(path.read_text()) if path.exists() else [])}
        merged.update({tuple(r[f] for f in key): r for r in to_rows(entries, timings)})
        path.write_text(json.dumps([merged[k] for k in sorted(merged)], indent=1) + "\n")
        print(f"wrote {path}")
    return write_json(args.out, {"benchmark": "tile_gemm_tune", "margin": args.margin,
                                 "results": {f"{s} {d}": r for (s, d), r in results.items()}})

if __name__ == "__main__":
    main()
