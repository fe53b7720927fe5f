"""Launch shapes for the folded batch-1 projections (`kernels/linear_fold.py`), measured.

A folded launch runs a different loop body than the plain GEMM the tuned table was measured
for (the norm's x² sums and weight loads, the SiLU pairing, the rotary epilogue), so its best
shape may differ. For each projection of the 8B shape with the fold a decode layer gives it
at `--rows` rows, this times every elementwise-loop candidate (`candidate_configs`; unsplit
under a norm) as `--layers` launches over distinct weights in one CUDA graph, and prints µs a
launch beside the shape the fold runs today. `--out` writes the measurements and the winners
as rows of the tuned table (dtype name + `+fold:<tag>`), to merge into
`phaseflip/assets/kernel_configs/skinny_linear_<gpu>.json`.

    python -m benchmarks.fold_tune --rows 1 --dtype fp8 bf16 --out fold_tune.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

import torch

from benchmarks.common import graph_replay_us
from phaseflip.kernels.linear import skinny_linear
from phaseflip.kernels.linear_configs import (
    ConfigTable,
    SkinnyConfig,
    candidate_configs,
    load_bundled_configs,
    pick_config,
)
from phaseflip.kernels.linear_fold import NORM_FOLD_PAYS_M, Fold, RotaryFold
from phaseflip.model.quant.fp8 import quantize_rows

H, INTER, Q_HEADS, KV_HEADS, HEAD_DIM, EPS = 4096, 14336, 32, 8, 128, 1e-5
SHAPES = {"qkv": ((Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, H), "o": (H, H),
          "gate_up": (2 * INTER, H), "down": (H, INTER)}


def _fold(name: str, rows: int, fp8: bool) -> Fold:
    """The fold a decode layer of `rows` rows gives projection `name`."""
    dev = torch.device("cuda")
    g = 1 + 0.1 * torch.randn(H, device=dev, dtype=torch.bfloat16)
    norm = g if rows <= NORM_FOLD_PAYS_M else None
    if name in ("o", "down"):
        return Fold(residual=torch.randn(rows, H, device=dev, dtype=torch.bfloat16))
    if name == "gate_up":
        return Fold(norm_weight=norm, eps=EPS, silu_mul=True)
    cache = torch.zeros(64, KV_HEADS, HEAD_DIM, device=dev,
                        dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    scale = torch.full((KV_HEADS,), 0.05, device=dev) if fp8 else None
    tables = torch.rand(4096, HEAD_DIM // 2, device=dev)
    rotary = RotaryFold(torch.arange(rows, device=dev) + 1000, tables, tables.clone(),
                        torch.arange(rows, device=dev), cache, cache.clone(), scale,
                        None if scale is None else scale.clone(), Q_HEADS)
    return Fold(norm_weight=norm, eps=EPS, rotary=rotary)


def _time(weights: list, x: torch.Tensor, fold: Fold, cfg: SkinnyConfig, reps: int) -> float:
    def run() -> None:
        for w, s in weights:
            skinny_linear(x, w, weight_scale=s, config=cfg, fold=fold)

    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph_replay_us(graph, reps, len(weights))


def sweep(name: str, rows: int, fp8: bool, layers: int, reps: int) -> dict:
    n, k = SHAPES[name]
    dev = torch.device("cuda")
    weights = []
    for _ in range(layers):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        weights.append(quantize_rows(w) if fp8 else (w, None))
    wdtype = weights[0][0].dtype
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    fold = _fold(name, rows, fp8)
    today = fold.config(pick_config(rows, n, k, wdtype, dev, fold=fold.tag), rows, n, k,
                        wdtype, dev)
    seen: dict[SkinnyConfig, float] = {}
    for cfg in [today] + candidate_configs(rows, n, k, wdtype, dev):
        cfg = fold.config(cfg, rows, n, k, wdtype, dev)
        if cfg.loop != "ew" or cfg in seen:
            continue
        seen[cfg] = round(_time(weights, x, fold, cfg, reps), 2)
    best = min(seen, key=seen.get)
    row = {"proj": name, "rows": rows, "dtype": "fp8" if fp8 else "bf16", "tag": fold.tag,
           "n": n, "k": k, "today": today.label(), "today_us": seen[today],
           "best": best.label(), "best_us": seen[best],
           "all": {c.label(): t for c, t in sorted(seen.items(), key=lambda kv: kv[1])}}
    row["table_row"] = ConfigTable.key(rows, n, k, wdtype, fold=fold.tag), asdict(best)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1")
    ap.add_argument("--dtype", nargs="+", default=["fp8", "bf16"], choices=["fp8", "bf16"])
    ap.add_argument("--proj", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    load_bundled_configs(torch.device("cuda"))
    results = []
    for dtype in args.dtype:
        for rows in [int(v) for v in args.rows.split(",")]:
            for name in args.proj:
                row = sweep(name, rows, dtype == "fp8", args.layers, args.reps)
                results.append(row)
                print(f"{dtype} rows={rows} {name:8} [{row['tag']}] today {row['today']} "
                      f"{row['today_us']} us, best {row['best']} {row['best_us']} us",
                      flush=True)
                torch.cuda.empty_cache()
    if args.out:
        table = [{"m_bucket": b, "n": n, "k": k, "dtype": d, **cfg}
                 for (b, n, k, d), cfg in (r.pop("table_row") for r in results)]
        with open(args.out, "w") as f:
            json.dump({"sweeps": results, "table_rows": table, "layers": args.layers}, f,
                      indent=1)


if __name__ == "__main__":
    main()
