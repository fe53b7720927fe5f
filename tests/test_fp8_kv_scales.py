"""Calibrated FP8 KV scales from the checkpoint (`self_attn.k_scale` / `v_scale`, or the older
`k_proj.output_scale` / `v_proj.output_scale`): loaded into an FP8 pool, this rank's heads'
share, ignored by a float pool."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file

from phaseflip import Engine
from phaseflip.cache.kv_pool import KVPool
from phaseflip.config import EMBEDDED_MODEL
from phaseflip.errors import ModelLoadError
from phaseflip.layout import Layout
from phaseflip.model.config import ModelConfig
from phaseflip.model.llama import LlamaForCausalLM
from phaseflip.model.loader import iter_checkpoint_tensors
from phaseflip.model.quant.kv_scales import load_kv_scales

FP8 = torch.float8_e4m3fn
K0 = torch.tensor(0.03)  # layer 0 K: per tensor
V0 = torch.tensor([0.01, 0.02, 0.03, 0.04])  # layer 0 V: per KV head (4)
K2 = torch.tensor([0.05])  # layer 2 K, the older name


@pytest.fixture(scope="module")
def scaled_dir(tmp_path_factory):
    """The embedded model plus KV scales for layers 0 and 2 (1 and 3 have none)."""
    out = tmp_path_factory.mktemp("kvscales")
    for f in EMBEDDED_MODEL.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copyfile(f, out / f.name)
    tensors = dict(iter_checkpoint_tensors(EMBEDDED_MODEL, progress=False))
    tensors["model.layers.0.self_attn.k_scale"] = K0
    tensors["model.layers.0.self_attn.v_scale"] = V0
    tensors["model.layers.2.self_attn.k_proj.output_scale"] = K2
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_engine_fp8_pool_takes_the_checkpoint_scales(scaled_dir):
    with Engine(str(scaled_dir), device="cpu", max_total_tokens=1024,
                kv_cache_dtype="fp8_e4m3") as e:
        pool = e.core.runner.pool
        assert torch.equal(pool.k_scale[0], K0.expand(4))
        assert torch.equal(pool.v_scale[0], V0)
        assert torch.equal(pool.k_scale[2], K2.expand(4))
        assert torch.equal(pool.v_scale[2], torch.ones(4))  # absent: 1.0
        assert torch.equal(pool.k_scale[1], torch.ones(4))
        from phaseflip import SamplingParams

        out = e.generate([[5, 6, 7, 8, 9]], SamplingParams(max_new_tokens=3), use_tqdm=False)
        assert len(out[0].token_ids) == 3


def test_float_pool_ignores_them(scaled_dir):
    with Engine(str(scaled_dir), device="cpu", max_total_tokens=1024) as e:
        assert e.core.runner.pool.k_scale is None


def test_a_tp_rank_takes_its_heads_share(scaled_dir):
    cfg = ModelConfig.from_dir(scaled_dir)
    model = LlamaForCausalLM(cfg, Layout(1, 2), torch.float32)  # KV heads 2 and 3
    pool = KVPool(8, (0, 4), 2, cfg.head_dim, FP8, "cpu")
    assert load_kv_scales(pool, model, str(scaled_dir)) == 2
    assert torch.equal(pool.v_scale[0], V0[2:])
    assert torch.equal(pool.k_scale[0], K0.expand(2))


def test_bad_scales_are_refused(tmp_path, scaled_dir):
    for f in scaled_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copyfile(f, tmp_path / f.name)
    tensors = dict(iter_checkpoint_tensors(scaled_dir, progress=False))
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor([0.1, 0.2, 0.3])  # 3 of 4
    save_file(tensors, str(tmp_path / "model.safetensors"))
    cfg = ModelConfig.from_dir(tmp_path)
    model = LlamaForCausalLM(cfg, Layout(), torch.float32)
    with pytest.raises(ModelLoadError, match="one per KV head"):
        load_kv_scales(KVPool(8, (0, 4), 4, cfg.head_dim, FP8, "cpu"), model, str(tmp_path))
