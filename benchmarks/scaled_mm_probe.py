"""Whether cuBLAS's FP8 GEMM pays for its row-wise scales: `torch._scaled_mm` of the 8B's
projections with the scales we use (per token × per output channel, float32 [M, 1] and
[1, N]) against the same FP8 operands with one scale each (tensor-wise) and against bf16.

    python -m benchmarks.scaled_mm_probe --out scaled_mm_probe.json
    python -m benchmarks.scaled_mm_probe --m-sweep --out m_sweep.json  # row padding

If the tensor-wise GEMM were much faster at the mixed steps' M, the row and column scales
could be applied by the elementwise kernel that consumes each GEMM's output (SiLU·mul, the
rotary, the residual add) instead: the probe says whether that is worth building. µs are
`do_bench` medians (L2 flushed), TFLOP/s of 2·M·N·K.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import print_table, write_json

# (name, N, K) of Llama-3.1-8B's projections
SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
          ("down", 4096, 14336))
ROWS = (512, 2048, 8192)


def probe(m: int, n: int, k: int, dev: torch.device) -> dict:
    """µs of the row-wise, tensor-wise and bf16 GEMMs of one shape."""
    from triton.testing import do_bench

    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    xq, wq = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    sx = torch.rand(m, 1, device=dev, dtype=torch.float32) + 0.5
    sw = torch.rand(1, n, device=dev, dtype=torch.float32) + 0.5
    one = torch.ones((), device=dev, dtype=torch.float32)
    runs = {
        "rowwise": lambda: torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw,
                                            out_dtype=torch.bfloat16),
        "tensorwise": lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one,
                                               out_dtype=torch.bfloat16),
        "bf16": lambda: x @ w.t(),
    }
    row = {"M": m, "N": n, "K": k}
    for name, fn in runs.items():
        us = do_bench(fn, warmup=10, rep=100) * 1e3
        row[f"{name}_us"] = round(us, 1)
        row[f"{name}_tflops"] = round(2 * m * n * k / us / 1e6, 1)
    return row


def halves(m: int, n: int, k: int, dev: torch.device) -> dict:
    """µs of one row-wise GEMM of M rows against two of M/2 (a different cuBLAS pick?)."""
    from triton.testing import do_bench

    xq = torch.randn(m, k, device=dev).to(torch.float8_e4m3fn)
    wq = torch.randn(n, k, device=dev).to(torch.float8_e4m3fn)
    sx = torch.rand(m, 1, device=dev) + 0.5
    sw = torch.rand(1, n, device=dev) + 0.5
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    h = m // 2

    def two():
        for r in (slice(0, h), slice(h, m)):
            out[r] = torch._scaled_mm(xq[r], wq.t(), scale_a=sx[r], scale_b=sw,
                                      out_dtype=torch.bfloat16)

    def one():
        return torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)
    return {"M": m, "N": n, "K": k, "one_us": round(do_bench(one, rep=100) * 1e3, 1),
            "two_halves_us": round(do_bench(two, rep=100) * 1e3, 1)}


# `--m-sweep`: one 8B layer's four row-wise GEMMs at every multiple of 16 rows in [LO, HI]
# and one row past each (a batch's row count is arbitrary), ROUNDS interleaved rounds
# (medians: FP8 GEMMs at full load move the clocks); then for each padding multiple the mean
# layer µs of the odd counts run padded against unpadded
SWEEP_RANGES = ((1024, 2048, 64), (8192, 9216, 16))
PADS = (16, 32, 64, 128, 256)


def m_sweep(dev: torch.device, rounds: int = 3, bf16: bool = False,
            tensorwise: bool = False) -> dict:
    """{"layer_us": {M: µs of qkv + o + gate_up + down}, "shape_us": {shape: {M: µs}},
    "pads": {multiple: saving}}, each shape's median over the rounds: the row-wise FP8
    GEMMs, with `tensorwise` the FP8 GEMMs with unit scales (`fp8.ScaledRows`), or with
    `bf16` the 16-bit `x @ w.t()` of the same shapes."""
    from triton.testing import do_bench

    ms = sorted({m + d for lo, hi, step in SWEEP_RANGES for m in range(lo, hi + 1, step)
                 for d in (0, 1)})
    ms += sorted({-(-m // p) * p for m in ms for p in PADS} - set(ms))
    top = max(ms)
    dtype = torch.bfloat16 if bf16 else torch.float8_e4m3fn
    ops = [(torch.randn(top, k, device=dev).to(dtype), torch.rand(top, 1, device=dev) + 0.5,
            torch.randn(n, k, device=dev).to(dtype).t(), torch.rand(1, n, device=dev) + 0.5)
           for _name, n, k in SHAPES]

    one = torch.ones((), device=dev)

    def gemm(x, s, wt, sw):
        if bf16:
            return lambda: x @ wt
        if tensorwise:
            return lambda: torch._scaled_mm(x, wt, scale_a=one, scale_b=one,
                                            out_dtype=torch.bfloat16)
        return lambda: torch._scaled_mm(x, wt, scale_a=s, scale_b=sw, out_dtype=torch.bfloat16)

    names = [name for name, _n, _k in SHAPES]
    samples: dict[str, dict[int, list[float]]] = {name: {m: [] for m in ms} for name in names}
    for _ in range(rounds):
        for m in ms:
            for name, (x, s, wt, sw) in zip(names, ops):
                us = do_bench(gemm(x[:m], s[:m], wt, sw), warmup=5, rep=25) * 1e3
                samples[name][m].append(us)
    shape_us = {name: {m: sorted(v)[len(v) // 2] for m, v in by_m.items()}
                for name, by_m in samples.items()}
    layer = {m: sum(shape_us[name][m] for name in names) for m in ms}
    return {"layer_us": layer, "shape_us": shape_us, "pads": pad_savings(layer),
            "rounds": rounds,
            "dtype": "bf16" if bf16 else "fp8 tensor-wise" if tensorwise else "fp8 row-wise"}


def pad_savings(layer: dict[int, float]) -> dict[int, dict]:
    """For each multiple of `PADS`: the mean µs of the row counts that are not multiples of
    16, as they are and padded to it (both must be in `layer`), and the fraction saved."""
    odd = [m for m in layer if m % 16]
    pads = {}
    for p in PADS:
        pairs = [(layer[m], layer[-(-m // p) * p]) for m in odd]
        pads[p] = {"unpadded_us": sum(a for a, _ in pairs) / len(pairs),
                   "padded_us": sum(b for _, b in pairs) / len(pairs)}
        pads[p]["saving"] = 1 - pads[p]["padded_us"] / pads[p]["unpadded_us"]
    return pads


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    ap.add_argument("--m-sweep", action="store_true",
                    help="a layer's row-wise GEMMs over row counts, and what padding saves")
    ap.add_argument("--bf16", action="store_true", help="--m-sweep the bf16 GEMMs instead")
    ap.add_argument("--tensorwise", action="store_true",
                    help="--m-sweep the FP8 GEMMs with unit scales instead")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    if args.m_sweep:
        r = m_sweep(dev, bf16=args.bf16, tensorwise=args.tensorwise)
        for p, v in r["pads"].items():
            print(f"pad to a multiple of {p:3d}: {v['unpadded_us']:.0f} -> {v['padded_us']:.0f}"
                  f" µs a layer ({100 * v['saving']:+.1f} %)", flush=True)
        best = max(r["pads"], key=lambda p: r["pads"][p]["saving"])
        print(f"best pad: {best}", flush=True)
        write_json(args.out, {"benchmark": "scaled_mm_m_sweep", **r, "best_pad": best})
        return
    rows = [{"shape": name, **probe(m, n, k, dev)} for m in args.rows for name, n, k in SHAPES]
    print_table(["shape", "M", "row-wise µs", "TFLOP/s", "tensor-wise µs", "TFLOP/s",
                 "bf16 µs", "TFLOP/s"],
                [[r["shape"], r["M"], r["rowwise_us"], r["rowwise_tflops"], r["tensorwise_us"],
                  r["tensorwise_tflops"], r["bf16_us"], r["bf16_tflops"]] for r in rows],
                title=f"{torch.cuda.get_device_name()}: torch._scaled_mm, FP8 e4m3")
    split = [halves(m, n, k, dev) for m in args.rows for name, n, k in SHAPES
             if name == "down"]
    for r in split:
        print(f"down M={r['M']}: row-wise {r['one_us']} µs, as two halves "
              f"{r['two_halves_us']} µs", flush=True)
    write_json(args.out, {"benchmark": "scaled_mm_probe", "rows": rows, "down_halves": split})


if __name__ == "__main__":
    main()
