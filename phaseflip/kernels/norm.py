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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    X, R, W, OUT, R_OUT,
    num_rows, inner, n_cols, eps, inv_n,
    sx_a, sx_b, sr_a, sr_b, so_a, so_b, sro_a, sro_b,
    HAS_RESIDUAL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Rows [pid * BLOCK_R, +BLOCK_R): row r is (r // inner, r % inner) of an [A, B, N] view."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < num_rows)[:, None] & (cols < n_cols)[None, :]
    a = (rows // inner).to(tl.int64)
    b = (rows % inner).to(tl.int64)
    x = tl.load(X + (a * sx_a + b * sx_b)[:, None] + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + (a * sr_a + b * sr_b)[:, None] + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(R_OUT + (a * sro_a + b * sro_b)[:, None] + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) * inv_n + eps)
    y = (xf * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    out = (w[None, :] * y).to(OUT.dtype.element_ty)
    tl.store(OUT + (a * so_a + b * so_b)[:, None] + cols[None, :], out, mask=mask)


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
    out: torch.Tensor, residual_out: torch.Tensor | None,
) -> None:
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match rows of {n}")
    a, inner, sx_a, sx_b = _rows(x, "x")
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
    _rms_norm_kernel[grid](
        x, residual if residual is not None else x, weight, out,
        residual_out if residual_out is not None else out,
        num_rows, inner, n, eps, 1.0 / n,
        sx_a, sx_b, sr_a, sr_b, so_a, so_b, sro_a, sro_b,
        HAS_RESIDUAL=residual is not None, BLOCK_R=block_r, BLOCK_N=block_n,
        num_warps=num_warps, enable_fp_fusion=False,
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`weight * norm(x)` over the last dim of x ([N], [T, N] or a strided [T, H, N] view).

    Returns `out` (default: a new contiguous tensor of x's shape in the dtype torch would
    promote weight * x to).
    """
    if out is None:
        out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype),
                          device=x.device)
    elif out.shape != x.shape:
        raise ValueError(f"out shape {tuple(out.shape)} != x shape {tuple(x.shape)}")
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual), computed IN PLACE: `residual` receives x + residual
    and `x` receives the normed rows; returns `(x, residual)`.

    In place is what lets a decoder carry one residual buffer through all its layers; the
    caller must not need the old contents of either tensor. x, residual and weight share one
    dtype (that of the result), and their rows must not overlap in memory.
    """
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    if not (x.dtype == residual.dtype == weight.dtype):
        raise ValueError(f"in-place fused add+norm needs one dtype, got x {x.dtype}, residual "
                         f"{residual.dtype}, weight {weight.dtype}")
    _launch(x, residual, weight, eps, x, residual)
    return x, residual
