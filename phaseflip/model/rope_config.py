"""RoPE settings of a checkpoint, normalised from either config format (transformers 4.x
`rope_scaling` or 5.x `rope_parameters`) into one `RopeConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from phaseflip.errors import ModelLoadError
from phaseflip.model.config_fields import Fields

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
_DEFAULT_ROPE_THETA = 10000.0  # RotaryEmbeddingConfigMixin.default_theta; no arch overrides it


@dataclass(frozen=True)
class RopeConfig:
    """Rotary-embedding parameters, normalised from either config format.

    `original_max_position_embeddings` is already resolved for llama3/yarn (explicit value,
    else max_position_embeddings, as transformers does); `factor` is resolved for yarn when the
    checkpoint leaves it null (max_position_embeddings / original_max_position_embeddings).
    """

    rope_type: str  # "default" | "linear" | "dynamic" | "llama3" | "yarn"
    theta: float
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float | None = None  # yarn (HF default 32)
    beta_slow: float | None = None  # yarn (HF default 1)
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    attention_factor: float | None = None  # yarn explicit override
    truncate: bool | None = None  # yarn (newer HF); None means True
    partial_rotary_factor: float = 1.0


def _select_rope_dict(cfg: Fields) -> tuple[dict[str, Any], str]:
    """Returns the rope dict and the key it came from.

    Like transformers, a non-empty 4.x `rope_scaling` takes priority over `rope_parameters`.
    A `rope_parameters` nested by layer type is accepted only if every layer type agrees.
    """
    for key in ("rope_scaling", "rope_parameters"):
        value = cfg.raw.get(key)
        if not value:
            continue
        if not isinstance(value, dict):
            raise cfg._bad(key, value, "a JSON object")
        nested = [v for v in value.values() if isinstance(v, dict)]
        if nested:
            if len(nested) != len(value) or any(v != nested[0] for v in nested[1:]):
                raise ModelLoadError(
                    f"per-layer-type '{key}' with differing RoPE settings is unsupported "
                    f"in {cfg.path}"
                )
            value = nested[0]
        return dict(value), key
    return {}, "rope_parameters"


def parse_rope(cfg: Fields, max_position_embeddings: int) -> RopeConfig:
    rope_dict, key = _select_rope_dict(cfg)
    rp = Fields(rope_dict, cfg.path, prefix=f"{key}.")
    rope_type = _rope_type(cfg, rope_dict, key)
    theta = _rope_theta(cfg, rp)
    partial = _rope_partial_factor(cfg, rp)
    original_max = _rope_original_max(cfg, rp, rope_type, max_position_embeddings)
    factor = _rope_factor(rp, rope_type, max_position_embeddings, original_max)
    low, high = _rope_llama3_freq_factors(rp, rope_type)
    truncate = rope_dict.get("truncate")
    if truncate is not None and not isinstance(truncate, bool):
        raise rp._bad("truncate", truncate, "true or false")
    is_yarn = rope_type == "yarn"
    return RopeConfig(
        rope_type=rope_type,
        theta=theta,
        factor=factor,
        original_max_position_embeddings=original_max,
        low_freq_factor=low,
        high_freq_factor=high,
        beta_fast=rp.get_float("beta_fast", None) if is_yarn else None,
        beta_slow=rp.get_float("beta_slow", None) if is_yarn else None,
        mscale=rp.get_float("mscale", None) if is_yarn else None,
        mscale_all_dim=rp.get_float("mscale_all_dim", None) if is_yarn else None,
        attention_factor=rp.get_float("attention_factor", None) if is_yarn else None,
        truncate=truncate if is_yarn else None,
        partial_rotary_factor=partial,
    )


def _rope_type(cfg: Fields, rope_dict: dict[str, Any], key: str) -> str:
    rope_type = rope_dict.get("rope_type") or rope_dict.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope type {rope_type!r} ('{key}') in {cfg.path}; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return rope_type


def _rope_theta(cfg: Fields, rp: Fields) -> float:
    # Priority as in transformers: rope dict, then top-level key, then the class default.
    theta = rp.get_float("rope_theta", None)
    if theta is None:
        theta = cfg.get_float("rope_theta", _DEFAULT_ROPE_THETA)
    if theta <= 0:
        raise rp._bad("rope_theta", theta, "a positive number")
    return theta


def _rope_partial_factor(cfg: Fields, rp: Fields) -> float:
    partial = rp.get_float("partial_rotary_factor", None)
    if partial is None:
        partial = cfg.get_float("partial_rotary_factor", 1.0)
    if not 0.0 < partial <= 1.0:
        raise rp._bad("partial_rotary_factor", partial, "in (0, 1]")
    return partial


def _rope_original_max(cfg: Fields, rp: Fields, rope_type: str,
                       max_position_embeddings: int) -> int | None:
    original_max: int | None = rp.get_int("original_max_position_embeddings", None)
    if rope_type in ("llama3", "yarn"):
        # transformers re-standardises at RoPE init, when a top-level
        # original_max_position_embeddings (Phi3 style) overrides the rope dict's value.
        original_max = cfg.get_int("original_max_position_embeddings", original_max)
        if original_max is None:
            original_max = max_position_embeddings
    return original_max


def _rope_factor(rp: Fields, rope_type: str, max_position_embeddings: int,
                 original_max: int | None) -> float:
    factor: float = 1.0
    if rope_type in ("linear", "dynamic", "llama3"):
        factor = rp.get_float("factor")
    elif rope_type == "yarn":
        factor = rp.get_float("factor", None)
        if factor is None:
            assert original_max is not None
            factor = max_position_embeddings / original_max
    if rope_type != "default" and factor <= 0:
        raise rp._bad("factor", factor, "a positive number")
    return factor


def _rope_llama3_freq_factors(rp: Fields, rope_type: str) -> tuple[float | None, float | None]:
    """llama3's (low_freq_factor, high_freq_factor); (None, None) for other rope types."""
    if rope_type != "llama3":
        return None, None
    low, high = rp.get_float("low_freq_factor"), rp.get_float("high_freq_factor")
    if low == high:
        raise rp._bad("high_freq_factor", high, "different from low_freq_factor")
    return low, high
