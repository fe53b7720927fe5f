"""Device helpers the decode and extend attention kernels share: the FP8 pool's widening.

An FP8 (e4m3) pool's K and V rows are widened in registers to the dtype the dots run in; how
is `FP8_DOT_MODES` (`attention_plan.py`). Kept apart so both kernel modules import them.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # the kernels' exponentials are base 2, the scale folds this in


@triton.jit
def fp8_query(q, qk_scale, FP8_DOT: tl.constexpr):
    """(q in the dtype the FP8 K rows widen to, the softmax scale that goes with it).

    "q"/"fp16_pv": q as it is (K widens to q's dtype). "fp16": q in fp16, because Hopper
    widens an e4m3 pair to fp16 in one instruction, to bf16 only through fp16 (3-4 in all).
    Every e4m3 value and every bf16 q element from 2^-17 to 65504 is exact in fp16, and the
    dots accumulate in fp32, so the only hazard is a q element beyond 65504 (inf in fp16):
    then the program's q is divided by a power of two (exact) that the softmax scale undoes.
    A real model's q never comes near; there the factor is 1 and the dots equal bf16's.
    """
    if FP8_DOT == "fp16":
        if q.dtype != tl.float16:
            qf = q.to(tl.float32)
            amax = tl.max(tl.max(tl.abs(qf), 1), 0)
            # 2^k with amax / 2^k < 2^15, from amax's exponent bits (no rounding anywhere)
            k = tl.maximum(((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 141, 0)
            k = tl.where(amax > 65504.0, k, 0)
            q = (qf * ((127 - k) << 23).to(tl.float32, bitcast=True)).to(tl.float16)
            qk_scale = qk_scale * ((127 + k) << 23).to(tl.float32, bitcast=True)
    return q, qk_scale


@triton.jit
def fp8_widen(k, v, q, FP8_DOT: tl.constexpr):
    """K rows in q's dtype, V rows in q's ("q") or fp16's: exact, every e4m3 value is one."""
    k = k.to(q.dtype)
    if FP8_DOT == "q":
        v = v.to(q.dtype)
    else:
        v = v.to(tl.float16)
    return k, v
