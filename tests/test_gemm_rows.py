"""A large GEMM's activation rows padded for cuBLAS without a copy (`kernels/gemm_rows.py`).

The producers of a GEMM's input rows (RMSNorm, SiLU·mul, attention, and for FP8 the
quantizers) allocate the padded row count and hand on a view of the real rows; the 16-bit
`linear` runs `F.linear` on the padded view and drops the padded rows. Here the switch is on
at 16 rows from one row, every padded row is poisoned with NaN, and a tiny bf16 Llama's
logits must equal the unpadded run's while every projection saw the padded count.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import interpret_without_cuda

interpret_without_cuda()  # before triton is imported
pytest.importorskip("triton")

from tiny_llama import logits, prefill, tiny_llama  # noqa: E402

from phaseflip.kernels import activation, gemm_rows, norm  # noqa: E402
from phaseflip.model import layers  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_rows_views_and_refusals(monkeypatch):
    assert gemm_rows.gemm_rows(8705, fp8=False) == 8705  # off by default
    monkeypatch.setattr(gemm_rows, "BF16_ROW_PAD", 64)
    assert [gemm_rows.gemm_rows(t, fp8=False) for t in (3, 1024, 1025, 1088, 8705)] == [
        3, 1024, 1088, 1088, 8768]
    x = gemm_rows.empty_rows(1030, 8, torch.bfloat16, "cpu", fp8=False)
    assert x.shape == (1030, 8)
    view = gemm_rows.padded_view(x, 1088)
    assert view.shape == (1088, 8) and view.data_ptr() == x.data_ptr()
    assert gemm_rows.padded_view(x, 1089) is None  # past the buffer
    assert gemm_rows.padded_view(x, 1030) is None  # nothing to pad
    assert gemm_rows.padded_view(x.t(), 1088) is None  # not contiguous rows
    assert gemm_rows.padded_view(torch.empty(1030, 8), 1088) is None  # no room


def test_padded_bf16_rows_leave_the_logits_the_same(tmp_path, monkeypatch):
    from phaseflip.kernels import linear_configs, tile_gemm

    monkeypatch.setattr(layers, "use_fused_kernels", lambda x: True)  # our kernels, on CPU
    monkeypatch.setattr(linear_configs, "should_use_skinny", lambda m, n, k: False)
    monkeypatch.setattr(tile_gemm, "pick", lambda *a, **k: None)  # cuBLAS's rows: F.linear
    model = tiny_llama(tmp_path, DEVICE)
    t = 24
    batch = prefill([t], 3, DEVICE)
    seen: list[int] = []  # the rows of each projection's F.linear, in call order
    linear = torch.nn.functional.linear

    def recorded(x, w, b=None):
        seen.append(x.shape[0])
        return linear(x, w, b)

    monkeypatch.setattr(layers.F, "linear", recorded)

    def run() -> torch.Tensor:
        seen.clear()
        return logits(model, batch, DEVICE)

    plain = run()
    assert seen[:8] == [t] * 8
    monkeypatch.setattr(gemm_rows, "BF16_ROW_PAD", 16)
    monkeypatch.setattr(gemm_rows, "ROW_PAD_MIN", 1)
    empty = gemm_rows.empty_rows

    def poisoned(t, k, dtype, device, fp8):  # the rows past t hold NaN
        x = empty(t, k, dtype, device, fp8)
        full = gemm_rows.padded_view(x, gemm_rows.gemm_rows(t, fp8))
        if full is not None:
            full[t:].fill_(float("nan"))
        return x

    for mod in (norm, activation):  # the producers (each imports the name)
        monkeypatch.setattr(mod, "empty_rows", poisoned)
    import phaseflip.attention.torch_ref as torch_ref
    monkeypatch.setattr(torch_ref, "empty_rows", poisoned)
    padded = run()
    assert seen[:8] == [32] * 8  # 2 layers x qkv, o, gate_up, down, all on 32 rows
    assert not padded.isnan().any()
    if DEVICE.type == "cpu":
        assert torch.equal(padded, plain)
    else:  # cuBLAS may pick another kernel for 32 rows than for 24
        assert torch.allclose(padded, plain, rtol=2e-2, atol=2e-2)
