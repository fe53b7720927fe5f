"""FP8 (e4m3) numerics: quantize, dequantize and the scaled GEMM of an FP8 linear layer.

Weights are held as `float8_e4m3fn` with one float32 scale per output channel (row), so
`W ≈ W_q * scale[:, None]`. Activations are quantized per token (row) at run time, so
`x ≈ x_q * sx[:, None]`, and a linear is `y = (x_q @ W_q^T) * sx[:, None] * scale[None, :]`.

On CUDA that product is one `torch._scaled_mm` with row-wise scales (cuBLASLt, FP8 tensor
cores, Hopper and later), or for a few rows (a small decode batch) the skinny kernel's W8A8
loop (`kernels/linear.py`), which streams the weight at close to HBM bandwidth where cuBLAS'
tiles do not, or for 129-1024 rows where this GPU's table says so the tile GEMM
(`kernels/tile_gemm.py`), whose 64-row tiles waste less than cuBLAS' 128-row ones; none of
them runs in this repository's CI. Everywhere else — CPU, and shapes or
dtypes the CUDA kernels do not take — the same product is computed in float32 from the FP8
values (`scaled_linear_ref`): it rounds x and W exactly as the GPU paths do and differs from
them only by accumulation order, so it is the oracle the accuracy tests measure.

On both GPU paths the per-token quantization of a linear's input may already have been
done by the kernel that produced it (an RMSNorm, SiLU·mul: `kernels/norm.py`,
`kernels/activation.py`): the linear then receives an `Fp8Activation` instead of the tensor,
bitwise what it would have quantized itself. Symmetrically, where cuBLAS runs o or down in one
process, the scales may be left to the consumer (`ScaledRows`): the GEMM runs with unit
scales, faster, and the residual add + RMSNorm kernel scales the product as it adds.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from phaseflip.kernels.gemm_rows import padded_operands

if TYPE_CHECKING:
    from phaseflip.kernels.tile_gemm import TileGemmConfig

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_MIN_SCALE = 1e-12  # an all-zero row keeps a finite scale (its values quantize to 0)
_HAS_TRITON = importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class Fp8Activation:
    """An FP8 linear's input rows, quantized per token by the kernel that produced them: what
    `scaled_linear` would quantize itself, bitwise. Made only where the linear quantizes these
    rows (`quantizes_rows`) and its input is the whole row (no TP amax)."""

    x_q: torch.Tensor  # [T, K] float8_e4m3fn
    scale: torch.Tensor  # [T, 1] float32, per token
    dtype: torch.dtype  # the 16-bit activations' dtype: the linear's output dtype


@dataclass(frozen=True)
class ScaledRows:
    """An FP8 linear's product before its scales, for a consumer that applies them itself
    (the residual add + RMSNorm kernel: `kernels/norm.py`): the linear's output is
    `prod * row_scale * col_scale` rounded to `dtype` (`materialize`). cuBLAS's FP8 GEMM with
    one unit scale per operand (tensor-wise) is faster than with ours (per token × per output
    channel, row-wise) at the mixed steps' row counts: on an H100 the 8B's `down` took 734
    against 900 µs at 8 320 rows (docs/benchmarks.md). `prod` is x_q W_q^T rounded once to
    bf16 (|x_q|, |W_q| <= 448: far inside its range); the consumer then rounds once more."""

    prod: torch.Tensor  # [T, N] bfloat16
    row_scale: torch.Tensor  # [T, 1] float32, per token
    col_scale: torch.Tensor  # [N] float32, per output channel
    dtype: torch.dtype  # the output's dtype (bfloat16: only bf16 models fold)

    def materialize(self) -> torch.Tensor:
        """The output as a tensor, rounded as the consumer kernels round it."""
        return (self.prod.float() * self.row_scale * self.col_scale).to(self.dtype)


# Whether FP8 linears whose consumer applies the scales (`scaled_linear(fold=True)`) run
# cuBLAS tensor-wise and hand back `ScaledRows` (A/B: set False for row-wise everywhere).
FOLD_SCALES = True


def output_rows(x: torch.Tensor | ScaledRows) -> torch.Tensor:
    """The [T, N] rows of a linear's output, scaled or not: for shape checks only."""
    return x.prod if isinstance(x, ScaledRows) else x


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (output-channel) FP8: returns (w_q [R, C] fp8, scale [R] float32)."""
    wf = w.float()
    scale = (wf.abs().amax(dim=-1) / FP8_MAX).clamp_min(_MIN_SCALE)
    q = (wf / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for the whole tensor (compressed-tensors' "tensor" strategy): (w_q, scale [])."""
    wf = w.float()
    scale = (wf.abs().amax() / FP8_MAX).clamp_min(_MIN_SCALE)
    return (wf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP8 as the official Qwen3 / DeepSeek FP8 checkpoints store it: one scale per
    `block[0] x block[1]` tile (edge tiles may be partial). Returns (w_q, scale_inv
    [ceil(R/b0), ceil(C/b1)]), `scale_inv` being the factor that dequantizes (checkpoint name)."""
    rows, cols = w.shape
    b0, b1 = block
    pr, pc = -rows % b0, -cols % b1
    wf = torch.nn.functional.pad(w.float(), (0, pc, 0, pr))
    tiles = wf.view(wf.shape[0] // b0, b0, wf.shape[1] // b1, b1)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(_MIN_SCALE)
    q = (tiles / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(wf.shape)[:rows, :cols].contiguous(), scale


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
                      ) -> torch.Tensor:
    """float32 values of a block-wise FP8 tensor (`quantize_blocks`' inverse up to rounding)."""
    rows, cols = q.shape
    s = scale_inv.float().repeat_interleave(block[0], 0)[:rows]
    s = s.repeat_interleave(block[1], 1)[:, :cols]
    return q.float() * s


def token_amax(x: torch.Tensor) -> torch.Tensor:
    """|x| maximum of each token row, float32 [T, 1]: what a per-token scale is taken from (a
    tensor-parallel row-parallel layer reduces it over the group first: the whole row's)."""
    return x.reshape(-1, x.shape[-1]).float().abs().amax(dim=-1, keepdim=True)


def quantize_tokens(x: torch.Tensor, amax: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token activation quantization: (x_q [T, K] fp8, scale [T, 1] float32).
    `amax`: the rows' maxima when they cover more than `x` (a TP rank's slice of a row)."""
    xf = x.float()
    if amax is None:
        amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = (amax / FP8_MAX).clamp_min(_MIN_SCALE)
    return (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def scaled_linear_ref(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                      bias: torch.Tensor | None = None, amax: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """The FP8 linear in float32 from the FP8 values (the CPU path and the oracle)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    x_q, sx = quantize_tokens(x2, amax)
    y = (x_q.float() @ w_q.float().t()) * sx * w_scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*shape[:-1], w_q.shape[0])


def _scaled_mm_ok(x: torch.Tensor, w_q: torch.Tensor) -> bool:
    """What cuBLASLt's row-wise FP8 GEMM takes: a Hopper-or-later GPU (sm_90+), K and N
    multiples of 16 (M is free: decode batches of any size qualify; an empty batch is not
    sent to it)."""
    return (x.is_cuda and x.numel() > 0 and hasattr(torch, "_scaled_mm")
            and x.shape[-1] % 16 == 0
            and w_q.shape[0] % 16 == 0
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


# Rows up to which FP8 linears run the skinny kernel (`kernels/linear.py`) instead of
# `torch._scaled_mm`, whose tiles are built for large M: any shape up to
# `FP8_SKINNY_UNTUNED_MAX_M` rows, and up to `FP8_SKINNY_MAX_M` (the kernel's one M tile) on a
# GPU with FP8 MMAs where the shipped table has a tuned W8A8 entry for the shape's M bucket
# (an untuned 128-row tile may exceed a smaller GPU's shared memory, or lose to cuBLAS). One 8B
# layer's four projections on the H200 (`linear_kernels --fp8-weights --w8a8 --tune --m
# 16,32,64,128`, weights streamed from HBM), tuned W8A8 against per-token quantization +
# `_scaled_mm`: 67 / 70 / 76 / 87 µs against 142 / 138 / 133 / 127 µs at M 16 / 32 / 64 / 128.
FP8_SKINNY_UNTUNED_MAX_M = 16
FP8_SKINNY_MAX_M = 128
# Rows up to which the skinny kernel reads 16-bit x as it is (weight-only, W8A16) rather than
# quantized per token (W8A8, FP8 MMAs). Tuned on the H200 (`linear_kernels --fp8-weights
# [--w8a8] --tune`, weights streamed from HBM), one 8B layer's four projections: W8A16 61 / 66
# / 96 / 107 / 104 µs at M 1 / 2 / 4 / 8 / 16, W8A8 72 / 73 / 72 / 70 / 68 µs (its MMA pads
# to 16 rows; W8A16's elementwise loop does not, but widening every weight to bf16 caps it
# beyond 2 rows). GPUs without FP8 MMAs (before sm_89) stay weight-only.
FP8_WEIGHT_ONLY_MAX_M = 2


@functools.cache
def _fp8_mma(device_index: int) -> bool:
    """Whether this GPU's tensor cores multiply e4m3 (Ada, Hopper and later)."""
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def skinny_rows(x: torch.Tensor, w_q: torch.Tensor) -> bool:
    """A few rows on CUDA with triton, K a multiple of 16: the skinny kernel's, whether x
    comes 16-bit or quantized (1..FP8_SKINNY_UNTUNED_MAX_M rows; up to FP8_SKINNY_MAX_M where
    a tuned W8A8 entry exists for `w_q`'s shape)."""
    if not (_HAS_TRITON and x.is_cuda):
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    if rows < 1 or x.shape[-1] % 16:
        return False
    if rows <= FP8_SKINNY_UNTUNED_MAX_M:
        return True
    return rows <= FP8_SKINNY_MAX_M and _fp8_mma(x.device.index or 0) and _tuned_w8a8(rows, w_q)


def _tuned_w8a8(rows: int, w_q: torch.Tensor) -> bool:
    from phaseflip.kernels import linear_configs  # needs triton: imported on first use

    return linear_configs.TUNED.get(rows, *w_q.shape, w_q.dtype, w8a8=True) is not None


def _w8a8_rows(x: torch.Tensor) -> bool:
    rows = x.numel() // max(x.shape[-1], 1)
    return rows > FP8_WEIGHT_ONLY_MAX_M and _fp8_mma(x.device.index or 0)


def weight_only(x: torch.Tensor, w_q: torch.Tensor) -> bool:
    """Skinny rows of 16-bit x that stay unquantized: the kernel reads the FP8 weight, widens
    it in registers and multiplies it with x as is (up to `FP8_WEIGHT_ONLY_MAX_M` rows on a
    GPU with FP8 MMAs, every skinny row count on one without).

    The price: FP8 numerics depend on how many rows a GEMM gets (a layout that cuts a step
    into smaller calls, PP micro-batches or decode groups, can run weight-only where one
    process quantizes activations), so FP8 layouts agree only to FP8's own error there
    (docs/quantization.md); beyond it every row count rounds x per token alike, and layouts
    agree to float32's accumulation order (the amax reduce of `RowParallelLinear` covers TP)."""
    return x.element_size() == 2 and skinny_rows(x, w_q) and not _w8a8_rows(x)


def quantizes_rows(x: torch.Tensor, w_q: torch.Tensor) -> bool:
    """Whether `scaled_linear` quantizes these rows per token (for the skinny kernel's W8A8
    loop or for `_scaled_mm`): neither weight-only nor the float32 reference."""
    return not weight_only(x, w_q) and (skinny_rows(x, w_q) or _scaled_mm_ok(x, w_q))


def _quantize_on_gpu(x: torch.Tensor, amax: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_tokens`, bitwise, as one Triton kernel when triton is installed (the torch
    ops are eight launches per linear: `kernels/fp8_quant.py`)."""
    if not _HAS_TRITON:
        return quantize_tokens(x, amax)
    from phaseflip.kernels.fp8_quant import per_token_quant  # defined on first use

    return per_token_quant(x if x.stride(-1) == 1 else x.contiguous(), amax)


def scaled_linear(x: torch.Tensor | Fp8Activation, w_q: torch.Tensor, w_scale: torch.Tensor,
                  bias: torch.Tensor | None = None, amax: torch.Tensor | None = None, *,
                  fold: bool = False) -> torch.Tensor | ScaledRows:
    """y = x W^T for an FP8 weight (per-row `w_scale`) with per-token dynamic activation
    scales: `torch._scaled_mm` on CUDA where it applies, else `scaled_linear_ref`.

    Row-wise scaling produces bf16 only: fp16/fp32 models get the bf16 product cast to their
    dtype (its 8 bits of mantissa are not what limits an FP8 GEMM). The bias is added after
    the GEMM. Every op is capturable in a CUDA graph (no host sync, static shapes). `amax`:
    the token rows' maxima ([T, 1] float32) when `x` is a slice of the rows (`token_amax`).
    An `Fp8Activation` goes straight to `_scaled_mm` (its rows are quantized already).
    `fold`: the caller's consumer takes `ScaledRows`; returned where cuBLAS runs the rows of a
    bf16 model without a bias (`FOLD_SCALES`), a tensor everywhere else."""
    if isinstance(x, Fp8Activation):
        if amax is not None:
            raise ValueError("an Fp8Activation holds whole rows quantized: no amax applies")
        return _rows_linear(x.x_q, x.scale, w_q, w_scale, bias, x.dtype, fold)
    if weight_only(x, w_q):  # W8A16: no activation rounding
        from phaseflip.kernels.linear import skinny_linear

        return skinny_linear(x, w_q, bias, weight_scale=w_scale)
    if not quantizes_rows(x, w_q):
        return scaled_linear_ref(x, w_q, w_scale, bias, amax)
    shape = x.shape
    x_q, sx = _quantize_on_gpu(x.reshape(-1, shape[-1]), amax)
    y = _rows_linear(x_q, sx, w_q, w_scale, bias, x.dtype, fold and x.dim() == 2)
    return y if isinstance(y, ScaledRows) else y.reshape(*shape[:-1], w_q.shape[0])


def scaled_mm_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                     bias: torch.Tensor | None = None, amax: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """The cuBLASLt path of `scaled_linear` (per-token activation quantization, then one
    row-wise `torch._scaled_mm`), whatever M: what the skinny kernel is timed against."""
    shape = x.shape
    x_q, sx = _quantize_on_gpu(x.reshape(-1, shape[-1]), amax)
    y = _scaled_mm(x_q, sx, w_q, w_scale, bias, x.dtype)
    return y.reshape(*shape[:-1], w_q.shape[0])


def _rows_linear(x_q: torch.Tensor, sx: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None, dtype: torch.dtype, fold: bool = False
                 ) -> torch.Tensor | ScaledRows:
    """[T, N] in `dtype` from per-token quantized rows: the tile GEMM (`kernels/tile_gemm.py`)
    where this GPU's table says it beats both the skinny kernel and cuBLAS for the row count,
    else the skinny kernel's W8A8 loop for a few rows (unless the table found cuBLAS faster
    there), else `_scaled_mm` — or with `fold` (no bias) in a bf16 model `_tensorwise_mm`."""
    cfg = _tile_gemm_config(x_q, w_q)
    if cfg is not None:
        from phaseflip.kernels.tile_gemm import tile_gemm

        return _finish(tile_gemm(x_q, w_q, cfg, sx, w_scale), bias, dtype)
    if skinny_rows(x_q, w_q) and not _cublas_rows(x_q, w_q):
        from phaseflip.kernels.linear import skinny_linear

        return skinny_linear(x_q, w_q, bias, weight_scale=w_scale, x_scale=sx, out_dtype=dtype)
    if fold and FOLD_SCALES and bias is None and dtype == torch.bfloat16:
        return _tensorwise_mm(x_q, sx, w_q, w_scale)
    return _scaled_mm(x_q, sx, w_q, w_scale, bias, dtype)


def _cublas_rows(x_q: torch.Tensor, w_q: torch.Tensor) -> bool:
    """Rows the skinny kernel takes but where the tuner found cuBLAS faster (the skinny
    kernel's one M tile at 80 or 96 rows, `kernels/tile_gemm.py`)."""
    from phaseflip.kernels import tile_gemm

    return tile_gemm.cublas_wins(x_q.shape[0], *w_q.shape, w_q.dtype, x_q.device)


def _tile_gemm_config(x_q: torch.Tensor, w_q: torch.Tensor) -> TileGemmConfig | None:
    """The tile GEMM's measured launch shape for these rows, or None (cuBLAS): CUDA with
    triton, FP8 MMAs, contiguous operands and a table entry for the row bucket."""
    if not (x_q.is_cuda and _HAS_TRITON and x_q.is_contiguous() and w_q.is_contiguous()):
        return None
    from phaseflip.kernels import tile_gemm

    if tile_gemm.m_bucket(x_q.shape[0]) is None or not _fp8_mma(x_q.device.index or 0):
        return None
    return tile_gemm.pick(x_q.shape[0], *w_q.shape, w_q.dtype, x_q.device)


def _scaled_mm(x_q: torch.Tensor, sx: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """[T, N] in `dtype` from per-token quantized rows: one row-wise `torch._scaled_mm`, on
    the rows padded to `gemm_rows.gemm_rows` (a multiple of 128) where the buffers hold them."""
    rows = x_q.shape[0]
    padded = padded_operands(x_q, sx)
    if padded is not None:
        x_q, sx = padded
    y = torch._scaled_mm(x_q, w_q.t(), scale_a=sx, scale_b=w_scale.view(1, -1),
                         out_dtype=torch.bfloat16)
    return _finish(y[:rows], bias, dtype)


def _tensorwise_mm(x_q: torch.Tensor, sx: torch.Tensor, w_q: torch.Tensor,
                   w_scale: torch.Tensor) -> ScaledRows:
    """x_q W_q^T without the scales (`ScaledRows`): one tensor-wise `torch._scaled_mm` with
    unit scales, on the rows as they are: the tensor-wise GEMM has no row-count sawtooth to
    pad away (an H100's layer of four: 2 772 µs at 8 193 rows, 2 771 at 8 192; padding to
    128 cost 1.4 % over the sweep, `scaled_mm_probe --m-sweep --tensorwise`)."""
    one = _unit_scale(x_q.device)
    y = torch._scaled_mm(x_q, w_q.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    return ScaledRows(y, sx, w_scale, torch.bfloat16)


# A float32 1.0 per CUDA device, made outside any graph capture: a memo, never changed.
_UNIT_SCALES: dict[int, torch.Tensor] = {}


def _unit_scale(device: torch.device) -> torch.Tensor:
    """A float32 1.0 on `device`: the memo's (a graph captures it as any other tensor), or
    while capturing before any eager call made it, one per call from the graph's pool (kept
    out of the memo: a graph's pool must not outlive the graph, which a flip may release)."""
    if device.type != "cuda":
        return torch.ones((), dtype=torch.float32, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    one = _UNIT_SCALES.get(index)
    if one is None:
        one = torch.ones((), dtype=torch.float32, device=device)
        if not torch.cuda.is_current_stream_capturing():
            _UNIT_SCALES[index] = one
    return one


def _finish(y: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The bf16 product in the model's dtype, plus the bias (added after, as both GEMMs do)."""
    if y.dtype != dtype:
        y = y.to(dtype)
    return y + bias if bias is not None else y
