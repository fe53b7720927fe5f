"""The output projection: vocabulary rows split across TP ranks, logits gathered to the
sampling rank, an eager step's rows padded to warmed buckets, and (`--fp8-lm-head`) an FP8
copy of the weight that the logits GEMM reads instead of the 16-bit one.

The FP8 copy is derived, not loaded: `ParallelLMHead.quantize_` makes it from the weight after
every load path (checkpoint, dummy, a phase flip's host image or peer slices; the runner calls
it), so the checkpoint mapping, tied embeddings and every flip strategy keep moving the one
16-bit weight they know, and a rank's vocabulary shard quantizes row by row exactly as the
whole head would (the scales are per row).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phaseflip.layout import Layout
from phaseflip.model.layers import VocabParallelEmbedding, linear
from phaseflip.model.quant import FP8_DTYPE
from phaseflip.model.quant.fp8 import quantize_rows

# LM-head row buckets of the eager steps (prefill, mixed). Their row count (the rows that
# sample) is new at almost every step, and cuBLAS picks its kernel for a few-row, 128k-column
# GEMM by the row count (profiles name a different kernel at nearly every mixed step). On the
# H200 2 of 16 new row counts waited for the GPU's queued work to drain (~100 ms behind a busy
# queue; `benchmarks/first_shape_probe.py`), read as a kernel's first call. Padded to these
# buckets (warmed at build, `ParallelLMHead.warm`) no step meets a new shape: 0 of 16 waited.
ROW_BUCKETS_SMALL = (1, 2, 4, 8, 16, 32)
ROW_BUCKET = 32  # above 32 rows, up to ROW_BUCKET_WIDE_FROM
ROW_BUCKET_WIDE_FROM, ROW_BUCKET_WIDE = 1024, 256  # prompt-logprob steps: thousands of rows
QUANTIZE_CHUNK_ROWS = 8192  # rows quantized at a time: bounds the float32 temporaries


def lm_head_rows(rows: int) -> int:
    """The bucket `rows` is padded to in an eager step's LM head."""
    for b in ROW_BUCKETS_SMALL:
        if rows <= b:
            return b
    step = ROW_BUCKET if rows <= ROW_BUCKET_WIDE_FROM else ROW_BUCKET_WIDE
    return -(-rows // step) * step


def lm_head_buckets(max_rows: int) -> list[int]:
    """Every bucket a step of at most `max_rows` rows can pad to (what `warm` runs)."""
    return sorted({lm_head_rows(r) for r in range(1, max(1, max_rows) + 1)})


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, vocabulary split across TP ranks. Only TP rank 0 samples, so only
    it receives the other ranks' shards (a gather, not an all-gather: the others would hold
    4 bytes × vocab per row for nothing); logits are float32, cut back to the true vocabulary.

    On CUDA an eager step's rows are padded to `lm_head_rows` buckets (`bucket_rows`: None
    = on CUDA only; tests force it on the CPU), so the GEMM meets only shapes `warm` ran.
    `fp8`: the logits GEMM reads `fp8_weight` / `fp8_scale` (buffers: freed with the model,
    never loaded or moved by a flip), which `quantize_` fills from `weight`."""

    bucket_rows: bool | None = None

    def __init__(self, vocab_size: int, hidden: int, layout: Layout, dtype: torch.dtype,
                 fp8: bool = False) -> None:
        super().__init__(vocab_size, hidden, layout, dtype)
        self.fp8 = fp8
        self.quantized = False  # `quantize_` ran since the weight was loaded
        if fp8:
            rows = self.end - self.start
            self.register_buffer("fp8_weight", torch.empty(rows, hidden, dtype=FP8_DTYPE),
                                 persistent=False)
            self.register_buffer("fp8_scale", torch.empty(rows, dtype=torch.float32),
                                 persistent=False)

    @property
    def padded_vocab(self) -> int:
        return (self.end - self.start) * self.layout.tp_size

    @property
    def derived_bytes(self) -> int:
        """Device bytes of the FP8 copy (0 without): weight bytes no parameter counts."""
        if not self.fp8:
            return 0
        return self.fp8_weight.numel() * self.fp8_weight.element_size() + (
            self.fp8_scale.numel() * self.fp8_scale.element_size())

    def quantize_(self) -> None:
        """Fills the FP8 copy from the loaded weight (a no-op without `fp8`): per-row FP8,
        as the decoder's projections (`quant.fp8.quantize_rows`), a chunk of rows at a time."""
        if not self.fp8:
            return
        with torch.no_grad():
            for a in range(0, self.weight.shape[0], QUANTIZE_CHUNK_ROWS):
                q, s = quantize_rows(self.weight[a : a + QUANTIZE_CHUNK_ROWS])
                self.fp8_weight[a : a + q.shape[0]].copy_(q)
                self.fp8_scale[a : a + q.shape[0]].copy_(s)
        self.quantized = True

    def _project(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the logits, in the model dtype."""
        if not self.fp8:
            return linear(hidden, self.weight, pad=False)
        if not self.quantized:
            raise RuntimeError("the FP8 LM head was not quantized after its weight loaded "
                               "(ParallelLMHead.quantize_)")
        return linear(hidden, self.fp8_weight, weight_scale=self.fp8_scale)

    def _buckets(self, hidden: torch.Tensor) -> bool:
        return hidden.is_cuda if self.bucket_rows is None else self.bucket_rows

    def warm(self, max_rows: int) -> int:
        """Runs this rank's shard of the LM head once at every row bucket up to `max_rows`
        (local GEMMs, no collective: each rank warms its own), so cuBLAS's kernels and
        heuristics are loaded before serving; returns the buckets run (0 off CUDA)."""
        if not self._buckets(self.weight):
            return 0
        buckets = lm_head_buckets(max_rows)
        x = torch.zeros(buckets[-1], self.weight.shape[1], dtype=self.weight.dtype,
                        device=self.weight.device)
        for b in buckets:
            self._project(x[:b])
        if self.weight.is_cuda:
            torch.cuda.synchronize(self.weight.device)
        return len(buckets)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None
               ) -> torch.Tensor | None:
        """float32 `[rows, vocab]` on TP rank 0, None on the other TP ranks. `out`: the float32
        `[rows, padded_vocab]` to write (a decode graph's static buffer), else a new one. The
        shards travel in the weights' dtype and are widened once, on rank 0 (the same values
        as widening before the gather, half the bytes in bf16)."""
        rows, tp = hidden.shape[0], self.layout.tp_size
        padded = lm_head_rows(rows) if out is None and self._buckets(hidden) else rows
        if padded != rows:
            hidden = F.pad(hidden, (0, 0, 0, padded - rows))
        local = self._project(hidden)[:rows]
        shards = self.layout.tp_comm.gather(local)  # [tp, rows, vocab / tp]
        if shards is None:
            return None
        if out is None:
            out = torch.empty(rows, self.padded_vocab, dtype=torch.float32, device=local.device)
        out.view(rows, tp, self.end - self.start).copy_(shards.transpose(0, 1))
        return out[:, : self.vocab_size]
