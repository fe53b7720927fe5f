"""Triton attention kernels over the paged KV pool: split-K decode and tiled extend/prefill.

Both kernels read K/V rows of one layer's pool (`[num_slots, kv_heads, head_dim]`) through the
slot list `kv_indices` (each sequence's whole context, prefix then new tokens, laid out back to
back with offsets `kv_indptr`), so pages need not be contiguous. Key position = index into that
slot list, exactly as in `TorchRefAttention`. Softmax is online (running max / sum, base-2
exponentials with the scale folded into log2(e)) with float32 accumulation for every input dtype.

Decode (one query per sequence) is memory-bound: the cost is reading the context's K/V once.
So a program owns one (sequence, KV head) pair and *all* query heads of that KV head's group
(padded to 16 rows for `tl.dot`), loading each K/V row once for the group; and long contexts
are split over several programs (split-K, "flash-decoding") whose partial (max, sum, acc) are
merged by the last of them to finish (a counter per sequence and head block), so a batch of
one still fills the GPU without a second launch. With a single split a program normalises and
writes the output itself.

Extend (prefill, chunked prefill, mixed batches) is flash-attention style: a program owns a tile
of BLOCK_M *packed rows* of one sequence, where row r is query r // group of query head
r % group of one KV head, so K/V tiles are again loaded once per group. (A one-token sequence
would still cost a whole BLOCK_M tile per head for its `group` rows, so in a mixed batch those
go to the decode kernel instead, `mixed_decode_attention`, and only the others are tiled.)
Key blocks entirely below the tile's first query position need no causal mask; only the blocks
on the diagonal are masked. Tiles are listed on the host (from the host-side `extend_lens`)
longest first, so the grid has no dead programs and the heavy diagonal tiles start early.

Everything the kernels need from the batch is either already on the device (`kv_indptr`,
`kv_indices`) or derived from host lists once per batch (`qo_indptr`, the tile list, the split
plan): no host<->device synchronisation on the per-layer path. Launch shapes and that planning
live in `attention_plan.py`; its public names are re-exported here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phaseflip.kernels.attention_extend import extend_attention
from phaseflip.kernels.attention_fp8 import LOG2E, fp8_query, fp8_widen
from phaseflip.kernels.attention_plan import (
    FP8_DECODE_DOT,
    FP8_DOT_MODES,
    FP8_EXTEND_DOT,
    MAX_SPLITS,
    MIN_CHUNK,
    DecodePlan,
    KernelConfig,
    check_layout,
    compute_dtype,
    decode_config,
    dot_precision,
    extend_config,
    extend_tiles,
    fp8_dot_mode,
    fp8_scales,
    num_sms,
    orders_decode,
    plan_decode,
)
from phaseflip.kernels.pdl import chain_launch_options, launch_dependents, wait_previous

# the planning names callers reach through this module (`kernels.decode_config`, ...)
__all__ = [
    "FP8_DECODE_DOT", "FP8_DOT_MODES", "FP8_EXTEND_DOT", "LOG2E", "MAX_SPLITS", "MIN_CHUNK",
    "DecodePlan", "KernelConfig",
    "compute_dtype", "decode_attention", "decode_config", "decode_order", "decode_workspace",
    "extend_attention", "extend_config", "extend_tiles", "mixed_decode_attention", "num_sms",
    "orders_decode", "plan_decode",
]


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _split_chunks(seq_len, window, min_chunk, num_splits,
                  HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """(first key, chunk, splits holding keys) of a sequence: split s attends keys
    [first + s * chunk, +chunk). The chunk is cut per sequence from its own length, so one
    launch shape (grid and workspace fixed by the host plan) serves any mix of lengths — which
    a CUDA graph needs; the splits past the last key (at least one split always runs) exit at
    once and the merge counts only the others."""
    start = seq_len * 0
    if HAS_WINDOW:
        start = tl.maximum(seq_len - window, 0)
    per_split = (seq_len - start + num_splits - 1) // num_splits
    chunk = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    chunk = tl.maximum(chunk, min_chunk)
    return start, chunk, tl.maximum((seq_len - start + chunk - 1) // chunk, 1)


@triton.jit
def _decode_row(pid, ORDER, QO, HAS_ORDER: tl.constexpr, HAS_QO: tl.constexpr):
    """(sequence, token row) of a decode program: the pid-th sequence of ORDER (or the pid-th),
    whose query and output sit at row QO[b] (or row b)."""
    b = pid
    if HAS_ORDER:
        b = tl.load(ORDER + pid)
    t = b.to(tl.int64)
    if HAS_QO:
        t = tl.load(QO + b).to(tl.int64)
    return b, t


@triton.jit(do_not_specialize=["num_splits"])
def _decode_split_kernel(
    Q, K, V, KV_INDPTR, KV_INDICES, ORDER, QO, OUT, MID_O, MID_M, MID_L, LOCKS, K_SCALE, V_SCALE,
    qk_scale, window, min_chunk, num_splits,
    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr, DIRECT: tl.constexpr, DOT_PREC: tl.constexpr,
    KV_FP8: tl.constexpr, FP8_DOT: tl.constexpr, HAS_ORDER: tl.constexpr,
    HAS_QO: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):
    """One (KV head, head block, sequence, split): attend the group's queries over one chunk.

    The KV head varies fastest in launch order, so a sequence's heads run side by side and
    read the same pages' rows together; with ORDER the sequences launch longest first (the
    backend sorts them), so the long ones do not start last and set the grid's tail. With QO
    (a mixed batch's one-token sequences, ORDER listing them) sequence b's query and output
    are token row QO[b] rather than row b. PDL: every program waits for the kernel before
    (rotary + KV store) first and lets the next one launch when done (`kernels/pdl.py`)."""
    wait_previous(PDL)
    kvh = tl.program_id(0) // HEAD_BLOCKS
    hblk = tl.program_id(0) % HEAD_BLOCKS
    b, t = _decode_row(tl.program_id(1), ORDER, QO, HAS_ORDER, HAS_QO)
    split = tl.program_id(2)
    num_heads = tl.num_programs(0) // HEAD_BLOCKS * GROUP

    offs_g = hblk * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    kv_beg = tl.load(KV_INDPTR + b)
    seq_len = tl.load(KV_INDPTR + b + 1) - kv_beg
    start, chunk, active = _split_chunks(seq_len, window, min_chunk, num_splits, HAS_WINDOW,
                                         BLOCK_N)
    if split < active:
        lo = start + split * chunk
        _decode_split(Q, K, V, KV_INDICES, OUT, MID_O, MID_M, MID_L, LOCKS, K_SCALE, V_SCALE,
                      qk_scale, kv_beg, lo, tl.minimum(lo + chunk, seq_len), b, t, kvh, heads,
                      mask_h, num_heads, split, num_splits, active, stride_qt, stride_qh,
                      stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh,
                      BLOCK_H, BLOCK_N, HEAD_DIM, BLOCK_D, DIRECT, DOT_PREC, KV_FP8, FP8_DOT,
                      BLOCK_S)
    launch_dependents(PDL)


@triton.jit
def _decode_split(Q, K, V, KV_INDICES, OUT, MID_O, MID_M, MID_L, LOCKS, K_SCALE, V_SCALE,
                  qk_scale, kv_beg, lo, hi, b, t, kvh, heads, mask_h, num_heads, split,
                  num_splits, active, stride_qt, stride_qh, stride_kn, stride_kh, stride_vn,
                  stride_vh, stride_ot, stride_oh, BLOCK_H: tl.constexpr,
                  BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  DIRECT: tl.constexpr, DOT_PREC: tl.constexpr, KV_FP8: tl.constexpr,
                  FP8_DOT: tl.constexpr, BLOCK_S: tl.constexpr):
    """One split holding keys [lo, hi): its partial, or the output when unsplit."""
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        Q + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :], other=0.0,
    )
    if KV_FP8:  # this KV head's K scale folds into the softmax scale
        q, qk_scale = fp8_query(q, qk_scale * tl.load(K_SCALE + kvh), FP8_DOT)
    else:
        q = q.to(K.dtype.element_ty)
    acc, l_i, m_i = _decode_chunk(
        q, K, V, KV_INDICES, kv_beg, lo, hi, kvh, qk_scale, stride_kn, stride_kh, stride_vn,
        stride_vh, BLOCK_H, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PREC, KV_FP8, FP8_DOT)
    if KV_FP8:  # the V scale of this KV head: out = sum p * (v * s) / l = (sum p * v) * s / l
        acc = acc * tl.load(V_SCALE + kvh)

    if DIRECT:
        out = acc / l_i[:, None]
        tl.store(
            OUT + t * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(OUT.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :],
        )
    else:
        _store_split(OUT, MID_O, MID_M, MID_L, LOCKS, acc, l_i, m_i, b, t, heads, mask_h,
                     num_heads, split, num_splits, active, stride_ot, stride_oh, HEAD_DIM,
                     BLOCK_H, BLOCK_D, BLOCK_S)


@triton.jit
def _decode_chunk(q, K, V, KV_INDICES, kv_beg, lo, hi, kvh, qk_scale, stride_kn, stride_kh,
                  stride_vn, stride_vh, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr,
                  KV_FP8: tl.constexpr, FP8_DOT: tl.constexpr):
    """(acc, l, m) of the group's queries over keys [lo, hi): online softmax, unnormalised."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        idx = n0 + offs_n
        mask_n = idx < hi
        slots = tl.load(KV_INDICES + kv_beg + idx, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K + slots[:, None] * stride_kn + kvh * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(V + slots[:, None] * stride_vn + kvh * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        if KV_FP8:
            k, v = fp8_widen(k, v, q, FP8_DOT)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _store_split(OUT, MID_O, MID_M, MID_L, LOCKS, acc, l_i, m_i, b, t, heads, mask_h,
                 num_heads, split, num_splits, active, stride_ot, stride_oh,
                 HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_S: tl.constexpr):
    """Stores one split's partial at [b, head, split] (an empty split: (-inf, 0, 0), which the
    merge weighs by exp2(-inf) = 0); the last of the `active` splits of the (sequence, head
    block) to finish merges them. The ordering is CUTLASS's semaphore: every thread's stores, a CTA
    barrier, then one acquire-release atomic (cumulative over the barrier); the merge reads
    the others' partials from L2."""
    offs_d = tl.arange(0, BLOCK_D)
    row = (b * num_heads + heads) * num_splits + split
    tl.store(MID_M + row, m_i, mask=mask_h)
    tl.store(MID_L + row, l_i, mask=mask_h)
    tl.store(MID_O + row[:, None] * HEAD_DIM + offs_d[None, :], acc,
             mask=mask_h[:, None] & (offs_d < HEAD_DIM)[None, :])
    tl.debug_barrier()
    lock = LOCKS + b * tl.num_programs(0) + tl.program_id(0)
    if tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu") == active - 1:
        tl.atomic_xchg(lock, 0, sem="relaxed", scope="gpu")  # zero for the next launch
        _merge_splits(OUT, MID_O, MID_M, MID_L, b, t, heads, mask_h, num_heads, num_splits,
                      active, stride_ot, stride_oh, HEAD_DIM, BLOCK_H, BLOCK_D, BLOCK_S)


@triton.jit
def _merge_splits(OUT, MID_O, MID_M, MID_L, b, t, heads, mask_h, num_heads, num_splits,
                  active, stride_ot, stride_oh, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """out = sum_s acc_s * w_s / sum_s l_s * w_s with w_s = exp2(m_s - max m) for the group's
    heads of sequence b (written at token row t), over its first `active` splits."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    base = (b * num_heads + heads) * num_splits
    stats = base[:, None] + offs_s[None, :]
    mask_hs = mask_h[:, None] & (offs_s < active)[None, :]
    m = tl.load(MID_M + stats, mask=mask_hs, other=float("-inf"), cache_modifier=".cg")
    l_s = tl.load(MID_L + stats, mask=mask_hs, other=0.0, cache_modifier=".cg")
    # finite for every real head (split 0 holds the first key); padded heads are not stored
    m_max = tl.where(mask_h, tl.max(m, 1), 0.0)
    denom = tl.sum(l_s * tl.exp2(m - m_max[:, None]), 1)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    mask_o = mask_h[:, None] & mask_d[None, :]
    for s in range(0, active):
        m_one = tl.load(MID_M + base + s, mask=mask_h, other=0.0, cache_modifier=".cg")
        o_one = tl.load(MID_O + (base + s)[:, None] * HEAD_DIM + offs_d[None, :], mask=mask_o,
                        other=0.0, cache_modifier=".cg")
        acc += o_one * tl.exp2(m_one - m_max)[:, None]
    out = acc / tl.where(mask_h, denom, 1.0)[:, None]
    tl.store(OUT + t * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(OUT.dtype.element_ty), mask=mask_o)


# ----------------------------------------------------------------------------------------------
# Wrappers
# ----------------------------------------------------------------------------------------------


def decode_workspace(batch_size: int, num_heads: int, head_dim: int, plan: DecodePlan,
                     device: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A split decode's float32 partials (acc [B,H,S,D], max [B,H,S], sum [B,H,S]) and its
    int32 split counters ([B*H], zero; each launch leaves them zero again)."""
    s = plan.num_splits
    return (
        torch.empty(batch_size, num_heads, s, head_dim, dtype=torch.float32, device=device),
        torch.empty(batch_size, num_heads, s, dtype=torch.float32, device=device),
        torch.empty(batch_size, num_heads, s, dtype=torch.float32, device=device),
        torch.zeros(batch_size * num_heads, dtype=torch.int32, device=device),
    )


def decode_order(kv_indptr: torch.Tensor) -> torch.Tensor:
    """The sequences of a decode batch longest first (int64 [B], on kv_indptr's device): a
    device sort, so a CUDA graph re-sorts at every replay. Ties keep no particular order;
    any permutation gives the same outputs, each row's program writes only its own."""
    return torch.argsort(kv_indptr[1:] - kv_indptr[:-1], descending=True)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
    plan: DecodePlan,
    *,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    workspace: tuple[torch.Tensor, ...] | None = None,
    config: KernelConfig | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence (q row b = sequence b) over its paged context.

    q: [B, H, D]; caches [slots, KVH, D]; kv_indptr [B+1] / kv_indices (device, any int dtype).
    An FP8 cache needs `k_scale` / `v_scale` (float32 [KVH], `KVPool.scales`). `order` (device
    ints [B], a permutation of the rows, `decode_order`) is the order sequences launch in.
    `plan` comes from `plan_decode` with the same `config.block_n`. Returns out [B, H*D] in q's
    dtype (written into `out` when given). `workspace` (from `decode_workspace`) may be reused
    across calls of one batch; it is allocated here when omitted and the plan splits.
    """
    batch_size = q.shape[0]
    if order is not None and order.shape != (batch_size,):
        raise ValueError(f"order must be [{batch_size}], got {tuple(order.shape)}")
    return _decode(q, k_cache, v_cache, kv_indptr, kv_indices, scale, plan, order, None,
                   batch_size, sliding_window, out, workspace, config, k_scale, v_scale)


def mixed_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    seqs: torch.Tensor,
    scale: float,
    plan: DecodePlan,
    out: torch.Tensor,
    *,
    sliding_window: int | None = None,
    workspace: tuple[torch.Tensor, ...] | None = None,
    config: KernelConfig | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decode kernel for the one-token sequences `seqs` (device ints, launch order) of a
    mixed batch: q [T, H, D] token rows, sequence b's query at row qo_indptr[b]; writes those
    rows of `out` [T, H*D] and no other. The extend kernel would give each of them a whole
    BLOCK_M tile of 128 rows per KV head for its `group` rows (`plan_decode` for len(seqs))."""
    num_seqs = kv_indptr.numel() - 1
    return _decode(q, k_cache, v_cache, kv_indptr, kv_indices, scale, plan, seqs, qo_indptr,
                   num_seqs, sliding_window, out, workspace, config, k_scale, v_scale)


# Splits one merge reads at once (the plan's split cap): one build for every split count, so a
# plan that splits differently never compiles another kernel mid-serving
MERGE_SPLITS = 64


def _decode(q, k_cache, v_cache, kv_indptr, kv_indices, scale: float, plan: DecodePlan,
            order: torch.Tensor | None, qo: torch.Tensor | None, num_seqs: int,
            sliding_window: int | None, out: torch.Tensor | None,
            workspace: tuple[torch.Tensor, ...] | None,
            config: KernelConfig | None, k_scale: torch.Tensor | None,
            v_scale: torch.Tensor | None) -> torch.Tensor:
    """Launches the split kernel over the sequences `order` lists (all `num_seqs` when
    None); partials and split counters are indexed by sequence."""
    group, head_dim = check_layout(q, k_cache, v_cache)
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    kv_fp8, k_scale, v_scale = fp8_scales(q, k_cache, k_scale, v_scale)
    dtype = compute_dtype(q.dtype, k_cache.dtype)
    cfg = config or decode_config(dtype, head_dim, group, q.device, k_cache.dtype)
    fp8_dot = fp8_dot_mode(cfg, kv_fp8, dtype)
    if out is None:
        out = torch.empty(q.shape[0], num_heads * head_dim, dtype=q.dtype, device=q.device)
    programs = num_seqs if order is None else order.numel()
    if programs == 0:
        return out
    head_blocks = triton.cdiv(group, cfg.block_m)
    # a mixed batch's decodes always go through the partials and the merge: one build
    # whatever the plan, which the launch warm-up's one mixed step compiles
    direct = plan.num_splits == 1 and qo is None
    if direct:
        mid_o = mid_m = mid_l = locks = out  # unused
    else:
        mid_o, mid_m, mid_l, locks = workspace or decode_workspace(
            num_seqs, num_heads, head_dim, plan, q.device)
    block_d = triton.next_power_of_2(head_dim)
    order_arg = kv_indptr if order is None else order
    qo_arg = kv_indptr if qo is None else qo
    grid = (num_kv_heads * head_blocks, programs, plan.num_splits)
    pdl = chain_launch_options(q.device)
    _decode_split_kernel[grid](
        q, k_cache, v_cache, kv_indptr, kv_indices, order_arg, qo_arg,
        out, mid_o, mid_m, mid_l, locks, k_scale, v_scale,
        scale * LOG2E, sliding_window or 0, plan.min_chunk, plan.num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), head_dim,
        GROUP=group, HEAD_BLOCKS=head_blocks, BLOCK_H=cfg.block_m, BLOCK_N=cfg.block_n,
        HEAD_DIM=head_dim, BLOCK_D=block_d, HAS_WINDOW=sliding_window is not None,
        DIRECT=direct, DOT_PREC=dot_precision(dtype), KV_FP8=kv_fp8, FP8_DOT=fp8_dot,
        HAS_ORDER=order is not None, HAS_QO=qo is not None,
        BLOCK_S=max(MERGE_SPLITS, triton.next_power_of_2(plan.num_splits)),
        PDL=bool(pdl), num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl,
    )
    return out
