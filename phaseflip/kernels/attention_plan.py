"""Launch configuration and host-side planning for the attention kernels (`attention.py`).

Launch shapes per dtype (`decode_config`, `extend_config`; docs/kernels.md has the
measurements), the decode split plan, the extend tile list, and the checks and FP8 choices the
wrappers make before a launch. Host ints only: nothing here touches device data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# FP8 decode's default dot mode (FP8_DOT_MODES): fp16 won the H200 sweep of
# benchmarks/attention_kernels.py --kv-dtype fp8_e4m3 --sweep at every batch >= 64
FP8_DECODE_DOT = "fp16"
FP8_EXTEND_DOT = "fp16"  # extend's, likewise (benchmarks/attention_kernels.py times extend)


@dataclass(frozen=True)
class KernelConfig:
    block_m: int  # extend: packed rows per tile; decode: query-head rows per program (>= 16)
    block_n: int  # keys per inner-loop step
    num_warps: int
    num_stages: int
    # on an FP8 cache: the dtype of the dots (FP8_DOT_MODES); float caches ignore it
    fp8_dot: str = "q"


# "q": K and V widen to q's dtype (bf16: 3-4 conversion instructions per e4m3 pair on Hopper);
# "fp16_pv": K to q's dtype, V and the probabilities to fp16 (one conversion per pair);
# "fp16": q, K, V and the probabilities in fp16 (q shrunk into range when it must be).
FP8_DOT_MODES = ("q", "fp16_pv", "fp16")


def _on_gpu(device: torch.device) -> bool:
    return device.type == "cuda"


def decode_config(dtype: torch.dtype, head_dim: int, group: int, device: torch.device,
                  kv_dtype: torch.dtype | None = None) -> KernelConfig:
    """Decode launch shape for dots in `dtype` over a cache of `kv_dtype` (default: `dtype`).

    The head block pads the group to >= 16 rows (tl.dot's minimum). An FP8 cache with a
    16-bit q gets its own shape: its tiles are half the bytes and its widening costs
    conversions a float cache does not pay (FP8_DOT_MODES).
    """
    block_h = min(max(16, triton.next_power_of_2(group)), 64)
    fp8 = kv_dtype in _FP8 and dtype != torch.float32
    if not _on_gpu(device):  # interpreter: small key blocks so tiny tests cross blocks
        return KernelConfig(block_h, 16, 4, 1, FP8_DECODE_DOT if fp8 else "q")
    if dtype == torch.float32:
        return KernelConfig(block_h, 32, 4, 2)
    if fp8:  # H200 sweep (attention_kernels --kv-dtype fp8_e4m3 --sweep, 8B shape): 128 keys,
        # 4 warps, 3 stages, fp16 dots was fastest at batch 64/256, ctx 1k/4k: 67-781 us vs
        # 84-1003 for the bf16 pool (0.73-0.82x) and 91-1063 for the first FP8 shape
        return KernelConfig(block_h, 128, 4, 3, FP8_DECODE_DOT)
    # bf16, 8B shape, H200 (benchmarks/attention_kernels.py --sweep): 3 stages instead of 2
    # cut bs=256 ctx=1k from 360 to 265 us and bs=64 ctx=4k from 337 to 265 us.
    return KernelConfig(block_h, 64, 4, 3)


def extend_config(dtype: torch.dtype, head_dim: int, device: torch.device,
                  kv_dtype: torch.dtype | None = None) -> KernelConfig:
    """Extend tile shape, per dtype and head_dim (docs/kernels.md has the measurements).

    bf16/fp16 head_dim 128: 64x64 tiles, 3 stages, 4 warps measured fastest of five shapes on
    an H200 (8192-token prefill: 1.69 ms vs 2.34 ms for 128x64 / 2 stages). fp32 dots are IEEE
    (FMA units, no tensor cores), so fp32 tiles are small enough not to spill registers. An FP8
    cache (`kv_dtype`) with 16-bit q takes FP8_EXTEND_DOT's dot mode and, at head_dim 128,
    128x128 tiles: its K/V tiles are half the bytes, and on the H200 (8192-token prefill,
    `attention_kernels --sweep --quick --kv-dtype bf16 fp8_e4m3`) 128x128 / 8 warps / 2
    stages took 1.64 ms against 2.21 ms for the 64x64 bf16 shape (bf16 pool: 1.68 ms).
    """
    fp8 = kv_dtype in _FP8 and dtype != torch.float32
    mode = FP8_EXTEND_DOT if fp8 else "q"
    if not _on_gpu(device):
        return KernelConfig(16, 16, 4, 1, mode)
    if dtype == torch.float32:
        return KernelConfig(32, 32, 4, 2) if head_dim <= 64 else KernelConfig(32, 16, 8, 2)
    if head_dim <= 64:
        return KernelConfig(128, 64, 8, 3, mode)
    if fp8 and head_dim <= 128:  # (256: 256 KiB of shared memory, over the H200's 227)
        return KernelConfig(128, 128, 8, 2, mode)
    return KernelConfig(64, 64, 4, 3, mode)


_NUM_SMS: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    if not _on_gpu(device):
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


# Split-K bounds of a decode launch. H200, FP8 pool, 8B heads, one launch per layer in a CUDA
# graph (`benchmarks/decode_split_probe.py`, µs a launch): 1 x 1 056 keys 9.5 in 9 chunks of
# 128 keys, 12.3 in 4 of 256; 1 x 4 096 14.8 in 16 chunks, 17.8 in 32; 1 x 8 192 20.3 in 16,
# 21.7 in 32; 16 x 1 024 25.3 in 4, 27.0 in 8 (bf16 pool, 1 x 1 056: 11.0 in 9, 14.1 in 4).
# A CUDA graph plans for its longest context, and the splits past a sequence's last key exit
# at once, so these bounds are what a short context in a graph gets.
MIN_CHUNK = 128
MAX_SPLITS = 16


@dataclass(frozen=True)
class DecodePlan:
    """How a decode batch's contexts are cut into split-K chunks (host ints, no device data).

    Sequence b of length n (clipped to its window) is cut into chunks of
    `max(ceil(ceil(n / num_splits) / block_n) * block_n, min_chunk)` keys, computed in the
    kernel: the plan fixes only the launch shape, so it holds for any lengths below the
    `max_kv_len` it was planned for (CUDA graphs plan once for the longest context).
    """

    num_splits: int
    min_chunk: int  # keys; splits past a short sequence's end are empty


def plan_decode(
    batch_size: int,
    num_kv_heads: int,
    head_blocks: int,
    max_kv_len: int,
    sms: int,
    *,
    num_splits: int | None = None,
    min_chunk: int = MIN_CHUNK,
    max_splits: int = MAX_SPLITS,
) -> DecodePlan:
    """Pick the split count: enough programs for ~4 per SM, never chunks below `min_chunk`.

    Splitting costs a reduce launch and a float32 round trip of the partials, so large batches
    (which already have enough programs) run unsplit and write their output directly.
    `max_kv_len` is the longest attended range (already clipped to a sliding window).
    """
    max_kv_len = max(max_kv_len, 1)
    if num_splits is None:
        programs = batch_size * num_kv_heads * head_blocks
        want = math.ceil(4 * sms / programs)
        num_splits = max(1, min(want, math.ceil(max_kv_len / min_chunk), max_splits))
    return DecodePlan(num_splits=num_splits, min_chunk=min_chunk)


def orders_decode(batch_size: int, num_kv_heads: int, head_blocks: int, sms: int) -> bool:
    """Whether a decode launch should take its sequences longest first (`decode_order`).

    Only a grid of several waves has a tail to shorten: on the H200 (ShareGPT-like contexts,
    one 8B layer; docs/kernels.md, "Decode launch order") head-major launch with the longest
    first took 104 against 133 us at 300 sequences (FP8 pool) and 333 against 359 us at
    1 000, and nothing at 32, where the sort (16-46 us a step) would buy nothing.
    """
    return batch_size * num_kv_heads * head_blocks > 2 * sms


def extend_tiles(extend_lens: list[int], prefix_lens: list[int], group: int, block_m: int
                 ) -> list[list[int]]:
    """Host tile list `[seq_ids, row_starts]` for the extend kernel, heaviest tiles first.

    A tile's work is its last query position (keys it reads); launching the longest tiles
    first keeps the causal triangle's big tiles off the grid's tail.
    """
    work: list[tuple[int, int, int]] = []
    for i, (ext, pre) in enumerate(zip(extend_lens, prefix_lens)):
        rows = ext * group
        for r0 in range(0, rows, block_m):
            last = pre + (min(r0 + block_m, rows) - 1) // group
            work.append((-last, i, r0))
    work.sort()
    return [[w[1] for w in work], [w[2] for w in work]]


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs must not be rounded to tf32 (the fp32 path is held to 1e-5 of the reference).
    return "ieee" if dtype == torch.float32 else "tf32"


def compute_dtype(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> torch.dtype:
    """The dtype the dots run in: the cache's, or q's when the cache is FP8 (widened on load)."""
    return q_dtype if kv_dtype in _FP8 else kv_dtype


def fp8_scales(q: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor | None,
               v_scale: torch.Tensor | None) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """(is FP8, K scale, V scale) for a launch; a float cache gets q as unread stand-ins."""
    if k_cache.dtype not in _FP8:
        return False, q, q
    if k_scale is None or v_scale is None or k_scale.numel() != k_cache.shape[1] \
            or v_scale.numel() != k_cache.shape[1]:
        raise ValueError("an FP8 KV cache needs k_scale and v_scale, one per KV head")
    return True, k_scale, v_scale


def fp8_dot_mode(cfg: KernelConfig, kv_fp8: bool, dtype: torch.dtype) -> str:
    """The FP8_DOT a launch compiles: the config's on an FP8 cache with 16-bit q, else "q"
    (float pools ignore it; float32 q keeps IEEE float32 dots)."""
    if cfg.fp8_dot not in FP8_DOT_MODES:
        raise ValueError(f"fp8_dot {cfg.fp8_dot!r}: expected one of {FP8_DOT_MODES}")
    return cfg.fp8_dot if kv_fp8 and dtype != torch.float32 else "q"


def check_layout(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
                 ) -> tuple[int, int]:
    """(group, head_dim) of q [T, H, D] over caches [slots, KVH, D]; refuses other layouts."""
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise ValueError("q must be [T, H, D] and k/v caches [slots, KVH, D]")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads or k_cache.shape[2] != head_dim:
        raise ValueError(f"bad head layout: q {tuple(q.shape)}, kv {tuple(k_cache.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k/v caches must be contiguous in head_dim")
    return num_heads // num_kv_heads, head_dim
