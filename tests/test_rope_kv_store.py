"""Rotary fused with the KV-cache store (`kernels.rope.rotary_store_kv`) against the unfused
reference: `apply_rotary` (torch) then `KVPool.store`.

Runs on CUDA when present, else on the CPU through Triton's interpreter; skipped without
triton. An engine-level CPU test of the fused path is not possible (CPU tensors take the torch
path: `RotaryEmbedding.uses_kernel` is CUDA-only); `test_fused_kernels.
test_decoder_forward_kernel_path_matches_torch_path` forces the dispatch through the whole
model in the interpreter instead. Contract: q and every byte of the pool bit-identical (float
pools of each dtype and the FP8 pool with per-(layer, head) scales, saturating values
included), rows outside `out_cache_loc` and other layers untouched, k and v left as given.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import interpret_without_cuda

interpret_without_cuda()  # before triton is imported
pytest.importorskip("triton")

from phaseflip.cache.kv_pool import KVPool  # noqa: E402
from phaseflip.kernels.rope import rotary_store_kv  # noqa: E402
from phaseflip.model.config import RopeConfig  # noqa: E402
from phaseflip.model.rope import RotaryEmbedding, apply_rotary  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
FP8 = torch.float8_e4m3fn
LAYERS, SLOTS, H, KVH = (2, 5), 24, 4, 2

ROPES = {
    "default": RopeConfig("default", 10000.0),
    "partial": RopeConfig("default", 10000.0, partial_rotary_factor=0.5),
    "llama3": RopeConfig("llama3", 500000.0, factor=8.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=64),
}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pool(pool_dtype: torch.dtype, head_dim: int, seed: int, kvh: int = KVH) -> KVPool:
    """A pool with random rows everywhere (so untouched rows are checkable) and, for FP8,
    random per-(layer, head) scales, some small enough that rotated values saturate."""
    gen = _gen(seed)
    pool = KVPool(SLOTS, LAYERS, kvh, head_dim, pool_dtype, DEVICE)
    pool.kv.view(torch.uint8).copy_(torch.randint(0, 120, pool.kv.view(torch.uint8).shape,
                                                  generator=gen, dtype=torch.uint8))
    if pool.k_scale is not None:
        pool.k_scale.copy_(torch.rand(pool.k_scale.shape, generator=gen) * 0.5 + 0.003)
        pool.v_scale.copy_(torch.rand(pool.v_scale.shape, generator=gen) * 0.5 + 0.003)
        pool.k_scale[:, 0] = pool.v_scale[:, -1] = 0.004  # |x| > 1.8 saturates there
    return pool


def _case(rope_name: str, head_dim: int, dtype: torch.dtype, t: int, seed: int,
          h: int = H, kvh: int = KVH):
    """(rope, qkv, q, k, v, positions, slots): q/k/v are strided views of one qkv buffer."""
    gen = _gen(seed)
    rope = RotaryEmbedding(ROPES[rope_name], head_dim, 256, device=DEVICE)
    qkv = (torch.randn(t, (h + 2 * kvh) * head_dim, generator=gen) * 3).to(dtype).to(DEVICE)
    q = qkv[:, : h * head_dim].view(t, h, head_dim)
    k = qkv[:, h * head_dim : (h + kvh) * head_dim].view(t, kvh, head_dim)
    v = qkv[:, (h + kvh) * head_dim :].view(t, kvh, head_dim)
    positions = torch.randint(0, 256, (t,), generator=gen).to(DEVICE)
    slots = (torch.randperm(SLOTS - 1, generator=gen)[:t] + 1).to(DEVICE)
    return rope, qkv, q, k, v, positions, slots


def _reference(rope, q, k, v, positions, slots, pool, layer):
    """The unfused path: torch rotary, then the pool's own store."""
    cos, sin = rope.cos_sin(positions, q.dtype)
    pool.store(layer, slots, apply_rotary(k, cos, sin), v)
    return apply_rotary(q, cos, sin)


def _fused(rope, q, k, v, positions, slots, pool, layer):
    k_cache, v_cache = pool.layer(layer)
    k_scale, v_scale = pool.scales(layer) or (None, None)
    return rotary_store_kv(q, k, v, positions, rope.cos_cache, rope.sin_cache, slots,
                           k_cache, v_cache, k_scale, v_scale)


def _same_bytes(a: KVPool, b: KVPool) -> bool:
    return torch.equal(a.kv.view(torch.uint8), b.kv.view(torch.uint8))


@pytest.mark.parametrize("dtype,pool_dtype", [
    (torch.float32, torch.float32), (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16), (torch.bfloat16, FP8), (torch.float16, FP8),
    (torch.float32, FP8),
])
@pytest.mark.parametrize("rope_name,head_dim", [("llama3", 64), ("partial", 80)])
def test_pool_and_q_bit_identical(dtype, pool_dtype, rope_name, head_dim):
    rope, qkv, q, k, v, positions, slots = _case(rope_name, head_dim, dtype, 5, seed=head_dim)
    want_pool, got_pool = _pool(pool_dtype, head_dim, 1), _pool(pool_dtype, head_dim, 1)
    if pool_dtype == FP8:  # some values past the FP8 range saturate, on both paths alike
        assert (k[:, 0].float().abs() / got_pool.k_scale[1, 0] > got_pool.fp8_max).any()
        assert (v[:, -1].float().abs() / got_pool.v_scale[1, -1] > got_pool.fp8_max).any()
    before = qkv.clone()
    want_q = _reference(rope, q, k, v, positions, slots, want_pool, 3)
    got_q = _fused(rope, q, k, v, positions, slots, got_pool, 3)
    assert got_q is q and torch.equal(q, want_q)
    assert _same_bytes(got_pool, want_pool)
    width = H * head_dim
    assert torch.equal(qkv[:, width:], before[:, width:])  # k and v as given


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, FP8])
def test_several_head_blocks_per_token(pool_dtype):
    """head_dim 256 with 20 q / 10 KV heads: two q programs and two K/V programs a token, the
    second of each partly masked (16 q heads and 8 K/V heads a program at this width)."""
    rope, _, q, k, v, positions, slots = _case("default", 256, torch.bfloat16, 3, seed=8,
                                               h=20, kvh=10)
    want_pool, got_pool = _pool(pool_dtype, 256, 6, kvh=10), _pool(pool_dtype, 256, 6, kvh=10)
    want_q = _reference(rope, q, k, v, positions, slots, want_pool, 2)
    _fused(rope, q, k, v, positions, slots, got_pool, 2)
    assert torch.equal(q, want_q) and _same_bytes(got_pool, want_pool)


def test_float_pool_of_another_dtype_gets_the_cast_rows():
    """A bf16 model over an fp32 pool: rows cast as `KVPool.store` casts them."""
    rope, _, q, k, v, positions, slots = _case("default", 64, torch.bfloat16, 3, seed=4)
    want_pool, got_pool = _pool(torch.float32, 64, 2), _pool(torch.float32, 64, 2)
    want_q = _reference(rope, q, k, v, positions, slots, want_pool, 2)
    _fused(rope, q, k, v, positions, slots, got_pool, 2)
    assert torch.equal(q, want_q) and _same_bytes(got_pool, want_pool)


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, FP8])
def test_module_paths_agree(pool_dtype):
    """`RotaryBatch.rotate_and_store_`: the kernel path (forced on CPU tensors under the
    interpreter) and the torch path leave the same q and pool; the torch path is the
    reference, so this is what the model's attention sees on either device."""
    rope, _, q, k, v, positions, slots = _case("llama3", 64, torch.bfloat16, 6, seed=5)
    pools = [_pool(pool_dtype, 64, 3), _pool(pool_dtype, 64, 3)]
    outs = []
    for kernel, pool in zip((False, True), pools):
        rope.uses_kernel = lambda x, kernel=kernel: kernel  # instance override of the dispatch
        rotary = rope.for_batch(positions, q.dtype, max_position=int(positions.max()))
        assert (rotary.cos_sin is None) == kernel
        outs.append(rotary.rotate_and_store_(q.clone(), k.clone(), v, pool, 4, slots))
    assert torch.equal(outs[0], outs[1]) and _same_bytes(pools[0], pools[1])


def test_comparisons_can_fail():
    """A wrong scale, a wrong position or the unrotated k give different pool bytes."""
    rope, _, q, k, v, positions, slots = _case("llama3", 64, torch.bfloat16, 4, seed=6)
    want = _pool(FP8, 64, 4)
    _reference(rope, q.clone(), k, v, positions, slots, want, 2)
    swapped = _pool(FP8, 64, 4)
    swapped.k_scale[0] = swapped.k_scale[0].flip(0)
    _fused(rope, q.clone(), k, v, positions, slots, swapped, 2)
    assert not _same_bytes(swapped, want)
    shifted = _pool(FP8, 64, 4)
    _fused(rope, q.clone(), k, v, positions + 1, slots, shifted, 2)
    assert not _same_bytes(shifted, want)
    unrotated = _pool(FP8, 64, 4)
    unrotated.store(2, slots, k, v)
    assert not _same_bytes(unrotated, want)


def test_refuses_mismatched_pool():
    rope, _, q, k, v, positions, slots = _case("default", 64, torch.bfloat16, 2, seed=7)
    pool = _pool(FP8, 64, 5)
    k_cache, v_cache = pool.layer(2)
    with pytest.raises(ValueError, match="FP8 pool needs"):
        rotary_store_kv(q, k, v, positions, rope.cos_cache, rope.sin_cache, slots,
                        k_cache, v_cache)
    with pytest.raises(ValueError, match="do not match"):
        rotary_store_kv(q, k, v, positions, rope.cos_cache, rope.sin_cache, slots[:1],
                        k_cache, v_cache, *pool.scales(2))
    empty = _fused(rope, q[:0], k[:0], v[:0], positions[:0], slots[:0], pool, 2)
    assert empty.shape == (0, H, 64)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, FP8])
def test_captures_in_a_cuda_graph(pool_dtype):
    """Replays from a CUDA graph on new q/k/v, positions and slots copied into static buffers
    (what the decode graphs do), at Llama-3.1-8B head shapes."""
    t, h, kvh, d = 8, 32, 8, 128
    rope = RotaryEmbedding(ROPES["llama3"], d, 4096, device=DEVICE)
    qkv = torch.zeros(t, (h + 2 * kvh) * d, device=DEVICE, dtype=torch.bfloat16)
    q = qkv[:, : h * d].view(t, h, d)
    k, v = qkv[:, h * d :].view(t, 2 * kvh, d).split(kvh, dim=1)
    pos = torch.zeros(t, dtype=torch.int64, device=DEVICE)
    loc = torch.arange(1, t + 1, device=DEVICE)
    pool = KVPool(64, (0, 1), kvh, d, pool_dtype, DEVICE)
    if pool.k_scale is not None:
        pool.k_scale.uniform_(0.01, 0.1)
        pool.v_scale.uniform_(0.01, 0.1)
    scales = pool.scales(0) or (None, None)

    def step() -> None:
        rotary_store_kv(q, k, v, pos, rope.cos_cache, rope.sin_cache, loc, *pool.layer(0),
                        *scales)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    qkv.copy_(torch.randn(qkv.shape, generator=gen, device=DEVICE) * 4)
    pos.copy_(torch.randint(0, 4096, (t,), generator=gen, device=DEVICE))
    loc.copy_(torch.randperm(63, generator=gen, device=DEVICE)[:t] + 1)
    want = KVPool(64, (0, 1), kvh, d, pool_dtype, DEVICE)
    if want.k_scale is not None:
        want.k_scale.copy_(pool.k_scale)
        want.v_scale.copy_(pool.v_scale)
    want.kv.copy_(pool.kv)
    want_q = _reference(rope, q.clone(), k, v, pos, loc, want, 0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(q, want_q) and _same_bytes(pool, want)
