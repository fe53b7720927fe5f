"""Skinny GEMM for decode linears (M = 1..128 rows): y = x @ W^T (+ b) at weight-streaming speed.

A decode step at small batch reads every linear's whole weight once and does only M FMAs per
weight element, so its figure of merit is weight bytes / time against HBM bandwidth. cuBLAS'
general GEMM tiles are built to reuse operands out of shared memory and reach ~2.5 of 4.2 TB/s
at M = 1 on an H200; this kernel is built only to keep enough weight bytes in flight.

Kernel: a program owns BLOCK_N rows of W (row-major [N, K], K contiguous) and walks its K range
in BLOCK_K chunks with 16-byte loads along K (W loads are marked evict-first: each byte is used
once); x (M x K, a few KB) is re-read from L1/L2 every chunk. The config picks the inner loop:

* "ew" (elementwise, M <= 8): each 16-byte run of W is multiplied by the matching run of every
  x row and summed inside the thread, into one [BLOCK_N, BLOCK_K / 8] fp32 accumulator per x
  row; the cross-thread reduction happens once, after the loop. The K loop thus has no shuffles
  or barriers, and registers hold loaded weights rather than partial sums, so many programs
  (many bytes in flight) fit on an SM;
* "dot" (any M, padded to >= 16): swap-AB `tl.dot`, acc[BLOCK_N, BLOCK_M] += W_tile @ x_tile^T,
  so W is the MMA's wide operand, the tensor cores absorb the FMAs (16x redundant at M = 1,
  still far below their rate) and Triton's software pipeliner keeps `num_stages` W tiles in
  flight with cp.async (it does not pipeline the elementwise loop's loads).

FP8 weights (e4m3, one float32 scale per row of W): the same loops read one byte per weight.
With 16-bit x (W8A16) the weight is converted in registers (to fp32 for "ew", to x's dtype for
"dot": exact, e4m3 fits in bf16) and each row's sum scaled once at the store. With FP8 x
(W8A8: quantized per token, one float32 scale per row of x) the "dot" loop feeds both FP8
tiles to the FP8 MMA as they are, with no conversion in the loop, and the store applies both
scales; on the H200 that streamed 2.7-3.9 TB/s where W8A16's conversions held the 8B
projections to 1.6-2.6 (`model/quant/fp8.py` routes a few rows here, `_scaled_mm` beyond).

Rows past N and x rows past M are clamped to the last valid row (duplicate reads, masked
stores), so no load is masked when K is a multiple of BLOCK_K.

Split-K: when N / BLOCK_N programs are too few to keep every SM streaming (o_proj, down: N =
4096), the K range is cut into `split_k` chunks. Each program stores its fp32 partial tile in a
workspace and bumps the tile's arrival counter; the last to arrive sums the partials in split
order (deterministic), adds the bias, writes the output and re-arms the counter to 0. One
launch, no memset, nothing allocated per call: safe inside CUDA-graph capture.

Configs: a heuristic table (`default_config`) that measured entries in `TUNED` override (filled
by `tune()` on the GPU, or loaded from its JSON). Nothing is tuned or allocated on the call path
and there are no host syncs; `warmup()` compiles every (M bucket, N, K) variant and sizes the
split-K workspace, so that graph capture later launches only compiled kernels.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import triton
import triton.language as tl

from phaseflip.kernels.activation import USE_LIBDEVICE, silu_mul_values
from phaseflip.kernels.linear_configs import (
    KERNEL_MAX_M,
    SkinnyConfig,
    _interpreting,
    pick_config,
    plan_splits,
)
from phaseflip.kernels.linear_fold import NO_FOLD, Fold
from phaseflip.kernels.linear_workspace import SplitKWorkspace, split_arrive, workspace_for
from phaseflip.kernels.pdl import (
    chain_launch_options,
    launch_dependents,
    launch_options,
    prefetch_then_wait,
)
from phaseflip.kernels.rope import rotary_pair_rows, store_rotary_fold

# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _lane_dot(w, x, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    """[BLOCK_N, BLOCK_K // VEC] sums of w * x over runs of VEC contiguous K elements.

    A run is one thread's 16-byte load, so this reduction never leaves the thread: the K loop
    has no shuffles or barriers, and the cross-thread reduction happens once after the loop.
    """
    prod = w * x[None, :]
    return tl.sum(tl.reshape(prod, [BLOCK_N, BLOCK_K // VEC, VEC]), 2)


@triton.jit
def _row_step(w, g, x_ptrs, mask_k, a, ssq, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              VEC: tl.constexpr, EVEN_K: tl.constexpr, NORM: tl.constexpr):
    """One x row's share of a K step: (accumulator, sum of squares) updated. NORM: the row
    is the residual stream before RMSNorm; it is scaled by the norm weight `g` here and by its
    rsqrt(mean square) after the loop (`_rms_scale`), from the squares summed here."""
    if EVEN_K:
        x = tl.load(x_ptrs).to(tl.float32)
    else:
        x = tl.load(x_ptrs, mask=mask_k, other=0.0).to(tl.float32)
    if NORM:
        ssq += x * x
        x = x * g
    return a + _lane_dot(w, x, BLOCK_N, BLOCK_K, VEC), ssq


@triton.jit
def _rms_scale(a, ssq, K, eps, NORM: tl.constexpr):
    """A row's dot products [BLOCK_N], times its RMSNorm factor under NORM."""
    out = tl.sum(a, 1)
    if NORM:
        out = out * tl.math.rsqrt(tl.sum(ssq, 0) / K + eps)
    return out


@triton.jit
def _rows_ew(X, W, G, M, rows_w, k_lo, k_hi, K, eps, stride_xm, stride_wn,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             VEC: tl.constexpr, EVEN_K: tl.constexpr, NORM: tl.constexpr):
    """M <= 8 on the FMA units: returns [BLOCK_M, BLOCK_N] fp32 partial sums over [k_lo, k_hi).

    One [BLOCK_N, BLOCK_K // VEC] accumulator per x row (named, since a loop cannot carry a
    list): each weight tile is loaded once and multiplied by every row of x. NORM serves
    M <= 2 (one more [BLOCK_K] fp32 sum per row: `_row_step`).
    """
    tl.static_assert(BLOCK_M <= 8, "the elementwise loop serves M <= 8")
    tl.static_assert(not NORM or BLOCK_M <= 2, "the RMSNorm prologue serves M <= 2")
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = W + rows_w[:, None].to(tl.int64) * stride_wn + (k_lo + offs_k)[None, :]
    x_ptrs = X + k_lo + offs_k
    g_ptrs = G + k_lo + offs_k
    # Row r of x starts dr[r] elements after row 0; rows past M repeat row M - 1 (not stored).
    dr1 = tl.minimum(1, M - 1) * stride_xm
    dr2 = tl.minimum(2, M - 1) * stride_xm
    dr3 = tl.minimum(3, M - 1) * stride_xm
    dr4 = tl.minimum(4, M - 1) * stride_xm
    dr5 = tl.minimum(5, M - 1) * stride_xm
    dr6 = tl.minimum(6, M - 1) * stride_xm
    dr7 = tl.minimum(7, M - 1) * stride_xm
    a0 = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    a1 = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    a2 = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    a3 = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    a4 = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    a5 = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    a6 = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    a7 = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    s0 = tl.zeros([BLOCK_K], tl.float32)  # sums of squares (the "norm" prologue)
    s1 = tl.zeros([BLOCK_K], tl.float32)
    g = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        mask_k = (k0 + offs_k) < k_hi
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
        else:
            w = tl.load(w_ptrs, mask=mask_k[None, :], other=0.0, eviction_policy="evict_first")
        w = w.to(tl.float32)
        if NORM:
            g = tl.load(g_ptrs, mask=mask_k, other=0.0).to(tl.float32)
        a0, s0 = _row_step(w, g, x_ptrs, mask_k, a0, s0, BLOCK_N, BLOCK_K, VEC, EVEN_K, NORM)
        if BLOCK_M > 1:
            a1, s1 = _row_step(w, g, x_ptrs + dr1, mask_k, a1, s1, BLOCK_N, BLOCK_K, VEC,
                               EVEN_K, NORM)
        if BLOCK_M > 2:
            a2, s1 = _row_step(w, g, x_ptrs + dr2, mask_k, a2, s1, BLOCK_N, BLOCK_K, VEC,
                               EVEN_K, NORM)
            a3, s1 = _row_step(w, g, x_ptrs + dr3, mask_k, a3, s1, BLOCK_N, BLOCK_K, VEC,
                               EVEN_K, NORM)
        if BLOCK_M > 4:
            a4, s1 = _row_step(w, g, x_ptrs + dr4, mask_k, a4, s1, BLOCK_N, BLOCK_K, VEC,
                               EVEN_K, NORM)
            a5, s1 = _row_step(w, g, x_ptrs + dr5, mask_k, a5, s1, BLOCK_N, BLOCK_K, VEC,
                               EVEN_K, NORM)
            a6, s1 = _row_step(w, g, x_ptrs + dr6, mask_k, a6, s1, BLOCK_N, BLOCK_K, VEC,
                               EVEN_K, NORM)
            a7, s1 = _row_step(w, g, x_ptrs + dr7, mask_k, a7, s1, BLOCK_N, BLOCK_K, VEC,
                               EVEN_K, NORM)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
    return _rows_tile(a0, a1, a2, a3, a4, a5, a6, a7, s0, s1, K, eps, BLOCK_M, NORM)


@triton.jit
def _rows_tile(a0, a1, a2, a3, a4, a5, a6, a7, s0, s1, K, eps, BLOCK_M: tl.constexpr,
               NORM: tl.constexpr):
    """`_rows_ew`'s per-row accumulators reduced and stacked into one [BLOCK_M, BLOCK_N]
    tile (rows 0 and 1 times their RMSNorm factor under NORM)."""
    row = tl.arange(0, BLOCK_M)[:, None]
    acc = tl.where(row == 0, _rms_scale(a0, s0, K, eps, NORM)[None, :], 0.0)
    if BLOCK_M > 1:
        acc += tl.where(row == 1, _rms_scale(a1, s1, K, eps, NORM)[None, :], 0.0)
    if BLOCK_M > 2:
        acc += tl.where(row == 2, tl.sum(a2, 1)[None, :], 0.0)
        acc += tl.where(row == 3, tl.sum(a3, 1)[None, :], 0.0)
    if BLOCK_M > 4:
        acc += tl.where(row == 4, tl.sum(a4, 1)[None, :], 0.0)
        acc += tl.where(row == 5, tl.sum(a5, 1)[None, :], 0.0)
        acc += tl.where(row == 6, tl.sum(a6, 1)[None, :], 0.0)
        acc += tl.where(row == 7, tl.sum(a7, 1)[None, :], 0.0)
    return acc


@triton.jit
def _rows_dot(X, W, rows_x, x_live, rows_w, k_lo, k_hi, stride_xm, stride_wn,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr, W8A8: tl.constexpr):
    """Tensor cores, swap-AB (W tile on the MMA's M side): returns [BLOCK_M, BLOCK_N] fp32;
    x's rows outside `x_live` read as zeros (no memory traffic). W8A8: FP8 W and FP8 x go to
    the FP8 MMA as they are (no conversion in the loop)."""
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = W + rows_w[:, None].to(tl.int64) * stride_wn + (k_lo + offs_k)[None, :]
    x_ptrs = X + rows_x[None, :] * stride_xm + (k_lo + offs_k)[:, None]  # x^T: [BLOCK_K, BM]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=x_live[None, :], other=0.0)
        else:
            mask_k = (k0 + offs_k) < k_hi
            w = tl.load(w_ptrs, mask=mask_k[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=mask_k[:, None] & x_live[None, :], other=0.0)
        if W8A8:
            acc = tl.dot(w, x, acc)
        else:
            acc = tl.dot(w.to(x.dtype), x, acc, input_precision=DOT_PREC)  # FP8 W: exact upcast
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return tl.trans(acc)


@triton.jit
def _store_rows(acc, B, S, XS, R, Y, offs_m, offs_n, M, N, stride_rm, stride_ym,
                HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_XSCALE: tl.constexpr,
                HAS_RES: tl.constexpr):
    """y = acc (x's and W's scales, bias) in Y's dtype; HAS_RES: + R, the residual stream,
    added to the rounded product as the fused add-norm kernel adds it (so bitwise the same)."""
    if HAS_XSCALE:  # FP8 x: its rows' (tokens') scales
        acc = acc * tl.load(XS + tl.minimum(offs_m, M - 1))[:, None]
    if HAS_SCALE:  # FP8 W: its rows' scales, once per output element
        acc = acc * tl.load(S + tl.minimum(offs_n, N - 1))[None, :]
    if HAS_BIAS:
        bias = tl.load(B + tl.minimum(offs_n, N - 1)).to(tl.float32)
        acc = acc + bias[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    y = acc.to(Y.dtype.element_ty)
    if HAS_RES:
        res = tl.load(R + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0)
        y = (y.to(tl.float32) + res.to(tl.float32)).to(Y.dtype.element_ty)
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], y, mask=mask)


@triton.jit
def _store_silu(acc, S, Y, offs_m, rows_w, pid_n, M, N, stride_ym, BLOCK_N: tl.constexpr,
                HAS_SCALE: tl.constexpr, LIBDEVICE: tl.constexpr):
    """silu(gate) * up into Y [M, N / 2] from a tile whose columns pair gate row j with up
    row j (`_tile_rows`): each product rounded to Y's dtype as the GEMM's output would be,
    then combined as `kernels/activation.py` combines them (so bitwise the two kernels)."""
    if HAS_SCALE:
        acc = acc * tl.load(S + rows_w)[None, :]
    acc = acc.to(Y.dtype.element_ty).to(tl.float32)
    gate, up = tl.split(tl.reshape(acc, [acc.shape[0], BLOCK_N // 2, 2]))
    out = silu_mul_values(gate, up, Y.dtype.element_ty, LIBDEVICE)
    offs_n = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    mask = (offs_m < M)[:, None] & (offs_n < N // 2)[None, :]
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], out, mask=mask)


@triton.jit
def _tile_rows(pid_n, N, half, BLOCK_N: tl.constexpr, SILU: tl.constexpr,
               ROPE: tl.constexpr):
    """(W rows, their output columns) of tile pid_n. SILU: W is [gate; up] (N = 2I rows) and
    the tile pairs gate row j with up row j, I apart, for BLOCK_N / 2 output columns. ROPE:
    rotary channel pairs side by side (`rope.rotary_pair_rows`; the epilogue stores them)."""
    if SILU:
        j = tl.minimum(pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N) // 2, N // 2 - 1)
        return j + (tl.arange(0, BLOCK_N) % 2) * (N // 2), j
    if ROPE:
        rows = rotary_pair_rows(pid_n, N, half, BLOCK_N)
        return rows, rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return tl.minimum(offs_n, N - 1), offs_n


@triton.jit
def _store_tile(acc, B, S, XS, R, Y, offs_m, offs_n, rows_w, pid_n, M, N, stride_rm,
                stride_ym, RP, RI, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                HAS_SCALE: tl.constexpr, HAS_XSCALE: tl.constexpr, HAS_RES: tl.constexpr,
                SILU: tl.constexpr, LIBDEVICE: tl.constexpr, ROPE: tl.constexpr,
                FP8_KV: tl.constexpr):
    if SILU:
        _store_silu(acc, S, Y, offs_m, rows_w, pid_n, M, N, stride_ym, BLOCK_N, HAS_SCALE,
                    LIBDEVICE)
    elif ROPE:
        if HAS_SCALE:
            acc = acc * tl.load(S + rows_w)[None, :]
        if HAS_BIAS:
            acc = acc + tl.load(B + rows_w).to(tl.float32)[None, :]
        store_rotary_fold(acc.to(Y.dtype.element_ty), Y, offs_m, pid_n, M, N, stride_ym, RP[0],
                          RP[1], RP[2], RP[3], RP[4], RP[5], RP[6], RP[7], RI[0], RI[1], RI[2],
                          RI[3], RI[4], RI[5], RI[6], RI[7], BLOCK_N, FP8_KV, LIBDEVICE)
    else:
        _store_rows(acc, B, S, XS, R, Y, offs_m, offs_n, M, N, stride_rm, stride_ym,
                    HAS_BIAS, HAS_SCALE, HAS_XSCALE, HAS_RES)


@triton.jit(do_not_specialize=["M", "num_splits"])
def _skinny_kernel(
    X, W, B, S, XS, G, R, Y, PARTIALS, COUNTERS, RP, RI,
    M, N, K, eps, stride_xm, stride_wn, stride_rm, stride_ym, k_per_split, num_splits,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    LOOP: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    VEC: tl.constexpr, DOT_PREC: tl.constexpr, HAS_SCALE: tl.constexpr,
    HAS_XSCALE: tl.constexpr, PDL: tl.constexpr, PF_LINE: tl.constexpr,
    NORM: tl.constexpr, SILU: tl.constexpr, HAS_RES: tl.constexpr, LIBDEVICE: tl.constexpr,
    ROPE: tl.constexpr, FP8_KV: tl.constexpr, TRIGGER: tl.constexpr,
):
    """Program (n tile, split): rows [pid_n*BLOCK_N, +BLOCK_N) of y over one K chunk.
    PDL: launched before the previous kernel ends; its first W tile (lines of PF_LINE
    elements) is prefetched into L2 before the wait (`kernels/pdl.py`). The folds
    (`kernels/linear_fold.py`, ew loop only): NORM computes RMSNorm(x) * G on the fly (one
    program sees all of K: no split), SILU writes silu(gate) * up of y = [gate | up], HAS_RES
    adds R to y, ROPE rotates q and writes k and v to the KV pool (`rope.store_rotary_fold`;
    RP: its 8 pointers, RI: its 8 scalars, `Fold.rotary`). TRIGGER: the next kernel may launch
    once every program has left its K loop (`kernels/pdl.py`)."""
    tl.static_assert(not (NORM or SILU or ROPE) or LOOP == "ew", "the folds run in the ew loop")
    tl.static_assert(not NORM or not SPLIT, "the RMSNorm prologue needs all of K")
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows_w, offs_n = _tile_rows(pid_n, N, RI[0], BLOCK_N, SILU, ROPE)
    offs_m = tl.arange(0, BLOCK_M)
    # Rows past M are masked, not re-read: clamped onto row M - 1 they were one L2 line read
    # by every padded row of every CTA (80 rows in a 128-row tile: the 8B gate_up 1.19x slower
    # than 128 rows under one config, docs/kernels.md; masked, as fast as 128).
    rows_x = tl.minimum(offs_m, M - 1)
    x_live = offs_m < M
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if PDL:
        cols = tl.minimum(k_lo + tl.arange(0, BLOCK_K // PF_LINE) * PF_LINE, K - 1)
        prefetch_then_wait(W + rows_w[:, None].to(tl.int64) * stride_wn + cols[None, :], PDL)
    if LOOP == "dot":
        acc = _rows_dot(X, W, rows_x, x_live, rows_w, k_lo, k_hi, stride_xm, stride_wn,
                        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PREC, HAS_XSCALE)
    else:
        acc = _rows_ew(X, W, G, M, rows_w, k_lo, k_hi, K, eps, stride_xm, stride_wn,
                       BLOCK_M, BLOCK_N, BLOCK_K, VEC, EVEN_K, NORM)
    launch_dependents(TRIGGER)

    if SPLIT:
        # Tile pid_n owns PARTIALS[pid_n, 0:num_splits, BLOCK_M, BLOCK_N] and COUNTERS[pid_n],
        # which is 0 between launches (the last arrival re-arms it).
        tile = (PARTIALS + pid_n.to(tl.int64) * num_splits * BLOCK_M * BLOCK_N
                + offs_m[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :])
        if split_arrive(acc, tile, COUNTERS + pid_n, pid_k, num_splits, BLOCK_M * BLOCK_N):
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(0, num_splits):
                total += tl.load(tile + s * BLOCK_M * BLOCK_N, cache_modifier=".cg")
            _store_tile(total, B, S, XS, R, Y, offs_m, offs_n, rows_w, pid_n, M, N, stride_rm,
                        stride_ym, RP, RI, BLOCK_N, HAS_BIAS, HAS_SCALE, HAS_XSCALE, HAS_RES,
                        SILU, LIBDEVICE, ROPE, FP8_KV)
            tl.store(COUNTERS + pid_n, 0)
    else:
        _store_tile(acc, B, S, XS, R, Y, offs_m, offs_n, rows_w, pid_n, M, N, stride_rm,
                    stride_ym, RP, RI, BLOCK_N, HAS_BIAS, HAS_SCALE, HAS_XSCALE, HAS_RES, SILU,
                    LIBDEVICE, ROPE, FP8_KV)


# ----------------------------------------------------------------------------------------------
# Wrapper
# ----------------------------------------------------------------------------------------------


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 must not be rounded to tf32 (the fp32 path is held to 1e-5 of F.linear).
    return "ieee" if dtype == torch.float32 else "tf32"


def _launch(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            y2: torch.Tensor, n: int, cfg: SkinnyConfig, workspace: SplitKWorkspace | None,
            reserve_n: int | None = None, weight_scale: torch.Tensor | None = None,
            x_scale: torch.Tensor | None = None, fold: Fold = NO_FOLD) -> None:
    """Launch on 2-D x [M, K] / y [M, >=n] ([M, >=n/2] under `fold.silu_mul`); `reserve_n`
    sizes the workspace for a larger N than launched (warmup's proxy weights);
    `weight_scale`: an FP8 weight's row scales; `x_scale`: FP8 x's row scales (W8A8)."""
    m, k = x2.shape
    cfg = fold.config(cfg, m, n, k, weight.dtype, x2.device)
    bm = cfg.block_m(m)
    if cfg.loop == "ew" and bm > 8:
        raise ValueError(f"the ew loop serves at most 8 rows (got {m}); use a dot config")
    num_splits, k_per_split = plan_splits(k, cfg.block_k, cfg.split_k)
    # PDL for the tensor-core loop only: on the H200 it took 1.5-2 % off FP8 decode steps of
    # 16-64 rows and added ~1 % to batch 1's elementwise loop (docs/kernels.md)
    pdl = launch_options(x2.device) if cfg.use_dot else {}
    tiles = triton.cdiv(n // 2, cfg.block_n // 2) if fold.silu_mul else triton.cdiv(n, cfg.block_n)
    split = num_splits > 1
    if split:
        ws = workspace or workspace_for(x2.device)
        tiles_reserved = triton.cdiv(reserve_n or n, cfg.block_n)
        partials, counters = ws.reserve(tiles_reserved * num_splits * bm * cfg.block_n,
                                        tiles_reserved)
    else:
        partials, counters = y2, y2  # unused
    _skinny_kernel[(tiles, num_splits)](
        x2, weight, bias if bias is not None else weight,
        weight_scale if weight_scale is not None else y2,
        x_scale if x_scale is not None else y2,
        fold.norm_weight if fold.norm_weight is not None else y2,
        fold.residual if fold.residual is not None else y2, y2, partials, counters,
        *fold.rotary_args(y2),
        m, n, k, fold.eps, x2.stride(0), weight.stride(0),
        fold.residual.stride(0) if fold.residual is not None else 0, y2.stride(0),
        k_per_split, num_splits,
        BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, LOOP=cfg.loop,
        SPLIT=split, HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0,
        VEC=16 // weight.element_size(), DOT_PREC=_dot_precision(x2.dtype),
        HAS_SCALE=weight_scale is not None, HAS_XSCALE=x_scale is not None,
        PDL=bool(pdl), PF_LINE=min(128 // weight.element_size(), cfg.block_k),
        NORM=fold.norm_weight is not None, SILU=fold.silu_mul, HAS_RES=fold.residual is not None,
        LIBDEVICE=USE_LIBDEVICE, ROPE=fold.rotary is not None,
        FP8_KV=fold.rotary is not None and fold.rotary.k_scale is not None,
        TRIGGER=bool(chain_launch_options(x2.device)), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl,
    )


def _check_operands(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None,
                    x_scale: torch.Tensor | None, out_dtype: torch.dtype | None
                    ) -> torch.dtype:
    """The operand rules of `skinny_linear`; returns the output dtype."""
    if x.device.type != "cuda" and not _interpreting():
        raise ValueError("skinny_linear needs CUDA tensors (or TRITON_INTERPRET=1); "
                         "use torch.nn.functional.linear on the CPU")
    n, k = weight.shape
    fp8_w, fp8_x = weight.element_size() == 1, x.element_size() == 1
    if x.shape[-1] != k or (x.dtype != weight.dtype and not fp8_w):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not match weight "
                         f"{tuple(weight.shape)} {weight.dtype}")
    if fp8_w != (weight_scale is not None) or (fp8_w and (
            x.element_size() == 4 or weight_scale.shape != (n,)
            or weight_scale.dtype != torch.float32)):
        raise ValueError("an FP8 weight needs 16-bit or FP8 x and its float32 row scales [N] "
                         "(and only an FP8 weight takes weight_scale)")
    if fp8_x != (x_scale is not None) or (fp8_x and (
            not fp8_w or x_scale.dtype != torch.float32
            or x_scale.numel() != x.numel() // max(k, 1) or not x_scale.is_contiguous())):
        raise ValueError("FP8 x needs an FP8 weight and its contiguous float32 row scales "
                         "(one per row of x; only FP8 x takes x_scale)")
    if weight.stride(1) != 1:
        raise ValueError("weight must be contiguous along K (row-major [N, K])")
    if not fp8_x:
        return x.dtype
    if out_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError("FP8 x needs a float out_dtype (float16, bfloat16 or float32)")
    return out_dtype


def _rows_2d(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [..., K] as [M, K], contiguous along K; M checked against what the kernel serves."""
    x2 = x.reshape(math.prod(x.shape[:-1]), k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m > KERNEL_MAX_M:
        raise ValueError(f"skinny_linear handles at most {KERNEL_MAX_M} rows (got {m}); "
                         f"use torch.nn.functional.linear")
    return x2


def _output_for(out: torch.Tensor | None, lead: torch.Size, n_out: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """The caller's `out`, checked, or a new one [*lead, n_out]."""
    if out is None:
        return torch.empty(*lead, n_out, dtype=dtype, device=device)
    if out.shape != (*lead, n_out) or out.dtype != dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {(*lead, n_out)} of dtype {dtype}, contiguous in N")
    return out


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    weight_scale: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: SkinnyConfig | None = None,
    workspace: SplitKWorkspace | None = None,
    fold: Fold = NO_FOLD,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for few rows: x [..., K], weight [N, K] (K contiguous),
    bias [N]; fp32 accumulation, output in x's dtype (written into `out`, [..., N], when given).
    An FP8 `weight` comes with `weight_scale` (float32 [N]): y = (x @ W^T) * scale (+ b).
    FP8 x (W8A8, per-token quantized) comes with `x_scale` (float32, one per row) and
    `out_dtype` (the model's float dtype): y = (x_q @ W_q^T) * x_scale[:, None] * scale (+ b),
    FP8 MMAs.

    `fold` (a few rows of 16-bit x): an RMSNorm before, SiLU·mul before, a residual add after
    (`Fold`). `config` pins a launch shape (tests, tuning); otherwise the tuned table or the
    heuristic picks one. No host syncs; allocates only `out` when it is omitted (and the
    split-K workspace the first time a shape needs more of it — call `warmup` before graph
    capture).
    """
    dtype = _check_operands(x, weight, weight_scale, x_scale, out_dtype)
    n, k = weight.shape
    if bias is not None and (bias.shape != (n,) or bias.dtype != dtype):
        raise ValueError(f"bias must be [{n}] of dtype {dtype}")
    x2 = _rows_2d(x, k)
    m = x2.shape[0]
    n_out = n // 2 if fold.silu_mul else n
    out = _output_for(out, x.shape[:-1], n_out, dtype, x.device)
    fold.check(x2, weight, bias, out, x_scale is not None)
    if m == 0 or n == 0:
        return out
    y2 = out.view(-1, n_out) if out.dim() != 2 else out
    if k == 0 and fold.active:
        raise ValueError("a fold needs K >= 1")
    if k == 0:  # an empty sum: the bias alone
        y2.zero_()
        if bias is not None:
            y2 += bias
        return out
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    cfg = config or pick_config(m, n, k, weight.dtype, x.device, w8a8=x_scale is not None,
                                fold=fold.tag)
    _launch(x2, weight, bias, y2, n, cfg, workspace, weight_scale=weight_scale,
            x_scale=x_scale, fold=fold.rows(m, n_out))
    return out


# ----------------------------------------------------------------------------------------------
# Warmup and tuning (never on the call path)
# ----------------------------------------------------------------------------------------------

DEFAULT_M_VALUES = (1, 2, 4, 8, 16)


def _proxy_rows(n: int) -> int:
    """A small N with the same Triton specialisation as `n` (== 1, divisible by 16 or not)."""
    if n <= 64:
        return n
    return 64 if n % 16 == 0 else 16 + n % 16


def warmup(shapes: Iterable[tuple[int, int]], dtype: torch.dtype, device: torch.device, *,
           m_values: Sequence[int] = DEFAULT_M_VALUES, bias: bool = False,
           weight_dtype: torch.dtype | None = None, w8a8: bool = False) -> None:
    """Compile (and load) the kernel for every (N, K) in `shapes` x M bucket in `m_values`, and
    size the split-K workspace, so that later calls — in particular inside CUDA-graph capture —
    compile and allocate nothing (`dtype`: x's; `weight_dtype`: the weights' when they
    differ, FP8; `w8a8`: FP8 x as well, `dtype` the output's). Call it after loading/tuning
    configs (`TUNED`): it warms the
    configs `pick_config` returns now (`linear_tune.tune` measures new ones).

    Launches use proxy weights of `_proxy_rows(N)` rows (same compiled variant as the real N),
    so no full-size weight is allocated. Covers 16-byte-aligned operands (any fresh tensor);
    a misaligned view of x would compile a new variant on first use.
    """
    shapes = list(dict.fromkeys(shapes))
    if device.type != "cuda":
        return
    ws = workspace_for(device)
    wdtype = weight_dtype or dtype
    for n, k in shapes:
        rows = _proxy_rows(n)
        w = torch.zeros(rows, k, dtype=wdtype, device=device)
        b = torch.zeros(rows, dtype=dtype, device=device) if bias else None
        scale = torch.ones(rows, device=device) if w.element_size() == 1 else None
        for m in m_values:
            x = torch.zeros(m, k, dtype=w.dtype if w8a8 else dtype, device=device)
            xs = torch.ones(m, device=device) if w8a8 else None
            y = torch.empty(m, rows, dtype=dtype, device=device)
            cfg = pick_config(m, n, k, wdtype, device, w8a8=w8a8)
            _launch(x, w, b, y, rows, cfg, ws, reserve_n=n, weight_scale=scale, x_scale=xs)
    torch.cuda.synchronize(device)
