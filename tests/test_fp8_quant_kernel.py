"""The fused per-token FP8 quantization kernel against `quantize_tokens` (the torch oracle):
bitwise, on CUDA or in Triton's interpreter on the CPU."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import interpret_without_cuda

interpret_without_cuda()  # before triton is imported
pytest.importorskip("triton")

from phaseflip.kernels.fp8_quant import per_token_quant  # noqa: E402
from phaseflip.model.quant.fp8 import quantize_tokens  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [64, 200, 1536])  # one block, a ragged one, several blocks
def test_matches_the_torch_quantization_bitwise(dtype, k):
    gen = torch.Generator().manual_seed(k)
    x = (torch.randn(7, k, generator=gen) * torch.logspace(-4, 2, 7)[:, None]).to(dtype)
    x[3] = 0  # an all-zero row keeps a finite scale
    x[5, 11] = 1e4  # an outlier sets its row's scale
    q, s = per_token_quant(x.to(DEVICE))
    want_q, want_s = quantize_tokens(x)
    assert torch.equal(s.cpu(), want_s)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))


def test_given_row_maxima_replace_the_rows_own():
    """A TP rank's slice quantized with the whole row's maxima (and saturating where its own
    values exceed them, as the torch code does)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=gen)
    amax = torch.rand(5, 1, generator=gen) * 4 + 0.5
    q, s = per_token_quant(x.to(DEVICE), amax.to(DEVICE))
    want_q, want_s = quantize_tokens(x, amax)
    assert torch.equal(s.cpu(), want_s)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))


def test_strided_rows_and_empty_batch():
    x = torch.randn(4, 256)[:, :128]  # row stride 256
    q, s = per_token_quant(x.to(DEVICE))
    want_q, _ = quantize_tokens(x)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    q0, s0 = per_token_quant(torch.empty(0, 64, device=DEVICE))
    assert q0.shape == (0, 64) and s0.shape == (0, 1)


def test_the_gpu_path_of_the_fp8_linear_quantizes_with_the_kernel():
    """What `scaled_linear` feeds `_scaled_mm` on CUDA: the kernel's output, which equals the
    oracle's, for strided inputs too."""
    from phaseflip.model.quant.fp8 import _quantize_on_gpu

    x = torch.randn(6, 320)[:, :160]
    q, s = _quantize_on_gpu(x.to(DEVICE), None)
    want_q, want_s = quantize_tokens(x)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s.cpu(), want_s)
