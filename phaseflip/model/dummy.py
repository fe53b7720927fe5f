"""Random ("dummy") weights and bundled real-shape model configs, for benchmarks without downloads.

Performance depends on shapes, not on weight values, and nothing can be downloaded on the
machines we benchmark on. So a few real configs (Llama-3.1-8B, Qwen3-8B, Llama-3.2-1B,
Qwen3-0.6B) ship hand-written in `phaseflip/assets/configs/`, and `--load-format dummy` fills
the model with seeded random values on its own device instead of reading a checkpoint.

Every random tensor is a *checkpoint* tensor (HF name and full, unsharded shape) drawn from a
generator seeded by (seed, tensor name), then handed to the model's own `load_weights`. Hence:

* the values do not depend on the parallel layout (a TP=2 or PP=2 model is the same model as
  TP=1, each rank keeping its slice), nor on which other tensors a stage skips;
* `write_random_checkpoint` streams the very same tensors to safetensors, so loading that
  checkpoint gives the same model as dummy init with the same seed (on the same device type:
  CPU and CUDA generators draw different numbers);
* `load_weights` checks that every parameter was provided, so a dummy model is complete.

Bundled models reuse the tiny model's tokenizer (vocab 4096): prompts given as token ids may use
the model's whole vocabulary, but text in or out of such a model is meaningless — ids above
4095 decode to nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from phaseflip.errors import ModelLoadError
from phaseflip.model.bundled import (
    TOKENIZER_DIR,
    TOKENIZER_FILES,
    generation_config_for,
    resolve_model_dir,
    tokenizer_files,
)
from phaseflip.model.config import ModelConfig

INIT_STD = 0.02  # transformers' initializer_range for every bundled model

_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
}


# ---------------------------------------------------------------------------------------------
# Checkpoint tensor inventory (HF names, full shapes), computed from the config alone


def checkpoint_shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor a Hugging Face checkpoint of this config holds, with its full shape, in
    the order transformers writes them (embedding, layers, final norm, LM head)."""
    h, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv, d = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h))]
        if cfg.attention_bias:
            out += [(p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.bias", (kv,)),
                    (p + "self_attn.v_proj.bias", (kv,))]
        out.append((p + "self_attn.o_proj.weight", (h, q)))
        if cfg.o_proj_bias:
            out.append((p + "self_attn.o_proj.bias", (h,)))
        if cfg.qk_norm:
            out += [(p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,))]
        out += [(p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter)),
                (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    out.append(("model.norm.weight", (h,)))
    if not cfg.tie_word_embeddings:
        out.append(("lm_head.weight", (vocab, h)))
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def num_parameters(cfg: ModelConfig) -> int:
    """Parameter count from the config alone (tied embeddings counted once), as the model
    cards quote it: 8.03B for Llama-3.1-8B, 8.19B for Qwen3-8B."""
    return sum(_numel(shape) for _, shape in checkpoint_shapes(cfg))


# ---------------------------------------------------------------------------------------------
# Random tensors


def is_norm_weight(name: str) -> bool:
    """RMSNorm gains (layer norms, final norm, Qwen3 q/k norms): these start at one, as in
    transformers, so every layer sees unit-scale inputs and activations stay finite in bf16."""
    return name.endswith("norm.weight")


def tensor_seed(seed: int, name: str) -> int:
    """Generator seed of one tensor: depends on (seed, name) only, so a tensor's values do not
    depend on which other tensors are drawn, or in what order."""
    return (zlib.crc32(name.encode()) ^ (seed * 0x9E3779B97F4A7C15)) & ((1 << 63) - 1)


def random_tensor(
    name: str,
    shape: tuple[int, ...],
    seed: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """One checkpoint tensor: ones for norm gains, else N(0, INIT_STD²). Drawn in float32 and
    then cast, so float32 and bfloat16 models of one seed hold the same values up to rounding."""
    device = torch.device(device)
    if is_norm_weight(name):
        return torch.ones(shape, dtype=dtype, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(tensor_seed(seed, name))
    t = torch.empty(shape, dtype=torch.float32, device=device)
    t.normal_(0.0, INIT_STD, generator=gen)
    return t if dtype == torch.float32 else t.to(dtype)


def iter_random_checkpoint(
    cfg: ModelConfig,
    seed: int,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    names: set[str] | None = None,
    progress: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every checkpoint tensor of `cfg` (only those in `names` if given),
    one at a time, so at most one full tensor exists beside the model."""
    todo = [(n, s) for n, s in checkpoint_shapes(cfg) if names is None or n in names]
    for name, shape in tqdm(todo, desc="Random weights", unit="tensor", disable=not progress):
        yield name, random_tensor(name, shape, seed, device, dtype)


def _wanted_names(model: nn.Module, cfg: ModelConfig) -> set[str]:
    """Checkpoint names this model shard keeps, so a pipeline stage draws only its layers."""
    mapper = getattr(model, "_param_name", None)
    all_names = [n for n, _ in checkpoint_shapes(cfg)]
    if mapper is None:
        return set(all_names)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    wanted = set()
    for name in all_names:
        target = mapper(name)
        if target is not None and target[0] in params:
            wanted.add(name)
    return wanted


def init_dummy_weights(model: nn.Module, seed: int, *, progress: bool = False) -> None:
    """Fills every parameter of `model` in place, on its device, with seeded random values.

    A phaseflip model (one with `cfg` and `load_weights`) is fed full checkpoint tensors
    through its own loader, one tensor at a time on the parameters' device: no second copy of
    the model is ever made, the layout slices each tensor as it would a real checkpoint, and
    the loader's completeness check proves every parameter was set. Any other module is
    filled parameter by parameter (ones for norm gains, N(0, 0.02²) for the rest).
    """
    params = list(model.parameters())
    if not params:
        return
    device = params[0].device
    cfg = getattr(model, "cfg", None)
    load = getattr(model, "load_weights", None)
    with torch.no_grad():
        if isinstance(cfg, ModelConfig) and load is not None:
            load(iter_random_checkpoint(cfg, seed, device=device, names=_wanted_names(model, cfg),
                                        progress=progress))
        else:
            for name, param in model.named_parameters():
                param.data.copy_(random_tensor(name, tuple(param.shape), seed, param.device,
                                               param.dtype))
    if device.type == "cuda":
        # The float32 draws went through the caching allocator; give them back so the KV
        # pool, sized from the driver's free memory, is not short by the largest tensor.
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Random checkpoints on disk


def _shard_plan(
    shapes: list[tuple[str, tuple[int, ...]]], itemsize: int, shard_bytes: int
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Greedy split in checkpoint order; a tensor larger than a shard gets a shard alone."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = _numel(shape) * itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def _safetensors_header(
    tensors: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype
) -> bytes:
    """The 8-byte length + JSON header of a safetensors file, computed before any data exists,
    which is what lets the data be streamed tensor by tensor."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        nbytes = _numel(shape) * itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def write_random_checkpoint(
    model: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    shard_gb: float = 5.0,
    seed: int = 0,
    progress: bool = True,
    device: torch.device | str = "cpu",
) -> Path:
    """Writes a random-weight Hugging Face checkpoint of `model` (bundled name or a directory
    with config.json) to `out`: safetensors shards (+ index when more than one), config.json
    (dtype set to `dtype`), generation_config.json and tokenizer files.

    Tensors are drawn on `device` and written one at a time (memory: the largest tensor, not
    the model). Drawn on the CPU, the values equal `init_dummy_weights(model, seed)` on a CPU
    model; on a GPU (an 8B checkpoint in seconds, not minutes) they are another draw of the
    same distribution, each GPU model's generator its own.
    """
    src = resolve_model_dir(model)
    cfg = ModelConfig.from_dir(src)
    dtype = dtype or cfg.dtype
    if dtype not in _SAFETENSORS_DTYPES:
        raise ModelLoadError(f"cannot write {dtype} checkpoints; use float32/float16/bfloat16")
    out_dir = Path(out)
    _write_checkpoint_metadata(src, out_dir, dtype)
    shapes = checkpoint_shapes(cfg)
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards = _shard_plan(shapes, itemsize, max(1, int(shard_gb * 1e9)))
    total = sum(_numel(s) for _, s in shapes) * itemsize
    names = _shard_file_names(len(shards))
    weight_map: dict[str, str] = {}
    with tqdm(total=total, desc="Writing checkpoint", unit="B", unit_scale=True,
              disable=not progress) as bar:
        for fname, shard in zip(names, shards):
            _write_shard(out_dir, fname, shard, seed, device, dtype, bar)
            weight_map.update((name, fname) for name, _ in shard)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out_dir


def _write_checkpoint_metadata(src: Path, out_dir: Path, dtype: torch.dtype) -> None:
    """Creates `out_dir` without stale shards, and writes config.json (dtype set to `dtype`),
    generation_config.json and the tokenizer files."""
    raw_cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
    dtype_name = str(dtype).removeprefix("torch.")
    raw_cfg["torch_dtype"] = dtype_name  # transformers 4.x
    raw_cfg["dtype"] = dtype_name  # transformers 5.x
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*out_dir.glob("*.safetensors"), out_dir / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)  # a shard left from a run with another --shard-gb
    (out_dir / "config.json").write_text(json.dumps(raw_cfg, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(
        json.dumps(generation_config_for(raw_cfg), indent=2) + "\n")
    tok_src = src if (src / "tokenizer.json").is_file() else TOKENIZER_DIR
    for fname, data in tokenizer_files(raw_cfg, tok_src).items():
        (out_dir / fname).write_bytes(data)


def _shard_file_names(num_shards: int) -> list[str]:
    if num_shards == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]


def _write_shard(out_dir: Path, fname: str, shard: list[tuple[str, tuple[int, ...]]],
                 seed: int, device: torch.device | str, dtype: torch.dtype, bar: tqdm) -> None:
    """Streams one shard's tensors to a hidden partial file, renamed into place when complete
    so that an interrupted run never leaves a truncated shard under its real name."""
    tmp = out_dir / f".{fname}.partial"
    itemsize = torch.empty((), dtype=dtype).element_size()
    with open(tmp, "wb") as f:
        f.write(_safetensors_header(shard, dtype))
        for name, shape in shard:
            t = random_tensor(name, shape, seed, device, dtype).contiguous().cpu()
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)
            bar.update(t.numel() * itemsize)
    os.replace(tmp, out_dir / fname)


def copy_tokenizer(dst: str | os.PathLike[str]) -> None:
    """Copies the tiny model's tokenizer files into `dst` (for hand-made model directories)."""
    for name in TOKENIZER_FILES:
        if (TOKENIZER_DIR / name).is_file():
            shutil.copyfile(TOKENIZER_DIR / name, Path(dst) / name)
