"""Launch configs of the skinny GEMM (`kernels/linear.py`): the dispatch cut-overs, the
heuristic table, the measured overrides in `TUNED` (filled by `linear_tune.tune` on the GPU or
loaded from its JSON; shipped tables per GPU model in assets/kernel_configs), and the pick.
Kept apart from the kernel so each file reads on its own."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import triton

# should_use_skinny's M cut-over, from benchmarks/linear_kernels.py --tune on an H200 (the
# largest M at which the tuned kernel still beats cuBLAS in a CUDA graph at every M below it):
# qkv and down win at M <= 2 (1.05-1.21x), gate_up ties cuBLAS (1.03x at M = 1).
SKINNY_MAX_M = 2
# Largest M the kernel accepts at all (BLOCK_M = next power of two of M, one M tile: each
# program reads its W tile once for every row). 16-bit x hands over to cuBLAS far below it
# (`MAX_M_BY_SHAPE`); FP8 W8A8 rows may use it up to `model.quant.fp8.FP8_SKINNY_MAX_M`.
KERNEL_MAX_M = 128
# Per-(N, K) cut-overs measured on the target GPU override SKINNY_MAX_M; empty until measured.
MAX_M_BY_SHAPE: dict[tuple[int, int], int] = {
    (4096, 4096): 32,  # Llama/Qwen3-8B o_proj: 1.07-1.23x up to M = 32
    (128256, 4096): 32,  # Llama-3 lm_head: 1.02-1.04x up to M = 32
}
# Tuned tables shipped per GPU model (`load_bundled_configs`).
BUNDLED_CONFIGS = Path(__file__).resolve().parent.parent / "assets" / "kernel_configs"

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
    """Configs are chosen per power-of-two bucket of M (1, 2, 4, ..., KERNEL_MAX_M)."""
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
                   sms: int | None = None, w8a8: bool = False) -> SkinnyConfig:
    """Heuristic launch shape per M bucket (before/without `tune`; shapes from the table above).

    M = 1: ew 8 rows x 1024 columns. M = 2: ew 8 x 512. M >= 4: dot 32 x 128, 4 stages (the
    tensor cores' 16-row padding costs nothing at this arithmetic intensity, and cp.async
    pipelining keeps more bytes in flight than ew's registers can). W8A8 (FP8 x and W), every
    M: dot 128 x 128, 8 warps (up to 40 % slower than the tuned H200 entries for the 8B shapes,
    which ship in the table).
    Split-K from `auto_split` for `sms` SMs (default: the device's).
    """
    bucket = m_bucket(m)
    if device.type != "cuda":  # interpreter: small blocks so tiny test shapes cross blocks
        return SkinnyConfig(16, 32, 4, 1, 1, "dot" if bucket >= 16 or w8a8 else "ew")
    half = 2 if dtype == torch.float32 else 1
    if w8a8:
        cfg = SkinnyConfig(128, 128, 8, 4, 1, "dot")
    elif bucket == 1 and dtype.itemsize == 1:  # FP8 W: twice the rows for bf16's bytes in flight
        cfg = SkinnyConfig(16, 1024, 4, 1, 1, "ew")
    elif bucket == 1:
        cfg = SkinnyConfig(8, 1024 // half, 4, 1, 1, "ew")
    elif bucket == 2:
        cfg = SkinnyConfig(8, 512 // half, 4, 1, 1, "ew")
    else:
        cfg = SkinnyConfig(32, 128 // half, 4, 4, 1, "dot")
    sms = sms or num_sms(device)
    return replace(cfg, split_k=auto_split(n, k, cfg.block_n, cfg.block_k, sms))


def ew_config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, *,
              sms: int | None = None) -> SkinnyConfig:
    """The heuristic's first elementwise-loop shape for M <= 8 rows (what a launch that must
    run that loop gets where the pick is the tensor-core loop), split as `default_config`."""
    bn, bk, warps, stages = _EW_SHAPES[m_bucket(m)][0]
    bk //= 2 if dtype == torch.float32 else 1
    return SkinnyConfig(bn, bk, warps, stages,
                        auto_split(n, k, bn, bk, sms or num_sms(device)), "ew")


def candidate_configs(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, *,
                      sms: int | None = None, w8a8: bool = False) -> list[SkinnyConfig]:
    """The sweep `tune` times for one (M bucket, N, K): the shapes above (ew for M <= 8, dot
    for all; dot only for W8A8), each with split-K {1, 2, 3, 4, 6, 8, auto, 2x auto} (as
    many distinct chunkings as those give). Two compiled variants per shape (split or not):
    the split count is a runtime argument, so the extra counts cost timing, not compiles.
    Why the small counts: `auto_split` aims at ~4 programs an SM, but a dot tile with 3-4
    stages holds 64-100 KB of shared memory, so 2 fit an SM, and a grid of 3-4 an SM runs
    in two waves (the 8B qkv at 16-64 rows: 96 tiles of 64 rows, whose one-wave split is 2,
    never timed before)."""
    bucket = m_bucket(m)
    half = 2 if dtype == torch.float32 else 1
    sms = sms or num_sms(device)
    out: list[SkinnyConfig] = []
    ew = [] if w8a8 else _EW_SHAPES.get(bucket, [])
    for loop, shapes in (("ew", ew), ("dot", _DOT_SHAPES)):
        if dtype.itemsize == 1:  # FP8 W: the same bytes per tile hold twice the K columns
            shapes = shapes + [(bn, 2 * bk, w, s) for bn, bk, w, s in shapes if bk <= 1024]
        for bn, bk, warps, stages in shapes:
            bk //= half
            auto = auto_split(n, k, bn, bk, sms)
            chunkings: set[int] = set()
            for split in sorted({1, 2, 3, 4, 6, 8, auto, min(2 * auto, 16)}):
                chunks = plan_splits(k, bk, split)[0]
                if chunks not in chunkings and (split == 1 or chunks > 1):
                    chunkings.add(chunks)
                    out.append(SkinnyConfig(bn, bk, warps, stages, split, loop))
    return list(dict.fromkeys(out))


# The table's name for launches whose x is FP8 too (W8A8), beside the weight dtype's name.
W8A8_SUFFIX = "+a8"


# ... and its suffix for a folded launch (`linear_fold.Fold.tag`: "+fold:norm+rope", ...)
FOLD_SUFFIX = "+fold:"


class ConfigTable:
    """Measured best configs keyed by (M bucket, N, K, dtype name); overrides the heuristic.
    The dtype name is the weight's, with `W8A8_SUFFIX` when x is FP8 as well and
    `FOLD_SUFFIX` + the fold's tag for a folded launch (its own loop body, its own best)."""

    def __init__(self) -> None:
        self.entries: dict[tuple[int, int, int, str], SkinnyConfig] = {}

    @staticmethod
    def key(m: int, n: int, k: int, dtype: torch.dtype, w8a8: bool = False, fold: str = ""
            ) -> tuple[int, int, int, str]:
        name = str(dtype).removeprefix("torch.") + (W8A8_SUFFIX if w8a8 else "")
        return (m_bucket(m), n, k, name + (FOLD_SUFFIX + fold if fold else ""))

    def get(self, m: int, n: int, k: int, dtype: torch.dtype, w8a8: bool = False,
            fold: str = "") -> SkinnyConfig | None:
        return self.entries.get(self.key(m, n, k, dtype, w8a8, fold))

    def put(self, m: int, n: int, k: int, dtype: torch.dtype, cfg: SkinnyConfig,
            w8a8: bool = False, fold: str = "") -> None:
        self.entries[self.key(m, n, k, dtype, w8a8, fold)] = cfg

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


def card_name(device_name: str) -> str:
    """A GPU model's name as the shipped tables spell it ("NVIDIA H100 80GB HBM3" ->
    "nvidia_h100_80gb_hbm3")."""
    return device_name.lower().replace(" ", "_").replace("-", "_")


def skinny_table_path(device_name: str) -> Path:
    """Where the skinny GEMM's tuned table for a GPU model ships (it may not exist)."""
    return BUNDLED_CONFIGS / f"skinny_linear_{card_name(device_name)}.json"


def load_bundled_configs(device: torch.device) -> Path | None:
    """Merges the tuned table shipped for this GPU model (e.g. skinny_linear_nvidia_h200.json)
    into `TUNED`; returns its path, or None when none ships (the heuristic then decides)."""
    if device.type != "cuda":
        return None
    path = skinny_table_path(torch.cuda.get_device_name(device))
    if not path.exists():
        return None
    TUNED.load(path)
    return path


def pick_config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, *,
                w8a8: bool = False, fold: str = "") -> SkinnyConfig:
    """The tuned entry, else the heuristic (`dtype`: the weight's; `w8a8`: x is FP8 too;
    `fold`: a folded launch's tag, whose own entry comes first)."""
    return ((fold and TUNED.get(m, n, k, dtype, w8a8, fold)) or TUNED.get(m, n, k, dtype, w8a8)
            or default_config(m, n, k, dtype, device, w8a8=w8a8))


def should_use_skinny(m: int, n: int, k: int) -> bool:
    """Dispatch rule for a CUDA linear: skinny kernel for 1 <= M <= the measured cut-over, and
    only when rows of W are 16-byte aligned (K % 8 == 0), which its vector loads rely on."""
    limit = min(MAX_M_BY_SHAPE.get((n, k), SKINNY_MAX_M), KERNEL_MAX_M)
    return 1 <= m <= limit and k % 8 == 0
