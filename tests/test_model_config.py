"""ModelConfig.from_dir: both config.json generations (4.x `rope_scaling`, 5.x
`rope_parameters`), each architecture's defaults (cross-checked against the installed
transformers), generation_config.json, and errors that name what is wrong."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from phaseflip.errors import ModelLoadError
from phaseflip.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from phaseflip.model.rope import rope_inv_freq
from phaseflip.model.rope_config import RopeConfig

BASE = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
}


def write_dir(
    root: Path, config: dict[str, Any], generation: dict[str, Any] | None = None
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (root / "generation_config.json").write_text(json.dumps(generation))
    return root


def hf_rope(model_dir: Path, architecture: str) -> tuple[Any, torch.Tensor, float]:
    """transformers' own reading of the directory and its RoPE init."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config_class = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    hf = config_class.from_pretrained(model_dir)
    rope_type = hf.rope_parameters["rope_type"]
    if rope_type == "default":
        inv, scale = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        inv, scale = ROPE_INIT_FUNCTIONS[rope_type](hf)
    return hf, inv, scale


def assert_matches_transformers(model_dir: Path, cfg: ModelConfig) -> None:
    hf, inv, scale = hf_rope(model_dir, cfg.architecture)
    ours_inv, ours_scale = rope_inv_freq(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
    assert torch.equal(ours_inv, inv)
    assert ours_scale == pytest.approx(scale, rel=1e-15)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert cfg.head_dim == head_dim
    assert cfg.num_kv_heads == hf.num_key_value_heads
    assert cfg.max_position_embeddings == hf.max_position_embeddings
    assert cfg.rms_norm_eps == hf.rms_norm_eps
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert cfg.sliding_window == getattr(hf, "sliding_window", None)
    if getattr(hf, "layer_types", None) is not None:
        assert cfg.layer_types == tuple(hf.layer_types)


# -- transformers-5 format (what save_pretrained writes today) -------------------------------


@pytest.mark.parametrize(
    ("cls", "extra"),
    [
        ("LlamaConfig", {"tie_word_embeddings": True}),
        ("MistralConfig", {"sliding_window": 24, "head_dim": 32}),
        ("Qwen2Config", {}),
        ("Qwen3Config", {"head_dim": 24}),
    ],
)
def test_saved_by_transformers_5(tmp_path: Path, cls: str, extra: dict[str, Any]) -> None:
    import transformers

    hf = getattr(transformers, cls)(**BASE, num_key_value_heads=2, max_position_embeddings=512,
                                    **extra)
    hf.save_pretrained(tmp_path)
    assert "rope_parameters" in json.loads((tmp_path / "config.json").read_text())
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.architecture == cls.replace("Config", "ForCausalLM")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (128, 64, 96)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (3, 4, 2)
    assert cfg.rope == RopeConfig("default", 10000.0)
    assert_matches_transformers(tmp_path, cfg)


def test_llama_llama3_rope_both_formats_agree(tmp_path: Path) -> None:
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256}
    v4 = write_dir(tmp_path / "v4", {
        **BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "max_position_embeddings": 2048, "num_key_value_heads": 2, "torch_dtype": "bfloat16",
        "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **scaling},
        "transformers_version": "4.43.0",
    })
    v5 = write_dir(tmp_path / "v5", {
        **BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "max_position_embeddings": 2048, "num_key_value_heads": 2, "dtype": "bfloat16",
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **scaling},
    })
    a, b = ModelConfig.from_dir(v4), ModelConfig.from_dir(v5)
    assert a.rope == b.rope == RopeConfig(
        "llama3", 500000.0, factor=8.0, original_max_position_embeddings=256,
        low_freq_factor=1.0, high_freq_factor=4.0,
    )
    assert a.dtype == b.dtype == torch.bfloat16
    assert a.attention_bias is False and a.qk_norm is False and a.sliding_window is None
    assert_matches_transformers(v4, a)
    assert_matches_transformers(v5, b)


@pytest.mark.parametrize(
    ("scaling", "expected"),
    [
        ({"type": "linear", "factor": 2.0}, RopeConfig("linear", 1e6, factor=2.0)),
        ({"type": "dynamic", "factor": 4.0}, RopeConfig("dynamic", 1e6, factor=4.0)),
        (
            {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
            RopeConfig("yarn", 1e6, factor=4.0, original_max_position_embeddings=512),
        ),
        (  # no original_max_position_embeddings: transformers uses max_position_embeddings
            {"rope_type": "yarn", "factor": 2.0, "beta_fast": 8, "mscale": 1.0,
             "mscale_all_dim": 0.5},
            RopeConfig("yarn", 1e6, factor=2.0, original_max_position_embeddings=2048,
                       beta_fast=8.0, mscale=1.0, mscale_all_dim=0.5),
        ),
    ],
)
def test_4x_rope_scaling_variants(
    tmp_path: Path, scaling: dict[str, Any], expected: RopeConfig
) -> None:
    d = write_dir(tmp_path, {
        **BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "max_position_embeddings": 2048, "num_key_value_heads": 4, "rope_theta": 1e6,
        "rope_scaling": scaling,
    })
    cfg = ModelConfig.from_dir(d)
    assert cfg.rope == expected
    assert_matches_transformers(d, cfg)


def test_top_level_original_max_position_embeddings_wins_like_transformers(
    tmp_path: Path,
) -> None:
    d = write_dir(tmp_path, {
        **BASE, "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096,
        "original_max_position_embeddings": 2048,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                            "original_max_position_embeddings": 1024},
    })
    cfg = ModelConfig.from_dir(d)
    assert cfg.rope.original_max_position_embeddings == 2048
    assert_matches_transformers(d, cfg)


# -- architecture specifics ------------------------------------------------------------------


def test_qwen2_has_qkv_bias_and_4x_defaults(tmp_path: Path) -> None:
    d = write_dir(tmp_path, {
        **BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "num_key_value_heads": 2, "rope_theta": 1000000.0, "torch_dtype": "bfloat16",
        "use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 28,
        "tie_word_embeddings": True, "attention_bias": False,  # ignored: Qwen2 always has bias
    })
    cfg = ModelConfig.from_dir(d)
    assert cfg.attention_bias is True and cfg.o_proj_bias is False
    assert cfg.qk_norm is False
    assert cfg.sliding_window is None and cfg.layer_sliding_window(2) is None
    assert cfg.tie_word_embeddings is True
    assert cfg.max_position_embeddings == 32768  # Qwen2Config default
    assert cfg.rope == RopeConfig("default", 1e6)
    assert_matches_transformers(d, cfg)


def test_qwen2_sliding_window_only_above_max_window_layers(tmp_path: Path) -> None:
    d = write_dir(tmp_path, {
        **BASE, "architectures": ["Qwen2ForCausalLM"], "num_key_value_heads": 4,
        "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1,
    })
    cfg = ModelConfig.from_dir(d)
    assert cfg.sliding_window == 64
    assert cfg.layer_types == ("full_attention", "sliding_attention", "sliding_attention")
    assert [cfg.layer_sliding_window(i) for i in range(3)] == [None, 64, 64]
    assert_matches_transformers(d, cfg)


def test_qwen3_qk_norm_and_head_dim(tmp_path: Path) -> None:
    explicit = write_dir(tmp_path / "a", {
        **BASE, "architectures": ["Qwen3ForCausalLM"], "num_key_value_heads": 2,
        "head_dim": 32, "rope_theta": 1000000, "attention_bias": False,
    })
    cfg = ModelConfig.from_dir(explicit)
    assert cfg.qk_norm is True and cfg.attention_bias is False
    assert cfg.head_dim == 32 != cfg.hidden_size // cfg.num_heads
    assert cfg.rope.theta == 1e6 and isinstance(cfg.rope.theta, float)
    assert_matches_transformers(explicit, cfg)
    # Qwen3Config's default head_dim is 128, not hidden_size // heads.
    default = write_dir(tmp_path / "b", {**BASE, "architectures": ["Qwen3ForCausalLM"],
                                          "num_key_value_heads": 2})
    assert ModelConfig.from_dir(default).head_dim == 128
    biased = write_dir(tmp_path / "c", {**BASE, "architectures": ["Qwen3ForCausalLM"],
                                         "num_key_value_heads": 2, "attention_bias": True})
    cfg = ModelConfig.from_dir(biased)
    assert cfg.attention_bias is True and cfg.o_proj_bias is True


@pytest.mark.parametrize(
    ("extra", "window"),
    [({"sliding_window": 4096}, 4096), ({"sliding_window": None}, None), ({}, 4096)],
    ids=["explicit", "null", "absent-uses-MistralConfig-default"],
)
def test_mistral_sliding_window(tmp_path: Path, extra: dict[str, Any], window: int | None) -> None:
    d = write_dir(tmp_path, {**BASE, "architectures": ["MistralForCausalLM"],
                             "num_key_value_heads": 2, "head_dim": 32, **extra})
    cfg = ModelConfig.from_dir(d)
    assert cfg.sliding_window == window
    assert all(cfg.layer_sliding_window(i) == window for i in range(cfg.num_layers))
    assert cfg.attention_bias is False and cfg.head_dim == 32
    assert_matches_transformers(d, cfg)


def test_absent_keys_follow_transformers_defaults(tmp_path: Path) -> None:
    for arch in SUPPORTED_ARCHITECTURES:
        d = write_dir(tmp_path / arch, {**BASE, "num_attention_heads": 32, "hidden_size": 256,
                                        "architectures": [arch]})
        cfg = ModelConfig.from_dir(d)
        assert cfg.dtype == torch.float32 and cfg.hidden_act == "silu"
        assert cfg.rope.theta == 10000.0  # default_theta; no architecture overrides it
        assert_matches_transformers(d, cfg)
    assert ModelConfig.from_dir(tmp_path / "MistralForCausalLM").num_kv_heads == 8
    assert ModelConfig.from_dir(tmp_path / "LlamaForCausalLM").num_kv_heads == 32


def test_architecture_from_model_type_when_architectures_absent(tmp_path: Path) -> None:
    d = write_dir(tmp_path, {**BASE, "model_type": "mistral", "num_key_value_heads": 4})
    assert ModelConfig.from_dir(d).architecture == "MistralForCausalLM"


# -- generation_config.json, dtype, sizes ----------------------------------------------------


def test_eos_union_and_generation_defaults(tmp_path: Path) -> None:
    d = write_dir(
        tmp_path,
        {**BASE, "architectures": ["LlamaForCausalLM"], "eos_token_id": 7, "bos_token_id": 1,
         "pad_token_id": None},
        {"eos_token_id": [9, 7, 11], "bos_token_id": 3, "pad_token_id": 5, "do_sample": True,
         "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05,
         "max_new_tokens": 64, "use_cache": True, "transformers_version": "4.45.0",
         "min_p": None},
    )
    cfg = ModelConfig.from_dir(d)
    assert cfg.eos_token_ids == (9, 7, 11)
    assert cfg.bos_token_id == 3 and cfg.pad_token_id == 5
    assert cfg.generation_defaults == {
        "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20,
        "repetition_penalty": 1.05, "max_new_tokens": 64,
    }


def test_eos_from_config_only_and_list_form(tmp_path: Path) -> None:
    d = write_dir(tmp_path / "a", {**BASE, "architectures": ["Qwen2ForCausalLM"],
                                   "num_key_value_heads": 4, "eos_token_id": [4, 2]})
    cfg = ModelConfig.from_dir(d)
    assert cfg.eos_token_ids == (4, 2) and cfg.generation_defaults == {}
    assert cfg.bos_token_id is None and cfg.pad_token_id is None
    d = write_dir(tmp_path / "b", {**BASE, "architectures": ["LlamaForCausalLM"]},
                  {"eos_token_id": 5})
    # LlamaConfig's defaults (bos 1, eos 2) apply when config.json has no ids.
    cfg = ModelConfig.from_dir(d)
    assert cfg.eos_token_ids == (5, 2) and cfg.bos_token_id == 1


@pytest.mark.parametrize(
    ("fields", "dtype"),
    [
        ({"torch_dtype": "float16"}, torch.float16),
        ({"dtype": "bfloat16", "torch_dtype": "float16"}, torch.bfloat16),
        ({"dtype": None, "torch_dtype": "bfloat16"}, torch.bfloat16),
        ({}, torch.float32),
    ],
)
def test_dtype_and_kv_size(tmp_path: Path, fields: dict[str, Any], dtype: torch.dtype) -> None:
    d = write_dir(tmp_path, {**BASE, "architectures": ["LlamaForCausalLM"],
                             "num_key_value_heads": 2, **fields})
    cfg = ModelConfig.from_dir(d)
    assert cfg.dtype == dtype
    itemsize = torch.empty((), dtype=dtype).element_size()
    assert cfg.kv_size_per_token_bytes == 2 * 3 * 2 * 16 * itemsize


def test_config_is_frozen(tmp_path: Path) -> None:
    cfg = ModelConfig.from_dir(write_dir(tmp_path, {**BASE, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(AttributeError):
        cfg.hidden_size = 1  # type: ignore[misc]
    assert cfg.model_dir == str(tmp_path.absolute())
    assert hash(cfg) == hash(ModelConfig.from_dir(tmp_path))


# -- errors ----------------------------------------------------------------------------------


def test_missing_directory_and_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist.*nope"):
        ModelConfig.from_dir(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelLoadError, match="not a directory"):
        ModelConfig.from_dir(tmp_path / "file")
    with pytest.raises(ModelLoadError, match="config.json not found") as exc:
        ModelConfig.from_dir(tmp_path)
    assert str(tmp_path) in str(exc.value)


def test_invalid_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json is not valid JSON") as exc:
        ModelConfig.from_dir(tmp_path)
    assert str(tmp_path / "config.json") in str(exc.value)
    write_dir(tmp_path, {**BASE, "architectures": ["LlamaForCausalLM"]})
    (tmp_path / "generation_config.json").write_text("[1, 2")
    with pytest.raises(ModelLoadError, match="generation_config.json is not valid JSON"):
        ModelConfig.from_dir(tmp_path)


BAD_CONFIGS: list[tuple[dict[str, Any], str]] = [
    ({**BASE, "architectures": ["GPT2LMHeadModel"]},
     r"unsupported architecture GPT2LMHeadModel.*supported: LlamaForCausalLM, "
     r"MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"),
    ({**BASE}, r"'architectures' \(or 'model_type'\) is missing"),
    ({**BASE, "model_type": "gpt2"}, r"unsupported model_type 'gpt2'"),
    ({k: v for k, v in BASE.items() if k != "hidden_size"} | {"architectures":
                                                               ["LlamaForCausalLM"]},
     r"required field 'hidden_size' is missing"),
    ({**BASE, "architectures": ["LlamaForCausalLM"], "vocab_size": "many"},
     r"field 'vocab_size' must be an integer, got 'many'"),
    ({**BASE, "architectures": ["LlamaForCausalLM"],
      "rope_scaling": {"type": "longrope", "factor": 2.0}},
     r"unsupported rope type 'longrope' \('rope_scaling'\).*supported: default, linear"),
    ({**BASE, "architectures": ["LlamaForCausalLM"],
      "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}},
     r"required field 'rope_parameters.low_freq_factor' is missing"),
    ({**BASE, "architectures": ["LlamaForCausalLM"],
      "rope_parameters": {"rope_type": "linear"}},
     r"required field 'rope_parameters.factor' is missing"),
    ({**BASE, "architectures": ["LlamaForCausalLM"], "hidden_act": "gelu"},
     r"unsupported hidden_act 'gelu'.*only 'silu'"),
    ({**BASE, "architectures": ["LlamaForCausalLM"], "mlp_bias": True},
     r"mlp_bias=true is unsupported"),
    ({**BASE, "architectures": ["LlamaForCausalLM"], "num_key_value_heads": 3},
     r"num_attention_heads \(4\) is not a multiple of num_key_value_heads \(3\)"),
    ({**BASE, "architectures": ["Qwen2ForCausalLM"]},
     r"not a multiple of num_key_value_heads \(32, the default\)"),
    ({**BASE, "architectures": ["LlamaForCausalLM"], "torch_dtype": "int8"},
     r"field 'torch_dtype' must be one of"),
    ({**BASE, "architectures": ["LlamaForCausalLM"], "head_dim": 15},
     r"rotary dimension 15 .* must be even"),
    ({**BASE, "architectures": ["Qwen2ForCausalLM"], "num_key_value_heads": 4,
      "use_sliding_window": True, "layer_types": ["full_attention"]},
     r"field 'layer_types' must be a list of 3 entries"),
]


@pytest.mark.parametrize(("config", "message"), BAD_CONFIGS)
def test_bad_config_errors_name_the_problem(
    tmp_path: Path, config: dict[str, Any], message: str
) -> None:
    write_dir(tmp_path, config)
    with pytest.raises(ModelLoadError, match=message) as exc:
        ModelConfig.from_dir(tmp_path)
    assert str(tmp_path) in str(exc.value)
