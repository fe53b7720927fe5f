"""FP8 weights: numerics (`fp8`), checkpoint formats (`checkpoint`) and writing FP8 checkpoints
from float ones (`export`, for tests and for users without a download). docs/quantization.md."""

from phaseflip.model.quant.checkpoint import (
    QUANTIZATION_METHODS,
    Fp8Config,
    convert_checkpoint,
    engine_quantization,
    resolve_quantization,
)
from phaseflip.model.quant.fp8 import FP8_DTYPE, scaled_linear

__all__ = ["FP8_DTYPE", "QUANTIZATION_METHODS", "Fp8Config", "convert_checkpoint",
           "engine_quantization", "resolve_quantization", "scaled_linear"]
