"""phaseflip: an LLM inference engine that flips between TP and PP layouts at runtime."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from phaseflip.versions import __version__ as __version__

# Public names, imported on first use: `phaseflip --help` and `--version` need none of them
# (importing torch and transformers takes seconds).
_EXPORTS = {
    "EngineConfig": "phaseflip.config",
    "Engine": "phaseflip.engine.engine",
    "CompletionOutput": "phaseflip.engine.outputs",
    "RequestOutput": "phaseflip.engine.outputs",
    "StreamDelta": "phaseflip.engine.outputs",
    "Usage": "phaseflip.engine.outputs",
    "CapacityError": "phaseflip.errors",
    "ContextLengthError": "phaseflip.errors",
    "InvalidRequestError": "phaseflip.errors",
    "ModelLoadError": "phaseflip.errors",
    "PhaseflipError": "phaseflip.errors",
    "SamplingParams": "phaseflip.sampling.params",
}
__all__ = [
    "CapacityError",
    "CompletionOutput",
    "ContextLengthError",
    "Engine",
    "EngineConfig",
    "InvalidRequestError",
    "ModelLoadError",
    "PhaseflipError",
    "RequestOutput",
    "SamplingParams",
    "StreamDelta",
    "Usage",
]

if TYPE_CHECKING:
    from phaseflip.config import EngineConfig
    from phaseflip.engine.engine import Engine
    from phaseflip.engine.outputs import CompletionOutput, RequestOutput, StreamDelta, Usage
    from phaseflip.errors import (
        CapacityError,
        ContextLengthError,
        InvalidRequestError,
        ModelLoadError,
        PhaseflipError,
    )
    from phaseflip.sampling.params import SamplingParams


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'phaseflip' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
