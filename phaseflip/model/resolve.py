"""Where a model lives: `--model` as people give it (a directory, a bundled shape name, ORG/NAME
in the local Hugging Face cache, with --tokenizer / --chat-template overlays) turned into one
directory the loader reads."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from phaseflip.config import EngineConfig
from phaseflip.errors import ModelLoadError
from phaseflip.model import loader
from phaseflip.model.bundled import resolve_model_dir


def resolve_model(cfg: EngineConfig) -> EngineConfig:
    """The config with `model` turned into a directory: bundled shape names → their dir,
    ORG/NAME → its snapshot in the local Hugging Face cache, and with --tokenizer or
    --chat-template a directory that reads as the model with those (ModelLoadError on a miss)."""
    if loader.is_overlay(cfg.model):  # resolved already
        return cfg
    model = Path(cfg.model)
    if not model.is_dir():
        model = resolve_model_dir(cfg.model)
        if not model.is_dir():
            model = loader.resolve_model_path(cfg.model, cfg.revision)
    if cfg.load_format != "dummy":
        loader.check_remote_code(model, cfg.trust_remote_code)
    if cfg.tokenizer is not None or cfg.chat_template is not None:
        tokenizer = cfg.tokenizer and _tokenizer_dir(cfg.tokenizer)
        model = loader.overlay_model_dir(model, tokenizer, cfg.chat_template)
    return cfg if str(model) == cfg.model else replace(cfg, model=str(model))


def _tokenizer_dir(tokenizer: str) -> Path:
    """--tokenizer's directory; its ModelLoadError names the flag (the loader's own message
    speaks of a model directory, which read as --model's)."""
    try:
        return loader.resolve_model_path(tokenizer, None)
    except ModelLoadError as e:
        raise ModelLoadError(f"--tokenizer {tokenizer}: {e}") from None
