"""Folds (`kernels/linear_fold.py`): RMSNorm, SiLU·mul and the residual add inside the skinny
GEMM's launch, and the folded decoder layer (`model/llama.py`).

Contracts: the SiLU fold and the residual fold are bitwise what the separate kernels give (the
same x values reach the same loop, and the sum is rounded before the add as the fused add-norm
rounds it); the norm fold matches RMSNorm in float32 followed by the GEMM (the norm kernel
rounds its output first, so there the bound is bf16's). A tiny model's logits with every layer
folded match the unfolded run's, and the folded run launches no norm or SiLU kernel but the
final norm. Runs on CUDA when present, else through Triton's interpreter on the CPU (the
model-level tests then force the kernel dispatch on CPU tensors).
"""

from __future__ import annotations

import json

import pytest
import torch
from triton_interpreter import interpret_without_cuda

interpret_without_cuda()  # before triton is imported
pytest.importorskip("triton")

from phaseflip.kernels import activation, norm  # noqa: E402
from phaseflip.kernels import rope as rope_kernels  # noqa: E402
from phaseflip.kernels.linear import skinny_linear  # noqa: E402
from phaseflip.kernels.linear_configs import SkinnyConfig  # noqa: E402
from phaseflip.kernels.linear_fold import NORM_FOLD_PAYS_M, Fold  # noqa: E402
from phaseflip.layout import Layout  # noqa: E402
from phaseflip.model import layers, rope  # noqa: E402
from phaseflip.model.quant import fp8  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-6
EW = SkinnyConfig(16, 64, 4, 1, 1, "ew")
EW_SPLIT = SkinnyConfig(16, 32, 4, 1, 3, "ew")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed)).to(DEVICE, dtype)


def _norm_ref(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * g.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k", [(1, 100), (2, 128), (2, 200)])
def test_norm_fold_is_rms_norm_then_the_gemm(dtype, m, k):
    x = _randn(m, k, seed=k, dtype=dtype) * 3
    w, g = _randn(24, k, seed=1, dtype=dtype), _randn(k, seed=2, dtype=dtype)
    b = _randn(24, seed=3, dtype=dtype)
    got = skinny_linear(x, w, b, config=EW, fold=Fold(norm_weight=g, eps=EPS))
    want = _norm_ref(x, g) @ w.float().t() + b.float()
    err = ((got.float() - want).norm() / want.norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


def test_norm_fold_with_an_fp8_weight():
    """W8A16 (the batch-1 FP8 route): the norm and the weight's row scales both apply."""
    k = 128
    x, g = _randn(2, k, seed=4), _randn(k, seed=5)
    w_q, scale = fp8.quantize_rows(_randn(40, k, seed=6, dtype=torch.float32))
    got = skinny_linear(x, w_q, weight_scale=scale, config=EW, fold=Fold(norm_weight=g, eps=EPS))
    want = _norm_ref(x, g) @ (w_q.float() * scale[:, None]).t()
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.parametrize("cfg", [EW, EW_SPLIT], ids=["ew", "ew_split"])
@pytest.mark.parametrize("m,k,inter", [(1, 96, 40), (2, 100, 24), (5, 64, 9)])
def test_silu_and_residual_folds_are_bitwise_the_separate_kernels(cfg, m, k, inter):
    x = _randn(m, k, seed=m + k) * 2
    w_gate_up, w = _randn(2 * inter, k, seed=7), _randn(40, k, seed=15)
    act = activation.silu_and_mul(skinny_linear(x, w_gate_up, config=cfg))
    got = skinny_linear(x, w_gate_up, config=cfg, fold=Fold(silu_mul=True))
    assert got.shape == (m, inter) and torch.equal(got, act)
    r = _randn(m, 40, seed=8)
    added = (skinny_linear(x, w, config=cfg).float() + r.float()).to(r.dtype)
    assert torch.equal(skinny_linear(x, w, config=cfg, fold=Fold(residual=r)), added)
    into = r.clone()  # the residual stream updated in place
    assert skinny_linear(x, w, out=into, config=cfg, fold=Fold(residual=into)) is into
    assert torch.equal(into, added)


def test_silu_fold_with_an_fp8_weight_and_the_norm():
    """The batch-1 gate_up launch: RMSNorm before, the row scales, SiLU·mul after."""
    k, inter = 128, 48
    x, g = _randn(1, k, seed=16), _randn(k, seed=17)
    w_q, scale = fp8.quantize_rows(_randn(2 * inter, k, seed=18, dtype=torch.float32))
    got = skinny_linear(x, w_q, weight_scale=scale, config=EW,
                        fold=Fold(norm_weight=g, eps=EPS, silu_mul=True))
    y = (_norm_ref(x, g) @ (w_q.float() * scale[:, None]).t()).to(torch.bfloat16)
    want = activation.silu_and_mul(y)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 2e-2


def test_a_tensor_core_pick_runs_the_elementwise_loop():
    x, w, g = _randn(2, 128, seed=9), _randn(48, 128, seed=10), _randn(128, seed=11)
    dot = SkinnyConfig(16, 32, 4, 1, 2, "dot")
    got = skinny_linear(x, w, config=dot, fold=Fold(norm_weight=g, eps=EPS))
    want = _norm_ref(x, g) @ w.float().t()
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2


def test_folds_reject_what_they_do_not_serve():
    x, w, g = _randn(3, 64, seed=12), _randn(16, 64, seed=13), _randn(64, seed=14)
    with pytest.raises(ValueError, match="at most"):
        skinny_linear(x, w, config=EW, fold=Fold(norm_weight=g, eps=EPS))  # 3 rows
    with pytest.raises(ValueError, match="at most"):
        skinny_linear(_randn(9, 64, seed=1), w, config=EW, fold=Fold(residual=_randn(9, 16,
                                                                                    seed=2)))
    with pytest.raises(ValueError, match="SiLU"):
        skinny_linear(x[:1], w[:15], config=EW, fold=Fold(silu_mul=True))  # odd rows
    with pytest.raises(ValueError, match="SiLU"):
        skinny_linear(x[:1], w, w[:, 0].contiguous(), config=EW, fold=Fold(silu_mul=True))
    with pytest.raises(ValueError, match="norm weight"):
        skinny_linear(x[:1], w, config=EW, fold=Fold(norm_weight=g[:32], eps=EPS))
    with pytest.raises(ValueError, match="residual"):
        skinny_linear(x, w, config=EW, fold=Fold(residual=_randn(3, 8, seed=3)))
    w_q, scale = fp8.quantize_rows(w.float())
    x_q, sx = fp8.quantize_tokens(x[:1])
    with pytest.raises(ValueError, match="16-bit"):
        skinny_linear(x_q, w_q, weight_scale=scale, x_scale=sx.reshape(-1),
                      out_dtype=torch.bfloat16, config=EW, fold=Fold(residual=x[:1, :16]))


# ------------------------------------------------------------------------------ the layer


def _tiny_llama(tmp_path, quant: bool, arch: str = "qwen2"):
    from phaseflip.model.config import ModelConfig
    from phaseflip.model.dummy import init_dummy_weights
    from phaseflip.model.llama import LlamaForCausalLM
    from phaseflip.model.quant import Fp8Config

    cfg = {"architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "Qwen3ForCausalLM"],
           "model_type": arch, "hidden_size": 96, "intermediate_size": 160,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 24, "vocab_size": 128, "rms_norm_eps": EPS, "rope_theta": 10000.0,
           "max_position_embeddings": 64, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with torch.device(DEVICE):
        model = LlamaForCausalLM(ModelConfig.from_dir(tmp_path), Layout(), torch.bfloat16,
                                 Fp8Config("float") if quant else None)
    init_dummy_weights(model, 0)
    gen = _gen(5)
    for name, p in model.named_parameters():
        if "norm" in name:  # gains of one would hide a norm weight applied twice or not at all
            p.data.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
    return model.eval()


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """The CUDA dispatch on CPU tensors (interpreted kernels; FP8 rows routed as on a GPU
    with FP8 MMAs); returns the norm / SiLU kernel-call counter."""
    if DEVICE.type == "cpu":
        monkeypatch.setattr(layers, "use_fused_kernels", lambda x: True)
        monkeypatch.setattr(rope.RotaryEmbedding, "uses_kernel", lambda self, x: True)
        monkeypatch.setattr(fp8, "skinny_rows", lambda x, w: x.shape[0] <= 16)
        monkeypatch.setattr(fp8, "_fp8_mma", lambda index: True)
    calls: dict[str, int] = {}
    for mod, name in ((norm, "rms_norm"), (norm, "fused_add_rms_norm"),
                      (activation, "silu_and_mul"), (rope_kernels, "rotary_store_kv")):
        fn = getattr(mod, name)

        def counted(*args, _fn=fn, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(mod, name, counted)
    return calls


def _logits(model, rows: int) -> torch.Tensor:
    """One step of `rows` single-token sequences (a decode step's shape) through the model."""
    from phaseflip.attention.torch_ref import TorchRefAttention
    from phaseflip.cache.kv_pool import KVPool
    from phaseflip.forward_batch import ForwardBatch

    batch = ForwardBatch(
        input_ids=torch.randint(0, 128, (rows,), generator=_gen(rows)),
        positions=torch.arange(rows) + 3, out_cache_loc=torch.arange(1, rows + 1),
        extend_lens=[1] * rows, prefix_lens=[0] * rows,
        kv_indptr=torch.arange(rows + 1), kv_indices=torch.arange(1, rows + 1),
        logits_indices=torch.arange(rows), max_position=rows + 2,
    ).to(DEVICE)
    cfg = model.cfg
    pool = KVPool(rows + 8, (0, cfg.num_layers), cfg.num_kv_heads, cfg.head_dim,
                  torch.bfloat16, DEVICE)
    with torch.inference_mode():
        return model.compute_logits(model(batch, pool, TorchRefAttention())[0])


@pytest.mark.parametrize("quant,arch", [(False, "qwen2"), (True, "qwen2"), (False, "qwen3")])
@pytest.mark.parametrize("rows", [1, 2])
def test_a_folded_model_matches_the_unfolded_one(tmp_path, monkeypatch, kernels_on_cpu, quant,
                                                 arch, rows):
    """QKV bias (Qwen2), q/k norms (Qwen3: between qkv and the rotary, which then runs as
    its own kernel), FP8 weights (weight-only at these rows). Past NORM_FOLD_PAYS_M rows
    nothing folded rounds differently, so the logits are bitwise the unfolded ones."""
    model = _tiny_llama(tmp_path, quant, arch)
    monkeypatch.delenv(layers.NO_FOLD_ENV, raising=False)  # the default: folded
    head_norms = 4 if arch == "qwen3" else 0  # q and k norms, 2 layers
    folded = _logits(model, rows)
    # the final norm; past NORM_FOLD_PAYS_M rows the layers' norms as kernels (without adds)
    layer_norms = 0 if rows <= NORM_FOLD_PAYS_M else 4
    want = {"rms_norm": 1 + head_norms + layer_norms} | ({"rotary_store_kv": 2} if head_norms
                                                         else {})
    assert kernels_on_cpu == want
    kernels_on_cpu.clear()
    monkeypatch.setenv(layers.NO_FOLD_ENV, "1")
    plain = _logits(model, rows)
    assert kernels_on_cpu == {"rms_norm": 1 + head_norms, "fused_add_rms_norm": 4,
                              "silu_and_mul": 2, "rotary_store_kv": 2}
    err = ((folded - plain).norm() / plain.norm()).item()
    assert err < 2e-2, err
    assert torch.equal(folded.argmax(-1), plain.argmax(-1))
    if rows > NORM_FOLD_PAYS_M:
        assert torch.equal(folded, plain)


def test_which_steps_fold(tmp_path, monkeypatch, kernels_on_cpu):
    model = _tiny_llama(tmp_path, quant=False)
    linears = model.layers[0]._linears
    one, three = (torch.randn(m, 96, dtype=torch.bfloat16, device=DEVICE) for m in (1, 3))
    monkeypatch.delenv(layers.NO_FOLD_ENV, raising=False)
    assert layers.folds_rows(one, Layout(), linears)  # the default
    monkeypatch.setenv(layers.NO_FOLD_ENV, "1")
    assert not layers.folds_rows(one, Layout(), linears)  # the opt-out
    monkeypatch.delenv(layers.NO_FOLD_ENV)
    assert not layers.folds_rows(three, Layout(), linears)  # more rows than the norm fold's
    assert not layers.folds_rows(one.float(), Layout(), linears)  # not the weights' dtype
    assert not layers.folds_rows(one, Layout(0, 2), linears)  # TP: the add awaits a reduce
    assert not layers.folds_rows(one, Layout(pp_rank=0, pp_size=2), linears)
    monkeypatch.setattr(layers, "use_fused_kernels", lambda x: False)  # CPU, unpatched
    assert not layers.folds_rows(one, Layout(), linears)
