"""Rotary position embeddings, numerically identical to transformers.

The inverse frequencies are computed with the same float32 operations, in the same order, as
`transformers.modeling_rope_utils` (5.x), so checkpoints fine-tuned under HF see exactly the
angles they were trained with. Applying them follows HF's "rotate_half" (non-interleaved)
convention and its casting (cos/sin in float32, times attention_scaling, cast to the activation
dtype, then `x * cos + rotate_half(x) * sin` in that dtype), so bf16 outputs match HF bit for bit.

Dynamic NTK ("dynamic"): transformers starts from the plain frequencies and, whenever a forward
pass sees a sequence longer than max_position_embeddings, recomputes them for that length and
applies them to every position of that pass. That is incompatible with a KV cache (keys cached
under the old frequencies are never re-rotated; HF has the same inconsistency), and makes a
token's encoding depend on the other requests of the batch. We therefore keep the frequencies
transformers uses for sequences <= max_position_embeddings (== "default") for all positions:
identical to HF within the trained context, and no rescaling beyond it. `rope_inv_freq(...,
seq_len=n)` still exposes HF's rescaled frequencies for a given length.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from phaseflip.model.rope_config import SUPPORTED_ROPE_TYPES, RopeConfig

if TYPE_CHECKING:
    from phaseflip.cache.kv_pool import KVPool

log = logging.getLogger(__name__)

# Whether the fused in-place kernel (`phaseflip.kernels.rope`, imported on first use) can rotate
# CUDA tensors; elsewhere the torch code below runs.
HAS_TRITON = importlib.util.find_spec("triton") is not None


def rope_inv_freq(
    rope: RopeConfig,
    head_dim: int,
    max_position_embeddings: int,
    *,
    seq_len: int | None = None,
) -> tuple[torch.Tensor, float]:
    """(inv_freq float32 [rotary_dim//2], attention_scaling) exactly as transformers computes them.

    Computed on CPU, as transformers does when it initialises the rotary buffers, so the values
    do not depend on the accelerator's pow/division rounding. `seq_len` only matters for
    "dynamic" (HF's rescaling for a sequence of that length; None means
    max_position_embeddings, i.e. the plain frequencies).
    """
    if rope.rope_type not in SUPPORTED_ROPE_TYPES:
        supported = ", ".join(SUPPORTED_ROPE_TYPES)
        raise ValueError(f"unsupported rope type {rope.rope_type!r}; supported: {supported}")
    dim = int(head_dim * rope.partial_rotary_factor)
    base = rope.theta

    def plain(base: float) -> torch.Tensor:
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float)
        return 1.0 / (base ** (exponents / dim))

    if rope.rope_type == "default":
        return plain(base), 1.0

    if rope.rope_type == "linear":
        inv_freq = plain(base)
        inv_freq /= rope.factor
        return inv_freq, 1.0

    if rope.rope_type == "dynamic":
        length = max_position_embeddings
        if seq_len is not None:
            length = max(seq_len, max_position_embeddings)
        factor = rope.factor
        base = base * ((factor * length / max_position_embeddings) - (factor - 1)) ** (
            dim / (dim - 2)
        )
        return plain(base), 1.0

    if rope.rope_type == "llama3":
        return _llama3_inv_freq(rope, plain(base), max_position_embeddings), 1.0

    return _yarn_inv_freq(rope, dim, max_position_embeddings)


def _llama3_inv_freq(
    rope: RopeConfig, inv_freq: torch.Tensor, max_position_embeddings: int
) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling (transformers `_compute_llama3_parameters`)."""
    if rope.low_freq_factor is None or rope.high_freq_factor is None:
        raise ValueError("llama3 rope needs low_freq_factor and high_freq_factor")
    factor = rope.factor
    low_freq_factor = rope.low_freq_factor
    high_freq_factor = rope.high_freq_factor
    old_context_len = rope.original_max_position_embeddings or max_position_embeddings

    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed_inv_freq = (
        (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    )
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def _yarn_inv_freq(
    rope: RopeConfig, dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """YaRN (transformers `_compute_yarn_parameters`, 5.x semantics: an explicit `factor` is
    used as is, even when original_max_position_embeddings implies another ratio)."""
    base = rope.theta
    original_max = rope.original_max_position_embeddings or max_position_embeddings
    factor = rope.factor

    def get_mscale(scale: float, mscale: float = 1) -> float:
        if scale <= 1:
            return 1.0
        return 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = float(
                get_mscale(factor, rope.mscale) / get_mscale(factor, rope.mscale_all_dim)
            )
        else:
            attention_factor = get_mscale(factor)

    beta_fast = rope.beta_fast or 32
    beta_slow = rope.beta_slow or 1
    truncate = True if rope.truncate is None else rope.truncate

    def find_correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low = find_correction_dim(beta_fast)
    high = find_correction_dim(beta_slow)
    if truncate:
        low = math.floor(low)
        high = math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # prevent singularity

    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp.to(dtype=torch.float)
    inv_freq = (
        inv_freq_interpolation * (1 - extrapolation_factor)
        + inv_freq_extrapolation * extrapolation_factor
    )
    return inv_freq, attention_factor


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF's non-interleaved rotation: (x1, x2) -> (-x2, x1) over the two halves."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [..., heads, head_dim] by cos/sin [..., rotary_dim] (already in x.dtype).

    With partial rotary (rotary_dim < head_dim) only the leading rotary_dim channels rotate,
    the rest pass through, as in HF's partial-rotary models.
    """
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return (x * cos) + (rotate_half(x) * sin)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat(((x_rot * cos) + (rotate_half(x_rot) * sin), x_pass), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k at given positions, from a float32 cos/sin cache.

    The cache holds `cos(pos * inv_freq) * attention_scaling` (and sin) for positions
    [0, max_position_embeddings), i.e. exactly the float32 values HF computes per forward pass;
    it is built on `device` (default: the current default device), so construct the module on
    the device it will run on for bit parity with HF there (cos/sin rounding differs between
    CPU and CUDA). Positions beyond the cache grow it (to the next power of two).
    """

    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    inv_freq: torch.Tensor

    def __init__(
        self,
        rope: RopeConfig,
        head_dim: int,
        max_position_embeddings: int,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        inv_freq, attention_scaling = rope_inv_freq(rope, head_dim, max_position_embeddings)
        target = torch.device(device) if device is not None else torch.empty(0).device
        self.rope = rope
        self.head_dim = head_dim
        self.rotary_dim = 2 * inv_freq.numel()
        self.attention_scaling = attention_scaling
        self.max_position_embeddings = max_position_embeddings
        self.register_buffer("inv_freq", inv_freq.to(target), persistent=False)
        cos, sin = self._build_cache(max_position_embeddings)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)
        # (positions tensor, its _version) whose bound was last checked: every layer gets the
        # same positions tensor in a step, so the device sync to read its max happens once.

    @property
    def cache_len(self) -> int:
        return self.cos_cache.shape[0]

    def _build_cache(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Half-width tables [length, rotary_dim // 2]; HF's cat((freqs, freqs)) duplicates
        them, which `cos_sin` does after the gather to halve the cache's memory."""
        device = self.inv_freq.device
        positions = torch.arange(length, dtype=torch.int64, device=device)
        freqs = positions[:, None].float() * self.inv_freq.to(dtype=torch.float)[None, :]
        return freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling

    def ensure_capacity(self, num_positions: int) -> None:
        """Makes the cache cover positions [0, num_positions). Call it before capturing a CUDA
        graph (forward cannot grow the cache during capture)."""
        if num_positions <= self.cache_len:
            return
        if self.rope.rope_type == "dynamic" and self.cache_len <= self.max_position_embeddings:
            log.warning(  # once: the cache only grows
                "dynamic RoPE: positions past max_position_embeddings %d keep the unscaled "
                "frequencies (no NTK rescaling here; transformers rescales every position of a "
                "longer sequence): outputs there differ from transformers and may degrade",
                self.max_position_embeddings)
        length = 1 << (num_positions - 1).bit_length()
        self.cos_cache, self.sin_cache = self._build_cache(length)

    def cos_sin(
        self,
        positions: torch.Tensor,
        dtype: torch.dtype,
        *,
        max_position: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [*positions.shape, rotary_dim] in `dtype`, shareable across layers.

        `max_position` (largest position in `positions`, known on the host to whoever built
        the batch) grows the cache when needed; without it the cache must already cover the
        positions (`ensure_capacity`), which keeps this free of device syncs and graph-safe.
        """
        if max_position is not None:
            self.ensure_capacity(max_position + 1)
        cos = self.cos_cache[positions]
        sin = self.sin_cache[positions]
        cos = torch.cat((cos, cos), dim=-1).to(dtype)
        sin = torch.cat((sin, sin), dim=-1).to(dtype)
        return cos, sin

    def uses_kernel(self, x: torch.Tensor) -> bool:
        """Whether `rotate_` runs the fused Triton kernel on tensors like x (CUDA + triton)."""
        return HAS_TRITON and x.is_cuda

    def for_batch(
        self, positions: torch.Tensor, dtype: torch.dtype, *, max_position: int | None = None
    ) -> RotaryBatch:
        """The rotary inputs of one forward, shared by all its layers.

        Grows the cache on the host when `max_position` needs it (so never inside a kernel or a
        graph replay); the torch path also gathers cos/sin once here, in `dtype`, while the
        kernel path gathers them per layer inside the kernel.
        """
        if self.uses_kernel(positions):
            if max_position is not None:
                self.ensure_capacity(max_position + 1)
            return RotaryBatch(self, positions, None)
        cos_sin = self.cos_sin(positions, dtype, max_position=max_position)
        return RotaryBatch(self, positions, cos_sin)

    def rotate_(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated (q [T, H, D], k [T, KVH, D]) at `positions` [T], the cache covering them.

        On CUDA with triton q and k are rotated IN PLACE (they may be views of the fused qkv
        output) and returned; otherwise `apply_rotary` makes new ones from `cos_sin` (as
        `cos_sin()` returns it; gathered here in q's dtype when None). Both are bit-identical.
        """
        if self.uses_kernel(q) and q.dim() == k.dim() == 3:
            from phaseflip.kernels.rope import apply_rotary_inplace

            return apply_rotary_inplace(q, k, positions, self.cos_cache, self.sin_cache)
        cos, sin = cos_sin if cos_sin is not None else self.cos_sin(positions, q.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def rotate_and_store_(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        pool: KVPool,
        layer_id: int,
        slots: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Rotates q and k and writes k, v into `pool` rows `slots` of `layer_id`; returns q.

        On CUDA with triton one fused launch (`kernels.rope.rotary_store_kv`) rotates q IN
        PLACE and writes the rotated k straight into the pool (k itself stays unrotated);
        elsewhere `rotate_` then `KVPool.store` (the reference). The pool rows and q are
        bit-identical either way, FP8 pools included.
        """
        if self.uses_kernel(q) and q.dim() == k.dim() == v.dim() == 3:
            from phaseflip.kernels.rope import rotary_store_kv

            k_cache, v_cache = pool.layer(layer_id)
            k_scale, v_scale = pool.scales(layer_id) or (None, None)
            return rotary_store_kv(q, k, v, positions, self.cos_cache, self.sin_cache, slots,
                                   k_cache, v_cache, k_scale, v_scale)
        q, k = self.rotate_(q, k, positions, cos_sin)
        pool.store(layer_id, slots, k, v)
        return q

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        max_position: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [T]; q [T, num_heads, head_dim]; k [T, num_kv_heads, head_dim].

        Returns rotated (q, k) in their own dtypes.
        """
        cos, sin = self.cos_sin(positions, q.dtype, max_position=max_position)
        q_out = apply_rotary(q, cos, sin)
        if k.dtype != q.dtype:
            cos, sin = self.cos_sin(positions, k.dtype, max_position=max_position)
        return q_out, apply_rotary(k, cos, sin)

    def extra_repr(self) -> str:
        return (
            f"type={self.rope.rope_type}, head_dim={self.head_dim}, "
            f"rotary_dim={self.rotary_dim}, cache_len={self.cache_len}"
        )


@dataclass(frozen=True)
class RotaryBatch:
    """RoPE state of one forward pass, handed to every layer: the positions and, on the torch
    path, the cos/sin rows gathered once for all layers (None on the kernel path)."""

    rope: RotaryEmbedding
    positions: torch.Tensor
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None

    def rotate_(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """See `RotaryEmbedding.rotate_`: in place on CUDA, new tensors otherwise."""
        return self.rope.rotate_(q, k, self.positions, self.cos_sin)

    def rotate_and_store_(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          pool: KVPool, layer_id: int, slots: torch.Tensor) -> torch.Tensor:
        """See `RotaryEmbedding.rotate_and_store_`: rotated q, the new K/V in the pool."""
        return self.rope.rotate_and_store_(q, k, v, self.positions, pool, layer_id, slots,
                                           self.cos_sin)
