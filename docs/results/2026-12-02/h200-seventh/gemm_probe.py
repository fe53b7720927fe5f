"""FP8 GEMMs at decode batch sizes 17-512: torch._scaled_mm (row-wise) against a Triton FP8 GEMM."""
import json, os, time
import torch, triton, triton.language as tl, triton.testing

@triton.jit
def _mm(A, B, AS, BS, C, M, N, K, sam, sbn, scm,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr):
    pid_n = tl.program_id(0); pid_m = tl.program_id(1); pid_k = tl.program_id(2)
    om = pid_m * BM + tl.arange(0, BM); on = pid_n * BN + tl.arange(0, BN); ok = tl.arange(0, BK)
    kc = K // SPLIT
    k0 = pid_k * kc
    a_p = A + om[:, None].to(tl.int64) * sam + (k0 + ok)[None, :]
    b_p = B + on[:, None].to(tl.int64) * sbn + (k0 + ok)[None, :]
    acc = tl.zeros([BM, BN], tl.float32)
    for k in range(0, kc, BK):
        a = tl.load(a_p, mask=(om < M)[:, None], other=0.0)
        b = tl.load(b_p)
        acc = tl.dot(a, tl.trans(b), acc)
        a_p += BK; b_p += BK
    acc = acc * tl.load(AS + om, mask=om < M, other=0.0)[:, None] * tl.load(BS + on)[None, :]
    cp = C + om[:, None].to(tl.int64) * scm + on[None, :]
    if SPLIT == 1:
        tl.store(cp, acc.to(C.dtype.element_ty), mask=(om < M)[:, None])
    else:
        tl.atomic_add(cp, acc, mask=(om < M)[:, None], sem="relaxed")

def main():
    dev = torch.device("cuda"); torch.manual_seed(0)
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    Ms = [24, 48, 86, 128, 200, 300, 512]
    cfgs = [(16, 64, 128, 1, 4, 4), (16, 64, 256, 1, 4, 4), (16, 128, 128, 1, 4, 4),
            (32, 64, 128, 1, 4, 4), (32, 64, 256, 1, 4, 3), (32, 128, 128, 1, 4, 4),
            (64, 64, 128, 1, 4, 4), (64, 128, 128, 1, 4, 4), (64, 128, 128, 1, 8, 4), (64, 64, 256, 1, 4, 3),
            (128, 128, 128, 1, 8, 4), (128, 64, 128, 1, 4, 4),
            (16, 64, 128, 2, 4, 4), (32, 64, 128, 2, 4, 4), (64, 64, 128, 2, 4, 4), (32, 64, 128, 4, 4, 4),
            (64, 128, 128, 2, 8, 4)]
    out = {}
    for name, (N, K) in shapes.items():
        w = (torch.randn(N, K, device=dev) * 0.05).to(torch.float8_e4m3fn)
        ws = torch.rand(N, device=dev, dtype=torch.float32) * 0.01 + 0.001
        for M in Ms:
            x = (torch.randn(M, K, device=dev)).to(torch.float8_e4m3fn)
            xs = torch.rand(M, 1, device=dev) * 0.01 + 0.001
            ref = torch._scaled_mm(x, w.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16)
            t_ref = triton.testing.do_bench(lambda: torch._scaled_mm(x, w.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16), warmup=5, rep=30) * 1e3
            byts = N * K + M * K + M * N * 2
            row = {"scaled_mm_us": round(t_ref, 1), "scaled_mm_TBs": round(byts / t_ref / 1e6, 2)}
            best = None
            for (bm, bn, bk, sp, nw, st) in cfgs:
                if N % bn or K % (bk * sp):
                    continue
                key = f"{bm}x{bn}x{bk} s{sp} w{nw} st{st}"
                try:
                    if sp == 1:
                        c = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
                        f = lambda: _mm[(N // bn, triton.cdiv(M, bm), 1)](x, w, xs, ws, c, M, N, K, K, K, N, BM=bm, BN=bn, BK=bk, SPLIT=1, num_warps=nw, num_stages=st)
                    else:
                        c = torch.zeros(M, N, device=dev, dtype=torch.float32)
                        def f(c=c, bm=bm, bn=bn, bk=bk, sp=sp, nw=nw, st=st):
                            c.zero_()
                            _mm[(N // bn, triton.cdiv(M, bm), sp)](x, w, xs, ws, c, M, N, K, K, K, N, BM=bm, BN=bn, BK=bk, SPLIT=sp, num_warps=nw, num_stages=st)
                            return c.to(torch.bfloat16)
                    f()
                    got = c.to(torch.bfloat16) if sp > 1 else c
                    if sp > 1:
                        got = f()
                    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                    t = triton.testing.do_bench(f, warmup=5, rep=30) * 1e3
                    row[key] = (round(t, 1), round(err, 4))
                    if err < 1e-2 and (best is None or t < best[1]):
                        best = (key, t)
                except Exception as e:  # noqa: BLE001
                    row[key] = f"error {type(e).__name__}: {str(e)[:100]}"
            row["best"] = best
            out[f"{name} M={M}"] = row
            b = f"{best[0]} {best[1]:.1f} us ({byts / best[1] / 1e6:.2f} TB/s) = {t_ref / best[1]:.2f}x" if best else "-"
            print(f"{name:8s} M={M:4d}  scaled_mm {t_ref:7.1f} us ({byts / t_ref / 1e6:.2f} TB/s)  best triton {b}", flush=True)
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "gemm_probe.json"), "w"), indent=1)

main()
