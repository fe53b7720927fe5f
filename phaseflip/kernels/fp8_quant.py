"""Per-token FP8 activation quantization in one kernel (the input side of an FP8 linear).

`model.quant.fp8.quantize_tokens` in torch is eight elementwise/reduce launches (widen, abs,
amax, divide, clamp, divide, clamp, cast) for every FP8 linear: at four linears a layer that is
over a thousand tiny kernels in one 8B decode step, several microseconds each even inside a
CUDA graph. Here a program owns one token row: it takes the row's |x| maximum (or the one given,
a TP group's whole-row maximum), writes the scale, and writes the FP8 row, reading x twice.
Bitwise what the torch code computes: float32 math, an IEEE-rounded divide (`div_rn`), the
range clamp, round-to-nearest-even to e4m3.

`fp8_row_scale` and `fp8_quantize` are that math as `@triton.jit` helpers: the kernels that
produce a linear's input (`norm.py`, `activation.py`) call them to emit the FP8 row and its
scale themselves, bitwise what `per_token_quant` makes of their 16-bit output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phaseflip.kernels.gemm_rows import empty_rows
from phaseflip.kernels.pdl import (
    chain_launch_options,
    launch_dependents,
    pdl_enabled,
    wait_previous,
)

FP8_MAX = 448.0
MIN_SCALE = 1e-12


@triton.jit
def fp8_row_scale(amax, FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr):
    """A row's scale from its |x| maximum (float32): amax / 448, IEEE-rounded, at least 1e-12."""
    return tl.maximum(tl.math.div_rn(amax, FP8_MAX_C), MIN_SCALE_C)


@triton.jit
def fp8_quantize(x, scale, Q, FP8_MAX_C: tl.constexpr):
    """float32 x / scale (IEEE-rounded), clamped to e4m3's range, cast (RNE) to Q's dtype."""
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX_C), FP8_MAX_C)
    return y.to(Q.dtype.element_ty)


@triton.jit
def _per_token_quant_kernel(
    X, Q, SCALE, AMAX, stride_x, stride_q, K,
    BLOCK: tl.constexpr, HAS_AMAX: tl.constexpr, FP8_MAX_C: tl.constexpr,
    MIN_SCALE_C: tl.constexpr, PDL: tl.constexpr,
):
    launch_dependents(PDL)  # the FP8 GEMM after it may launch early (`kernels/pdl.py`)
    wait_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if HAS_AMAX:
        amax = tl.load(AMAX + row)
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, K, BLOCK):
            mask = k0 + offs < K
            x = tl.load(X + row * stride_x + k0 + offs, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        amax = tl.max(amax, 0)
    scale = fp8_row_scale(amax, FP8_MAX_C, MIN_SCALE_C)
    tl.store(SCALE + row, scale)
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        x = tl.load(X + row * stride_x + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(Q + row * stride_q + k0 + offs, fp8_quantize(x, scale, Q, FP8_MAX_C), mask=mask)


def empty_fp8_rows(t: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (x_q [t, k] float8_e4m3fn, scale [t, 1] float32) for a kernel to fill:
    the first `t` rows of buffers of the FP8 GEMM's padded row count (`gemm_rows`), so
    `gemm_rows.padded_operands` can hand the GEMM the padded rows without a copy."""
    return (empty_rows(t, k, torch.float8_e4m3fn, device, fp8=True),
            empty_rows(t, 1, torch.float32, device, fp8=True))


def per_token_quant(x: torch.Tensor, amax: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (unit last stride) -> (x_q [T, K] float8_e4m3fn, scale [T, 1] float32), as
    `quantize_tokens`; `amax` [T, 1] float32 replaces the rows' own maxima."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError("x must be [T, K] with unit last stride")
    t, k = x.shape
    q, scale = empty_fp8_rows(t, k, x.device)
    if t == 0:
        return q, scale
    amax_arg = amax.reshape(t).contiguous() if amax is not None else scale
    block = min(triton.next_power_of_2(k), 1024)
    _per_token_quant_kernel[(t,)](
        x, q, scale, amax_arg, x.stride(0), q.stride(0), k,
        BLOCK=block, HAS_AMAX=amax is not None, FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE,
        PDL=pdl_enabled(x.device), num_warps=4 if block >= 512 else 2,
        **chain_launch_options(x.device),
    )
    return q, scale
