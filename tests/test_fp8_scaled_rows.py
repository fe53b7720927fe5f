"""FP8 products handed on before their scales (`ScaledRows`): o_proj and down run cuBLAS
tensor-wise and the residual add + RMSNorm kernel applies the per-token and per-channel
scales as it adds.

The kernel's contract is bitwise: scaling inside the add equals `ScaledRows.materialize`
followed by the plain add + norm. The model's: a tiny bf16 FP8 Llama takes the fold at o and
down but the stage's last down (tensor-wise GEMMs, counted), its logits bitwise those of the
same run with every `ScaledRows` materialized before the norm, and within bf16's rounding of
the row-wise run (the fold rounds the product once more). Runs on CUDA when present, else on the CPU
through Triton's interpreter, with `torch._scaled_mm` emulated in float32 as
`test_fp8_quant_fusion.py` does.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import interpret_without_cuda

interpret_without_cuda()  # before triton is imported
pytest.importorskip("triton")

from tiny_llama import logits, prefill, tiny_llama  # noqa: E402

from phaseflip.kernels.norm import fused_add_rms_norm, fused_add_rms_norm_fp8  # noqa: E402
from phaseflip.layout import Layout  # noqa: E402
from phaseflip.model import layers  # noqa: E402
from phaseflip.model.quant import Fp8Config, fp8  # noqa: E402
from phaseflip.model.quant.fp8 import ScaledRows  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
EPS = 1e-6


def _scaled(t: int, n: int, seed: int) -> ScaledRows:
    """Products of FP8 magnitudes (up to ~1e5) with scales spanning four decades."""
    gen = torch.Generator().manual_seed(seed)
    prod = (torch.randn(t, n, generator=gen) * 3e4).to(torch.bfloat16)
    row = torch.logspace(-6, -2, t)[:, None] * (1 + torch.rand(t, 1, generator=gen))
    col = 0.5 + torch.rand(n, generator=gen)
    return ScaledRows(prod.to(DEVICE), row.to(DEVICE), col.to(DEVICE), torch.bfloat16)


def _residual_and_weight(t: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    res = torch.randn(t, n, generator=gen).to(torch.bfloat16).to(DEVICE)
    return res, (1 + 0.3 * torch.randn(n, generator=gen)).to(torch.bfloat16).to(DEVICE)


@pytest.mark.parametrize("n", [64, 200, 4096])  # one block, ragged, the 8B's hidden size
@pytest.mark.parametrize("fp8_out", [False, True])
def test_the_add_applies_the_scales_as_materialize_does(n, fp8_out):
    """Bitwise: the kernel's scaled add (out, residual, and the FP8 rows when it quantizes)
    against materializing the product first; and not the unscaled product's result."""
    t = 9
    x = _scaled(t, n, seed=n)
    res, w = _residual_and_weight(t, n, seed=n)
    plain, scales = x.materialize(), (x.row_scale, x.col_scale)
    if fp8_out:
        got = fused_add_rms_norm_fp8(x.prod.clone(), res.clone(), w, EPS, True, scales)
        want = fused_add_rms_norm_fp8(plain, res.clone(), w, EPS, True)
        assert torch.equal(got[3], want[3])
        assert torch.equal(got[2].view(torch.uint8), want[2].view(torch.uint8))
    else:
        got = fused_add_rms_norm(x.prod.clone(), res.clone(), w, EPS, scales)
        want = fused_add_rms_norm(plain, res.clone(), w, EPS)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    unscaled = fused_add_rms_norm(x.prod.clone(), res.clone(), w, EPS)
    assert not torch.equal(unscaled[1], want[1])


def test_scales_of_the_wrong_shape_are_refused():
    x = _scaled(4, 64, seed=1)
    res, w = _residual_and_weight(4, 64, seed=1)
    with pytest.raises(ValueError, match="float32"):
        fused_add_rms_norm(x.prod, res, w, EPS, (x.row_scale[:3], x.col_scale))
    with pytest.raises(ValueError, match="float32"):
        fused_add_rms_norm(x.prod, res, w, EPS, (x.row_scale, x.col_scale.double()))


def _cpu_scaled_mm(a, b, scale_a, scale_b, out_dtype):
    """`torch._scaled_mm` in float32 (exact FP8 products, one order), either scale kind."""
    return ((a.float() @ b.float()) * scale_a * scale_b).to(out_dtype)


def _take_cublas(monkeypatch) -> list[str]:
    """The fused kernels and cuBLAS's FP8 path taken on this device's tensors, `_scaled_mm`
    emulated off the GPU; returns the list of each GEMM's (scale kind, rows): "tensor" or
    "row", and the row count it ran on."""
    calls: list[tuple[str, int]] = []
    real = getattr(torch, "_scaled_mm", None)

    def recorded(a, b, scale_a, scale_b, out_dtype):
        calls.append(("tensor" if scale_a.numel() == 1 else "row", a.shape[0]))
        if ON_GPU:
            return real(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
        return _cpu_scaled_mm(a, b, scale_a, scale_b, out_dtype)

    monkeypatch.setattr(layers, "use_fused_kernels", lambda x: True)
    monkeypatch.setattr(fp8, "_scaled_mm_ok", lambda x, w: x.numel() > 0
                        and x.shape[-1] % 16 == 0 and w.shape[0] % 16 == 0)
    monkeypatch.setattr(fp8, "skinny_rows", lambda x, w: False)
    monkeypatch.setattr(fp8, "_tile_gemm_config", lambda x, w: None)
    monkeypatch.setattr(torch, "_scaled_mm", recorded, raising=False)
    return calls


@pytest.fixture
def cublas_path(monkeypatch):
    return _take_cublas(monkeypatch)


def test_o_and_down_fold_their_scales_into_the_residual_adds(tmp_path, monkeypatch):
    """Two layers: o and down tensor-wise but for the last layer's down (what leaves the
    stage is a tensor), qkv, gate_up and that down row-wise; the logits bitwise those of the
    run materializing each `ScaledRows` before the norm, and close to the row-wise run's
    (`FOLD_SCALES = False`: every GEMM row-wise), not equal."""
    model = tiny_llama(tmp_path, DEVICE, Fp8Config("float"))
    batch = prefill([11, 13], 1, DEVICE)
    calls = _take_cublas(monkeypatch)
    folded = logits(model, batch, DEVICE)
    # qkv, o, gate_up, down of each layer
    assert [k for k, _ in calls] == ["row", "tensor", "row", "tensor", "row", "tensor", "row",
                                     "row"]

    def materialized(self, x, residual, quantize):
        return self.forward(x.materialize(), residual, quantize)

    monkeypatch.setattr(layers.RMSNorm, "_forward_scaled", materialized)
    assert torch.equal(logits(model, batch, DEVICE), folded)
    monkeypatch.undo()
    calls = _take_cublas(monkeypatch)
    monkeypatch.setattr(fp8, "FOLD_SCALES", False)
    rowwise = logits(model, batch, DEVICE)
    assert [k for k, _ in calls] == ["row"] * 8
    err = (folded.float() - rowwise.float()).abs().max().item()
    assert 0 < err < 0.05 * rowwise.float().abs().max().item(), err


def test_fold_only_where_nothing_follows_the_gemm(cublas_path):
    """One process without a bias hands back `ScaledRows`; a bias (added after the GEMM),
    an fp16 model or `fold=False` get tensors. (A TP shard never folds: its partial sums are
    reduced first.)"""
    quant, bf16 = Fp8Config("float"), torch.bfloat16
    x = torch.randn(20, 64, dtype=bf16, device=DEVICE)

    def out(layer, fold=True):
        layer = layer.to(DEVICE)
        layer.weight.data.copy_(torch.randn(layer.weight.shape).to(layer.weight.dtype))
        layer.weight_scale.data.fill_(0.01)
        if layer.bias is not None:
            layer.bias.data.zero_()
        return layer(x, fold=fold)

    assert isinstance(out(layers.RowParallelLinear(64, 32, False, Layout(), bf16, quant)),
                      ScaledRows)
    assert isinstance(out(layers.RowParallelLinear(64, 32, False, Layout(), bf16, quant),
                          fold=False), torch.Tensor)
    assert isinstance(out(layers.RowParallelLinear(64, 32, True, Layout(), bf16, quant)),
                      torch.Tensor)
    f16 = layers.RowParallelLinear(64, 32, False, Layout(), torch.float16, quant).to(DEVICE)
    f16.weight_scale.data.fill_(0.01)
    assert isinstance(f16(x.half(), fold=True), torch.Tensor)  # only bf16 models fold


def test_the_folded_gemms_run_on_the_rows_unpadded(tmp_path, monkeypatch):
    """With FP8 row padding on (16 rows here), the row-wise GEMMs run on the padded count and
    the tensor-wise ones on the batch's own (no sawtooth to pad away); logits unchanged."""
    from phaseflip.kernels import gemm_rows

    model = tiny_llama(tmp_path, DEVICE, Fp8Config("float"))
    batch = prefill([24], 2, DEVICE)
    calls = _take_cublas(monkeypatch)
    plain = logits(model, batch, DEVICE)
    assert {r for _, r in calls} == {24}
    calls.clear()
    monkeypatch.setattr(gemm_rows, "FP8_ROW_PAD", 16)
    monkeypatch.setattr(gemm_rows, "ROW_PAD_MIN", 1)
    padded = logits(model, batch, DEVICE)
    assert sorted(calls) == [("row", 32)] * 5 + [("tensor", 24)] * 3
    assert torch.equal(padded, plain)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs and cuBLAS's FP8 GEMM need a GPU")
def test_a_folded_layer_replays_from_a_cuda_graph(monkeypatch):
    """o (folded, the real tensor-wise `_scaled_mm`) into the scaled add + norm, captured and
    replayed on new rows: bitwise the eager run's (the unit scale made inside the capture
    lives in the graph's pool)."""
    from phaseflip.model.quant.fp8 import quantize_rows

    monkeypatch.setattr(fp8, "_tile_gemm_config", lambda x, w: None)  # cuBLAS, whatever table

    t, k, n = 256, 1024, 1024
    o = layers.RowParallelLinear(k, n, False, Layout(), torch.bfloat16,
                                 Fp8Config("float")).to(DEVICE)
    w_q, w_s = quantize_rows(torch.randn(n, k, device=DEVICE) * 0.05)
    o.weight.data.copy_(w_q)
    o.weight_scale.data.copy_(w_s)
    norm = layers.RMSNorm(n, EPS, torch.bfloat16).to(DEVICE)
    x = torch.empty(t, k, device=DEVICE, dtype=torch.bfloat16)
    res = torch.empty(t, n, device=DEVICE, dtype=torch.bfloat16)

    def fill(seed: int) -> None:
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        for buf in (x, res):
            buf.copy_(torch.randn(buf.shape, generator=gen, device=DEVICE))

    def step(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = o(x, fold=True)
        assert isinstance(y, ScaledRows)
        return norm(y, r)

    fill(0)
    step(res.clone())  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, summed = step(res)
    fill(7)
    want_out, want_sum = (a.clone() for a in step(res.clone()))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want_out) and torch.equal(summed, want_sum)


def test_a_pipeline_stage_does_not_fold(tmp_path, monkeypatch):
    """Only a single rank folds: the layouts a flip moves between (here stage 0 of pp2) keep
    every GEMM row-wise, so they round alike whatever the layout."""
    import json

    from tiny_llama import CONFIG

    from phaseflip.attention.torch_ref import TorchRefAttention
    from phaseflip.cache.kv_pool import KVPool
    from phaseflip.model.config import ModelConfig
    from phaseflip.model.dummy import init_dummy_weights
    from phaseflip.model.llama import LlamaForCausalLM

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    with torch.device(DEVICE):
        stage = LlamaForCausalLM(ModelConfig.from_dir(tmp_path), Layout(0, 1, 0, 2),
                                 torch.bfloat16, Fp8Config("float"))
    init_dummy_weights(stage, 0)
    batch = prefill([24], 3, DEVICE)
    pool = KVPool(32, (0, 1), CONFIG["num_key_value_heads"],
                  CONFIG["hidden_size"] // CONFIG["num_attention_heads"], torch.bfloat16,
                  DEVICE)
    calls = _take_cublas(monkeypatch)
    with torch.inference_mode():
        hidden, residual = stage.eval()(batch, pool, TorchRefAttention())
    assert [k for k, _ in calls] == ["row"] * 4 and isinstance(hidden, torch.Tensor)
