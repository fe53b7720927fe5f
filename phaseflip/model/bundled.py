"""The bundled real-shape model configs (`--model llama-3.1-8b`, ...): names → directories.

Kept apart from the dummy weights (`dummy.py`, which needs torch) because the command line
resolves `--model` before anything heavy is imported: `phaseflip serve` spawns its engine
process first thing (`server/engine_start.py`), and a torch import on the way there cost
~2 s of every start.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from phaseflip.errors import ModelLoadError

ASSETS = Path(__file__).resolve().parent.parent / "assets"
CONFIGS_DIR = ASSETS / "configs"
TOKENIZER_DIR = ASSETS / "tiny-llama"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def bundled_models() -> tuple[str, ...]:
    """Names accepted by `resolve_model_dir` (one per `assets/configs/<name>.json`)."""
    return tuple(sorted(p.stem for p in CONFIGS_DIR.glob("*.json")))


def default_cache_dir() -> Path:
    """Where bundled model directories are materialised: $PHASEFLIP_CACHE_DIR, else
    $XDG_CACHE_HOME/phaseflip, else ~/.cache/phaseflip."""
    explicit = os.environ.get("PHASEFLIP_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "phaseflip"


def write_atomic(path: Path, data: bytes) -> None:
    """Writes `data` unless the file already holds exactly it; atomic so that concurrent
    processes (TP ranks, parallel tests) never see a half-written config."""
    try:
        if path.read_bytes() == data:
            return
    except OSError:
        pass
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def generation_config_for(config: dict[str, Any]) -> dict[str, Any]:
    """A neutral generation_config.json: the ids only, so no sampling default (temperature,
    top_p) sneaks into benchmarks through the server's per-model defaults."""
    return {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
            if config.get(k) is not None}


def tokenizer_files(config: dict[str, Any], source: Path) -> dict[str, bytes]:
    """The tokenizer files to place beside a config, with `model_max_length` raised to the
    model's context so long token-id prompts do not trigger truncation warnings."""
    out: dict[str, bytes] = {}
    for name in TOKENIZER_FILES:
        path = source / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        if name == "tokenizer_config.json":
            tok_cfg = json.loads(data)
            tok_cfg["model_max_length"] = config.get("max_position_embeddings",
                                                     tok_cfg.get("model_max_length"))
            data = (json.dumps(tok_cfg, indent=2) + "\n").encode()
        out[name] = data
    return out


def resolve_model_dir(
    name_or_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """A bundled model name (see `bundled_models`, case-insensitive) → a directory with its
    config.json, a neutral generation_config.json and the tiny model's tokenizer, created
    under `cache_dir/dummy/<name>` (default `default_cache_dir()`); anything else → itself.

    An existing path always wins over a bundled name, so a local directory called
    `qwen3-8b` is used as is. The directory is rewritten when the bundled config changed.
    """
    path = Path(name_or_path)
    if path.exists():
        return path
    name = str(name_or_path).lower()
    src = CONFIGS_DIR / f"{name}.json"
    if name not in bundled_models():
        return path
    try:
        config = json.loads(src.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:  # a broken install, not a user error
        raise ModelLoadError(f"bundled config {src} is unreadable: {exc}") from exc
    out = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out = out / "dummy" / name
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "config.json": src.read_bytes(),
        "generation_config.json": (json.dumps(generation_config_for(config), indent=2)
                                   + "\n").encode(),
        **tokenizer_files(config, TOKENIZER_DIR),
    }
    for fname, data in files.items():
        write_atomic(out / fname, data)
    return out
