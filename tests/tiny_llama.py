"""A 2-layer Qwen2-style model (QKV bias) with random weights and norm gains, one prefill
batch of it, and its logits through the torch reference attention: what the model-level
kernel tests run (FP8 fusion, padded GEMM rows)."""

from __future__ import annotations

import json

import torch

from phaseflip.layout import Layout

CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 96,
          "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 128, "rms_norm_eps": 1e-6,
          "rope_theta": 10000.0, "max_position_embeddings": 64, "tie_word_embeddings": False}


def tiny_llama(tmp_path, device: torch.device, quant=None):
    """The model in bf16 (`quant`: e.g. `Fp8Config("float")`), eval mode, on `device`."""
    from phaseflip.model.config import ModelConfig
    from phaseflip.model.dummy import init_dummy_weights
    from phaseflip.model.llama import LlamaForCausalLM

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    with torch.device(device):
        model = LlamaForCausalLM(ModelConfig.from_dir(tmp_path), Layout(), torch.bfloat16,
                                 quant)
    init_dummy_weights(model, 0)
    gen = torch.Generator().manual_seed(5)
    for name, p in model.named_parameters():
        if "layernorm" in name:  # gains of one would make w * y exact: no rounding to see
            p.data.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
    return model.eval()


def prefill(seqs: list[int], seed: int, device: torch.device):
    """A ForwardBatch prefilling `seqs` new sequences of random tokens, slots 1 onwards."""
    from phaseflip.forward_batch import ForwardBatch

    t = sum(seqs)
    indptr = torch.tensor([0, *torch.tensor(seqs).cumsum(0).tolist()])
    return ForwardBatch(
        input_ids=torch.randint(0, CONFIG["vocab_size"], (t,),
                                generator=torch.Generator().manual_seed(seed)),
        positions=torch.cat([torch.arange(n) for n in seqs]),
        out_cache_loc=torch.arange(1, t + 1), extend_lens=seqs, prefix_lens=[0] * len(seqs),
        kv_indptr=indptr, kv_indices=torch.arange(1, t + 1), logits_indices=torch.arange(t),
        max_position=max(seqs) - 1,
    ).to(device)


def logits(model, batch, device: torch.device) -> torch.Tensor:
    """Every token's logits, from a fresh pool."""
    from phaseflip.attention.torch_ref import TorchRefAttention
    from phaseflip.cache.kv_pool import KVPool

    t = batch.input_ids.numel()
    pool = KVPool(t + 8, (0, CONFIG["num_hidden_layers"]), CONFIG["num_key_value_heads"],
                  CONFIG["hidden_size"] // CONFIG["num_attention_heads"], torch.bfloat16,
                  device)
    with torch.inference_mode():
        return model.compute_logits(model(batch, pool, TorchRefAttention())[0])
