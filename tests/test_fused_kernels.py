"""Fused Triton kernels (RMSNorm +- residual add, SiLU*mul, rotary) against the torch path.

Runs on CUDA when present, else on the CPU through Triton's interpreter (`TRITON_INTERPRET=1`,
set here before any kernel is defined); skipped when triton is not installed. The dispatch in
`RMSNorm` / `SiluAndMul` / `RotaryEmbedding` only fires on CUDA tensors, so these tests call the
kernel functions directly and compare them with the modules' `forward_native` / `apply_rotary`.

Contract, in ulps of the output dtype (`ulps` below: distance in representable values):
- rotary: bit-identical for fp32, fp16 and bf16 (measured max difference 0, CPU interpreter).
- fused add: the new residual bit-identical.
- RMSNorm output and silu_and_mul: fp16/bf16 within 2 ulps on under 0.5% of the elements, fp32
  within 8 ulps (~5e-7 relative). The half-precision slack: the fp32 intermediate (sum of
  squares in another order; NumPy's exp vs torch's Sleef exp on the CPU) can tip one rounding
  to the dtype by 1 ulp, and the dtype multiply that follows (weight * y, silu * up) can turn
  that into 2 ulps of the output when the product crosses a power of two. Measured on the CPU
  interpreter (triton 3.6, NumPy 2.x): RMSNorm fp16/bf16 0 ulps, fp32 max 4; silu_and_mul bf16
  0, fp16 max 2 (on 0.014% of the elements), fp32 max 4. On the GPU the SiLU kernel uses the
  libdevice expf and IEEE division torch's CUDA kernel compiles to, so fp16/bf16 are expected
  bit-identical there (`benchmarks/fused_kernels.py` reports the mismatch counts).
`test_comparisons_can_fail` shows these bounds catch a wrong eps / position / gate.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import interpret_without_cuda

interpret_without_cuda()  # before triton is imported
pytest.importorskip("triton")

from phaseflip.kernels.activation import silu_and_mul  # noqa: E402
from phaseflip.kernels.norm import fused_add_rms_norm, rms_norm  # noqa: E402
from phaseflip.kernels.rope import apply_rotary_inplace  # noqa: E402
from phaseflip.model.config import RopeConfig  # noqa: E402
from phaseflip.model.layers import RMSNorm, SiluAndMul  # noqa: E402
from phaseflip.model.rope import RotaryEmbedding, apply_rotary  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-6


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| counted in representable values of their dtype (0 = bit-identical)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    bits = {4: torch.int32, 2: torch.int16}[a.element_size()]
    lo = -(1 << (8 * a.element_size() - 1))

    def ordered(t: torch.Tensor) -> torch.Tensor:
        i = t.contiguous().view(bits).long()
        return torch.where(i < 0, lo - i, i)  # sign-magnitude -> monotone integers

    return (ordered(a) - ordered(b)).abs()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, gen: torch.Generator, dtype: torch.dtype, scale: float = 1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def _norm_module(n: int, dtype: torch.dtype, gen: torch.Generator) -> RMSNorm:
    norm = RMSNorm(n, EPS, dtype).to(DEVICE)
    norm.weight.data.copy_(1 + 0.3 * torch.randn(n, generator=gen))
    return norm


def _bound(dtype: torch.dtype) -> int:
    """Max ulps for RMSNorm / SiLU outputs (see the module docstring)."""
    return 8 if dtype == torch.float32 else 2


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    d = ulps(got, want)
    assert d.max() <= _bound(got.dtype), f"max {d.max()} ulp"
    if got.dtype != torch.float32:
        assert (d > 0).float().mean() < 0.005, f"{(d > 0).float().mean():.2%} differ"


# ---------------------------------------------------------------------------------- RMSNorm

NORM_SHAPES = [(7, 96), (33, 1000), (1, 4096), (33, 128)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", NORM_SHAPES)
def test_rms_norm(rows, n, dtype):
    gen = _gen(rows * n)
    norm = _norm_module(n, dtype, gen)
    x = _randn(rows, n, gen=gen, dtype=dtype, scale=3.0)
    want = norm.forward_native(x)
    got = rms_norm(x, norm.weight, EPS)
    assert got.is_contiguous()
    _check(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(7, 96), (33, 1000), (1, 4096)])
@pytest.mark.parametrize("strided", [False, True])
def test_fused_add_rms_norm(rows, n, dtype, strided):
    gen = _gen(rows + n + strided)
    norm = _norm_module(n, dtype, gen)
    x = _randn(rows, n, gen=gen, dtype=dtype, scale=2.0)
    res = _randn(rows, n, gen=gen, dtype=dtype, scale=5.0)
    want_out, want_res = norm.forward_native(x, res)
    if strided:  # rows of a wider buffer, as a slice of the fused qkv / gate_up output would be
        xb, rb = _randn(rows, n + 24, gen=gen, dtype=dtype), _randn(rows, n + 8, gen=gen,
                                                                     dtype=dtype)
        xk, rk = xb[:, 5 : 5 + n], rb[:, :n]
        xk.copy_(x)
        rk.copy_(res)
        keep_x, keep_r = xb.clone(), rb.clone()
    else:
        xk, rk = x.clone(), res.clone()
    got_out, got_res = fused_add_rms_norm(xk, rk, norm.weight, EPS)
    assert got_out is xk and got_res is rk  # in place
    assert torch.equal(got_res, want_res)
    _check(got_out, want_out)
    if strided:  # nothing outside the views was touched
        assert torch.equal(xb[:, :5], keep_x[:, :5]) and torch.equal(xb[:, 5 + n :],
                                                                     keep_x[:, 5 + n :])
        assert torch.equal(rb[:, n:], keep_r[:, n:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_per_head_view(dtype):
    """Qwen3's q_norm/k_norm: rows of head_dim in [T, H, D] views of the fused qkv output."""
    t, h, kvh, d = 7, 4, 2, 64
    gen = _gen(3)
    norm = _norm_module(d, dtype, gen)
    qkv = _randn(t, (h + 2 * kvh) * d, gen=gen, dtype=dtype, scale=2.0)
    before = qkv.clone()
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
    for x in (q, k):
        got = rms_norm(x, norm.weight, EPS)
        assert got.is_contiguous()
        _check(got, norm.forward_native(x))
    assert torch.equal(qkv, before)  # the plain norm is out of place


def test_rms_norm_out_buffer_and_empty():
    gen = _gen(4)
    norm = _norm_module(96, torch.float32, gen)
    x = _randn(5, 96, gen=gen, dtype=torch.float32)
    out = torch.full_like(x, float("nan"))
    assert rms_norm(x, norm.weight, EPS, out=out) is out
    _check(out, norm.forward_native(x))
    empty = x[:0]
    assert rms_norm(empty, norm.weight, EPS).shape == (0, 96)
    assert fused_add_rms_norm(empty, empty.clone(), norm.weight, EPS)[0].shape == (0, 96)
    with pytest.raises(ValueError):
        fused_add_rms_norm(x, x.to(torch.float16), norm.weight, EPS)


# ------------------------------------------------------------------------------ SiLU * mul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 96), (7, 1000), (33, 1100)])
def test_silu_and_mul(rows, n, dtype):
    gen = _gen(rows * 7 + n)
    x = _randn(rows, 2 * n, gen=gen, dtype=dtype, scale=4.0)
    want = SiluAndMul().forward_native(x)
    _check(silu_and_mul(x), want)


def test_silu_and_mul_strided_rows_and_out():
    gen = _gen(5)
    n = 200
    buf = _randn(9, 2 * n + 16, gen=gen, dtype=torch.bfloat16, scale=4.0)
    x = buf[:, 16:]  # strided rows
    out = torch.full((9, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    assert silu_and_mul(x, out=out) is out
    _check(out, SiluAndMul().forward_native(x))
    assert silu_and_mul(x[:0]).shape == (0, n)


# ---------------------------------------------------------------------------------- rotary

ROPES = {
    "default": RopeConfig("default", 10000.0),
    "partial": RopeConfig("default", 10000.0, partial_rotary_factor=0.5),
    "yarn": RopeConfig("yarn", 10000.0, factor=4.0, original_max_position_embeddings=64),
}


def _rope_case(rope_name: str, head_dim: int, dtype: torch.dtype, t: int, seed: int):
    gen = _gen(seed)
    rope = RotaryEmbedding(ROPES[rope_name], head_dim, 256, device=DEVICE)
    h, kvh = 4, 2
    qkv = _randn(t, (h + 2 * kvh) * head_dim, gen=gen, dtype=dtype, scale=3.0)
    positions = torch.randint(0, 256, (t,), generator=gen).to(DEVICE)
    q = qkv[:, : h * head_dim].view(t, h, head_dim)
    k = qkv[:, h * head_dim : (h + kvh) * head_dim].view(t, kvh, head_dim)
    return rope, qkv, q, k, positions


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope_name,head_dim", [("default", 64), ("partial", 64),
                                                ("yarn", 96), ("default", 80)])
@pytest.mark.parametrize("t", [1, 33])
def test_rotary_bit_identical(rope_name, head_dim, dtype, t):
    rope, qkv, q, k, positions = _rope_case(rope_name, head_dim, dtype, t, seed=t + head_dim)
    cos, sin = rope.cos_sin(positions, dtype)
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    v_before = qkv[:, (q.shape[1] + k.shape[1]) * head_dim :].clone()
    got_q, got_k = apply_rotary_inplace(q, k, positions, rope.cos_cache, rope.sin_cache)
    assert got_q is q and got_k is k  # in place, through the non-contiguous views
    assert torch.equal(q, want_q), f"max {ulps(q, want_q).max()} ulp"
    assert torch.equal(k, want_k), f"max {ulps(k, want_k).max()} ulp"
    assert torch.equal(qkv[:, (q.shape[1] + k.shape[1]) * head_dim :], v_before)


def test_rotary_module_paths_and_growth():
    """RotaryEmbedding.for_batch/rotate_: the torch path equals `forward`; the cache grows on
    the host for positions beyond it, and the kernel reads the grown tables."""
    rope, _, q, k, positions = _rope_case("default", 64, torch.float32, 9, seed=1)
    positions[3] = 700  # beyond the 256-row cache
    want_q, want_k = rope(positions, q, k, max_position=700)
    assert rope.cache_len == 1024
    rotary = rope.for_batch(positions, q.dtype, max_position=700)
    assert (rotary.cos_sin is None) == rope.uses_kernel(q)
    got_q, got_k = rotary.rotate_(q.clone(), k.clone())
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    apply_rotary_inplace(q, k, positions, rope.cos_cache, rope.sin_cache)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


def test_rotary_position_outside_table_is_nan():
    rope, _, q, k, positions = _rope_case("default", 64, torch.float32, 3, seed=2)
    positions[1] = rope.cache_len
    apply_rotary_inplace(q, k, positions, rope.cos_cache, rope.sin_cache)
    assert q[1].isnan().all() and k[1].isnan().all()
    assert not q[0].isnan().any() and not q[2].isnan().any()


# ------------------------------------------------------------------- the checks can fail


def test_comparisons_can_fail():
    gen = _gen(6)
    norm = _norm_module(96, torch.bfloat16, gen)
    x = _randn(7, 96, gen=gen, dtype=torch.bfloat16, scale=0.01)  # eps matters at this scale
    with pytest.raises(AssertionError):
        _check(rms_norm(x, norm.weight, 1e-5), norm.forward_native(x))

    rope, _, q, k, positions = _rope_case("default", 64, torch.bfloat16, 5, seed=3)
    cos, sin = rope.cos_sin(positions, torch.bfloat16)
    want_q = apply_rotary(q, cos, sin)
    apply_rotary_inplace(q, k, positions + 1, rope.cos_cache, rope.sin_cache)
    assert ulps(q, want_q).max() > 1

    y = _randn(5, 200, gen=gen, dtype=torch.bfloat16, scale=4.0)
    swapped = torch.cat((y[:, 100:], y[:, :100]), dim=-1)  # up|gate instead of gate|up
    with pytest.raises(AssertionError):
        _check(silu_and_mul(swapped), SiluAndMul().forward_native(y))


# ------------------------------------------------------------------- the decoder, end to end


def _tiny_qwen3(tmp_path, dtype: torch.dtype):
    """A 2-layer Qwen3-style model (q/k norm, partial rotary) with seeded random weights."""
    import json

    from phaseflip.layout import Layout
    from phaseflip.model.config import ModelConfig
    from phaseflip.model.dummy import init_dummy_weights
    from phaseflip.model.llama import LlamaForCausalLM

    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 96,
           "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 128, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "max_position_embeddings": 64,
           "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with torch.device(DEVICE):
        model = LlamaForCausalLM(ModelConfig.from_dir(tmp_path), Layout(), dtype)
    init_dummy_weights(model, 0)
    return model.eval()


@pytest.mark.parametrize("dtype,pool_dtype", [(torch.float32, torch.float32),
                                              (torch.bfloat16, torch.bfloat16),
                                              (torch.bfloat16, torch.float8_e4m3fn)])
def test_decoder_forward_kernel_path_matches_torch_path(tmp_path, monkeypatch, dtype,
                                                        pool_dtype):
    """Whole-model forward with every fused kernel forced on (also on CPU tensors, through the
    interpreter) against the torch path: in-place residual, rotary fused with the KV store
    (float and FP8 pools, random per-head scales), q/k norm on strided views, partial rotary
    and a position beyond the initial rope cache (growth on the host). Bound on
    ||kernel - torch|| / ||torch|| of the final hidden states: fp32 1e-6, bf16 1e-2 (a flipped
    bf16 rounding may cascade); measured on the CPU interpreter: fp32 2.5e-7, bf16 0."""
    from phaseflip.attention.torch_ref import TorchRefAttention
    from phaseflip.cache.kv_pool import KVPool
    from phaseflip.forward_batch import ForwardBatch
    from phaseflip.kernels import activation, norm, rope
    from phaseflip.model import layers

    model = _tiny_qwen3(tmp_path, dtype)
    assert model.rope.rotary_dim == 16 and model.rope.cache_len == 64
    seqs = [(0, 5), (70, 2)]  # (prefix, extend): the second reaches position 71
    slots = torch.randperm(80, generator=_gen(0))[: sum(p + e for p, e in seqs)] + 1
    indptr, out_loc, positions = [0], [], []
    for p, e in seqs:
        out_loc.append(slots[indptr[-1] + p : indptr[-1] + p + e])
        positions += list(range(p, p + e))
        indptr.append(indptr[-1] + p + e)
    batch = ForwardBatch(
        input_ids=torch.randint(0, 128, (len(positions),), generator=_gen(1)),
        positions=torch.tensor(positions), out_cache_loc=torch.cat(out_loc),
        extend_lens=[e for _, e in seqs], prefix_lens=[p for p, _ in seqs],
        kv_indptr=torch.tensor(indptr), kv_indices=slots,
        logits_indices=torch.arange(len(positions)), max_position=max(positions),
    ).to(DEVICE)

    def forward() -> torch.Tensor:
        pool = KVPool(96, (0, 2), 2, 32, pool_dtype, DEVICE)
        for i in range(2):  # the second sequence's cached prefix
            pool.k[i].copy_(torch.randn(pool.k[i].shape, generator=_gen(10 + i)))
            pool.v[i].copy_(torch.randn(pool.v[i].shape, generator=_gen(20 + i)))
        if pool.k_scale is not None:
            pool.k_scale.copy_(torch.rand(2, 2, generator=_gen(30)) + 0.05)
            pool.v_scale.copy_(torch.rand(2, 2, generator=_gen(31)) + 0.05)
        with torch.inference_mode():
            return model(batch, pool, TorchRefAttention())[0]

    monkeypatch.setattr(layers, "use_fused_kernels", lambda x: False)
    monkeypatch.setattr(RotaryEmbedding, "uses_kernel", lambda self, x: False)
    want = forward()
    assert model.rope.cache_len == 128  # grown on the host by for_batch

    calls = {"norm": 0, "add_norm": 0, "silu": 0, "rope": 0}

    def counted(mod, name: str, key: str) -> None:
        fn = getattr(mod, name)

        def wrapper(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)

        monkeypatch.setattr(mod, name, wrapper)

    counted(norm, "rms_norm", "norm")
    counted(norm, "fused_add_rms_norm", "add_norm")
    counted(activation, "silu_and_mul", "silu")
    counted(rope, "rotary_store_kv", "rope")
    monkeypatch.setattr(layers, "use_fused_kernels", lambda x: True)
    monkeypatch.setattr(RotaryEmbedding, "uses_kernel", lambda self, x: True)
    got = forward()
    # per layer: q_norm + k_norm (+ input_layernorm of layer 0), 2 add+norm (1 in layer 0),
    # rotary + KV store, silu; plus the final add+norm
    assert calls == {"norm": 5, "add_norm": 4, "silu": 2, "rope": 2}
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert rel < (1e-6 if dtype == torch.float32 else 1e-2), rel


# ------------------------------------------------------------------------------ CUDA only


@pytest.mark.skipif(not ON_GPU, reason="the module dispatch only fires on CUDA tensors")
def test_modules_dispatch_to_kernels_on_cuda():
    torch.manual_seed(0)
    t, hidden, inter, h, kvh, d = 300, 4096, 14336, 32, 8, 128
    dtype = torch.bfloat16
    norm = RMSNorm(hidden, EPS, dtype).to(DEVICE)
    norm.weight.data.normal_(1.0, 0.2)
    x = torch.randn(t, hidden, device=DEVICE, dtype=dtype)
    res = torch.randn(t, hidden, device=DEVICE, dtype=dtype) * 4
    want_out, want_res = norm.forward_native(x, res)
    xk, rk = x.clone(), res.clone()
    got_out, got_res = norm(xk, rk)
    assert got_out.data_ptr() == xk.data_ptr() and got_res.data_ptr() == rk.data_ptr()
    assert torch.equal(got_res, want_res)
    _check(got_out, want_out)
    _check(norm(x), norm.forward_native(x))

    g = torch.randn(t, 2 * inter, device=DEVICE, dtype=dtype) * 4
    _check(SiluAndMul()(g), SiluAndMul().forward_native(g))

    rope = RotaryEmbedding(RopeConfig("llama3", 500000.0, factor=8.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0,
                                      original_max_position_embeddings=8192), d, 131072,
                           device=DEVICE)
    qkv = torch.randn(t, (h + 2 * kvh) * d, device=DEVICE, dtype=dtype)
    positions = torch.randint(0, 100_000, (t,), device=DEVICE)
    q, k = qkv[:, : h * d].view(t, h, d), qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
    cos, sin = rope.cos_sin(positions, dtype)
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    rotary = rope.for_batch(positions, dtype, max_position=int(positions.max()))
    assert rotary.cos_sin is None
    got_q, got_k = rotary.rotate_(q, k)
    assert got_q.data_ptr() == q.data_ptr()
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_kernels_capture_in_a_cuda_graph():
    """The three kernels replay from a CUDA graph on new inputs copied into static buffers."""
    torch.manual_seed(1)
    t, hidden, inter, h, kvh, d = 64, 1024, 2816, 8, 2, 128
    dtype = torch.bfloat16
    norm = RMSNorm(hidden, EPS, dtype).to(DEVICE)
    norm.weight.data.normal_(1.0, 0.2)
    rope = RotaryEmbedding(RopeConfig("default", 10000.0), d, 4096, device=DEVICE)
    x = torch.empty(t, hidden, device=DEVICE, dtype=dtype)
    res = torch.empty_like(x)
    g = torch.empty(t, 2 * inter, device=DEVICE, dtype=dtype)
    qkv = torch.empty(t, (h + 2 * kvh) * d, device=DEVICE, dtype=dtype)
    pos = torch.zeros(t, dtype=torch.int64, device=DEVICE)
    q, k = qkv[:, : h * d].view(t, h, d), qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)

    def step() -> torch.Tensor:
        fused_add_rms_norm(x, res, norm.weight, EPS)
        apply_rotary_inplace(q, k, pos, rope.cos_cache, rope.sin_cache)
        return silu_and_mul(g)

    def fill(seed: int) -> None:
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        for buf in (x, res, g, qkv):
            buf.copy_(torch.randn(buf.shape, generator=gen, device=DEVICE))
        pos.copy_(torch.randint(0, 4096, (t,), generator=gen, device=DEVICE))

    fill(0)
    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        act = step()
    fill(7)
    x0, r0, g0, qkv0, p0 = x.clone(), res.clone(), g.clone(), qkv.clone(), pos.clone()
    graph.replay()
    torch.cuda.synchronize()
    want_x, want_r = norm.forward_native(x0, r0)
    assert torch.equal(res, want_r)
    _check(x, want_x)
    cos, sin = rope.cos_sin(p0, dtype)
    q0, k0 = qkv0[:, : h * d].view(t, h, d), qkv0[:, h * d : (h + kvh) * d].view(t, kvh, d)
    assert torch.equal(q, apply_rotary(q0, cos, sin)) and torch.equal(k, apply_rotary(k0, cos, sin))
    _check(act, SiluAndMul().forward_native(g0))
