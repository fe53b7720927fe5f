"""Building blocks whose parameters know how to take their own shard of a checkpoint tensor.

Every parallel layer is told its tensor-parallel rank and size by a `Layout`; each parameter
carries a `weight_loader(param, loaded, shard_id=None)` that slices the full checkpoint tensor
to this rank's part. With `tp_size == 1` the slices are the whole tensors and the collectives
are identities, so the single-process path is the general path.

`RMSNorm` and `SiluAndMul` run fused Triton kernels (`phaseflip.kernels`) on CUDA tensors when
triton is installed, and the torch code (`forward_native`, the oracle) everywhere else.
Asked to (`quantize=True`, when the FP8 linear they feed says `takes_fp8_input`), those kernels
also quantize their output per token and hand the linear an `Fp8Activation` in its place.
`RMSNorm`'s residual add also takes an FP8 linear's product before its scales (`ScaledRows`,
from `RowParallelLinear(fold=True)`) and applies them in the same pass.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from phaseflip.kernels.gemm_rows import gemm_rows, padded_view
from phaseflip.layout import Layout
from phaseflip.model.quant import FP8_DTYPE, Fp8Config, scaled_linear
from phaseflip.model.quant.fp8 import (
    Fp8Activation,
    ScaledRows,
    quantizes_rows,
    token_amax,
    weight_only,
)

if TYPE_CHECKING:  # (imported on first use: it needs triton)
    from phaseflip.kernels.linear_fold import RotaryFold

WeightLoader = Callable[..., None]

# Whether the fused kernels can be used on CUDA tensors. The kernel modules themselves are
# imported on first use: triton decides interpreted-or-compiled when a kernel is defined.
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _param(shape: tuple[int, ...], dtype: torch.dtype, loader: WeightLoader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def use_fused_kernels(x: torch.Tensor) -> bool:
    """The dispatch rule: the Triton kernels take CUDA tensors when triton is installed."""
    return HAS_TRITON and x.is_cuda


def fp8_input_fusable(x: torch.Tensor, weight: torch.Tensor,
                      weight_scale: torch.Tensor | None) -> bool:
    """Whether the kernel producing `x` (16-bit [T, K] rows, the whole row of each token)
    should quantize them for this linear: FP8 weights, the fused kernels in use, and rows the
    linear quantizes per token (`quantizes_rows`: not weight-only, not the reference). Shapes
    and types only: no sync, so a CUDA graph captures the same choice it replays."""
    return (weight_scale is not None and use_fused_kernels(x) and x.dim() == 2
            and x.element_size() == 2 and quantizes_rows(x, weight))


def linear(x: torch.Tensor | Fp8Activation, weight: torch.Tensor,
           bias: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None,
           *, pad: bool = True, fold: bool = False) -> torch.Tensor | ScaledRows:
    """`F.linear`, or on CUDA for the few rows of a small decode batch the skinny-GEMM kernel,
    which streams the weight at close to HBM bandwidth where cuBLAS' GEMM tiles do not
    (`kernels/linear.py`; the row cut-over is measured per shape), and for 129-1024 rows the
    tile GEMM where this GPU's table has the shape (`kernels/tile_gemm.py`). An FP8 weight (with its
    per-row `weight_scale`) runs the scaled FP8 GEMM (`model.quant.fp8`), which also takes
    rows quantized already (`Fp8Activation`). With `pad` and `gemm_rows.BF16_ROW_PAD` on,
    cuBLAS runs on the padded row count wherever x's buffer has room past its rows (the
    producers make it; any other room is used too: wasted rows, never read back); the LM
    head, which buckets its own rows, passes `pad=False`. `fold`: FP8 may return `ScaledRows`
    (`scaled_linear`), for a caller whose consumer applies the scales."""
    if weight_scale is not None:
        return scaled_linear(x, weight, weight_scale, bias, fold=fold)
    if isinstance(x, Fp8Activation):
        raise TypeError("an Fp8Activation feeds FP8 weights only")
    if use_fused_kernels(x) and x.dim() == 2:
        from phaseflip.kernels import tile_gemm
        from phaseflip.kernels.linear import skinny_linear
        from phaseflip.kernels.linear_configs import should_use_skinny

        if should_use_skinny(x.shape[0], weight.shape[0], weight.shape[1]):
            return skinny_linear(x, weight, bias)
        cfg = tile_gemm.pick(x.shape[0], *weight.shape, weight.dtype, x.device)
        if (cfg is not None and x.dtype == weight.dtype and x.is_contiguous()
                and weight.is_contiguous() and (bias is None or bias.is_contiguous())):
            return tile_gemm.tile_gemm(x, weight, cfg, bias=bias)
        padded = padded_view(x, gemm_rows(x.shape[0], fp8=False)) if pad else None
        if padded is not None:  # on the rows padded for cuBLAS
            return F.linear(padded, weight, bias)[: x.shape[0]]
    return F.linear(x, weight, bias)


def _weight_params(shape: tuple[int, int], dtype: torch.dtype, quant: Fp8Config | None,
                   loader: WeightLoader, scale_loader: WeightLoader
                   ) -> tuple[nn.Parameter, nn.Parameter | None]:
    """(weight, weight_scale): FP8 [out, in] with float32 per-row scales [out] under `quant`
    (the scales shard along the rows exactly as the weight does), else (weight in `dtype`,
    None)."""
    if quant is None:
        return _param(shape, dtype, loader), None
    return _param(shape, FP8_DTYPE, loader), _param(shape[:1], torch.float32, scale_loader)


# What a norm or activation hands the next linear: its 16-bit rows, or those rows quantized
LinearInput = torch.Tensor | Fp8Activation


def _dense_rows(*ts: torch.Tensor) -> bool:
    """The fused kernels' layout: 1-3 dims, unit last stride (rows themselves may be strided)."""
    return all(1 <= t.dim() <= 3 and t.stride(-1) == 1 for t in ts)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 like the reference, optionally fused with the residual add.

    `forward(x, residual)` returns `(norm(x + residual), x + residual)` so a decoder layer
    carries the residual stream without a separate add. On CUDA with triton the fused kernel
    does this IN PLACE (x receives the normed rows, residual the sum, and those two tensors are
    returned): callers must not reuse the old x or residual. The decoder layers do not.
    `quantize=True` (only where `takes_fp8_input` of the linear fed said so): the normed rows
    come back as an `Fp8Activation` where the kernel runs (x's contents then left stale), as a
    tensor otherwise. x may be `ScaledRows` where a residual comes with it: the kernel scales
    x's product as it adds (the product's buffer then holds the normed rows, stale when they
    are quantized); anywhere else it is materialized first.
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param((size,), dtype, default_weight_loader)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(
        self, x: torch.Tensor | ScaledRows, residual: torch.Tensor | None = None,
        quantize: bool = False
    ) -> LinearInput | tuple[LinearInput, torch.Tensor]:
        if isinstance(x, ScaledRows):
            if use_fused_kernels(x.prod) and self._fusable_add(x.prod, residual):
                return self._forward_scaled(x, residual, quantize)
            x = x.materialize()
        if use_fused_kernels(x):
            from phaseflip.kernels import norm

            if quantize and x.dim() == 2:
                return self._forward_fp8(x, residual)
            if residual is None and _dense_rows(x):
                return norm.rms_norm(x, self.weight, self.eps)
            if self._fusable_add(x, residual):
                return norm.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return self.forward_native(x, residual)

    def _forward_scaled(self, x: ScaledRows, residual: torch.Tensor, quantize: bool
                        ) -> tuple[LinearInput, torch.Tensor]:
        """The fused add for an FP8 product whose scales the kernel applies as it adds."""
        from phaseflip.kernels import norm

        scales = (x.row_scale, x.col_scale)
        if quantize:
            _, residual, x_q, scale = norm.fused_add_rms_norm_fp8(
                x.prod, residual, self.weight, self.eps, scales=scales)
            return Fp8Activation(x_q, scale, x.dtype), residual
        return norm.fused_add_rms_norm(x.prod, residual, self.weight, self.eps, scales=scales)

    def _fusable_add(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        return (residual is not None and _dense_rows(x, residual) and residual.shape == x.shape
                and x.dtype == residual.dtype == self.weight.dtype)

    def _forward_fp8(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> LinearInput | tuple[LinearInput, torch.Tensor]:
        """The kernel path for [T, N] rows, the normed rows quantized per token."""
        from phaseflip.kernels import norm

        dtype = torch.promote_types(self.weight.dtype, x.dtype)
        if residual is None and _dense_rows(x):
            _, x_q, scale = norm.rms_norm_fp8(x, self.weight, self.eps)
            return Fp8Activation(x_q, scale, dtype)
        if self._fusable_add(x, residual):
            _, residual, x_q, scale = norm.fused_add_rms_norm_fp8(x, residual, self.weight,
                                                                  self.eps)
            return Fp8Activation(x_q, scale, dtype), residual
        return self.forward(x, residual)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The torch path (CPU, and the oracle the kernels are tested against)."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class MergedColumnParallelLinear(nn.Module):
    """Several column-parallel projections of one input fused into one matmul (gate/up).

    The local weight is `[shard_0 | shard_1 | ...]`, each shard being this rank's slice of the
    corresponding checkpoint tensor; `weight_loader(param, loaded, shard_id=i)` places it.
    """

    def __init__(
        self, in_features: int, out_sizes: list[int], bias: bool, layout: Layout,
        dtype: torch.dtype, quant: Fp8Config | None = None,
    ) -> None:
        super().__init__()
        self.layout = layout
        self.shards = [layout.shard(n, "output features") for n in out_sizes]
        self.local_sizes = [e - s for s, e in self.shards]
        total = sum(self.local_sizes)
        self.weight, self.weight_scale = _weight_params((total, in_features), dtype, quant,
                                                        self._load, self._load)
        self.bias = _param((total,), dtype, self._load) if bias else None

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        (start, end), offset = self.shards[shard_id], sum(self.local_sizes[:shard_id])
        dst = param.data.narrow(0, offset, end - start)
        src = loaded.narrow(0, start, end - start)
        if dst.shape != src.shape:
            raise ValueError(f"shape mismatch in shard {shard_id}: {dst.shape} vs {src.shape}")
        dst.copy_(src)

    def takes_fp8_input(self, x: torch.Tensor) -> bool:
        """Whether the kernel producing x should hand this layer x's FP8 rows instead."""
        return fp8_input_fusable(x, self.weight, self.weight_scale)

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.weight_scale)


class QKVParallelLinear(nn.Module):
    """Fused Q/K/V projection. Q heads are split across TP ranks; KV heads too, or replicated
    (each rank keeps the one KV head its Q heads use) when tp_size exceeds the KV head count."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        layout: Layout,
        dtype: torch.dtype,
        quant: Fp8Config | None = None,
    ) -> None:
        super().__init__()
        tp = layout.tp_size
        q_start, q_end = layout.shard(num_heads, "attention heads")
        self.num_heads = q_end - q_start
        if num_kv_heads >= tp:
            kv_start, kv_end = layout.shard(num_kv_heads, "key/value heads")
        else:
            if tp % num_kv_heads:
                raise ValueError(f"tp_size={tp} is not a multiple of num_kv_heads={num_kv_heads}")
            kv_start = layout.tp_rank * num_kv_heads // tp
            kv_end = kv_start + 1
        self.num_kv_heads = kv_end - kv_start
        self.head_dim = head_dim
        self.rows = {
            "q": (q_start * head_dim, self.num_heads * head_dim),
            "k": (kv_start * head_dim, self.num_kv_heads * head_dim),
            "v": (kv_start * head_dim, self.num_kv_heads * head_dim),
        }
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        total = self.q_size + 2 * self.kv_size
        self.weight, self.weight_scale = _weight_params((total, hidden_size), dtype, quant,
                                                        self._load, self._load)
        self.bias = _param((total,), dtype, self._load) if bias else None

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        offset = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}[shard_id]
        start, size = self.rows[shard_id]
        dst, src = param.data.narrow(0, offset, size), loaded.narrow(0, start, size)
        if dst.shape != src.shape:
            raise ValueError(f"shape mismatch in {shard_id}: {dst.shape} vs {src.shape}")
        dst.copy_(src)

    def takes_fp8_input(self, x: torch.Tensor) -> bool:
        """Whether the kernel producing x should hand this layer x's FP8 rows instead."""
        return fp8_input_fusable(x, self.weight, self.weight_scale)

    def forward(self, x: torch.Tensor | Fp8Activation
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.split(linear(x, self.weight, self.bias, self.weight_scale))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v: views of the fused projection's output."""
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split across TP ranks; partial sums are all-reduced and
    the bias is added once, after the reduction."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, layout: Layout,
        dtype: torch.dtype, quant: Fp8Config | None = None,
    ) -> None:
        super().__init__()
        self.layout = layout
        start, end = layout.shard(in_features, "input features")
        self.in_start, self.in_local = start, end - start
        # an FP8 row's scale covers the whole row (quantized before slicing): not sharded
        self.weight, self.weight_scale = _weight_params(
            (out_features, self.in_local), dtype, quant, self._load, default_weight_loader)
        self.bias = _param((out_features,), dtype, default_weight_loader) if bias else None

    def _load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.device != param.device and self.in_local < loaded.shape[1]:
            # a column slice of a host tensor is strided: copy_ would gather it on the host into
            # pageable memory and upload synchronously (5.5 GB/s for a tp2 shard on the H200,
            # against 44 GB/s from the pinned host image); upload the whole tensor, cut on device
            loaded = loaded.to(param.device, non_blocking=True)
        default_weight_loader(param, loaded.narrow(1, self.in_start, self.in_local))

    def takes_fp8_input(self, x: torch.Tensor) -> bool:
        """As the column-parallel layers, at tp_size 1 only: under TP, x is this rank's slice
        of each row and its scale the whole row's (a max-reduce the producer cannot do)."""
        return self.layout.tp_size == 1 and fp8_input_fusable(x, self.weight, self.weight_scale)

    def forward(self, x: torch.Tensor | Fp8Activation, fold: bool = False
                ) -> torch.Tensor | ScaledRows:
        """`fold`: the caller's consumer applies FP8 scales (`RMSNorm`'s residual add), so the
        product may come back as `ScaledRows` (one process, no bias: nothing to reduce or add
        after the GEMM)."""
        if isinstance(x, Fp8Activation) and self.layout.tp_size > 1:
            raise ValueError("a TP shard of a row cannot arrive quantized: its scale is the "
                             "whole row's (takes_fp8_input is False under TP)")
        if (self.weight_scale is not None and self.layout.tp_size > 1
                and not weight_only(x, self.weight)):
            # FP8: each rank holds a slice of every token's row; its activation scale is the
            # WHOLE row's (one small max-reduce), so TP rounds exactly as one process and PP do.
            # (Rows that go weight-only stay unquantized: no scale to agree on; every rank has
            # the same rows, so all take the same branch.)
            amax = self.layout.tp_comm.all_reduce_max(token_amax(x))
            part = scaled_linear(x, self.weight, self.weight_scale, None, amax)
        else:
            fold = fold and self.layout.tp_size == 1 and self.bias is None
            part = linear(x, self.weight, None, self.weight_scale, fold=fold)
            if isinstance(part, ScaledRows):
                return part
        y = self.layout.tp_comm.all_reduce(part)
        return y + self.bias if self.bias is not None else y


def _vocab_shard(vocab_size: int, layout: Layout) -> tuple[int, int, int]:
    """(padded vocab, start, end): the vocabulary padded to a multiple of tp_size, then split."""
    padded = -(-vocab_size // layout.tp_size) * layout.tp_size
    start, end = layout.shard(padded, "padded vocabulary")
    return padded, start, end


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across TP ranks; each rank embeds the ids it owns, zeros elsewhere,
    and an all-reduce assembles the full embedding."""

    def __init__(self, vocab_size: int, hidden: int, layout: Layout, dtype: torch.dtype) -> None:
        super().__init__()
        self.layout = layout
        _, self.start, self.end = _vocab_shard(vocab_size, layout)
        self.vocab_size = vocab_size
        self.weight = _param((self.end - self.start, hidden), dtype, self._load)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.zero_()
        rows = max(0, min(self.end, loaded.shape[0]) - self.start)
        param.data[:rows].copy_(loaded[self.start : self.start + rows])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.layout.tp_size == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.start) & (ids < self.end)
        out = F.embedding((ids - self.start).masked_fill(~mine, 0), self.weight)
        out = out.masked_fill(~mine[:, None], 0)
        return self.layout.tp_comm.all_reduce(out)


class SiluAndMul(nn.Module):
    """silu(gate) * up for x = [gate | up] along the last dim (a fused kernel on CUDA).
    `quantize=True` (where the FP8 linear fed `takes_fp8_input`): [T, 2I] rows come back
    quantized per token, an `Fp8Activation`, where the kernel runs."""

    def forward(self, x: torch.Tensor, quantize: bool = False) -> LinearInput:
        if use_fused_kernels(x) and x.stride(-1) == 1 and x.shape[-1] % 2 == 0:
            from phaseflip.kernels import activation

            if quantize and x.dim() == 2:
                _, x_q, scale = activation.silu_and_mul_fp8(x)
                return Fp8Activation(x_q, scale, x.dtype)
            return activation.silu_and_mul(x)
        return self.forward_native(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """The torch path (CPU, and the oracle the kernel is tested against)."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


# Set to 1 to run decode layers of a few rows unfolded (A/B runs, `benchmarks/fold_ab.sh`).
NO_FOLD_ENV = "PHASEFLIP_NO_FOLD"


def folds_rows(x: torch.Tensor, layout: Layout, linears: tuple[nn.Module, ...]) -> bool:
    """Whether a decoder layer runs `x` (the residual stream, [M, hidden]) folded: its norms,
    SiLU·mul and residual adds inside its projections' launches (`kernels/linear_fold.py`).
    Where: CUDA with triton, one process (under TP the residual add waits for an all-reduce;
    pipeline stages exchange (hidden, residual) pairs), M <= 2 rows, and every projection
    on the skinny kernel's 16-bit-x loop: bf16/fp16/fp32 weights the kernel is picked for, FP8
    weights weight-only (their rows stay unquantized at M <= 2). Shapes and types only: a CUDA
    graph captures the choice it replays. `PHASEFLIP_NO_FOLD=1` turns it off."""
    from phaseflip.model.quant.fp8 import FP8_WEIGHT_ONLY_MAX_M

    if not (use_fused_kernels(x) and x.dim() == 2 and layout.tp_size == 1
            and layout.pp_size == 1 and 1 <= x.shape[0] <= FP8_WEIGHT_ONLY_MAX_M):
        return False
    if os.environ.get(NO_FOLD_ENV, "") not in ("", "0"):
        return False
    from phaseflip.kernels.linear_configs import should_use_skinny
    from phaseflip.kernels.linear_fold import NORM_FOLD_MAX_M

    m = x.shape[0]
    for layer in linears:
        n, k = layer.weight.shape
        if layer.weight_scale is None:
            ok = layer.weight.dtype == x.dtype and should_use_skinny(m, n, k)
        else:
            ok = x.element_size() == 2 and k % 16 == 0
        if not ok:
            return False
    return m <= NORM_FOLD_MAX_M


def folded_linear(x: torch.Tensor, layer: nn.Module, *, norm: RMSNorm | None = None,
                  silu_mul: bool = False, residual: torch.Tensor | None = None,
                  rotary: RotaryFold | None = None) -> torch.Tensor:
    """`layer`'s projection of a few rows (`folds_rows`) with `norm` applied to x first (in
    the launch where that pays, else by the norm's own kernel), `silu_mul`: silu(gate) * up
    of its [gate | up] output, `residual` added to the output, `rotary`: qkv's rotary and KV
    store in its epilogue."""
    from phaseflip.kernels.linear import skinny_linear
    from phaseflip.kernels.linear_fold import NORM_FOLD_PAYS_M, Fold

    if norm is not None and x.shape[0] > NORM_FOLD_PAYS_M:
        x, norm = norm(x), None

    fold = Fold(norm.weight if norm is not None else None, norm.eps if norm is not None else 0.0,
                silu_mul, residual, rotary)
    return skinny_linear(x, layer.weight, layer.bias, weight_scale=layer.weight_scale,
                         fold=fold)
