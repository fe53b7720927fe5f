"""Triton SiLU-and-multiply for the gated MLP: [T, 2I] (gate | up) -> silu(gate) * up, [T, I].

Rounding follows the torch path (`SiluAndMul` in `model/layers.py`, the oracle): `F.silu` on a
half-precision tensor computes `g / (1 + exp(-g))` in float32 and rounds once to the activation
dtype; the multiply by `up` is a dtype multiply (exact float32 product, rounded once). The kernel
does exactly that. On the GPU it uses libdevice's `expf` and an IEEE division (`div_rn`), the
functions torch's CUDA kernel compiles to, not Triton's default `exp` (ex2.approx) and `/`
(div.full), so bf16/fp16 results should be bit-identical; under the interpreter `exp` is NumPy's.

One read of gate and up, one write of the output: the torch path's extra round trip through the
materialised `silu(gate)` is the saving. No host syncs; capturable in a CUDA graph once compiled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    X, OUT, n_cols, stride_x, stride_out,
    BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    """Columns [pid1 * BLOCK, +BLOCK) of row pid0."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if LIBDEVICE:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    s = tl.math.div_rn(g, 1.0 + e).to(OUT.dtype.element_ty).to(tl.float32)
    tl.store(OUT + row * stride_out + cols, (s * u).to(OUT.dtype.element_ty), mask=mask)


# triton.jit chose compiled or interpreted when the kernel was defined; libdevice is GPU only.
_LIBDEVICE = isinstance(_silu_and_mul_kernel, triton.runtime.JITFunction)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x[..., :I]) * x[..., I:] for x [..., 2I]; rows may be strided (unit last stride).

    Returns `out` (default: a new contiguous [..., I] tensor of x's dtype).
    """
    if x.shape[-1] % 2:
        raise ValueError(f"last dim {x.shape[-1]} is not gate|up (even)")
    n = x.shape[-1] // 2
    shape = (*x.shape[:-1], n)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    elif out.shape != shape or out.dtype != x.dtype:
        raise ValueError(f"out must be {shape} {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    rows_x = x if x.dim() == 2 else x.reshape(-1, 2 * n)
    rows_out = out if out.dim() == 2 else out.view(-1, n)
    if rows_x.stride(-1) != 1 or rows_out.stride(-1) != 1:
        raise ValueError("silu_and_mul needs a unit last stride")
    if rows_x.shape[0] == 0 or n == 0:
        return out
    grid = (rows_x.shape[0], triton.cdiv(n, BLOCK))
    _silu_and_mul_kernel[grid](
        rows_x, rows_out, n, rows_x.stride(0), rows_out.stride(0),
        BLOCK=BLOCK, LIBDEVICE=_LIBDEVICE, num_warps=4,
    )
    return out
