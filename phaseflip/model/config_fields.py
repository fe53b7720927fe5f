"""Typed reads of a checkpoint's JSON files (config.json, generation_config.json): every
error a `ModelLoadError` that names the key and the file."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from phaseflip.errors import ModelLoadError

REQUIRED: Any = object()  # sentinel: the key has no default and must be present


def read_json(path: str, what: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{what} is not valid JSON ({exc}): {path}") from exc
    except UnicodeDecodeError as exc:
        raise ModelLoadError(f"{what} is not UTF-8 text: {path}") from exc
    except OSError as exc:
        raise ModelLoadError(f"cannot read {what} ({exc.strerror}): {path}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{what} must hold a JSON object, got {type(data).__name__}: {path}")
    return data


class Fields:
    """Typed access to one JSON object, with errors that name the key and the file."""

    def __init__(self, raw: Mapping[str, Any], path: str, prefix: str = "") -> None:
        self.raw = raw
        self.path = path
        self.prefix = prefix

    def _missing(self, key: str) -> ModelLoadError:
        return ModelLoadError(f"required field '{self.prefix}{key}' is missing in {self.path}")

    def _bad(self, key: str, value: Any, expected: str) -> ModelLoadError:
        return ModelLoadError(
            f"field '{self.prefix}{key}' must be {expected}, got {value!r} in {self.path}"
        )

    def get(self, key: str, default: Any = None) -> Any:
        """Raw value; an explicit JSON null counts as absent."""
        value = self.raw.get(key)
        return default if value is None else value

    def get_int(self, key: str, default: Any = REQUIRED, *, positive: bool = True) -> Any:
        value = self.raw.get(key)
        if value is None:
            if default is REQUIRED:
                raise self._missing(key)
            return default
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(key, value, "an integer")
        if positive and value <= 0:
            raise self._bad(key, value, "a positive integer")
        return value

    def get_float(self, key: str, default: Any = REQUIRED) -> Any:
        value = self.raw.get(key)
        if value is None:
            if default is REQUIRED:
                raise self._missing(key)
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._bad(key, value, "a number")
        if not math.isfinite(value):
            raise self._bad(key, value, "a finite number")
        return float(value)

    def get_bool(self, key: str, default: bool) -> bool:
        value = self.raw.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._bad(key, value, "true or false")
        return value

    def token_ids(self, key: str, default: int | None) -> tuple[int, ...]:
        """An id field that may be an int or a list of ints (eos_token_id)."""
        value = self.raw[key] if key in self.raw else default
        if value is None:
            return ()
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, bool) or not isinstance(item, int) or item < 0:
                raise self._bad(key, value, "a token id or a list of token ids")
        return tuple(items)

    def token_id(self, key: str, default: int | None) -> int | None:
        value = self.raw[key] if key in self.raw else default
        if value is None:
            return None
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self._bad(key, value, "a token id")
        return value
