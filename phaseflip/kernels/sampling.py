"""Fused token choice for a [B, V] logits matrix: greedy argmax or the exponential race.

Why: the torch path of the sampler (`sampling/sampler.py`) makes ~10 full passes over the
logits a step (a noise tensor, the row max, the tempered copy, log, subtraction, argmax, ...);
at 1000 rows of a 128k vocabulary each pass moves ~512 MB. Here each logit is read once.

Row r draws token argmax_v (l[r, v] - ref[r]) * inv_temp[r] - ln E[r, v], E ~ Exp(1): the
exponential race (Gumbel-max), which samples from softmax(l / T). It is computed in base 2, the
same argmax: (l - ref) * inv_temp * log2(e) - log2(t), t = E / ln 2 = -log2(u), with the GPU's
lg2.approx (libdevice's log made the kernel compute bound: 360 against 200 us at 1000 x 128k
float32 on an H200, whose memory floor, the greedy rows' pass, is ~130 us). u comes from
Philox (`tl.randint4x`, 10 rounds; 7 would save ~30 us) keyed by the row's 64-bit seed, with
counter and lane fixed by the column alone (column c: counter (c // 1024) * 256 + c % 256,
lane (c // 256) % 4), so a row's draw depends on its seed and logits only: not on the batch,
its row position, or the chunking of the launch. u = (23 random bits + 0.5) / 2**23 lies in
[2**-24, 1 - 2**-24], so E is never 0 or inf (t is clamped at 1e-30 too, as the torch path
clamps its draws, for safety).

inv_temp[r] == 0 marks a greedy row: the first maximal index (ties to the lowest id), as
`sampler.greedy`, with no random numbers drawn. -inf logits are never chosen unless the whole
row is -inf (then index 0, as argmax). NaN logits are never chosen (torch's argmax would
choose the first NaN); a row of NaN (and -inf) gives 0.

Launch: programs over (row, chunk of `chunk_size` columns); each reduces its chunk to (best value,
lowest index among the best) in a [B, chunks] partial buffer, and `_race_reduce_kernel`
picks each row's winner (lowest index on ties). No host syncs; only the small partial
buffers and the output are allocated.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

RNG_SUB = 256  # columns per Philox lane: part of the stream's definition (see above)
RNG_GROUP = 4 * RNG_SUB  # columns of one `randint4x` call; a chunk is a multiple of it
MAX_CHUNK = 8192
TARGET_PROGRAMS = 2048  # chunks shrink (down to RNG_GROUP) until the grid has about this many
_INT32_MAX = 2**31 - 1


@triton.jit
def _log2(x, FAST: tl.constexpr):
    """log2 of positive normal floats: the GPU's lg2.approx (abs error ~2**-22; libdevice's
    log took the race from 200 to 360 us at 1000 x 128k) or, interpreted, NumPy's."""
    if FAST:
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)
    return tl.log2(x)


@triton.jit
def _lane(x_row, cols, n_cols, bits, inv2, ref, best_v, best_i,
          RANDOM: tl.constexpr, FAST: tl.constexpr):
    """Folds columns `cols` of one row into the running (best value, its column) per slot;
    strict > keeps the lowest column of a slot on ties (columns grow along a slot)."""
    x = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
    if RANDOM:
        u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        t = tl.maximum(-_log2(u, FAST), 1e-30)  # E / ln 2 (clamped as the torch path's)
        x = (x - ref) * inv2 - _log2(t, FAST)
    better = x > best_v
    return tl.where(better, x, best_v), tl.where(better, cols, best_i)


@triton.jit(do_not_specialize=["n_chunks", "chunk_cols"])
def _race_partial_kernel(
    X, INV, SEEDS, REF, PART_V, PART_I, n_cols, stride_x, n_chunks, chunk_cols,
    SUB: tl.constexpr, HAS_REF: tl.constexpr, FAST: tl.constexpr,
):
    """Chunk pid1 of row pid0: (best value, lowest best column) into the partial buffers.
    The chunk is a runtime value: one compile serves every batch size."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    x_row = X + row * stride_x
    inv = tl.load(INV + row)
    c0 = tl.multiple_of(chunk * chunk_cols, 4 * SUB)
    end = tl.minimum(c0 + chunk_cols, n_cols)
    offs = tl.arange(0, SUB)
    best_v = tl.full([SUB], float("-inf"), tl.float32)
    best_i = c0 + offs  # an all -inf chunk reports its first column
    if inv > 0:
        inv2 = inv * 1.4426950408889634  # log2(e): the race in base 2, the same argmax
        seed = tl.load(SEEDS + row)
        ref = 0.0
        if HAS_REF:
            ref = tl.load(REF + row)
        for g in range(c0, end, 4 * SUB):
            r0, r1, r2, r3 = tl.randint4x(seed, g // 4 + offs)
            best_v, best_i = _lane(x_row, g + offs, n_cols, r0, inv2, ref, best_v, best_i,
                                   True, FAST)
            best_v, best_i = _lane(x_row, g + SUB + offs, n_cols, r1, inv2, ref, best_v,
                                   best_i, True, FAST)
            best_v, best_i = _lane(x_row, g + 2 * SUB + offs, n_cols, r2, inv2, ref, best_v,
                                   best_i, True, FAST)
            best_v, best_i = _lane(x_row, g + 3 * SUB + offs, n_cols, r3, inv2, ref, best_v,
                                   best_i, True, FAST)
    else:
        for g in range(c0, end, SUB):
            best_v, best_i = _lane(x_row, g + offs, n_cols, 0, 0.0, 0.0, best_v, best_i,
                                   False, FAST)
    top = tl.max(best_v, 0)
    at = tl.min(tl.where(best_v == top, best_i, 2147483647), 0)
    tl.store(PART_V + row * n_chunks + chunk, top)
    tl.store(PART_I + row * n_chunks + chunk, at)


@triton.jit(do_not_specialize=["n_chunks"])
def _race_reduce_kernel(PART_V, PART_I, OUT, n_chunks, BLOCK: tl.constexpr):
    """Row pid0's winner over its chunks: the best value, the lowest column on ties."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_chunks
    v = tl.load(PART_V + row * n_chunks + offs, mask=mask, other=float("-inf"))
    i = tl.load(PART_I + row * n_chunks + offs, mask=mask, other=2147483647)
    top = tl.max(v, 0)
    tl.store(OUT + row, tl.min(tl.where(v == top, i, 2147483647), 0).to(tl.int64))


# triton.jit chose compiled or interpreted when the kernel was defined; PTX is NVIDIA's only.
_FAST_LOG = (isinstance(_race_partial_kernel, triton.runtime.JITFunction)
             and torch.version.hip is None)


def chunk_size(rows: int, n_cols: int) -> int:
    """Columns a program takes: the largest power-of-two multiple of RNG_GROUP (at most
    MAX_CHUNK) that still gives about TARGET_PROGRAMS programs. Results do not depend on it."""
    chunk = MAX_CHUNK
    while chunk > RNG_GROUP and rows * triton.cdiv(n_cols, chunk) < TARGET_PROGRAMS:
        chunk //= 2
    return chunk


def exponential_race(logits: torch.Tensor, inv_temp: torch.Tensor, seeds: torch.Tensor,
                     ref: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """int64 [B]: per row of `logits` [B, V] (float32/bf16/fp16, unit last stride), the first
    maximal index where `inv_temp` (float32 [B]) is 0, else argmax((l - ref) * inv_temp -
    log E) with E ~ Exp(1) drawn from `seeds` (int64 [B]); `ref` (float32 [B], default 0) is
    a per-row shift for tiny temperatures (the row max keeps l * inv_temp finite). `chunk`
    (a multiple of RNG_GROUP) is for tests; it never changes the result."""
    rows, n_cols = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("exponential_race needs a unit last stride")
    if n_cols >= _INT32_MAX - MAX_CHUNK:
        raise ValueError(f"vocabulary of {n_cols} columns is too large for int32 indices")
    chunk = chunk_size(rows, n_cols) if chunk is None else chunk
    if chunk % RNG_GROUP:
        raise ValueError(f"chunk {chunk} is not a multiple of {RNG_GROUP}")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    n_chunks = triton.cdiv(n_cols, chunk)
    part_v = torch.empty((rows, n_chunks), dtype=torch.float32, device=logits.device)
    part_i = torch.empty((rows, n_chunks), dtype=torch.int32, device=logits.device)
    _race_partial_kernel[(rows, n_chunks)](
        logits, inv_temp, seeds, inv_temp if ref is None else ref, part_v, part_i,
        n_cols, logits.stride(0), n_chunks, chunk,
        SUB=RNG_SUB, HAS_REF=ref is not None, FAST=_FAST_LOG, num_warps=2,
    )
    # one BLOCK for vocabularies up to 128 x 1024 (every chunk size): one compile
    _race_reduce_kernel[(rows,)](part_v, part_i, out, n_chunks,
                                 BLOCK=max(128, triton.next_power_of_2(n_chunks)))
    return out
