"""Microbenchmark: the fused Triton elementwise kernels vs the torch path on one GPU.

Shapes of Llama-3.1-8B (hidden 4096, intermediate 14336, 32 query / 8 KV heads, head_dim 128),
bf16, T = 1, 64, 256, 4096, 8192 tokens (`--tokens`). Ops, each timed as the Triton wrapper and
as the torch code the CPU path runs (`forward_native`, `apply_rotary`):

- `rms_norm`      [T, 4096] (a layer's first input_layernorm, the final norm)
- `add_rms_norm`  residual add + norm, in place, vs `x + residual` then norm (every other norm)
- `silu_and_mul`  [T, 28672] -> [T, 14336]
- `rotary`        q [T, 32, 128] and k [T, 8, 128], views of the qkv output, rotated in place
                  with cos/sin gathered in the kernel, vs `apply_rotary` on q and k given cos/sin
                  (the torch path gathers those once per forward: `gather us`, not in `torch us`)
- `head_rms_norm` Qwen3's per-head q_norm on the [T, 32, 128] view (not a Llama op)
- `rotary+kv_store` (`... fp8`: into an FP8 pool with per-head scales) `rotary_store_kv`: q
                  rotated in place, rotated k and v written into pool slots (shuffled), in one
                  launch; its "torch" column is the UNFUSED CUDA path it replaces (the rotary
                  kernel, then `KVPool.store`'s index_put), its check the pool rows and q

Times are `triton.testing.do_bench` medians (it flushes the L2 between runs). GB/s counts the
bytes the fused kernel must move (each input read once, each output written once) over kernel
time, against the device copy bandwidth measured here. The correctness columns compare one
call of each on the same inputs: max |triton - torch|, max ulps, and the share of elements that
differ at all (rotary should be bit-identical; RMSNorm/SiLU may differ by 1-2 ulps on a few
elements, see tests/test_fused_kernels.py). The last table sums one decoder layer's worth
(2 add_rms_norm + silu_and_mul + rotary).

`--fp8` times instead the FP8 per-token quantization fused into its producer (the FP8 model's
path for more than 16 rows) against the separate kernels it replaces, at T = 64, 300, 1024,
8192 and K = 4096, 14336: `add_rms_norm+fp8` (`fused_add_rms_norm_fp8`, no 16-bit output) vs
`fused_add_rms_norm` then `per_token_quant`, and `silu_and_mul+fp8` ([T, 2K] -> FP8 [T, K]) vs
`silu_and_mul` then `per_token_quant`. Its check columns count the FP8 bytes and scales that
differ between the two (the contract is 0: bitwise).

    python -m benchmarks.fused_kernels --out fused_kernels.json
    python -m benchmarks.fused_kernels --fp8 --out fused_fp8_quant.json
    python -m benchmarks.fused_kernels --silu-variants --out silu_variants.json

`--silu-variants` times the FP8 SiLU·mul with the approximate exp and division and with
per-program scratch rows (`activation.FAST_SILU_FP8`, off; `SCRATCH_SLOTS_FP8`, 528) against
one scratch row a token at [T, 28672], with the FP8 bytes that differ from that kernel's.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import print_table, write_json  # noqa: E402

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
DTYPE = torch.bfloat16
EPS = 1e-5
TOKENS = (1, 64, 256, 4096, 8192)
FP8_TOKENS = (64, 300, 1024, 8192)
FP8_K = (HIDDEN, INTER)


def bench(fn: Callable[[], object], quick: bool) -> float:
    """Median microseconds."""
    import triton.testing

    ms = triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 100,
                                 return_mode="median")
    return ms * 1e3


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in representable values of their (16- or 32-bit float) dtype."""
    bits = {4: torch.int32, 2: torch.int16}[a.element_size()]
    lo = -(1 << (8 * a.element_size() - 1))

    def ordered(t: torch.Tensor) -> torch.Tensor:
        i = t.contiguous().view(bits).long()
        return torch.where(i < 0, lo - i, i)

    return (ordered(a) - ordered(b)).abs()


def compare(got: torch.Tensor | tuple, want: torch.Tensor | tuple) -> dict:
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    diffs = [ulps(g, w) for g, w in zip(got, want)]
    n = sum(d.numel() for d in diffs)
    return {
        "max_abs_diff": max((g.float() - w.float()).abs().max().item()
                            for g, w in zip(got, want)),
        "max_ulps": max(int(d.max()) for d in diffs),
        "pct_differ": 100.0 * sum(int((d > 0).sum()) for d in diffs) / n,
    }


def run_token_count(t: int, args, dev: torch.device) -> list[dict]:
    from phaseflip.kernels.activation import silu_and_mul
    from phaseflip.kernels.norm import fused_add_rms_norm, rms_norm
    from phaseflip.model.layers import RMSNorm, SiluAndMul
    from phaseflip.model.rope import RotaryEmbedding
    from phaseflip.model.rope_config import RopeConfig

    e = DTYPE.itemsize
    norm = RMSNorm(HIDDEN, EPS, DTYPE).to(dev)
    norm.weight.data.normal_(1.0, 0.2)
    head_norm = RMSNorm(HEAD_DIM, EPS, DTYPE).to(dev)
    head_norm.weight.data.normal_(1.0, 0.2)
    act = SiluAndMul()
    rope = RotaryEmbedding(RopeConfig("llama3", 500000.0, factor=8.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0,
                                      original_max_position_embeddings=8192),
                           HEAD_DIM, 131072, device=dev)
    x = torch.randn(t, HIDDEN, device=dev, dtype=DTYPE)
    res = torch.randn(t, HIDDEN, device=dev, dtype=DTYPE) * 4
    gate_up = torch.randn(t, 2 * INTER, device=dev, dtype=DTYPE) * 3
    qkv = torch.randn(t, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=dev, dtype=DTYPE) * 2
    positions = torch.randint(0, 131072, (t,), device=dev)

    q = qkv[:, : HEADS * HEAD_DIM].view(t, HEADS, HEAD_DIM)
    rows = []

    def row(op: str, kernel, torch_fn, check: dict, nbytes: int, **extra) -> None:
        k_us, t_us = bench(kernel, args.quick), bench(torch_fn, args.quick)
        rows.append({"op": op, "tokens": t, "triton_us": k_us, "torch_us": t_us,
                     "speedup": t_us / k_us, "GBps": nbytes / (k_us * 1e-6) / 1e9,
                     **check, **extra})

    # correctness first, on fresh copies (the timed in-place calls drift the buffers)
    row("rms_norm", lambda: rms_norm(x, norm.weight, EPS), lambda: norm.forward_native(x),
        compare(rms_norm(x, norm.weight, EPS), norm.forward_native(x)), 2 * t * HIDDEN * e)

    got = fused_add_rms_norm(x.clone(), res.clone(), norm.weight, EPS)
    xa, ra = x.clone(), res.clone()
    row("add_rms_norm", lambda: fused_add_rms_norm(xa, ra, norm.weight, EPS),
        lambda: norm.forward_native(x, res), compare(got, norm.forward_native(x, res)),
        4 * t * HIDDEN * e)

    row("silu_and_mul", lambda: silu_and_mul(gate_up), lambda: act.forward_native(gate_up),
        compare(silu_and_mul(gate_up), act.forward_native(gate_up)), 3 * t * INTER * e)

    rotary_row(t, qkv, positions, rope, row, args.quick)
    row("head_rms_norm", lambda: rms_norm(q, head_norm.weight, EPS),
        lambda: head_norm.forward_native(q),
        compare(rms_norm(q, head_norm.weight, EPS), head_norm.forward_native(q)),
        2 * t * HEADS * HEAD_DIM * e)
    for pool_dtype in (DTYPE, torch.float8_e4m3fn):
        kv_store_rows(t, qkv, positions, rope, pool_dtype, row)
    return rows


def rotary_row(t: int, qkv: torch.Tensor, positions: torch.Tensor, rope,
               row: Callable[..., None], quick: bool) -> None:
    """The `rotary` row: the in-place kernel on q and k of a qkv buffer vs `apply_rotary`
    (with the cos/sin gather it needs timed beside it)."""
    from phaseflip.kernels.rope import apply_rotary_inplace
    from phaseflip.model.rope import apply_rotary

    def qk(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = buf[:, : HEADS * HEAD_DIM].view(t, HEADS, HEAD_DIM)
        k = buf[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(t, KV_HEADS, HEAD_DIM)
        return q, k

    q, k = qk(qkv)
    cos, sin = rope.cos_sin(positions, DTYPE)
    want = (apply_rotary(q, cos, sin), apply_rotary(k, cos, sin))
    qc, kc = qk(qkv.clone())
    got = apply_rotary_inplace(qc, kc, positions, rope.cos_cache, rope.sin_cache)
    qt, kt = qk(qkv.clone())
    gather_us = bench(lambda: rope.cos_sin(positions, DTYPE), quick)
    row("rotary", lambda: apply_rotary_inplace(qt, kt, positions, rope.cos_cache,
                                               rope.sin_cache),
        lambda: (apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)), compare(got, want),
        2 * t * (HEADS + KV_HEADS) * HEAD_DIM * DTYPE.itemsize
        + t * (8 + 2 * 4 * rope.rotary_dim // 2), gather_us=gather_us)


def kv_store_rows(t: int, qkv: torch.Tensor, positions: torch.Tensor, rope, pool_dtype,
                  row: Callable[..., None]) -> None:
    """The `rotary+kv_store` row: fused kernel vs rotary kernel + `KVPool.store`."""
    from phaseflip.cache.kv_pool import KVPool
    from phaseflip.kernels.rope import apply_rotary_inplace, rotary_store_kv

    dev = qkv.device
    slots = torch.randperm(2 * t + 16, device=dev)[:t] + 1

    def views(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = buf[:, : HEADS * HEAD_DIM].view(t, HEADS, HEAD_DIM)
        k, v = buf[:, HEADS * HEAD_DIM :].view(t, 2 * KV_HEADS, HEAD_DIM).split(KV_HEADS, 1)
        return q, k, v

    def pool() -> KVPool:
        p = KVPool(2 * t + 17, (0, 1), KV_HEADS, HEAD_DIM, pool_dtype, dev)
        if p.k_scale is not None:
            p.k_scale.copy_(torch.linspace(0.01, 0.05, KV_HEADS))
            p.v_scale.copy_(torch.linspace(0.02, 0.01, KV_HEADS))
        return p

    def fused(p: KVPool, q, k, v) -> torch.Tensor:
        return rotary_store_kv(q, k, v, positions, rope.cos_cache, rope.sin_cache, slots,
                               *p.layer(0), *(p.scales(0) or (None, None)))

    def unfused(p: KVPool, q, k, v) -> torch.Tensor:
        apply_rotary_inplace(q, k, positions, rope.cos_cache, rope.sin_cache)
        p.store(0, slots, k, v)
        return q

    results = []
    for fn in (fused, unfused):
        p = pool()
        q_out = fn(p, *views(qkv.clone()))
        results.append((q_out.float(), p.k[0][slots].float(), p.v[0][slots].float()))
    p_f, p_u = pool(), pool()
    buf_f, buf_u = views(qkv.clone()), views(qkv.clone())
    name = "rotary+kv_store" + (" fp8" if pool_dtype != DTYPE else "")
    row(name, lambda: fused(p_f, *buf_f), lambda: unfused(p_u, *buf_u),
        compare(results[0], results[1]),
        t * (HEADS + 2 * KV_HEADS) * HEAD_DIM * DTYPE.itemsize + t * HEADS * HEAD_DIM
        * DTYPE.itemsize + 2 * t * KV_HEADS * HEAD_DIM * pool_dtype.itemsize)


def fp8_quant_rows(t: int, k: int, quick: bool, dev: torch.device) -> list[dict]:
    """Fused producer + FP8 quantization vs the producer then `per_token_quant`, at [T, K]."""
    from phaseflip.kernels.activation import silu_and_mul, silu_and_mul_fp8
    from phaseflip.kernels.fp8_quant import per_token_quant
    from phaseflip.kernels.norm import fused_add_rms_norm, fused_add_rms_norm_fp8

    e = DTYPE.itemsize
    w = torch.empty(k, device=dev, dtype=DTYPE).normal_(1.0, 0.2)
    x = torch.randn(t, k, device=dev, dtype=DTYPE)
    res = torch.randn(t, k, device=dev, dtype=DTYPE) * 4
    gate_up = torch.randn(t, 2 * k, device=dev, dtype=DTYPE) * 3

    def separate_norm(xs: torch.Tensor, rs: torch.Tensor):
        return per_token_quant(fused_add_rms_norm(xs, rs, w, EPS)[0])

    def separate_silu(g: torch.Tensor):
        return per_token_quant(silu_and_mul(g))

    cases = [
        # op, fused, separate (both on their own copies: in place), minimal bytes moved
        ("add_rms_norm+fp8", lambda a: fused_add_rms_norm_fp8(*a, w, EPS)[2:],
         lambda a: separate_norm(*a), lambda: (x.clone(), res.clone()), t * k * (3 * e + 1)),
        ("silu_and_mul+fp8", lambda a: silu_and_mul_fp8(a)[1:], separate_silu,
         lambda: gate_up, t * k * (2 * e + 1)),
    ]
    rows = []
    for op, fused, separate, fresh, nbytes in cases:
        (q, s), (wq, ws) = fused(fresh()), separate(fresh())  # correctness on fresh inputs
        args_f, args_s = fresh(), fresh()
        f_us, s_us = bench(partial(fused, args_f), quick), bench(partial(separate, args_s), quick)
        rows.append({"op": op, "tokens": t, "K": k, "fused_us": f_us, "separate_us": s_us,
                     "speedup": s_us / f_us, "GBps": nbytes / (f_us * 1e-6) / 1e9,
                     "q_bytes_differ": int((q.view(torch.uint8) != wq.view(torch.uint8)).sum()),
                     "scales_differ": int((s != ws).sum())})
    return rows


def silu_variant_rows(t: int, quick: bool, dev: torch.device) -> list[dict]:
    """The FP8 SiLU·mul's variants (`activation.FAST_SILU_FP8`, `SCRATCH_SLOTS_FP8`) at
    [T, 2 x INTER]: µs, GB/s of the bytes it must move, and the FP8 bytes that differ from the
    one-scratch-row-a-token kernel's (slots 0); `shipped` marks the module's defaults."""
    from phaseflip.kernels.activation import (
        FAST_SILU_FP8,
        SCRATCH_SLOTS_FP8,
        silu_and_mul_fp8,
    )
    from phaseflip.kernels.attention import num_sms

    gate_up = torch.randn(t, 2 * INTER, device=dev, dtype=DTYPE) * 3
    _, q0, _ = silu_and_mul_fp8(gate_up, fast=False, scratch_slots=0)
    sms = num_sms(dev)
    rows = []
    for fast in (False, True):
        for slots in sorted({0, 2 * sms, 4 * sms, 8 * sms, SCRATCH_SLOTS_FP8}):
            def run(fast=fast, slots=slots):
                return silu_and_mul_fp8(gate_up, fast=fast, scratch_slots=slots)
            us = bench(run, quick)
            rows.append({"tokens": t, "fast": fast, "slots": slots, "us": us,
                         "shipped": fast == FAST_SILU_FP8 and slots == SCRATCH_SLOTS_FP8,
                         "GBps": t * INTER * (2 * DTYPE.itemsize + 1) / (us * 1e-6) / 1e9,
                         "q_bytes_differ": int((run()[1].view(torch.uint8)
                                                != q0.view(torch.uint8)).sum())})
    return rows


def main_silu_variants(args, dev: torch.device) -> None:
    rows = [r for t in (args.tokens or [800, 8192]) for r in silu_variant_rows(t, args.quick, dev)]
    print_table(["T", "fast", "scratch slots", "shipped", "us", "GB/s", "q bytes differ"],
                [[r["tokens"], r["fast"], r["slots"], r["shipped"], r["us"], r["GBps"],
                  r["q_bytes_differ"]] for r in rows],
                title=f"FP8 SiLU·mul variants, [T, {2 * INTER}] {DTYPE} -> FP8 "
                      f"(q bytes compared with slots 0)")
    write_json(args.out, {"benchmark": "fused_kernels_silu_variants", "rows": rows})


def main_fp8(args, dev: torch.device) -> None:
    import triton

    tokens = args.tokens or list(FP8_TOKENS)
    rows = [r for t in tokens for k in FP8_K for r in fp8_quant_rows(t, k, args.quick, dev)]
    print(f"\n{torch.cuda.get_device_name()}  triton {triton.__version__}  torch "
          f"{torch.__version__}  bf16 -> float8_e4m3fn per token")
    print_table(
        ["op", "T", "K", "fused us", "separate us", "speedup", "GB/s (fused)", "q bytes differ",
         "scales differ"],
        [[r["op"], r["tokens"], r["K"], r["fused_us"], r["separate_us"], r["speedup"], r["GBps"],
          r["q_bytes_differ"], r["scales_differ"]] for r in rows],
        title="FP8 per-token quantization fused into its producer vs separate kernels",
    )
    write_json(args.out, {"benchmark": "fused_kernels_fp8_quant", "dtype": str(DTYPE),
                          "rows": rows})


def measure_copy_TBps(dev: torch.device, quick: bool) -> float:
    a = torch.empty(1024**3, dtype=DTYPE, device=dev).normal_()  # 2 GiB
    b = torch.empty_like(a)
    us = bench(lambda: b.copy_(a), quick)
    return 2 * a.numel() * a.element_size() / (us * 1e-6) / 1e12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="JSON results path")
    ap.add_argument("--tokens", type=int, nargs="+",
                    help=f"token counts T (default: {TOKENS}; with --fp8 {FP8_TOKENS})")
    ap.add_argument("--quick", action="store_true", help="shorter do_bench windows")
    ap.add_argument("--silu-variants", action="store_true",
                    help="time the FP8 SiLU·mul's variants instead (default T: 800, 8192)")
    ap.add_argument("--fp8", action="store_true",
                    help="time the FP8 quantization fused into add+norm and SiLU*mul instead")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    if args.silu_variants:
        return main_silu_variants(args, dev)
    if args.fp8:
        return main_fp8(args, dev)
    args.tokens = args.tokens or list(TOKENS)

    import triton

    copy_tbps = measure_copy_TBps(dev, args.quick)
    rows = [r for t in args.tokens for r in run_token_count(t, args, dev)]
    for r in rows:
        r["pct_of_copy_bw"] = 100 * r["GBps"] / (copy_tbps * 1e3)

    print(f"\n{torch.cuda.get_device_name()}  triton {triton.__version__}  torch "
          f"{torch.__version__}  bf16  device copy {copy_tbps:.2f} TB/s")
    print_table(
        ["op", "T", "triton us", "torch us", "gather us", "speedup", "GB/s", "% copy bw",
         "max abs diff", "max ulps", "% differ"],
        [[r["op"], r["tokens"], r["triton_us"], r["torch_us"], r.get("gather_us"), r["speedup"],
          r["GBps"], r["pct_of_copy_bw"], r["max_abs_diff"], r["max_ulps"], r["pct_differ"]]
         for r in rows],
        title="Fused elementwise kernels vs torch (Llama-3.1-8B shapes)",
    )
    layer = []
    for t in args.tokens:
        by_op = {r["op"]: r for r in rows if r["tokens"] == t}
        ops = ("add_rms_norm", "add_rms_norm", "silu_and_mul", "rotary")
        tri = sum(by_op[o]["triton_us"] for o in ops)
        ref = sum(by_op[o]["torch_us"] for o in ops)
        layer.append({"tokens": t, "triton_us": tri, "torch_us": ref, "saved_us": ref - tri})
    print_table(["T", "triton us", "torch us", "saved us / layer"],
                [[r["tokens"], r["triton_us"], r["torch_us"], r["saved_us"]] for r in layer],
                title="One decoder layer's elementwise work (2 add+norm, silu*mul, rotary)")
    write_json(args.out, {
        "benchmark": "fused_kernels", "dtype": str(DTYPE), "hidden": HIDDEN,
        "intermediate": INTER, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "copy_TBps": copy_tbps, "rows": rows, "per_layer": layer,
    })


if __name__ == "__main__":
    main()
