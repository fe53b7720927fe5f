"""FP8-KV decode attention written in CUDA C++ (`csrc/fp8_decode.cu`), for Hopper.

Triton's FP8 decode kernel gathers V byte by byte (its P·V dot wants key pairs in a register
and the pool stores V key-major) and reaches ~2.6 TB/s of the H200's 4.2 at 1 000 sequences.
The CUDA kernel puts the keys where each MMA wants contiguous pairs (K as the first operand of
S^T = K·q^T, V^T as the first of O^T = V^T·P^T, key pairs interleaved by PRMT, P transposed by
movmatrix) and stages every warp's tiles four deep by cp.async: 4–15 % faster per launch at
66–1 000 sequences on the H200 (`benchmarks/fp8_decode_probe.py`, docs/kernels.md). It takes
the unsplit launches (one program per sequence and KV head: the large batches) of GQA groups up
to 4; a sliding window, a mixed batch's decodes and every other layout stay on Triton. It also
computes split plans (fewer sequences: a program per split, the last arrival merging the
partials in the Triton kernel's workspace), which the backend routes to it only where
`SPLIT_PLANS` says so: off, since on an H100 it was slower than Triton's split kernel in sum
(docs/kernels.md, "Split plans").

Compiled once per process by NVRTC (cubins cached on disk), loaded by the driver; no build
step. `PHASEFLIP_NO_CUDA_ATTENTION=1` turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

from phaseflip.kernels.attention_plan import DecodePlan
from phaseflip.kernels.cuda_rtc import CudaKernel, compile_cubin

log = logging.getLogger(__name__)

NO_CUDA_ATTENTION_ENV = "PHASEFLIP_NO_CUDA_ATTENTION"
SOURCE = Path(__file__).parent / "csrc" / "fp8_decode.cu"
HEAD_DIM = 128
MAX_GROUP = 8  # the MMA's N: query heads of one KV head (what the kernel computes)
ROUTED_MAX_GROUP = 4  # what it is given: at group 8 it was 4 % slower than Triton (H200)
WARPS, STAGES, TILE_BYTES = 4, 4, 4096  # as in the source (STAGES its default)
MERGE_BYTES = WARPS * 8 * (128 + 2) * 4  # the CTA's merge buffer reuses the rings
LOG2E = 1.4426950408889634
# Whether the backend gives the kernel split plans (the decode tail's few long sequences).
# Off: correct on an H100, but slower than Triton there at 2 and 9 splits (faster at 3).
SPLIT_PLANS = False


class CudaFp8Decode:
    """The compiled kernel of one device; `accepts` says which launches it takes."""

    def __init__(self, device: torch.device, options: tuple[str, ...] = (),
                 stages: int = STAGES, min_blocks: int = 1) -> None:
        """`stages` (tiles a warp stages, ≥ 2: the rings hold the merge buffer) and
        `min_blocks` (CTAs an SM the registers must allow) are build options."""
        if stages < 2:
            raise ValueError(f"stages {stages}: the merge needs {MERGE_BYTES} bytes of ring")
        build = (f"-DSTAGES={stages}", f"-DMIN_BLOCKS={min_blocks}")
        cubin = compile_cubin(SOURCE.read_text(), "fp8_decode",
                              options=("--use_fast_math", *build, *options))
        self._kernel = CudaKernel(cubin, "fp8_decode_async_kernel", device)
        self.shared = WARPS * stages * TILE_BYTES
        self._kernel.allow_shared(self.shared)

    @property
    def registers(self) -> int:
        return self._kernel.registers

    @classmethod
    def create(cls, device: torch.device) -> CudaFp8Decode | None:
        """The kernel for `device`, or None where it cannot run (not an sm_90 GPU, switched
        off, no NVRTC, a compile or load error: logged once, Triton serves instead)."""
        if os.environ.get(NO_CUDA_ATTENTION_ENV) == "1" or device.type != "cuda":
            return None
        if torch.cuda.get_device_capability(device) != (9, 0):
            return None
        try:
            return cls(device)
        except (OSError, RuntimeError) as exc:
            log.warning("CUDA FP8 decode attention unavailable, using Triton's: %s", exc)
            return None

    @staticmethod
    def accepts(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                out: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                order: torch.Tensor | None, sliding_window: int | None) -> bool:
        """Whether a decode launch has the layout the kernel reads and a group it is faster
        at: bf16 q [B, H, 128] with rows of heads, an e4m3 pool [slots, KVH, 128],
        H / KVH <= 4 (it computes up to 8), int64 indices, float32 scales, no window. The pool may
        be slot-major or head-major (`stride(1)` of a head): rows start on 16 bytes."""
        if sliding_window is not None or k_scale is None or v_scale is None:
            return False
        if q.dtype != torch.bfloat16 or out.dtype != torch.bfloat16:
            return False
        if k_cache.dtype != torch.float8_e4m3fn or v_cache.dtype != torch.float8_e4m3fn:
            return False
        if q.dim() != 3 or q.shape[2] != HEAD_DIM or k_cache.shape[2] != HEAD_DIM:
            return False
        heads, kv_heads = q.shape[1], k_cache.shape[1]
        if heads % kv_heads or heads // kv_heads > ROUTED_MAX_GROUP:
            return False
        if q.stride(2) != 1 or q.stride(1) != HEAD_DIM or out.stride(-1) != 1:
            return False
        for cache in (k_cache, v_cache):  # rows of 16-byte chunks (cp.async), any order
            if (cache.stride(2) != 1 or cache.stride(0) % 16 or cache.stride(1) % 16
                    or cache.data_ptr() % 16):
                return False
        ints = (kv_indptr, kv_indices) + (() if order is None else (order,))
        if any(t.dtype != torch.int64 for t in ints):
            return False
        return all(s.dtype == torch.float32 and s.is_contiguous() and s.numel() == kv_heads
                   for s in (k_scale, v_scale))

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 kv_indptr: torch.Tensor, kv_indices: torch.Tensor, k_scale: torch.Tensor,
                 v_scale: torch.Tensor, scale: float, out: torch.Tensor,
                 order: torch.Tensor | None = None, plan: DecodePlan | None = None,
                 workspace: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """out [B, H*128] (row b: sequence b) = attention of q row b over its context, one
        program per (KV head, sequence) in `order` (all B rows when None) and split of `plan`
        (unsplit when None). A split plan needs `workspace` (`decode_workspace` for the same
        plan: partials [B, H, S, 128], maxima and sums [B, H, S], int32 counters [B*H], zero
        and left zero), the layout the Triton kernel merges from."""
        seqs = q.shape[0] if order is None else order.numel()
        if seqs == 0:
            return out
        kv_heads = k_cache.shape[1]
        splits = 1 if plan is None else plan.num_splits
        if splits > 1:
            mid_o, mid_m, mid_l, locks = _split_workspace(workspace, q, kv_heads, splits)
        else:
            mid_o = mid_m = mid_l = locks = None  # unsplit: the output directly
        args = [q, k_cache, v_cache, kv_indptr, kv_indices, k_scale, v_scale, out,
                mid_o, mid_m, mid_l, locks,
                ctypes.c_float(scale * LOG2E), ctypes.c_int(q.shape[1] // kv_heads),
                ctypes.c_int(splits), ctypes.c_int(1 if plan is None else plan.min_chunk),
                ctypes.c_longlong(q.stride(0)), ctypes.c_longlong(k_cache.stride(0)),
                ctypes.c_longlong(v_cache.stride(0)), ctypes.c_longlong(out.stride(0)), order,
                ctypes.c_longlong(k_cache.stride(1)), ctypes.c_longlong(v_cache.stride(1))]
        self._kernel((kv_heads, seqs, splits), (32 * WARPS, 1, 1), args, shared=self.shared)
        return out


def _split_workspace(workspace: tuple[torch.Tensor, ...] | None, q: torch.Tensor,
                     kv_heads: int, splits: int) -> tuple[torch.Tensor, ...]:
    """A split launch's workspace, checked against the shapes the kernel indexes (it trusts
    them: a short buffer would be written past its end)."""
    if workspace is None:
        raise ValueError("a split plan needs its workspace (decode_workspace)")
    mid_o, mid_m, mid_l, locks = workspace
    seqs, heads = q.shape[0], q.shape[1]
    # [>= B, H, S]: the kernel's row stride is the split count, so S must be exact
    if (mid_m.dim() != 3 or mid_m.shape[0] < seqs or tuple(mid_m.shape[1:]) != (heads, splits)
            or mid_l.shape != mid_m.shape or mid_o.shape != (*mid_m.shape, HEAD_DIM)
            or locks.numel() < seqs * kv_heads or locks.dtype != torch.int32
            or any(t.dtype != torch.float32 for t in (mid_o, mid_m, mid_l))
            or any(not t.is_contiguous() or t.device != q.device
                   for t in (mid_o, mid_m, mid_l, locks))):
        raise ValueError(f"the workspace (partials {tuple(mid_o.shape)} {mid_o.dtype} on "
                         f"{mid_o.device}) does not hold {seqs} sequences x {heads} heads x "
                         f"{splits} splits on {q.device}")
    return mid_o, mid_m, mid_l, locks
