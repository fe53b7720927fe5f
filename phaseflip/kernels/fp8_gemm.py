"""FP8 GEMM for decode-sized batches (129-1024 rows): y = (x_q W_q^T) * sx * sw in bf16.

Why not `torch._scaled_mm` there: cuBLASLt's row-wise FP8 kernels run 128x128 tiles, so a
batch of 257 rows pays for 384, and its heuristic picks slower kernels at M off a multiple of
128 (H200, one 8B layer's four projections, weights cold: 219 us at M = 257 against 145 at
256 and 186 at 384; docs/benchmarks.md, eleventh run). A plain Triton tile loop with 64-row
tiles, grouped program order (the programs sharing a weight tile run together, so it is read
from HBM once) and a launch shape measured per (N, K, M bucket) takes 148 us at M = 257.

Which shapes run here is data, not code: `pick` returns a config only where the table shipped
for this GPU model (assets/kernel_configs/fp8_gemm_<gpu>.json, written by
`benchmarks/fp8_gemm_tune.py`) has one for the M bucket, i.e. where it beat cuBLAS on that
GPU; everything else stays on `_scaled_mm`. The output is bf16, as `_scaled_mm`'s row-wise
path gives, so a caller treats the two alike.
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

# Rows this kernel's table covers; fewer go to the skinny kernel, more to cuBLAS.
GEMM_MIN_M = 129
GEMM_MAX_M = 1024
# Turns the kernel off (every row count back to `_scaled_mm`), for A/B runs.
NO_FP8_GEMM_ENV = "PHASEFLIP_NO_FP8_GEMM"
TABLES = Path(__file__).resolve().parent.parent / "assets" / "kernel_configs"


@dataclass(frozen=True)
class Fp8GemmConfig:
    """One launch shape: a [block_m, block_n] output tile per program, block_k per K step."""

    block_m: int
    block_n: int
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    group_m: int = 8  # programs of one weight column tile launched together

    def label(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} "
                f"s{self.num_stages} g{self.group_m}")

    def fits(self, n: int, k: int) -> bool:
        """Weight tiles are loaded unmasked: N and K must be whole tiles."""
        return n % self.block_n == 0 and k % self.block_k == 0


def m_bucket(m: int) -> int | None:
    """The table's row bucket for m rows: the decode graphs' capture sizes (multiples of 16
    up to 256, of 32 up to GEMM_MAX_M), so a graph's padded batch is its own bucket; None
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


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(X, W, XS, WS, Y, M, N, K,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, STAGES: tl.constexpr):
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = offs_m < M
    x_ptrs = X + offs_m[:, None].to(tl.int64) * K + offs_k[None, :]
    w_ptrs = W + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        x = tl.load(x_ptrs, mask=rows[:, None], other=0.0)
        w = tl.load(w_ptrs)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    sx = tl.load(XS + offs_m, mask=rows, other=0.0)
    sw = tl.load(WS + offs_n)
    acc = acc * sx[:, None] * sw[None, :]
    y_ptrs = Y + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=rows[:, None])


def fp8_gemm(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor,
             w_scale: torch.Tensor, config: Fp8GemmConfig,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """[M, N] bf16 = (x_q @ w_q.T) * x_scale[:, None] * w_scale[None, :], fp32 accumulation.

    x_q [M, K] and w_q [N, K] FP8 (e4m3), contiguous; x_scale M and w_scale N float32 values
    (any shape holding them contiguously, e.g. [M, 1] and [N] / [1, N])."""
    m, k = x_q.shape
    n = w_q.shape[0]
    if w_q.shape[1] != k or x_q.element_size() != 1 or w_q.element_size() != 1:
        raise ValueError(f"fp8_gemm takes FP8 x [M, K] and W [N, K], got {tuple(x_q.shape)} "
                         f"{x_q.dtype} and {tuple(w_q.shape)} {w_q.dtype}")
    if not config.fits(n, k):
        raise ValueError(f"config {config.label()} does not tile N={n}, K={k}")
    if not (x_q.is_contiguous() and w_q.is_contiguous()):
        raise ValueError("fp8_gemm needs contiguous x and W")
    if x_scale.numel() != m or w_scale.numel() != n:
        raise ValueError(f"scales: {x_scale.numel()} for {m} rows, {w_scale.numel()} for {n}")
    y = out if out is not None else torch.empty(m, n, dtype=torch.bfloat16, device=x_q.device)
    if m == 0:
        return y
    grid = (triton.cdiv(m, config.block_m) * (n // config.block_n),)
    _fp8_gemm_kernel[grid](
        x_q, w_q, x_scale.float().contiguous(), w_scale.float().contiguous(), y, m, n, k,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, STAGES=config.num_stages, num_warps=config.num_warps)
    return y


# ----------------------------------------------------------------------------------------------
# The shipped table
# ----------------------------------------------------------------------------------------------


def table_path(device_name: str) -> Path:
    name = device_name.lower().replace(" ", "_").replace("-", "_")
    return TABLES / f"fp8_gemm_{name}.json"


def parse_table(rows: Iterable[dict]) -> dict[tuple[int, int, int], Fp8GemmConfig]:
    """{(m_bucket, n, k): config} from the JSON rows (`to_rows`); rows without a config are
    buckets where cuBLAS won, kept in the file for the record."""
    out = {}
    for row in rows:
        if row.get("config"):
            out[(row["m_bucket"], row["n"], row["k"])] = Fp8GemmConfig(**row["config"])
    return out


def to_rows(entries: dict[tuple[int, int, int], Fp8GemmConfig | None],
            timings: dict[tuple[int, int, int], dict] | None = None) -> list[dict]:
    return [{"m_bucket": b, "n": n, "k": k, "config": asdict(c) if c else None,
             **(timings or {}).get((b, n, k), {})} for (b, n, k), c in sorted(entries.items())]


@functools.cache
def _table_for(device_name: str) -> dict[tuple[int, int, int], Fp8GemmConfig]:
    path = table_path(device_name)
    return parse_table(json.loads(path.read_text())) if path.exists() else {}


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def table(device: torch.device) -> dict[tuple[int, int, int], Fp8GemmConfig]:
    """The shipped table for this device's GPU model (empty for none, or off the GPU)."""
    if device.type != "cuda" or os.environ.get(NO_FP8_GEMM_ENV) == "1":
        return {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _table_for(_device_name(index))


def pick(m: int, n: int, k: int, device: torch.device) -> Fp8GemmConfig | None:
    """The measured launch shape for m rows of an [N, K] FP8 weight, or None (cuBLAS)."""
    bucket = m_bucket(m)
    return None if bucket is None else table(device).get((bucket, n, k))


def warmup(shapes: Iterable[tuple[int, int]], device: torch.device) -> None:
    """Compiles every config the table holds for these (N, K) weights, so neither a graph
    capture nor a mixed step of a new row count compiles on the serving path. Proxy weights
    of one column tile: the compiled variant does not depend on N, K or M."""
    shapes = set(shapes)
    for (bucket, n, k), cfg in table(device).items():
        if (n, k) not in shapes:
            continue
        x = torch.zeros(bucket, k, dtype=torch.float8_e4m3fn, device=device)
        w = torch.zeros(cfg.block_n, k, dtype=torch.float8_e4m3fn, device=device)
        fp8_gemm(x, torch.ones(bucket, device=device), w,
                 torch.ones(cfg.block_n, device=device), cfg)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
