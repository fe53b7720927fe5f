"""What folding a decode layer's norms, SiLU·mul and residual adds into its GEMMs buys, by
piece, for a few rows (`kernels/linear_fold.py`).

Each variant runs the projections of `--layers` decoder layers of the 8B shape (distinct
weights, more bytes than L2 holds) as one CUDA graph, without attention (its input to o_proj
is a fixed tensor): what changes between variants is only the elementwise work around the
GEMMs. Variants: `plain` (fused add-norm, GEMM, ..., SiLU kernel: today's unfolded layer),
`folded` (norm before qkv and gate_up, SiLU after gate_up, residual after o and down, all in
the GEMMs), `no_norm` (folded but the norms as kernels), `no_silu` (folded but the SiLU as a
kernel). Prints µs per layer (median of `--reps` replays of the graph) and writes JSON.

    python -m benchmarks.fold_probe --rows 1,2 --dtype fp8 bf16 --out fold_probe.json
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.common import graph_replay_us
from phaseflip.kernels import activation, norm
from phaseflip.kernels.linear import skinny_linear
from phaseflip.kernels.linear_configs import load_bundled_configs
from phaseflip.kernels.linear_fold import Fold
from phaseflip.model.quant.fp8 import quantize_rows

H, INTER, QKV, EPS = 4096, 14336, 6144, 1e-5
VARIANTS = ("plain", "folded", "no_norm", "no_silu")


def _weights(n: int, k: int, fp8: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    if not fp8:
        return w, None
    return quantize_rows(w)


def _layer(fp8: bool) -> dict[str, object]:
    return {"qkv": _weights(QKV, H, fp8), "o": _weights(H, H, fp8),
            "gate_up": _weights(2 * INTER, H, fp8), "down": _weights(H, INTER, fp8),
            "g1": 1 + 0.1 * torch.randn(H, device="cuda", dtype=torch.bfloat16),
            "g2": 1 + 0.1 * torch.randn(H, device="cuda", dtype=torch.bfloat16)}


def _lin(x, wts, fold=None):
    w, s = wts
    return skinny_linear(x, w, weight_scale=s, fold=fold or Fold())


def _run(variant: str, layers: list[dict], r: torch.Tensor, attn: torch.Tensor) -> None:
    """One pass over the layers, writing the residual stream into r."""
    h = None
    for p in layers:
        norm_fold = variant in ("folded", "no_silu")
        silu_fold = variant in ("folded", "no_norm")
        if variant == "plain":
            if h is None:
                x = norm.rms_norm(r, p["g1"], EPS)
            else:
                x, r = norm.fused_add_rms_norm(h, r, p["g1"], EPS)
            _lin(x, p["qkv"])
            h = _lin(attn, p["o"])
            x, r = norm.fused_add_rms_norm(h, r, p["g2"], EPS)
            h = _lin(activation.silu_and_mul(_lin(x, p["gate_up"])), p["down"])
            continue
        if norm_fold:
            _lin(r, p["qkv"], Fold(norm_weight=p["g1"], eps=EPS))
        else:
            _lin(norm.rms_norm(r, p["g1"], EPS), p["qkv"])
        r = _lin(attn, p["o"], Fold(residual=r))
        x = r if norm_fold else norm.rms_norm(r, p["g2"], EPS)
        fold = Fold(norm_weight=p["g2"] if norm_fold else None, eps=EPS, silu_mul=silu_fold)
        act = _lin(x, p["gate_up"], fold)
        if not silu_fold:
            act = activation.silu_and_mul(act)
        r = _lin(act, p["down"], Fold(residual=r))


def measure(variant: str, layers: list[dict], rows: int, reps: int) -> float:
    r = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
    attn = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        _run(variant, layers, r.clone(), attn)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run(variant, layers, r.clone(), attn)
    return graph_replay_us(graph, reps, len(layers))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2")
    ap.add_argument("--dtype", nargs="+", default=["fp8", "bf16"], choices=["fp8", "bf16"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    load_bundled_configs(torch.device("cuda"))
    results = []
    for dtype in args.dtype:
        layers = [_layer(dtype == "fp8") for _ in range(args.layers)]
        for rows in [int(v) for v in args.rows.split(",")]:
            row = {"dtype": dtype, "rows": rows}
            for variant in VARIANTS:
                row[variant] = round(measure(variant, layers, rows, args.reps), 2)
            results.append(row)
            print(json.dumps(row), flush=True)
        del layers
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"us_per_layer": results, "layers": args.layers}, f, indent=1)


if __name__ == "__main__":
    main()
