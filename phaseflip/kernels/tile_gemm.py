"""Tile GEMM for decode-sized batches (129-1024 rows): y = x W^T, bf16/fp16 or FP8 with
per-row scales (y = (x_q W_q^T) * sx * sw), fp32 accumulation.

Why not cuBLAS there: its kernels run 128x128 tiles, so a batch of 257 rows pays for 384, and
its heuristic picks slower kernels at M off a multiple of 128 (H200, one 8B layer's four FP8
projections, weights cold: `_scaled_mm` 219 us at M = 257 against 145 at 256 and 186 at 384;
docs/benchmarks.md, eleventh run). A plain Triton tile loop with 64-row tiles, grouped
program order (the programs sharing a weight tile run together, so it is read from HBM once)
and a launch shape measured per (N, K, M bucket, dtype) takes 148 us at M = 257.

Which shapes run here is data, not code: `pick` returns a config only where the table shipped
for this GPU model (assets/kernel_configs/tile_gemm_<gpu>.json, written by
`benchmarks/tile_gemm_tune.py`) has one for the row bucket and dtype, i.e. where it beat
cuBLAS on that GPU; everything else stays on cuBLAS. An FP8 product comes out in bf16, as
`_scaled_mm`'s row-wise path gives, so callers treat the two alike.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from phaseflip.kernels.linear_configs import card_name, plan_splits
from phaseflip.kernels.linear_workspace import split_arrive, workspace_for
from phaseflip.kernels.pdl import chain_launch_options, launch_dependents, prefetch_then_wait

# Rows the table covers; fewer go to the skinny kernel, more to cuBLAS. From 33 rows a row
# bucket without a config falls back to the skinny kernel where it takes the rows (up to
# 128, `model/quant/fp8.py`), else cuBLAS: the tuner times both against the tiles. (The
# skinny kernel's one M tile pads 72 rows to 128: in the FP8 offline run's tail, 72
# sequences spent 5.5 ms a step in it, 103 sequences 3.9 ms.)
GEMM_MIN_M = 33
GEMM_MAX_M = 1024
# Turns the kernel off (every row count back to cuBLAS), for A/B runs.
NO_TILE_GEMM_ENV = "PHASEFLIP_NO_TILE_GEMM"
# Launch with PDL (its first weight tile prefetched before its wait, as the skinny kernel):
# passed tests/test_pdl.py's graph test at 256 sequences on an H100 (unsplit tiles; the
# test now splits K too, not yet run on a GPU); its speed unmeasured, so off until an A/B
# says it pays (tools/device/pdl_tile_call.sh flips it for one arm).
PDL_LAUNCH = False
TABLES = Path(__file__).resolve().parent.parent / "assets" / "kernel_configs"

Key = tuple[int, int, int, str]  # (m_bucket, n, k, the weight's dtype name)


@dataclass(frozen=True)
class TileGemmConfig:
    """One launch shape: a [block_m, block_n] output tile per program, block_k per K step."""

    block_m: int
    block_n: int
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    group_m: int = 8  # row tiles of one weight column tile launched together
    split_k: int = 1  # K chunks per tile, summed by the tile's last arrival (few-tile shapes)

    def label(self) -> str:
        split = f" split{self.split_k}" if self.split_k > 1 else ""
        return (f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} "
                f"s{self.num_stages} g{self.group_m}{split}")

    def fits(self, n: int, k: int) -> bool:
        """Weight tiles are loaded unmasked: N and K must be whole tiles."""
        return n % self.block_n == 0 and k % self.block_k == 0


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def m_bucket(m: int) -> int | None:
    """The table's row bucket for m rows: the decode graphs' capture sizes (multiples of 16
    from 48 up to 256, of 32 up to GEMM_MAX_M), so a graph's padded batch is its own bucket; None
    outside [GEMM_MIN_M, GEMM_MAX_M]."""
    if m < GEMM_MIN_M or m > GEMM_MAX_M:
        return None
    step = 16 if m <= 256 else 32
    return -(-m // step) * step


def buckets() -> list[int]:
    """Every bucket, smallest first (what the tuner sweeps)."""
    return sorted({b for m in range(GEMM_MIN_M, GEMM_MAX_M + 1) if (b := m_bucket(m))})


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tile_ids(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program -> (row tile, column tile), GROUP_M row tiles per column tile in a row, so the
    programs reading one weight tile are resident together and it comes from L2 after the
    first."""
    grid_m = tl.cdiv(M, BLOCK_M)
    width = GROUP_M * (N // BLOCK_N)
    first_m = (pid // width) * GROUP_M
    size_m = min(grid_m - first_m, GROUP_M)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


@triton.jit
def _epilogue(acc, XS, WS, B, Y, offs_m, offs_n, rows, N, SCALED: tl.constexpr,
              HAS_BIAS: tl.constexpr):
    if SCALED:
        sx = tl.load(XS + offs_m, mask=rows, other=0.0)
        sw = tl.load(WS + offs_n)
        acc = acc * sx[:, None] * sw[None, :]
    if HAS_BIAS:  # in fp32 before the one rounding, as cuBLAS' epilogue adds it
        acc += tl.load(B + offs_n).to(tl.float32)[None, :]
    y_ptrs = Y + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=rows[:, None])


@triton.jit(do_not_specialize=["M"])
def _tile_gemm_kernel(X, W, XS, WS, B, Y, PARTIALS, COUNTERS, M, N, K, k_per_split, num_splits,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, STAGES: tl.constexpr, SCALED: tl.constexpr,
                      HAS_BIAS: tl.constexpr, WIDEN: tl.constexpr, SPLIT: tl.constexpr,
                      TRIGGER: tl.constexpr, PDL: tl.constexpr, PF_LINE: tl.constexpr):
    """Program (output tile, K chunk): y tile = x rows @ W rows^T over the chunk, fp32; with
    SPLIT the tile's last arrival sums the chunks and applies the epilogue. TRIGGER: the next
    kernel may launch once every program has left its K loop. PDL: launched before the
    kernel before it ends: the program's first weight tile (lines of PF_LINE elements) is
    prefetched into L2, then it waits (`kernels/pdl.py`)."""
    tile_id = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = _tile_ids(tile_id, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * k_per_split + tl.arange(0, BLOCK_K)
    rows = offs_m < M
    x_ptrs = X + offs_m[:, None].to(tl.int64) * K + offs_k[None, :]
    w_ptrs = W + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
    if PDL:
        lines = pid_k * k_per_split + tl.arange(0, BLOCK_K // PF_LINE) * PF_LINE
        prefetch_then_wait(W + offs_n[:, None].to(tl.int64) * K + lines[None, :], PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_len = min(k_per_split, K - pid_k * k_per_split)
    for _ in tl.range(0, k_len, BLOCK_K, num_stages=STAGES):
        x = tl.load(x_ptrs, mask=rows[:, None], other=0.0)
        w = tl.load(w_ptrs)
        if WIDEN:  # the CPU interpreter (triton 3.9) returns garbage from a bf16 dot
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc,
                         input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    launch_dependents(TRIGGER)
    if SPLIT:
        # Tile tile_id owns PARTIALS[tile_id, 0:num_splits, BLOCK_M, BLOCK_N] and
        # COUNTERS[tile_id], 0 between launches (its last arrival re-arms it); the last
        # arrival sums the partials in split order, so the result does not depend on timing.
        tile_elems = BLOCK_M * BLOCK_N
        tile = (PARTIALS + tile_id.to(tl.int64) * num_splits * tile_elems
                + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :])
        if split_arrive(acc, tile, COUNTERS + tile_id, pid_k, num_splits, tile_elems):
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(0, num_splits):
                total += tl.load(tile + s * tile_elems, cache_modifier=".cg")
            _epilogue(total, XS, WS, B, Y, offs_m, offs_n, rows, N, SCALED, HAS_BIAS)
            tl.store(COUNTERS + tile_id, 0)
    else:
        _epilogue(acc, XS, WS, B, Y, offs_m, offs_n, rows, N, SCALED, HAS_BIAS)


def tile_gemm(x: torch.Tensor, w: torch.Tensor, config: TileGemmConfig,
              x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
              bias: torch.Tensor | None = None, out: torch.Tensor | None = None
              ) -> torch.Tensor:
    """[M, N] = x [M, K] @ w [N, K].T (+ bias [N]), fp32 accumulation, x and w contiguous
    and of one dtype.

    16-bit operands: the output has their dtype. FP8 (e4m3) operands need x_scale (M values)
    and w_scale (N values), float32 in any shape holding them contiguously ([M, 1], [N],
    [1, N]), applied to the fp32 sums; the output is bf16 (a bias is added to the scaled
    sums). `out` may be any float dtype."""
    m, k = x.shape
    n = w.shape[0]
    scaled = x.element_size() == 1
    if (w.shape[1] != k or w.dtype != x.dtype or x.element_size() not in (1, 2)
            or not x.dtype.is_floating_point or k == 0):
        raise ValueError(f"tile_gemm takes x [M, K] and W [N, K] (K > 0) of one 8- or 16-bit "
                         f"float dtype, got {tuple(x.shape)} {x.dtype} and {tuple(w.shape)} "
                         f"{w.dtype}")
    if not config.fits(n, k):
        raise ValueError(f"config {config.label()} does not tile N={n}, K={k}")
    if not (x.is_contiguous() and w.is_contiguous()) or (
            bias is not None and (bias.numel() != n or not bias.is_contiguous())):
        raise ValueError("tile_gemm needs contiguous x, W and an N-value bias")
    if scaled and (x_scale is None or w_scale is None
                   or x_scale.numel() != m or w_scale.numel() != n):
        raise ValueError(f"FP8 scales: need {m} row and {n} weight scales")
    if out is not None and (out.shape != (m, n) or not out.is_contiguous()
                            or out.device != x.device):
        raise ValueError(f"out must be a contiguous [{m}, {n}] tensor on {x.device}")
    y = out if out is not None else torch.empty(
        m, n, dtype=torch.bfloat16 if scaled else x.dtype, device=x.device)
    if m == 0:
        return y
    xs = x_scale.float().contiguous() if scaled else x
    ws = w_scale.float().contiguous() if scaled else w
    tiles = triton.cdiv(m, config.block_m) * (n // config.block_n)
    splits, k_per_split = plan_splits(k, config.block_k, config.split_k)
    if splits > 1:
        partials, counters = workspace_for(x.device).reserve(
            _partial_elems(tiles, splits, config), tiles)
    else:
        partials, counters = y, y  # unused
    pdl = chain_launch_options(x.device) if PDL_LAUNCH else {}
    _tile_gemm_kernel[(tiles, splits)](
        x, w, xs, ws, bias if bias is not None else w, y, partials, counters, m, n, k,
        k_per_split, splits, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, GROUP_M=config.group_m, STAGES=config.num_stages,
        SCALED=scaled, HAS_BIAS=bias is not None, WIDEN=not scaled and not x.is_cuda,
        SPLIT=splits > 1, TRIGGER=bool(chain_launch_options(x.device)), PDL=bool(pdl),
        PF_LINE=min(128 // w.element_size(), config.block_k), num_warps=config.num_warps,
        **pdl)
    return y


def _partial_elems(tiles: int, splits: int, config: TileGemmConfig) -> int:
    return tiles * splits * config.block_m * config.block_n


# ----------------------------------------------------------------------------------------------
# The shipped table
# ----------------------------------------------------------------------------------------------


def table_path(device_name: str) -> Path:
    return TABLES / f"tile_gemm_{card_name(device_name)}.json"


def parse_table(rows: Iterable[dict]) -> dict[Key, TileGemmConfig]:
    """{(m_bucket, n, k, dtype): config} from the JSON rows (`to_rows`); rows without a
    config are buckets where cuBLAS won, kept in the file for the record."""
    return {(r["m_bucket"], r["n"], r["k"], r["dtype"]): TileGemmConfig(**r["config"])
            for r in rows if r.get("config")}


def to_rows(entries: dict[Key, TileGemmConfig | None],
            timings: dict[Key, dict] | None = None) -> list[dict]:
    return [{"m_bucket": b, "n": n, "k": k, "dtype": d, "config": asdict(c) if c else None,
             **(timings or {}).get((b, n, k, d), {})}
            for (b, n, k, d), c in sorted(entries.items())]


def cublas_keys(rows: Iterable[dict]) -> set[Key]:
    """The rows without a config where cuBLAS also beat the skinny kernel (the tuner times
    it up to 128 rows): those rows go to cuBLAS, not to the skinny kernel."""
    return {(r["m_bucket"], r["n"], r["k"], r["dtype"]) for r in rows
            if not r.get("config") and r.get("cublas_us", 0) < r.get("skinny_us", 0)}


@functools.cache
def _rows_for(device_name: str) -> tuple[dict]:
    path = table_path(device_name)
    return tuple(json.loads(path.read_text())) if path.exists() else ()


@functools.cache
def _table_for(device_name: str) -> dict[Key, TileGemmConfig]:
    return parse_table(_rows_for(device_name))


@functools.cache
def _cublas_for(device_name: str) -> frozenset[Key]:
    return frozenset(cublas_keys(_rows_for(device_name)))


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _gpu_name(device: torch.device) -> str | None:
    """The GPU model whose table applies (None off the GPU or with the kernel turned off)."""
    if device.type != "cuda" or os.environ.get(NO_TILE_GEMM_ENV) == "1":
        return None
    if device.index is None:  # a tensor's device always has its index; a bare "cuda" may not
        if not torch.cuda.is_available():
            return None
        device = torch.device("cuda", torch.cuda.current_device())
    return _device_name(device.index)


def table(device: torch.device) -> dict[Key, TileGemmConfig]:
    """The shipped table for this device's GPU model (empty for none, or off the GPU)."""
    name = _gpu_name(device)
    return {} if name is None else _table_for(name)


def cublas_wins(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the tuner found cuBLAS fastest for m rows where the skinny kernel also runs."""
    bucket, name = m_bucket(m), _gpu_name(device)
    return (bucket is not None and name is not None
            and (bucket, n, k, dtype_name(dtype)) in _cublas_for(name))


def pick(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device
         ) -> TileGemmConfig | None:
    """The measured launch shape for m rows of an [N, K] weight of `dtype`, or None."""
    bucket = m_bucket(m)
    return None if bucket is None else table(device).get((bucket, n, k, dtype_name(dtype)))


def warmup(shapes: Iterable[tuple[int, int]], dtype: torch.dtype, device: torch.device) -> None:
    """Compiles every config the table holds for these (N, K) weights of `dtype` and sizes the
    split-K workspace for them, so neither a graph capture nor a mixed step of a new row count
    compiles or allocates on the serving path. Proxy weights of one column tile: the compiled
    variant does not depend on N, K or M."""
    shapes, name = set(shapes), dtype_name(dtype)
    todo = [(bucket, n, k, cfg) for (bucket, n, k, d), cfg in table(device).items()
            if d == name and (n, k) in shapes]
    # the real N's partials (a capture must not grow the workspace), the largest first so
    # the workspace grows once
    need = [(_partial_elems(triton.cdiv(b, c.block_m) * (n // c.block_n), splits, c),
             triton.cdiv(b, c.block_m) * (n // c.block_n))
            for b, n, k, c in todo if (splits := plan_splits(k, c.block_k, c.split_k)[0]) > 1]
    if need:
        workspace_for(device).reserve(max(e for e, _ in need), max(t for _, t in need))
    for bucket, _, k, cfg in todo:
        x = torch.zeros(bucket, k, dtype=dtype, device=device)
        w = torch.zeros(cfg.block_n, k, dtype=dtype, device=device)
        if dtype.itemsize == 1:  # FP8: scales; a bias is added after the product
            tile_gemm(x, w, cfg, torch.ones(bucket, device=device),
                      torch.ones(cfg.block_n, device=device))
            continue
        for bias in (None, torch.zeros(cfg.block_n, dtype=dtype, device=device)):
            tile_gemm(x, w, cfg, bias=bias)  # 16-bit layers with and without a bias
    if todo and device.type == "cuda":
        torch.cuda.synchronize(device)
