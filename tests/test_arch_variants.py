"""Config and checkpoint variants that real models have, each against `transformers` (fp32,
CPU): greedy tokens equal token for token (16 new tokens, several prompts, one longer than the
prefill chunk and than a sliding window) and prompt logprobs within 1e-4; the checkpoints a
loader must refuse name the tensor and the file. Tiny random models written by transformers'
`save_pretrained` (sharded, with an index) in the test."""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from phaseflip import Engine, SamplingParams
from phaseflip.errors import ModelLoadError
from phaseflip.layout import Layout
from phaseflip.model.config import ModelConfig
from phaseflip.model.llama import LlamaForCausalLM
from phaseflip.model.loader import iter_checkpoint_tensors
from tests.conftest import build_model

pytestmark = pytest.mark.timeout(180, method="thread")  # gloo ranks: signals cannot interrupt

NEW = 16
CHUNK = 16  # prefill chunk: the longest prompt (40) takes three

# name -> (conftest ARCHS key, config overrides): variants seen in released checkpoints
VARIANTS = {
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-mha": ("llama", {"num_attention_heads": 8, "num_key_value_heads": 8}),  # GQA 1
    "llama-gqa2": ("llama", {"num_attention_heads": 8, "num_key_value_heads": 4}),
    "llama-gqa4": ("llama", {"num_attention_heads": 8, "num_key_value_heads": 2}),
    "llama-mqa8": ("llama", {"num_attention_heads": 8, "num_key_value_heads": 1}),
    "llama-head-dim-24": ("llama", {"head_dim": 24}),
    "llama-attention-bias": ("llama", {"attention_bias": True}),
    "llama-rope-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-rope-llama3": ("llama", {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}}),
    "llama-rope-dynamic": ("llama", {"max_position_embeddings": 64, "rope_scaling": {
        "rope_type": "dynamic", "factor": 2.0}}),  # within its 64 positions: as plain RoPE
    "llama-eps-theta-vocab": ("llama", {"rms_norm_eps": 1e-2, "rope_theta": 500.0,
                                        "vocab_size": 331}),  # not a multiple of 64
    "qwen2-bias": ("qwen2", {}),
    "qwen2-yarn": ("qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 32}}),
    "qwen2-sliding": ("qwen2", {"use_sliding_window": True, "sliding_window": 8,
                                "max_window_layers": 1}),
    "qwen3-hd32-gqa4": ("qwen3", {"num_attention_heads": 8, "num_key_value_heads": 2,
                                  "head_dim": 32}),
    "qwen3-bias-bf16": ("qwen3", {"attention_bias": True}),  # stored in bf16 (see below)
    "mistral-nemo": ("mistral", {"head_dim": 32, "sliding_window": None}),
    "mistral-window-8": ("mistral", {"sliding_window": 8}),
}


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in (3, 11, 23, 40)]


def _hf_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy without a cache and without generate()'s processors (no EOS ban)."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(NEW):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(p):])
    return out


@pytest.fixture(scope="module")
def variant_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("variants")
    return {name: build_model(root / name, arch,
                              torch.bfloat16 if name.endswith("bf16") else torch.float32, **over)
            for name, (arch, over) in VARIANTS.items()}


@pytest.fixture(scope="module")
def hf_reference(variant_dirs):
    """(greedy tokens of every prompt, log_softmax of the longest prompt's logits) per variant."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def ref(name: str):
        if name not in cache:
            d = variant_dirs[name]
            model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
            prompts = _prompts(model.config.vocab_size)
            with torch.no_grad():
                logits = model(torch.tensor([prompts[-1]])).logits[0]
            cache[name] = prompts, _hf_greedy(model, prompts), torch.log_softmax(logits, -1)
        return cache[name]

    return ref


def _engine(model_dir: Path, **cfg) -> Engine:
    cfg = {"device": "cpu", "dtype": "float32", "max_total_tokens": 2048,
           "chunked_prefill_size": CHUNK, "check_accounting": True, "dist_timeout_s": 60} | cfg
    return Engine(str(model_dir), **cfg)


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_matches_transformers(name, variant_dirs, hf_reference):
    prompts, want, ref_lp = hf_reference(name)
    with _engine(variant_dirs[name]) as e:
        got = [o.token_ids for o in e.generate(prompts, GREEDY, use_tqdm=False)]
        p = prompts[-1]
        params = SamplingParams(temperature=0.0, max_new_tokens=1, prompt_logprobs=0)
        out = e.generate([p], params, use_tqdm=False)[0]
    assert got == want
    want_lp = [ref_lp[i - 1, p[i]].item() for i in range(1, len(p))]
    assert out.prompt_logprobs[1:] == pytest.approx(want_lp, abs=1e-4)


@pytest.mark.parametrize("layout", [{"tp_size": 2}, {"pp_size": 2}], ids=["tp2", "pp2"])
@pytest.mark.parametrize("name", ["qwen3-hd32-gqa4", "mistral-nemo", "llama-mqa8",
                                  "llama-eps-theta-vocab"])
def test_layouts_of_odd_variants_match_transformers(name, layout, variant_dirs, hf_reference):
    """Explicit head_dim 32 with GQA 4 and the Qwen3 q/k norms, Mistral-Nemo's head_dim, one
    KV head (replicated under tp2), a vocabulary of 331 (padded to split): over gloo ranks,
    the tokens of one rank, which are transformers' tokens."""
    prompts, want, _ = hf_reference(name)
    with _engine(variant_dirs[name], **layout) as e:
        assert [o.token_ids for o in e.generate(prompts, GREEDY, use_tqdm=False)] == want


# ----------------------------------------------------------------------- checkpoint defects


@pytest.fixture(scope="module")
def single_file(tmp_path_factory, variant_dirs) -> Path:
    """The tiny Llama (GQA 4) as one model.safetensors, no index."""
    src = variant_dirs["llama-gqa4"]
    out = tmp_path_factory.mktemp("single") / "m"
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _edited(src: Path, dst: Path, edit, config_edit=None) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if config_edit is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config_edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _load(model_dir: Path, layout: Layout | None = None) -> LlamaForCausalLM:
    model = LlamaForCausalLM(ModelConfig.from_dir(model_dir), layout or Layout(), torch.float32)
    model.load_weights(iter_checkpoint_tensors(model_dir, progress=False))
    return model


# (tensor, wrong shape): each was cut or zero-padded to fit, and served, before the check
WRONG_SHAPES = [
    ("model.layers.0.self_attn.q_proj.weight", (80, 64)),
    ("model.layers.0.self_attn.k_proj.weight", (64, 64)),
    ("model.layers.1.self_attn.o_proj.weight", (64, 80)),
    ("model.layers.0.mlp.gate_proj.weight", (200, 64)),
    ("model.layers.0.mlp.down_proj.weight", (64, 100)),
    ("model.embed_tokens.weight", (300, 64)),
    ("model.embed_tokens.weight", (400, 64)),
    ("lm_head.weight", (300, 64)),
    ("model.norm.weight", (32,)),
]


@pytest.mark.parametrize(("tensor", "shape"), WRONG_SHAPES)
def test_a_wrong_shape_tensor_is_refused_by_name(tensor, shape, single_file, tmp_path):
    def edit(t):
        t[tensor] = torch.zeros(shape)

    d = _edited(single_file, tmp_path / "m", edit)
    expected = tuple(load_file(single_file / "model.safetensors")[tensor].shape)
    with pytest.raises(ModelLoadError, match=rf"'{tensor}' has shape {tuple(shape)}.*implies "
                                             rf"{expected}.*{d}".replace("(", r"\(")
                       .replace(")", r"\)")):
        _load(d)


def test_a_missing_tensor_is_named_as_the_checkpoint_names_it(single_file, tmp_path):
    """On pipeline stage 1 (layers 1..) the name carries the global layer index and the
    unfused projection, not the stage's local fused parameter."""
    d = _edited(single_file, tmp_path / "m",
                lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"lacks 1 tensors: "
                                             r"model\.layers\.1\.self_attn\.k_proj\.weight$"):
        _load(d, Layout(pp_rank=1, pp_size=2))


def test_an_untied_checkpoint_without_lm_head_says_so(single_file, tmp_path):
    d = _edited(single_file, tmp_path / "m", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ModelLoadError, match="lacks 1 tensors: lm_head.weight; config.json has "
                                             "tie_word_embeddings false"):
        _load(d)


def test_a_tied_checkpoint_shipping_a_different_lm_head_warns(single_file, tmp_path, caplog):
    def tie(cfg):
        cfg["tie_word_embeddings"] = True

    def same_head(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    same = _edited(single_file, tmp_path / "same", same_head, tie)
    with caplog.at_level(logging.WARNING, logger="phaseflip.model.llama"):
        model = _load(same)
    assert not caplog.records
    assert model.lm_head.weight is model.embed_tokens.weight

    def other_head(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"] + 1

    d = _edited(single_file, tmp_path / "other", other_head, tie)
    with caplog.at_level(logging.WARNING, logger="phaseflip.model.llama"):
        model = _load(d)
    assert "lm_head.weight differs from its embed_tokens.weight" in caplog.text
    emb = load_file(d / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(model.lm_head.weight, emb)  # served as vLLM does


# ------------------------------------------------------------ served differently from HF: said


def test_partial_rotary_is_announced(single_file, tmp_path, caplog):
    """transformers 5 ignores partial_rotary_factor for these architectures and 4 cannot run
    it; phaseflip rotates the leading channels (as vLLM), and says so at load."""
    d = _edited(single_file, tmp_path / "m", lambda t: None,
                lambda cfg: cfg.update(partial_rotary_factor=0.5))
    with caplog.at_level(logging.WARNING, logger="phaseflip.model.config"):
        cfg = ModelConfig.from_dir(d)
    assert cfg.rope.partial_rotary_factor == 0.5
    assert "rotates the first 4 of 8 channels" in caplog.text


def test_dynamic_rope_past_its_positions_warns(variant_dirs, caplog, monkeypatch):
    """Dynamic NTK is HF's exactly within max_position_embeddings (the variant test); past it
    the frequencies stay unscaled: a --max-model-len there is refused (test_config_validation_
    engine) unless opted into, and then a warning says so."""
    from phaseflip.config import ALLOW_LONG_MAX_MODEL_LEN_ENV

    monkeypatch.setenv(ALLOW_LONG_MAX_MODEL_LEN_ENV, "1")
    d = variant_dirs["llama-rope-dynamic"]
    prompt = _prompts(320)[-1] * 2  # 80 tokens > 64 positions
    with caplog.at_level(logging.WARNING, logger="phaseflip.model.rope"):
        with _engine(d, max_model_len=128) as e:
            e.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=2),
                       use_tqdm=False)
    assert "dynamic RoPE: positions past max_position_embeddings 64" in caplog.text
