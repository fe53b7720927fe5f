"""Skinny GEMM for decode linears (M = 1..16 rows): y = x @ W^T (+ b) at weight-streaming speed.

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

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import triton
import triton.language as tl

# should_use_skinny's M cut-over, from benchmarks/linear_kernels.py --tune on an H200 (the
# largest M at which the tuned kernel still beats cuBLAS in a CUDA graph at every M below it):
# qkv and down win at M <= 2 (1.05-1.21x), gate_up ties cuBLAS (1.03x at M = 1).
SKINNY_MAX_M = 2
# Largest M the kernel accepts at all (BLOCK_M = next power of two of M; beyond this the
# register tiles stop making sense and cuBLAS wins anyway).
KERNEL_MAX_M = 64
# Per-(N, K) cut-overs measured on the target GPU override SKINNY_MAX_M; empty until measured.
MAX_M_BY_SHAPE: dict[tuple[int, int], int] = {
    (4096, 4096): 32,  # Llama/Qwen3-8B o_proj: 1.07-1.23x up to M = 32
    (128256, 4096): 32,  # Llama-3 lm_head: 1.02-1.04x up to M = 32
}
# Tuned tables shipped per GPU model (`load_bundled_configs`).
BUNDLED_CONFIGS = Path(__file__).resolve().parent.parent / "assets" / "kernel_configs"

# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _lane_dot(w, x_ptrs, mask_k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              VEC: tl.constexpr, EVEN_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K // VEC] sums of w * x over runs of VEC contiguous K elements.

    A run is one thread's 16-byte load, so this reduction never leaves the thread: the K loop
    has no shuffles or barriers, and the cross-thread reduction happens once after the loop.
    """
    if EVEN_K:
        x = tl.load(x_ptrs)
    else:
        x = tl.load(x_ptrs, mask=mask_k, other=0.0)
    prod = w * x.to(tl.float32)[None, :]
    return tl.sum(tl.reshape(prod, [BLOCK_N, BLOCK_K // VEC, VEC]), 2)


@triton.jit
def _rows_ew(X, W, M, rows_w, k_lo, k_hi, stride_xm, stride_wn,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             VEC: tl.constexpr, EVEN_K: tl.constexpr):
    """M <= 8 on the FMA units: returns [BLOCK_M, BLOCK_N] fp32 partial sums over [k_lo, k_hi).

    One [BLOCK_N, BLOCK_K // VEC] accumulator per x row (named, since a loop cannot carry a
    list): each weight tile is loaded once and multiplied by every row of x.
    """
    tl.static_assert(BLOCK_M <= 8, "the elementwise loop serves M <= 8")
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = W + rows_w[:, None].to(tl.int64) * stride_wn + (k_lo + offs_k)[None, :]
    x_ptrs = X + k_lo + offs_k
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
    for k0 in range(k_lo, k_hi, BLOCK_K):
        mask_k = (k0 + offs_k) < k_hi
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
        else:
            w = tl.load(w_ptrs, mask=mask_k[None, :], other=0.0, eviction_policy="evict_first")
        w = w.to(tl.float32)
        a0 += _lane_dot(w, x_ptrs, mask_k, BLOCK_N, BLOCK_K, VEC, EVEN_K)
        if BLOCK_M > 1:
            a1 += _lane_dot(w, x_ptrs + dr1, mask_k, BLOCK_N, BLOCK_K, VEC, EVEN_K)
        if BLOCK_M > 2:
            a2 += _lane_dot(w, x_ptrs + dr2, mask_k, BLOCK_N, BLOCK_K, VEC, EVEN_K)
            a3 += _lane_dot(w, x_ptrs + dr3, mask_k, BLOCK_N, BLOCK_K, VEC, EVEN_K)
        if BLOCK_M > 4:
            a4 += _lane_dot(w, x_ptrs + dr4, mask_k, BLOCK_N, BLOCK_K, VEC, EVEN_K)
            a5 += _lane_dot(w, x_ptrs + dr5, mask_k, BLOCK_N, BLOCK_K, VEC, EVEN_K)
            a6 += _lane_dot(w, x_ptrs + dr6, mask_k, BLOCK_N, BLOCK_K, VEC, EVEN_K)
            a7 += _lane_dot(w, x_ptrs + dr7, mask_k, BLOCK_N, BLOCK_K, VEC, EVEN_K)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    row = tl.arange(0, BLOCK_M)[:, None]
    acc = tl.where(row == 0, tl.sum(a0, 1)[None, :], 0.0)
    if BLOCK_M > 1:
        acc += tl.where(row == 1, tl.sum(a1, 1)[None, :], 0.0)
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
def _rows_dot(X, W, rows_x, rows_w, k_lo, k_hi, stride_xm, stride_wn,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """Tensor cores, swap-AB (W tile on the MMA's M side): returns [BLOCK_M, BLOCK_N] fp32."""
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = W + rows_w[:, None].to(tl.int64) * stride_wn + (k_lo + offs_k)[None, :]
    x_ptrs = X + rows_x[None, :] * stride_xm + (k_lo + offs_k)[:, None]  # x^T: [BLOCK_K, BM]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            x = tl.load(x_ptrs)
        else:
            mask_k = (k0 + offs_k) < k_hi
            w = tl.load(w_ptrs, mask=mask_k[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=mask_k[:, None], other=0.0)
        acc = tl.dot(w, x, acc, input_precision=DOT_PREC)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return tl.trans(acc)


@triton.jit
def _store_rows(acc, B, Y, offs_m, offs_n, M, N, stride_ym, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        bias = tl.load(B + tl.minimum(offs_n, N - 1)).to(tl.float32)
        acc = acc + bias[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=mask)


@triton.jit(do_not_specialize=["M", "num_splits"])
def _skinny_kernel(
    X, W, B, Y, PARTIALS, COUNTERS,
    M, N, K, stride_xm, stride_wn, stride_ym, k_per_split, num_splits,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    LOOP: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    VEC: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Program (n tile, split): rows [pid_n*BLOCK_N, +BLOCK_N) of y over one K chunk."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    rows_w = tl.minimum(offs_n, N - 1)
    rows_x = tl.minimum(offs_m, M - 1)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if LOOP == "dot":
        acc = _rows_dot(X, W, rows_x, rows_w, k_lo, k_hi, stride_xm, stride_wn,
                        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PREC)
    else:
        acc = _rows_ew(X, W, M, rows_w, k_lo, k_hi, stride_xm, stride_wn,
                       BLOCK_M, BLOCK_N, BLOCK_K, VEC, EVEN_K)

    if SPLIT:
        # Tile pid_n owns PARTIALS[pid_n, 0:num_splits, BLOCK_M, BLOCK_N] and COUNTERS[pid_n],
        # which is 0 between launches (the last arrival re-arms it).
        tile_elems = BLOCK_M * BLOCK_N
        tile = (PARTIALS + pid_n.to(tl.int64) * num_splits * tile_elems
                + offs_m[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :])
        tl.store(tile + pid_k * tile_elems, acc)
        # Every thread's partial is written before one thread publishes the arrival (release);
        # the acquire side makes the other programs' partials visible to the last arrival.
        tl.debug_barrier()
        arrived = tl.atomic_add(COUNTERS + pid_n, 1, sem="acq_rel")
        if arrived == num_splits - 1:
            tl.debug_barrier()
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(0, num_splits):
                total += tl.load(tile + s * tile_elems, cache_modifier=".cg")
            _store_rows(total, B, Y, offs_m, offs_n, M, N, stride_ym, HAS_BIAS)
            tl.store(COUNTERS + pid_n, 0)
    else:
        _store_rows(acc, B, Y, offs_m, offs_n, M, N, stride_ym, HAS_BIAS)


# ----------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------


LOOPS = ("ew", "dot")


@dataclass(frozen=True)
class SkinnyConfig:
    """One launch shape. `split_k` is the requested split count; the launch may use fewer so
    that no split is empty (see `plan_splits`)."""

    block_n: int  # W rows per program
    block_k: int  # K elements per inner-loop step
    num_warps: int
    num_stages: int
    split_k: int = 1
    loop: str = "ew"  # "ew" (elementwise, M <= 8) or "dot" (swap-AB tensor cores, any M)

    def __post_init__(self) -> None:
        if self.loop not in LOOPS:
            raise ValueError(f"loop must be one of {LOOPS}, not {self.loop!r}")

    @property
    def use_dot(self) -> bool:
        return self.loop == "dot"

    def block_m(self, m: int) -> int:
        bm = triton.next_power_of_2(max(m, 1))
        return max(bm, 16) if self.use_dot else bm

    def label(self) -> str:
        return (f"{self.loop} n{self.block_n} k{self.block_k} w{self.num_warps} s{self.num_stages}"
                f" split{self.split_k}")


def m_bucket(m: int) -> int:
    """Configs are chosen per power-of-two bucket of M (1, 2, 4, 8, 16, 32, 64)."""
    return triton.next_power_of_2(max(m, 1))


def plan_splits(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(num_splits, k_per_split): chunks are whole BLOCK_K steps and none is empty."""
    k_per_split = triton.cdiv(triton.cdiv(k, max(split_k, 1)), block_k) * block_k
    k_per_split = max(k_per_split, block_k)
    return triton.cdiv(k, k_per_split), k_per_split


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


_NUM_SMS: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def auto_split(n: int, k: int, block_n: int, block_k: int, sms: int) -> int:
    """Split count that gives ~4 programs per SM (registers allow 5-9 resident, so there is
    slack for the tail), never chunks shorter than 2 BLOCK_K steps or 1024 elements."""
    programs = triton.cdiv(n, block_n)
    want = triton.cdiv(4 * sms, programs)
    most = max(1, k // max(2 * block_k, 1024))
    return max(1, min(want, most, 16))


# Launch shapes (block_n, block_k, num_warps, num_stages) per loop and M bucket, for 16-bit
# inputs (fp32 halves block_k). Compiled for sm_90 on a CPU box (`triton.compile` +
# `cuobjdump -res-usage`, docs/kernels.md), bf16: ew M = 1 8x1024 uses 56 registers (9
# programs / SM, 144 KB of weights in flight per SM), 16x1024 80 (6 / SM, 192 KB); ew at M = 2
# 8x512 64 (8 / SM, 64 KB); at M = 4 and 8 the per-row accumulators and products push ew to
# 60-130 registers and 16-48 KB in flight, where dot 32x128 x 4 stages keeps 48 registers, 36 KB
# of shared memory (6 / SM) and ~144 KB in flight. None of these spills.
_EW_SHAPES = {
    1: [(8, 1024, 4, 1), (16, 1024, 4, 1), (4, 1024, 4, 1), (8, 512, 4, 1), (16, 512, 4, 1),
        (16, 256, 4, 1), (8, 2048, 4, 1)],
    2: [(8, 512, 4, 1), (4, 1024, 4, 1), (16, 256, 4, 1), (8, 1024, 4, 1), (32, 256, 4, 1)],
    4: [(8, 512, 4, 1), (4, 1024, 4, 1), (8, 256, 4, 1), (16, 256, 4, 1), (4, 512, 4, 1)],
    8: [(4, 512, 4, 1), (8, 256, 4, 1), (4, 1024, 4, 1), (16, 256, 4, 1)],
}
_DOT_SHAPES = [(32, 128, 4, 4), (64, 128, 4, 4), (64, 64, 4, 6), (32, 256, 4, 3),
               (128, 128, 8, 3), (128, 64, 4, 4)]


def default_config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, *,
                   sms: int | None = None) -> SkinnyConfig:
    """Heuristic launch shape per M bucket (before/without `tune`; shapes from the table above).

    M = 1: ew 8 rows x 1024 columns. M = 2: ew 8 x 512. M >= 4: dot 32 x 128, 4 stages (the
    tensor cores' 16-row padding costs nothing at this arithmetic intensity, and cp.async
    pipelining keeps more bytes in flight than ew's registers can). Split-K from `auto_split`
    for `sms` SMs (default: the device's).
    """
    bucket = m_bucket(m)
    if device.type != "cuda":  # interpreter: small blocks so tiny test shapes cross blocks
        return SkinnyConfig(16, 32, 4, 1, 1, "dot" if bucket >= 16 else "ew")
    half = 2 if dtype == torch.float32 else 1
    if bucket == 1:
        cfg = SkinnyConfig(8, 1024 // half, 4, 1, 1, "ew")
    elif bucket == 2:
        cfg = SkinnyConfig(8, 512 // half, 4, 1, 1, "ew")
    else:
        cfg = SkinnyConfig(32, 128 // half, 4, 4, 1, "dot")
    sms = sms or num_sms(device)
    return replace(cfg, split_k=auto_split(n, k, cfg.block_n, cfg.block_k, sms))


def candidate_configs(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, *,
                      sms: int | None = None) -> list[SkinnyConfig]:
    """The sweep `tune` times for one (M bucket, N, K): the shapes above (ew for M <= 8, dot
    for all), each with split-K {1, auto, 2x auto}. Two compiled variants per shape (split or
    not): the split count is a runtime argument."""
    bucket = m_bucket(m)
    half = 2 if dtype == torch.float32 else 1
    sms = sms or num_sms(device)
    out: list[SkinnyConfig] = []
    for loop, shapes in (("ew", _EW_SHAPES.get(bucket, [])), ("dot", _DOT_SHAPES)):
        for bn, bk, warps, stages in shapes:
            bk //= half
            auto = auto_split(n, k, bn, bk, sms)
            for split in sorted({1, auto, min(2 * auto, 16)}):
                if split == 1 or plan_splits(k, bk, split)[0] > 1:
                    out.append(SkinnyConfig(bn, bk, warps, stages, split, loop))
    return list(dict.fromkeys(out))


class ConfigTable:
    """Measured best configs keyed by (M bucket, N, K, dtype name); overrides the heuristic."""

    def __init__(self) -> None:
        self.entries: dict[tuple[int, int, int, str], SkinnyConfig] = {}

    @staticmethod
    def key(m: int, n: int, k: int, dtype: torch.dtype) -> tuple[int, int, int, str]:
        return (m_bucket(m), n, k, str(dtype).removeprefix("torch."))

    def get(self, m: int, n: int, k: int, dtype: torch.dtype) -> SkinnyConfig | None:
        return self.entries.get(self.key(m, n, k, dtype))

    def put(self, m: int, n: int, k: int, dtype: torch.dtype, cfg: SkinnyConfig) -> None:
        self.entries[self.key(m, n, k, dtype)] = cfg

    def to_json(self) -> list[dict]:
        return [{"m_bucket": b, "n": n, "k": k, "dtype": d, **asdict(c)}
                for (b, n, k, d), c in sorted(self.entries.items())]

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    def load(self, path: str | Path) -> None:
        """Merge a table written by `save` (e.g. from benchmarks/linear_kernels.py --tune)."""
        for row in json.loads(Path(path).read_text()):
            key = (row.pop("m_bucket"), row.pop("n"), row.pop("k"), row.pop("dtype"))
            self.entries[key] = SkinnyConfig(**row)


TUNED = ConfigTable()


def load_bundled_configs(device: torch.device) -> Path | None:
    """Merges the tuned table shipped for this GPU model (e.g. skinny_linear_nvidia_h200.json)
    into `TUNED`; returns its path, or None when none ships (the heuristic then decides)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower().replace(" ", "_").replace("-", "_")
    path = BUNDLED_CONFIGS / f"skinny_linear_{name}.json"
    if not path.exists():
        return None
    TUNED.load(path)
    return path


def pick_config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device
                ) -> SkinnyConfig:
    return TUNED.get(m, n, k, dtype) or default_config(m, n, k, dtype, device)


def should_use_skinny(m: int, n: int, k: int) -> bool:
    """Dispatch rule for a CUDA linear: skinny kernel for 1 <= M <= the measured cut-over, and
    only when rows of W are 16-byte aligned (K % 8 == 0), which its vector loads rely on."""
    limit = min(MAX_M_BY_SHAPE.get((n, k), SKINNY_MAX_M), KERNEL_MAX_M)
    return 1 <= m <= limit and k % 8 == 0


# ----------------------------------------------------------------------------------------------
# Split-K workspace
# ----------------------------------------------------------------------------------------------


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class SplitKWorkspace:
    """fp32 partial tiles and int32 arrival counters for split launches on one device.

    Launches that share a workspace must be ordered (one stream, or a CUDA graph of one
    stream): the counters are re-armed by each launch's last arrivals, and the partials are
    overwritten. Grows only outside graph capture (`warmup` sizes it beforehand). Outgrown
    buffers are kept, not freed: a graph captured earlier still points at them. Keep the
    workspace alive as long as any graph captured with it.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.partials = torch.empty(0, dtype=torch.float32, device=device)
        self.counters = torch.zeros(0, dtype=torch.int32, device=device)
        self._outgrown: list[torch.Tensor] = []

    def reserve(self, partial_elems: int, num_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.partials.numel() < partial_elems or self.counters.numel() < num_tiles:
            if _capturing(self.device):
                raise RuntimeError(
                    f"skinny_linear split-K workspace too small during CUDA-graph capture "
                    f"(need {partial_elems} floats, {num_tiles} counters): call "
                    f"phaseflip.kernels.linear.warmup() with this shape before capturing")
            elems = max(self.partials.numel(), triton.next_power_of_2(partial_elems))
            tiles = max(self.counters.numel(), triton.next_power_of_2(num_tiles))
            self._outgrown += [self.partials, self.counters]
            self.partials = torch.empty(elems, dtype=torch.float32, device=self.device)
            # Fresh counters start at 0; the old ones are all 0 at rest (self-re-arming).
            self.counters = torch.zeros(tiles, dtype=torch.int32, device=self.device)
        return self.partials, self.counters


_WORKSPACES: dict[torch.device, SplitKWorkspace] = {}


def workspace_for(device: torch.device) -> SplitKWorkspace:
    """The default workspace of `device` (one per device; see SplitKWorkspace for ordering)."""
    if device not in _WORKSPACES:
        _WORKSPACES[device] = SplitKWorkspace(device)
    return _WORKSPACES[device]


# ----------------------------------------------------------------------------------------------
# Wrapper
# ----------------------------------------------------------------------------------------------


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 must not be rounded to tf32 (the fp32 path is held to 1e-5 of F.linear).
    return "ieee" if dtype == torch.float32 else "tf32"


def _launch(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            y2: torch.Tensor, n: int, cfg: SkinnyConfig, workspace: SplitKWorkspace | None,
            reserve_n: int | None = None) -> None:
    """Launch on 2-D x [M, K] / y [M, >=n]; `reserve_n` sizes the workspace for a larger N
    than launched (warmup's proxy weights)."""
    m, k = x2.shape
    bm = cfg.block_m(m)
    if cfg.loop == "ew" and bm > 8:
        raise ValueError(f"the ew loop serves at most 8 rows (got {m}); use a dot config")
    num_splits, k_per_split = plan_splits(k, cfg.block_k, cfg.split_k)
    tiles = triton.cdiv(n, cfg.block_n)
    split = num_splits > 1
    if split:
        ws = workspace or workspace_for(x2.device)
        tiles_reserved = triton.cdiv(reserve_n or n, cfg.block_n)
        partials, counters = ws.reserve(tiles_reserved * num_splits * bm * cfg.block_n,
                                        tiles_reserved)
    else:
        partials, counters = y2, y2  # unused
    _skinny_kernel[(tiles, num_splits)](
        x2, weight, bias if bias is not None else weight, y2, partials, counters,
        m, n, k, x2.stride(0), weight.stride(0), y2.stride(0), k_per_split, num_splits,
        BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, LOOP=cfg.loop,
        SPLIT=split, HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0,
        VEC=16 // weight.element_size(), DOT_PREC=_dot_precision(weight.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    config: SkinnyConfig | None = None,
    workspace: SplitKWorkspace | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for few rows: x [..., K], weight [N, K] (K contiguous),
    bias [N]; fp32 accumulation, output in x's dtype (written into `out`, [..., N], when given).

    `config` pins a launch shape (tests, tuning); otherwise the tuned table or the heuristic
    picks one. No host syncs; allocates only `out` when it is omitted (and the split-K
    workspace the first time a shape needs more of it — call `warmup` before graph capture).
    """
    if x.device.type != "cuda" and not _interpreting():
        raise ValueError("skinny_linear needs CUDA tensors (or TRITON_INTERPRET=1); "
                         "use torch.nn.functional.linear on the CPU")
    n, k = weight.shape
    if x.shape[-1] != k or x.dtype != weight.dtype:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not match weight "
                         f"{tuple(weight.shape)} {weight.dtype}")
    if weight.stride(1) != 1:
        raise ValueError("weight must be contiguous along K (row-major [N, K])")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{n}] of dtype {x.dtype}")
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m > KERNEL_MAX_M:
        raise ValueError(f"skinny_linear handles at most {KERNEL_MAX_M} rows (got {m}); "
                         f"use torch.nn.functional.linear")
    if out is None:
        out = torch.empty(*lead, n, dtype=x.dtype, device=x.device)
    elif out.shape != (*lead, n) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {(*lead, n)} of dtype {x.dtype}, contiguous in N")
    if m == 0 or n == 0:
        return out
    y2 = out.view(-1, n) if out.dim() != 2 else out
    if k == 0:  # an empty sum: the bias alone
        y2.zero_()
        if bias is not None:
            y2 += bias
        return out
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    cfg = config or pick_config(m, n, k, x.dtype, x.device)
    _launch(x2, weight, bias, y2, n, cfg, workspace)
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
           m_values: Sequence[int] = DEFAULT_M_VALUES, bias: bool = False) -> None:
    """Compile (and load) the kernel for every (N, K) in `shapes` x M bucket in `m_values`, and
    size the split-K workspace, so that later calls — in particular inside CUDA-graph capture —
    compile and allocate nothing. Call it after loading/tuning configs (`TUNED`): it warms the
    configs `pick_config` returns now (`linear_tune.tune` measures new ones).

    Launches use proxy weights of `_proxy_rows(N)` rows (same compiled variant as the real N),
    so no full-size weight is allocated. Covers 16-byte-aligned operands (any fresh tensor);
    a misaligned view of x would compile a new variant on first use.
    """
    shapes = list(dict.fromkeys(shapes))
    if device.type != "cuda":
        return
    ws = workspace_for(device)
    for n, k in shapes:
        rows = _proxy_rows(n)
        w = torch.zeros(rows, k, dtype=dtype, device=device)
        b = torch.zeros(rows, dtype=dtype, device=device) if bias else None
        for m in m_values:
            x = torch.zeros(m, k, dtype=dtype, device=device)
            y = torch.empty(m, rows, dtype=dtype, device=device)
            _launch(x, w, b, y, rows, pick_config(m, n, k, dtype, device), ws, reserve_n=n)
    torch.cuda.synchronize(device)
