"""FP8 per-token quantization fused into RMSNorm (+ residual add) and SiLU·mul.

The contract is bitwise: the fused kernels' (x_q, scale) equal the 16-bit output the plain
kernel writes today followed by `per_token_quant` (the rounding to 16 bits first, then the amax
of the rounded row, `div_rn`, clamp, RNE cast), and a tiny FP8 Llama's logits are bitwise the
same with and without the fusion. Runs on CUDA when present, else on the CPU through Triton's
interpreter; the model-level test forces the fused path on CPU tensors (kernel dispatch and
`_scaled_mm` eligibility patched, `torch._scaled_mm` emulated in float32: both paths use the
same emulation, so only the quantization differs between them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton_interpreter import interpret_without_cuda

interpret_without_cuda()  # before triton is imported
pytest.importorskip("triton")

from tiny_llama import logits, prefill, tiny_llama  # noqa: E402

from phaseflip.kernels import activation, fp8_quant, gemm_rows, norm  # noqa: E402
from phaseflip.kernels.activation import silu_and_mul, silu_and_mul_fp8  # noqa: E402
from phaseflip.kernels.fp8_quant import per_token_quant  # noqa: E402
from phaseflip.kernels.norm import (  # noqa: E402
    fused_add_rms_norm,
    fused_add_rms_norm_fp8,
    rms_norm,
    rms_norm_fp8,
)
from phaseflip.layout import Layout  # noqa: E402
from phaseflip.model import layers  # noqa: E402
from phaseflip.model.quant import fp8  # noqa: E402
from phaseflip.model.quant.fp8 import Fp8Activation, quantize_tokens  # noqa: E402

# a gate of -100 overflows exp(-g) to inf in float32, as in torch: silu is then -0
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
HALF = [torch.bfloat16, torch.float16]
EPS = 1e-6


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rows(t: int, k: int, dtype: torch.dtype, seed: int, huge: float) -> torch.Tensor:
    """Rows spanning six decades, one all zeros, one with a huge outlier, one constant tiny
    row (FP8 subnormals after scaling)."""
    x = torch.randn(t, k, generator=_gen(seed)) * torch.logspace(-3, 3, t)[:, None]
    x[1] = 0
    x[2, k // 3] = huge
    x[3] = 1e-3
    return x.to(dtype).to(DEVICE)


def _same_fp8(got: tuple, want: tuple) -> None:
    (q, s), (wq, ws) = got, want
    assert q.dtype == torch.float8_e4m3fn and q.shape == wq.shape
    assert s.dtype == torch.float32 and s.shape == ws.shape == (q.shape[0], 1)
    assert torch.equal(s, ws), (s - ws).abs().max()
    assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8)), \
        int((q.view(torch.uint8) != wq.view(torch.uint8)).sum())


def _weight(k: int, dtype: torch.dtype, seed: int, gain: float = 1.0) -> torch.Tensor:
    return ((1 + 0.3 * torch.randn(k, generator=_gen(seed))) * gain).to(dtype).to(DEVICE)


# ------------------------------------------------------------------------------ the kernels


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("k", [64, 200, 4099])  # one block, ragged, odd (block 8192)
@pytest.mark.parametrize("gain", [1.0, 300.0])  # outputs past e4m3's 448: the scale absorbs
def test_rms_norm_fp8_is_norm_then_per_token_quant(dtype, k, gain):
    x, w = _rows(19, k, dtype, k, 3e4), _weight(k, dtype, k, gain)
    want_out = rms_norm(x, w, EPS)
    out, q, s = rms_norm_fp8(x, w, EPS, keep_out=True)
    assert torch.equal(out, want_out)  # the 16-bit output as today
    _same_fp8((q, s), per_token_quant(want_out))
    # and the torch oracle's, on the CPU: CUDA torch divides by a Python scalar as a multiply
    # by its reciprocal (an ulp off IEEE at times), the kernels and CPU torch divide exactly
    _same_fp8((q.cpu(), s.cpu()), quantize_tokens(want_out.cpu()))
    none, q2, s2 = rms_norm_fp8(x, w, EPS)
    assert none is None
    _same_fp8((q2, s2), (q, s))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("k", [64, 200, 4099])
@pytest.mark.parametrize("keep_out", [True, False])
def test_fused_add_rms_norm_fp8_is_add_norm_then_per_token_quant(dtype, k, keep_out):
    x, r = _rows(21, k, dtype, k, 3e4), _rows(21, k, dtype, k + 1, -2e4)
    w = _weight(k, dtype, k + 2)
    want_out, want_res = fused_add_rms_norm(x.clone(), r.clone(), w, EPS)
    xk, rk = x.clone(), r.clone()
    out, res, q, s = fused_add_rms_norm_fp8(xk, rk, w, EPS, keep_out=keep_out)
    assert res.data_ptr() == rk.data_ptr() and torch.equal(res, want_res)  # in place, as today
    if keep_out:
        assert out.data_ptr() == xk.data_ptr() and torch.equal(out, want_out)
    else:
        assert out is None and torch.equal(xk, x)  # x not written at all
    _same_fp8((q, s), per_token_quant(want_out))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("n", [64, 200, 3001])  # one step, ragged, two steps of 2048 + ragged
@pytest.mark.parametrize("whole_max", [activation.WHOLE_ROW_MAX, 64])  # one pass / two passes
def test_silu_and_mul_fp8_is_silu_then_per_token_quant(dtype, n, whole_max, monkeypatch):
    monkeypatch.setattr(activation, "WHOLE_ROW_MAX", whole_max)
    # the products stay finite in the dtype (an inf row has a NaN FP8 row either way)
    huge, gain = (250.0, 0.03) if dtype == torch.float16 else (1e15, 3.0)
    g = _rows(23, 2 * n, dtype, n, huge) * gain
    want_out = silu_and_mul(g)
    out, q, s = silu_and_mul_fp8(g, keep_out=True)
    assert torch.equal(out, want_out)
    _same_fp8((q, s), per_token_quant(want_out))
    none, q2, s2 = silu_and_mul_fp8(g)
    assert none is None
    _same_fp8((q2, s2), (q, s))


@pytest.mark.parametrize("slots", [1, 3, 7, 40])  # fewer programs than rows; more (capped)
def test_silu_fp8_with_scratch_slots_is_the_same_bytes(slots, monkeypatch):
    """`scratch_slots`: programs loop over rows, each staging its products in one reused
    scratch row; bitwise the row-per-program kernel (and so the unfused pair)."""
    monkeypatch.setattr(activation, "WHOLE_ROW_MAX", 64)  # the two-pass path
    g = _rows(23, 2 * 300, torch.bfloat16, 300, 1e3)
    _same_fp8(silu_and_mul_fp8(g, scratch_slots=slots)[1:], per_token_quant(silu_and_mul(g)))


@pytest.mark.parametrize("whole_max", [activation.WHOLE_ROW_MAX, 64])
def test_fast_silu_fp8_is_within_a_step_of_the_exact_one(whole_max, monkeypatch):
    """`fast`: the approximate exp and division change a product's last bit now and then;
    dequantized, no value moves by more than one e4m3 step of its row (1/8 of the value's
    binade) and the scales by more than 1 %."""
    monkeypatch.setattr(activation, "WHOLE_ROW_MAX", whole_max)
    g = _rows(23, 2 * 300, torch.bfloat16, 300, 1e3) * 3
    _, q, s = silu_and_mul_fp8(g)
    _, qf, sf = silu_and_mul_fp8(g, fast=True, scratch_slots=5)
    assert torch.allclose(sf, s, rtol=1e-2, atol=0)
    exact, fast = q.float() * s, qf.float() * sf
    assert ((fast - exact).abs() <= exact.abs() / 8 + 2 * s * 2.0**-9).all()


def test_strided_gate_up_rows_and_empty_batches():
    g = _rows(18, 2 * 320, torch.bfloat16, 0, 50.0)
    wide = torch.zeros(18, 1000, dtype=torch.bfloat16, device=DEVICE)
    wide[:, :640] = g
    _same_fp8(silu_and_mul_fp8(wide[:, :640])[1:], per_token_quant(silu_and_mul(g)))
    w = _weight(64, torch.bfloat16, 0)
    empty = torch.empty(0, 64, dtype=torch.bfloat16, device=DEVICE)
    for got in (rms_norm_fp8(empty, w, EPS)[1:],
                fused_add_rms_norm_fp8(empty, empty.clone(), w, EPS)[2:],
                silu_and_mul_fp8(torch.empty(0, 128, dtype=torch.bfloat16, device=DEVICE))[1:]):
        assert got[0].shape == (0, 64) and got[1].shape == (0, 1)
    with pytest.raises(ValueError, match=r"\[T, N\]"):
        rms_norm_fp8(empty.view(0, 1, 64), w, EPS)


def test_fp8_variants_sum_squares_in_the_plain_kernels_order():
    """On the GPU the bitwise contract also needs the FP8 variants to sum the squares in the
    plain kernel's order (the interpreter above cannot show it): compiled for sm_90 here, every
    variant's sum runs in one layout. Left unhinted, the FP8 store (16 bytes = 16 values a
    thread) pulls the whole row into a 16-a-thread layout where the 16-bit kernel has 8."""
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("Triton's NVIDIA backend is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    shapes = ["4096", "5120", "8192", "2048:fp16", "128:bf16:4"]  # N[:dtype[:rows]]
    proc = subprocess.run([sys.executable, str(root / "tests" / "norm_reduce_layouts.py"),
                           *shapes], env=env, cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for shape, layouts in json.loads(proc.stdout).items():
        assert len(set(layouts.values())) == 1, (shape, layouts)


def test_the_rounding_order_is_what_the_comparisons_see():
    """Quantizing the float32 product before its 16-bit rounding (the tempting shortcut) gives
    other FP8 bits on these inputs, so the bitwise tests above can tell the two orders apart."""
    x, w = _rows(19, 200, torch.bfloat16, 200, 3e4).cpu(), _weight(200, torch.bfloat16, 200)
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype).float()
    unrounded = w.cpu().float() * y
    want_q, _ = quantize_tokens(unrounded.to(x.dtype))
    shortcut_q, _ = quantize_tokens(unrounded)
    assert not torch.equal(shortcut_q.view(torch.uint8), want_q.view(torch.uint8))


# ------------------------------------------------------------- the decision and the model


def _cpu_scaled_mm(a, b, scale_a, scale_b, out_dtype):
    """`torch._scaled_mm` with row-wise scales, in float32 (exact FP8 products, one order)."""
    return ((a.float() @ b.float()) * scale_a * scale_b).to(out_dtype)


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """The fused kernels and the `_scaled_mm` path taken on CPU tensors (the real row rule:
    K and N multiples of 16), `_scaled_mm` emulated; returns the kernel-call counter."""
    monkeypatch.setattr(layers, "use_fused_kernels", lambda x: True)
    monkeypatch.setattr(fp8, "_scaled_mm_ok", lambda x, w: x.numel() > 0
                        and x.shape[-1] % 16 == 0 and w.shape[0] % 16 == 0)
    monkeypatch.setattr(torch, "_scaled_mm", _cpu_scaled_mm, raising=False)
    calls: dict[str, int] = {}
    for mod, name in ((norm, "rms_norm_fp8"), (norm, "fused_add_rms_norm_fp8"),
                      (activation, "silu_and_mul_fp8"), (fp8_quant, "per_token_quant")):
        fn = getattr(mod, name)

        def counted(*args, _fn=fn, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(mod, name, counted)
    return calls


def test_which_linears_are_handed_fp8_rows(fused_on_cpu):
    """Only FP8 weights on the `_scaled_mm` path with whole rows: never bf16 weights, float32
    activations, the reference path (K not a multiple of 16), nor a TP shard of a row."""
    from phaseflip.model.quant import Fp8Config

    quant, bf16 = Fp8Config("float"), torch.bfloat16
    x = torch.randn(20, 64, dtype=bf16)
    col = layers.MergedColumnParallelLinear(64, [32, 32], False, Layout(), bf16, quant)
    assert col.takes_fp8_input(x)
    assert not col.takes_fp8_input(x.float())
    assert not col.takes_fp8_input(torch.randn(20, 40, dtype=bf16))
    plain = layers.MergedColumnParallelLinear(64, [32, 32], False, Layout(), bf16)
    assert not plain.takes_fp8_input(x)
    assert layers.RowParallelLinear(64, 32, False, Layout(), bf16, quant).takes_fp8_input(x)
    shard = layers.RowParallelLinear(128, 32, False, Layout(0, 2), bf16, quant)
    assert not shard.takes_fp8_input(x)
    with pytest.raises(ValueError, match="whole row"):
        shard(Fp8Activation(*quantize_tokens(x), bf16))


def test_the_decision_follows_the_gemm_path_on_cuda(monkeypatch):
    """Unpatched: CPU tensors never fuse. On (simulated) CUDA with FP8 MMAs every row count
    quantizes (the skinny kernel's W8A8 loop for a few rows, `_scaled_mm` beyond), so the
    producer quantizes for both; rows routed weight-only (`FP8_WEIGHT_ONLY_MAX_M`, or a GPU
    without FP8 MMAs) stay 16-bit."""
    from phaseflip.model.quant import Fp8Config

    col = layers.QKVParallelLinear(64, 16, 4, 2, False, Layout(), torch.bfloat16,
                                   Fp8Config("float"))
    most = fp8.FP8_SKINNY_MAX_M
    small, big = (torch.randn(m, 64, dtype=torch.bfloat16) for m in (most, most + 1))
    assert not col.takes_fp8_input(big)  # CPU
    monkeypatch.setattr(layers, "use_fused_kernels", lambda x: True)
    monkeypatch.setattr(fp8, "_scaled_mm_ok", lambda x, w: True)
    monkeypatch.setattr(fp8, "skinny_rows", lambda x, w: x.shape[0] <= fp8.FP8_SKINNY_MAX_M)
    monkeypatch.setattr(fp8, "_fp8_mma", lambda index: True)
    assert col.takes_fp8_input(small) and col.takes_fp8_input(big)
    monkeypatch.setattr(fp8, "FP8_WEIGHT_ONLY_MAX_M", fp8.FP8_SKINNY_MAX_M)
    assert not col.takes_fp8_input(small) and col.takes_fp8_input(big)
    monkeypatch.setattr(fp8, "FP8_WEIGHT_ONLY_MAX_M", 0)
    monkeypatch.setattr(fp8, "_fp8_mma", lambda index: False)
    assert not col.takes_fp8_input(small) and col.takes_fp8_input(big)


def _tiny_fp8_llama(tmp_path):
    from phaseflip.model.quant import Fp8Config

    return tiny_llama(tmp_path, DEVICE, Fp8Config("float"))


def test_fp8_llama_logits_are_bitwise_the_same_with_the_fusion(tmp_path, monkeypatch,
                                                               fused_on_cpu):
    """Two prefills (24 tokens) through a 2-layer Qwen2-style FP8 model (QKV bias): with the
    fusion, each layer's qkv, gate_up and down take FP8 rows from the norms and the SiLU
    (only o_proj still calls `per_token_quant`), and the logits equal the unfused run's."""
    model = _tiny_fp8_llama(tmp_path)
    batch = prefill([11, 13], 1, DEVICE)
    fused = logits(model, batch, DEVICE)
    assert fused_on_cpu == {"rms_norm_fp8": 1, "fused_add_rms_norm_fp8": 3,
                            "silu_and_mul_fp8": 2, "per_token_quant": 2}
    fused_on_cpu.clear()
    monkeypatch.setattr(layers, "fp8_input_fusable", lambda *a: False)  # today's path
    unfused = logits(model, batch, DEVICE)
    assert fused_on_cpu == {"per_token_quant": 8}
    assert torch.equal(fused, unfused)


def test_padded_gemm_rows_leave_the_logits_bitwise_the_same(tmp_path, monkeypatch,
                                                            fused_on_cpu):
    """`gemm_rows.FP8_ROW_PAD`: the producers' FP8 rows live in buffers of the padded row
    count and every `_scaled_mm` runs on them (24 tokens -> 32 rows here), the rows past the
    batch holding garbage; the logits equal the unpadded run's bit for bit."""
    model = _tiny_fp8_llama(tmp_path)
    monkeypatch.setattr(fp8, "FOLD_SCALES", False)  # o and down row-wise (folded: unpadded)
    t = 24
    batch = prefill([t], 2, DEVICE)
    rows: list[int] = []

    def recorded(a, b, scale_a, scale_b, out_dtype):
        rows.append(a.shape[0])
        return _cpu_scaled_mm(a, b, scale_a, scale_b, out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", recorded, raising=False)
    plain = logits(model, batch, DEVICE)
    assert set(rows) == {t}
    rows.clear()
    monkeypatch.setattr(gemm_rows, "FP8_ROW_PAD", 16)
    monkeypatch.setattr(gemm_rows, "ROW_PAD_MIN", 1)
    empty = fp8_quant.empty_fp8_rows

    def poisoned(t, k, device):  # the rows past t hold NaN: a leak would reach the logits
        q, scale = empty(t, k, device)
        pq, ps = gemm_rows.padded_operands(q, scale) or (q, scale)
        pq[t:].view(torch.uint8).fill_(0x7F)  # e4m3fn NaN
        ps[t:].fill_(float("nan"))
        return q, scale

    for mod in (fp8_quant, norm, activation):
        monkeypatch.setattr(mod, "empty_fp8_rows", poisoned)
    padded = logits(model, batch, DEVICE)
    assert len(rows) == 8 and set(rows) == {32}  # 2 layers x qkv, o, gate_up, down
    assert padded.shape == plain.shape and torch.equal(padded, plain)


def test_padded_operands_view_the_buffers_or_decline(monkeypatch):
    monkeypatch.setattr(gemm_rows, "FP8_ROW_PAD", 128)
    assert [gemm_rows.gemm_rows(t, fp8=True) for t in (1, 1024, 1025, 8704, 8705)] == [
        1, 1024, 1152, 8704, 8832]
    assert gemm_rows.gemm_rows(1025, fp8=False) == 1025  # the bf16 switch is its own
    q, s = fp8_quant.empty_fp8_rows(1030, 32, torch.device("cpu"))
    assert q.shape == (1030, 32) and s.shape == (1030, 1)
    pq, ps = gemm_rows.padded_operands(q, s)
    assert pq.shape == (1152, 32) and ps.shape == (1152, 1)
    assert pq.data_ptr() == q.data_ptr() and ps.data_ptr() == s.data_ptr()
    plain = torch.empty(1030, 32, dtype=torch.float8_e4m3fn)  # no room past its rows
    assert gemm_rows.padded_operands(plain, torch.empty(1030, 1)) is None
    assert gemm_rows.padded_operands(q, torch.empty(1030, 1)) is None  # x_q has room, not scale
    big, scales = torch.empty(1200, 32, dtype=torch.float8_e4m3fn), torch.empty(1200, 1)
    late = gemm_rows.padded_operands(big[10:1040], scales[10:1040])  # 10 + 1152 rows fit
    assert late[0].shape == (1152, 32) and late[0].data_ptr() == big[10].data_ptr()
    assert late[1].data_ptr() == scales[10].data_ptr()
    assert gemm_rows.padded_operands(big[60:1090], scales[60:1090]) is None  # 60 + 1152 do not
    monkeypatch.setattr(gemm_rows, "FP8_ROW_PAD", 0)
    assert gemm_rows.padded_operands(q, s) is None and gemm_rows.gemm_rows(1030, True) == 1030


def test_the_sweep_scores_each_padding_multiple():
    """`scaled_mm_probe.pad_savings`: the odd row counts against their padded ones; here one
    row past a multiple of 64 costs 1.5x and only multiples of 64 are fast: padding to 64 saves
    a third, to 16 or 32 less (it lands on a fast count a quarter or half of the time), to
    128 or 256 less too (more padded rows)."""
    from benchmarks.scaled_mm_probe import PADS, pad_savings

    layer = {m: m if m % 64 == 0 else 1.5 * m for m in range(1024, 2048 + 257, 16)}
    layer.update({m + 1: 1.5 * (m + 1) for m in range(1024, 2049, 16)})
    pads = pad_savings(layer)
    assert set(pads) == set(PADS)
    saving = {p: v["saving"] for p, v in pads.items()}
    assert saving[64] > 0.3 and max(saving, key=saving.get) == 64
    assert 0 < saving[16] < saving[32] < saving[64] > saving[128] > saving[256]


# ------------------------------------------------------------------------------ CUDA only


@pytest.mark.skipif(not ON_GPU, reason="cuBLAS's FP8 GEMM needs a GPU")
def test_the_real_scaled_mm_on_padded_rows(monkeypatch):
    """On the GPU: the padded GEMM (1 030 rows run as 1 152, the rows past 1 030 NaN) gives
    the unpadded GEMM's rows, within one bf16 rounding (cuBLAS may pick another kernel for
    the padded count), and no NaN."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("row-wise _scaled_mm needs sm_90+")
    monkeypatch.setattr(gemm_rows, "FP8_ROW_PAD", 128)
    t, k, n = 1030, 4096, 6144
    x = torch.randn(t, k, device=DEVICE, dtype=torch.bfloat16)
    q, scale = fp8_quant.empty_fp8_rows(t, k, DEVICE)
    for dst, src in zip((q, scale), per_token_quant(x)):
        dst.copy_(src)
    pq, ps = gemm_rows.padded_operands(q, scale)
    pq[t:].view(torch.uint8).fill_(0x7F)
    ps[t:].fill_(float("nan"))
    w = (torch.randn(n, k, device=DEVICE) * 0.05).to(torch.float8_e4m3fn)
    ws = torch.rand(n, device=DEVICE) * 0.01 + 0.001
    padded = fp8._scaled_mm(q, scale, w, ws, None, torch.bfloat16)
    plain = torch._scaled_mm(q.clone(), w.t(), scale_a=scale.clone(), scale_b=ws.view(1, -1),
                             out_dtype=torch.bfloat16)
    assert padded.shape == (t, n) and not padded.isnan().any()
    assert torch.allclose(padded.float(), plain.float(), rtol=8e-3, atol=1e-3)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_fused_kernels_capture_in_a_cuda_graph():
    """The three FP8 variants replay from a CUDA graph on new inputs, bitwise as unfused."""
    t, hidden, inter, dtype = 64, 1024, 2816, torch.bfloat16
    w = _weight(hidden, dtype, 0)
    x = torch.empty(t, hidden, device=DEVICE, dtype=dtype)
    res, g = torch.empty_like(x), torch.empty(t, 2 * inter, device=DEVICE, dtype=dtype)

    def step():
        return (rms_norm_fp8(x, w, EPS)[1:], fused_add_rms_norm_fp8(x, res, w, EPS)[2:],
                silu_and_mul_fp8(g)[1:])

    def fill(seed: int) -> None:
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        for buf in (x, res, g):
            buf.copy_(torch.randn(buf.shape, generator=gen, device=DEVICE) * 3)

    fill(0)
    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    fill(7)
    x0, r0, g0 = x.clone(), res.clone(), g.clone()
    graph.replay()
    torch.cuda.synchronize()
    _same_fp8(outs[0], per_token_quant(rms_norm(x0, w, EPS)))
    _same_fp8(outs[1], per_token_quant(fused_add_rms_norm(x0.clone(), r0.clone(), w, EPS)[0]))
    _same_fp8(outs[2], per_token_quant(silu_and_mul(g0)))

