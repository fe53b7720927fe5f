"""Decode attention kernel compiled for a GPU that is not here: registers, shared memory and the
instruction mix of each launch-shape candidate, read from the SASS (no device needed).

It compiles `_decode_split_kernel` ahead of time for `--arch` (default sm_90, the H200) with the
argument specialisation a real launch gets (pointers and strides divisible by 16), at the 8B
decode shape (group 4, head_dim 128), and disassembles it with the Triton wheel's cuobjdump. The
counts are static instructions (a loop body counts once per unrolled copy), so compare
candidates with each other, not with a profile. What to look for: registers a thread (they cap
the resident warps: 65 536 registers an SM, 64 warps at most), byte-wise shared loads
(`LDS.U8`: an 8-bit operand the MMA needs transposed), conversion instructions (`F2F*`, `F2FP*`)
and which MMA runs (`HMMA` register MMA, `HGMMA` warpgroup MMA).

    python benchmarks/attention_sass.py                 # the FP8 sweep's candidates
    python benchmarks/attention_sass.py --kv-dtype bf16 # the bf16 sweep's
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for real, even from a CPU test session
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from benchmarks.attention_kernels import DECODE_SWEEP, DECODE_SWEEP_FP8, config_name  # noqa: E402
from phaseflip.kernels import attention as kernels  # noqa: E402

PTRS = ["Q", "K", "V", "KV_INDPTR", "KV_INDICES", "ORDER", "QO", "OUT", "MID_O", "MID_M", "MID_L",
        "LOCKS", "K_SCALE", "V_SCALE"]
SCALARS = {"qk_scale": "fp32", "window": "i32", "min_chunk": "i32", "num_splits": "i32"}
STRIDES = ["stride_qt", "stride_qh", "stride_kn", "stride_kh", "stride_vn", "stride_vh",
           "stride_ot", "stride_oh"]
KEEP = ("F2F", "F2FP", "HMMA", "HGMMA", "LDG", "LDGSTS", "LDS", "LDSM", "STS", "PRMT", "MUFU")


def compile_decode(cfg: kernels.KernelConfig, fp8: bool, direct: bool, arch: int):
    """The decode kernel for `cfg`, compiled for sm_`arch` as a launch would specialise it."""
    kv = "fp8e4nv" if fp8 else "bf16"
    types = {"Q": "bf16", "K": kv, "V": kv, "OUT": "bf16", "KV_INDPTR": "i64",
             "KV_INDICES": "i64", "ORDER": "i64", "QO": "i32", "MID_O": "fp32",
             "MID_M": "fp32", "MID_L": "fp32", "LOCKS": "i32",
             "K_SCALE": "fp32", "V_SCALE": "fp32"}
    sig = {p: f"*{types[p]}" for p in PTRS} | SCALARS | dict.fromkeys(STRIDES, "i32")
    const = {"GROUP": 4, "HEAD_BLOCKS": 1, "BLOCK_H": cfg.block_m, "BLOCK_N": cfg.block_n,
             "HEAD_DIM": 128, "BLOCK_D": 128, "HAS_WINDOW": False, "DIRECT": direct,
             "DOT_PREC": "tf32", "KV_FP8": fp8, "FP8_DOT": cfg.fp8_dot if fp8 else "q",
             "HAS_ORDER": True, "HAS_QO": False, "BLOCK_S": 64}
    sig |= dict.fromkeys(const, "constexpr")
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in PTRS + STRIDES}
    src = ASTSource(kernels._decode_split_kernel, sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


def describe(compiled) -> dict:
    """Registers, spill stack, shared bytes and the kept instruction counts of one kernel."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    ops = Counter(re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass))
    usage = dict(re.findall(r"(REG|STACK):(\d+)", res))
    return {"regs": int(usage.get("REG", 0)), "stack": int(usage.get("STACK", 0)),
            "smem": compiled.metadata.shared,
            "ops": {o: n for o, n in sorted(ops.items()) if o.split(".")[0] in KEEP}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-dtype", choices=["bf16", "fp8_e4m3"], default="fp8_e4m3")
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90")
    ap.add_argument("--split", action="store_true", help="the split-K variant (not DIRECT)")
    args = ap.parse_args()
    fp8 = args.kv_dtype == "fp8_e4m3"
    for cfg in DECODE_SWEEP_FP8 if fp8 else DECODE_SWEEP:
        d = describe(compile_decode(cfg, fp8, not args.split, args.arch))
        warp_regs = -(-max(d["regs"], 1) // 8) * 8 * 32  # allocated per warp, 8 at a time
        warps = min(65536 // warp_regs, 64) // cfg.num_warps * cfg.num_warps
        print(f"{config_name(cfg, fp8):<22} regs {d['regs']:>3} stack {d['stack']:>3} smem "
              f"{d['smem']:>6}  resident warps/SM by regs {warps}")
        print("    " + " ".join(f"{o}:{n}" for o, n in d["ops"].items()))


if __name__ == "__main__":
    main()
