"""Calibrated FP8 KV cache scales from the checkpoint.

FP8 checkpoints made with a KV cache scheme (llm-compressor's `kv_cache_scheme`, ModelOpt)
carry a dequantization scale for K and for V of every attention layer: per tensor (shape
`[]` or `[1]`) or per KV head (`[num_kv_heads]`), under `model.layers.N.self_attn.k_scale` /
`v_scale` (or, from older llm-compressor, `k_proj.output_scale` / `v_proj.output_scale`). With
`--kv-cache-dtype fp8_e4m3` they replace the pool's default 1.0, this rank's KV heads' share.
They are part of the checkpoint, like its weights, so the HiCache pages of one model directory
(its fingerprint covers the directory) always hold values quantized with the same scales.
"""

from __future__ import annotations

import torch

from phaseflip.errors import ModelLoadError
from phaseflip.model.loader import read_checkpoint_tensors

_NAMES = {"k": ("self_attn.k_scale", "self_attn.k_proj.output_scale"),
          "v": ("self_attn.v_scale", "self_attn.v_proj.output_scale")}


def _per_head(t: torch.Tensor, num_kv_heads: int, name: str) -> torch.Tensor:
    s = t.float().reshape(-1)
    if s.numel() == 1:
        s = s.expand(num_kv_heads)
    if s.numel() != num_kv_heads or not bool(torch.all(s > 0)):
        raise ModelLoadError(f"{name}: expected one positive scale or one per KV head "
                             f"({num_kv_heads}), got {tuple(t.shape)}")
    return s


def load_kv_scales(pool, model, model_dir: str, load_format: str = "auto") -> int:
    """Sets an FP8 `pool`'s K and V scales from the checkpoint of `model_dir` for the layers
    and KV heads `model` (this rank's shard) holds; returns how many layers had them. A float
    pool, dummy weights, or a checkpoint without scales leave the pool as it is (1.0)."""
    if pool.k_scale is None or load_format == "dummy" or not len(model.layers):
        return 0
    qkv = model.layers[0].self_attn.qkv_proj
    head0, heads = qkv.rows["k"][0] // qkv.head_dim, qkv.num_kv_heads
    total = model.cfg.num_kv_heads
    names = {f"model.layers.{layer}.{n}" for layer in range(model.start_layer, model.end_layer)
             for pair in _NAMES.values() for n in pair}
    found = read_checkpoint_tensors(model_dir, names)
    done = 0
    for i, layer in enumerate(range(model.start_layer, model.end_layer)):
        for kind, dst in (("k", pool.k_scale), ("v", pool.v_scale)):
            name = next((f"model.layers.{layer}.{n}" for n in _NAMES[kind]
                         if f"model.layers.{layer}.{n}" in found), None)
            if name is not None:
                dst[i].copy_(_per_head(found[name], total, name)[head0:head0 + heads])
                done += kind == "k"
    return done
