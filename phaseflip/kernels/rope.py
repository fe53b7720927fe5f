"""Triton rotary embedding, in place on q and k, gathering cos/sin by position in the kernel.

The torch path (`RotaryEmbedding.cos_sin` + `apply_rotary`, the oracle) gathers float32 cos/sin
rows, casts them to the activation dtype, and computes `x * cos + rotate_half(x) * sin` in that
dtype: each product is rounded to the dtype, then their sum is. For the channel pair (x1, x2) =
(x[i], x[i + rotary_dim/2]) that is

    x1' = rd(rd(x1 * c) - rd(x2 * s))        x2' = rd(rd(x2 * c) + rd(x1 * s))

with c, s = cos/sin[pos, i] rounded to the dtype. The kernel evaluates exactly these float32
operations (a product of two bf16/fp16 values is exact in float32, so each `rd(a * b)` is the
correctly rounded dtype product torch computes), with fp contraction off so fp32 inputs are not
fused into FMAs either: the results are bit-identical to the torch path for every dtype. (For
bf16 the compiler emits native `mul.rn.bf16` / `add.rn.bf16`: the same values, since rounding
through fp32 first is innocuous for 8- and 11-bit significands.)
Channels past rotary_dim (partial rotary) are not touched.

Grid (T, q head blocks + k head blocks): a program rotates one block of heads of one token, so
q and k of a token share the cos/sin row it loads once. q and k may be strided views into the
fused qkv output. Positions are read on the device; the caller keeps the tables covering them
(`RotaryEmbedding.ensure_capacity`, on the host), so the launch is sync-free and capturable in
a CUDA graph. A position outside the tables yields NaN rows rather than reading out of bounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TILE = 2048  # elements of one (heads x half) tile


@triton.jit
def _rotate_heads(
    X, t, blk, num_heads, stride_t, stride_h, c, s, half,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    heads = blk * BLOCK_H + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    mask = (heads < num_heads)[:, None] & (offs < half)[None, :]
    ptr = X + t * stride_t + heads.to(tl.int64)[:, None] * stride_h + offs[None, :]
    x1 = tl.load(ptr, mask=mask, other=0.0)
    x2 = tl.load(ptr + half, mask=mask, other=0.0)
    dt = X.dtype.element_ty
    c = c.to(dt).to(tl.float32)[None, :]
    s = s.to(dt).to(tl.float32)[None, :]
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    o1 = (x1f * c).to(dt).to(tl.float32) - (x2f * s).to(dt).to(tl.float32)
    o2 = (x2f * c).to(dt).to(tl.float32) + (x1f * s).to(dt).to(tl.float32)
    tl.store(ptr, o1.to(dt), mask=mask)
    tl.store(ptr + half, o2.to(dt), mask=mask)


@triton.jit
def _rotary_kernel(
    Q, K, POS, COS, SIN,
    num_q_heads, num_k_heads, q_blocks, half, cache_len, stride_cache,
    stride_qt, stride_qh, stride_kt, stride_kh,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    pos = tl.load(POS + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    ok = (offs < half) & (pos >= 0) & (pos < cache_len)
    c = tl.load(COS + pos * stride_cache + offs, mask=ok, other=float("nan"))
    s = tl.load(SIN + pos * stride_cache + offs, mask=ok, other=float("nan"))
    if blk < q_blocks:
        _rotate_heads(Q, t, blk, num_q_heads, stride_qt, stride_qh, c, s, half,
                      BLOCK_HQ, BLOCK_HALF)
    else:
        _rotate_heads(K, t, blk - q_blocks, num_k_heads, stride_kt, stride_kh, c, s, half,
                      BLOCK_HK, BLOCK_HALF)


def _check_heads(x: torch.Tensor, name: str, rotary_dim: int) -> None:
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"{name} must be [T, heads, head_dim] with a unit last stride, got "
                         f"shape {tuple(x.shape)} strides {x.stride()}")
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"rotary_dim {rotary_dim} > {name} head_dim {x.shape[-1]}")


def apply_rotary_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, H, D] and k [T, KVH, D] in place at `positions` [T]; returns (q, k).

    `cos_cache`/`sin_cache`: float32 half-width tables [max_pos, rotary_dim // 2] (as built by
    `RotaryEmbedding._build_cache`), covering every position; channels >= rotary_dim pass.
    """
    if cos_cache.shape != sin_cache.shape or cos_cache.stride() != sin_cache.stride():
        raise ValueError("cos and sin tables differ in shape or layout")
    if cos_cache.dim() != 2 or cos_cache.stride(-1) != 1:
        raise ValueError(f"cos/sin tables must be [max_pos, half] rows, got {cos_cache.shape}")
    half = cos_cache.shape[1]
    _check_heads(q, "q", 2 * half)
    _check_heads(k, "k", 2 * half)
    t = q.shape[0]
    if k.shape[0] != t or positions.shape != (t,):
        raise ValueError(f"token counts differ: q {q.shape[0]}, k {k.shape[0]}, positions "
                         f"{tuple(positions.shape)}")
    if t == 0 or half == 0:
        return q, k
    block_half = triton.next_power_of_2(half)
    rows = max(1, _TILE // block_half)
    block_hq = min(triton.next_power_of_2(q.shape[1]), rows)
    block_hk = min(triton.next_power_of_2(max(k.shape[1], 1)), rows)
    q_blocks = triton.cdiv(q.shape[1], block_hq)
    grid = (t, q_blocks + triton.cdiv(k.shape[1], block_hk))
    _rotary_kernel[grid](
        q, k, positions, cos_cache, sin_cache,
        q.shape[1], k.shape[1], q_blocks, half, cos_cache.shape[0], cos_cache.stride(0),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half,
        num_warps=4, enable_fp_fusion=False,
    )
    return q, k
