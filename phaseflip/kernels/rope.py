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

`rotary_store_kv` is the same rotation fused with the KV-cache store (`KVPool.store`): its
K/V programs write the rotated k and v straight into the pool rows of `out_cache_loc` (cast,
or quantized for an FP8 pool exactly as `KVPool._quantize` does) instead of back into k, so the
decode step has one launch and no separate scatter. The pool rows are bit-identical to rotating
then storing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from phaseflip.kernels.pdl import (
    chain_launch_options,
    launch_dependents,
    pdl_enabled,
    wait_previous,
)

_TILE = 2048  # elements of one (heads x half) tile


@triton.jit
def rotate_values(x1, x2, c, s, EXACT: tl.constexpr):
    """(x1', x2') in x1's dtype from fp32 cos/sin broadcastable to x1, rounded as the torch
    path rounds them (module docstring). EXACT: products and sums through libdevice's
    round-to-nearest calls, which the compiler never contracts into FMAs (for kernels compiled
    with fp fusion on; the rotary kernels turn it off and the interpreter never fuses)."""
    dt = x1.dtype
    c = c.to(dt).to(tl.float32)
    s = s.to(dt).to(tl.float32)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    if EXACT:
        o1 = libdevice.sub_rn(libdevice.mul_rn(x1f, c).to(dt).to(tl.float32),
                              libdevice.mul_rn(x2f, s).to(dt).to(tl.float32))
        o2 = libdevice.add_rn(libdevice.mul_rn(x2f, c).to(dt).to(tl.float32),
                              libdevice.mul_rn(x1f, s).to(dt).to(tl.float32))
    else:
        o1 = (x1f * c).to(dt).to(tl.float32) - (x2f * s).to(dt).to(tl.float32)
        o2 = (x2f * c).to(dt).to(tl.float32) + (x1f * s).to(dt).to(tl.float32)
    return o1.to(dt), o2.to(dt)


@triton.jit
def _rotated(ptr, mask, c, s, half):
    """The rotated halves (x1', x2') of the rows at `ptr`, in their dtype, rounded as the torch
    path rounds them (module docstring); c, s: the fp32 cos/sin row."""
    x1 = tl.load(ptr, mask=mask, other=0.0)
    x2 = tl.load(ptr + half, mask=mask, other=0.0)
    return rotate_values(x1, x2, c[None, :], s[None, :], False)


@triton.jit
def _rotate_heads(
    X, t, blk, num_heads, stride_t, stride_h, c, s, half,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    heads = blk * BLOCK_H + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    mask = (heads < num_heads)[:, None] & (offs < half)[None, :]
    ptr = X + t * stride_t + heads.to(tl.int64)[:, None] * stride_h + offs[None, :]
    o1, o2 = _rotated(ptr, mask, c, s, half)
    tl.store(ptr, o1, mask=mask)
    tl.store(ptr + half, o2, mask=mask)


@triton.jit
def _cos_sin_row(POS, COS, SIN, t, half, cache_len, stride_cache, BLOCK_HALF: tl.constexpr):
    """The fp32 cos/sin row of token t's position; NaN past the tables (never out of bounds)."""
    pos = tl.load(POS + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    ok = (offs < half) & (pos >= 0) & (pos < cache_len)
    c = tl.load(COS + pos * stride_cache + offs, mask=ok, other=float("nan"))
    s = tl.load(SIN + pos * stride_cache + offs, mask=ok, other=float("nan"))
    return c, s


@triton.jit
def _rotary_kernel(
    Q, K, POS, COS, SIN,
    num_q_heads, num_k_heads, q_blocks, half, cache_len, stride_cache,
    stride_qt, stride_qh, stride_kt, stride_kh,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    c, s = _cos_sin_row(POS, COS, SIN, t, half, cache_len, stride_cache, BLOCK_HALF)
    if blk < q_blocks:
        _rotate_heads(Q, t, blk, num_q_heads, stride_qt, stride_qh, c, s, half,
                      BLOCK_HQ, BLOCK_HALF)
    else:
        _rotate_heads(K, t, blk - q_blocks, num_k_heads, stride_kt, stride_kh, c, s, half,
                      BLOCK_HK, BLOCK_HALF)


@triton.jit
def _quantize_store(ptr, x, mask, scale, fp8_max, FP8: tl.constexpr):
    """Writes x into the pool at `ptr`: cast to the pool's dtype, or for an FP8 pool
    `KVPool._quantize`'s ops (fp32 x / its head's `scale`, IEEE-rounded; the clamp to the FP8
    range, NaN kept as torch's clamp keeps it; round to nearest even)."""
    if FP8:
        y = tl.math.div_rn(x.to(tl.float32), scale)
        y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -fp8_max), fp8_max))
        tl.store(ptr, y.to(ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_rows(ptr, x, mask, SCALE, heads, hmask, fp8_max, FP8: tl.constexpr):
    """Writes rows x [heads, channels] into the pool at `ptr` (`_quantize_store`)."""
    scale = 1.0
    if FP8:
        scale = tl.load(SCALE + heads, mask=hmask, other=1.0)[:, None]
    _quantize_store(ptr, x, mask, scale, fp8_max, FP8)


@triton.jit
def rotary_pair_rows(pid_n, N, half, BLOCK_N: tl.constexpr):
    """W rows of tile pid_n of a qkv GEMM whose epilogue rotates (`store_rotary_fold`):
    BLOCK_N / 2 channel pairs (i, i + half) of its heads (head_dim 2 * half), the two channels
    of a pair side by side; past N the last pair repeats (stores masked)."""
    lane = tl.arange(0, BLOCK_N)
    p = tl.minimum(pid_n * (BLOCK_N // 2) + lane // 2, N // 2 - 1)
    return (p // half) * (2 * half) + p % half + (lane % 2) * half


@triton.jit
def store_rotary_fold(x, Y, offs_m, pid_n, M, N, stride_ym, POS, LOC, COS, SIN, K_CACHE,
                      V_CACHE, K_SCALE, V_SCALE, half, num_q_heads, num_kv_heads, cache_len,
                      stride_cache, stride_cs, stride_ch, fp8_max, BLOCK_N: tl.constexpr,
                      FP8: tl.constexpr, EXACT: tl.constexpr):
    """The qkv GEMM's epilogue for a few decode rows: what `rotary_store_kv` does after it.

    x [BLOCK_M, BLOCK_N]: the tile's output in Y's dtype, columns as `rotary_pair_rows` lays
    them out over [q heads | k heads | v heads]. Y receives q rotated and k, v as they are
    (what the qkv output holds after `rotary_store_kv`); rotated k and v go to pool slot
    LOC[m] of each row m, quantized as `_store_rows` quantizes. Bitwise the two kernels."""
    rows = tl.minimum(offs_m, M - 1)
    ok_m = offs_m < M
    p = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    ok_p = p < N // 2
    head = p // half
    i = p % half
    pos = tl.load(POS + rows).to(tl.int64)
    ok_cs = ((pos >= 0) & (pos < cache_len))[:, None] & ok_p[None, :]
    c = tl.load(COS + pos[:, None] * stride_cache + i[None, :], mask=ok_cs, other=float("nan"))
    s = tl.load(SIN + pos[:, None] * stride_cache + i[None, :], mask=ok_cs, other=float("nan"))
    x1, x2 = tl.split(tl.reshape(x, [x.shape[0], BLOCK_N // 2, 2]))
    o1, o2 = rotate_values(x1, x2, c, s, EXACT)
    is_q = (head < num_q_heads)[None, :]
    y = tl.reshape(tl.join(tl.where(is_q, o1, x1), tl.where(is_q, o2, x2)),
                   [x.shape[0], BLOCK_N])
    ok_col = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N) // 2 < N // 2
    cols = rotary_pair_rows(pid_n, N, half, BLOCK_N)  # (clamped past N: those lanes masked)
    tl.store(Y + offs_m[:, None] * stride_ym + cols[None, :], y,
             mask=ok_m[:, None] & ok_col[None, :])

    kv = head - num_q_heads  # k heads 0..KVH-1, then v heads KVH..2 KVH-1
    is_k = (kv >= 0) & (kv < num_kv_heads) & ok_p
    is_v = (kv >= num_kv_heads) & ok_p
    kvh = tl.minimum(tl.maximum(tl.where(is_v, kv - num_kv_heads, kv), 0), num_kv_heads - 1)
    slot = tl.load(LOC + rows).to(tl.int64)
    dst = slot[:, None] * stride_cs + kvh.to(tl.int64)[None, :] * stride_ch + i[None, :]
    k_scale = 1.0
    v_scale = 1.0
    if FP8:
        k_scale = tl.load(K_SCALE + kvh)[None, :]
        v_scale = tl.load(V_SCALE + kvh)[None, :]
    mask_k = ok_m[:, None] & is_k[None, :]
    mask_v = ok_m[:, None] & is_v[None, :]
    _quantize_store(K_CACHE + dst, o1, mask_k, k_scale, fp8_max, FP8)
    _quantize_store(K_CACHE + dst + half, o2, mask_k, k_scale, fp8_max, FP8)
    _quantize_store(V_CACHE + dst, x1, mask_v, v_scale, fp8_max, FP8)
    _quantize_store(V_CACHE + dst + half, x2, mask_v, v_scale, fp8_max, FP8)


@triton.jit
def _rotary_store_kernel(
    Q, K, V, POS, LOC, COS, SIN, K_CACHE, V_CACHE, K_SCALE, V_SCALE,
    num_q_heads, num_kv_heads, q_blocks, half, head_dim, cache_len, stride_cache,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
    fp8_max,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr, PARTIAL: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):
    """q blocks rotate in place as `_rotary_kernel`'s do; a K/V block of token t rotates k
    and writes it, its pass-through channels and v straight into pool slot LOC[t]. PDL: the
    attention after it may launch early, and it may itself have been (`kernels/pdl.py`)."""
    launch_dependents(PDL)
    wait_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    c, s = _cos_sin_row(POS, COS, SIN, t, half, cache_len, stride_cache, BLOCK_HALF)
    if blk < q_blocks:
        _rotate_heads(Q, t, blk, num_q_heads, stride_qt, stride_qh, c, s, half,
                      BLOCK_HQ, BLOCK_HALF)
    else:
        heads = (blk - q_blocks) * BLOCK_HK + tl.arange(0, BLOCK_HK)
        hmask = heads < num_kv_heads
        rows = heads.to(tl.int64)[:, None]
        slot = tl.load(LOC + t).to(tl.int64)
        k_src = K + t * stride_kt + rows * stride_kh
        k_dst = K_CACHE + slot * stride_cs + rows * stride_ch
        offs = tl.arange(0, BLOCK_HALF)[None, :]
        mask = hmask[:, None] & (offs < half)
        o1, o2 = _rotated(k_src + offs, mask, c, s, half)
        _store_rows(k_dst + offs, o1, mask, K_SCALE, heads, hmask, fp8_max, FP8)
        _store_rows(k_dst + half + offs, o2, mask, K_SCALE, heads, hmask, fp8_max, FP8)
        d = tl.arange(0, BLOCK_D)[None, :]
        if PARTIAL:  # channels past rotary_dim: stored as they are
            tail = hmask[:, None] & (d >= 2 * half) & (d < head_dim)
            x = tl.load(k_src + d, mask=tail, other=0.0)
            _store_rows(k_dst + d, x, tail, K_SCALE, heads, hmask, fp8_max, FP8)
        full = hmask[:, None] & (d < head_dim)
        x = tl.load(V + t * stride_vt + rows * stride_vh + d, mask=full, other=0.0)
        v_dst = V_CACHE + slot * stride_cs + rows * stride_ch + d
        _store_rows(v_dst, x, full, V_SCALE, heads, hmask, fp8_max, FP8)


def _check_heads(x: torch.Tensor, name: str, rotary_dim: int) -> None:
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"{name} must be [T, heads, head_dim] with a unit last stride, got "
                         f"shape {tuple(x.shape)} strides {x.stride()}")
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"rotary_dim {rotary_dim} > {name} head_dim {x.shape[-1]}")


def _check_inputs(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                  cos_cache: torch.Tensor, sin_cache: torch.Tensor) -> int:
    """Validates the rotary inputs; returns half the rotary dim."""
    if cos_cache.shape != sin_cache.shape or cos_cache.stride() != sin_cache.stride():
        raise ValueError("cos and sin tables differ in shape or layout")
    if cos_cache.dim() != 2 or cos_cache.stride(-1) != 1:
        raise ValueError(f"cos/sin tables must be [max_pos, half] rows, got {cos_cache.shape}")
    half = cos_cache.shape[1]
    _check_heads(q, "q", 2 * half)
    _check_heads(k, "k", 2 * half)
    if k.shape[0] != q.shape[0] or positions.shape != (q.shape[0],):
        raise ValueError(f"token counts differ: q {q.shape[0]}, k {k.shape[0]}, positions "
                         f"{tuple(positions.shape)}")
    return half


def _head_blocks(half: int, *head_counts: int) -> list[int]:
    """Heads per program for each head count: a tile of up to _TILE half-rows."""
    rows = max(1, _TILE // triton.next_power_of_2(half))
    return [min(triton.next_power_of_2(max(n, 1)), rows) for n in head_counts]


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
    half = _check_inputs(q, k, positions, cos_cache, sin_cache)
    t = q.shape[0]
    if t == 0 or half == 0:
        return q, k
    block_half = triton.next_power_of_2(half)
    block_hq, block_hk = _head_blocks(half, q.shape[1], k.shape[1])
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


def rotary_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotates q [T, H, D] in place and writes rotated k and v [T, KVH, D] into pool rows
    `slots` [T] of `k_cache`/`v_cache` ([slots, KVH, D], one layer of `KVPool`) in one launch;
    returns q. k itself is left unrotated (the pool holds the rotated rows).

    The pool rows equal `apply_rotary_inplace` then `KVPool.store` bit for bit: a float pool
    gets the rotated k cast to its dtype, an FP8 pool (`k_scale`/`v_scale` [KVH] float32, both
    required) the same quantization as `KVPool._quantize`. Sync-free and graph-capturable.
    """
    half = _check_inputs(q, k, positions, cos_cache, sin_cache)
    t, kv_heads, head_dim = k.shape
    if v.shape != k.shape or v.stride(-1) != 1 or slots.shape != (t,):
        raise ValueError(f"v {tuple(v.shape)} / slots {tuple(slots.shape)} do not match k "
                         f"{tuple(k.shape)} (or v has a non-unit last stride)")
    if (k_cache.shape[1:] != k.shape[1:] or v_cache.shape != k_cache.shape
            or v_cache.stride() != k_cache.stride() or k_cache.stride(-1) != 1):
        raise ValueError(f"pool rows {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not "
                         f"hold k {tuple(k.shape)} as [slots, heads, head_dim] rows")
    fp8 = k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if fp8 != (k_scale is not None) or fp8 != (v_scale is not None):
        raise ValueError("an FP8 pool needs k_scale and v_scale (and a float pool neither)")
    if t == 0:
        return q
    block_half = triton.next_power_of_2(max(half, 1))
    block_d = triton.next_power_of_2(head_dim)
    block_hq, _ = _head_blocks(half, q.shape[1], kv_heads)
    block_hk = _head_blocks(block_d, kv_heads)[0]  # v rows are a whole head wide
    q_blocks = triton.cdiv(q.shape[1], block_hq)
    grid = (t, q_blocks + triton.cdiv(kv_heads, block_hk))
    _rotary_store_kernel[grid](
        q, k, v, positions, slots, cos_cache, sin_cache, k_cache, v_cache,
        k_scale if fp8 else k_cache, v_scale if fp8 else v_cache,
        q.shape[1], kv_heads, q_blocks, half, head_dim, cos_cache.shape[0],
        cos_cache.stride(0), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), k_cache.stride(0), k_cache.stride(1),
        float(torch.finfo(k_cache.dtype).max) if fp8 else 0.0,
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half, BLOCK_D=block_d,
        PARTIAL=2 * half < head_dim, FP8=fp8, PDL=pdl_enabled(q.device), num_warps=4,
        enable_fp_fusion=False, **chain_launch_options(q.device),
    )
    return q
