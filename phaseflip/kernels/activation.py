"""Triton SiLU-and-multiply for the gated MLP: [T, 2I] (gate | up) -> silu(gate) * up, [T, I].

Rounding follows the torch path (`SiluAndMul` in `model/layers.py`, the oracle): `F.silu` on a
half-precision tensor computes `g / (1 + exp(-g))` in float32 and rounds once to the activation
dtype; the multiply by `up` is a dtype multiply (exact float32 product, rounded once). The kernel
does exactly that. On the GPU it uses libdevice's `expf` and an IEEE division (`div_rn`), the
functions torch's CUDA kernel compiles to, not Triton's default `exp` (ex2.approx) and `/`
(div.full), so bf16/fp16 results should be bit-identical; under the interpreter `exp` is NumPy's.

One read of gate and up, one write of the output: the torch path's extra round trip through the
materialised `silu(gate)` is the saving. No host syncs; capturable in a CUDA graph once compiled.

`silu_and_mul_fp8` feeds an FP8 linear (`down`): a program owns a whole row and writes it as
FP8 with its scale (`kernels/fp8_quant.py`'s helpers), bitwise `per_token_quant` of
`silu_and_mul`'s output. The SiLU (libdevice exp, IEEE division) is what costs: at the 8B's
8 192 x 14 336 the earlier form, which recomputed the products in its second pass, was issue
bound (~390 us against 140 us of bytes at 4.2 TB/s; H200). So the products are computed once:
a row of up to WHOLE_ROW_MAX columns stays in registers (one pass); a longer row writes its
16-bit products (the output, or a scratch buffer when the output is not kept) in pass 1 with
its |max| and reads them back (from L2) in pass 2 to quantize. One row whole in registers is
not the answer for the 8B's rows: 16 warps a program, one program an SM, took 507 us.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from phaseflip.kernels.fp8_quant import (
    FP8_MAX,
    MIN_SCALE,
    empty_fp8_rows,
    fp8_quantize,
    fp8_row_scale,
)
from phaseflip.kernels.gemm_rows import empty_rows
from phaseflip.kernels.pdl import (
    chain_launch_options,
    launch_dependents,
    pdl_enabled,
    wait_previous,
)

BLOCK = 1024
ROW_BLOCK = 2048  # columns a step of the two-pass FP8 kernel (rows past WHOLE_ROW_MAX)
WHOLE_ROW_MAX = 4096  # columns the one-pass FP8 kernel holds in registers (4 warps: 32 each)
# Two variants of the two-pass FP8 kernel (`benchmarks/fused_kernels.py --silu-variants`):
# FAST_SILU_FP8: the SiLU with the hardware's approximate exp and division (~2 ulp of float32)
# instead of libdevice's expf and an IEEE division (which made the kernel's earlier form
# issue-bound, see above); the products then differ from `silu_and_mul`'s in the last bf16
# bit now and then (the FP8 row rarely), so the output is no longer bitwise the unfused pair's.
FAST_SILU_FP8 = False
# SCRATCH_SLOTS_FP8 > 0: that many programs loop over the rows, each staging its products in
# its own scratch row, reused row after row, so the scratch stays in L2 instead of being
# written back (235 MB a layer at the 8B's 8 192 x 14 336, of ~820 MB of traffic). Bitwise
# the same rows. On an H100 (2026-12-06) 528 slots (four an SM) took 277 against 326 µs at
# 8 192 x 14 336 and 39.8 against 44.2 at 800 rows (264 slots were slower, 1 056 between);
# FP8 offline over three interleaved pairs 16 288 against 16 282 output tok/s (unchanged).
SCRATCH_SLOTS_FP8 = 528


@triton.jit
def silu_mul_values(g, u, DTYPE: tl.constexpr, LIBDEVICE: tl.constexpr):
    """silu(g) * u from float32 g, u, rounded to DTYPE at both steps as the torch path rounds
    (the skinny GEMM's SiLU prologue computes its x with this too: `kernels/linear.py`)."""
    if LIBDEVICE:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    s = tl.math.div_rn(g, 1.0 + e).to(DTYPE).to(tl.float32)
    return (s * u).to(DTYPE)


@triton.jit
def _silu_mul(X_ROW, OUT, cols, mask, n_cols, LIBDEVICE: tl.constexpr,
              FAST: tl.constexpr = False, STREAM: tl.constexpr = False):
    """silu(gate) * up at `cols` of one row, rounded to OUT's dtype as the torch path rounds
    (FAST: with the approximate exp and division, `FAST_SILU_FP8`; STREAM: gate and up are
    read to be evicted first, so they do not push the scratch rows out of L2)."""
    if STREAM:
        g = tl.load(X_ROW + cols, mask=mask, other=0.0, eviction_policy="evict_first")
        u = tl.load(X_ROW + n_cols + cols, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        g = tl.load(X_ROW + cols, mask=mask, other=0.0)
        u = tl.load(X_ROW + n_cols + cols, mask=mask, other=0.0)
    g, u = g.to(tl.float32), u.to(tl.float32)
    if FAST:
        s = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty).to(tl.float32)
        return (s * u).to(OUT.dtype.element_ty)
    return silu_mul_values(g, u, OUT.dtype.element_ty, LIBDEVICE)


@triton.jit
def _silu_and_mul_kernel(
    X, OUT, n_cols, stride_x, stride_out,
    BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr,
):
    """Columns [pid1 * BLOCK, +BLOCK) of row pid0. PDL: see `kernels/pdl.py`."""
    launch_dependents(PDL)
    wait_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    out = _silu_mul(X + row * stride_x, OUT, cols, mask, n_cols, LIBDEVICE)
    tl.store(OUT + row * stride_out + cols, out, mask=mask)


# n_rows is not specialized (a count of 1 or a multiple of 16 would compile another kernel
# mid-serving)
@triton.jit(do_not_specialize=["n_rows"])
def _silu_and_mul_fp8_kernel(
    X, OUT, Q, SCALE, n_rows, n_cols, stride_x, stride_out,
    BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr, STORE_OUT: tl.constexpr,
    FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr, WHOLE: tl.constexpr,
    PDL: tl.constexpr, FAST: tl.constexpr, SLOTS: tl.constexpr,
):
    """Rows pid0, pid0 + SLOTS, ... (SLOTS 0: row pid0 alone), each whole. WHOLE (BLOCK >=
    n_cols): one block, one pass. Otherwise pass 1 writes the 16-bit products with their
    maximum to OUT's row (SLOTS: the program's own scratch row pid0, reused), pass 2 reads
    them back for the FP8 row. PDL: see `kernels/pdl.py`."""
    launch_dependents(PDL)
    wait_previous(PDL)
    first = tl.program_id(0).to(tl.int64)
    if SLOTS:
        for r in range(first, n_rows, tl.num_programs(0)):
            row = tl.cast(r, tl.int64)
            _silu_fp8_row(X + row * stride_x, OUT + first * stride_out, Q + row * n_cols,
                          SCALE + row, n_cols, BLOCK, LIBDEVICE, STORE_OUT, FP8_MAX_C,
                          MIN_SCALE_C, WHOLE, FAST, True)
            tl.debug_barrier()  # the next row's pass 1 overwrites this scratch row
    else:
        _silu_fp8_row(X + first * stride_x, OUT + first * stride_out, Q + first * n_cols,
                      SCALE + first, n_cols, BLOCK, LIBDEVICE, STORE_OUT, FP8_MAX_C,
                      MIN_SCALE_C, WHOLE, FAST, False)


@triton.jit
def _silu_fp8_row(X_ROW, OUT_ROW, Q_ROW, SCALE_AT, n_cols, BLOCK: tl.constexpr,
                  LIBDEVICE: tl.constexpr, STORE_OUT: tl.constexpr, FP8_MAX_C: tl.constexpr,
                  MIN_SCALE_C: tl.constexpr, WHOLE: tl.constexpr, FAST: tl.constexpr,
                  STREAM: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    if WHOLE:
        mask = offs < n_cols
        out = _silu_mul(X_ROW, OUT_ROW, offs, mask, n_cols, LIBDEVICE, FAST, STREAM)
        if STORE_OUT:
            tl.store(OUT_ROW + offs, out, mask=mask)
        wide = out.to(tl.float32)
        scale = fp8_row_scale(tl.max(tl.abs(wide), 0), FP8_MAX_C, MIN_SCALE_C)
        tl.store(SCALE_AT, scale)
        tl.store(Q_ROW + offs, fp8_quantize(wide, scale, Q_ROW, FP8_MAX_C), mask=mask)
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        for c0 in range(0, n_cols, BLOCK):
            cols = c0 + offs
            mask = cols < n_cols
            out = _silu_mul(X_ROW, OUT_ROW, cols, mask, n_cols, LIBDEVICE, FAST, STREAM)
            tl.store(OUT_ROW + cols, out, mask=mask)
            amax = tl.maximum(amax, tl.abs(out.to(tl.float32)))  # masked columns are 0
        scale = fp8_row_scale(tl.max(amax, 0), FP8_MAX_C, MIN_SCALE_C)
        tl.store(SCALE_AT, scale)
        tl.debug_barrier()  # pass 2 reads what the program's threads wrote in pass 1
        for c0 in range(0, n_cols, BLOCK):
            cols = c0 + offs
            mask = cols < n_cols
            out = tl.load(OUT_ROW + cols, mask=mask, other=0.0)
            q = fp8_quantize(out.to(tl.float32), scale, Q_ROW, FP8_MAX_C)
            tl.store(Q_ROW + cols, q, mask=mask)


# triton.jit chose compiled or interpreted when the kernel was defined; libdevice is GPU only.
USE_LIBDEVICE = isinstance(_silu_and_mul_kernel, triton.runtime.JITFunction)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x[..., :I]) * x[..., I:] for x [..., 2I]; rows may be strided (unit last stride).

    Returns `out` (default: a new contiguous [..., I] tensor of x's dtype).
    """
    if x.shape[-1] % 2:
        raise ValueError(f"last dim {x.shape[-1]} is not gate|up (even)")
    n = x.shape[-1] // 2
    shape = (*x.shape[:-1], n)
    if out is None:  # [T, I] rows padded for the down projection's GEMM (`gemm_rows`)
        out = (empty_rows(*shape, x.dtype, x.device, fp8=False) if len(shape) == 2
               else torch.empty(shape, dtype=x.dtype, device=x.device))
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
        BLOCK=BLOCK, LIBDEVICE=USE_LIBDEVICE, PDL=pdl_enabled(x.device), num_warps=4,
        **chain_launch_options(x.device),
    )
    return out


def silu_and_mul_fp8(x: torch.Tensor, keep_out: bool = False, *, fast: bool | None = None,
                     scratch_slots: int | None = None
                     ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """`silu_and_mul(x)` for x [T, 2I] and its per-token FP8 quantization in one kernel:
    (out [T, I] or None unless `keep_out`, x_q [T, I] float8_e4m3fn, scale [T, 1] float32),
    bitwise `(out, *per_token_quant(out))`. `fast` and `scratch_slots` (default: the module's
    `FAST_SILU_FP8` and `SCRATCH_SLOTS_FP8`) pick the variants; slots apply to rows too long
    for one pass when the output is not kept."""
    if x.dim() != 2 or x.shape[-1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"need [T, 2I] gate|up rows with a unit last stride, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    fast = FAST_SILU_FP8 if fast is None else fast
    slots = SCRATCH_SLOTS_FP8 if scratch_slots is None else scratch_slots
    t, n = x.shape[0], x.shape[1] // 2
    width = triton.next_power_of_2(n)
    whole = width <= WHOLE_ROW_MAX
    slots = min(slots, t) if not (whole or keep_out) else 0
    # two passes stage the products in `out` (a scratch buffer unless kept: a row a program
    # with slots)
    out = None
    if keep_out or not whole:
        out = torch.empty((slots or t, n), dtype=x.dtype, device=x.device)
    q, scale = empty_fp8_rows(t, n, x.device)
    if t == 0 or n == 0:
        return (out if keep_out else None), q, scale
    out_arg = out if out is not None else x  # only its dtype is read when not written
    block = width if whole else ROW_BLOCK
    _silu_and_mul_fp8_kernel[(slots or t,)](
        x, out_arg, q, scale, t, n, x.stride(0), out_arg.stride(0),
        BLOCK=block, LIBDEVICE=USE_LIBDEVICE, STORE_OUT=keep_out, FP8_MAX_C=FP8_MAX,
        MIN_SCALE_C=MIN_SCALE, WHOLE=whole, PDL=pdl_enabled(x.device), FAST=fast,
        # a flag, not the count: a row count below the slots must not compile another build
        SLOTS=slots > 0, num_warps=4 if whole else 8,  # whole rows: 32 columns a thread
        **chain_launch_options(x.device),
    )
    return (out if keep_out else None), q, scale
