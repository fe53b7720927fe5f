"""Triton RMSNorm, alone and fused with the residual add, rounding where the torch path rounds.

The torch path (`RMSNorm` in `model/layers.py`, the oracle) computes per row of N channels

    s   = x + residual                         rounded to the activation dtype
    y   = (s_f32 * rsqrt(mean(s_f32²) + eps))  in float32, then rounded to the activation dtype
    out = weight * y                           a dtype multiply: exact fp32 product, one rounding

and the kernel performs the same operations at the same rounding points (the mean as sum times
1/N, as torch's CUDA mean does; `rsqrt` is the same `rsqrt.approx.f32` instruction torch uses).
Only the float32 sum of squares is reduced in another order, so an output can be one ulp off
where y lies within an fp32 ulp or two of a rounding boundary of the activation dtype.

A program normalises BLOCK_R rows of BLOCK_N >= N channels held in registers: each row is read
once and written once. Rows are addressed as `[A, B]` with two strides, so a `[T, H, D]` view of
the fused qkv output (Qwen3's per-head q_norm/k_norm) needs no copy. No host syncs, no
data-dependent allocation: capturable in a CUDA graph once compiled.

`rms_norm_fp8` / `fused_add_rms_norm_fp8` are the same kernel feeding an FP8 linear: from the
rounded output row still in registers they also write its per-token FP8 quantization (x_q, scale),
bitwise `per_token_quant` of the 16-bit output (`kernels/fp8_quant.py`'s helpers: amax of the
rounded row, `div_rn`, clamp, RNE cast), and writing the 16-bit output itself is optional. That
saves the quantization's launch and its two reads of the row.

The fused add also takes x as an FP8 linear's product before its scales (`scales`: per-row
[T, 1] and per-column [N] float32, `model.quant.fp8.ScaledRows`): x is first scaled and
rounded to its dtype, `(x_f32 * row) * col`, exactly as `ScaledRows.materialize` rounds, so
the result is bitwise the unscaled call on the materialized rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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


# num_rows (the batch's token count) is not specialized: a count turning 1 or a multiple of 16
# would otherwise compile another kernel mid-serving, per variant (plain and FP8)
@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    X, R, W, OUT, R_OUT, Q, SCALE, XS_ROW, XS_COL,
    num_rows, inner, n_cols, eps, inv_n,
    sx_a, sx_b, sr_a, sr_b, so_a, so_b, sro_a, sro_b,
    HAS_RESIDUAL: tl.constexpr, STORE_OUT: tl.constexpr, QUANT: tl.constexpr,
    SCALED: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr, Q_VEC: tl.constexpr,
    PDL: tl.constexpr,
):
    """Rows [pid * BLOCK_R, +BLOCK_R): row r is (r // inner, r % inner) of an [A, B, N] view.
    QUANT: also row r of Q [num_rows, N] (FP8) and SCALE [num_rows] from the rounded output.
    SCALED: x is scaled by XS_ROW [num_rows] and XS_COL [N] first (2-D rows only).
    PDL: the GEMM after it may launch early, and it may itself have been (`kernels/pdl.py`)."""
    launch_dependents(PDL)
    wait_previous(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < num_rows)[:, None] & (cols < n_cols)[None, :]
    a = (rows // inner).to(tl.int64)
    b = (rows % inner).to(tl.int64)
    x = tl.load(X + (a * sx_a + b * sx_b)[:, None] + cols[None, :], mask=mask, other=0.0)
    if SCALED:
        rs = tl.load(XS_ROW + rows, mask=rows < num_rows, other=0.0)
        cs = tl.load(XS_COL + cols, mask=cols < n_cols, other=0.0)
        x = ((x.to(tl.float32) * rs[:, None]) * cs[None, :]).to(X.dtype.element_ty)
    if HAS_RESIDUAL:
        r = tl.load(R + (a * sr_a + b * sr_b)[:, None] + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(R_OUT + (a * sro_a + b * sro_b)[:, None] + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) * inv_n + eps)
    y = (xf * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    out = (w[None, :] * y).to(OUT.dtype.element_ty)
    if STORE_OUT:
        tl.store(OUT + (a * so_a + b * so_b)[:, None] + cols[None, :], out, mask=mask)
    if QUANT:  # masked columns hold 0: they do not raise a row's maximum
        of = out.to(tl.float32)
        scale = fp8_row_scale(tl.max(tl.abs(of), axis=1), FP8_MAX_C, MIN_SCALE_C)
        tl.store(SCALE + rows, scale, mask=rows < num_rows)
        q = fp8_quantize(of, scale[:, None], Q, FP8_MAX_C)
        # the FP8 store vectorised as the 16-bit accesses are (Q_VEC a thread): left free it
        # would take 16 a thread, and the compiler gives every access of the row, the sum of
        # squares included, that layout: another summation order than the plain kernel's
        q_cols = tl.max_contiguous(cols, Q_VEC)
        tl.store(Q + rows.to(tl.int64)[:, None] * n_cols + q_cols[None, :], q, mask=mask)


def _rows(t: torch.Tensor, what: str) -> tuple[int, int, int, int]:
    """(A, B, stride_a, stride_b) of `t` seen as [A, B, N] rows; the last dim must be dense."""
    if t.dim() > 3 or t.dim() == 0 or (t.shape[-1] > 1 and t.stride(-1) != 1):
        raise ValueError(f"{what}: need 1-3 dims with a unit last stride, got "
                         f"shape {tuple(t.shape)} strides {t.stride()}")
    if t.dim() == 1:
        return 1, 1, 0, 0
    if t.dim() == 2:
        return t.shape[0], 1, t.stride(0), 0
    return t.shape[0], t.shape[1], t.stride(0), t.stride(1)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    out: torch.Tensor | None, residual_out: torch.Tensor | None,
    quant: tuple[torch.Tensor, torch.Tensor] | None = None, out_dtype: torch.dtype | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """`out` None: not written (then `quant`, the (x_q, scale) to fill, is, and `out_dtype` is
    the dtype the output is rounded to before quantizing). `scales`: x's row and column
    scales, applied before the add."""
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match rows of {n}")
    if scales is not None:
        _check_scales(x, *scales)
    a, inner, sx_a, sx_b = _rows(x, "x")
    so_a = so_b = 0
    if out is not None:
        _, _, so_a, so_b = _rows(out, "out")
    sr_a = sr_b = sro_a = sro_b = 0
    if residual is not None and residual_out is not None:
        _, _, sr_a, sr_b = _rows(residual, "residual")
        _, _, sro_a, sro_b = _rows(residual_out, "residual_out")
    num_rows = a * inner
    if num_rows == 0 or n == 0:
        return
    block_n = triton.next_power_of_2(n)
    block_r = max(1, min(triton.next_power_of_2(num_rows), 2048 // block_n))
    num_warps = min(max(block_r * block_n // 512, 1), 16)
    grid = (triton.cdiv(num_rows, block_r),)
    # a stand-in of the output's dtype where the output is not written (only its type is read)
    out_arg = out if out is not None else x if x.dtype == out_dtype else weight
    q, scale = quant if quant is not None else (out_arg, out_arg)
    xs_row, xs_col = scales if scales is not None else (weight, weight)
    _rms_norm_kernel[grid](
        x, residual if residual is not None else x, weight, out_arg,
        residual_out if residual_out is not None else out_arg, q, scale, xs_row, xs_col,
        num_rows, inner, n, eps, 1.0 / n,
        sx_a, sx_b, sr_a, sr_b, so_a, so_b, sro_a, sro_b,
        HAS_RESIDUAL=residual is not None, STORE_OUT=out is not None, QUANT=quant is not None,
        SCALED=scales is not None,
        BLOCK_R=block_r, BLOCK_N=block_n, FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE,
        Q_VEC=16 // x.element_size(), PDL=pdl_enabled(x.device),
        num_warps=num_warps, enable_fp_fusion=False, **chain_launch_options(x.device),
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`weight * norm(x)` over the last dim of x ([N], [T, N] or a strided [T, H, N] view).

    Returns `out` (default: a new contiguous tensor of x's shape in the dtype torch would
    promote weight * x to).
    """
    if out is None:  # [T, N] rows padded for the GEMM they feed (`gemm_rows`)
        dtype = torch.promote_types(weight.dtype, x.dtype)
        out = (empty_rows(*x.shape, dtype, x.device, fp8=False) if x.dim() == 2
               else torch.empty(x.shape, dtype=dtype, device=x.device))
    elif out.shape != x.shape:
        raise ValueError(f"out shape {tuple(out.shape)} != x shape {tuple(x.shape)}")
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual), computed IN PLACE: `residual` receives x + residual
    and `x` receives the normed rows; returns `(x, residual)`.

    In place is what lets a decoder carry one residual buffer through all its layers; the
    caller must not need the old contents of either tensor. x, residual and weight share one
    dtype (that of the result), and their rows must not overlap in memory. `scales` (row
    [T, 1], column [N] float32): x is an FP8 product before its scales, applied first.
    """
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    if not (x.dtype == residual.dtype == weight.dtype):
        raise ValueError(f"in-place fused add+norm needs one dtype, got x {x.dtype}, residual "
                         f"{residual.dtype}, weight {weight.dtype}")
    _launch(x, residual, weight, eps, x, residual, scales=scales)
    return x, residual


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, keep_out: bool = False
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """`rms_norm(x)` for x [T, N] and its per-token FP8 quantization in one pass:
    (out [T, N] or None unless `keep_out`, x_q [T, N] float8_e4m3fn, scale [T, 1] float32),
    bitwise `(out, *per_token_quant(out))`."""
    _need_rows(x)
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device) if keep_out else None
    quant = empty_fp8_rows(x.shape[0], x.shape[1], x.device)
    _launch(x, None, weight, eps, out, None, quant, out_dtype)
    return (out, *quant)


def fused_add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    keep_out: bool = False, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`fused_add_rms_norm` (in place, same rules, `scales` too) for x [T, N] that also
    quantizes the normed rows per token: (x or None unless `keep_out`, residual, x_q,
    scale), bitwise `per_token_quant` of the normed rows. Without `keep_out` x's contents
    are left stale."""
    _need_rows(x)
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    if not (x.dtype == residual.dtype == weight.dtype):
        raise ValueError(f"in-place fused add+norm needs one dtype, got x {x.dtype}, residual "
                         f"{residual.dtype}, weight {weight.dtype}")
    quant = empty_fp8_rows(x.shape[0], x.shape[1], x.device)
    _launch(x, residual, weight, eps, x if keep_out else None, residual, quant, x.dtype,
            scales)
    return (x if keep_out else None, residual, *quant)


def _need_rows(x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"FP8 output needs [T, N] rows, got shape {tuple(x.shape)}")


def _check_scales(x: torch.Tensor, row: torch.Tensor, col: torch.Tensor) -> None:
    """Scales of an FP8 product: float32, contiguous, [T, 1] (or [T]) and [N] for x [T, N]."""
    t, n = (x.shape[0], x.shape[1]) if x.dim() == 2 else (-1, -1)
    ok = (x.dim() == 2 and row.numel() == t and col.shape == (n,)
          and row.dtype == col.dtype == torch.float32 and row.is_contiguous()
          and col.is_contiguous())
    if not ok:
        raise ValueError(f"scales for x {tuple(x.shape)} must be float32 [T, 1] and [N], got "
                         f"{tuple(row.shape)} {row.dtype} and {tuple(col.shape)} {col.dtype}")
