"""phaseflip: an LLM inference engine that flips between TP and PP layouts at runtime."""

__version__ = "0.1.0"

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
