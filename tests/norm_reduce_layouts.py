"""The layout Triton gives the RMSNorm kernel's sum of squares, per variant, compiled for sm_90
without a GPU (Triton's NVIDIA backend and its bundled ptxas; no driver needed).

The reduction order of `tl.sum` follows its operand's layout, and the compiler picks one layout
for every access of the row from all the kernel's loads and stores: a variant that also stores
FP8 rows could sum in another order than the plain kernel and round its output differently.
`tests/test_fp8_quant_fusion.py` runs this as a script (not under `TRITON_INTERPRET`, which
would make the kernels uncompilable) and asserts every variant reduces in the same layout.

    python tests/norm_reduce_layouts.py 4096 128:fp16:4   # N[:dtype[:rows]] -> JSON
                                                          # {arg: {variant: layout}}
"""

from __future__ import annotations

import json
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from phaseflip.kernels import norm

# (HAS_RESIDUAL, STORE_OUT, QUANT, SCALED): the plain kernels, every FP8 variant the wrappers
# launch, and the adds that scale an FP8 product first (`scales=`)
VARIANTS = ((0, 1, 0, 0), (0, 1, 1, 0), (0, 0, 1, 0), (1, 1, 0, 0), (1, 1, 1, 0), (1, 0, 1, 0),
            (1, 1, 0, 1), (1, 0, 1, 1))
_STRIDES = ("sx_a", "sx_b", "sr_a", "sr_b", "so_a", "so_b", "sro_a", "sro_b")


def _compile(n: int, rows: int, variant: tuple[int, int, int, int], dtype: str) -> str:
    """TTGIR of the kernel as `norm._launch` launches it on contiguous [rows, n] rows of
    `dtype`, specialized as the launcher does (16-byte aligned pointers, ints % 16 marked)."""
    has_res, store_out, quant, scaled = variant
    kernel, elem = norm._rms_norm_kernel, {"bf16": 2, "fp16": 2}[dtype]
    block_n = triton.next_power_of_2(n)
    block_r = max(1, min(triton.next_power_of_2(rows), 2048 // block_n))
    num_warps = min(max(block_r * block_n // 512, 1), 16)
    consts = {"HAS_RESIDUAL": bool(has_res), "STORE_OUT": bool(store_out), "QUANT": bool(quant),
              "SCALED": bool(scaled),
              "BLOCK_R": block_r, "BLOCK_N": block_n, "FP8_MAX_C": norm.FP8_MAX,
              "MIN_SCALE_C": norm.MIN_SCALE, "Q_VEC": 16 // elem, "inner": 1,
              "PDL": True}  # as an H200 launches it (kernels/pdl.py)
    types = dict.fromkeys(("X", "R", "W", "OUT", "R_OUT"), f"*{dtype}")
    types |= {"Q": "*fp8e4nv" if quant else f"*{dtype}",
              "SCALE": "*fp32" if quant else f"*{dtype}",
              "XS_ROW": "*fp32" if scaled else f"*{dtype}",
              "XS_COL": "*fp32" if scaled else f"*{dtype}",
              "num_rows": "i32", "n_cols": "i32", "eps": "fp32", "inv_n": "fp32"}
    types |= dict.fromkeys(_STRIDES, "i32")
    names = kernel.arg_names
    signature = {a: "constexpr" if a in consts else types[a] for a in names}
    aligned = [a for a in names if types.get(a, "").startswith("*")]
    aligned += [a for a in _STRIDES if a.endswith("_b")]  # 0 for [T, N] rows
    aligned += [a for a in _STRIDES if a.endswith("_a")] + ["n_cols"] if n % 16 == 0 else []
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(names.index(a),): v for a, v in consts.items()},
                    attrs={(names.index(a),): [["tt.divisibility", 16]] for a in aligned})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "enable_fp_fusion": False})
    return compiled.asm["ttgir"]


def sum_layout(ttgir: str) -> str:
    """The layout (its definition) of the first `tt.reduce` combining with addf: the sum."""
    aliases = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*>)$", ttgir, re.M))
    for body, layout in re.findall(r'"tt\.reduce"\((.*?)\}\) : \(tensor<[^,]+, (#\w+)>', ttgir,
                                   re.S):
        if "arith.addf" in body:
            return aliases.get(layout, layout)
    raise ValueError("no sum (tt.reduce of addf) in the kernel")


def main() -> None:
    out: dict[str, dict[str, str]] = {}
    for arg in sys.argv[1:]:
        parts = arg.split(":")
        n, dtype = int(parts[0]), parts[1] if len(parts) > 1 else "bf16"
        rows = int(parts[2]) if len(parts) > 2 else 4096
        out[arg] = {"".join(map(str, v)): sum_layout(_compile(n, rows, v, dtype))
                    for v in VARIANTS}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
