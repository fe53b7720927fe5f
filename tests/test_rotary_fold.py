"""The rotary fold (`kernels/linear_fold.py` `RotaryFold`, `kernels/rope.py`
`store_rotary_fold`): a batch-1 qkv projection that rotates q and writes rotated k and v into
the KV pool in its own epilogue, so the decode layer launches no rotary kernel.

Contract: bitwise what the GEMM followed by `rotary_store_kv` leaves — the qkv output (q
rotated, k and v as projected) and the pool rows, float and FP8 pools alike — for every tile
shape (pairs of one head per tile, tiles spanning heads, split-K), with bias, FP8 weights and
the norm folded in front. Interpreted on the CPU, compiled on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import interpret_without_cuda

interpret_without_cuda()  # before triton is imported
pytest.importorskip("triton")

from phaseflip.kernels.linear import skinny_linear  # noqa: E402
from phaseflip.kernels.linear_configs import SkinnyConfig  # noqa: E402
from phaseflip.kernels.linear_fold import Fold, RotaryFold  # noqa: E402
from phaseflip.kernels.rope import rotary_store_kv  # noqa: E402
from phaseflip.model.quant import fp8  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
Q_HEADS, KV_HEADS, K = 4, 2, 64
CONFIGS = {
    "one head a tile": SkinnyConfig(16, 32, 4, 1, 1, "ew"),
    "tiles span heads": SkinnyConfig(64, 32, 4, 1, 1, "ew"),
    "split-k": SkinnyConfig(32, 16, 4, 1, 3, "ew"),
}


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _pool(fp8_pool: bool, head_dim: int) -> tuple[torch.Tensor, torch.Tensor,
                                                  torch.Tensor | None, torch.Tensor | None]:
    dtype = torch.float8_e4m3fn if fp8_pool else torch.bfloat16
    k_cache = torch.zeros(8, KV_HEADS, head_dim, dtype=dtype, device=DEVICE)
    if not fp8_pool:
        return k_cache, k_cache.clone(), None, None
    return (k_cache, k_cache.clone(), torch.tensor([0.5, 0.25], device=DEVICE),
            torch.tensor([0.3, 0.7], device=DEVICE))


@pytest.mark.parametrize("fp8_pool", [False, True], ids=["bf16 pool", "fp8 pool"])
@pytest.mark.parametrize("cfg", list(CONFIGS.values()), ids=list(CONFIGS))
@pytest.mark.parametrize("m,head_dim,fp8_weight,norm", [
    (1, 16, False, False), (2, 16, True, False), (1, 24, False, True), (2, 24, False, False),
])
def test_the_rotary_fold_is_bitwise_the_gemm_then_rotary_store(fp8_pool, cfg, m, head_dim,
                                                               fp8_weight, norm):
    n = (Q_HEADS + 2 * KV_HEADS) * head_dim
    x, b = _randn(m, K, seed=m + head_dim) * 2, _randn(n, seed=2)
    w, scale = _randn(n, K, seed=1), None
    if fp8_weight:
        w, scale = fp8.quantize_rows(w.float())
        b = None  # (FP8 checkpoints of the family carry no qkv bias either way)
    fold = Fold(norm_weight=_randn(K, seed=3), eps=1e-6) if norm else Fold()
    positions = torch.tensor([5, 30][:m], device=DEVICE)
    slots = torch.tensor([6, 2][:m], device=DEVICE)
    cos, sin = _randn(32, head_dim // 2, seed=4, dtype=torch.float32), \
        _randn(32, head_dim // 2, seed=5, dtype=torch.float32)
    k_cache, v_cache, k_scale, v_scale = _pool(fp8_pool, head_dim)

    want = skinny_linear(x, w, b, weight_scale=scale, config=cfg, fold=fold)
    q, k, v = (t.view(m, -1, head_dim) for t in want.split(
        [Q_HEADS * head_dim, KV_HEADS * head_dim, KV_HEADS * head_dim], -1))
    k_want, v_want = k_cache.clone(), v_cache.clone()
    rotary_store_kv(q, k, v, positions, cos, sin, slots, k_want, v_want, k_scale, v_scale)

    rotary = RotaryFold(positions, cos, sin, slots, k_cache, v_cache, k_scale, v_scale, Q_HEADS)
    got = skinny_linear(x, w, b, weight_scale=scale, config=cfg,
                        fold=Fold(fold.norm_weight, fold.eps, rotary=rotary))
    assert torch.equal(got, want)  # q rotated, k and v as projected
    assert torch.equal(k_cache.view(torch.uint8), k_want.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_want.view(torch.uint8))
    assert k_cache[slots].float().abs().sum() > 0  # the rows were written at all


def test_the_rotary_fold_rejects_what_it_does_not_serve():
    x, w = _randn(1, K, seed=1), _randn((Q_HEADS + 2 * KV_HEADS) * 16, K, seed=2)
    pos = slots = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    cos = _randn(8, 8, seed=3, dtype=torch.float32)
    k_cache, v_cache, _, _ = _pool(False, 16)

    def fold(**kw) -> Fold:
        args = {"positions": pos, "cos": cos, "sin": cos, "slots": slots, "k_cache": k_cache,
                "v_cache": v_cache, "k_scale": None, "v_scale": None, "num_q_heads": Q_HEADS}
        return Fold(rotary=RotaryFold(**(args | kw)))

    cfg = CONFIGS["one head a tile"]
    with pytest.raises(ValueError, match="full rotary"):  # a partial rotary's tables
        skinny_linear(x, w, config=cfg, fold=fold(cos=cos[:, :4], sin=cos[:, :4]))
    with pytest.raises(ValueError, match="columns"):
        skinny_linear(x, w, config=cfg, fold=fold(num_q_heads=3))
    with pytest.raises(ValueError, match="positions"):
        skinny_linear(x, w, config=cfg, fold=fold(positions=torch.zeros(2, dtype=torch.int64,
                                                                           device=DEVICE)))
    fp8_cache, fp8_v, _, _ = _pool(True, 16)
    with pytest.raises(ValueError, match="FP8 pool"):
        skinny_linear(x, w, config=cfg, fold=fold(k_cache=fp8_cache, v_cache=fp8_v))
    with pytest.raises(ValueError, match="SiLU|residual"):
        skinny_linear(x, w, config=cfg,
                      fold=Fold(residual=torch.zeros_like(x[:, :1].expand(1, w.shape[0])),
                                rotary=fold().rotary))
