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
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from phaseflip.errors import ModelLoadError

if TYPE_CHECKING:
    import torch
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


def read_checkpoint_tensors(model_dir: str | os.PathLike[str], names: set[str]
                            ) -> dict[str, torch.Tensor]:
    """The tensors of `names` the checkpoint holds (others are absent from the result), read
    without the rest: for a few small tensors, such as KV cache scales."""
    out: dict[str, torch.Tensor] = {}
    for plan in _plan(model_dir):
        wanted = [n for n in plan.names if n in names]
        if not wanted:
            continue
        try:
            with safe_open(str(plan.path), framework="pt", device="cpu") as f:
                out.update({n: f.get_tensor(n) for n in wanted})
        except SafetensorError as exc:
            raise ModelLoadError(f"cannot read safetensors file ({exc}): {plan.path}") from exc
    return out


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
    # tqdm's own switch, which an explicit `disable=` would override: `phaseflip serve
    # --log-level warning` (or quieter) sets it for the engine and its ranks
    quiet = not progress or os.environ.get("TQDM_DISABLE", "").lower() in ("1", "true", "yes")
    with tqdm(total=total, desc=desc, unit="tensor", disable=quiet) as bar:
        for plan in plans:
            try:
                with safe_open(str(plan.path), framework="pt", device="cpu") as f:
                    for name in plan.names:
                        tensor = f.get_tensor(name)
                        bar.update(1)
                        yield name, tensor
            except SafetensorError as exc:
                raise ModelLoadError(f"cannot read safetensors file ({exc}): {plan.path}") from exc


def tokenizer_dir(model_dir: str | os.PathLike[str]) -> Path:
    """`model_dir` as a directory with tokenizer files in it, else a ModelLoadError: the
    cheap part of `load_tokenizer`, for a server to check before it starts its engine."""
    directory = _model_dir(model_dir)
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelLoadError(
            f"no tokenizer files in {directory} (looked for {', '.join(_TOKENIZER_FILES)})"
        )
    return directory


def load_tokenizer(model_dir: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """AutoTokenizer.from_pretrained(model_dir), offline, with a ModelLoadError when the
    directory has no tokenizer or transformers cannot load it."""
    directory = tokenizer_dir(model_dir)
    from transformers import AutoTokenizer  # deferred: importing transformers is slow

    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # transformers raises OSError/ValueError/KeyError/... variously
        raise ModelLoadError(f"cannot load the tokenizer in {directory}: {exc}") from exc


# ---------------------------------------------------------------- models named the hub's way
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_COMMIT = re.compile(r"[0-9a-f]{40}")
# Files that make up a tokenizer; `--tokenizer DIR` replaces the model's with DIR's.
_TOKENIZER_SET = (*_TOKENIZER_FILES, "special_tokens_map.json", "added_tokens.json",
                  "merges.txt", "chat_template.jinja", "chat_template.json")
OVERLAY_MARKER = "phaseflip-overlay.json"


def looks_like_repo_id(name: str) -> bool:
    """`ORG/NAME` (a Hugging Face repository id), as opposed to a path."""
    return bool(_REPO_ID.fullmatch(name)) and not name.startswith((".", "/", "~"))


def hub_cache_dir() -> Path:
    """The local Hugging Face hub cache, as huggingface_hub finds it: $HF_HUB_CACHE, else
    $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "huggingface" / "hub"


def resolve_hub_model(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot directory of `repo_id` at `revision` (a branch, tag or commit; default
    main) in the local Hugging Face cache. Never downloads: a miss is a ModelLoadError that
    says how to fetch the model."""
    cache = hub_cache_dir()
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    rev = revision or "main"
    commit = None
    ref = repo / "refs" / rev
    if ref.is_file():
        commit = ref.read_text().strip()
    elif _COMMIT.fullmatch(rev):
        commit = rev
    snapshot = repo / "snapshots" / commit if commit else None
    if snapshot is None or not (snapshot / "config.json").is_file():
        at = f" at revision {rev!r}" if revision else ""
        found = ""
        if (repo / "snapshots").is_dir():
            refs = sorted(p.name for p in (repo / "refs").glob("*"))
            found = f" (the cache holds it at {', '.join(refs) or 'other commits'})"
        raise ModelLoadError(
            f"model {repo_id!r}{at} is not a directory and not in the local Hugging Face cache "
            f"{cache}{found}. phaseflip never downloads at run time, and this machine may be "
            f"offline: fetch it where there is network (`hf download {repo_id}"
            f"{' --revision ' + revision if revision else ''}`, or `huggingface-cli download`), "
            "then copy the cache here (or set HF_HUB_CACHE / HF_HOME to it), or pass the "
            "model's directory to --model")
    return snapshot


def hub_repo_id(model_dir: str | os.PathLike[str]) -> str | None:
    """ORG/NAME where `model_dir` is a snapshot in a local Hugging Face cache
    (`…/models--ORG--NAME/snapshots/REV`, as `resolve_hub_model` finds it), also under a
    --tokenizer / --chat-template overlay; None for any other directory. The cache's own
    path differs between hosts (HF_HOME, the user's home): the id is what names the model."""
    path = Path(model_dir)
    if is_overlay(path):
        try:
            path = Path(json.loads((path / OVERLAY_MARKER).read_text())["model"])
        except (OSError, ValueError, KeyError):
            return None
    repo = path.parent.parent.name
    if path.parent.name != "snapshots" or not repo.startswith("models--"):
        return None
    return repo.removeprefix("models--").replace("--", "/", 1)  # hub names hold no "--"


def resolve_model_path(name: str, revision: str | None = None) -> Path:
    """A directory as is; `ORG/NAME` from the local hub cache; otherwise a ModelLoadError."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if looks_like_repo_id(name) and not path.exists():
        return resolve_hub_model(name, revision)
    return _model_dir(path)  # names what is wrong with the path


def is_overlay(model_dir: str | os.PathLike[str]) -> bool:
    return (Path(model_dir) / OVERLAY_MARKER).is_file()


def overlay_model_dir(model_dir: Path, tokenizer_dir: Path | None = None,
                      chat_template: str | None = None) -> Path:
    """A directory that reads as `model_dir` with the tokenizer files of `tokenizer_dir`
    and/or the chat template `chat_template` (a file, or the template text) in place of the
    model's own: symbolic links to the model's files, made once per process in a temporary
    directory that ends in the model's name (the default served model name)."""
    import atexit
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="phaseflip-model-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    out = root / model_dir.name
    out.mkdir()
    replaced = set(_TOKENIZER_SET) if tokenizer_dir is not None else set()
    if chat_template is not None:
        replaced |= {"chat_template.jinja", "chat_template.json"}
    for src in model_dir.iterdir():
        if src.name not in replaced:
            (out / src.name).symlink_to(src.resolve())
    if tokenizer_dir is not None:
        names = [n for n in _TOKENIZER_SET if (tokenizer_dir / n).is_file()]
        if not any(n in _TOKENIZER_FILES for n in names):
            raise ModelLoadError(f"no tokenizer files in --tokenizer {tokenizer_dir} (looked "
                                 f"for {', '.join(_TOKENIZER_FILES)})")
        for n in names:
            (out / n).symlink_to((tokenizer_dir / n).resolve())
    if chat_template is not None:
        template = Path(chat_template).expanduser()
        text = template.read_text(encoding="utf-8") if template.is_file() else chat_template
        if "{" not in text:  # neither a file nor a Jinja template: most likely a typo'd path
            raise ModelLoadError(f"--chat-template {chat_template!r} is neither a file nor a "
                                 "Jinja template")
        (out / "chat_template.jinja").write_text(text, encoding="utf-8")
    (out / OVERLAY_MARKER).write_text(json.dumps({
        "model": str(model_dir), "tokenizer": tokenizer_dir and str(tokenizer_dir),
        "chat_template": chat_template}))
    return out


def check_remote_code(model_dir: Path, trust_remote_code: bool) -> None:
    """phaseflip runs its own implementation of each supported architecture and never a
    checkpoint's Python code: with --trust-remote-code a checkpoint that needs its own code
    (an `auto_map`, or an architecture phaseflip does not implement) is refused by name."""
    if not trust_remote_code:
        return
    from phaseflip.model.config import SUPPORTED_ARCHITECTURES

    try:
        raw = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # ModelConfig names what is wrong with config.json
    archs = [a for a in raw.get("architectures") or [] if isinstance(a, str)]
    if any(a in SUPPORTED_ARCHITECTURES for a in archs):
        return
    custom = " with its own code (auto_map in config.json)" if raw.get("auto_map") else ""
    raise ModelLoadError(
        f"--trust-remote-code: {model_dir} is architecture {', '.join(archs) or '(none)'}"
        f"{custom}, which phaseflip does not implement. phaseflip runs its own implementations "
        f"({', '.join(SUPPORTED_ARCHITECTURES)}) and never a checkpoint's code, so "
        "--trust-remote-code cannot add an architecture")


def with_tokenizer_eos(eos_ids: tuple[int, ...], tokenizer: PreTrainedTokenizerBase
                       ) -> tuple[int, ...]:
    """`eos_ids` (generation_config.json's, then config.json's) and the tokenizer's own
    `eos_token_id` where they lack it: vLLM and SGLang stop at it too, and a chat fine-tune
    often sets only the tokenizer's (ChatML's `<|im_end|>` over a base whose config says
    `</s>`), so without it generation runs on past the end of the turn."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return eos_ids if not isinstance(eos, int) or eos in eos_ids else (*eos_ids, eos)
