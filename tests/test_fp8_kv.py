"""FP8 KV cache (`--kv-cache-dtype fp8_e4m3`): the pool stores FP8 with per-(layer, KV head)
scales, the torch reference reads it back scaled, and the Triton decode / extend kernels
(interpreter on CPU) match the reference on the same FP8 pool.

The kernel cases reuse test_triton_attention's batches (shuffled slots, random prefixes,
NaN-filled outputs). Both backends read the SAME FP8 rows, so they must agree as tightly as on
a float pool (fp32 1e-5, bf16 1e-2); the scales are random per head, so a kernel that ignored
or misplaced a scale (K into the output, V into the softmax, another head's) fails.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import interpret_without_cuda

interpret_without_cuda()  # before triton is imported

from phaseflip.attention.torch_ref import TorchRefAttention  # noqa: E402
from phaseflip.cache.kv_pool import KVPool, kv_cache_dtype  # noqa: E402

FP8 = torch.float8_e4m3fn
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _fp8_pools(num_slots: int, layers: int, kv_heads: int, head_dim: int, n: int,
               gen: torch.Generator) -> list[KVPool]:
    """`n` identical FP8 pools: random rows in every slot, random per-head scales."""
    pools = [KVPool(num_slots, (0, layers), kv_heads, head_dim, FP8, DEVICE) for _ in range(n)]
    for i in range(layers):
        ks, vs = torch.rand(2, kv_heads, generator=gen) * 0.5 + 0.05
        for src, scale in (("k", ks), ("v", vs)):
            data = (torch.randn(num_slots, kv_heads, head_dim, generator=gen) / scale[:, None])
            for pool in pools:
                getattr(pool, src)[i].copy_(data.to(FP8))
                getattr(pool, f"{src}_scale")[i].copy_(scale)
    return pools


def test_kv_cache_dtype_resolution():
    assert kv_cache_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert kv_cache_dtype("fp8_e4m3", torch.bfloat16) is FP8
    with pytest.raises(ValueError, match="fp8_e4m3"):
        kv_cache_dtype("int8", torch.bfloat16)


def test_fp8_pool_holds_twice_the_tokens_of_bf16():
    """Same bytes -> 2x the slots (8B shape: 32 layers, 8 KV heads, head_dim 128)."""
    bf16 = KVPool.bytes_per_slot(32, 8, 128, torch.bfloat16)
    fp8 = KVPool.bytes_per_slot(32, 8, 128, FP8)
    assert bf16 == 2 * fp8 == 131072
    pool = KVPool(64, (0, 2), 2, 16, FP8, "cpu")
    scale_bytes = pool.k_scale.nbytes + pool.v_scale.nbytes  # per pool, not per slot
    assert pool.kv.nbytes == 64 * KVPool.bytes_per_slot(2, 2, 16, FP8) and scale_bytes == 32


def test_store_quantizes_with_the_heads_scale_and_reads_back():
    pool = KVPool(16, (3, 5), 2, 8, FP8, "cpu")
    pool.k_scale[1] = torch.tensor([0.5, 4.0])
    pool.v_scale[1] = torch.tensor([2.0, 0.25])
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(3, 2, 8, generator=gen) * 3
    v = torch.randn(3, 2, 8, generator=gen)
    slots = torch.tensor([4, 9, 2])
    pool.store(4, slots, k, v)
    assert pool.k[1].dtype == FP8
    # the stored values are x / scale of their head, rounded to e4m3
    want_k = (k / pool.k_scale[1][:, None]).to(FP8)
    assert torch.equal(pool.k[1][slots].float(), want_k.float())
    kk, vv = pool.dequantized(4, slots)
    # e4m3: 3 mantissa bits; below 2^-6 * scale the subnormal step is 2^-9 * scale, so the
    # absolute error there reaches half of it (2^-10 * 4.0 for K's second head)
    assert torch.allclose(kk, k, rtol=0.07, atol=4.0 * 2**-10)
    assert torch.allclose(vv, v, rtol=0.07, atol=2.0 * 2**-10)
    big = torch.full((1, 2, 8), 1e6)  # saturates at +-448 * scale, never inf/nan
    pool.store(4, torch.tensor([1]), big, -big)
    kk, vv = pool.dequantized(4, torch.tensor([1]))
    assert torch.isfinite(kk).all() and torch.isfinite(vv).all()
    assert torch.equal(kk[0, 0], torch.full((8,), 448 * 0.5))


def test_float_pool_has_no_scales():
    pool = KVPool(8, (0, 1), 2, 4, torch.bfloat16, "cpu")
    assert pool.scales(0) is None and pool.k_scale is None


def test_reference_attention_reads_fp8_scaled():
    """The reference on an FP8 pool = the reference on a float pool holding the dequantized
    rows (so the scale is applied, and per head)."""
    from test_triton_attention import make_batch

    gen = torch.Generator().manual_seed(3)
    batch = make_batch([(9, 3), (4, 1)], gen)
    num_slots = int(batch.kv_indices.max()) + 4
    (fp8,) = _fp8_pools(num_slots, 1, 2, 16, 1, gen)
    f32 = KVPool(num_slots, (0, 1), 2, 16, torch.float32, DEVICE)
    q = torch.randn(batch.num_tokens, 4, 16, generator=gen).to(DEVICE)
    k = torch.randn(batch.num_tokens, 2, 16, generator=gen).to(DEVICE)
    v = torch.randn(batch.num_tokens, 2, 16, generator=gen).to(DEVICE)
    ref = TorchRefAttention()
    got = ref.forward(0, q, k, v, batch, fp8, 0.25)
    all_slots = torch.arange(num_slots)
    kk, vv = fp8.dequantized(0, all_slots)
    f32.k[0].copy_(kk)
    f32.v[0].copy_(vv)
    want = ref.forward(0, q, kk[batch.out_cache_loc], vv[batch.out_cache_loc], batch, f32, 0.25)
    assert torch.allclose(got, want, atol=1e-6)


# ---------------------------------------------------------------- Triton kernels vs reference

triton = pytest.importorskip("triton")
from phaseflip.attention.triton_backend import TritonAttention  # noqa: E402

BOUND = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def run_fp8_case(seqs, *, dtype=torch.float32, num_kv_heads=2, group=4, head_dim=32,
                 window=None, backend=None, layers=2, seed=0) -> float:
    from test_triton_attention import make_batch

    gen = torch.Generator().manual_seed(seed)
    batch = make_batch(seqs, gen)
    num_slots = int(batch.kv_indices.max()) + 8
    pools = _fp8_pools(num_slots, layers, num_kv_heads, head_dim, 2, gen)
    backend = backend or TritonAttention()
    ref = TorchRefAttention()
    worst = 0.0
    for layer in range(layers):
        t = batch.num_tokens
        q = torch.randn(t, num_kv_heads * group, head_dim, generator=gen).to(DEVICE, dtype)
        k = torch.randn(t, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
        v = torch.randn(t, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
        want = ref.forward(layer, q, k, v, batch, pools[0], head_dim**-0.5, window)
        out = torch.full_like(want, float("nan"))
        got = backend.forward(layer, q, k, v, batch, pools[1], head_dim**-0.5, window, out=out)
        assert torch.isfinite(got).all(), "unwritten or non-finite output rows"
        assert torch.equal(pools[0].k[layer].float(), pools[1].k[layer].float())
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        worst = max(worst, err)
    assert worst < BOUND[dtype], f"relative error {worst:.3g} >= {BOUND[dtype]}"
    return worst


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_decode_reads_fp8(dtype):
    run_fp8_case([(5, 1), (33, 1), (0, 1), (17, 1)], dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_extend_and_mixed_read_fp8(dtype):
    run_fp8_case([(13, 5), (40, 17), (3, 1), (0, 9)], dtype=dtype)


def test_triton_split_k_decode_and_window_read_fp8():
    run_fp8_case([(70, 1), (37, 1)], backend=TritonAttention(decode_splits=3,
                                                              decode_min_chunk=16))
    run_fp8_case([(40, 1), (20, 6)], window=7, group=2)


def test_kernels_refuse_fp8_cache_without_scales():
    from phaseflip.kernels import attention as kernels

    q = torch.randn(1, 2, 16)
    cache = torch.zeros(4, 1, 16, dtype=FP8)
    plan = kernels.plan_decode(1, 1, 1, 2, 8)
    with pytest.raises(ValueError, match="k_scale"):
        kernels.decode_attention(q, cache, cache, torch.tensor([0, 2]), torch.tensor([1, 2]),
                                 0.25, plan)


# ------------------------------------------------- FP8 decode's dot modes (kernels.FP8_DOT_MODES)


def _modes_backend(mode: str, splits: int | None = None) -> TritonAttention:
    from phaseflip.kernels import attention as kernels

    cfg = kernels.KernelConfig(16, 16, 4, 1, mode)
    return TritonAttention(decode_config=cfg, extend_config=cfg, decode_splits=splits,
                           decode_min_chunk=16)


@pytest.mark.parametrize("mode", ["q", "fp16_pv", "fp16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_decode_fp8_every_dot_mode(mode, dtype):
    """Each mode, unsplit and split-K, against the reference on the same FP8 rows."""
    seqs = [(5, 1), (70, 1), (0, 1), (33, 1)]
    run_fp8_case(seqs, dtype=dtype, backend=_modes_backend(mode))
    run_fp8_case(seqs, dtype=dtype, backend=_modes_backend(mode, splits=3), layers=1)


@pytest.mark.parametrize("mode", ["q", "fp16_pv", "fp16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_extend_fp8_every_dot_mode(mode, dtype):
    """Extend and mixed batches (masked diagonal blocks and full ones), and a window."""
    run_fp8_case([(13, 5), (40, 17), (3, 1), (0, 9)], dtype=dtype, backend=_modes_backend(mode))
    run_fp8_case([(40, 1), (20, 6)], dtype=dtype, window=7, group=2, layers=1,
                 backend=_modes_backend(mode))


@pytest.mark.parametrize("seqs", [[(40, 1), (9, 1), (25, 1)], [(30, 6), (0, 9), (12, 1)]],
                         ids=["decode", "extend"])
def test_triton_fp16_dots_survive_q_beyond_fp16_range(seqs):
    """"fp16" mode with bf16 q elements past 65504 (inf in fp16): the program's q is shrunk
    by a power of two the softmax scale undoes, so the output matches the reference (without
    the shrink it is NaN). The huge element meets K rows that are 0 in that lane, so the
    logits are ordinary and the comparison tight."""
    from test_triton_attention import make_batch

    gen = torch.Generator().manual_seed(5)
    batch = make_batch(seqs, gen)
    num_slots = int(batch.kv_indices.max()) + 8
    pools = _fp8_pools(num_slots, 1, 2, 32, 2, gen)
    for pool in pools:
        pool.k[0].view(torch.uint8)[:, :, 0] = 0  # e4m3 +0
    t = batch.num_tokens
    q = torch.randn(t, 8, 32, generator=gen).to(DEVICE, torch.bfloat16)
    q[:, 1:3, 0] = torch.tensor([1e6, -3e5]).to(q)  # two heads of KV head 0, both signs
    k = torch.randn(t, 2, 32, generator=gen).to(DEVICE, torch.bfloat16)
    k[:, :, 0] = 0
    v = torch.randn(t, 2, 32, generator=gen).to(DEVICE, torch.bfloat16)
    want = TorchRefAttention().forward(0, q, k, v, batch, pools[0], 32**-0.5)
    for splits in (None, 2):  # (extend ignores the split count)
        out = torch.full_like(want, float("nan"))
        got = _modes_backend("fp16", splits).forward(0, q, k, v, batch, pools[1], 32**-0.5,
                                                      out=out)
        assert torch.isfinite(got).all()
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert err < 1e-2, err


def test_launch_configs_read_the_kv_dtype():
    """bf16's launch shapes are unchanged; an FP8 cache with 16-bit q gets FP8's dot mode;
    float32 q never gets an fp16 mode; an unknown mode is refused."""
    from phaseflip.kernels import attention as kernels

    gpu = torch.device("cuda")  # decode_config reads only the device's type
    bf16 = kernels.decode_config(torch.bfloat16, 128, 4, gpu)
    assert bf16 == kernels.KernelConfig(16, 64, 4, 3, "q")
    assert kernels.decode_config(torch.bfloat16, 128, 4, gpu, torch.bfloat16) == bf16
    for dev in (gpu, torch.device("cpu")):
        fp8 = kernels.decode_config(torch.bfloat16, 128, 4, dev, FP8)
        assert fp8.fp8_dot == kernels.FP8_DECODE_DOT
        assert kernels.decode_config(torch.float32, 128, 4, dev, FP8).fp8_dot == "q"
        ext = kernels.extend_config(torch.bfloat16, 128, dev, FP8)
        assert ext.fp8_dot == kernels.FP8_EXTEND_DOT
        assert kernels.extend_config(torch.float32, 128, dev, FP8).fp8_dot == "q"
    assert kernels.extend_config(torch.bfloat16, 128, gpu, FP8) == kernels.KernelConfig(
        128, 128, 8, 2, kernels.FP8_EXTEND_DOT)  # the H200 sweep's fastest FP8 extend shape
    assert kernels.extend_config(torch.bfloat16, 256, gpu, FP8) == kernels.KernelConfig(
        64, 64, 4, 3, kernels.FP8_EXTEND_DOT)  # 128x128 would not fit shared memory
    for head_dim in (64, 128):  # float pools: the shapes they had
        for kv in (None, torch.bfloat16):
            got = kernels.extend_config(torch.bfloat16, head_dim, gpu, kv)
            assert got == (kernels.KernelConfig(128, 64, 8, 3) if head_dim == 64
                           else kernels.KernelConfig(64, 64, 4, 3))
    q = torch.randn(1, 2, 16)
    cache = torch.zeros(4, 1, 16, dtype=FP8)
    with pytest.raises(ValueError, match="fp8_dot"):
        kernels.decode_attention(q, cache, cache, torch.tensor([0, 2]), torch.tensor([1, 2]),
                                 0.25, kernels.plan_decode(1, 1, 1, 2, 8),
                                 config=kernels.KernelConfig(16, 16, 4, 1, "fp8"),
                                 k_scale=torch.ones(1), v_scale=torch.ones(1))


@pytest.mark.parametrize("name,seqs", [("FP8_DECODE_DOT", [(5, 1), (9, 1)]),
                                       ("FP8_EXTEND_DOT", [(5, 3), (9, 1)])])
def test_backend_plans_fp8_with_the_fp8_configs(monkeypatch, name, seqs):
    """The backend asks decode_config / extend_config with the pool's dtype: a bogus FP8
    default mode reaches the kernel wrapper (and is refused) only through an FP8 pool."""
    from phaseflip.kernels import attention_plan

    monkeypatch.setattr(attention_plan, name, "bogus")
    with pytest.raises(ValueError, match="bogus"):
        run_fp8_case(seqs, dtype=torch.bfloat16, layers=1)


def test_nan_in_an_attended_fp8_row_reaches_the_output_as_on_the_gpu():
    """e4m3's NaN (0x7F) widens to NaN on the GPU; the kernels must see the same on the CPU
    (Triton's interpreter read it as 480 until `triton_interpreter` patched the cast)."""
    from test_triton_attention import make_batch

    gen = torch.Generator().manual_seed(0)
    batch = make_batch([(9, 1), (6, 1)], gen)
    num_slots = int(batch.kv_indices.max()) + 8
    pool = _fp8_pools(num_slots, 1, 2, 32, 1, gen)[0]
    first = batch.kv_indices[: int(batch.kv_indptr[1])]
    pool.v[0].view(torch.uint8)[first[3]] = 0x7F  # one prefix row of sequence 0, every head
    q = torch.randn(2, 8, 32, generator=gen).to(DEVICE)
    k = torch.randn(2, 2, 32, generator=gen).to(DEVICE)
    v = torch.randn(2, 2, 32, generator=gen).to(DEVICE)
    got = TritonAttention().forward(0, q, k, v, batch, pool, 32**-0.5).float()
    assert torch.isnan(got[0]).all() and torch.isfinite(got[1]).all()
