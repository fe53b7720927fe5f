"""Which FP8 scheme a model runs, and the checkpoint tensors turned into the one form the
model's FP8 layers load.

The layers know one form only ("canonical"): for every projection of a decoder layer
(q/k/v/o/gate/up/down), `<proj>.weight` in `float8_e4m3fn` [out, in] and `<proj>.weight_scale`
in float32 [out], one scale per output channel. `convert_checkpoint` produces it from any of:

* a float checkpoint (fp32/fp16/bf16) with `--quantization fp8`: each weight is quantized per
  output channel at load, on the model's device;
* compressed-tensors FP8 (`quant_method: compressed-tensors`, weights `strategy` channel or
  tensor): the FP8 weight as is, the scale flattened ([out, 1] -> [out]) or, per tensor,
  repeated over the rows (per-row scales of a per-tensor weight are exact);
* block-wise FP8 (`quant_method: fp8` with `weight_block_size`, the official Qwen3 / DeepSeek
  layout: `weight_scale_inv` per 128 x 128 tile): dequantized to float32 and re-quantized per
  output channel. That costs one more FP8 rounding of the weight (measured in
  docs/quantization.md) and buys one GEMM path (row-wise `_scaled_mm`) for every format;
* `quant_method: fp8` without a block size (per-tensor `weight_scale`): as compressed-tensors'
  tensor strategy.

Static activation scales (`input_scale`) are dropped: activations are always quantized per token
at run time, which is at least as accurate. Embeddings, the LM head and norms stay in the model
dtype: an LM head stored in FP8 (a checkpoint that did not `ignore` it) is dequantized with
its scale to float32 here, never cast without it (`--fp8-lm-head` makes its own per-row FP8
copy from that weight). Every full tensor is converted BEFORE tensor-parallel slicing, so a
row-parallel layer's per-row scale covers the whole row and a TP group holds exactly one
process's numbers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from phaseflip.errors import ModelLoadError
from phaseflip.model.quant.fp8 import FP8_DTYPE, dequantize_blocks, quantize_rows

if TYPE_CHECKING:
    from phaseflip.config import EngineConfig

QUANTIZATION_METHODS = ("fp8",)
_PROJ = re.compile(r"^(?P<prefix>.*\.(?:q|k|v|o|gate|up|down)_proj)\."
                   r"(?P<kind>weight|weight_scale|weight_scale_inv|input_scale)$")
_HEAD = re.compile(r"^(?P<prefix>lm_head)\.(?P<kind>weight|weight_scale|weight_scale_inv|"
                   r"input_scale)$")


@dataclass(frozen=True)
class Fp8Config:
    """The FP8 weights scheme of one model. `source`: what the checkpoint holds ("float",
    "compressed-tensors", "fp8-block", "fp8-tensor"); `block`: the block-wise tile;
    `lm_head`: the LM head runs FP8 too (`--fp8-lm-head`: a per-row FP8 copy of its weight
    made at load, `lm_head.ParallelLMHead`)."""

    source: str = "float"
    block: tuple[int, int] | None = None
    lm_head: bool = False

    @property
    def prequantized(self) -> bool:
        return self.source != "float"


def _checkpoint_quantization(model_dir: str | Path) -> dict | None:
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # ModelConfig names what is wrong with config.json
    q = raw.get("quantization_config") if isinstance(raw, dict) else None
    return q if isinstance(q, dict) else None


def _prequantized(q: dict, model_dir: str | Path) -> Fp8Config:
    method = q.get("quant_method")
    if method == "compressed-tensors":
        groups = q.get("config_groups") or {}
        for group in groups.values():
            w = group.get("weights") or {}
            if not (w.get("type") == "float" and w.get("num_bits") == 8
                    and w.get("strategy") in ("channel", "tensor")):
                raise ModelLoadError(
                    f"{model_dir}: compressed-tensors weights {w} are not supported; phaseflip "
                    "loads FP8 (type float, 8 bits) with strategy channel or tensor")
        return Fp8Config("compressed-tensors")
    if method == "fp8":
        block = q.get("weight_block_size")
        if block is None:
            return Fp8Config("fp8-tensor")
        if not (isinstance(block, list) and len(block) == 2 and all(
                isinstance(b, int) and b > 0 for b in block)):
            raise ModelLoadError(f"{model_dir}: weight_block_size {block!r} is not [rows, cols]")
        return Fp8Config("fp8-block", (block[0], block[1]))
    raise ModelLoadError(
        f"{model_dir} is quantized with {method!r}, which phaseflip does not load; it loads "
        "float checkpoints (optionally --quantization fp8), compressed-tensors FP8 and "
        "block-wise FP8 (quant_method fp8)")


def resolve_quantization(quantization: str | None, model_dir: str | Path,
                         load_format: str = "auto", lm_head: bool = False
                         ) -> Fp8Config | None:
    """The scheme for `--quantization` and the checkpoint: a pre-quantized FP8 checkpoint runs
    FP8 whether or not the flag says so (its weights are FP8); a float one only with
    `--quantization fp8`. `lm_head` (`--fp8-lm-head`) needs FP8 weights. Raises
    ModelLoadError for quantization schemes not supported."""
    scheme = _resolve(quantization, model_dir, load_format)
    if lm_head and scheme is None:
        raise ModelLoadError("--fp8-lm-head runs the LM head in FP8 beside FP8 weights: add "
                             "--quantization fp8 (or load an FP8 checkpoint)")
    return replace(scheme, lm_head=True) if lm_head else scheme


def engine_quantization(cfg: EngineConfig, model_dir: str | Path) -> Fp8Config | None:
    """`resolve_quantization` for an engine's flags (`quantization`, `load_format`,
    `fp8_lm_head`): what every builder of the engine's models asks."""
    return resolve_quantization(cfg.quantization, model_dir, cfg.load_format, cfg.fp8_lm_head)


def _resolve(quantization: str | None, model_dir: str | Path,
             load_format: str) -> Fp8Config | None:
    q = None if load_format == "dummy" else _checkpoint_quantization(model_dir)
    if q is not None:
        return _prequantized(q, model_dir)
    if quantization is None:
        return None
    if quantization not in QUANTIZATION_METHODS:
        raise ModelLoadError(f"quantization {quantization!r} is not supported "
                             f"(expected one of {', '.join(QUANTIZATION_METHODS)})")
    return Fp8Config("float")


def _scale_rows(scale: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    s = scale.float().reshape(-1)
    if s.numel() == 1:
        return s.expand(rows).contiguous()
    if s.numel() != rows:
        raise ModelLoadError(f"{name}: {s.numel()} scales for {rows} output channels")
    return s


class _Pairing:
    """Holds one projection's FP8 weight until its scale arrives (or the other way round):
    checkpoints list them in either order, usually next to each other."""

    def __init__(self, cfg: Fp8Config) -> None:
        self.cfg = cfg
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, prefix: str, kind: str, t: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """The projection's weight and scale once both arrived, else None."""
        parts = self.pending.setdefault(prefix, {})
        parts[kind] = t
        if "weight" not in parts or not ({"weight_scale", "weight_scale_inv"} & parts.keys()):
            return None
        del self.pending[prefix]
        if "weight_scale_inv" in parts and self.cfg.block is None:
            raise ModelLoadError(f"{prefix}.weight_scale_inv without weight_block_size in "
                                 "the checkpoint's quantization_config")
        return parts

    def rows(self, prefix: str, parts: dict[str, torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(FP8 weight, per-row scales): block-wise weights re-quantized per row."""
        w = parts["weight"]
        if "weight_scale_inv" in parts:
            return quantize_rows(self.dense(prefix, parts))
        return w, _scale_rows(parts["weight_scale"], w.shape[0], prefix)

    def dense(self, prefix: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """The weight dequantized to float32."""
        w = parts["weight"]
        if "weight_scale_inv" in parts:
            return dequantize_blocks(w, parts["weight_scale_inv"], self.cfg.block)
        scale = parts["weight_scale"].float()
        if scale.numel() > 1:  # per row ([out] or [out, 1]); else one for the tensor
            scale = _scale_rows(scale, w.shape[0], prefix)[:, None]
        return w.float() * scale


def convert_checkpoint(weights: Iterable[tuple[str, torch.Tensor]], cfg: Fp8Config,
                       device: torch.device, keep: Callable[[str], bool] | None = None
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream in canonical form (module docstring). Float projection weights
    are quantized on `device`; `keep(name)` (the model's filter) skips tensors of other
    pipeline stages before any work. Raises ModelLoadError naming a weight left without its
    scale at the end."""
    pairing = _Pairing(cfg)
    for name, t in weights:
        m = _PROJ.match(name)
        head = _HEAD.match(name) if m is None else None
        if head is not None and head["kind"] == "weight" and t.dtype != FP8_DTYPE:
            head = None  # a float LM head: as is
        if m is None and head is None:
            yield name, t
            continue
        m = m or head
        if keep is not None and not keep(f"{m['prefix']}.weight"):
            continue
        prefix, kind = m["prefix"], m["kind"]
        if kind == "input_scale":
            continue
        if kind == "weight" and t.dtype != FP8_DTYPE:
            w_q, scale = quantize_rows(t.to(device))
        else:
            done = pairing.add(prefix, kind, t.to(device))
            if done is None:
                continue
            if head:  # the head stays 16-bit: dequantized with its scale, never cast bare
                yield f"{prefix}.weight", pairing.dense(prefix, done)
                continue
            w_q, scale = pairing.rows(prefix, done)
        yield f"{prefix}.weight", w_q
        yield f"{prefix}.weight_scale", scale
    if pairing.pending:
        left = ", ".join(sorted(pairing.pending)[:4])
        raise ModelLoadError(f"FP8 checkpoint: {len(pairing.pending)} projection(s) lack a "
                             f"weight or its scale: {left}")
