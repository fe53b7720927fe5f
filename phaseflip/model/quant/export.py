"""Writes FP8 checkpoints in the formats people download, from a float checkpoint: what the
tests load (no download) and a way to try a format locally.

`write_fp8_checkpoint(src, out, fmt)` with fmt:
* "compressed-tensors-channel" / "compressed-tensors-tensor": `weight` F8_E4M3 and
  `weight_scale` ([out, 1] per channel, [1] per tensor), config `quant_method:
  compressed-tensors`, `ignore: [lm_head]`;
* "block": `weight` F8_E4M3 and `weight_scale_inv` per `block` tile, config `quant_method: fp8,
  weight_block_size` (the Qwen3 / DeepSeek FP8 layout).
Everything but the decoder projections is copied as is.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from phaseflip.model.loader import iter_checkpoint_tensors
from phaseflip.model.quant.checkpoint import _PROJ
from phaseflip.model.quant.fp8 import quantize_blocks, quantize_per_tensor, quantize_rows

FORMATS = ("compressed-tensors-channel", "compressed-tensors-tensor", "block")


def _quantization_config(fmt: str, block: tuple[int, int]) -> dict:
    if fmt == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block)}
    strategy = fmt.rsplit("-", 1)[1]
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "ignore": ["lm_head"], "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                            "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                      "symmetric": True, "dynamic": True}}}}


def _quantized(name: str, t: torch.Tensor, fmt: str, block: tuple[int, int]
               ) -> dict[str, torch.Tensor]:
    m = _PROJ.match(name)
    if m is None or m["kind"] != "weight":
        return {name: t.contiguous()}
    prefix = m["prefix"]
    if fmt == "block":
        q, s = quantize_blocks(t, block)
        return {name: q, f"{prefix}.weight_scale_inv": s}
    if fmt == "compressed-tensors-tensor":
        q, s = quantize_per_tensor(t)
        return {name: q, f"{prefix}.weight_scale": s.reshape(1)}
    q, s = quantize_rows(t)
    return {name: q, f"{prefix}.weight_scale": s.reshape(-1, 1).to(torch.bfloat16)}


def write_fp8_checkpoint(src: str | Path, out: str | Path, fmt: str,
                         block: tuple[int, int] = (128, 128)) -> Path:
    """A copy of the model directory `src` whose projections are FP8 in format `fmt`."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: expected one of {', '.join(FORMATS)}")
    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json" and (
                not f.name.endswith(".index.json")):
            shutil.copyfile(f, out / f.name)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in iter_checkpoint_tensors(src, progress=False):
        tensors.update(_quantized(name, t, fmt, block))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((src / "config.json").read_text(encoding="utf-8"))
    raw["quantization_config"] = _quantization_config(fmt, block)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return out
