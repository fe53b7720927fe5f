"""Model configuration read straight from a Hugging Face model directory.

We parse `config.json` / `generation_config.json` as raw JSON instead of going through
transformers' config classes: their fields and back-compat shims move between releases (4.x
writes `rope_theta` + `rope_scaling`, 5.x writes `rope_parameters`, `torch_dtype` became
`dtype`), while checkpoints in the wild were written by every one of those releases. Reading the
JSON ourselves lets one code path accept all of them, with each architecture's transformers
defaults (checked against transformers 5.24 and 4.x) applied when a key is absent, so that the
engine builds exactly the model transformers would build from the same directory.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from phaseflip.errors import ModelLoadError
from phaseflip.model.config_fields import Fields, read_json
from phaseflip.model.rope_config import RopeConfig, parse_rope

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


# `model_type` -> architecture, used only when `architectures` is absent from config.json
# (transformers' Auto classes dispatch on model_type too).
_MODEL_TYPE_TO_ARCH = MappingProxyType(
    {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    }
)

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

_DTYPES = MappingProxyType(
    {
        "float32": torch.float32,
        "float": torch.float32,
        "float16": torch.float16,
        "half": torch.float16,
        "bfloat16": torch.bfloat16,
        "float64": torch.float64,
    }
)

# generation_config.json keys copied into `generation_defaults`: the sampling and length
# settings a checkpoint's authors recommend. A whitelist, because transformers also writes
# bookkeeping such as use_cache / output_attentions there.
GENERATION_DEFAULT_KEYS = (
    "do_sample",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "typical_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "no_repeat_ngram_size",
    "max_new_tokens",
    "min_new_tokens",
    "max_length",
    "min_length",
)



@dataclass(frozen=True)
class _ArchDefaults:
    """Values transformers' config class of one architecture uses when a key is absent.

    Taken from the installed transformers (5.24) config dataclasses, which agree with 4.x.
    """

    max_position_embeddings: int
    num_kv_heads: int | None  # None: same as num_attention_heads
    head_dim: int | None  # None: hidden_size // num_attention_heads
    bos_token_id: int | None
    eos_token_id: int | None
    sliding_window: int | None  # value of `sliding_window` when the key is absent
    uses_sliding_flag: bool  # Qwen2/3: sliding only when use_sliding_window is true
    attention_bias: bool | None  # None: read `attention_bias` (default False); else forced
    qk_norm: bool
    reads_mlp_bias: bool  # only Llama has an `mlp_bias` option


_ARCH_DEFAULTS = MappingProxyType(
    {
        "LlamaForCausalLM": _ArchDefaults(
            max_position_embeddings=2048, num_kv_heads=None, head_dim=None, bos_token_id=1,
            eos_token_id=2, sliding_window=None, uses_sliding_flag=False, attention_bias=None,
            qk_norm=False, reads_mlp_bias=True,
        ),
        # MistralAttention never has biases, whatever the config says.
        "MistralForCausalLM": _ArchDefaults(
            max_position_embeddings=4096 * 32, num_kv_heads=8, head_dim=None, bos_token_id=1,
            eos_token_id=2, sliding_window=4096, uses_sliding_flag=False, attention_bias=False,
            qk_norm=False, reads_mlp_bias=False,
        ),
        # Qwen2Attention hard-codes bias=True on q/k/v (and none on o_proj).
        "Qwen2ForCausalLM": _ArchDefaults(
            max_position_embeddings=32768, num_kv_heads=32, head_dim=None, bos_token_id=None,
            eos_token_id=None, sliding_window=4096, uses_sliding_flag=True, attention_bias=True,
            qk_norm=False, reads_mlp_bias=False,
        ),
        "Qwen3ForCausalLM": _ArchDefaults(
            max_position_embeddings=32768, num_kv_heads=32, head_dim=128, bos_token_id=None,
            eos_token_id=None, sliding_window=4096, uses_sliding_flag=True, attention_bias=None,
            qk_norm=True, reads_mlp_bias=False,
        ),
    }
)

_DEFAULT_RMS_NORM_EPS = 1e-6
_DEFAULT_MAX_WINDOW_LAYERS = 28  # Qwen2/3


@dataclass(frozen=True)
class ModelConfig:
    """Everything the engine needs to know about a checkpoint, independent of its HF version."""

    model_dir: str
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases; see `o_proj_bias` for the output projection
    qk_norm: bool  # Qwen3: per-head RMSNorm on q and k before rope
    sliding_window: int | None  # window size; which layers use it: `layer_sliding_window`
    rope: RopeConfig
    dtype: torch.dtype
    hidden_act: str  # always "silu"
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    # Excluded from hashing (a dict is unhashable) so the config can key caches.
    generation_defaults: dict[str, Any] = field(hash=False)
    # Per-layer "full_attention" / "sliding_attention". Qwen2/3 slide only on layers
    # >= max_window_layers (or as listed in config.json); None means every layer slides iff
    # `sliding_window` is set. Defaulted so hand-built configs need not spell it out.
    layer_types: tuple[str, ...] | None = field(default=None)

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike[str]) -> ModelConfig:
        """Parses `config.json` (+ optional `generation_config.json`) of a HF model directory."""
        return _parse_model_dir(model_dir)

    @property
    def kv_size_per_token_bytes(self) -> int:
        """Bytes of K and V one token occupies across all layers, in the model dtype."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @property
    def o_proj_bias(self) -> bool:
        """Whether o_proj has a bias: Llama/Qwen3 put `attention_bias` on all four projections,
        Qwen2 only on q/k/v."""
        return self.attention_bias and self.architecture != "Qwen2ForCausalLM"

    def layout_error(self, tp_size: int, pp_size: int) -> str | None:
        """Why tp_size × pp_size cannot hold this model (None: it can). Checked before any
        rank starts (a launch) or any rank moves (a flip), not by each rank half-way."""
        if pp_size > self.num_layers:
            return f"pp_size={pp_size} exceeds the model's {self.num_layers} layers"
        kv_ok = self.num_kv_heads % tp_size == 0 or tp_size % self.num_kv_heads == 0
        for what, ok in ((f"{self.num_heads} attention heads", self.num_heads % tp_size == 0),
                         (f"{self.num_kv_heads} key/value heads", kv_ok),
                         (f"intermediate size {self.intermediate_size}",
                          self.intermediate_size % tp_size == 0)):
            if not ok:
                return f"tp_size={tp_size} does not split the model's {what}"
        return None

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The sliding window of one layer (None: full attention)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer_idx] == SLIDING_ATTENTION else None


# ---------------------------------------------------------------------------------------------
# Parsing helpers


def _resolve_architecture(cfg: Fields) -> str:
    archs = cfg.raw.get("architectures")
    if archs is not None:
        if isinstance(archs, str):
            archs = [archs]
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise cfg._bad("architectures", archs, "a list of class names")
        for arch in archs:
            if arch in SUPPORTED_ARCHITECTURES:
                return arch
        if archs:
            raise ModelLoadError(
                f"unsupported architecture {', '.join(archs)} in {cfg.path}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
    model_type = cfg.raw.get("model_type")
    if model_type is None:
        raise ModelLoadError(
            f"required field 'architectures' (or 'model_type') is missing in {cfg.path}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    arch = _MODEL_TYPE_TO_ARCH.get(model_type) if isinstance(model_type, str) else None
    if arch is None:
        raise ModelLoadError(
            f"unsupported model_type {model_type!r} in {cfg.path}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _resolve_dtype(cfg: Fields) -> torch.dtype:
    # transformers keeps `dtype` when both are present (5.x) and falls back to `torch_dtype` (4.x).
    for key in ("dtype", "torch_dtype"):
        value = cfg.raw.get(key)
        if value is None:
            continue
        name = value.removeprefix("torch.") if isinstance(value, str) else None
        if name not in _DTYPES:
            raise cfg._bad(key, value, f"one of {', '.join(_DTYPES)}")
        return _DTYPES[name]
    return torch.float32


def _parse_sliding(
    cfg: Fields, arch: str, defaults: _ArchDefaults, num_layers: int
) -> tuple[int | None, tuple[str, ...]]:
    if "sliding_window" in cfg.raw:
        window = cfg.get_int("sliding_window", None)  # explicit null: no sliding window
    else:
        window = defaults.sliding_window
    if not defaults.uses_sliding_flag:
        # Llama has no sliding window; Mistral slides on every layer when a window is set.
        if arch == "LlamaForCausalLM":
            window = None
        kind = SLIDING_ATTENTION if window is not None else FULL_ATTENTION
        return window, (kind,) * num_layers
    if not cfg.get_bool("use_sliding_window", False):
        return None, (FULL_ATTENTION,) * num_layers
    layer_types = cfg.raw.get("layer_types")
    if layer_types is not None:
        valid = (FULL_ATTENTION, SLIDING_ATTENTION)
        if (
            not isinstance(layer_types, list)
            or len(layer_types) != num_layers
            or any(t not in valid for t in layer_types)
        ):
            raise cfg._bad(
                "layer_types", layer_types,
                f"a list of {num_layers} entries, each one of {', '.join(valid)}",
            )
        return window, tuple(layer_types)
    max_window_layers = cfg.get_int("max_window_layers", _DEFAULT_MAX_WINDOW_LAYERS, positive=False)
    return window, tuple(
        SLIDING_ATTENTION if window is not None and i >= max_window_layers else FULL_ATTENTION
        for i in range(num_layers)
    )


def _parse_generation_config(path: str) -> tuple[Fields | None, dict[str, Any]]:
    if not os.path.isfile(path):
        return None, {}
    raw = read_json(path, "generation_config.json")
    defaults = {k: raw[k] for k in GENERATION_DEFAULT_KEYS if raw.get(k) is not None}
    return Fields(raw, path), defaults


def _check_mlp(cfg: Fields, d, config_path: str) -> None:
    hidden_act = cfg.get("hidden_act", "silu")
    if hidden_act not in ("silu", "swish"):  # transformers maps both to SiLU
        raise ModelLoadError(
            f"unsupported hidden_act {hidden_act!r} in {config_path}; only 'silu' is supported"
        )
    if d.reads_mlp_bias and cfg.get_bool("mlp_bias", False):
        raise ModelLoadError(f"mlp_bias=true is unsupported (in {config_path})")


def _special_tokens(cfg: Fields, gen: Fields | None, d
                    ) -> tuple[list[int], int | None, int | None]:
    """(EOS ids, BOS, PAD): generation_config.json is what transformers' generate() uses,
    config.json the fallback (its EOS ids are added after the generation config's)."""
    eos: list[int] = []
    if gen is not None:
        eos.extend(gen.token_ids("eos_token_id", None))
    for tok in cfg.token_ids("eos_token_id", d.eos_token_id):
        if tok not in eos:
            eos.append(tok)
    bos = gen.token_id("bos_token_id", None) if gen is not None else None
    if bos is None:
        bos = cfg.token_id("bos_token_id", d.bos_token_id)
    pad = gen.token_id("pad_token_id", None) if gen is not None else None
    if pad is None:
        pad = cfg.token_id("pad_token_id", None)
    return eos, bos, pad


def _config_fields(directory: str) -> tuple[Fields, str]:
    """The directory's config.json, read; a clear error for each way it is not there."""
    if not os.path.exists(directory):
        raise ModelLoadError(f"model directory does not exist: {directory}")
    if not os.path.isdir(directory):
        raise ModelLoadError(f"model path is not a directory: {directory}")
    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"config.json not found in model directory: {directory}")
    return Fields(read_json(config_path, "config.json"), config_path), config_path


def _check_rotary(rope: RopeConfig, head_dim: int, config_path: str) -> None:
    rotary_dim = int(head_dim * rope.partial_rotary_factor)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ModelLoadError(
            f"rotary dimension {rotary_dim} (head_dim {head_dim} x partial_rotary_factor "
            f"{rope.partial_rotary_factor}) must be even and >= 2 in {config_path}"
        )
    if rope.rope_type == "dynamic" and rotary_dim == 2:
        raise ModelLoadError(f"dynamic RoPE needs a rotary dimension > 2 in {config_path}")
    if rotary_dim < head_dim:
        log.warning(
            "%s: partial_rotary_factor %g rotates the first %d of %d channels of each head, as "
            "vLLM does; transformers 5 ignores the key for this architecture (it rotates all "
            "%d) and transformers 4 cannot run it. Remove the key if the model was trained "
            "with full rotary", config_path, rope.partial_rotary_factor, rotary_dim, head_dim,
            head_dim)


def _parse_model_dir(model_dir: str | os.PathLike[str]) -> ModelConfig:
    directory = os.path.abspath(os.fspath(model_dir))
    cfg, config_path = _config_fields(directory)

    arch = _resolve_architecture(cfg)
    d = _ARCH_DEFAULTS[arch]

    _check_mlp(cfg, d, config_path)

    hidden_size = cfg.get_int("hidden_size")
    num_heads = cfg.get_int("num_attention_heads")
    num_layers = cfg.get_int("num_hidden_layers")
    num_kv_heads = cfg.get_int("num_key_value_heads", d.num_kv_heads or num_heads)
    head_dim = cfg.get_int("head_dim", d.head_dim or hidden_size // num_heads)
    if head_dim <= 0:
        raise cfg._bad("head_dim", head_dim, "a positive integer (hidden_size // heads is 0)")
    if num_heads % num_kv_heads:
        raise ModelLoadError(
            f"num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads "
            f"({num_kv_heads}{'' if 'num_key_value_heads' in cfg.raw else ', the default'}) "
            f"in {config_path}"
        )
    max_pos = cfg.get_int("max_position_embeddings", d.max_position_embeddings)
    rope = parse_rope(cfg, max_pos)
    _check_rotary(rope, head_dim, config_path)

    attention_bias = d.attention_bias
    if attention_bias is None:
        attention_bias = cfg.get_bool("attention_bias", False)
    sliding_window, layer_types = _parse_sliding(cfg, arch, d, num_layers)

    gen, generation_defaults = _parse_generation_config(
        os.path.join(directory, "generation_config.json"))
    eos, bos, pad = _special_tokens(cfg, gen, d)

    return ModelConfig(
        model_dir=directory,
        architecture=arch,
        vocab_size=cfg.get_int("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=cfg.get_int("intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get_float("rms_norm_eps", _DEFAULT_RMS_NORM_EPS),
        max_position_embeddings=max_pos,
        tie_word_embeddings=cfg.get_bool("tie_word_embeddings", False),
        attention_bias=attention_bias,
        qk_norm=d.qk_norm,
        sliding_window=sliding_window,
        rope=rope,
        dtype=_resolve_dtype(cfg),
        hidden_act="silu",
        eos_token_ids=tuple(eos),
        bos_token_id=bos,
        pad_token_id=pad,
        generation_defaults=generation_defaults,
        layer_types=layer_types,
    )
