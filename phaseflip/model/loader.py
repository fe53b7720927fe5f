"""Reading checkpoint tensors and the tokenizer from a Hugging Face model directory.

Only safetensors is supported: it can be read lazily, tensor by tensor, without executing
pickled code, which lets each pipeline/tensor-parallel worker stream the checkpoint and keep only
its own shard. Every file's header is read (and the index cross-checked) before the first tensor
is yielded, so a broken checkpoint fails fast with a message naming the culprit instead of after
minutes of loading.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from phaseflip.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# A safetensors header is JSON describing offsets; anything this large is a corrupt length.
_MAX_HEADER_BYTES = 100 * 1024 * 1024

# Files whose presence means AutoTokenizer has something to load.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "tekken.json",
)


@dataclass(frozen=True)
class _FilePlan:
    """One safetensors file and the tensors to read from it, in on-disk order."""

    path: Path
    names: tuple[str, ...]


def _model_dir(model_dir: str | os.PathLike[str]) -> Path:
    path = Path(model_dir).absolute()
    if not path.exists():
        raise ModelLoadError(f"model directory does not exist: {path}")
    if not path.is_dir():
        raise ModelLoadError(f"model path is not a directory: {path}")
    return path


def _read_header(path: Path) -> dict[str, int]:
    """Tensor name -> data start offset, from the file's JSON header (no tensor data read)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ModelLoadError(f"safetensors file is truncated (no header): {path}")
            (length,) = struct.unpack("<Q", prefix)
            if length > min(size - 8, _MAX_HEADER_BYTES):
                raise ModelLoadError(
                    f"safetensors file has a corrupt header length ({length} bytes): {path}"
                )
            header = json.loads(f.read(length))
    except OSError as exc:
        raise ModelLoadError(f"cannot read safetensors file ({exc.strerror}): {path}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"safetensors file has a corrupt header ({exc}): {path}") from exc
    if not isinstance(header, dict):
        raise ModelLoadError(f"safetensors file has a corrupt header: {path}")
    offsets: dict[str, int] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            offsets[name] = int(info["data_offsets"][0])
        except (TypeError, KeyError, IndexError, ValueError) as exc:
            raise ModelLoadError(
                f"safetensors header entry for tensor '{name}' is malformed: {path}"
            ) from exc
    return offsets


def _plan_from_index(directory: Path, index_path: Path) -> list[_FilePlan]:
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{INDEX_FILE} is not valid JSON ({exc}): {index_path}") from exc
    except OSError as exc:
        raise ModelLoadError(f"cannot read {INDEX_FILE} ({exc.strerror}): {index_path}") from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ModelLoadError(
            f"{INDEX_FILE} has no valid 'weight_map' (tensor name -> shard file): {index_path}"
        )
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(name)

    plans = []
    for shard in sorted(by_shard):
        shard_path = directory / shard
        if not shard_path.is_file():
            raise ModelLoadError(
                f"checkpoint shard '{shard}' named in {INDEX_FILE} is missing: {shard_path}"
            )
        offsets = _read_header(shard_path)
        absent = sorted(n for n in by_shard[shard] if n not in offsets)
        if absent:
            more = f" (+{len(absent) - 5} more)" if len(absent) > 5 else ""
            shown = ", ".join(absent[:5]) + more
            raise ModelLoadError(
                f"checkpoint shard '{shard}' lacks {len(absent)} tensor(s) that {INDEX_FILE} "
                f"assigns to it: {shown}; in {directory}"
            )
        # The index is authoritative (as in transformers): stray tensors it does not list are
        # not loaded. Read in on-disk order so the page cache streams sequentially.
        names = tuple(sorted(by_shard[shard], key=offsets.__getitem__))
        plans.append(_FilePlan(shard_path, names))
    return plans


def _plan(model_dir: str | os.PathLike[str]) -> list[_FilePlan]:
    """Which tensors to read from which file, after validating every header involved."""
    directory = _model_dir(model_dir)
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        return _plan_from_index(directory, index_path)
    single = directory / SINGLE_FILE
    # Without an index transformers reads model.safetensors alone; other *.safetensors next to
    # it (e.g. Mistral's consolidated.safetensors, a different naming scheme) are ignored.
    files = [single] if single.is_file() else sorted(directory.glob("*.safetensors"))
    files = [f for f in files if f.is_file()]
    if not files:
        others = sorted(p.name for p in directory.glob("*.bin")) + sorted(
            p.name for p in directory.glob("*.pt")
        )
        found = f" (found {', '.join(others[:3])})" if others else ""
        raise ModelLoadError(
            f"no *.safetensors checkpoint in {directory}{found}; only the safetensors format "
            "is supported (convert pytorch_model.bin with transformers' save_pretrained)"
        )
    plans = []
    owner: dict[str, Path] = {}
    for path in files:
        offsets = _read_header(path)
        for name in offsets:
            if name in owner:
                raise ModelLoadError(
                    f"tensor '{name}' appears in both {owner[name].name} and {path.name} "
                    f"in {directory}"
                )
            owner[name] = path
        plans.append(_FilePlan(path, tuple(sorted(offsets, key=offsets.__getitem__))))
    return plans


def checkpoint_tensor_names(model_dir: str | os.PathLike[str]) -> set[str]:
    """Names of every tensor `iter_checkpoint_tensors` would yield (headers only, cheap)."""
    return {name for plan in _plan(model_dir) for name in plan.names}


def checkpoint_tensor_specs(
    model_dir: str | os.PathLike[str],
) -> list[tuple[str, str, list[int], int]]:
    """(name, safetensors dtype, shape, bytes) of every tensor `iter_checkpoint_tensors` would
    yield, in its order, from the files' headers (no tensor data read)."""
    specs = []
    for plan in _plan(model_dir):
        try:
            with safe_open(str(plan.path), framework="pt", device="cpu") as f:
                for name in plan.names:
                    s = f.get_slice(name)
                    shape, dtype = list(s.get_shape()), s.get_dtype()
                    specs.append((name, dtype, shape, _nbytes(dtype, shape)))
        except SafetensorError as exc:
            raise ModelLoadError(f"cannot read safetensors file ({exc}): {plan.path}") from exc
    return specs


def _nbytes(dtype: str, shape: list[int]) -> int:
    bits = {"F64": 64, "I64": 64, "U64": 64, "F32": 32, "I32": 32, "U32": 32, "F16": 16,
            "BF16": 16, "I16": 16, "U16": 16}.get(dtype, 8)
    n = 1
    for d in shape:
        n *= d
    return n * bits // 8


def iter_checkpoint_tensors(
    model_dir: str | os.PathLike[str],
    *,
    progress: bool = True,
    desc: str = "Loading weights",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) for every tensor of the directory's safetensors checkpoint.

    Uses model.safetensors.index.json when present (every shard it names must exist and hold
    every tensor it assigns to that shard), else model.safetensors, else every *.safetensors.
    Tensors are read lazily, one file open at a time, on CPU and in their stored dtype. The
    checkpoint is validated when this is called, before the first tensor is read.
    """
    plans = _plan(model_dir)
    return _iter_plans(plans, progress=progress, desc=desc)


def _iter_plans(
    plans: list[_FilePlan], *, progress: bool, desc: str
) -> Iterator[tuple[str, torch.Tensor]]:
    total = sum(len(p.names) for p in plans)
    with tqdm(total=total, desc=desc, unit="tensor", disable=not progress) as bar:
        for plan in plans:
            try:
                with safe_open(str(plan.path), framework="pt", device="cpu") as f:
                    for name in plan.names:
                        tensor = f.get_tensor(name)
                        bar.update(1)
                        yield name, tensor
            except SafetensorError as exc:
                raise ModelLoadError(f"cannot read safetensors file ({exc}): {plan.path}") from exc


def load_tokenizer(model_dir: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """AutoTokenizer.from_pretrained(model_dir), offline, with a ModelLoadError when the
    directory has no tokenizer or transformers cannot load it."""
    directory = _model_dir(model_dir)
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelLoadError(
            f"no tokenizer files in {directory} (looked for {', '.join(_TOKENIZER_FILES)})"
        )
    from transformers import AutoTokenizer  # deferred: importing transformers is slow

    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # transformers raises OSError/ValueError/KeyError/... variously
        raise ModelLoadError(f"cannot load the tokenizer in {directory}: {exc}") from exc
