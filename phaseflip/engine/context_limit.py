"""The context an engine serves: --max-model-len, checked against the positions the model
was trained on (its rotary embedding's reach), before any rank starts or weight loads."""

from __future__ import annotations

import logging
import os

from phaseflip.config import ALLOW_LONG_MAX_MODEL_LEN_ENV, EngineConfig
from phaseflip.errors import InvalidRequestError
from phaseflip.model.config import ModelConfig

log = logging.getLogger(__name__)


def trained_positions(model_cfg: ModelConfig) -> int:
    """The positions the model's rotary embedding covers: its max_position_embeddings, times
    the factor of linear scaling; for yarn, the original positions times the factor (a
    checkpoint may leave max_position_embeddings at the original length and turn yarn on, as
    Qwen2.5 documents). Dynamic scaling is not multiplied (vLLM does): our rotary keeps the
    unscaled frequencies past max_position_embeddings, where transformers rescales them."""
    rope, limit = model_cfg.rope, model_cfg.max_position_embeddings
    if rope.rope_type == "linear":
        return int(limit * rope.factor)
    if rope.rope_type == "yarn" and rope.original_max_position_embeddings:
        return max(limit, int(rope.original_max_position_embeddings * rope.factor))
    return limit


def context_limit(cfg: EngineConfig, model_cfg: ModelConfig) -> int:
    """The context the engine serves (`EngineConfig.context_len`). A --max-model-len past the
    model's trained positions would run rotary positions it never saw, silently worse, so it
    is refused, as vLLM does, unless ALLOW_LONG_MAX_MODEL_LEN_ENV=1 says to serve it anyway."""
    limit, positions = trained_positions(model_cfg), model_cfg.max_position_embeddings
    if cfg.max_model_len is None or cfg.max_model_len <= limit:
        return cfg.context_len(positions)
    if os.environ.get(ALLOW_LONG_MAX_MODEL_LEN_ENV) != "1":
        source = ("max_position_embeddings" if limit == positions else
                  f"max_position_embeddings {positions} with its {model_cfg.rope.rope_type} "
                  f"rope factor {model_cfg.rope.factor:g}")
        raise InvalidRequestError(
            f"--max-model-len {cfg.max_model_len} exceeds the model's context of {limit} "
            f"tokens ({source}): positions past it are ones the model was never trained on. "
            f"Lower --max-model-len or leave it unset; {ALLOW_LONG_MAX_MODEL_LEN_ENV}=1 in "
            "the environment serves it anyway", param="max_model_len")
    log.warning("--max-model-len %d exceeds the model's context of %d tokens (%s=1): "
                "outputs past it may be garbage", cfg.max_model_len, limit,
                ALLOW_LONG_MAX_MODEL_LEN_ENV)
    return cfg.max_model_len
