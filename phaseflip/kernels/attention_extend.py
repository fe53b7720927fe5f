"""Extend (prefill, chunked prefill, mixed batch) attention over the paged KV pool (Triton).

Flash-attention style, as `attention.py`'s docstring describes: a program owns a tile of
BLOCK_M packed rows (query r // group of query head r % group of one KV head) of one
sequence, key blocks below its first query position need no causal mask, and tiles come
longest first from the host (`extend_tiles`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phaseflip.kernels.attention_fp8 import LOG2E, fp8_query, fp8_widen
from phaseflip.kernels.attention_plan import (
    KernelConfig,
    check_layout,
    compute_dtype,
    dot_precision,
    extend_config,
    fp8_dot_mode,
    fp8_scales,
)


@triton.jit
def _extend_block(
    acc, l_i, m_i, q, K, V, KV_INDICES, kv_beg, n0, kv_hi, q_pos, window, kvh,
    stride_kn, stride_kh, stride_vn, stride_vh, qk_scale,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr,
    KV_FP8: tl.constexpr, FP8_DOT: tl.constexpr,
):
    """One BLOCK_N key block of the online softmax; MASK only on diagonal (and window) blocks."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    idx = n0 + offs_n
    k_ptrs = K + kvh * stride_kh + offs_d[None, :]
    v_ptrs = V + kvh * stride_vh + offs_d[None, :]
    if MASK:
        in_range = idx < kv_hi
        slots = tl.load(KV_INDICES + kv_beg + idx, mask=in_range, other=0).to(tl.int64)
        kv_mask = in_range[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_ptrs + slots[:, None] * stride_kn, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs + slots[:, None] * stride_vn, mask=kv_mask, other=0.0)
    else:
        # Full blocks lie inside the context: only a padded head_dim needs a mask.
        slots = tl.load(KV_INDICES + kv_beg + idx).to(tl.int64)
        if HEAD_DIM == BLOCK_D:
            k = tl.load(k_ptrs + slots[:, None] * stride_kn)
            v = tl.load(v_ptrs + slots[:, None] * stride_vn)
        else:
            d_mask = (offs_d < HEAD_DIM)[None, :]
            k = tl.load(k_ptrs + slots[:, None] * stride_kn, mask=d_mask, other=0.0)
            v = tl.load(v_ptrs + slots[:, None] * stride_vn, mask=d_mask, other=0.0)
    if KV_FP8:  # exact widening (fp8_widen); the scales are applied by the caller
        k, v = fp8_widen(k, v, q, FP8_DOT)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    if MASK:
        visible = (idx[None, :] <= q_pos[:, None]) & in_range[None, :]
        if HAS_WINDOW:
            visible = visible & (idx[None, :] > q_pos[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row can see nothing yet (window not reached): keep exp2 away from -inf - -inf.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_ref = m_new
    p = tl.exp2(qk - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def _tile_keys(prefix, r0, num_rows, window, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """The keys a tile of rows [r0, r0 + BLOCK_M) reads: (first, end of the blocks every row
    sees in full, end). Keys [first, full end) are causally visible to every row of the
    tile: those blocks need no causal mask (a sliding window still masks them)."""
    q_lo = prefix + r0 // GROUP
    q_hi = prefix + (tl.minimum(r0 + BLOCK_M, num_rows) - 1) // GROUP
    kv_lo = q_lo * 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(q_lo - window + 1, 0)
    full_end = kv_lo + (q_lo + 1 - kv_lo) // BLOCK_N * BLOCK_N
    return kv_lo, full_end, q_hi + 1


# num_tiles varies with every batch: specializing it (== 1, divisible by 16) would compile a
# new variant mid-serving the first time a batch's tile count lands in another class
@triton.jit(do_not_specialize=["num_tiles"])
def _extend_kernel(
    Q, K, V, QO_INDPTR, KV_INDPTR, KV_INDICES, TILES, OUT, K_SCALE, V_SCALE,
    qk_scale, window, num_tiles,
    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_PREC: tl.constexpr, KV_FP8: tl.constexpr, FP8_DOT: tl.constexpr,
):
    """One tile of BLOCK_M packed (query, head-in-group) rows of one sequence, one KV head."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.load(TILES + tile)
    r0 = tl.load(TILES + num_tiles + tile)
    q_beg = tl.load(QO_INDPTR + b)
    ext = tl.load(QO_INDPTR + b + 1) - q_beg
    kv_beg = tl.load(KV_INDPTR + b)
    seq_len = tl.load(KV_INDPTR + b + 1) - kv_beg
    prefix = seq_len - ext
    num_rows = ext * GROUP

    rows = r0 + tl.arange(0, BLOCK_M)
    mask_m = rows < num_rows
    qi = rows // GROUP
    heads = kvh * GROUP + rows % GROUP
    q_pos = prefix + qi
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        Q + (q_beg + qi).to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh
        + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :], other=0.0,
    )
    if KV_FP8:  # this KV head's K scale folds into the softmax scale
        q, qk_scale = fp8_query(q, qk_scale * tl.load(K_SCALE + kvh), FP8_DOT)
    else:
        q = q.to(K.dtype.element_ty)

    kv_lo, full_end, kv_hi = _tile_keys(prefix, r0, num_rows, window, GROUP, BLOCK_M,
                                        BLOCK_N, HAS_WINDOW)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(kv_lo, full_end, BLOCK_N):
        acc, l_i, m_i = _extend_block(
            acc, l_i, m_i, q, K, V, KV_INDICES, kv_beg, n0, kv_hi, q_pos, window, kvh,
            stride_kn, stride_kh, stride_vn, stride_vh, qk_scale,
            BLOCK_N, HEAD_DIM, BLOCK_D, HAS_WINDOW, HAS_WINDOW, DOT_PREC, KV_FP8, FP8_DOT,
        )
    for n0 in range(full_end, kv_hi, BLOCK_N):
        acc, l_i, m_i = _extend_block(
            acc, l_i, m_i, q, K, V, KV_INDICES, kv_beg, n0, kv_hi, q_pos, window, kvh,
            stride_kn, stride_kh, stride_vn, stride_vh, qk_scale,
            BLOCK_N, HEAD_DIM, BLOCK_D, True, HAS_WINDOW, DOT_PREC, KV_FP8, FP8_DOT,
        )
    # Padding rows past the sequence may have seen no key (l = 0): divide them by 1, not 0.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if KV_FP8:
        out = out * tl.load(V_SCALE + kvh)
    tl.store(
        OUT + (q_beg + qi).to(tl.int64)[:, None] * stride_ot + heads[:, None] * stride_oh
        + offs_d[None, :],
        out.to(OUT.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :],
    )


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    tiles: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    config: KernelConfig | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged context.

    q: [T, H, D], sequence i's queries at rows qo_indptr[i]:qo_indptr[i+1] and positions
    prefix_i .. seq_len_i - 1 (prefix_i = its KV length minus its query count). `tiles` is
    `extend_tiles(...)` for the same group and `config.block_m`, as an int32 [2, n] device
    tensor. Returns out [T, H*D] in q's dtype (written into `out` when given). An FP8 cache
    needs `k_scale` / `v_scale` (float32 [KVH]).
    """
    group, head_dim = check_layout(q, k_cache, v_cache)
    num_tokens, num_heads = q.shape[0], q.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    kv_fp8, k_scale, v_scale = fp8_scales(q, k_cache, k_scale, v_scale)
    dtype = compute_dtype(q.dtype, k_cache.dtype)
    cfg = config or extend_config(dtype, head_dim, q.device, k_cache.dtype)
    fp8_dot = fp8_dot_mode(cfg, kv_fp8, dtype)
    if out is None:
        out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
    num_tiles = tiles.shape[1]
    if num_tiles == 0:
        return out
    grid = (num_tiles, k_cache.shape[1])
    _extend_kernel[grid](
        q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, tiles, out, k_scale, v_scale,
        scale * LOG2E, sliding_window or 0, num_tiles,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), head_dim,
        GROUP=group, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), HAS_WINDOW=sliding_window is not None,
        DOT_PREC=dot_precision(dtype), KV_FP8=kv_fp8, FP8_DOT=fp8_dot,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
