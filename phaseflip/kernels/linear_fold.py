"""Folds: the elementwise neighbours of a decode linear done inside the skinny GEMM's launch.

At batch 1 a decoder layer's RMSNorms and SiLU·mul are launch-bound kernels (~2 µs each on an
H200 for a few KB of data: 0.18 of a 2.7 ms FP8 step), between GEMMs that stream megabytes.
The skinny kernel's elementwise loop reads x from L1/L2 at every K step anyway, so it can
apply the norm or the SiLU to what it reads, and add the residual at its store
(`kernels/linear.py`, `_skinny_kernel`'s PRO and HAS_RES); `model/llama.py` folds a layer so
when a step has few rows on one process.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from phaseflip.kernels.linear_configs import SkinnyConfig, ew_config

FOLD_MAX_M = 8  # the elementwise loop's rows
NORM_FOLD_MAX_M = 2  # rows whose sums of squares the loop carries (one [BLOCK_K] sum each)
# Rows up to which folding the norm pays. H200, 8B projections of 8 layers in one CUDA graph
# (`benchmarks/fold_probe.py`, µs a layer): FP8 at 1 row 65.0 unfolded, 63.1 folded, 64.3
# with the norms as kernels; at 2 rows 70.9, 79.9 and 69.8 (the sums of squares cost the
# loop registers). bf16: 114.5 / 112.4 / 114.8 at 1 row, 116.5 / 126.8 / 116.7 at 2.
NORM_FOLD_PAYS_M = 1


@dataclass(frozen=True)
class RotaryFold:
    """The qkv projection's epilogue at a few decode rows: rotary on q and k and the K/V store
    into one layer of the pool, what `kernels.rope.rotary_store_kv` does after the GEMM (and
    bitwise so), without its launch. The output [M, (H + 2 KVH) * D] then holds q rotated
    and k, v unrotated, as after that kernel. Full rotary only (head_dim = 2 * half)."""

    positions: torch.Tensor  # [M] int64, covered by the tables
    cos: torch.Tensor  # float32 [max_pos, half] (`RotaryEmbedding.cos_cache`)
    sin: torch.Tensor
    slots: torch.Tensor  # [M] pool rows (`out_cache_loc`)
    k_cache: torch.Tensor  # [slots, KVH, D], one layer of `KVPool`
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None  # [KVH] float32: an FP8 pool's per-head scales
    v_scale: torch.Tensor | None
    num_q_heads: int

    def check(self, m: int, n: int) -> None:
        half = self.cos.shape[1] if self.cos.dim() == 2 else 0
        kv_heads = self.k_cache.shape[1] if self.k_cache.dim() == 3 else 0
        if (self.cos.shape != self.sin.shape or self.cos.stride() != self.sin.stride()
                or self.cos.dim() != 2 or self.cos.stride(-1) != 1 or half == 0):
            raise ValueError("the rotary fold needs float32 [max_pos, half] cos/sin tables")
        if (self.k_cache.dim() != 3 or self.k_cache.shape[2] != 2 * half
                or self.v_cache.shape != self.k_cache.shape
                or self.v_cache.stride() != self.k_cache.stride()
                or self.k_cache.stride(-1) != 1):
            raise ValueError(f"the rotary fold needs [slots, KVH, {2 * half}] pool rows "
                             f"(full rotary), got {tuple(self.k_cache.shape)}")
        if n != (self.num_q_heads + 2 * kv_heads) * 2 * half:
            raise ValueError(f"qkv has {n} columns, not ({self.num_q_heads} + 2 x {kv_heads}) "
                             f"heads of {2 * half}")
        if self.positions.shape != (m,) or self.slots.shape != (m,):
            raise ValueError(f"the rotary fold needs {m} positions and {m} slots")
        fp8 = self.k_cache.element_size() == 1  # (float pools are 2 or 4 bytes a value)
        if fp8 != (self.k_scale is not None) or fp8 != (self.v_scale is not None):
            raise ValueError("an FP8 pool needs k_scale and v_scale (and a float pool neither)")

    def args(self) -> tuple[tuple, tuple]:
        """The kernel's (pointers, scalars) for `rope.store_rotary_fold`."""
        fp8 = self.k_scale is not None
        pointers = (self.positions, self.slots, self.cos, self.sin, self.k_cache, self.v_cache,
                    self.k_scale if fp8 else self.k_cache, self.v_scale if fp8 else self.v_cache)
        scalars = (self.cos.shape[1], self.num_q_heads, self.k_cache.shape[1],
                   self.cos.shape[0], self.cos.stride(0), self.k_cache.stride(0),
                   self.k_cache.stride(1),
                   float(torch.finfo(self.k_cache.dtype).max) if fp8 else 0.0)
        return pointers, scalars


@dataclass(frozen=True)
class Fold:
    """What one launch does around its GEMM for a few rows of 16-bit x (the ew loop), so
    that a batch-1 decode layer runs no norm or SiLU kernel of its own (launch-bound there).

    `norm_weight` (M <= 2): x is the residual stream and the GEMM reads RMSNorm(x) * weight,
    the mean square summed in the loop and applied at the store, in float32 (the norm
    kernel rounds its output to x's dtype first: the products differ by that rounding).
    `silu_mul`: W is [gate; up] (2I rows, no bias) and the launch writes silu(gate) * up
    [M, I], each program pairing gate row j with up row j so the SiLU runs once per output
    element, from the products rounded as the GEMM and the SiLU kernel would round them
    (bitwise those two kernels). `residual` [M, N]: y = round(x W^T) + residual, rounded as
    the fused add-norm kernel adds (may be `out` itself). `rotary`: qkv's rotary and KV store
    (`RotaryFold`).
    """

    norm_weight: torch.Tensor | None = None
    eps: float = 0.0
    silu_mul: bool = False
    residual: torch.Tensor | None = None
    rotary: RotaryFold | None = None

    @property
    def active(self) -> bool:
        return (self.norm_weight is not None or self.silu_mul or self.residual is not None
                or self.rotary is not None)

    @property
    def tag(self) -> str:
        """What the launch folds ("norm+silu", "res", ...): its key in the tuned table."""
        parts = (("norm", self.norm_weight is not None), ("silu", self.silu_mul),
                 ("res", self.residual is not None), ("rope", self.rotary is not None))
        return "+".join(name for name, on in parts if on)

    def rotary_args(self, stand_in: torch.Tensor) -> tuple[tuple, tuple]:
        """The kernel's RP / RI tuples (`stand_in` fills the unread pointers)."""
        if self.rotary is None:
            return (stand_in,) * 8, (0,) * 7 + (0.0,)
        return self.rotary.args()

    def check(self, x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              out: torch.Tensor, fp8_x: bool) -> None:
        """The fold's operand rules (x2: x as rows)."""
        if not self.active:
            return
        m, k = x2.shape
        if fp8_x or m > FOLD_MAX_M or (self.norm_weight is not None and m > NORM_FOLD_MAX_M):
            raise ValueError(f"folds take 16-bit x of at most {FOLD_MAX_M} rows "
                             f"({NORM_FOLD_MAX_M} with a norm)")
        if self.silu_mul and (weight.shape[0] % 2 or bias is not None
                              or self.residual is not None):
            raise ValueError("SiLU·mul needs [gate; up] weights (an even row count), no bias "
                             "and no residual")
        if self.rotary is not None:
            if self.silu_mul or self.residual is not None:
                raise ValueError("the rotary fold takes neither SiLU·mul nor a residual")
            self.rotary.check(m, weight.shape[0])
        if self.norm_weight is not None and (self.norm_weight.shape != (k,)
                                             or not self.norm_weight.is_contiguous()):
            raise ValueError(f"the norm weight must be a contiguous [{k}]")
        r = self.residual
        if r is not None and (r.shape != out.shape or r.dtype != out.dtype
                              or r.stride(-1) != 1 or (r.dim() > 2 and not r.is_contiguous())):
            raise ValueError(f"the residual must be {tuple(out.shape)} of dtype {out.dtype}, "
                             f"contiguous in N")

    def rows(self, m: int, n: int) -> Fold:
        """The fold with its residual as 2-D rows [M, N]."""
        if self.residual is None or self.residual.dim() == 2:
            return self
        return replace(self, residual=self.residual.reshape(m, n))

    def config(self, cfg: SkinnyConfig, m: int, n: int, k: int, dtype: torch.dtype,
               device: torch.device) -> SkinnyConfig:
        """A launch shape the fold runs in: the elementwise loop, unsplit under a norm."""
        if not self.active:
            return cfg
        if cfg.loop != "ew":
            cfg = ew_config(m, n, k, dtype, device)
        return replace(cfg, split_k=1) if self.norm_weight is not None else cfg


NO_FOLD = Fold()
