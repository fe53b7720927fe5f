"""RoPE must match transformers bit for bit: inverse frequencies, attention scaling and the
rotated q/k (fp32 and bf16), for every supported rope type."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from phaseflip.model.rope import RotaryEmbedding, apply_rotary, rope_inv_freq
from phaseflip.model.rope_config import RopeConfig

HEAD_DIM = 64
MAX_POS = 1024
THETA = 500000.0

# (rope_type, the rope_parameters fields, shared by transformers and our RopeConfig)
CASES: list[tuple[str, dict[str, Any]]] = [
    ("default", {}),
    ("linear", {"factor": 4.0}),
    ("dynamic", {"factor": 2.0}),
    (
        "llama3",
        {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 256},
    ),
    ("yarn", {"factor": 4.0, "original_max_position_embeddings": 256}),
    (
        "yarn",
        {"factor": 4.0, "original_max_position_embeddings": 256, "mscale": 0.707,
         "mscale_all_dim": 1.0, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
    ),
    ("yarn", {"factor": 3.0, "original_max_position_embeddings": 300, "attention_factor": 1.5}),
]
IDS = [f"{t}-{i}" for i, (t, _) in enumerate(CASES)]


def hf_config(rope_type: str, params: dict[str, Any], head_dim: int = HEAD_DIM, **extra: Any):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2,
        head_dim=head_dim, max_position_embeddings=MAX_POS,
        rope_parameters={"rope_type": rope_type, "rope_theta": THETA, **params}, **extra,
    )


def hf_inv_freq(config: Any, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config, seq_len=seq_len)


def hf_rotate(
    config: Any, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own path: LlamaRotaryEmbedding + apply_rotary_pos_emb on [1, H, T, D]."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    emb = LlamaRotaryEmbedding(config).to(q.device)
    cos, sin = emb(q, positions[None])
    qh, kh = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return qh[0].transpose(0, 1), kh[0].transpose(0, 1)


@pytest.mark.parametrize(("rope_type", "params"), CASES, ids=IDS)
def test_inv_freq_matches_transformers(rope_type: str, params: dict[str, Any]) -> None:
    ref_inv, ref_scale = hf_inv_freq(hf_config(rope_type, params))
    inv, scale = rope_inv_freq(RopeConfig(rope_type, THETA, **params), HEAD_DIM, MAX_POS)
    assert inv.dtype == torch.float32 and inv.shape == (HEAD_DIM // 2,)
    assert torch.equal(inv, ref_inv)
    assert scale == pytest.approx(ref_scale, abs=0, rel=1e-15)


@pytest.mark.parametrize(("rope_type", "params"), CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding_matches_transformers(
    rope_type: str, params: dict[str, Any], dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(0)
    # Within max_position_embeddings (dynamic rescales beyond it in HF; see rope.py).
    positions = torch.tensor([0, 1, 2, 7, 100, 255, 256, 511, 1000, 1023])
    q = torch.randn(len(positions), 4, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(len(positions), 2, HEAD_DIM, generator=gen).to(dtype)
    ref_q, ref_k = hf_rotate(hf_config(rope_type, params), positions, q, k)

    rope = RotaryEmbedding(RopeConfig(rope_type, THETA, **params), HEAD_DIM, MAX_POS)
    out_q, out_k = rope(positions, q, k)
    assert out_q.dtype == dtype and out_k.dtype == dtype
    assert out_q.shape == q.shape and out_k.shape == k.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out_q, ref_q, atol=1e-6, rtol=0)
        torch.testing.assert_close(out_k, ref_k, atol=1e-6, rtol=0)
    # Same float ops in the same order: bit-identical in every dtype.
    assert torch.equal(out_q, ref_q)
    assert torch.equal(out_k, ref_k)


def test_dynamic_seq_len_matches_transformers_rescaling() -> None:
    params = {"factor": 2.0}
    config = hf_config("dynamic", params)
    ref_inv, _ = hf_inv_freq(config, seq_len=3000)
    inv, _ = rope_inv_freq(RopeConfig("dynamic", THETA, **params), HEAD_DIM, MAX_POS,
                           seq_len=3000)
    assert torch.equal(inv, ref_inv)
    # Within the trained context it is the plain frequencies, as in HF at init.
    plain, _ = rope_inv_freq(RopeConfig("default", THETA), HEAD_DIM, MAX_POS)
    torch.testing.assert_close(rope_inv_freq(RopeConfig("dynamic", THETA, factor=2.0), HEAD_DIM,
                                             MAX_POS)[0], plain, atol=0, rtol=1e-6)


def test_cache_grows_beyond_max_position_embeddings() -> None:
    positions = torch.tensor([3, 1023, 1024, 5000, 70000])
    q = torch.randn(len(positions), 4, HEAD_DIM, dtype=torch.bfloat16)
    k = torch.randn(len(positions), 2, HEAD_DIM, dtype=torch.bfloat16)
    rope = RotaryEmbedding(RopeConfig("default", THETA), HEAD_DIM, MAX_POS)
    assert rope.cache_len == MAX_POS
    out_q, out_k = rope(positions, q, k, max_position=70000)
    assert rope.cache_len == 131072  # next power of two above 70000
    ref_q, ref_k = hf_rotate(hf_config("default", {}), positions, q, k)
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)


def test_max_position_hint_and_ensure_capacity() -> None:
    rope = RotaryEmbedding(RopeConfig("default", THETA), HEAD_DIM, 16)
    rope.ensure_capacity(40)
    assert rope.cache_len == 64
    positions = torch.tensor([30, 63])
    q = torch.randn(2, 4, HEAD_DIM)
    k = torch.randn(2, 2, HEAD_DIM)
    a = rope(positions, q, k, max_position=63)
    b = RotaryEmbedding(RopeConfig("default", THETA), HEAD_DIM, 128)(positions, q, k)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_position_zero_is_identity_and_rotation_preserves_norm() -> None:
    rope = RotaryEmbedding(RopeConfig("default", 10000.0), 32, 64)
    q = torch.randn(3, 2, 32, dtype=torch.float64)
    k = torch.randn(3, 1, 32, dtype=torch.float64)
    out_q, out_k = rope(torch.tensor([0, 5, 63]), q, k)
    assert torch.equal(out_q[0], q[0]) and torch.equal(out_k[0], k[0])
    torch.testing.assert_close(out_q.norm(dim=-1), q.norm(dim=-1))


def test_partial_rotary_rotates_leading_channels_only() -> None:
    rope_cfg = RopeConfig("linear", THETA, factor=2.0, partial_rotary_factor=0.5)
    ref_inv, _ = hf_inv_freq(hf_config("linear", {"factor": 2.0, "partial_rotary_factor": 0.5}))
    inv, _ = rope_inv_freq(rope_cfg, HEAD_DIM, MAX_POS)
    assert inv.shape == (HEAD_DIM // 4,) and torch.equal(inv, ref_inv)

    rope = RotaryEmbedding(rope_cfg, HEAD_DIM, MAX_POS)
    positions = torch.tensor([1, 9, 400])
    q = torch.randn(3, 4, HEAD_DIM)
    k = torch.randn(3, 2, HEAD_DIM)
    out_q, out_k = rope(positions, q, k)
    half = HEAD_DIM // 2
    assert torch.equal(out_q[..., half:], q[..., half:])
    cos, sin = rope.cos_sin(positions, torch.float32)
    assert cos.shape == (3, half)
    assert torch.equal(out_k[..., :half], apply_rotary(k[..., :half], cos, sin))


def test_rope_inv_freq_rejects_unknown_type() -> None:
    with pytest.raises(ValueError, match="longrope"):
        rope_inv_freq(RopeConfig("longrope", THETA), HEAD_DIM, MAX_POS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("rope_type", "params"), CASES, ids=IDS)
def test_rotary_embedding_matches_transformers_on_cuda(
    rope_type: str, params: dict[str, Any]
) -> None:
    positions = torch.arange(0, MAX_POS, 7, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(len(positions), 4, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    k = torch.randn(len(positions), 2, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    ref_q, ref_k = hf_rotate(hf_config(rope_type, params), positions, q, k)
    rope = RotaryEmbedding(RopeConfig(rope_type, THETA, **params), HEAD_DIM, MAX_POS, "cuda")
    out_q, out_k = rope(positions, q, k)
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
