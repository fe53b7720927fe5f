"""Row counts for cuBLAS: a large GEMM's activation rows padded to a multiple, without a copy.

cuBLAS's GEMMs are sensitive to the row count itself: on an H100 the 8B's gate_up took
1 862 µs in FP8 (row-wise scales) at 8 705 rows against 1 651 at 8 704, 577 against 405 at
2 049 and 2 048, and 3 192 against 2 798 µs in bf16 at 8 705 and 8 704 (docs/benchmarks.md,
sixth H100) — and a mixed step's rows are 8 192 prompt tokens plus whatever decodes ride
along. So the kernels that produce a GEMM's input rows allocate them with the padded count
(`empty_rows`) and hand on a view of the real rows; the GEMM runs on the padded view
(`padded_view`) and drops the padded rows' products: garbage in, garbage out, never read
(a GEMM's output row depends on its own input row only).

FP8 pads to 128 rows: the sweep (`benchmarks/scaled_mm_probe.py --m-sweep`) shows a
128-row sawtooth (a layer's four GEMMs 3 100 µs at 8 193 rows, 2 937 at 8 320), padding saves
3.9 % of a layer, and offline went 16 548/16 531 → 16 658/16 666 (H100, docs/benchmarks.md,
seventh H100). bf16 stays off: every multiple was slower (16: −0.7 %, 128: −3.0 %).
Below `ROW_PAD_MIN` rows the skinny kernel and the tile GEMM run, which pad themselves.
The 16-bit producers (RMSNorm, SiLU·mul, attention outputs) pad whenever `BF16_ROW_PAD` is
set, also in FP8 models where a quantizer reads their rows (memory only: the quantizer
reads `t` rows).
"""

from __future__ import annotations

import torch

FP8_ROW_PAD = 128  # FP8 GEMMs (`torch._scaled_mm`, row-wise scales)
BF16_ROW_PAD = 0  # 16-bit GEMMs (`F.linear`)
ROW_PAD_MIN = 1025


def gemm_rows(t: int, fp8: bool) -> int:
    """Rows a GEMM of `t` activation rows runs on: `t`, or `t` padded up to the multiple."""
    pad = FP8_ROW_PAD if fp8 else BF16_ROW_PAD
    if pad <= 0 or t < ROW_PAD_MIN:
        return t
    return -(-t // pad) * pad


def empty_rows(t: int, k: int, dtype: torch.dtype, device: torch.device | str,
               fp8: bool) -> torch.Tensor:
    """Uninitialised [t, k]: the first `t` rows of a buffer of `gemm_rows(t, fp8)` rows."""
    return torch.empty((gemm_rows(t, fp8), k), dtype=dtype, device=device)[:t]


def padded_view(a: torch.Tensor, rows: int) -> torch.Tensor | None:
    """Contiguous 2-D `a` viewed with `rows` rows where its storage holds them, else None."""
    if a.dim() != 2 or not a.is_contiguous() or rows <= a.shape[0]:
        return None
    width = a.shape[1]
    if a.untyped_storage().nbytes() < (a.storage_offset() + rows * width) * a.element_size():
        return None
    return a.as_strided((rows, width), (width, 1), a.storage_offset())


def padded_operands(x_q: torch.Tensor, scale: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x_q, scale) viewed with the FP8 GEMM's padded row count where both buffers hold it
    (`fp8_quant.empty_fp8_rows` made them); None where no padding applies or fits."""
    rows = gemm_rows(x_q.shape[0], fp8=True)
    if scale.shape != (x_q.shape[0], 1):
        return None
    views = padded_view(x_q, rows), padded_view(scale, rows)
    return None if views[0] is None or views[1] is None else views
